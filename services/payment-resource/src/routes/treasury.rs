//! The treasury's controls on what moves (docs/contract.md#account-limits,
//! docs/contract.md#dual-approval): an account's limits, the answer to a funding that waits for
//! a second treasury identity (above `auth.treasury.dual-approval-above` with what its identity
//! funded on the account alone in the last 24 hours), and that identity's approval. paydb
//! enforces each (migrations/paydb/0038_baseline_guards.sql,
//! migrations/paydb/0039_baseline_payment_writes.sql); these
//! handlers check the request, name the caller and read the outcome.

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::Response;
use dlock_contract::error::{ApiError, ErrorBody, ErrorCode};
use dlock_contract::payment::{
    AccountLimits, AccountLimitsRequest, ApproveFundingRequest, ApprovedFunding, FundRequest,
    PendingFunding,
};
use dlock_server::auth::Caller;
use dlock_server::extract::PathWrite;
use dlock_server::openapi::{Idempotent, Invalid, NotFound, NotLeader, Unauthorized};
use serde_json::json;
use sqlx::PgConnection;
use uuid::Uuid;

use super::AppState;
use super::checks::{Checks, WriteHeaders, check_account_id, checked_write};
use super::errors::{account_not_found, store_error};
use super::idempotency::{Reply, idempotent};
use crate::openapi::WriteParams;
use crate::store::{ApproveOutcome, LimitsOutcome, PayStore, PendingRow};

/// `PENDING_APPROVAL`: a funding recorded and not applied.
pub const PENDING_APPROVAL: &str = "PENDING_APPROVAL";
/// `APPROVED`: a second treasury identity approved it, and it was applied.
pub const APPROVED: &str = "APPROVED";

fn not_customer() -> ApiError {
    ApiError::field(
        "accountId",
        "is a system account; only customer accounts have limits and fundings",
    )
}

/// Sets an account's limits: the largest single payout and the outflow per UTC day (treasury;
/// docs/contract.md#account-limits). paydb refuses a payout above them with LIMIT_EXCEEDED.
#[utoipa::path(post, path = "/v1/accounts/{account_id}/limits", request_body = AccountLimitsRequest,
    params(("accountId" = String, Path), WriteParams),
    responses((status = 200, body = AccountLimits), Invalid, Unauthorized, NotFound, Idempotent, NotLeader))]
// `POST /v1/accounts/{accountId}/limits`: the account's limits as a whole (a field left out
// or null is no limit of that kind).
pub(super) async fn set_limits(
    State(state): State<AppState>,
    PathWrite(caller, account_id, headers, body): PathWrite<AccountLimitsRequest, Caller>,
) -> Result<Response, ApiError> {
    caller.require_treasury("setting an account's limits")?;
    let write = checked_write(&headers, |checks| {
        check_account_id(checks, "accountId", &account_id);
        for (field, value) in [
            ("maxPayoutMinor", body.max_payout_minor),
            ("dailyOutflowMinor", body.daily_outflow_minor),
        ] {
            checks.check(
                value.is_none_or(|v| v > 0),
                field,
                "must be a positive amount in minor units, or null for no limit",
            );
        }
    })?;
    let identity = caller.audit_identity();
    let route = format!("POST /v1/accounts/{account_id}/limits");
    let scope = state.scope(route, &write, 0, &body, true)?;
    Ok(idempotent!(&state, scope, |conn| {
        limits_effect(conn, &account_id, &body, &identity, &write).await
    }))
}

async fn limits_effect(
    conn: &mut PgConnection,
    account_id: &str,
    body: &AccountLimitsRequest,
    identity: &str,
    write: &WriteHeaders,
) -> Result<Reply, ApiError> {
    let outcome = PayStore::set_limits(
        conn,
        account_id,
        body.max_payout_minor,
        body.daily_outflow_minor,
        identity,
    )
    .await
    .map_err(store_error)?;
    match outcome {
        LimitsOutcome::Set {
            max_payout_minor,
            daily_outflow_minor,
            set_by,
        } => {
            tracing::info!(
                event = "account_limits_set",
                account_id,
                max_payout_minor,
                daily_outflow_minor,
                identity,
                owner = %write.owner_id,
                "the treasury set an account's limits"
            );
            Reply::json(
                StatusCode::OK,
                &AccountLimits {
                    account_id: account_id.to_owned(),
                    max_payout_minor,
                    daily_outflow_minor,
                    set_by,
                },
            )
        }
        LimitsOutcome::NotFound => Err(account_not_found(account_id)),
        LimitsOutcome::NotCustomer => Err(not_customer()),
    }
}

/// `422 IDEMPOTENCY_CONFLICT`: the funding's reference names another funding, applied or
/// pending.
pub(super) fn reference_conflict(body: &FundRequest) -> ApiError {
    ApiError::new(
        ErrorCode::IdempotencyConflict,
        "this funding reference was already used for another account or amount",
    )
    .with_details(json!({ "reference": body.reference }))
}

/// A funding paydb recorded in `pending_fundings` instead of applying it (it, with what the same
/// treasury identity funded on the account alone in the last 24 hours, passes the threshold),
/// or found recorded there: `202` with its id.
pub(super) fn pending_reply(
    account_id: &str,
    body: &FundRequest,
    pending: PendingRow,
    threshold: Option<i64>,
) -> Result<Reply, ApiError> {
    let PendingRow {
        funding_id,
        requested_by,
        approved_by,
        window_minor,
    } = pending;
    tracing::warn!(
        event = "funding_pending_approval",
        account_id,
        %funding_id,
        amount_minor = body.amount_minor,
        funded_alone_24h_minor = window_minor,
        threshold,
        requested_by = %requested_by,
        "a funding that, with what its treasury identity funded on the account alone in the last \
         24 hours, is above auth.treasury.dual-approval-above waits for a second treasury identity"
    );
    Reply::json(
        StatusCode::ACCEPTED,
        &PendingFunding {
            funding_id,
            account_id: account_id.to_owned(),
            amount_minor: body.amount_minor,
            reference: body.reference.clone(),
            requested_by,
            status: if approved_by.is_some() {
                APPROVED
            } else {
                PENDING_APPROVAL
            }
            .to_owned(),
        },
    )
}

/// Applies a pending funding, once, by a second treasury identity (docs/contract.md#dual-approval).
#[utoipa::path(post, path = "/v1/fundings/{funding_id}/approve", request_body = ApproveFundingRequest,
    params(("fundingId" = String, Path), WriteParams),
    responses((status = 200, body = ApprovedFunding), Invalid, Unauthorized, NotFound, Idempotent, NotLeader,
        (status = 403, description = "FORBIDDEN: not a treasury identity, or the identity that asked for the funding; nothing changed", body = ErrorBody),
        (status = 422, description = "IDEMPOTENCY_CONFLICT: already approved (details.approvedBy)", body = ErrorBody),
    ))]
// `POST /v1/fundings/{fundingId}/approve`: a second treasury identity applies a pending
// funding, once.
pub(super) async fn approve_funding(
    State(state): State<AppState>,
    PathWrite(caller, funding_id, headers, body): PathWrite<ApproveFundingRequest, Caller>,
) -> Result<Response, ApiError> {
    caller.require_treasury("approving a funding")?;
    let mut parsed = None;
    let write = checked_write(&headers, |checks: &mut Checks| {
        parsed = checks
            .take(Uuid::parse_str(&funding_id).map_err(|_| {
                dlock_contract::error::FieldError::new("fundingId", "must be a UUID")
            }));
    })?;
    let Some(funding_id) = parsed else {
        return Err(ApiError::field("fundingId", "must be a UUID"));
    };
    let identity = caller.audit_identity();
    let route = format!("POST /v1/fundings/{funding_id}/approve");
    let scope = state.scope(route, &write, 0, &body, true)?;
    Ok(idempotent!(&state, scope, |conn| {
        approve_effect(conn, funding_id, &identity).await
    }))
}

async fn approve_effect(
    conn: &mut PgConnection,
    funding_id: Uuid,
    identity: &str,
) -> Result<Reply, ApiError> {
    let outcome = PayStore::approve_funding(conn, funding_id, identity)
        .await
        .map_err(store_error)?;
    match outcome {
        ApproveOutcome::Approved {
            funding,
            approved_by,
            balance_minor,
        } => {
            tracing::warn!(
                event = "funding_approved",
                %funding_id,
                account_id = %funding.account_id,
                amount_minor = funding.amount_minor,
                requested_by = %funding.requested_by,
                approved_by = %approved_by,
                "a second treasury identity approved a funding; it is applied"
            );
            let entries = PayStore::entries(conn, &format!("fund:{}", funding.reference), false)
                .await
                .map_err(store_error)?;
            Reply::json(
                StatusCode::OK,
                &ApprovedFunding {
                    funding_id,
                    account_id: funding.account_id,
                    amount_minor: funding.amount_minor,
                    reference: funding.reference,
                    requested_by: funding.requested_by,
                    approved_by,
                    entries,
                    balance_minor,
                },
            )
        }
        ApproveOutcome::NotFound => Err(ApiError::not_found(format!(
            "no pending funding {funding_id}"
        ))),
        ApproveOutcome::SameIdentity { funding } => {
            tracing::warn!(
                event = "funding_self_approval_refused",
                %funding_id,
                account_id = %funding.account_id,
                identity,
                "a treasury identity tried to approve its own funding"
            );
            Err(ApiError::new(
                ErrorCode::Forbidden,
                format!(
                    "`{identity}` asked for funding {funding_id} and cannot also approve it: a \
                     second, different treasury identity must; nothing was changed"
                ),
            )
            .with_details(json!({
                "fundingId": funding_id,
                "requestedBy": funding.requested_by,
            })))
        }
        ApproveOutcome::AlreadyApproved {
            funding,
            approved_by,
        } => Err(ApiError::new(
            ErrorCode::IdempotencyConflict,
            format!(
                "funding {funding_id} was already approved by `{approved_by}` and applied once; \
                 nothing was changed"
            ),
        )
        .with_details(json!({
            "fundingId": funding_id,
            "accountId": funding.account_id,
            "approvedBy": approved_by,
            "status": APPROVED,
        }))),
    }
}
