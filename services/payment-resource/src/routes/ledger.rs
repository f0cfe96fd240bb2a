//! The writes that post to the double-entry ledger: funding a customer account, and P3, a
//! payout the rail acknowledged posted with its two entries.

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::Response;
use dlock_contract::error::{ApiError, ErrorBody, FieldError};
use dlock_contract::payment::{
    Direction, FundRequest, FundResponse, LedgerEntry, PayoutState, PendingFunding, PostRequest,
    PostResponse,
};
use dlock_server::auth::Caller;
use dlock_server::extract::PathWrite;
use dlock_server::openapi::{Idempotent, Invalid, InvalidToken, NotFound, NotLeader, Unauthorized};
use sqlx::PgConnection;
use uuid::Uuid;

use super::AppState;
use super::checks::{check_account_id, check_amount, check_reference, checked_write};
use super::errors::{account_not_found, store_error};
use super::idempotency::{Reply, idempotent};
use super::payouts::Fenced;
use crate::metrics::Resource;
use crate::openapi::{FencedParams, WriteParams};
use crate::store::{FundAsOutcome, FundOutcome, PayStore, PostOutcome, Scope};

/// Funds an account.
#[utoipa::path(post, path = "/v1/accounts/{account_id}/fund", request_body = FundRequest,
    params(("accountId" = String, Path), WriteParams),
    responses((status = 200, body = FundResponse), Invalid, Unauthorized, NotFound, Idempotent, NotLeader,
        (status = 202, description = "above auth.treasury.dual-approval-above, with what the same treasury identity funded on the account alone in the last 24 hours: recorded, not applied, until a second treasury identity approves it (docs/contract.md#dual-approval)", body = PendingFunding),
    ))]
pub(super) async fn fund(
    State(state): State<AppState>,
    PathWrite(caller, account_id, headers, body): PathWrite<FundRequest, Caller>,
) -> Result<Response, ApiError> {
    // Funding is the one write that creates money in the ledger: the treasury's alone.
    caller.require_treasury("funding an account")?;
    let write = checked_write(&headers, |checks| {
        check_account_id(checks, "accountId", &account_id);
        check_amount(checks, body.amount_minor);
        check_reference(checks, "reference", &body.reference);
    })?;
    let route = format!("POST /v1/accounts/{account_id}/fund");
    let scope = state.scope(route, &write, 0, &body, true)?;
    // paydb decides whether the funding applies now or waits for a second treasury identity:
    // above auth.treasury.dual-approval-above with what this identity funded on the account
    // alone in the last 24 hours (docs/contract.md#dual-approval).
    let identity = caller.audit_identity();
    let threshold = state.config.dual_approval_above;
    Ok(idempotent!(&state, scope, |conn| {
        fund_effect(conn, &account_id, &body, &identity, threshold).await
    }))
}

async fn fund_effect(
    conn: &mut PgConnection,
    account_id: &str,
    body: &FundRequest,
    identity: &str,
    threshold: Option<i64>,
) -> Result<Reply, ApiError> {
    let outcome = PayStore::fund_as(
        conn,
        account_id,
        body.amount_minor,
        &body.reference,
        identity,
        threshold,
    )
    .await
    .map_err(store_error)?;
    let outcome = match outcome {
        FundAsOutcome::Fund(outcome) => outcome,
        FundAsOutcome::Pending(pending) => {
            return super::treasury::pending_reply(account_id, body, pending, threshold);
        }
    };
    let balance_minor = match outcome {
        FundOutcome::Funded { balance_minor } | FundOutcome::Exists { balance_minor } => {
            balance_minor
        }
        FundOutcome::Conflict => return Err(super::treasury::reference_conflict(body)),
        FundOutcome::NotFound => return Err(account_not_found(account_id)),
        FundOutcome::NotCustomer => {
            return Err(ApiError::field(
                "accountId",
                "is a system account; only customer accounts are funded",
            ));
        }
    };
    let entries = PayStore::entries(conn, &format!("fund:{}", body.reference), false)
        .await
        .map_err(store_error)?;
    Reply::json(
        StatusCode::OK,
        &FundResponse {
            account_id: account_id.to_owned(),
            reference: body.reference.clone(),
            entries,
            balance_minor,
        },
    )
}

/// P3: a fenced posting.
#[utoipa::path(post, path = "/v1/payouts/{payout_id}/post", request_body = PostRequest,
    params(("payoutId" = String, Path), FencedParams, WriteParams),
    responses((status = 200, body = PostResponse), InvalidToken, Unauthorized, NotFound, Idempotent, NotLeader,
        (status = 409, description = "FENCED_OUT or PAYOUT_NOT_CLAIMABLE", body = ErrorBody),
    ))]
pub(super) async fn post_payout(
    State(state): State<AppState>,
    PathWrite((), payout_id, headers, body): PathWrite<PostRequest>,
) -> Result<Response, ApiError> {
    let on = Fenced::check(&state, &headers, &payout_id, |checks| {
        check_reference(checks, "railReference", &body.rail_reference);
    })
    .await?;
    let route = format!("POST /v1/payouts/{}/post", on.payout_id);
    let scope = state.scope(route, &on.write, on.token, &body, true)?;
    let job = PostJob {
        on,
        scope,
        rail_reference: body.rail_reference,
        submission_id: body.submission_id,
    };
    // Group commit (docs/design.md#group-commit): posts that queue behind a running one go
    // into the next transaction together.
    Ok(super::payouts::grouped(state, |b| &b.posts, job).await)
}

/// A post, checked and proven, waiting for its transaction.
pub(super) struct PostJob {
    pub(super) on: Fenced,
    pub(super) scope: Scope,
    pub(super) rail_reference: String,
    pub(super) submission_id: Uuid,
}

/// A post in a transaction of its own: the idempotency record, the post and its entries in one
/// call (`pay_post_once`).
pub(super) async fn post_single(state: &AppState, job: &PostJob) -> Response {
    let (on, scope) = (&job.on, &job.scope);
    let payout_id = on.payout_id;
    let post = |tx, wait| {
        let (reference, submission) = (&job.rail_reference, job.submission_id);
        PayStore::post_once(
            tx,
            scope,
            wait,
            payout_id,
            reference,
            submission,
            on.proven(),
        )
    };
    let answer = |(outcome, entries): (PostOutcome, Vec<LedgerEntry>)| {
        post_effect(state, outcome, entries, on)
    };
    state.once(scope, post, answer).await
}

pub(super) fn post_effect(
    state: &AppState,
    outcome: PostOutcome,
    entries: Vec<LedgerEntry>,
    on: &Fenced,
) -> Result<Reply, ApiError> {
    let (payout_id, token, write) = (on.payout_id, on.token, &on.write);
    match outcome {
        PostOutcome::Posted { balance_minor } => {
            // The database wrote one balanced pair under this token; check what it answered.
            ApiError::invariant(
                entries_are_one_balanced_pair(&entries, token),
                "a post writes one debit and one credit of the same amount under the caller's token",
            )?;
            // The debit is the payout's account's.
            if let Some(debit) = entries.iter().find(|e| e.direction == Direction::Debit) {
                on.written_on(state, &debit.account_id)?;
            }
            tracing::info!(event = "payout_posted", %payout_id, token, owner = %write.owner_id, "payout posted to the ledger");
            Reply::json(
                StatusCode::OK,
                &PostResponse {
                    payout_id,
                    state: PayoutState::Posted,
                    entries,
                    balance_minor,
                },
            )
        }
        PostOutcome::ReferenceMismatch => Err(ApiError::validation(vec![
            FieldError::new(
                "railReference",
                "must match what the rail acknowledged for this payout",
            ),
            FieldError::new(
                "submissionId",
                "must match the submission the rail acknowledged",
            ),
        ])),
        PostOutcome::Refused(refusal) => {
            Err(on.refused(state, refusal, Resource::ledger, "RAIL_ACKED"))
        }
    }
}

/// Whether `entries` are one debit and one credit of the same positive amount, both written
/// under `token`: what `pay_post` promises for a payout (double entry, fenced).
fn entries_are_one_balanced_pair(entries: &[LedgerEntry], token: i64) -> bool {
    match entries {
        [a, b] => {
            a.direction != b.direction
                && a.amount_minor == b.amount_minor
                && a.amount_minor > 0
                && a.fence == token
                && b.fence == token
        }
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dlock_contract::payment::Direction;

    fn entry(direction: Direction, amount_minor: i64, fence: i64) -> LedgerEntry {
        LedgerEntry {
            entry_id: Uuid::new_v4(),
            account_id: "a".into(),
            direction,
            amount_minor,
            fence,
        }
    }

    #[test]
    fn a_post_is_one_balanced_pair_under_the_callers_token() {
        use Direction::{Credit, Debit};
        assert!(entries_are_one_balanced_pair(
            &[entry(Debit, 500, 7), entry(Credit, 500, 7)],
            7
        ));
        for (entries, why) in [
            (vec![entry(Debit, 500, 7)], "one entry"),
            (
                vec![entry(Debit, 500, 7), entry(Debit, 500, 7)],
                "two debits",
            ),
            (
                vec![entry(Debit, 500, 7), entry(Credit, 499, 7)],
                "unbalanced",
            ),
            (vec![entry(Debit, 0, 7), entry(Credit, 0, 7)], "no amount"),
            (
                vec![entry(Debit, 500, 6), entry(Credit, 500, 7)],
                "an older token",
            ),
            (vec![], "nothing"),
        ] {
            assert!(!entries_are_one_balanced_pair(&entries, 7), "{why}");
        }
    }
}
