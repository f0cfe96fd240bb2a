//! L1–L3: open a session, heartbeat, end it.

use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::Response;
use dlock_contract::error::{ApiError, ErrorBody, ErrorCode, FieldError};
use dlock_contract::headers;
use dlock_contract::http::json_response;
use dlock_contract::json::Json;
use dlock_contract::lock::*;
use dlock_server::auth::Caller;
use dlock_server::openapi::{Invalid, NotLeader, Unauthorized};

use super::AppState;
use super::checks::{Checks, path_session, present, session_ttl};
use super::errors::store_error;
use crate::config::LockServerConfig;
use crate::openapi::SessionGone;

/// L1: open a session.
#[utoipa::path(post, path = "/v1/sessions", request_body = CreateSessionRequest,
    params(("X-Owner-Id" = Option<String>, Header, description = "owner id, ≤64 chars (or ownerId in the body)")),
    responses((status = 201, body = Session), Invalid, Unauthorized, NotLeader,
        (status = 403, description = "FORBIDDEN: X-Owner-Id or the body's ownerId does not belong to the authenticated identity", body = ErrorBody),
    ))]
pub(super) async fn create_session(
    State(state): State<AppState>,
    caller: Caller,
    headers: HeaderMap,
    Json(body): Json<CreateSessionRequest>,
) -> Result<Response, ApiError> {
    let mut checks = Checks::default();
    let header_owner = checks.take(headers::owner_id_optional(&headers)).flatten();
    if let Some(owner) = &body.owner_id {
        checks.take(headers::check_owner_id("ownerId", owner));
    }
    let owner = match (header_owner, body.owner_id.clone()) {
        (Some(h), Some(b)) if h != b => {
            checks
                .0
                .push(FieldError::new("ownerId", "differs from X-Owner-Id"));
            None
        }
        (h, b) => h.or(b),
    };
    if owner.is_none() && checks.0.is_empty() {
        checks.0.push(FieldError::new(
            "ownerId",
            "is required (in the body or as X-Owner-Id)",
        ));
    }
    let ttl_ms = checks.take(session_ttl(&state.config, body.ttl_millis));
    checks.done()?;
    let (owner, ttl_ms) = (present(owner)?, present(ttl_ms)?);
    // The auth layer binds X-Owner-Id to the credential, but it cannot see the body: an ownerId
    // there, without the header, is bound here by the same rule.
    owner_bound(&state.config, &caller, &owner)?;
    let session = state
        .store
        .create_session(&owner, ttl_ms)
        .await
        .map_err(|e| store_error(e, None))?;
    tracing::info!(event = "session_opened", session_id = %session.session_id, owner_id = %owner, ttl_ms, "session opened");
    Ok(json_response(StatusCode::CREATED, &session))
}

/// `auth.owner-binding` for an owner id the auth layer did not see (L1's body `ownerId`): an
/// authenticated caller that is not an operator may name only its identity or
/// `<identity>/<worker>`, else `403 FORBIDDEN` and nothing is created.
fn owner_bound(config: &LockServerConfig, caller: &Caller, owner: &str) -> Result<(), ApiError> {
    let Some(identity) = caller.identity() else {
        return Ok(());
    };
    if !config.owner_binding || identity.operator {
        return Ok(());
    }
    let name = identity.name.as_str();
    let bound = owner == name
        || owner
            .strip_prefix(name)
            .is_some_and(|rest| rest.starts_with('/'));
    if bound {
        return Ok(());
    }
    tracing::warn!(
        event = "owner_binding_refused",
        identity = name,
        owner_id = owner,
        "a session was refused: its ownerId does not belong to the authenticated identity"
    );
    Err(ApiError::new(
        ErrorCode::Forbidden,
        format!(
            "ownerId `{owner}` does not belong to the authenticated identity `{name}`: use \
             `{name}` or `{name}/<worker>`; nothing was changed"
        ),
    ))
}

/// L2: heartbeat a session.
#[utoipa::path(post, path = "/v1/sessions/{session_id}/heartbeat",
    params(("sessionId" = String, Path), ("X-Owner-Id" = String, Header, description = "owner id, ≤64 chars")),
    responses((status = 200, body = Heartbeat), Invalid, Unauthorized, SessionGone, NotLeader))]
pub(super) async fn heartbeat(
    State(state): State<AppState>,
    Path(session_id): Path<String>,
    headers: HeaderMap,
) -> Result<Json<Heartbeat>, ApiError> {
    let mut checks = Checks::default();
    let session_id = checks.take(path_session(&session_id));
    let owner = checks.take(headers::owner_id(&headers));
    checks.done()?;
    let beat = state
        .store
        .heartbeat(present(session_id)?, &present(owner)?)
        .await
        .map_err(|e| store_error(e, None))?;
    Ok(Json(beat))
}

/// L3: end a session, releasing every lock it holds.
#[utoipa::path(delete, path = "/v1/sessions/{session_id}",
    params(("sessionId" = String, Path), ("X-Owner-Id" = String, Header, description = "owner id, ≤64 chars")),
    responses((status = 204, description = "ended"), Invalid, Unauthorized, SessionGone, NotLeader))]
pub(super) async fn end_session(
    State(state): State<AppState>,
    Path(session_id): Path<String>,
    headers: HeaderMap,
) -> Result<StatusCode, ApiError> {
    let mut checks = Checks::default();
    let session_id = checks.take(path_session(&session_id));
    let owner = checks.take(headers::owner_id(&headers));
    checks.done()?;
    let session_id = present(session_id)?;
    state
        .store
        .end_session(session_id, &present(owner)?)
        .await
        .map_err(|e| store_error(e, None))?;
    // The session's locks are gone; waiters anywhere may take them. Wake this replica's.
    for bucket in state.wake.iter() {
        bucket.notify_waiters();
    }
    tracing::info!(event = "session_ended", %session_id, "session ended; its locks were released");
    Ok(StatusCode::NO_CONTENT)
}
