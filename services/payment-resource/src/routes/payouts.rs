//! Payouts: registration, P1 and P4, P2's claim, and the operator's writes on a payout (the
//! resolution of an ambiguous one, the cancel of one that never reached the rail).

use axum::extract::rejection::QueryRejection;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use dlock_contract::error::{ApiError, ErrorBody, ErrorCode, FieldError};
use dlock_contract::headers;
use dlock_contract::http::json_response;
use dlock_contract::json::Json;
use dlock_contract::payment::{
    CancelRequest, Cancelled, ClaimRequest, ClaimResponse, CreatePayoutRequest, OPERATOR_LEN_MAX,
    Payout, PayoutPage, PayoutState, REASON_LEN_MAX, Resolution, ResolveRequest, ResolveResponse,
};
use dlock_server::auth::Caller;
use dlock_server::extract::PathWrite;
use dlock_server::openapi::{Idempotent, Invalid, InvalidToken, NotFound, NotLeader, Unauthorized};
use serde_json::json;
use sqlx::PgConnection;
use std::sync::Arc;
use uuid::Uuid;

use super::AppState;
use super::checks::{
    Checks, WriteHeaders, check_account_id, check_amount, check_currency, check_expected_state,
    check_operator_reason, check_reference, check_text, checked_payout_write, path_payout, present,
};
use super::cursor::{ListQuery, query_error};
use super::errors::{
    PayoutWrite, account_not_found, not_claimable, payout_not_found, refused, store_error,
};
use super::idempotency::{Create, Reply, Started, create, created, idempotent, kept};
use super::ledger::{PostJob, post_effect, post_single};
use crate::metrics::{BatchKind, Lookup, Metrics, Resource};
use crate::openapi::{FencedParams, WriteParams};
use crate::store::{
    AbandonOutcome, Answer, Audit, Begin, ClaimItem, ClaimOutcome, Contradiction,
    ContradictionKind, CreateItem, CreatePayoutOutcome, GroupCommit, Item, PayStore, PostItem,
    Refusal, ResolveOutcome, Scope, StoreError, StoreResult, Tx,
};

impl Create for CreatePayoutRequest {
    const ROUTE: &'static str = "POST /v1/payouts";

    fn check(&self, checks: &mut Checks) {
        check_account_id(checks, "accountId", &self.account_id);
        check_amount(checks, self.amount_minor);
        check_currency(checks, &self.currency);
        check_reference(checks, "beneficiaryRef", &self.beneficiary_ref);
    }

    async fn effect(&self, conn: &mut PgConnection) -> Result<Reply, ApiError> {
        let outcome = PayStore::create_payout(
            conn,
            self.payout_id,
            &self.account_id,
            self.amount_minor,
            &self.currency,
            &self.beneficiary_ref,
        )
        .await
        .map_err(store_error)?;
        let payout = match outcome {
            CreatePayoutOutcome::Created | CreatePayoutOutcome::Exists => {
                PayStore::payout(conn, self.payout_id)
                    .await
                    .map_err(store_error)?
            }
            _ => None,
        };
        registered(self, outcome, payout)
    }

    /// Grouped with the registrations that queue behind a running one
    /// (docs/design.md#group-commit).
    async fn run(state: AppState, scope: Scope, body: Self) -> Response {
        let (payout_id, account_id) = (body.payout_id, body.account_id.clone());
        let response = grouped(state.clone(), |b| &b.creates, CreateJob { scope, body }).await;
        // 201, fresh or replayed, is this very body's payout: its account is the one to prove
        // the payout's writes against.
        if response.status() == StatusCode::CREATED {
            state.store.remember_account(payout_id, account_id);
        }
        response
    }
}

/// The answer to a registration, alone or in a batch: `payout` is the payout as the
/// registration's transaction sees it.
fn registered(
    body: &CreatePayoutRequest,
    outcome: CreatePayoutOutcome,
    payout: Option<Payout>,
) -> Result<Reply, ApiError> {
    match outcome {
        CreatePayoutOutcome::Created | CreatePayoutOutcome::Exists => {}
        CreatePayoutOutcome::Conflict => {
            return Err(ApiError::new(
                ErrorCode::IdempotencyConflict,
                format!(
                    "payout {} already exists with a different body",
                    body.payout_id
                ),
            )
            .with_details(json!({ "payoutId": body.payout_id })));
        }
        CreatePayoutOutcome::AccountUnknown => return Err(account_not_found(&body.account_id)),
        CreatePayoutOutcome::CurrencyMismatch => {
            return Err(ApiError::field(
                "currency",
                "differs from the account's currency",
            ));
        }
    }
    created(Ok(payout), "payout")
}

/// Registers a payout.
#[utoipa::path(post, path = "/v1/payouts", request_body = CreatePayoutRequest,
    params(WriteParams),
    responses((status = 201, body = Payout), Invalid, Unauthorized, Idempotent, NotLeader,
        (status = 404, description = "NOT_FOUND: account", body = ErrorBody),
        (status = 422, description = "IDEMPOTENCY_CONFLICT, or LIMIT_EXCEEDED: above the account's largest single payout (docs/contract.md#account-limits); nothing changed", body = ErrorBody),
    ))]
pub(super) async fn create_payout(
    state: State<AppState>,
    caller: Caller,
    headers: HeaderMap,
    body: Json<CreatePayoutRequest>,
) -> Result<Response, ApiError> {
    create(state, caller, headers, body).await
}

/// A registration, checked, waiting for its transaction.
pub(super) struct CreateJob {
    scope: Scope,
    body: CreatePayoutRequest,
}

/// A registration in a transaction of its own, as every [`Create`].
async fn create_single(state: &AppState, job: &CreateJob) -> Response {
    idempotent!(state, &job.scope, |conn| job.body.effect(conn).await)
}

/// P1: lists payouts.
#[utoipa::path(get, path = "/v1/payouts",
    params(("state" = Option<PayoutState>, Query), ("accountId" = Option<String>, Query),
           ("limit" = Option<i64>, Query, description = "1 to 500, default 100"), ("cursor" = Option<String>, Query)),
    responses((status = 200, body = PayoutPage), Invalid, NotLeader))]
pub(super) async fn list_payouts(
    State(state): State<AppState>,
    query: Result<Query<ListQuery>, QueryRejection>,
) -> Result<Response, ApiError> {
    let Query(query) = query.map_err(query_error)?;
    let page = query.check()?;
    let items = state
        .store
        .list_payouts(
            page.state,
            page.account_id.as_deref(),
            page.limit,
            page.after,
        )
        .await
        .map_err(store_error)?;
    Ok(json_response(StatusCode::OK, &page.answer(items)))
}

/// P4: a payout (advisory).
#[utoipa::path(get, path = "/v1/payouts/{payout_id}", params(("payoutId" = String, Path)),
    responses((status = 200, body = Payout), Invalid, NotFound, NotLeader))]
pub(super) async fn get_payout(
    State(state): State<AppState>,
    Path(payout_id): Path<String>,
) -> Result<Response, ApiError> {
    let mut checks = Checks::default();
    let payout_id = path_payout(&mut checks, &payout_id);
    checks.done()?;
    let payout_id = present(payout_id)?;
    let read = if state.config.batch_max == 1 {
        state.store.read_payout(payout_id).await
    } else {
        // Grouped with the reads that queue behind a running one (docs/design.md#group-commit).
        let batches = state.batches.clone();
        batches
            .reads
            .submit(state.clone(), payout_id)
            .await
            .unwrap_or_else(|| {
                Err(StoreError::NotLeader(
                    "the grouped read stopped without an answer".into(),
                ))
            })
    };
    match read.map_err(store_error)? {
        Some(payout) => Ok(json_response(StatusCode::OK, &payout)),
        None => Err(payout_not_found(payout_id)),
    }
}

/// docs/design.md#d-8: with proof keys configured, a claim or post must carry the lock server's
/// proof of its token on `payout:{accountId}` of the payout's account. Checked before the
/// idempotency record and before any fence, so a refused write leaves nothing behind. A payout
/// that does not exist is 404, as the write itself would answer. Returns the account the proof
/// was checked against (`None` without proof keys).
async fn prove(
    state: &AppState,
    headers: &HeaderMap,
    payout_id: Uuid,
    token: i64,
) -> Result<Option<String>, ApiError> {
    let Some(keys) = &state.config.proof_keys else {
        return Ok(None);
    };
    let account_id = state
        .store
        .payout_account(payout_id)
        .await
        .map_err(store_error)?
        .ok_or_else(|| payout_not_found(payout_id))?;
    keys.require(
        headers,
        &dlock_contract::proof::payout_lock_key(&account_id),
        token,
    )?;
    Ok(Some(account_id))
}

/// A fenced write on the payout of the path (a claim, a post, a cancel): its checked headers,
/// its payout and the token it presents, proven as [`prove`] asks.
pub(super) struct Fenced {
    pub(super) write: WriteHeaders,
    pub(super) payout_id: Uuid,
    pub(super) token: i64,
    /// The account the proof was checked against, when it was (proof keys are configured): the
    /// payment resource keeps a payout's account ([`PayStore::payout_account`]), and
    /// [`Fenced::written_on`] holds paydb's write to it.
    proven_on: Option<String>,
}

impl Fenced {
    /// The write's token, its checks (`body` checks its body) and its proof, in that order.
    pub(super) async fn check(
        state: &AppState,
        headers: &HeaderMap,
        path: &str,
        body: impl FnOnce(&mut Checks),
    ) -> Result<Self, ApiError> {
        let token = headers::fencing_token(headers)?;
        let (write, payout_id) = checked_payout_write(headers, path, body)?;
        let proven_on = prove(state, headers, payout_id, token).await?;
        Ok(Self {
            write,
            payout_id,
            token,
            proven_on,
        })
    }

    /// Whether the token's proof was verified: paydb then records the token as one the account
    /// admitted (`accounts.max_seen_token`), below which no recovery may lower the fence.
    pub(super) fn proven(&self) -> bool {
        self.proven_on.is_some()
    }

    /// A write paydb admitted on `account_id` (from the write's own answer) stands only if that
    /// is the account the proof was checked against. They differ only when the kept account was
    /// stale: a payout lost with a failover's last commits and registered again on another
    /// account. Then the write is answered 503, so it is rolled back, record included; the kept
    /// account is forgotten, and the caller's retry is checked against the payout's account as
    /// paydb has it now.
    pub(super) fn written_on(&self, state: &AppState, account_id: &str) -> Result<(), ApiError> {
        match &self.proven_on {
            Some(proven) if proven != account_id => {
                state.store.forget_account(self.payout_id);
                tracing::warn!(event = "proof_account_stale", payout_id = %self.payout_id, proven_on = %proven, account_id = %account_id, token = self.token, "the account a proof was checked against is not the payout's in paydb; the write is rolled back and the account read again");
                Err(ApiError::new(
                    ErrorCode::NotLeader,
                    format!(
                        "payout {} belongs to another account than the one its proof was checked \
                         against; nothing was written, retry",
                        self.payout_id
                    ),
                ))
            }
            _ => Ok(()),
        }
    }

    /// The answer when paydb refused the write: the payout was not `wanted`, or `resource`'s
    /// fence stands above the token.
    pub(super) fn refused(
        &self,
        state: &AppState,
        refusal: Refusal,
        resource: Resource,
        wanted: &str,
    ) -> ApiError {
        let on = PayoutWrite {
            resource,
            payout_id: self.payout_id,
            token: self.token,
            wanted,
            write: &self.write,
        };
        refused(state, refusal, &on)
    }
}

/// P2: a fenced claim.
#[utoipa::path(post, path = "/v1/payouts/{payout_id}/claim", request_body = ClaimRequest,
    params(("payoutId" = String, Path), FencedParams, WriteParams),
    responses((status = 200, body = ClaimResponse), InvalidToken, Unauthorized, NotFound, Idempotent, NotLeader,
        (status = 409, description = "FENCED_OUT or PAYOUT_NOT_CLAIMABLE (also when the payout is out of attempts, payment.payout.max-attempts: it is then ABANDONED)", body = ErrorBody),
        (status = 422, description = "INSUFFICIENT_FUNDS, IDEMPOTENCY_CONFLICT, or LIMIT_EXCEEDED: above the account's largest single payout or its outflow for the UTC day (docs/contract.md#account-limits; nothing changed)", body = ErrorBody),
    ))]
pub(super) async fn claim(
    State(state): State<AppState>,
    PathWrite((), payout_id, headers, body): PathWrite<ClaimRequest>,
) -> Result<Response, ApiError> {
    let on = Fenced::check(&state, &headers, &payout_id, |checks| {
        check_expected_state(
            checks,
            body.expected_state,
            "must be PENDING, or CLAIMED for a recovery re-claim",
        );
    })
    .await?;
    let route = format!("POST /v1/payouts/{}/claim", on.payout_id);
    let scope = state.scope(route, &on.write, on.token, &body, false)?;
    let job = ClaimJob {
        on,
        scope,
        expected: body.expected_state,
    };
    Ok(grouped(state, |b| &b.claims, job).await)
}

/// A claim, checked and proven, waiting for its transaction.
pub(super) struct ClaimJob {
    on: Fenced,
    scope: Scope,
    expected: PayoutState,
}

/// A request waiting in a group-commit queue: its idempotency scope, and how it runs alone.
pub(super) trait BatchJob: Sync {
    fn scope(&self) -> &Scope;
    /// The request in a transaction of its own.
    fn single<'a>(&'a self, state: &'a AppState) -> impl Future<Output = Response> + Send + 'a;
}

impl BatchJob for CreateJob {
    fn scope(&self) -> &Scope {
        &self.scope
    }
    fn single<'a>(&'a self, state: &'a AppState) -> impl Future<Output = Response> + Send + 'a {
        create_single(state, self)
    }
}

impl BatchJob for ClaimJob {
    fn scope(&self) -> &Scope {
        &self.scope
    }
    fn single<'a>(&'a self, state: &'a AppState) -> impl Future<Output = Response> + Send + 'a {
        claim_single(state, self)
    }
}

impl BatchJob for super::ledger::PostJob {
    fn scope(&self) -> &Scope {
        &self.scope
    }
    fn single<'a>(&'a self, state: &'a AppState) -> impl Future<Output = Response> + Send + 'a {
        post_single(state, self)
    }
}

/// A claim in a transaction of its own: the idempotency record and the claim in one call
/// (`pay_claim_once`).
async fn claim_single(state: &AppState, job: &ClaimJob) -> Response {
    let (on, scope, expected) = (&job.on, &job.scope, job.expected);
    let (payout_id, proven, max_attempts) = (on.payout_id, on.proven(), state.config.max_attempts);
    let claim =
        |tx, wait| PayStore::claim_once(tx, scope, wait, payout_id, expected, max_attempts, proven);
    let answer = |outcome| claim_effect(state, outcome, on, expected);
    state.once(scope, claim, answer).await
}

fn claim_effect(
    state: &AppState,
    outcome: ClaimOutcome,
    on: &Fenced,
    expected_state: PayoutState,
) -> Result<Reply, ApiError> {
    let (payout_id, token, write) = (on.payout_id, on.token, &on.write);
    if let ClaimOutcome::Claimed { account_id, .. }
    | ClaimOutcome::Abandoned { account_id, .. }
    | ClaimOutcome::InsufficientFunds { account_id, .. } = &outcome
    {
        on.written_on(state, account_id)?;
    }
    match outcome {
        ClaimOutcome::Claimed {
            account_id,
            claim_token,
            fence,
            attempt_count,
        } => {
            claimed_by(token, claim_token, fence)?;
            let response = ClaimResponse {
                payout_id,
                state: PayoutState::Claimed,
                claim_token,
                account_fence: fence,
                attempt_count,
                idempotency_key: write.key.clone(),
            };
            tracing::info!(event = "payout_claimed", %payout_id, account_id = %account_id, token, owner = %write.owner_id, attempt_count = response.attempt_count, "payout claimed");
            Reply::json(StatusCode::OK, &response)
        }
        ClaimOutcome::Abandoned {
            account_id,
            attempt_count,
        } => {
            tracing::warn!(event = "payout_abandoned", %payout_id, account_id = %account_id, token, owner = %write.owner_id, attempt_count, cause = "attempts_exhausted", "a payout out of attempts was abandoned instead of claimed again");
            Err(attempts_exhausted(payout_id, attempt_count, expected_state))
        }
        ClaimOutcome::InsufficientFunds {
            account_id,
            available_minor,
            amount_minor,
        } => {
            tracing::info!(event = "payout_insufficient_funds", %payout_id, account_id = %account_id, owner = %write.owner_id, "claim refused for insufficient funds; payout FAILED");
            Err(insufficient_funds(json!({
                "payoutId": payout_id, "accountId": account_id, "state": PayoutState::Failed,
                "availableMinor": available_minor, "amountMinor": amount_minor,
            })))
        }
        ClaimOutcome::Refused(refusal) => {
            Err(on.refused(state, refusal, Resource::account, expected_state.as_str()))
        }
    }
}

/// The claim was granted to the caller's token, and the account's fence now stands at it.
fn claimed_by(token: i64, claim_token: i64, fence: i64) -> Result<(), ApiError> {
    ApiError::invariant(
        claim_token == token && fence == token,
        "a claim answers with the caller's token as the claim token and the account's fence",
    )
}

/// A claim that found the account's available balance short: the payout is FAILED.
fn insufficient_funds(details: serde_json::Value) -> ApiError {
    ApiError::new(
        ErrorCode::InsufficientFunds,
        "the account's available balance (balance minus holds) does not cover the payout; it is now FAILED",
    )
    .with_details(details)
}

/// A claim that found its payout out of attempts: it abandoned it instead.
fn attempts_exhausted(payout_id: Uuid, attempts: i32, expected_state: PayoutState) -> ApiError {
    ApiError::new(
                ErrorCode::PayoutNotClaimable,
                format!(
                    "payout {payout_id} was claimed {attempts} times, the most this service allows (payment.payout.max-attempts); it is now ABANDONED and nothing will pay it, retrying changes nothing"
                ),
            )
            .with_details(json!({
                "payoutId": payout_id,
                "state": PayoutState::Abandoned,
                "requiredState": expected_state.as_str(),
                "attemptCount": attempts,
                "cause": "attempts_exhausted",
            }))
}

/// Out-of-band resolution of a RAIL_AMBIGUOUS payout (operator).
///
/// It must agree with what the rail proxy recorded for the payout's attempt: POSTED names the
/// reference the rail acknowledged, FAILED is refused after an acknowledgement, POSTED after a
/// decline (400 VALIDATION_FAILED naming the field and both references; nothing changed).
#[utoipa::path(post, path = "/v1/payouts/{payout_id}/resolve", request_body = ResolveRequest,
    params(("payoutId" = String, Path), WriteParams),
    responses((status = 200, body = ResolveResponse), Invalid, Unauthorized, NotFound, Idempotent, NotLeader,
        (status = 409, description = "PAYOUT_NOT_CLAIMABLE", body = ErrorBody),
    ))]
pub(super) async fn resolve(
    State(state): State<AppState>,
    PathWrite(caller, payout_id, headers, body): PathWrite<ResolveRequest, Caller>,
) -> Result<Response, ApiError> {
    let identity = caller.operator("resolution")?;
    let (write, payout_id) = checked_payout_write(&headers, &payout_id, |checks| {
        match (&body.outcome, &body.rail_reference) {
            (_, Some(reference)) => check_reference(checks, "railReference", reference),
            (Resolution::Posted, None) => checks.check(
                false,
                "railReference",
                "is required to resolve POSTED: the rail's statement names the transfer",
            ),
            (Resolution::Failed, None) => {}
        }
        check_text(checks, "operator", &body.operator, 1, OPERATOR_LEN_MAX);
        check_text(checks, "evidence", &body.evidence, 1, REASON_LEN_MAX);
    })?;
    let route = format!("POST /v1/payouts/{payout_id}/resolve");
    let scope = state.scope(route, &write, 0, &body, true)?;
    Ok(idempotent!(&state, scope, |conn| {
        resolve_effect(conn, payout_id, &body, &write, &identity).await
    }))
}

async fn resolve_effect(
    conn: &mut PgConnection,
    payout_id: Uuid,
    body: &ResolveRequest,
    write: &WriteHeaders,
    identity: &str,
) -> Result<Reply, ApiError> {
    let outcome = match body.outcome {
        Resolution::Posted => PayoutState::Posted,
        Resolution::Failed => PayoutState::Failed,
    };
    let resolved = PayStore::resolve(
        conn,
        payout_id,
        outcome,
        body.rail_reference.as_deref(),
        &Audit::new(&body.operator, &body.evidence, identity, &write.owner_id),
    )
    .await
    .map_err(store_error)?;
    match resolved {
        ResolveOutcome::Resolved {
            state,
            balance_minor,
        } => {
            let entries = if outcome == PayoutState::Posted {
                PayStore::entries(conn, &format!("payout:{payout_id}"), true)
                    .await
                    .map_err(store_error)?
            } else {
                Vec::new()
            };
            tracing::warn!(event = "rail_ambiguous_resolved", %payout_id, outcome = outcome.as_str(), operator = %body.operator.trim(), identity, owner = %write.owner_id, "an ambiguous payout was resolved out of band");
            Reply::json(
                StatusCode::OK,
                &ResolveResponse {
                    payout_id,
                    state,
                    entries,
                    balance_minor,
                    operator: body.operator.trim().to_owned(),
                    identity: identity.to_owned(),
                },
            )
        }
        ResolveOutcome::NotClaimable { state } => {
            Err(not_claimable(payout_id, state.as_deref(), "RAIL_AMBIGUOUS"))
        }
        ResolveOutcome::Contradicted(record) => {
            tracing::warn!(event = "rail_ambiguous_resolution_refused", %payout_id, outcome = outcome.as_str(), rail_reference = ?body.rail_reference, recorded_outcome = ?record.recorded_outcome, recorded_reference = ?record.recorded_reference, operator = %body.operator.trim(), identity, owner = %write.owner_id, "a resolution contradicting the rail proxy's record was refused");
            Err(contradicted(payout_id, body, &record))
        }
        ResolveOutcome::NotFound => Err(payout_not_found(payout_id)),
    }
}

/// `400 VALIDATION_FAILED`: the resolution contradicts what the rail proxy recorded for the
/// payout's attempt (docs/contract.md#resolve-evidence). Names the field at fault, what was asked
/// and what was recorded; nothing changed.
fn contradicted(payout_id: Uuid, body: &ResolveRequest, record: &Contradiction) -> ApiError {
    let recorded = record.recorded_reference.as_deref().unwrap_or_default();
    let asked = body.rail_reference.as_deref().unwrap_or_default();
    let (field, reason) = match record.kind {
        ContradictionKind::ReferenceMismatch => (
            "railReference",
            format!(
                "the rail acknowledged this payout's submission as `{recorded}` (recorded by the rail proxy), not `{asked}`: resolve POSTED with `{recorded}`"
            ),
        ),
        ContradictionKind::RailAcked => (
            "outcome",
            format!(
                "the rail acknowledged this payout's submission as `{recorded}` (recorded by the rail proxy): the money moved, so FAILED is refused; resolve POSTED with `{recorded}`"
            ),
        ),
        ContradictionKind::RailRejected => (
            "outcome",
            "the rail declined this payout's submission (recorded by the rail proxy): the money did not move, so POSTED is refused; resolve FAILED".to_owned(),
        ),
        ContradictionKind::ReferenceTaken => (
            "railReference",
            format!(
                "`{asked}` is the rail's reference of another payout (acknowledged by the rail or resolved for it): a reference names one payout; resolve POSTED with this payout's own reference"
            ),
        ),
        ContradictionKind::NoAbsentFinding if !recorded.is_empty() => (
            "outcome",
            format!(
                "dlock reconcile found this payout on the rail's statement as `{recorded}`: FAILED is refused; resolve POSTED with `{recorded}`"
            ),
        ),
        ContradictionKind::NoAbsentFinding => (
            "outcome",
            "nobody recorded the rail's answer to this payout's submission and no reconciler finding shows it absent from a statement read the settlement window after the attempt: run dlock reconcile after the settlement window, then resolve FAILED".to_owned(),
        ),
        ContradictionKind::NoPresentFinding => (
            "railReference",
            format!(
                "nobody recorded the rail's answer to this payout's submission and no reconciler finding shows it on the rail's statement as `{asked}`: run dlock reconcile, then resolve POSTED with the reference it found"
            ),
        ),
    };
    let fields = vec![FieldError::new(field, reason.clone())];
    ApiError::new(
        ErrorCode::ValidationFailed,
        format!("{field}: {reason}; nothing was changed"),
    )
    .with_details(json!({
        "fields": fields,
        "payoutId": payout_id,
        "submissionId": record.submission_id,
        "railReference": body.rail_reference,
        "recordedOutcome": record.recorded_outcome,
        "recordedReference": record.recorded_reference,
    }))
}

/// Cancels a payout, PENDING | CLAIMED → ABANDONED (operator; a fenced write like a claim,
/// strict, the fence advances; docs/contract.md#cancel). Refused by paydb once an attempt
/// reached the rail proxy; recorded in payout_abandonments.
#[utoipa::path(post, path = "/v1/payouts/{payout_id}/cancel", request_body = CancelRequest,
    params(("payoutId" = String, Path), ("X-Fencing-Token" = String, Header, description = "a grant on payout:{accountId}, decimal int64 > 0"),
           ("X-Fencing-Proof" = Option<String>, Header, description = "the grant's fencingProof; required when fencing.proof-keys-file is set, else INVALID_TOKEN"),
           WriteParams),
    responses((status = 200, body = Cancelled), InvalidToken, Unauthorized, NotFound, Idempotent, NotLeader,
        (status = 409, description = "FENCED_OUT or PAYOUT_NOT_CLAIMABLE", body = ErrorBody),
    ))]
// A dlock extension beyond P1–P5 (docs/contract.md#cancel): the `cancel` transition, PENDING |
// CLAIMED → ABANDONED. Operator only, and a fenced write like a claim (X-Fencing-Token of a
// grant on `payout:{accountId}`, with its proof when proof keys are configured): strict
// `fence < token`, the fence advances, so no older holder can act on the payout afterwards.
// paydb refuses it once an attempt reached the rail proxy, and records it in
// `payout_abandonments`.
pub(super) async fn cancel(
    State(state): State<AppState>,
    PathWrite(caller, payout_id, headers, body): PathWrite<CancelRequest, Caller>,
) -> Result<Response, ApiError> {
    let identity = caller.operator("cancelling a payout")?;
    let on = Fenced::check(&state, &headers, &payout_id, |checks| {
        check_expected_state(
            checks,
            body.expected_state,
            "must be PENDING or CLAIMED: only a payout that never reached the rail can be cancelled",
        );
        check_operator_reason(checks, &body.operator, &body.reason);
    })
    .await?;
    let route = format!("POST /v1/payouts/{}/cancel", on.payout_id);
    let scope = state.scope(route, &on.write, on.token, &body, false)?;
    Ok(idempotent!(&state, scope, |conn| {
        cancel_effect(&state, conn, &on, &body, &identity).await
    }))
}

async fn cancel_effect(
    state: &AppState,
    conn: &mut PgConnection,
    on: &Fenced,
    body: &CancelRequest,
    identity: &str,
) -> Result<Reply, ApiError> {
    let (payout_id, token, write) = (on.payout_id, on.token, &on.write);
    let audit = Audit::new(&body.operator, &body.reason, identity, &write.owner_id);
    let outcome = PayStore::abandon(
        conn,
        payout_id,
        token,
        body.expected_state,
        on.proven(),
        &audit,
    )
    .await
    .map_err(store_error)?;
    if let AbandonOutcome::Abandoned { account_id, .. } = &outcome {
        on.written_on(state, account_id)?;
    }
    match outcome {
        AbandonOutcome::Abandoned {
            account_id,
            fence,
            attempt_count,
        } => {
            let response = Cancelled {
                payout_id,
                state: PayoutState::Abandoned,
                account_fence: fence,
                attempt_count,
                operator: audit.operator.to_owned(),
                identity: identity.to_owned(),
            };
            tracing::warn!(event = "payout_abandoned", %payout_id, account_id = %account_id, token, owner = %write.owner_id, operator = %audit.operator, identity, cause = "cancelled", "a payout was cancelled; it is ABANDONED and nothing will pay it");
            Reply::json(StatusCode::OK, &response)
        }
        AbandonOutcome::Refused(refusal) => Err(on.refused(
            state,
            refusal,
            Resource::account,
            body.expected_state.as_str(),
        )),
    }
}

// ---------------------------------------------------------------------------------------------
// Group commit (docs/design.md#group-commit)
// ---------------------------------------------------------------------------------------------

/// The queues of the group-committed writes, one per kind.
pub struct Batches {
    creates: GroupCommit<AppState, CreateJob, Response>,
    claims: GroupCommit<AppState, ClaimJob, Response>,
    pub(super) posts: GroupCommit<AppState, PostJob, Response>,
    reads: GroupCommit<AppState, Uuid, StoreResult<Option<Payout>>>,
}

impl Batches {
    pub fn new(max: usize, metrics: &Arc<Metrics>) -> Self {
        let gauge = |kind| {
            let metrics = metrics.clone();
            crate::store::queue_gauge(move |n| metrics.queued(kind, n))
        };
        Self {
            // One registration per payout and per idempotency key in a transaction.
            creates: GroupCommit::new(
                max,
                |job: &CreateJob| vec![job.body.payout_id.to_string(), job.scope.key.clone()],
                |state, jobs| Box::pin(batched(state, BatchKind::register, jobs, creates_batch)),
                gauge(BatchKind::register),
            ),
            claims: GroupCommit::new(
                max,
                |job: &ClaimJob| vec![job.on.payout_id.to_string()],
                |state, jobs| Box::pin(batched(state, BatchKind::claim, jobs, claims_batch)),
                gauge(BatchKind::claim),
            ),
            posts: GroupCommit::new(
                max,
                |job: &PostJob| vec![job.on.payout_id.to_string()],
                |state, jobs| Box::pin(batched(state, BatchKind::post, jobs, posts_batch)),
                gauge(BatchKind::post),
            ),
            reads: GroupCommit::new(
                max,
                |id: &Uuid| vec![id.to_string()],
                |state, ids| Box::pin(async move { reads_batch(&state, ids).await }),
                gauge(BatchKind::read),
            ),
        }
    }
}

/// Runs `job` through its group-commit queue (`queue` picks it), or alone when group commit is
/// off (`payment.batch.max = 1`, one transaction per request).
pub(super) async fn grouped<J: BatchJob + Send + 'static>(
    state: AppState,
    queue: fn(&Batches) -> &GroupCommit<AppState, J, Response>,
    job: J,
) -> Response {
    if state.config.batch_max == 1 {
        return job.single(&state).await;
    }
    let batches = state.batches.clone();
    queue(&batches)
        .submit(state, job)
        .await
        .unwrap_or_else(batch_lost)
}

/// The answer when a batch's task died without answering (a bug): retry-safe, as nothing of
/// an unanswered batch is committed after its answers are lost.
pub(super) fn batch_lost() -> Response {
    ApiError::new(
        ErrorCode::NotLeader,
        "the transaction this request was grouped in stopped without an answer; retry",
    )
    .into_response()
}

/// What an item of a batch gets once its verdict is read.
enum Settled {
    /// A fresh effect's answer, stored with the batch.
    Store(Reply),
    /// A replayed or refused answer (nothing to store).
    Done(Response),
    /// Run again on the single path after the batch commits.
    Single,
    /// Its answer keeps nothing (a server fault, [`kept`]): the single path rolls that back, so
    /// the whole batch is rolled back and every item runs on the single path.
    Poison,
}

fn settle<T>(
    state: &AppState,
    scope: &Scope,
    verdict: Item<T>,
    answer: impl FnOnce(T) -> Result<Reply, ApiError>,
) -> Settled {
    let done = |begun| match state.started(scope, Ok(begun)) {
        Ok(Started::Done(response)) => Settled::Done(response),
        Ok(Started::Fresh(_)) => Settled::Single,
        Err(error) => Settled::Done(error.into_response()),
    };
    match verdict {
        Item::Fresh(outcome) => {
            state.metrics.lookup(Lookup::miss);
            match kept(answer(outcome)) {
                Ok(reply) => Settled::Store(reply),
                Err(_) => Settled::Poison,
            }
        }
        Item::Replay { status, body } => done(Begin::Replay { status, body }),
        Item::Conflict => done(Begin::Conflict),
        // The single path answers these as it always does: 404, the in-progress 429, or
        // whatever rolled the item back (a CHECK, a limit).
        Item::NotFound | Item::Failed(_) => Settled::Single,
    }
}

/// Every item of a batch that failed as a whole: 503, retry-safe, nothing was written (it was
/// one transaction).
fn batch_failed(state: &AppState, kind: BatchKind, n: usize, error: &StoreError) -> Vec<Response> {
    tracing::warn!(event = "payment_batch_failed", kind = ?kind, size = n, error = %error, "a group-committed transaction failed; every request in it is answered 503 and nothing was written");
    let _ = state;
    (0..n)
        .map(|_| {
            ApiError::new(
                ErrorCode::NotLeader,
                "paydb failed the transaction this request was grouped in; nothing was written, retry",
            )
            .into_response()
        })
        .collect()
}

/// Settles each item's verdict (`answer` turns a fresh item's outcome into its reply), stores
/// the settled answers and commits; then the items that run on the single path do. A batch
/// whose statement failed fails every item.
async fn commit_batch<J: BatchJob, T>(
    state: &AppState,
    kind: BatchKind,
    jobs: &[J],
    verdicts: StoreResult<(Tx, Vec<Item<T>>)>,
    answer: impl Fn(&J, T) -> Result<Reply, ApiError>,
) -> Vec<Response> {
    let (tx, verdicts) = match verdicts {
        Ok(v) => v,
        Err(error) => return batch_failed(state, kind, jobs.len(), &error),
    };
    let settled: Vec<Settled> = jobs
        .iter()
        .zip(verdicts)
        .map(|(job, verdict)| settle(state, job.scope(), verdict, |outcome| answer(job, outcome)))
        .collect();
    let poisoned = settled.iter().any(|s| matches!(s, Settled::Poison));
    let answers = match poisoned {
        true => {
            drop(tx);
            jobs.iter().map(|_| None).collect()
        }
        false => match finish(state, kind, tx, jobs, settled).await {
            Ok(answers) => answers,
            Err(failed) => return failed,
        },
    };
    let mut out = Vec::with_capacity(jobs.len());
    for (job, answer) in jobs.iter().zip(answers) {
        out.push(match answer {
            Some(response) => response,
            None => job.single(state).await,
        });
    }
    out
}

/// Records the batch's stored answers and commits; the answers, `None` where the item goes to
/// the single path.
async fn finish<J: BatchJob>(
    state: &AppState,
    kind: BatchKind,
    tx: Tx,
    jobs: &[J],
    settled: Vec<Settled>,
) -> Result<Vec<Option<Response>>, Vec<Response>> {
    let answers: Vec<Answer> = jobs
        .iter()
        .zip(&settled)
        .filter_map(|(job, s)| match s {
            Settled::Store(reply) => Some(Answer {
                scope: job.scope(),
                status: reply.status.as_u16(),
                body: &reply.body,
            }),
            _ => None,
        })
        .collect();
    if let Err(error) = state.store.finish_many(tx, &answers).await {
        return Err(batch_failed(state, kind, jobs.len(), &error));
    }
    Ok(settled
        .into_iter()
        .map(|s| match s {
            Settled::Store(reply) => Some(reply.into_response(false)),
            Settled::Done(response) => Some(response),
            Settled::Single | Settled::Poison => None,
        })
        .collect())
}

/// Runs a group-committed batch of `kind`, counted in the metrics: a job alone runs as its single
/// request, several run through `many` (the batch statement).
async fn batched<J: BatchJob>(
    state: AppState,
    kind: BatchKind,
    jobs: Vec<J>,
    many: impl AsyncFnOnce(&AppState, Vec<J>) -> Vec<Response>,
) -> Vec<Response> {
    state.metrics.batch(kind, jobs.len());
    if let [job] = jobs.as_slice() {
        return vec![job.single(&state).await];
    }
    many(&state, jobs).await
}

async fn creates_batch(state: &AppState, jobs: Vec<CreateJob>) -> Vec<Response> {
    let items: Vec<CreateItem> = jobs
        .iter()
        .map(|job| CreateItem {
            scope: &job.scope,
            payout_id: job.body.payout_id,
            account_id: &job.body.account_id,
            amount_minor: job.body.amount_minor,
            currency: &job.body.currency,
            beneficiary_ref: &job.body.beneficiary_ref,
        })
        .collect();
    let wait_ms = state.config.idempotency.in_progress_wait_ms;
    let verdicts = state.store.create_many(&items, wait_ms).await;
    commit_batch(
        state,
        BatchKind::register,
        &jobs,
        verdicts,
        |job, (outcome, payout)| registered(&job.body, outcome, payout),
    )
    .await
}

async fn claims_batch(state: &AppState, jobs: Vec<ClaimJob>) -> Vec<Response> {
    let items: Vec<ClaimItem> = jobs
        .iter()
        .map(|job| ClaimItem {
            scope: &job.scope,
            payout_id: job.on.payout_id,
            expected_state: job.expected,
        })
        .collect();
    let config = &state.config;
    let verdicts = state
        .store
        .claim_many(
            &items,
            config.idempotency.in_progress_wait_ms,
            config.max_attempts,
            config.proof_keys.is_some(),
        )
        .await;
    commit_batch(state, BatchKind::claim, &jobs, verdicts, |job, outcome| {
        claim_effect(state, outcome, &job.on, job.expected)
    })
    .await
}

async fn posts_batch(state: &AppState, jobs: Vec<PostJob>) -> Vec<Response> {
    let items: Vec<PostItem> = jobs
        .iter()
        .map(|job| PostItem {
            scope: &job.scope,
            payout_id: job.on.payout_id,
            rail_reference: &job.rail_reference,
            submission_id: job.submission_id,
        })
        .collect();
    let config = &state.config;
    let verdicts = state
        .store
        .post_many(
            &items,
            config.idempotency.in_progress_wait_ms,
            config.proof_keys.is_some(),
        )
        .await;
    commit_batch(
        state,
        BatchKind::post,
        &jobs,
        verdicts,
        |job, (outcome, entries)| post_effect(state, outcome, entries, &job.on),
    )
    .await
}

/// P4 of every queued payout in one statement (one snapshot); each read gets its own payout, or
/// `None`, or the statement's error.
async fn reads_batch(state: &AppState, ids: Vec<Uuid>) -> Vec<StoreResult<Option<Payout>>> {
    state.metrics.batch(BatchKind::read, ids.len());
    match state.store.read_payouts(&ids).await {
        Ok(payouts) => ids
            .iter()
            .map(|id| Ok(payouts.iter().find(|p| p.payout_id == *id).cloned()))
            .collect(),
        Err(error) => ids.iter().map(|_| Err(error.clone())).collect(),
    }
}
