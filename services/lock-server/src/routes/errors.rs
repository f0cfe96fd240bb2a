//! The mapping of store answers to the contract's envelope.

use dlock_contract::error::{ApiError, ErrorCode};
use serde_json::json;

use crate::store::{Contention, StoreError};

/// Maps a store outcome to the contract's envelope.
pub(super) fn store_error(error: StoreError, key: Option<&str>) -> ApiError {
    match error {
        StoreError::SessionUnknown => ApiError::new(
            ErrorCode::SessionUnknown,
            "no such session for this owner; open a new session (its locks, if any, are gone)",
        ),
        StoreError::SessionExpired => ApiError::new(
            ErrorCode::SessionExpired,
            "the session's heartbeat lapsed and its locks were released; open a new session, re-acquire and re-read state",
        ),
        StoreError::LockLost { stored_token } => ApiError::new(
            ErrorCode::LockLost,
            "the grant has expired or was taken over; re-acquire, re-read state and use the new token",
        )
        .with_details(json!({ "key": key, "storedToken": stored_token })),
        StoreError::NotHeld => ApiError::not_found(format!(
            "{} is not held; there is nothing to revoke",
            key.unwrap_or("the key")
        )),
        StoreError::FencedOut {
            expected,
            stored,
            owner_id,
        } => revoke_fenced_out(expected, stored, owner_id, key),
        StoreError::QueueFull { waiter_count } => ApiError::new(
            ErrorCode::ContentionExceeded,
            "the key's waiter queue is full; back off for retryAfterMillis before trying again",
        )
        .with_details(json!({ "key": key, "waiterCount": waiter_count })),
        StoreError::SessionShareFull {
            waiter_count,
            share,
        } => ApiError::new(
            ErrorCode::ContentionExceeded,
            format!(
                "this session already waits for the key ({share} place(s) of its queue per \
                 session); wait for that acquire to end, or back off for retryAfterMillis"
            ),
        )
        .with_details(json!({
            "key": key,
            "waiterCount": waiter_count,
            "sessionWaitersMax": share,
        })),
        StoreError::NotLeader(reason) => {
            tracing::warn!(event = "backend_not_leader", %reason, "backend refused a write");
            ApiError::new(
                ErrorCode::NotLeader,
                "this replica's backend cannot take writes right now; nothing was changed, retry",
            )
        }
        StoreError::OutcomeUnknown(reason) => {
            tracing::warn!(event = "backend_outcome_unknown", %reason, "a write reached the backend and its answer never came");
            let error = ApiError::new(
                ErrorCode::OutcomeUnknown,
                "the write was sent to the backend and its answer never came: it may or may not \
                 have taken effect. Do not resend it blindly: read the key (GET /v1/locks/{key}) \
                 or the session first and act on what it shows",
            );
            match key {
                Some(key) => error.with_details(json!({ "key": key })),
                None => error,
            }
        }
        // Retry-safe: the grant was withdrawn before it was answered (docs/design.md#d-12-etcd).
        StoreError::RevisionBehind {
            revision,
            high_water,
        } => ApiError::new(
            ErrorCode::NotLeader,
            format!(
                "etcd's revision went back below the tokens already issued (etcd is at revision \
                 {revision}, tokens up to {high_water} were issued): nothing was granted. Restore \
                 etcd with `etcdutl snapshot restore --bump-revision` past {high_water}, or write \
                 to etcd until its revision passes {high_water}; acquires succeed again after \
                 that (docs/runbook.md#etcd-restored-from-a-backup)"
            ),
        )
        .with_retry_after_ms(5_000)
        .with_details(json!({ "key": key, "etcdRevision": revision, "highWater": high_water })),
        StoreError::Backend(reason) => ApiError::internal(reason),
    }
}

/// L8's expectedToken was not the live grant's.
fn revoke_fenced_out(expected: i64, stored: i64, owner_id: String, key: Option<&str>) -> ApiError {
    ApiError::fenced_out(
        "expectedToken is not the live grant's token; read the lock again before revoking",
        &dlock_contract::error::FencedOutDetails {
            presented_token: expected,
            highest_token: stored,
            resource_type: None,
            resource_id: key.unwrap_or_default().to_owned(),
            owner_id,
        },
    )
}

pub(super) fn contended(key: &str, c: Contention) -> ApiError {
    let retry_after = c
        .expires_at
        .map(|t| (t - chrono::Utc::now()).num_milliseconds())
        .unwrap_or(0)
        .clamp(1, 1_000) as u64;
    ApiError::new(
        ErrorCode::LockContended,
        "the lock is held by another grant; retry after a bounded, jittered backoff",
    )
    .with_retry_after_ms(retry_after)
    .with_details(json!({
        "key": key,
        "holderOwnerId": c.holder_owner_id,
        "expiresAt": c.expires_at.map(|t| dlock_contract::time::format(&t)),
        "waiterCount": c.waiter_count,
    }))
}
