//! `POST /v1/rail/submissions`: the request checked, then admission (`rail_admit`: the durable
//! high-water mark, strict, then one presented attempt per payout, then the intent row, all
//! committed before the forward), the single forward, and its record.

use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::Response;
use dlock_contract::error::{ApiError, ErrorBody, ErrorCode, FieldError};
use dlock_contract::headers;
use dlock_contract::json::Json;
use dlock_contract::rail::{SubmissionRequest, SubmissionResponse};
use dlock_server::openapi::{InvalidToken, RailUnavailable, Unauthorized};
use serde_json::json;
use tracing::Instrument;
use uuid::Uuid;

use std::future::Future;
use std::pin::Pin;

use dlock_server::group_commit::GroupCommit;
use sqlx::PgPool;

use crate::AppState;
use crate::metrics::SubmissionOutcome;
use crate::record::{Caller, record_answer, recovery_required, replay, unavailable};
use crate::store::{self, Admission, AdmitItem, StoreError};

/// The admissions' group commit (docs/design.md#group-commit): paydb and whether every token
/// came with a verified proof, the submission, what `rail_admit` decided for it.
pub(crate) type Admissions = GroupCommit<(PgPool, bool), AdmitItem, Admitted>;

/// What `rail_admit` decided for one submission, or why it could not.
type Admitted = Result<Admission, StoreError>;

/// One admission transaction: a lone submission through `rail_admit`, as without batching; more
/// through `rail_admit_many`, one statement and one commit. A failed statement is every item's
/// failure: nothing of the batch was written, so nothing of it is forwarded.
pub(crate) fn admit_batch(
    (pool, proven): (PgPool, bool),
    items: Vec<AdmitItem>,
) -> Pin<Box<dyn Future<Output = Vec<Admitted>> + Send + 'static>> {
    Box::pin(async move {
        if let [item] = items.as_slice() {
            return vec![
                store::admit(
                    &pool,
                    &item.body,
                    item.token,
                    &item.key,
                    item.submission_id,
                    &item.canonical,
                    proven,
                )
                .await,
            ];
        }
        match store::admit_many(&pool, &items, proven).await {
            Ok(answers) => answers,
            Err(error) => {
                tracing::warn!(
                    event = "rail_admission_batch_failed",
                    size = items.len(),
                    %error,
                    "an admission batch failed as a whole; nothing of it was written or \
                     forwarded, and each of its submissions is answered retry-safe"
                );
                let state = error.sqlstate();
                let message = error.to_string();
                items
                    .iter()
                    .map(|_| {
                        Err(StoreError::Failed {
                            state: state.clone(),
                            message: message.clone(),
                        })
                    })
                    .collect()
            }
        }
    })
}

/// Submits one payout to the rail, once, never retried. The identical request retried (same
/// X-Idempotency-Key, X-Fencing-Token and body) gets the first attempt's answer, status and
/// body, and is never forwarded again.
#[utoipa::path(post, path = "/v1/rail/submissions", request_body = SubmissionRequest,
    params(("X-Fencing-Token" = String, Header, description = "decimal int64 > 0"),
           ("X-Fencing-Proof" = Option<String>, Header, description = "the grant's fencingProof (`<key-id>.<hex>`) on payout:{accountId}; required when fencing.proof-keys-file is set, else INVALID_TOKEN"),
           ("X-Owner-Id" = String, Header), ("X-Idempotency-Key" = String, Header)),
    responses((status = 200, body = SubmissionResponse), InvalidToken, Unauthorized, RailUnavailable,
        (status = 404, description = "NOT_FOUND: payout", body = ErrorBody),
        (status = 409, description = "FENCED_OUT, DUPLICATE_SUBMISSION, PAYOUT_NOT_CLAIMABLE or RAIL_AMBIGUOUS", body = ErrorBody),
        (status = 422, description = "VALIDATION_FAILED: the rail declined; IDEMPOTENCY_CONFLICT: this key and token were already used with another body", body = ErrorBody),
        (status = 429, description = "CONTENTION_EXCEEDED: the identical request's first attempt is still in flight (retry-safe after retryAfterMillis, nothing forwarded again)", body = ErrorBody),
    ))]
pub(crate) async fn submit(
    State(state): State<AppState>,
    headers: HeaderMap,
    Json(body): Json<SubmissionRequest>,
) -> Result<Response, ApiError> {
    let token = headers::fencing_token(&headers)?;
    let mut fields = Vec::new();
    let owner = headers::owner_id(&headers).map_err(|e| fields.push(e)).ok();
    let key = headers::idempotency_key(&headers)
        .map_err(|e| fields.push(e))
        .ok();
    if !fields.is_empty() {
        return Err(ApiError::validation(fields));
    }
    check_body(&body)?;
    // The request's span names the payout, as the payment resource's spans do from their path.
    tracing::Span::current().record("payout.id", tracing::field::display(body.payout_id));
    // docs/design.md#d-8: the token must be one the lock server granted on this account's key.
    // Checked before rail_admit, so a refused submission records nothing and moves no mark.
    if let Some(keys) = &state.config.proof_keys {
        keys.require(
            &headers,
            &dlock_contract::proof::payout_lock_key(&body.account_id),
            token,
        )?;
    }
    let (owner, key) = (owner.unwrap_or_default(), key.unwrap_or_default());
    // Admission, the forward and its record run as their own task: a caller that hangs up or a
    // request deadline drops this handler, never the forward between the rail's answer and its
    // record (an acknowledged transfer left unresolved would be quarantined as ambiguous). The
    // task is tracked, so a shutdown waits for it too (`drain_forwards`).
    let submission = Submission {
        token,
        owner,
        key,
        body,
    };
    let task = admit_and_forward(state.clone(), submission).instrument(tracing::Span::current());
    state.forwards.spawn(task).await.unwrap_or_else(|error| {
        Err(ApiError::internal(format!(
            "the submission task failed: {error}"
        )))
    })
}

/// A checked submission and who presents it.
struct Submission {
    token: i64,
    owner: String,
    key: String,
    body: SubmissionRequest,
}

/// The body by the contract's own rules, the ones the payment resource applies to the payout
/// (`dlock_contract::payment`): a submission the payment resource would refuse as a payout is
/// refused here too, before anything is written.
fn check_body(body: &SubmissionRequest) -> Result<(), ApiError> {
    use dlock_contract::payment::{
        check_account_id, check_amount, check_currency, check_reference,
    };
    let mut checks = dlock_server::checks::Checks::default();
    checks.take(check_account_id("accountId", &body.account_id));
    checks.take(check_amount(body.amount_minor));
    checks.take(check_currency(&body.currency));
    checks.take(check_reference("beneficiaryRef", &body.beneficiary_ref));
    checks.done()
}

/// RAIL_UNAVAILABLE: the intent did not commit, so nothing was presented to the rail.
fn not_admitted(error: impl std::fmt::Display) -> ApiError {
    unavailable(
        "rail_intent_not_committed",
        error,
        "the intent row did not commit; nothing was forwarded",
        "the submission could not be recorded, so nothing was sent to the rail; retry after retryAfterMillis",
    )
}

async fn admit_and_forward(state: AppState, submission: Submission) -> Result<Response, ApiError> {
    let Submission {
        token,
        owner,
        key,
        body,
    } = submission;
    // The canonical request: the parsed body re-serialized, so field order and whitespace do not
    // make another request. paydb keeps only its hash.
    let canonical = serde_json::to_string(&body).map_err(ApiError::internal)?;
    let submission_id = Uuid::new_v4();
    // With proof keys every submission got here with its proof verified (`submit`).
    let proven = state.config.proof_keys.is_some();
    let admitted = match &state.admissions {
        None => {
            store::admit(
                &state.pool,
                &body,
                token,
                &key,
                submission_id,
                &canonical,
                proven,
            )
            .await
        }
        Some(batches) => {
            let item = AdmitItem {
                body: body.clone(),
                token,
                key: key.clone(),
                submission_id,
                canonical,
            };
            batches
                .submit((state.pool.clone(), proven), item)
                .await
                .unwrap_or_else(|| {
                    Err(StoreError::Failed {
                        state: None,
                        message: "the admission batch's task ended without answering".into(),
                    })
                })
        }
    };
    let admission = match admitted {
        Ok(admission) => admission,
        Err(error @ StoreError::Unknown { .. }) => return Err(ApiError::internal(error)),
        Err(error) => return Err(recovery_required(&error).unwrap_or_else(|| not_admitted(error))),
    };
    let caller = Caller {
        token,
        key: &key,
        owner: &owner,
    };
    let payout_id = body.payout_id;
    match admission {
        Admission::Admitted => {}
        Admission::Replay {
            submission_id,
            attempt,
            answer,
        } => return replay(&state, submission_id, attempt, answer, &caller, payout_id).await,
        refused => return Err(refusal(&state, refused, &caller, &body)),
    }
    // The intent is durable. Exactly one forward, never retried.
    let answer = crate::forward::forward(&state, &body).await;
    record_answer(&state, submission_id, payout_id, &caller, answer).await
}

/// The answer to a submission `rail_admit` refused; nothing was forwarded.
fn refusal(
    state: &AppState,
    admission: Admission,
    caller: &Caller<'_>,
    body: &SubmissionRequest,
) -> ApiError {
    let payout_id = body.payout_id;
    match admission {
        Admission::Conflict { submission_id } => conflict(submission_id, caller, payout_id),
        Admission::PayoutUnknown => {
            ApiError::not_found(format!("payout {payout_id} does not exist"))
        }
        Admission::Mismatch { fields } => mismatch(&fields, caller, body),
        Admission::Fenced { resource, highest } => fenced(state, resource, highest, caller, body),
        Admission::Duplicate {
            submission_id,
            attempt,
            state: payout_state,
        } => {
            state.metrics.duplicate_attempted();
            duplicate(submission_id, attempt, payout_state, caller, payout_id)
        }
        Admission::NotClaimable { state } => ApiError::new(
            ErrorCode::PayoutNotClaimable,
            "only a payout CLAIMED with this very token may be submitted",
        )
        .with_details(json!({ "payoutId": payout_id, "state": state })),
        Admission::Admitted | Admission::Replay { .. } => {
            ApiError::internal("an admitted submission was answered as refused")
        }
    }
}

/// VALIDATION_FAILED naming each field of the submission that is not the registered payout's
/// (`rail_admit` compared them in paydb): what reaches the rail is the payout as registered, so a
/// claim on one payout cannot send its money elsewhere or another sum.
fn mismatch(fields: &[String], caller: &Caller<'_>, body: &SubmissionRequest) -> ApiError {
    tracing::warn!(
        event = "rail_submission_mismatch",
        payout_id = %body.payout_id,
        account_id = %body.account_id,
        fields = %fields.join(","),
        presented_token = caller.token,
        owner_id = %caller.owner,
        "a submission that is not the registered payout was refused; nothing was forwarded"
    );
    let named: Vec<FieldError> = fields
        .iter()
        .map(|field| FieldError::new(field, "must be the registered payout's own"))
        .collect();
    if named.is_empty() {
        // rail_admit always names a field; should it not, the payout still is not forwarded.
        return ApiError::validation(vec![FieldError::new(
            "payoutId",
            "accountId, amountMinor, currency and beneficiaryRef must be the payout's own",
        )]);
    }
    ApiError::validation(named)
}

/// FENCED_OUT at the rail: a stale token, so two workers believed they held one lock.
fn fenced(
    state: &AppState,
    resource: String,
    highest: i64,
    caller: &Caller<'_>,
    body: &SubmissionRequest,
) -> ApiError {
    state.metrics.fenced_out(&resource);
    state.metrics.submission(SubmissionOutcome::fenced);
    tracing::error!(
        event = "fenced_out",
        resource = %resource,
        presented_token = caller.token,
        highest_token = highest,
        payout_id = %body.payout_id,
        account_id = %body.account_id,
        idempotency_key = %caller.key,
        owner_id = %caller.owner,
        "a stale token was refused at the rail; two workers believed they held one lock"
    );
    ApiError::fenced_out(
        "a newer holder exists; abort the whole critical section, do not retry",
        &dlock_contract::error::FencedOutDetails {
            presented_token: caller.token,
            highest_token: highest,
            resource_type: Some(resource),
            resource_id: body.account_id.clone(),
            owner_id: caller.owner.to_owned(),
        },
    )
}

/// IDEMPOTENCY_CONFLICT: the key and token came before with another body.
fn conflict(submission_id: Option<Uuid>, caller: &Caller<'_>, payout_id: Uuid) -> ApiError {
    tracing::warn!(
        event = "rail_idempotency_conflict",
        payout_id = %payout_id,
        presented_token = caller.token,
        existing_submission_id = ?submission_id,
        idempotency_key = %caller.key,
        owner_id = %caller.owner,
        "the same idempotency key and token came with another body; nothing was forwarded"
    );
    ApiError::new(
        ErrorCode::IdempotencyConflict,
        "this idempotency key and fencing token were already used with another body; nothing was forwarded",
    )
    .with_details(json!({
        "payoutId": payout_id,
        "submissionId": submission_id,
        "idempotencyKey": caller.key,
    }))
}

/// DUPLICATE_SUBMISSION: the payout has an attempt already; a second one is never presented.
fn duplicate(
    submission_id: Option<Uuid>,
    attempt: Option<String>,
    payout_state: Option<String>,
    caller: &Caller<'_>,
    payout_id: Uuid,
) -> ApiError {
    tracing::error!(
        event = "duplicate_rail_submission_attempted",
        payout_id = %payout_id,
        presented_token = caller.token,
        existing_submission_id = ?submission_id,
        existing_outcome = ?attempt,
        idempotency_key = %caller.key,
        owner_id = %caller.owner,
        "a second submission of one payout was refused; resolve from the existing record"
    );
    ApiError::new(
        ErrorCode::DuplicateSubmission,
        "this payout already has a submission record; resolve from it, never submit again",
    )
    .with_details(json!({
        "payoutId": payout_id,
        "submissionId": submission_id,
        "outcome": attempt,
        "state": payout_state,
    }))
}
