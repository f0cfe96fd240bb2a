//! L5 renew, L6 release, L7 lock info and the held-locks list.

use axum::body::Bytes;
use axum::extract::rejection::QueryRejection;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use dlock_contract::error::{ApiError, ErrorBody, ErrorCode, FieldError};
use dlock_contract::headers;
use dlock_contract::json::{Json, parse_body};
use dlock_contract::lock::*;
use dlock_server::auth::Caller;
use dlock_server::extract::PathWrite;
use dlock_server::openapi::{Invalid, InvalidToken, NotLeader, Unauthorized};
use serde::Deserialize;

use super::AppState;
use super::checks::{Checks, lock_ttl, path_key, path_session, present, strict_query};
use super::errors::store_error;
use crate::openapi::SessionGone;
use crate::store::{Claim, Renewal, StoreError};

/// L5: renew a grant; the token never changes.
///
/// Only the session that holds the grant, under the grant's owner, may renew it: the answer
/// carries the grant's proof.
#[utoipa::path(post, path = "/v1/locks/{key}/renew", request_body = RenewRequest,
    params(("key" = String, Path), ("X-Owner-Id" = String, Header), ("X-Fencing-Token" = String, Header, description = "decimal int64 > 0")),
    responses((status = 200, body = LockGrant), InvalidToken, Unauthorized, SessionGone, NotLeader,
        (status = 403, description = "FORBIDDEN: X-Owner-Id does not belong to the authenticated identity (an operator too renews only under an owner of its own)", body = ErrorBody),
        (status = 409, description = "LOCK_LOST: the grant ended, was taken over, or is not held by the caller's owner and session", body = ErrorBody),
    ))]
pub(super) async fn renew(
    State(state): State<AppState>,
    PathWrite(caller, key, headers, body): PathWrite<RenewRequest, Caller>,
) -> Result<Json<LockGrant>, ApiError> {
    let token = headers::fencing_token(&headers)?;
    let mut checks = Checks::default();
    checks.take(path_key(&key));
    let owner = checks.take(headers::owner_id(&headers));
    let ttl_ms = match body.ttl_millis {
        None => None,
        requested => checks.take(lock_ttl(&state.config, requested)),
    };
    checks.done()?;
    // Bound to the grant's owner (the caller's X-Owner-Id, which the auth layer binds to its
    // credential): a non-owner is LOCK_LOST, the contract's code for a caller that is not the
    // holder (docs/contract.md#error-codes).
    let owner_id = present(owner)?;
    operator_renews_its_own(&caller, &owner_id)?;
    // And to the grant's session: the store matches (key, token, owner, session), so another
    // session of the same owner is LOCK_LOST too and gets no proof.
    let renewal = Renewal {
        claim: Claim {
            key: &key,
            session_id: body.session_id,
            owner_id: &owner_id,
        },
        token,
        ttl_ms,
    };
    let grant = state
        .store
        .renew(&renewal)
        .await
        .map_err(|e| store_error(e, Some(&key)))?;
    Ok(Json(state.proven(grant)))
}

/// An operator may name any owner (a revocation acts on another's lock), but a renew answers
/// with a fresh proof of the grant's token, which is the holder's alone: an operator renews only
/// under an owner of its own identity (`<identity>` or `<identity>/<worker>`), as any caller
/// does. `403 FORBIDDEN` otherwise, before anything is read.
fn operator_renews_its_own(caller: &Caller, owner_id: &str) -> Result<(), ApiError> {
    let Some(identity) = caller.identity().filter(|i| i.operator) else {
        return Ok(());
    };
    let own = owner_id == identity.name
        || owner_id
            .strip_prefix(identity.name.as_str())
            .is_some_and(|rest| rest.starts_with('/'));
    if own {
        return Ok(());
    }
    Err(ApiError::new(
        ErrorCode::Forbidden,
        format!(
            "X-Owner-Id `{owner_id}` is not the operator identity `{0}`: a renew extends a grant of your own and answers with its proof, so it takes `{0}` or `{0}/<worker>`; nothing was changed (to end another owner's grant, revoke it)",
            identity.name
        ),
    ))
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub(super) struct ReleaseQuery {
    session_id: Option<String>,
}

/// L6: release a grant (compare-and-delete on key and token).
#[utoipa::path(delete, path = "/v1/locks/{key}", request_body(content = Option<ReleaseRequest>, description = "or sessionId in the query"),
    params(("key" = String, Path), ("sessionId" = Option<String>, Query), ("X-Owner-Id" = String, Header), ("X-Fencing-Token" = String, Header, description = "decimal int64 > 0")),
    responses((status = 204, description = "released"), InvalidToken, Unauthorized, NotLeader,
        (status = 409, description = "LOCK_LOST", body = ErrorBody),
    ))]
pub(super) async fn release(
    State(state): State<AppState>,
    Path(key): Path<String>,
    query: Result<Query<ReleaseQuery>, QueryRejection>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<StatusCode, ApiError> {
    let token = headers::fencing_token(&headers)?;
    let mut checks = Checks::default();
    checks.take(path_key(&key));
    let owner = checks.take(headers::owner_id(&headers));
    // sessionId comes in the body or, for clients that send no body with DELETE, the query.
    // It is attribution only: the delete compares (key, token) and nothing else.
    let session_id = if body.iter().any(|b| !b.is_ascii_whitespace()) {
        Some(parse_body::<ReleaseRequest>(&body)?.session_id)
    } else {
        let query = strict_query(query)?;
        match query.session_id {
            Some(text) => checks.take(path_session(&text)),
            None => {
                checks
                    .0
                    .push(FieldError::new("sessionId", "is required (body or query)"));
                None
            }
        }
    };
    checks.done()?;
    let owner = present(owner)?;
    let session_id = present(session_id)?;
    // The delete compares (key, token) as the contract says; the caller's owner id, bound to its
    // credential, must also be the grant's: a token is public (L7), so without this any
    // identity could end another's grant. A non-owner hears LOCK_LOST, as any non-holder does.
    match state.store.release(&key, &owner, token).await {
        Ok(()) => {
            state.wake(&key);
            tracing::debug!(event = "lock_released", key = %key, token, owner_id = %owner, %session_id, "lock released");
            Ok(StatusCode::NO_CONTENT)
        }
        Err(error) => {
            if matches!(error, StoreError::LockLost { .. }) {
                tracing::info!(event = "release_lock_lost", key = %key, token, owner_id = %owner, %session_id, "release of a grant that had already lapsed or been taken over");
            }
            Err(store_error(error, Some(&key)))
        }
    }
}
/// L7: who holds a key (advisory only).
#[utoipa::path(get, path = "/v1/locks/{key}",
    params(("key" = String, Path)),
    responses((status = 200, body = LockInfo), Invalid, NotLeader,
        (status = 404, description = "NOT_FOUND: never locked, or not granted for lock.keys-seen.retention", body = ErrorBody),
    ))]
pub(super) async fn lock_info(
    State(state): State<AppState>,
    Path(key): Path<String>,
) -> Result<Json<LockInfo>, ApiError> {
    path_key(&key).map_err(|e| ApiError::validation(vec![e]))?;
    match state
        .store
        .lock_info(&key)
        .await
        .map_err(|e| store_error(e, Some(&key)))?
    {
        Some(info) => Ok(Json(info)),
        None => Err(ApiError::not_found(format!(
            "{key} has never been locked here"
        ))),
    }
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub(super) struct HeldQuery {
    limit: Option<String>,
}

/// The most held locks one list returns.
pub const HELD_LIMIT_MAX: i64 = 1_000;

/// Every held lock (advisory).
#[utoipa::path(get, path = "/v1/locks",
    params(("limit" = Option<i64>, Query, description = "1 to 1000, default 500")),
    responses((status = 200, body = HeldLocks), Invalid, NotLeader))]
pub(super) async fn held_locks(
    State(state): State<AppState>,
    query: Result<Query<HeldQuery>, QueryRejection>,
) -> Result<Json<HeldLocks>, ApiError> {
    let query = strict_query(query)?;
    let limit = match query.limit {
        None => 500,
        Some(text) => match text.parse::<i64>() {
            Ok(n) if (1..=HELD_LIMIT_MAX).contains(&n) => n,
            _ => {
                return Err(ApiError::field(
                    "limit",
                    format!("must be an integer between 1 and {HELD_LIMIT_MAX}"),
                ));
            }
        },
    };
    let held = state
        .store
        .held(limit)
        .await
        .map_err(|e| store_error(e, None))?;
    Ok(Json(held))
}
