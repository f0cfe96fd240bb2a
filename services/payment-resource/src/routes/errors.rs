//! The answers a handler gives when the store says no: paydb unavailable or busy, a refused
//! write on a payout (FENCED_OUT, not claimable, not found), a missing account.

use dlock_contract::error::{ApiError, ErrorCode};
use serde_json::json;
use uuid::Uuid;

use super::AppState;
use super::checks::WriteHeaders;
use crate::metrics::Resource;
use crate::store::{Refusal, StoreError};

pub(super) fn store_error(error: StoreError) -> ApiError {
    match error {
        StoreError::NotLeader(reason) => {
            tracing::warn!(event = "backend_not_leader", %reason, "paydb refused a write");
            ApiError::new(
                ErrorCode::NotLeader,
                "paydb cannot take writes right now; nothing was changed, retry",
            )
        }
        StoreError::RecoveryRequired(reason) => {
            tracing::error!(
                event = "paydb_recovery_required",
                %reason,
                "paydb's epoch guard refused a write: paydb may have lost writes in a failover and \
                 takes none until an operator reconciles (dlock reconcile) and runs dlock recover \
                 paydb-epoch (docs/runbook.md)"
            );
            ApiError::new(
                ErrorCode::RecoveryRequired,
                "paydb refuses every write after a failover that may have lost writes; nothing \
                 was changed. An operator must run dlock reconcile, then dlock recover \
                 paydb-epoch; retry after that",
            )
        }
        // Not NOT_LEADER: paydb is fine, the caller's own identical request holds the record.
        // The contract has no in-progress code; CONTENTION_EXCEEDED (429) is its answer to a
        // caller whose own retry came too soon: retry-safe, but only after retryAfterMillis
        // (docs/contract.md#idempotency-rules).
        StoreError::InProgress => ApiError::new(
            ErrorCode::ContentionExceeded,
            "an identical request (same key, token and body) is still in progress; this one changed nothing, retry after retryAfterMillis to get its answer",
        ),
        StoreError::Backend(reason) => ApiError::internal(reason),
        StoreError::LimitExceeded { message, details } => {
            tracing::warn!(event = "limit_exceeded", %message, "an account limit refused a payout");
            let error = ApiError::new(
                ErrorCode::LimitExceeded,
                format!(
                    "{message}; nothing was changed. The treasury sets the account's limits \
                     (POST /v1/accounts/{{accountId}}/limits)"
                ),
            );
            match details {
                Some(details) => error.with_details(details),
                None => error,
            }
        }
    }
}

/// A write on a payout, as its refusal names it.
pub(super) struct PayoutWrite<'a> {
    /// The fence the write is checked against: the account's, or the ledger's (which a
    /// refusal names by the payout).
    pub(super) resource: Resource,
    pub(super) payout_id: Uuid,
    pub(super) token: i64,
    /// The state the write needs the payout in.
    pub(super) wanted: &'a str,
    pub(super) write: &'a WriteHeaders,
}

/// The answer to a write on a payout that paydb refused: FENCED_OUT, PAYOUT_NOT_CLAIMABLE or
/// NOT_FOUND.
pub(super) fn refused(state: &AppState, refusal: Refusal, on: &PayoutWrite<'_>) -> ApiError {
    match refusal {
        Refusal::FencedOut { account_id, fence } => {
            let resource_id = match on.resource {
                Resource::ledger => on.payout_id.to_string(),
                _ => account_id,
            };
            fenced_out(state, on, &resource_id, fence)
        }
        Refusal::NotClaimable { state } => not_claimable(on.payout_id, state.as_deref(), on.wanted),
        Refusal::NotFound => payout_not_found(on.payout_id),
    }
}

/// The 409 FENCED_OUT body is a contract (docs/contract.md#fenced-out-details): both tokens, the
/// resource and the owner, enough to alert on without a database query. Also the log event and
/// the counter.
fn fenced_out(state: &AppState, on: &PayoutWrite<'_>, resource_id: &str, highest: i64) -> ApiError {
    state.metrics.fenced_out(on.resource);
    tracing::warn!(
        event = "fenced_out",
        resource = on.resource.as_str(),
        resource_id = %resource_id,
        payout_id = %on.payout_id,
        idempotency_key = %on.write.key,
        owner = %on.write.owner_id,
        presented_token = on.token,
        highest_token = highest,
        trace = %dlock_contract::trace::current_trace_id(),
        "a write presented a token below the stored fence: a newer holder exists"
    );
    ApiError::fenced_out(
        "a newer holder's token is stored for this resource; abort the whole critical section, do not retry",
        &dlock_contract::error::FencedOutDetails {
            presented_token: on.token,
            highest_token: highest,
            resource_type: Some(on.resource.as_str().to_owned()),
            resource_id: resource_id.to_owned(),
            owner_id: on.write.owner_id.clone(),
        },
    )
}

pub(super) fn not_claimable(payout_id: Uuid, state: Option<&str>, wanted: &str) -> ApiError {
    ApiError::new(
        ErrorCode::PayoutNotClaimable,
        format!(
            "payout {payout_id} is {} and this write needs it {wanted}; retrying changes nothing",
            state.unwrap_or("in another state")
        ),
    )
    .with_details(json!({ "payoutId": payout_id, "state": state, "requiredState": wanted }))
}

pub(super) fn payout_not_found(payout_id: Uuid) -> ApiError {
    ApiError::not_found(format!("payout {payout_id} does not exist"))
}

pub(super) fn account_not_found(account_id: &str) -> ApiError {
    ApiError::not_found(format!("account {account_id} does not exist"))
}

pub(super) fn missing(what: &str) -> ApiError {
    ApiError::internal(format!("paydb returned no {what}"))
}
