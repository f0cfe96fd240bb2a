//! Accounts: creation, P5 (an account with its ledger sum), and the operator's fence writes
//! (a revocation floor, docs/design.md#d-8's recovery of a poisoned fence).

use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::Response;
use dlock_contract::error::{ApiError, ErrorBody, ErrorCode};
use dlock_contract::http::json_response;
use dlock_contract::json::Json;
use dlock_contract::payment::{
    Account, CreateAccountRequest, FUNDING_PREFIX, FenceRequest, FenceResponse, SETTLEMENT_PREFIX,
};
use dlock_contract::proof::{FenceLowerRequest, FenceLowered};
use dlock_server::auth::Caller;
use dlock_server::extract::PathWrite;
use dlock_server::openapi::{
    Idempotent, Invalid, InvalidToken, NotFound, NotLeader, RecoveryForbidden, RecoveryParams,
    Unauthorized,
};
use dlock_server::proof;
use serde_json::json;
use sqlx::PgConnection;

use super::AppState;
use super::checks::{
    Checks, WriteHeaders, check_account_id, check_currency, check_operator_reason, checked_write,
};
use super::errors::{account_not_found, store_error};
use super::idempotency::{Create, Reply, create, created, idempotent};
use crate::openapi::WriteParams;
use crate::store::{
    AdvanceOutcome, Audit, CreateAccountOutcome, FenceMove, LowerOutcome, PayStore,
};

impl Create for CreateAccountRequest {
    const ROUTE: &'static str = "POST /v1/accounts";

    fn check(&self, checks: &mut Checks) {
        check_account_id(checks, "accountId", &self.account_id);
        checks.check(
            !self.account_id.starts_with(FUNDING_PREFIX)
                && !self.account_id.starts_with(SETTLEMENT_PREFIX),
            "accountId",
            format!("{FUNDING_PREFIX}* and {SETTLEMENT_PREFIX}* are the system accounts' names"),
        );
        check_currency(checks, &self.currency);
    }

    /// Opening an account is the treasury's, like funding it.
    fn authorize(caller: &Caller) -> Result<(), ApiError> {
        caller.require_treasury("opening an account")
    }

    async fn effect(&self, conn: &mut PgConnection) -> Result<Reply, ApiError> {
        match PayStore::create_account(conn, &self.account_id, &self.currency)
            .await
            .map_err(store_error)?
        {
            CreateAccountOutcome::Created | CreateAccountOutcome::Exists => {}
            CreateAccountOutcome::Conflict { currency } => {
                return Err(ApiError::new(
                    ErrorCode::IdempotencyConflict,
                    format!(
                        "account {} already exists with another currency or kind",
                        self.account_id
                    ),
                )
                .with_details(json!({ "accountId": self.account_id, "currency": currency })));
            }
        }
        created(PayStore::account(conn, &self.account_id).await, "account")
    }
}

/// Opens an account.
#[utoipa::path(post, path = "/v1/accounts", request_body = CreateAccountRequest,
    params(WriteParams),
    responses((status = 201, body = Account), Invalid, Unauthorized, Idempotent, NotLeader))]
pub(super) async fn create_account(
    state: State<AppState>,
    caller: Caller,
    headers: HeaderMap,
    body: Json<CreateAccountRequest>,
) -> Result<Response, ApiError> {
    create(state, caller, headers, body).await
}

/// P5: an account (advisory).
#[utoipa::path(get, path = "/v1/accounts/{account_id}", params(("accountId" = String, Path)),
    responses((status = 200, body = Account), Invalid, NotFound, NotLeader))]
pub(super) async fn get_account(
    State(state): State<AppState>,
    Path(account_id): Path<String>,
) -> Result<Response, ApiError> {
    let mut checks = Checks::default();
    check_account_id(&mut checks, "accountId", &account_id);
    checks.done()?;
    match state
        .store
        .read_account(&account_id)
        .await
        .map_err(store_error)?
    {
        Some(account) => Ok(json_response(StatusCode::OK, &account)),
        None => Err(account_not_found(&account_id)),
    }
}

/// Advances an account's fence to a revocation floor (operator; docs/design.md#d-3).
#[utoipa::path(post, path = "/v1/accounts/{account_id}/fence", request_body = FenceRequest,
    params(("accountId" = String, Path), WriteParams),
    responses((status = 200, body = FenceResponse), Invalid, Unauthorized, NotFound, Idempotent, NotLeader))]
pub(super) async fn advance_fence(
    State(state): State<AppState>,
    PathWrite(caller, account_id, headers, body): PathWrite<FenceRequest, Caller>,
) -> Result<Response, ApiError> {
    let identity = caller.operator("the fence advance")?;
    let write = checked_write(&headers, |checks| {
        check_account_id(checks, "accountId", &account_id);
        checks.check(body.floor > 0, "floor", "must be a token greater than 0");
        check_operator_reason(checks, &body.operator, &body.reason);
    })?;
    let route = format!("POST /v1/accounts/{account_id}/fence");
    let scope = state.scope(route, &write, 0, &body, true)?;
    Ok(idempotent!(&state, scope, |conn| {
        fence_effect(conn, &account_id, &body, &write, &identity).await
    }))
}

async fn fence_effect(
    conn: &mut PgConnection,
    account_id: &str,
    body: &FenceRequest,
    write: &WriteHeaders,
    identity: &str,
) -> Result<Reply, ApiError> {
    let outcome = PayStore::advance_fence(
        conn,
        account_id,
        body.floor,
        body.revocation_id,
        &Audit::new(&body.operator, &body.reason, identity, &write.owner_id),
    )
    .await
    .map_err(store_error)?;
    let AdvanceOutcome::Advanced(FenceMove {
        previous_fence,
        fence,
    }) = outcome
    else {
        return Err(account_not_found(account_id));
    };
    tracing::warn!(
        event = "fence_advanced",
        account_id,
        previous_fence,
        fence,
        revocation_id = %body.revocation_id,
        operator = %body.operator.trim(),
        identity,
        owner = %write.owner_id,
        "account fence advanced to a revocation floor"
    );
    Reply::json(
        StatusCode::OK,
        &FenceResponse {
            account_id: account_id.to_owned(),
            previous_fence,
            fence,
            revocation_id: body.revocation_id,
            operator: body.operator.trim().to_owned(),
            identity: identity.to_owned(),
        },
    )
}

/// Lowers a fence poisoned by a forged token (docs/design.md#d-8) to the token of the operator's
/// own grant on `payout:{accountId}` (operator; needs fencing.proof-keys-file). Audited in
/// fence_recoveries.
#[utoipa::path(post, path = "/v1/accounts/{account_id}/fence/lower", request_body = FenceLowerRequest,
    params(("accountId" = String, Path), RecoveryParams, WriteParams),
    responses((status = 200, body = FenceLowered), InvalidToken, Unauthorized, RecoveryForbidden, NotFound, Idempotent, NotLeader,
        (status = 409, description = "FENCED_OUT: the token is below the highest token the account admitted with a proof (details.highestToken); nothing changed", body = ErrorBody),
    ))]
// docs/design.md#d-8 recovery: lowers a fence poisoned by a forged token to the token of the
// operator's own grant on `payout:{accountId}`. Operator only; needs proof keys, because only
// a proven grant shows that the lock server let the operator hold the key, i.e. that the
// previous holder's lock was revoked or had lapsed, and that the token is above every token
// issued before it. Recorded in `fence_recoveries` with the operator, the reason and the
// authenticated identity.
pub(super) async fn lower_fence(
    State(state): State<AppState>,
    PathWrite(caller, account_id, headers, body): PathWrite<FenceLowerRequest, Caller>,
) -> Result<Response, ApiError> {
    let identity = caller.operator("lowering a fence")?;
    let (token, write) = proof::recovery_grant(
        state.config.proof_keys.as_ref(),
        &headers,
        &account_id,
        || {
            checked_write(&headers, |checks| {
                check_account_id(checks, "accountId", &account_id);
                checks
                    .0
                    .extend(dlock_contract::proof::check_lower_request(&body));
            })
        },
    )?;
    let route = format!("POST /v1/accounts/{account_id}/fence/lower");
    let scope = state.scope(route, &write, token, &body, true)?;
    Ok(idempotent!(&state, scope, |conn| {
        lower_fence_effect(conn, &account_id, token, &body, &identity, &write).await
    }))
}

async fn lower_fence_effect(
    conn: &mut PgConnection,
    account_id: &str,
    token: i64,
    body: &FenceLowerRequest,
    identity: &str,
    write: &WriteHeaders,
) -> Result<Reply, ApiError> {
    let audit = Audit::new(&body.operator, &body.reason, identity, &write.owner_id);
    let (moved, recovery_id, lowered) = match PayStore::lower_fence(conn, account_id, token, &audit)
        .await
        .map_err(store_error)?
    {
        LowerOutcome::Lowered { fence, recovery_id } => (fence, recovery_id, true),
        LowerOutcome::Unchanged(fence) => (fence, None, false),
        LowerOutcome::BelowSeen { fence, seen_token } => {
            tracing::warn!(
                event = "fence_lowering_refused",
                account_id,
                fence,
                token,
                seen_token,
                operator = %audit.operator,
                identity,
                owner = %write.owner_id,
                "a fence lowering below a token the account admitted was refused"
            );
            // The account admitted `seen_token` with a proof (`accounts.max_seen_token`).
            let refused = format!(
                "account {account_id} already admitted token {seen_token} with a proof; lowering its fence to {token} would readmit the holders in between, so nothing was changed."
            );
            return Err(proof::below_seen(
                "account",
                account_id,
                token,
                seen_token,
                &write.owner_id,
                &refused,
            ));
        }
        LowerOutcome::NotFound => return Err(account_not_found(account_id)),
    };
    if lowered {
        tracing::warn!(
            event = "fence_lowered",
            account_id,
            previous_fence = moved.previous_fence,
            fence = moved.fence,
            recovery_id,
            operator = %audit.operator,
            identity,
            owner = %write.owner_id,
            "an account fence poisoned by a forged token was lowered to the operator's grant"
        );
    }
    Reply::json(
        StatusCode::OK,
        &FenceLowered {
            account_id: account_id.to_owned(),
            resource: "account".into(),
            previous_token: moved.previous_fence,
            token: moved.fence,
            lowered,
            recovery_id,
        },
    )
}
