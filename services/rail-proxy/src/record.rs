//! After the forward: what the rail answered, or failed to, is recorded once and answered; an
//! attempt whose outcome is unknown quarantines its payout as RAIL_AMBIGUOUS. The identical
//! retry (docs/contract.md#submit-replay) is answered from that record, never forwarded again.

use axum::http::StatusCode;
use axum::response::Response;
use chrono::Utc;
use dlock_contract::error::{ApiError, ErrorCode};
use dlock_contract::http::json_response;
use dlock_contract::rail::SubmissionResponse;
use dlock_server::idempotency::Reply;
use serde_json::json;
use uuid::Uuid;

use std::future::Future;
use std::pin::Pin;

use dlock_server::group_commit::GroupCommit;
use sqlx::PgPool;

use crate::AppState;
use crate::forward::RailAnswer;
use crate::metrics::SubmissionOutcome;
use crate::store::{self, Attempt, RecordItem, Recorded, StoreError, StoredAnswer};

/// The answer records' group commit (docs/design.md#group-commit): the answers of forwards that
/// finish while a record runs are recorded together in the next.
pub(crate) type Records = GroupCommit<PgPool, RecordItem, RecordOutcome>;

/// The attempt as recorded, or why it could not be.
type RecordOutcome = Result<Recorded, StoreError>;

/// One record transaction: a lone answer through `rail_record`, as without batching; more
/// through `rail_record_many`, one statement and one commit. If that statement fails, each
/// answer is recorded again alone: `rail_record` resolves only an unresolved attempt, so an
/// answer that did commit is read back as it is, and a known answer is not left to be timed out
/// as ambiguous for its neighbours' sake.
pub(crate) fn record_batch(
    pool: PgPool,
    items: Vec<RecordItem>,
) -> Pin<Box<dyn Future<Output = Vec<RecordOutcome>> + Send + 'static>> {
    Box::pin(async move {
        if items.len() > 1 {
            match store::record_many(&pool, &items).await {
                Ok(recorded) => return recorded,
                Err(error) => tracing::warn!(
                    event = "rail_record_batch_failed",
                    size = items.len(),
                    %error,
                    "a record batch failed as a whole; each answer is recorded again alone"
                ),
            }
        }
        let mut recorded = Vec::with_capacity(items.len());
        for item in &items {
            recorded.push(
                store::record(
                    &pool,
                    item.submission_id,
                    item.attempt,
                    item.reference.as_deref(),
                )
                .await,
            );
        }
        recorded
    })
}

/// Records one answer, through the records' queue when there is one.
async fn record(
    state: &AppState,
    submission_id: Uuid,
    attempt: Attempt,
    reference: Option<String>,
) -> Result<Recorded, StoreError> {
    let Some(records) = &state.records else {
        return store::record(&state.pool, submission_id, attempt, reference.as_deref()).await;
    };
    let item = RecordItem {
        submission_id,
        attempt,
        reference,
    };
    records
        .submit(state.pool.clone(), item)
        .await
        .unwrap_or_else(|| {
            Err(StoreError::Failed {
                state: None,
                message: "the record batch's task ended without answering".into(),
            })
        })
}

/// Who made an attempt, for the answer and the log.
pub(crate) struct Caller<'a> {
    pub(crate) token: i64,
    pub(crate) key: &'a str,
    pub(crate) owner: &'a str,
}

/// Records the rail's answer to the forwarded attempt and answers it; keeps the answer for the
/// identical retry unless it is rebuilt from the row (ACKED).
pub(crate) async fn record_answer(
    state: &AppState,
    submission_id: Uuid,
    payout_id: Uuid,
    caller: &Caller<'_>,
    answer: RailAnswer,
) -> Result<Response, ApiError> {
    let (attempt, reference, reason) = attempt_of(state, submission_id, payout_id, answer);
    let recorded = match record(state, submission_id, attempt, reference).await {
        Ok(r) => r,
        Err(error) => {
            // The outcome is known here but not stored; the sweeper will time the intent out.
            tracing::error!(event = "rail_outcome_not_recorded", %submission_id, %payout_id, %error, rail_outcome = attempt.as_str(), "the rail's answer could not be recorded; the intent will be timed out as ambiguous");
            return Err(ambiguous(
                state,
                submission_id,
                payout_id,
                "the outcome could not be recorded",
            ));
        }
    };
    let reply = answer_of(state, submission_id, caller, &recorded, reason.as_deref())?;
    // An ACKED answer is built from the recorded row alone (the submission, the caller's token,
    // the rail reference and the two DB timestamps), so the identical retry rebuilds the same
    // bytes from the row (see `replay`): storing it would be one more commit per payout.
    if recorded.attempt == Attempt::Acked {
        return Ok(reply.into_response(false));
    }
    // Kept for the identical retry. If this fails the retry is answered from the row instead.
    let stored = store::store_answer(
        &state.pool,
        submission_id,
        recorded.attempt,
        reply.status.as_u16(),
        &reply.body,
    )
    .await;
    if let Err(error) = stored {
        tracing::warn!(event = "rail_answer_not_stored", %submission_id, %payout_id, %error, "the answer could not be kept for a replay; a retry is answered from the recorded outcome");
    }
    Ok(reply.into_response(false))
}

/// The attempt's outcome, the rail reference and the reason the caller is told, from what the
/// rail answered.
fn attempt_of(
    state: &AppState,
    submission_id: Uuid,
    payout_id: Uuid,
    answer: RailAnswer,
) -> (Attempt, Option<String>, Option<String>) {
    match answer {
        RailAnswer::Acked(r) => (Attempt::Acked, Some(r), None),
        RailAnswer::Rejected(why) => (Attempt::Rejected, None, Some(why)),
        RailAnswer::Unknown(unknown) => {
            // The operator's copy, with the rail's address; the caller gets `reason` only.
            tracing::warn!(
                event = "rail_forward_unreadable",
                %submission_id,
                %payout_id,
                reason = unknown.reason,
                detail = %unknown.detail,
                rail = %state.config.rail_url,
                "the forwarded attempt's outcome could not be read"
            );
            (Attempt::Timeout, None, Some(unknown.reason.to_owned()))
        }
    }
}

/// The answer to a recorded attempt, with its counter and log event.
fn answer_of(
    state: &AppState,
    submission_id: Uuid,
    caller: &Caller<'_>,
    recorded: &Recorded,
    reason: Option<&str>,
) -> Result<Reply, ApiError> {
    let payout_id = recorded.payout_id;
    match recorded.attempt {
        Attempt::Acked => {
            state.metrics.submission(SubmissionOutcome::acked);
            let response = acked(submission_id, caller.token, recorded);
            tracing::info!(event = "rail_acked", %submission_id, %payout_id, rail_reference = %response.rail_reference, owner_id = %caller.owner, "the rail acknowledged the transfer");
            Reply::json(StatusCode::OK, &response)
        }
        Attempt::Rejected => {
            state.metrics.submission(SubmissionOutcome::rejected);
            tracing::info!(event = "rail_rejected", %submission_id, %payout_id, owner_id = %caller.owner, "the rail declined; the payout failed and its hold is released");
            Reply::error(&rejected(submission_id, payout_id, reason))
        }
        Attempt::Timeout | Attempt::Fenced | Attempt::Unresolved => {
            let reason = reason.unwrap_or("unknown");
            Reply::error(&ambiguous(state, submission_id, payout_id, reason))
        }
    }
}

fn acked(submission_id: Uuid, token: i64, recorded: &Recorded) -> SubmissionResponse {
    SubmissionResponse {
        submission_id,
        payout_id: recorded.payout_id,
        presented_token: token,
        outcome: "ACKED".into(),
        rail_reference: recorded.rail_reference.clone().unwrap_or_default(),
        submitted_at: recorded.submitted_at,
        resolved_at: recorded.resolved_at.unwrap_or_else(Utc::now),
    }
}

fn rejected(submission_id: Uuid, payout_id: Uuid, reason: Option<&str>) -> ApiError {
    ApiError::new(
        ErrorCode::ValidationFailed,
        "the rail declined the transfer; the payout is FAILED",
    )
    .with_status(StatusCode::UNPROCESSABLE_ENTITY)
    .with_details(json!({
        "submissionId": submission_id,
        "payoutId": payout_id,
        "outcome": "REJECTED",
        "reason": reason,
    }))
}

/// RAIL_UNAVAILABLE: paydb failed before anything was forwarded. `event` and `logged` are the
/// operator's log line, `told` what the caller reads.
pub(crate) fn unavailable(
    event: &'static str,
    error: impl std::fmt::Display,
    logged: &str,
    told: &str,
) -> ApiError {
    tracing::warn!(event, error = %error, "{logged}");
    ApiError::new(ErrorCode::RailUnavailable, told).with_retry_after_ms(500)
}

/// RECOVERY_REQUIRED when paydb's epoch guard refused the write (SQLSTATE DL012,
/// migrations/paydb/0038_baseline_guards.sql): paydb is on a new timeline after a failover that may
/// have lost writes and takes none until an operator runs `dlock recover paydb-epoch`
/// (docs/design.md#d-12). Nothing was recorded, so nothing was forwarded. `None` for any other
/// failure. Not RAIL_UNAVAILABLE: neither the rail nor a retry soon is the way out.
pub(crate) fn recovery_required(error: &store::StoreError) -> Option<ApiError> {
    if error.sqlstate().as_deref() != Some(dlock_server::pg::EPOCH_CHANGED) {
        return None;
    }
    let reason = match error {
        store::StoreError::Db(db) => {
            dlock_server::pg::unavailable(db, "paydb").unwrap_or_else(|| db.to_string())
        }
        other => other.to_string(),
    };
    tracing::error!(
        event = "paydb_recovery_required",
        %reason,
        "paydb's epoch guard refused the write; nothing was forwarded to the rail. paydb may have \
         lost writes in a failover and takes none until an operator reconciles (dlock reconcile) \
         and runs dlock recover paydb-epoch (docs/runbook.md)"
    );
    Some(ApiError::new(
        ErrorCode::RecoveryRequired,
        "paydb refuses every write after a failover that may have lost writes, so nothing was \
         recorded or sent to the rail. An operator must run dlock reconcile, then dlock recover \
         paydb-epoch; retry after that",
    ))
}

/// A retry whose first attempt could not be read: nothing was forwarded by this request.
fn replay_unavailable(error: impl std::fmt::Display) -> ApiError {
    unavailable(
        "rail_replay_unavailable",
        error,
        "the first attempt of an identical request could not be read; nothing was forwarded",
        "this request's first attempt could not be read; nothing was forwarded again, retry after retryAfterMillis",
    )
}

/// An identical request that finds its first attempt still in flight waits for that attempt's
/// answer, as long as the attempt can be in flight at all (the rail read timeout plus the margin
/// after which docs/design.md#d-5 declares it ambiguous). It never forwards anything itself.
async fn await_first_answer(
    state: &AppState,
    submission_id: Uuid,
) -> Result<(Attempt, StoredAnswer), ApiError> {
    const POLL: std::time::Duration = std::time::Duration::from_millis(25);
    // After the outcome is recorded, how long the answer may take to be stored.
    const STORE_GRACE: std::time::Duration = std::time::Duration::from_millis(250);
    let deadline = tokio::time::Instant::now()
        + state.config.rail_read_timeout
        + state.config.unresolved_margin;
    let mut resolved_at: Option<tokio::time::Instant> = None;
    loop {
        let (attempt, answer) = store::attempt_answer(&state.pool, submission_id)
            .await
            .map_err(replay_unavailable)?;
        let now = tokio::time::Instant::now();
        if answer.is_some() {
            return Ok((attempt, answer));
        }
        // An ACKED answer is never stored: it is rebuilt from the row, byte for byte.
        if attempt == Attempt::Acked {
            return Ok((attempt, None));
        }
        if attempt != Attempt::Unresolved {
            let since = *resolved_at.get_or_insert(now);
            if now >= since + STORE_GRACE {
                return Ok((attempt, None));
            }
        } else if now >= deadline {
            return Ok((attempt, None));
        }
        tokio::time::sleep(POLL).await;
    }
}

/// docs/contract.md#submit-replay: the identical request by the same holder gets the first answer.
/// Never forwarded again, never counted as a duplicate attempt.
pub(crate) async fn replay(
    state: &AppState,
    submission_id: Option<Uuid>,
    attempt: Option<String>,
    mut answer: StoredAnswer,
    caller: &Caller<'_>,
    payout_id: Uuid,
) -> Result<Response, ApiError> {
    let Some(submission_id) = submission_id else {
        return Err(ApiError::internal("rail_admit replayed no submission"));
    };
    let Some(attempt) = attempt else {
        return Err(ApiError::internal(
            "rail_admit replayed no submission outcome",
        ));
    };
    let mut attempt = Attempt::parse(&attempt).map_err(ApiError::internal)?;
    if answer.is_none() && attempt == Attempt::Unresolved {
        (attempt, answer) = await_first_answer(state, submission_id).await?;
    }
    tracing::info!(event = "rail_submission_replayed", %submission_id, %payout_id, presented_token = caller.token, idempotency_key = %caller.key, owner_id = %caller.owner, outcome = %attempt.as_str(), "the identical request was answered from its first attempt; nothing was forwarded");
    if let Some((status, body)) = answer {
        return Ok(Reply::stored(status as u16, body)?.into_response(false));
    }
    match attempt {
        // Not NOT_LEADER: paydb is fine, the caller's own identical request is at the rail. As
        // on the payment resource, the contract's answer (docs/contract.md#error-codes) to a retry
        // that came too soon.
        Attempt::Unresolved => Err(ApiError::new(
            ErrorCode::ContentionExceeded,
            "this identical request is still in flight to the rail; nothing was forwarded again, retry after retryAfterMillis to get its answer",
        )
        .with_retry_after_ms(500)
        .with_details(json!({
            "submissionId": submission_id,
            "payoutId": payout_id,
            "outcome": "unresolved",
        }))),
        // Resolved, but no answer kept (ACKED answers never are; the sweeper timed it out, or
        // storing failed): answer from the row.
        Attempt::Acked => {
            let recorded = store::recorded(&state.pool, submission_id)
                .await
                .map_err(replay_unavailable)?;
            Ok(json_response(
                StatusCode::OK,
                &acked(submission_id, caller.token, &recorded),
            ))
        }
        Attempt::Rejected => Err(rejected(
            submission_id,
            payout_id,
            Some("the rail declined the transfer"),
        )),
        Attempt::Timeout | Attempt::Fenced => Err(ambiguous_error(
            submission_id,
            payout_id,
            "the attempt's outcome is unknown",
        )),
    }
}

/// RAIL_AMBIGUOUS, with its counter and log event.
pub(crate) fn ambiguous(
    state: &AppState,
    submission_id: Uuid,
    payout_id: Uuid,
    reason: &str,
) -> ApiError {
    state.metrics.submission(SubmissionOutcome::timeout);
    tracing::warn!(
        event = "rail_ambiguous",
        %submission_id,
        %payout_id,
        reason,
        "an attempt was forwarded and its outcome is unknown; the payout is quarantined as RAIL_AMBIGUOUS"
    );
    ambiguous_error(submission_id, payout_id, reason)
}

fn ambiguous_error(submission_id: Uuid, payout_id: Uuid, reason: &str) -> ApiError {
    ApiError::new(
        ErrorCode::RailAmbiguous,
        "the attempt was forwarded and its outcome is unknown; the payout is quarantined as RAIL_AMBIGUOUS: release the lock and stop, never submit it again; an operator reconciles it against the rail's statement (dlock reconcile) and resolves it (dlock resolve)",
    )
    .with_details(json!({
        "submissionId": submission_id,
        "payoutId": payout_id,
        "outcome": "TIMEOUT",
        "reason": reason,
    }))
}
