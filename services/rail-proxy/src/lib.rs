//! The rail proxy (docs/contract.md#s3-5): enforcement point (c), the only component that calls the
//! rail.
//!
//! Admission is written once, in `rail_admit` (migrations/paydb): the durable high-water mark,
//! strict, then one presented attempt per payout, then the intent row — all committed before
//! the single forward. The forward is never retried. Whatever the rail answers, or fails to,
//! is recorded once; an attempt whose outcome is unknown quarantines its payout as
//! RAIL_AMBIGUOUS. No correctness state lives in this process: any number of replicas share
//! paydb and behave as one.

mod admission;
pub mod config;
mod forward;
mod high_water;
pub mod metrics;
pub mod openapi;
mod record;
mod store;

use std::sync::Arc;

use anyhow::Context;
use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use dlock_contract::error::{ApiError, ErrorCode};
use dlock_contract::http::json_response;
use dlock_server::openapi::RailUnavailable;
use serde_json::json;
use sqlx::PgPool;
use tokio_util::task::TaskTracker;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;
use uuid::Uuid;

pub use config::RailProxyConfig;
pub use dlock_contract::rail::{SubmissionRequest, SubmissionResponse};
use dlock_server::group_commit::{GroupCommit, Observer, Runner};
use metrics::{BatchKind, Metrics, SubmissionOutcome};
use store::{AdmitItem, RecordItem};

pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("../../migrations/paydb");

#[derive(Clone)]
pub struct AppState {
    pub pool: PgPool,
    pub config: Arc<RailProxyConfig>,
    pub metrics: Arc<Metrics>,
    rail: reqwest::Client,
    /// Every submission's admission, forward and record, each a task of its own: shutdown waits
    /// for them, whether or not their callers are still connected.
    forwards: TaskTracker,
    /// Group commit of the admissions (docs/design.md#group-commit); `None` with
    /// `rail.batch.max = 1`, where every submission is admitted in its own transaction.
    admissions: Option<admission::Admissions>,
    /// Group commit of the answer records, likewise.
    records: Option<record::Records>,
}

impl AppState {
    pub fn new(pool: PgPool, config: Arc<RailProxyConfig>) -> anyhow::Result<Self> {
        let tls = dlock_contract::tls::client_config(config.rail_ca_file.as_deref())
            .map_err(|e| anyhow::anyhow!("TLS towards the rail (rail.proxy.rail-ca-file): {e}"))?;
        let rail = reqwest::Client::builder()
            .use_preconfigured_tls(tls)
            .connect_timeout(config.rail_connect_timeout)
            .timeout(config.rail_read_timeout)
            // Forward once (docs/contract.md#rail-step-4): a followed 307/308 would present the
            // same transfer a second time without any retry in our code. A 3xx is an answer we
            // cannot read.
            .redirect(reqwest::redirect::Policy::none())
            .pool_max_idle_per_host(64)
            .build()
            .context("building the rail HTTP client")?;
        let metrics = Metrics::new();
        let admissions = queue(
            &config,
            &metrics,
            BatchKind::admit,
            AdmitItem::keys,
            admission::admit_batch,
        );
        let records = queue(
            &config,
            &metrics,
            BatchKind::record,
            RecordItem::keys,
            record::record_batch,
        );
        Ok(Self {
            pool,
            config,
            metrics,
            rail,
            forwards: TaskTracker::new(),
            admissions,
            records,
        })
    }
}

/// A group-commit queue of `kind` (docs/design.md#group-commit), `rail.batch.max` items a batch
/// at most, or `None` when that is 1 (every request in its own transaction).
fn queue<C, I, O>(
    config: &RailProxyConfig,
    metrics: &Arc<Metrics>,
    kind: BatchKind,
    keys: fn(&I) -> Vec<String>,
    run: Runner<C, I, O>,
) -> Option<GroupCommit<C, I, O>>
where
    C: Clone + Send + 'static,
    I: Send + 'static,
    O: Send + 'static,
{
    (config.batch_max > 1).then(|| {
        let observed = Observed(metrics.clone(), kind);
        GroupCommit::new(config.batch_max, keys, run, Arc::new(observed))
    })
}

/// A queue's batch sizes and length, as `rail_batch_size` and `rail_batch_queued`.
struct Observed(Arc<Metrics>, BatchKind);

impl Observer for Observed {
    fn queued(&self, waiting: usize) {
        self.0.queued(self.1, waiting);
    }

    fn batch(&self, size: usize) {
        self.0.batch(self.1, size);
    }
}

pub async fn connect(config: &RailProxyConfig) -> anyhow::Result<PgPool> {
    Ok(config
        .pg
        .connect("dlock-rail-proxy", &MIGRATOR, "paydb")
        .await?)
}

/// The rail proxy's own routes (the batch, `/healthz`, `/metrics` and the document are added by
/// `dlock_server::http`), each with its operation (`#[utoipa::path]` on its handler): [`app`]
/// serves them, and the document ([`openapi::document`]) is made of their operations.
pub(crate) fn routes() -> OpenApiRouter<AppState> {
    OpenApiRouter::with_openapi(<openapi::ApiDoc as utoipa::OpenApi>::openapi())
        .routes(routes!(admission::submit))
        .routes(routes!(
            high_water::high_water,
            high_water::advance_high_water
        ))
        .routes(routes!(high_water::lower_high_water))
        .routes(routes!(readyz))
}

pub fn app(state: AppState) -> Router {
    let config = state.config.clone();
    config
        .served
        .app(routes(), state, &openapi::BATCHES, metrics_text)
}

/// Serves until SIGINT/SIGTERM. At start, and then periodically, intents left unresolved by a
/// proxy that died mid-flight are timed out (docs/design.md#d-5).
pub async fn run(config: RailProxyConfig) -> anyhow::Result<()> {
    let pool = connect(&config).await?;
    let config = Arc::new(config);
    let state = AppState::new(pool, config.clone())?;
    expire_unresolved(&state).await;
    let sweeper = tokio::spawn(sweep_forever(state.clone()));
    let listener = config.served.bind().await?;
    tracing::info!(event = "rail_proxy_started", listen = %listener.local_addr()?, rail = %config.rail_url, "rail proxy is serving");
    let proof_keys = config.proof_keys.as_ref();
    (config.served)
        .serve(
            "rail-proxy",
            proof_keys,
            listener,
            app(state.clone()),
            sweeper,
        )
        .await
        .context("the HTTP server failed")?;
    drain_forwards(&state).await;
    Ok(())
}

/// After SIGTERM the server has stopped taking requests and has answered every caller still
/// connected; a submission whose caller hung up (a client timeout, an executor killed in the same
/// rollout) may still be between the rail and its record. Each is waited for, up to the rail's
/// connect and read timeouts and the unresolved margin (what a forward can take at most, and what
/// `terminationGracePeriodSeconds` must exceed), so its answer is recorded rather than left to be
/// timed out as RAIL_AMBIGUOUS.
pub async fn drain_forwards(state: &AppState) {
    let forwards = &state.forwards;
    forwards.close();
    if forwards.is_empty() {
        return;
    }
    let in_flight = forwards.len();
    let bound = state.config.rail_connect_timeout
        + state.config.rail_read_timeout
        + state.config.unresolved_margin;
    tracing::info!(
        event = "rail_forwards_draining",
        in_flight,
        bound_ms = bound.as_millis() as u64,
        "stopping: waiting for submissions in flight to the rail to be recorded"
    );
    match tokio::time::timeout(bound, forwards.wait()).await {
        Ok(()) => tracing::info!(
            event = "rail_forwards_drained",
            in_flight,
            "every submission in flight was recorded"
        ),
        Err(_) => tracing::error!(
            event = "rail_forwards_not_drained",
            left = forwards.len(),
            bound_ms = bound.as_millis() as u64,
            "stopping with submissions still in flight past the rail's timeouts; their intents \
             are timed out as RAIL_AMBIGUOUS by the next proxy's sweep: reconcile them"
        ),
    }
}

async fn sweep_forever(state: AppState) {
    let mut ticker = dlock_server::sweep::ticker(state.config.sweep_interval);
    loop {
        ticker.tick().await;
        expire_unresolved(&state).await;
        sweep_fenced(&state).await;
    }
}

/// The most FENCED rows one sweep statement deletes; a larger backlog goes over several ticks.
const FENCED_SWEEP_BATCH: i32 = 1_000;

/// Deletes FENCED attempts older than `rail.proxy.fenced-retention-ms`.
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

/// docs/design.md#d-5: intents older than the rail read timeout plus the margin become TIMEOUT.
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

/// paydb takes writes.
#[utoipa::path(get, path = "/readyz", responses((status = 200, body = serde_json::Value), RailUnavailable))]
async fn readyz(State(state): State<AppState>) -> Response {
    match dlock_server::pg::standby(&state.pool, "paydb").await {
        Ok(None) => json_response(StatusCode::OK, &json!({"status": "ready"})),
        _ => ApiError::new(
            ErrorCode::RailUnavailable,
            "paydb is not reachable as a primary; this replica should not receive traffic",
        )
        .into_response(),
    }
}

async fn metrics_text(State(state): State<AppState>) -> Response {
    state.metrics.refresh_ambiguous(&state.pool).await;
    dlock_server::http::metrics_response(state.metrics.encode())
}
