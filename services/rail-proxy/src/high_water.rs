//! The durable high-water mark per account: read it, raise it to a revocation floor, and the
//! docs/design.md#d-8 recovery that lowers one poisoned by a forged token. The two writes are
//! operator only and recorded with the operator, the reason and the authenticated identity.

use axum::extract::{Path, State};
use axum::http::HeaderMap;
use dlock_contract::error::{ApiError, ErrorBody, FieldError};
use dlock_contract::headers;
use dlock_contract::json::Json;
use dlock_contract::proof::{FenceLowerRequest, FenceLowered};
use dlock_contract::rail::HighWaterRequest as AdvanceRequest;
use dlock_contract::rail::{HighWater, HighWaterRequest};
use dlock_server::auth::Caller;
use dlock_server::extract::PathWrite;
use dlock_server::openapi::{
    Invalid, InvalidToken, NotFound, RailUnavailable, RecoveryForbidden, RecoveryParams,
    Unauthorized,
};
use dlock_server::proof;
use serde_json::json;

use crate::AppState;
use crate::openapi::HighWaterAdvanced;
use crate::store::{self, Audit, LowerOutcome};

/// A high-water write paydb failed: RECOVERY_REQUIRED when its epoch guard refused it, else a
/// server fault.
fn refused_write(error: store::StoreError) -> ApiError {
    crate::record::recovery_required(&error).unwrap_or_else(|| ApiError::internal(error))
}

/// The longest reason paydb keeps for a high-water advance.
const REASON_LEN_MAX: usize = 4096;

/// Raises an account's high-water mark to a revocation floor (operator; docs/design.md#d-3).
#[utoipa::path(post, path = "/v1/rail/high-water/{account_id}", request_body = HighWaterRequest,
    params(("accountId" = String, Path), ("X-Owner-Id" = String, Header)),
    responses((status = 200, body = HighWaterAdvanced), Invalid, Unauthorized, NotFound, RailUnavailable))]
pub(crate) async fn advance_high_water(
    State(state): State<AppState>,
    PathWrite(caller, account_id, headers, body): PathWrite<AdvanceRequest, Caller>,
) -> Result<Json<serde_json::Value>, ApiError> {
    let identity = caller.operator("the high-water advance")?;
    let owner = headers::owner_id(&headers).map_err(|e| ApiError::validation(vec![e]))?;
    check_advance(&account_id, &body)?;
    if !store::account_exists(&state.pool, &account_id)
        .await
        .map_err(ApiError::internal)?
    {
        return Err(account_not_found(&account_id));
    }
    let audit = Audit::new(&body.operator, &body.reason, &identity, &owner);
    let (previous, new) = store::advance_high_water(
        &state.pool,
        &account_id,
        body.floor,
        body.revocation_id,
        &audit,
    )
    .await
    .map_err(refused_write)?;
    tracing::warn!(event = "rail_high_water_advanced", account_id = %account_id, previous, new, operator = %audit.operator, identity = %identity, owner_id = %owner, revocation_id = ?body.revocation_id, "the rail high-water mark was raised to a revocation floor");
    Ok(Json(json!({
        "accountId": account_id,
        "previousToken": previous,
        "highestToken": new,
        "floor": body.floor,
        "operator": audit.operator,
        "identity": identity,
    })))
}

fn check_advance(account_id: &str, body: &AdvanceRequest) -> Result<(), ApiError> {
    let mut fields = Vec::new();
    check_account_id(&mut fields, account_id);
    if body.floor <= 0 {
        fields.push(FieldError::new("floor", "must be a token greater than 0"));
    }
    // A control character is refused as the lowering refuses it: PostgreSQL's text cannot hold
    // a NUL, and the INSERT would fail as a 500.
    if body.operator.trim().is_empty()
        || body.operator.len() > 128
        || body.operator.chars().any(char::is_control)
    {
        fields.push(FieldError::new(
            "operator",
            "must be 1 to 128 characters without control characters",
        ));
    }
    // paydb keeps 1 to 4096 characters (the advance record's reason); a longer reason is the
    // caller's error, refused here with the envelope, never a failed INSERT answered 500.
    let reason_len = body.reason.trim().chars().count();
    if !(8..=REASON_LEN_MAX).contains(&reason_len) || body.reason.chars().any(char::is_control) {
        fields.push(FieldError::new(
            "reason",
            format!(
                "must be 8 to {REASON_LEN_MAX} characters without control characters, got {reason_len}"
            ),
        ));
    }
    if fields.is_empty() {
        Ok(())
    } else {
        Err(ApiError::validation(fields))
    }
}

/// The checks of a lowering; the owner it names.
fn check_lower(
    account_id: &str,
    headers: &HeaderMap,
    body: &FenceLowerRequest,
) -> Result<String, ApiError> {
    let mut fields = dlock_contract::proof::check_lower_request(body);
    let owner = headers::owner_id(headers).map_err(|e| fields.push(e)).ok();
    check_account_id(&mut fields, account_id);
    if !fields.is_empty() {
        return Err(ApiError::validation(fields));
    }
    Ok(owner.unwrap_or_default())
}

fn check_account_id(fields: &mut Vec<FieldError>, account_id: &str) {
    if !dlock_contract::payment::account_id_is_valid(account_id) {
        fields.push(FieldError::new(
            "accountId",
            dlock_contract::payment::ACCOUNT_ID_RULE,
        ));
    }
}

fn account_not_found(account_id: &str) -> ApiError {
    ApiError::not_found(format!("account {account_id} does not exist"))
}

/// Lowers a high-water mark poisoned by a forged token (docs/design.md#d-8) to the token of the
/// operator's own grant on `payout:{accountId}` (operator; needs fencing.proof-keys-file), never
/// under the highest token the proxy admitted a proven submission with. Audited in
/// fence_recoveries.
#[utoipa::path(post, path = "/v1/rail/high-water/{account_id}/lower", request_body = FenceLowerRequest,
    params(("accountId" = String, Path), RecoveryParams, ("X-Owner-Id" = String, Header)),
    responses((status = 200, body = FenceLowered), InvalidToken, Unauthorized, RecoveryForbidden, NotFound, RailUnavailable,
        (status = 409, description = "FENCED_OUT: the token is below the highest token the proxy admitted a submission with, its proof verified (details.highestToken); nothing changed", body = ErrorBody),
    ))]
// docs/design.md#d-8 recovery: lowers a high-water mark poisoned by a forged token to the token of
// the operator's own proven grant on `payout:{accountId}` (which the lock server issues only while
// nobody else holds the key, above every token issued before), and never under a token the proxy
// admitted a proven submission with (`409 FENCED_OUT`). Operator only, needs proof keys,
// recorded in `fence_recoveries` with the operator, reason and authenticated identity.
pub(crate) async fn lower_high_water(
    State(state): State<AppState>,
    PathWrite(caller, account_id, headers, body): PathWrite<FenceLowerRequest, Caller>,
) -> Result<Json<FenceLowered>, ApiError> {
    let identity = caller.operator("lowering the high-water mark")?;
    let (token, owner) = proof::recovery_grant(
        state.config.proof_keys.as_ref(),
        &headers,
        &account_id,
        || check_lower(&account_id, &headers, &body),
    )?;
    let audit = Audit::new(&body.operator, &body.reason, &identity, &owner);
    let outcome = store::lower_high_water(&state.pool, &account_id, token, &audit)
        .await
        .map_err(refused_write)?;
    let (previous, highest, recovery_id, lowered) = match outcome {
        LowerOutcome::Lowered {
            previous,
            highest,
            recovery_id,
        } => (previous, highest, recovery_id, true),
        LowerOutcome::Unchanged { previous, highest } => (previous, highest, None, false),
        LowerOutcome::BelowSeen { highest, seen } => {
            tracing::warn!(
                event = "rail_high_water_lowering_refused",
                account_id = %account_id,
                highest,
                token,
                seen_token = seen,
                operator = %audit.operator,
                identity = %identity,
                owner_id = %owner,
                "a rail high-water lowering below a token the proxy admitted was refused"
            );
            // The proxy admitted `seen` with its proof (`rail_high_water.max_seen_token`).
            let refused = format!(
                "the rail proxy already admitted a submission of account {account_id} with token {seen} and its proof; lowering the high-water mark to {token} would admit the holders in between again, so nothing was changed."
            );
            return Err(proof::below_seen(
                "rail",
                &account_id,
                token,
                seen,
                &owner,
                &refused,
            ));
        }
        LowerOutcome::NotFound => return Err(account_not_found(&account_id)),
    };
    if lowered {
        tracing::warn!(
            event = "rail_high_water_lowered",
            account_id = %account_id,
            previous,
            highest,
            recovery_id,
            operator = %audit.operator,
            identity = %identity,
            owner_id = %owner,
            "a rail high-water mark poisoned by a forged token was lowered to the operator's grant"
        );
    }
    Ok(Json(FenceLowered {
        account_id,
        resource: "rail".into(),
        previous_token: previous,
        token: highest,
        lowered,
        recovery_id,
    }))
}

/// An account's high-water mark.
#[utoipa::path(get, path = "/v1/rail/high-water/{account_id}", params(("accountId" = String, Path)),
    responses((status = 200, body = HighWater), Invalid, NotFound, RailUnavailable))]
pub(crate) async fn high_water(
    State(state): State<AppState>,
    Path(account_id): Path<String>,
) -> Result<Json<serde_json::Value>, ApiError> {
    let highest = store::high_water(&state.pool, &account_id)
        .await
        .map_err(ApiError::internal)?;
    Ok(Json(json!({
        "accountId": account_id,
        "highestToken": highest,
    })))
}
