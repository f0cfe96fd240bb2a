//! The rail proxy (C3 §3.5): enforcement point (c), the only component that calls the rail.
//!
//! Admission is written once, in `rail_admit` (migrations/paydb): the durable high-water mark,
//! strict, then one presented attempt per payout, then the intent row — all committed before
//! the single forward. The forward is never retried. Whatever the rail answers, or fails to,
//! is recorded once; an attempt whose outcome is unknown quarantines its payout as
//! RAIL_AMBIGUOUS. No correctness state lives in this process: any number of replicas share
//! paydb and behave as one.

pub mod config;
pub mod metrics;
pub mod openapi;

use std::sync::Arc;

use anyhow::Context;
use axum::Router;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use chrono::{DateTime, Utc};
use dlock_contract::error::{ApiError, ErrorCode, FieldError};
use dlock_contract::headers;
use dlock_contract::http::{METRICS_CONTENT_TYPE, json_response};
use dlock_contract::json::Json;
use serde::Deserialize;
use serde_json::json;
use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use tracing::Instrument;
use uuid::Uuid;

pub use config::RailProxyConfig;
use metrics::{Metrics, SubmissionOutcome};

pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("../../migrations/paydb");

#[derive(Clone)]
pub struct AppState {
    pub pool: PgPool,
    pub config: Arc<RailProxyConfig>,
    pub metrics: Arc<Metrics>,
    rail: reqwest::Client,
}

impl AppState {
    pub fn new(pool: PgPool, config: Arc<RailProxyConfig>) -> anyhow::Result<Self> {
        let tls = dlock_contract::tls::client_config(config.rail_ca_file.as_deref())
            .map_err(|e| anyhow::anyhow!("TLS towards the rail (rail.proxy.rail-ca-file): {e}"))?;
        let rail = reqwest::Client::builder()
            .use_preconfigured_tls(tls)
            .connect_timeout(config.rail_connect_timeout)
            .timeout(config.rail_read_timeout)
            // Forward once (C3 §3.5 step 4): a followed 307/308 would present the same transfer
            // a second time without any retry in our code. A 3xx is an answer we cannot read.
            .redirect(reqwest::redirect::Policy::none())
            .pool_max_idle_per_host(64)
            .build()
            .context("building the rail HTTP client")?;
        Ok(Self {
            pool,
            config,
            metrics: Metrics::new(),
            rail,
        })
    }
}

pub async fn connect(config: &RailProxyConfig) -> anyhow::Result<PgPool> {
    let options: PgConnectOptions = config
        .pg_url
        .parse()
        .map_err(|e| anyhow::anyhow!("rail.proxy.pg.url is not a PostgreSQL URL: {e}"))?;
    let pool = PgPoolOptions::new()
        .max_connections(config.pg_pool_max)
        .acquire_timeout(config.pg_acquire_timeout)
        .connect_lazy_with(options.application_name("dlock-rail-proxy"));
    if config.pg_migrate {
        MIGRATOR
            .run(&pool)
            .await
            .map_err(|e| anyhow::anyhow!("applying the paydb migrations failed: {e}"))?;
    }
    Ok(pool)
}

pub fn app(state: AppState) -> Router {
    let limits = state.config.http;
    let routes = Router::new()
        .route("/v1/rail/submissions", post(submit))
        .route(
            "/v1/rail/high-water/{account_id}",
            get(high_water).post(advance_high_water),
        )
        .route(
            "/v1/rail/high-water/{account_id}/lower",
            post(lower_high_water),
        )
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics_text))
        .route(
            dlock_contract::openapi::PATH,
            get(|| async { dlock_contract::openapi::response(&crate::openapi::document()) }),
        )
        .with_state(state.clone());
    let routes = state.config.auth.protect(routes);
    dlock_contract::http::finish(routes, limits)
}

/// Serves until SIGINT/SIGTERM. At start, and then periodically, intents left unresolved by a
/// proxy that died mid-flight are timed out (D-5).
pub async fn run(config: RailProxyConfig) -> anyhow::Result<()> {
    let pool = connect(&config).await?;
    let config = Arc::new(config);
    let state = AppState::new(pool, config.clone())?;
    expire_unresolved(&state).await;
    let sweeper = tokio::spawn(sweep_forever(state.clone()));
    let listener = tokio::net::TcpListener::bind(config.listen)
        .await
        .with_context(|| format!("cannot listen on {} (server.listen)", config.listen))?;
    tracing::info!(event = "rail_proxy_started", listen = %listener.local_addr()?, rail = %config.rail_url, "rail proxy is serving");
    // Shutdown drains in-flight forwards: a rollout never cuts a forward mid-flight.
    config.auth.announce("rail-proxy");
    dlock_contract::proof::announce(config.proof_keys.as_ref(), "rail-proxy");
    dlock_contract::http::serve_maybe_tls(
        listener,
        config.tls.as_ref(),
        app(state),
        dlock_contract::http::shutdown_signal(),
    )
    .await
    .context("the HTTP server failed")?;
    sweeper.abort();
    Ok(())
}

async fn sweep_forever(state: AppState) {
    let mut ticker = tokio::time::interval(state.config.sweep_interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticker.tick().await;
        expire_unresolved(&state).await;
        sweep_fenced(&state).await;
    }
}

/// The most FENCED rows one sweep statement deletes; a larger backlog goes over several ticks.
const FENCED_SWEEP_BATCH: i32 = 1_000;

/// Deletes FENCED attempts older than `rail.proxy.fenced-retention-ms` (issue 13, item 16).
/// paydb deletes nothing else from rail_submission, whatever is asked (a trigger refuses it).
pub async fn sweep_fenced(state: &AppState) -> u64 {
    let removed: Result<(i64,), _> = sqlx::query_as("SELECT rail_sweep_fenced($1, $2)")
        .bind(state.config.fenced_retention.as_millis() as i64)
        .bind(FENCED_SWEEP_BATCH)
        .fetch_one(&state.pool)
        .await;
    match removed {
        Ok((n,)) => {
            if n > 0 {
                tracing::info!(
                    event = "rail_fenced_swept",
                    removed = n,
                    "deleted FENCED attempts past their retention"
                );
            }
            n.max(0) as u64
        }
        Err(error) => {
            tracing::warn!(event = "rail_fenced_sweep_failed", %error, "deleting FENCED attempts past their retention failed; retried on the next tick");
            0
        }
    }
}

/// D-5: intents older than the rail read timeout plus the margin become TIMEOUT.
pub async fn expire_unresolved(state: &AppState) -> usize {
    let older_than = state.config.rail_read_timeout + state.config.unresolved_margin;
    let rows: Result<Vec<(Uuid, Uuid)>, _> =
        sqlx::query_as("SELECT submission_id, payout_id FROM rail_expire_unresolved($1)")
            .bind(older_than.as_millis() as i64)
            .fetch_all(&state.pool)
            .await;
    match rows {
        Ok(rows) => {
            for (submission_id, payout_id) in &rows {
                state.metrics.submission(SubmissionOutcome::timeout);
                tracing::warn!(
                    event = "rail_ambiguous",
                    %submission_id,
                    %payout_id,
                    reason = "intent left unresolved past the read timeout",
                    "an attempt's outcome is unknown; the payout is quarantined as RAIL_AMBIGUOUS, resolve it from the rail statement"
                );
            }
            rows.len()
        }
        Err(error) => {
            tracing::warn!(event = "rail_sweep_failed", %error, "timing out unresolved intents failed; retried on the next tick");
            0
        }
    }
}

pub use dlock_contract::rail::{SubmissionRequest, SubmissionResponse};

#[derive(Debug, sqlx::FromRow)]
struct AdmitRow {
    outcome: String,
    highest_token: Option<i64>,
    resource_type: Option<String>,
    state: Option<String>,
    submission_id: Option<Uuid>,
    submission_outcome: Option<String>,
    response_status: Option<i16>,
    response_body: Option<Vec<u8>>,
}

#[derive(Debug, sqlx::FromRow)]
struct RecordRow {
    outcome: String,
    payout_id: Uuid,
    rail_reference: Option<String>,
    submitted_at: DateTime<Utc>,
    resolved_at: Option<DateTime<Utc>>,
}

fn check_body(body: &SubmissionRequest) -> Result<(), ApiError> {
    let mut fields = Vec::new();
    if !dlock_contract::payment::account_id_is_valid(&body.account_id) {
        fields.push(FieldError::new(
            "accountId",
            dlock_contract::payment::ACCOUNT_ID_RULE,
        ));
    }
    if body.amount_minor <= 0 {
        fields.push(FieldError::new(
            "amountMinor",
            "must be a positive integer of minor units",
        ));
    }
    if body.currency.len() != 3 || !body.currency.bytes().all(|b| b.is_ascii_uppercase()) {
        fields.push(FieldError::new(
            "currency",
            "must be an ISO-4217 code such as EUR",
        ));
    }
    if body.beneficiary_ref.is_empty() || body.beneficiary_ref.len() > 128 {
        fields.push(FieldError::new(
            "beneficiaryRef",
            "must be 1 to 128 characters",
        ));
    }
    if fields.is_empty() {
        Ok(())
    } else {
        Err(ApiError::validation(fields))
    }
}

/// RAIL_UNAVAILABLE: the intent did not commit, so nothing was presented to the rail.
fn unavailable(error: impl std::fmt::Display) -> ApiError {
    tracing::warn!(event = "rail_intent_not_committed", error = %error, "the intent row did not commit; nothing was forwarded");
    ApiError::new(
        ErrorCode::RailUnavailable,
        "the submission could not be recorded, so nothing was sent to the rail; retry after retryAfterMillis",
    )
    .with_retry_after_ms(500)
}

/// A retry whose first attempt could not be read: nothing was forwarded by this request.
fn replay_unavailable(error: impl std::fmt::Display) -> ApiError {
    tracing::warn!(event = "rail_replay_unavailable", error = %error, "the first attempt of an identical request could not be read; nothing was forwarded");
    ApiError::new(
        ErrorCode::RailUnavailable,
        "this request's first attempt could not be read; nothing was forwarded again, retry after retryAfterMillis",
    )
    .with_retry_after_ms(500)
}

/// What the rail's answer means.
enum RailAnswer {
    Acked(String),
    Rejected(String),
    Unknown(Unknown),
}

/// An outcome we cannot read. `reason` is what the caller is told: what kind of failure, never
/// where the rail is (issue 13, item 14). `detail` is the full error, rail address included, for
/// the operator's log only.
struct Unknown {
    reason: &'static str,
    detail: String,
}

impl Unknown {
    fn answer(reason: &'static str, detail: impl std::fmt::Display) -> RailAnswer {
        RailAnswer::Unknown(Self {
            reason,
            detail: detail.to_string(),
        })
    }
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct RailAck {
    rail_reference: String,
}

async fn forward(state: &AppState, body: &SubmissionRequest) -> RailAnswer {
    let url = format!("{}/submit", state.config.rail_url.trim_end_matches('/'));
    let request = json!({
        "clientRef": body.payout_id.to_string(),
        "amountMinor": body.amount_minor,
        "currency": body.currency,
    });
    // The hop to the rail is a span of its own: the last link of the payout's trace.
    let span = tracing::info_span!(
        "rail submit",
        otel.kind = "client",
        payout.id = %body.payout_id,
    );
    let traceparent = span.in_scope(|| dlock_contract::trace::outgoing_traceparent(None));
    let mut forward = state
        .rail
        .post(&url)
        .json(&request)
        .header(dlock_contract::headers::TRACEPARENT, traceparent);
    if let Some(credential) = &state.config.rail_credential {
        forward = forward.header(axum::http::header::AUTHORIZATION, credential.header_value());
    }
    let response = match tracing::Instrument::instrument(forward.send(), span).await {
        Ok(r) => r,
        // Even a refused connection is treated as unknown: proving that nothing was presented
        // is the rail's business, and a wrong guess here pays twice.
        Err(e) if e.is_timeout() => {
            return Unknown::answer("the rail did not answer within the read timeout", e);
        }
        Err(e) if e.is_connect() => {
            return Unknown::answer("the connection to the rail failed", e);
        }
        Err(e) => return Unknown::answer("the request to the rail failed without an answer", e),
    };
    let status = response.status();
    let bytes = match response.bytes().await {
        Ok(b) => b,
        Err(e) => return Unknown::answer("the rail's answer broke off", e),
    };
    match status.as_u16() {
        200 => match serde_json::from_slice::<RailAck>(&bytes) {
            Ok(ack) if !ack.rail_reference.is_empty() && ack.rail_reference.len() <= 128 => {
                RailAnswer::Acked(ack.rail_reference)
            }
            _ => Unknown::answer(
                "the rail's acknowledgement was malformed",
                format!(
                    "HTTP 200 with {} bytes that are not an acknowledgement",
                    bytes.len()
                ),
            ),
        },
        402 => RailAnswer::Rejected("the rail declined the transfer".into()),
        300..=399 => Unknown::answer(
            "the rail answered with a redirect, which is not followed; the transfer may have been taken",
            format!("HTTP {status} towards {url}"),
        ),
        500..=599 => Unknown::answer(
            "the rail answered with a server error",
            format!("HTTP {status} towards {url}"),
        ),
        _ => Unknown::answer(
            "the rail answered with a status it does not document",
            format!("HTTP {status} towards {url}"),
        ),
    }
}

async fn submit(
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
    // DESIGN D-8: the token must be one the lock server granted on this account's key. Checked
    // before rail_admit, so a refused submission records nothing and moves no mark.
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
    // record (an acknowledged transfer left unresolved would be quarantined as ambiguous).
    let attempt = Attempt {
        token,
        owner,
        key,
        body,
    };
    tokio::spawn(admit_and_forward(state, attempt).instrument(tracing::Span::current()))
        .await
        .unwrap_or_else(|error| {
            Err(ApiError::internal(format!(
                "the submission task failed: {error}"
            )))
        })
}

struct Attempt {
    token: i64,
    owner: String,
    key: String,
    body: SubmissionRequest,
}

/// A JSON answer from stored bytes, exactly as first given.
fn stored_answer(status: u16, body: Vec<u8>) -> Result<Response, ApiError> {
    let status = StatusCode::from_u16(status).map_err(ApiError::internal)?;
    Ok((
        status,
        [(
            header::CONTENT_TYPE,
            axum::http::HeaderValue::from_static(dlock_contract::http::JSON_CONTENT_TYPE),
        )],
        body,
    )
        .into_response())
}

async fn admit_and_forward(state: AppState, attempt: Attempt) -> Result<Response, ApiError> {
    let Attempt {
        token,
        owner,
        key,
        body,
    } = attempt;
    // The canonical request: the parsed body re-serialized, so field order and whitespace do not
    // make another request. paydb keeps only its hash.
    let canonical = serde_json::to_string(&body).map_err(ApiError::internal)?;
    let submission_id = Uuid::new_v4();
    let admitted: AdmitRow = sqlx::query_as(
        "SELECT outcome, highest_token, resource_type, state, submission_id, submission_outcome, \
                response_status, response_body \
         FROM rail_admit($1, $2, $3, $4, $5, $6, $7, $8)",
    )
    .bind(body.payout_id)
    .bind(&body.account_id)
    .bind(body.amount_minor)
    .bind(&body.currency)
    .bind(token)
    .bind(&key)
    .bind(submission_id)
    .bind(&canonical)
    .fetch_one(&state.pool)
    .await
    .map_err(unavailable)?;
    let payout_id = body.payout_id;
    match admitted.outcome.as_str() {
        "admitted" => {}
        "replay" => return replay(&state, admitted, token, &key, &owner, payout_id).await,
        "conflict" => {
            tracing::warn!(
                event = "rail_idempotency_conflict",
                payout_id = %payout_id,
                presented_token = token,
                existing_submission_id = ?admitted.submission_id,
                idempotency_key = %key,
                owner_id = %owner,
                "the same idempotency key and token came with another body; nothing was forwarded"
            );
            return Err(ApiError::new(
                ErrorCode::IdempotencyConflict,
                "this idempotency key and fencing token were already used with another body; nothing was forwarded",
            )
            .with_details(json!({
                "payoutId": payout_id,
                "submissionId": admitted.submission_id,
                "idempotencyKey": key,
            })));
        }
        "payout_unknown" => {
            return Err(ApiError::not_found(format!(
                "payout {payout_id} does not exist"
            )));
        }
        "mismatch" => {
            return Err(ApiError::validation(vec![FieldError::new(
                "payoutId",
                "accountId, amountMinor and currency must be the payout's own",
            )]));
        }
        "fenced" => {
            let resource = admitted.resource_type.unwrap_or_else(|| "rail".into());
            let highest = admitted.highest_token.unwrap_or_default();
            state.metrics.fenced_out(&resource);
            state.metrics.submission(SubmissionOutcome::fenced);
            tracing::error!(
                event = "fenced_out",
                resource = %resource,
                presented_token = token,
                highest_token = highest,
                payout_id = %payout_id,
                account_id = %body.account_id,
                idempotency_key = %key,
                owner_id = %owner,
                "a stale token was refused at the rail; two workers believed they held one lock"
            );
            return Err(ApiError::fenced_out(
                "a newer holder exists; abort the whole critical section, do not retry",
                &dlock_contract::error::FencedOutDetails {
                    presented_token: token,
                    highest_token: highest,
                    resource_type: Some(resource),
                    resource_id: body.account_id.clone(),
                    owner_id: owner,
                },
            ));
        }
        "duplicate" => {
            state.metrics.duplicate_attempted();
            tracing::error!(
                event = "duplicate_rail_submission_attempted",
                payout_id = %payout_id,
                presented_token = token,
                existing_submission_id = ?admitted.submission_id,
                existing_outcome = ?admitted.submission_outcome,
                idempotency_key = %key,
                owner_id = %owner,
                "a second submission of one payout was refused; resolve from the existing record"
            );
            return Err(ApiError::new(
                ErrorCode::DuplicateSubmission,
                "this payout already has a submission record; resolve from it, never submit again",
            )
            .with_details(json!({
                "payoutId": payout_id,
                "submissionId": admitted.submission_id,
                "outcome": admitted.submission_outcome,
                "state": admitted.state,
            })));
        }
        "not_claimable" => {
            return Err(ApiError::new(
                ErrorCode::PayoutNotClaimable,
                "only a payout CLAIMED with this very token may be submitted",
            )
            .with_details(json!({ "payoutId": payout_id, "state": admitted.state })));
        }
        other => return Err(ApiError::internal(format!("rail_admit answered {other}"))),
    }

    // The intent is durable. Exactly one forward, never retried.
    let answer = forward(&state, &body).await;
    let (outcome, reference, reason) = match &answer {
        RailAnswer::Acked(r) => ("ACKED", Some(r.as_str()), None),
        RailAnswer::Rejected(why) => ("REJECTED", None, Some(why.clone())),
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
            ("TIMEOUT", None, Some(unknown.reason.to_owned()))
        }
    };
    let recorded: Result<RecordRow, _> = sqlx::query_as(
        "SELECT outcome, payout_id, rail_reference, submitted_at, resolved_at FROM rail_record($1, $2, $3)",
    )
    .bind(submission_id)
    .bind(outcome)
    .bind(reference)
    .fetch_one(&state.pool)
    .await;
    let recorded = match recorded {
        Ok(r) => r,
        Err(error) => {
            // The outcome is known here but not stored; the sweeper will time the intent out.
            tracing::error!(event = "rail_outcome_not_recorded", %submission_id, %payout_id, %error, rail_outcome = outcome, "the rail's answer could not be recorded; the intent will be timed out as ambiguous");
            return Err(ambiguous(
                &state,
                submission_id,
                payout_id,
                "the outcome could not be recorded",
            ));
        }
    };
    let (status, bytes) = match recorded.outcome.as_str() {
        "ACKED" => {
            state.metrics.submission(SubmissionOutcome::acked);
            let response = acked(submission_id, token, &recorded);
            tracing::info!(event = "rail_acked", %submission_id, %payout_id, rail_reference = %response.rail_reference, owner_id = %owner, "the rail acknowledged the transfer");
            (StatusCode::OK, serde_json::to_vec(&response))
        }
        "REJECTED" => {
            state.metrics.submission(SubmissionOutcome::rejected);
            tracing::info!(event = "rail_rejected", %submission_id, %payout_id, owner_id = %owner, "the rail declined; the payout failed and its hold is released");
            let error = rejected(submission_id, payout_id, reason.as_deref());
            (error.status, serde_json::to_vec(&error.body()))
        }
        _ => {
            let error = ambiguous(
                &state,
                submission_id,
                payout_id,
                reason.as_deref().unwrap_or("unknown"),
            );
            (error.status, serde_json::to_vec(&error.body()))
        }
    };
    let bytes = bytes.map_err(ApiError::internal)?;
    // An ACKED answer is built from the recorded row alone (the submission, the caller's token,
    // the rail reference and the two DB timestamps), so the identical retry rebuilds the same
    // bytes from the row (see `replay`): storing it would be one more commit per payout.
    if recorded.outcome == "ACKED" {
        return stored_answer(status.as_u16(), bytes);
    }
    // Kept for the identical retry. If this fails the retry is answered from the row instead.
    let stored: Result<(bool,), _> = sqlx::query_as("SELECT rail_store_answer($1, $2, $3, $4)")
        .bind(submission_id)
        .bind(&recorded.outcome)
        .bind(status.as_u16() as i16)
        .bind(&bytes)
        .fetch_one(&state.pool)
        .await;
    if let Err(error) = stored {
        tracing::warn!(event = "rail_answer_not_stored", %submission_id, %payout_id, %error, "the answer could not be kept for a replay; a retry is answered from the recorded outcome");
    }
    stored_answer(status.as_u16(), bytes)
}

fn acked(submission_id: Uuid, token: i64, recorded: &RecordRow) -> SubmissionResponse {
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

type StoredAnswer = Option<(i16, Vec<u8>)>;

/// An identical request that finds its first attempt still in flight waits for that attempt's
/// answer, as long as the attempt can be in flight at all (the rail read timeout plus the margin
/// after which D-5 declares it ambiguous). It never forwards anything itself.
async fn await_first_answer(
    state: &AppState,
    submission_id: Uuid,
) -> Result<(String, StoredAnswer), ApiError> {
    const POLL: std::time::Duration = std::time::Duration::from_millis(25);
    // After the outcome is recorded, how long the answer may take to be stored.
    const STORE_GRACE: std::time::Duration = std::time::Duration::from_millis(250);
    let deadline = tokio::time::Instant::now()
        + state.config.rail_read_timeout
        + state.config.unresolved_margin;
    let mut resolved_at: Option<tokio::time::Instant> = None;
    loop {
        let (outcome, status, body): (String, Option<i16>, Option<Vec<u8>>) = sqlx::query_as(
            "SELECT outcome, response_status, response_body FROM rail_submission \
             WHERE submission_id = $1",
        )
        .bind(submission_id)
        .fetch_one(&state.pool)
        .await
        .map_err(replay_unavailable)?;
        let now = tokio::time::Instant::now();
        if let Some(answer) = status.zip(body) {
            return Ok((outcome, Some(answer)));
        }
        // An ACKED answer is never stored: it is rebuilt from the row, byte for byte.
        if outcome == "ACKED" {
            return Ok((outcome, None));
        }
        if outcome != "unresolved" {
            let since = *resolved_at.get_or_insert(now);
            if now >= since + STORE_GRACE {
                return Ok((outcome, None));
            }
        } else if now >= deadline {
            return Ok((outcome, None));
        }
        tokio::time::sleep(POLL).await;
    }
}

/// C3 §3.1: the identical request by the same holder gets the first answer. Never forwarded
/// again, never counted as a duplicate attempt.
async fn replay(
    state: &AppState,
    admitted: AdmitRow,
    token: i64,
    key: &str,
    owner: &str,
    payout_id: Uuid,
) -> Result<Response, ApiError> {
    let Some(submission_id) = admitted.submission_id else {
        return Err(ApiError::internal("rail_admit replayed no submission"));
    };
    let mut outcome = admitted.submission_outcome.unwrap_or_default();
    let mut answer = admitted.response_status.zip(admitted.response_body);
    if answer.is_none() && outcome == "unresolved" {
        (outcome, answer) = await_first_answer(state, submission_id).await?;
    }
    tracing::info!(event = "rail_submission_replayed", %submission_id, %payout_id, presented_token = token, idempotency_key = %key, owner_id = %owner, outcome = %outcome, "the identical request was answered from its first attempt; nothing was forwarded");
    if let Some((status, body)) = answer {
        return stored_answer(status as u16, body);
    }
    match outcome.as_str() {
        // Not NOT_LEADER: paydb is fine, the caller's own identical request is at the rail. As
        // on the payment resource, C3's answer to a retry that came too soon.
        "unresolved" => Err(ApiError::new(
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
        "ACKED" => {
            let recorded: RecordRow = sqlx::query_as(
                "SELECT outcome, payout_id, rail_reference, submitted_at, resolved_at \
                 FROM rail_submission WHERE submission_id = $1",
            )
            .bind(submission_id)
            .fetch_one(&state.pool)
            .await
            .map_err(replay_unavailable)?;
            Ok(json_response(
                StatusCode::OK,
                &acked(submission_id, token, &recorded),
            ))
        }
        "REJECTED" => Err(rejected(
            submission_id,
            payout_id,
            Some("the rail declined the transfer"),
        )),
        _ => Err(ambiguous_error(
            submission_id,
            payout_id,
            "the attempt's outcome is unknown",
        )),
    }
}

fn ambiguous(state: &AppState, submission_id: Uuid, payout_id: Uuid, reason: &str) -> ApiError {
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

use dlock_contract::rail::HighWaterRequest as AdvanceRequest;

/// The longest reason paydb keeps for a high-water advance.
const REASON_LEN_MAX: usize = 4096;

async fn advance_high_water(
    State(state): State<AppState>,
    caller: dlock_contract::auth::Caller,
    Path(account_id): Path<String>,
    headers: HeaderMap,
    Json(body): Json<AdvanceRequest>,
) -> Result<Json<serde_json::Value>, ApiError> {
    caller.require_operator("the high-water advance")?;
    let identity = identity_of(&caller);
    let owner = headers::owner_id(&headers).map_err(|e| ApiError::validation(vec![e]))?;
    let mut fields = Vec::new();
    if !dlock_contract::payment::account_id_is_valid(&account_id) {
        fields.push(FieldError::new(
            "accountId",
            dlock_contract::payment::ACCOUNT_ID_RULE,
        ));
    }
    if body.floor <= 0 {
        fields.push(FieldError::new("floor", "must be a token greater than 0"));
    }
    if body.operator.trim().is_empty() || body.operator.len() > 128 {
        fields.push(FieldError::new("operator", "must be 1 to 128 characters"));
    }
    // paydb keeps 1 to 4096 characters (the advance record's reason); a longer reason is the
    // caller's error, refused here with the envelope, never a failed INSERT answered 500.
    let reason_len = body.reason.trim().chars().count();
    if !(8..=REASON_LEN_MAX).contains(&reason_len) {
        fields.push(FieldError::new(
            "reason",
            format!("must be 8 to {REASON_LEN_MAX} characters, got {reason_len}"),
        ));
    }
    if !fields.is_empty() {
        return Err(ApiError::validation(fields));
    }
    let exists: Option<(i32,)> = sqlx::query_as("SELECT 1 FROM accounts WHERE account_id = $1")
        .bind(&account_id)
        .fetch_optional(&state.pool)
        .await
        .map_err(ApiError::internal)?;
    if exists.is_none() {
        return Err(ApiError::not_found(format!(
            "account {account_id} does not exist"
        )));
    }
    let (previous, new): (i64, i64) = sqlx::query_as(
        "SELECT previous_token, new_token \
         FROM rail_advance_high_water($1, $2, $3, $4, $5, $6, $7)",
    )
    .bind(&account_id)
    .bind(body.floor)
    .bind(body.operator.trim())
    .bind(&owner)
    .bind(body.reason.trim())
    .bind(body.revocation_id)
    .bind(&identity)
    .fetch_one(&state.pool)
    .await
    .map_err(ApiError::internal)?;
    tracing::warn!(event = "rail_high_water_advanced", account_id = %account_id, previous, new, operator = %body.operator.trim(), identity = %identity, owner_id = %owner, revocation_id = ?body.revocation_id, "the rail high-water mark was raised to a revocation floor");
    Ok(Json(json!({
        "accountId": account_id,
        "previousToken": previous,
        "highestToken": new,
        "floor": body.floor,
        "operator": body.operator.trim(),
        "identity": identity,
    })))
}

/// What the caller's credential authenticated as, recorded beside the typed-in operator.
fn identity_of(caller: &dlock_contract::auth::Caller) -> String {
    caller
        .identity()
        .map_or_else(|| "anonymous".to_owned(), |i| i.name.clone())
}

#[derive(Debug, sqlx::FromRow)]
struct LowerRow {
    outcome: String,
    previous_token: Option<i64>,
    highest_token: Option<i64>,
    recovery_id: Option<i64>,
}

/// DESIGN D-8 recovery: lowers a high-water mark poisoned by a forged token to the token of the
/// operator's own proven grant on `payout:{accountId}` (which the lock server issues only while
/// nobody else holds the key, above every token issued before). Operator only, needs proof
/// keys, recorded in `fence_recoveries` with the operator, reason and authenticated identity.
async fn lower_high_water(
    State(state): State<AppState>,
    caller: dlock_contract::auth::Caller,
    Path(account_id): Path<String>,
    headers: HeaderMap,
    Json(body): Json<dlock_contract::proof::FenceLowerRequest>,
) -> Result<Json<dlock_contract::proof::FenceLowered>, ApiError> {
    caller.require_operator("lowering the high-water mark")?;
    let Some(keys) = &state.config.proof_keys else {
        return Err(dlock_contract::proof::recovery_disabled());
    };
    let token = headers::fencing_token(&headers)?;
    let mut fields = dlock_contract::proof::check_lower_request(&body);
    let owner = headers::owner_id(&headers).map_err(|e| fields.push(e)).ok();
    if !dlock_contract::payment::account_id_is_valid(&account_id) {
        fields.push(FieldError::new(
            "accountId",
            dlock_contract::payment::ACCOUNT_ID_RULE,
        ));
    }
    if !fields.is_empty() {
        return Err(ApiError::validation(fields));
    }
    let owner = owner.unwrap_or_default();
    keys.require(
        &headers,
        &dlock_contract::proof::payout_lock_key(&account_id),
        token,
    )?;
    let identity = identity_of(&caller);
    let row: LowerRow = sqlx::query_as(
        "SELECT outcome, previous_token, highest_token, recovery_id \
         FROM rail_lower_high_water($1, $2, $3, $4, $5, $6)",
    )
    .bind(&account_id)
    .bind(token)
    .bind(body.operator.trim())
    .bind(&identity)
    .bind(&owner)
    .bind(body.reason.trim())
    .fetch_one(&state.pool)
    .await
    .map_err(ApiError::internal)?;
    if row.outcome == "not_found" {
        return Err(ApiError::not_found(format!(
            "account {account_id} does not exist"
        )));
    }
    let previous = row.previous_token.unwrap_or_default();
    let highest = row.highest_token.unwrap_or_default();
    let lowered = row.outcome == "lowered";
    if lowered {
        tracing::warn!(
            event = "rail_high_water_lowered",
            account_id = %account_id,
            previous,
            highest,
            recovery_id = row.recovery_id,
            operator = %body.operator.trim(),
            identity = %identity,
            owner_id = %owner,
            "a rail high-water mark poisoned by a forged token was lowered to the operator's grant"
        );
    }
    Ok(Json(dlock_contract::proof::FenceLowered {
        account_id,
        resource: "rail".into(),
        previous_token: previous,
        token: highest,
        lowered,
        recovery_id: row.recovery_id,
    }))
}

async fn high_water(
    State(state): State<AppState>,
    Path(account_id): Path<String>,
) -> Result<Json<serde_json::Value>, ApiError> {
    let row: Option<(i64,)> =
        sqlx::query_as("SELECT highest_token FROM rail_high_water WHERE account_id = $1")
            .bind(&account_id)
            .fetch_optional(&state.pool)
            .await
            .map_err(ApiError::internal)?;
    Ok(Json(json!({
        "accountId": account_id,
        "highestToken": row.map(|r| r.0).unwrap_or(0),
    })))
}

async fn healthz() -> Json<serde_json::Value> {
    Json(json!({"status": "ok"}))
}

async fn readyz(State(state): State<AppState>) -> Response {
    let check: Result<(bool,), _> = sqlx::query_as("SELECT pg_is_in_recovery()")
        .fetch_one(&state.pool)
        .await;
    match check {
        Ok((false,)) => json_response(StatusCode::OK, &json!({"status": "ready"})),
        _ => ApiError::new(
            ErrorCode::RailUnavailable,
            "paydb is not reachable as a primary; this replica should not receive traffic",
        )
        .into_response(),
    }
}

async fn metrics_text(State(state): State<AppState>) -> Response {
    state.metrics.refresh_ambiguous(&state.pool).await;
    (
        [(header::CONTENT_TYPE, METRICS_CONTENT_TYPE)],
        state.metrics.encode(),
    )
        .into_response()
}
