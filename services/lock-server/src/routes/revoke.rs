//! L8 revoke: an operator ends a grant and raises the token floor.

use axum::extract::State;
use dlock_contract::error::{ApiError, ErrorBody, FieldError};
use dlock_contract::headers;
use dlock_contract::json::Json;
use dlock_contract::lock::*;
use dlock_contract::payment::OPERATOR_LEN_MAX;
use dlock_server::auth::Caller;
use dlock_server::extract::PathWrite;
use dlock_server::openapi::{Invalid, NotLeader, Unauthorized};

use super::AppState;
use super::checks::{Checks, path_key};
use super::errors::store_error;
use crate::store::RevokeOrder;

/// L8: force-revoke a held lock (operator).
#[utoipa::path(post, path = "/v1/locks/{key}/revoke", request_body = RevokeRequest,
    params(("key" = String, Path), ("X-Owner-Id" = String, Header)),
    responses((status = 200, body = Revocation), Invalid, Unauthorized, NotLeader,
        (status = 404, description = "NOT_FOUND: not held", body = ErrorBody),
        (status = 409, description = "FENCED_OUT: expectedToken stale", body = ErrorBody),
    ))]
pub(super) async fn revoke(
    State(state): State<AppState>,
    PathWrite(caller, key, headers, body): PathWrite<RevokeRequest, Caller>,
) -> Result<Json<Revocation>, ApiError> {
    caller.require_operator("L8 revoke")?;
    let mut checks = Checks::default();
    checks.take(path_key(&key));
    checks.take(headers::owner_id(&headers));
    check_body(&mut checks, &body);
    checks.done()?;
    let operator = body.operator.trim();
    // `operator` is what the caller wrote; the identity its credential proved is stored beside
    // it (none when auth.mode is none).
    let revoked_by = caller.identity().map(|identity| identity.name.as_str());
    let order = RevokeOrder {
        key: &key,
        expected_token: body.expected_token,
        operator,
        reason: body.reason.trim(),
        caller: revoked_by,
    };
    let revocation = state
        .store
        .revoke(&order)
        .await
        .map_err(|e| store_error(e, Some(&key)))?;
    state.metrics.revoked();
    state.wake(&key);
    tracing::warn!(
        event = "lock_revoked",
        key = %key,
        revoked_token = revocation.revoked_token,
        revoked_owner_id = %revocation.revoked_owner_id,
        new_token_floor = revocation.new_token_floor,
        revocation_id = %revocation.revocation_id,
        operator = %revocation.operator,
        revoked_by = revoked_by.unwrap_or("-"),
        reason = %revocation.reason,
        "lock force-revoked; push newTokenFloor to the enforcement points"
    );
    Ok(Json(revocation))
}

/// L8's body: operator 1–128 characters, reason within its bounds, expectedToken positive.
fn check_body(checks: &mut Checks, body: &RevokeRequest) {
    let operator = body.operator.trim();
    if operator.is_empty() || operator.chars().count() > OPERATOR_LEN_MAX {
        checks.0.push(FieldError::new(
            "operator",
            format!("must be 1 to {OPERATOR_LEN_MAX} characters"),
        ));
    }
    let reason_len = body.reason.trim().chars().count();
    if !(REVOKE_REASON_LEN_MIN..=REVOKE_REASON_LEN_MAX).contains(&reason_len) {
        checks.0.push(FieldError::new(
            "reason",
            format!(
                "must be {REVOKE_REASON_LEN_MIN} to {REVOKE_REASON_LEN_MAX} characters, got {reason_len}"
            ),
        ));
    }
    if let Some(t) = body.expected_token
        && t <= 0
    {
        checks
            .0
            .push(FieldError::new("expectedToken", "must be greater than 0"));
    }
}
