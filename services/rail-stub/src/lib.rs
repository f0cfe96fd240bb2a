//! The rail stub (C3 §3.6): a stand-in for a payment rail we cannot change.
//!
//! It knows nothing of locks, tokens, sessions or fences, and it is deliberately not idempotent:
//! every accepted call is a transfer, and a repeated `clientRef` may be accepted again under a
//! new reference. Every safety property of dlock must hold with this stub treated as a hostile,
//! memoryless black box; making it idempotent would prove nothing.
//!
//! What it has accepted is its statement (`GET /statement`), which survives a restart: each
//! accepted transfer is appended to a file before the stub answers.

use std::collections::HashMap;
use std::io::Write;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use axum::Router;
use axum::extract::{RawQuery, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use chrono::Utc;
use dlock_contract::config::{ConfigError, RawConfig};
use dlock_contract::error::{ApiError, ErrorCode};
use dlock_contract::http::{HttpLimits, json_response};
use dlock_contract::json::Json;
use rand::Rng;
use serde::Deserialize;
use serde_json::json;
use tokio::sync::Mutex;

#[derive(Debug, Clone)]
pub struct RailStubConfig {
    pub listen: SocketAddr,
    /// `rail.stub.latency-ms`: fixed delay before every answer.
    pub latency_ms: u64,
    /// `rail.stub.latency-jitter-ms`: a uniform extra delay of up to this much.
    pub latency_jitter_ms: u64,
    /// `rail.stub.failure-rate`: share of calls that fail, half as a 5xx before acceptance and
    /// half as a connection held open and dropped (after the transfer was accepted half the time).
    pub failure_rate: f64,
    /// `rail.stub.duplicate-ack-rate`: share of repeated clientRefs accepted again as a new transfer.
    pub duplicate_ack_rate: f64,
    /// `rail.stub.decline-rate`: share of calls declined with 402.
    pub decline_rate: f64,
    /// `rail.stub.hang-ms`: how long a dropped connection is held open first.
    pub hang_ms: u64,
    /// `rail.stub.redirect-rate`: share of calls that take the transfer and then answer
    /// `307 Temporary Redirect` back to `/submit`, as a gateway in front of a rail may. A client
    /// that follows it presents the same transfer again.
    pub redirect_rate: f64,
    /// `rail.stub.statement-path`: the durable statement (JSON lines).
    pub statement_path: PathBuf,
    /// `server.tls.*`: TLS on the listener when set.
    pub tls: Option<dlock_contract::tls::TlsSettings>,
    /// `auth.*`: who may submit (the rail proxy's identity).
    pub auth: dlock_contract::auth::Authenticator,
}

impl RailStubConfig {
    pub fn load(file: Option<&Path>) -> Result<Self, ConfigError> {
        let mut raw = RawConfig::load(file)?;
        let config = Self::from_raw(&mut raw)?;
        raw.finish()?;
        Ok(config)
    }

    pub fn from_raw(raw: &mut RawConfig) -> Result<Self, ConfigError> {
        let listen_text = raw.string("server.listen", "127.0.0.1:7090")?;
        let listen = listen_text.parse().map_err(|e| ConfigError {
            key: "server.listen".into(),
            origin: String::new(),
            message: format!("must be an address like 127.0.0.1:7090, got {listen_text:?}: {e}"),
        })?;
        Ok(Self {
            listen,
            latency_ms: raw.integer("rail.stub.latency-ms", 0, 0..=600_000)? as u64,
            latency_jitter_ms: raw.integer("rail.stub.latency-jitter-ms", 0, 0..=600_000)? as u64,
            failure_rate: raw.decimal("rail.stub.failure-rate", 0.0, 0.0..=1.0)?,
            duplicate_ack_rate: raw.decimal("rail.stub.duplicate-ack-rate", 0.0, 0.0..=1.0)?,
            decline_rate: raw.decimal("rail.stub.decline-rate", 0.0, 0.0..=1.0)?,
            hang_ms: raw.integer("rail.stub.hang-ms", 30_000, 0..=600_000)? as u64,
            redirect_rate: raw.decimal("rail.stub.redirect-rate", 0.0, 0.0..=1.0)?,
            statement_path: PathBuf::from(
                raw.string("rail.stub.statement-path", "rail-statement.jsonl")?,
            ),
            tls: dlock_contract::tls::TlsSettings::from_raw(raw)?,
            auth: dlock_contract::auth::Authenticator::new(
                &dlock_contract::auth::AuthSettings::from_raw(raw)?,
                None,
                dlock_contract::auth::OperatorWithoutAuth::Refused,
            )?,
        })
    }
}

#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SubmitRequest {
    pub client_ref: String,
    pub amount_minor: i64,
    pub currency: String,
}

pub use dlock_contract::rail::{Statement, Transfer};

struct Ledger {
    transfers: Vec<Transfer>,
    by_client_ref: HashMap<String, Vec<usize>>,
    file: std::fs::File,
}

impl Ledger {
    fn open(path: &Path) -> anyhow::Result<Self> {
        let mut transfers = Vec::new();
        if path.exists() {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("reading the statement {}", path.display()))?;
            for (n, line) in text.lines().enumerate() {
                if line.trim().is_empty() {
                    continue;
                }
                // A torn last line (a crash mid-append) was never acknowledged: skip it.
                match serde_json::from_str::<Transfer>(line) {
                    Ok(t) => transfers.push(t),
                    Err(e) => {
                        tracing::warn!(event = "statement_line_skipped", line = n + 1, error = %e, "unreadable statement line skipped")
                    }
                }
            }
        }
        let mut by_client_ref: HashMap<String, Vec<usize>> = HashMap::new();
        for (i, t) in transfers.iter().enumerate() {
            by_client_ref
                .entry(t.client_ref.clone())
                .or_default()
                .push(i);
        }
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .with_context(|| format!("opening the statement {}", path.display()))?;
        Ok(Self {
            transfers,
            by_client_ref,
            file,
        })
    }

    /// Appends a transfer to the statement file; only then is it accepted.
    fn accept(&mut self, transfer: Transfer) -> anyhow::Result<Transfer> {
        let mut line = serde_json::to_vec(&transfer)?;
        line.push(b'\n');
        // One write(2) of the whole line: the page cache outlives a killed stub, which is the
        // restart the statement must survive. A stand-in rail need not survive a power cut.
        self.file.write_all(&line)?;
        self.by_client_ref
            .entry(transfer.client_ref.clone())
            .or_default()
            .push(self.transfers.len());
        self.transfers.push(transfer.clone());
        Ok(transfer)
    }
}

#[derive(Clone)]
pub struct StubState {
    config: Arc<RailStubConfig>,
    ledger: Arc<Mutex<Ledger>>,
}

impl StubState {
    pub fn open(config: RailStubConfig) -> anyhow::Result<Self> {
        let ledger = Ledger::open(&config.statement_path)?;
        Ok(Self {
            config: Arc::new(config),
            ledger: Arc::new(Mutex::new(ledger)),
        })
    }
}

pub fn app(state: StubState) -> Router {
    let routes = Router::new()
        .route("/submit", post(submit))
        .route("/statement", get(statement))
        .route("/healthz", get(healthz))
        .route("/readyz", get(healthz))
        .route(
            dlock_contract::openapi::PATH,
            get(|| async { dlock_contract::openapi::response(&openapi::document()) }),
        )
        .with_state(state.clone());
    let routes = state.config.auth.protect(routes);
    let limits = HttpLimits {
        body_bytes_max: 16 * 1024,
        request_timeout: Duration::from_secs(3_600),
    };
    dlock_contract::http::finish(routes, limits)
}

pub async fn run(config: RailStubConfig) -> anyhow::Result<()> {
    let listen = config.listen;
    let tls = config.tls.clone();
    config.auth.announce("rail-stub");
    let state = StubState::open(config)?;
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .with_context(|| format!("cannot listen on {listen} (server.listen)"))?;
    tracing::info!(event = "rail_stub_started", listen = %listener.local_addr()?, "rail stub is serving");
    dlock_contract::http::serve_maybe_tls(
        listener,
        tls.as_ref(),
        app(state),
        dlock_contract::http::shutdown_signal(),
    )
    .await
    .context("the HTTP server failed")?;
    Ok(())
}

fn new_reference() -> String {
    format!("rail-{}", uuid::Uuid::new_v4().simple())
}

/// What the dice decided for one call, drawn before the latency so it cannot depend on timing.
enum Fate {
    Fail5xx,
    Drop { accepted: bool },
    Decline,
    Redirect,
    Accept,
}

fn draw(config: &RailStubConfig) -> Fate {
    let mut rng = rand::rng();
    if rng.random_bool(config.failure_rate) {
        if rng.random_bool(0.5) {
            Fate::Fail5xx
        } else {
            Fate::Drop {
                accepted: rng.random_bool(0.5),
            }
        }
    } else if rng.random_bool(config.decline_rate) {
        Fate::Decline
    } else if rng.random_bool(config.redirect_rate) {
        Fate::Redirect
    } else {
        Fate::Accept
    }
}

/// A real rail keeps processing a transfer whose caller hung up, so the work runs in its own
/// task: a proxy that dies mid-flight cannot cancel it.
async fn submit(
    State(state): State<StubState>,
    Json(body): Json<SubmitRequest>,
) -> Result<Response, ApiError> {
    tokio::spawn(process(state, body))
        .await
        .unwrap_or_else(|e| Err(ApiError::internal(format!("the transfer task failed: {e}"))))
}

async fn process(state: StubState, body: SubmitRequest) -> Result<Response, ApiError> {
    if body.client_ref.is_empty() || body.client_ref.len() > 128 {
        return Err(ApiError::field("clientRef", "must be 1 to 128 characters"));
    }
    if body.amount_minor <= 0 {
        return Err(ApiError::field("amountMinor", "must be greater than 0"));
    }
    if body.currency.len() != 3 || !body.currency.bytes().all(|b| b.is_ascii_uppercase()) {
        return Err(ApiError::field("currency", "must be an ISO-4217 code"));
    }
    let config = state.config.clone();
    let fate = draw(&config);
    let jitter = if config.latency_jitter_ms > 0 {
        rand::rng().random_range(0..=config.latency_jitter_ms)
    } else {
        0
    };
    if config.latency_ms + jitter > 0 {
        tokio::time::sleep(Duration::from_millis(config.latency_ms + jitter)).await;
    }
    let transfer = |reference: String| Transfer {
        client_ref: body.client_ref.clone(),
        rail_reference: reference,
        amount_minor: body.amount_minor,
        currency: body.currency.clone(),
        accepted_at: Utc::now(),
    };
    match fate {
        Fate::Fail5xx => Ok(json_response(
            StatusCode::BAD_GATEWAY,
            &json!({"code": "RAIL_INTERNAL", "message": "the rail failed; nothing was accepted"}),
        )),
        Fate::Decline => Ok(json_response(
            StatusCode::PAYMENT_REQUIRED,
            &json!({"code": "DECLINED", "message": "the rail declined the transfer"}),
        )),
        Fate::Drop { accepted } => {
            if accepted {
                let mut ledger = state.ledger.lock().await;
                ledger
                    .accept(transfer(new_reference()))
                    .map_err(ApiError::internal)?;
            }
            // Hold the connection open, then give up on it without a proper answer.
            tokio::time::sleep(Duration::from_millis(config.hang_ms)).await;
            Ok((
                StatusCode::OK,
                [("connection", "close")],
                "{\"railRef", // a torn, malformed acknowledgement
            )
                .into_response())
        }
        Fate::Redirect => {
            let mut ledger = state.ledger.lock().await;
            ledger
                .accept(transfer(new_reference()))
                .map_err(ApiError::internal)?;
            Ok((
                StatusCode::TEMPORARY_REDIRECT,
                [("location", "/submit")],
                "",
            )
                .into_response())
        }
        Fate::Accept => {
            let mut ledger = state.ledger.lock().await;
            let repeat = ledger
                .by_client_ref
                .get(&body.client_ref)
                .and_then(|v| v.first().copied());
            let accepted = match repeat {
                // A repeat that the rail does not take again answers with the first reference.
                Some(first) if !rand::rng().random_bool(config.duplicate_ack_rate) => {
                    ledger.transfers[first].clone()
                }
                _ => ledger
                    .accept(transfer(new_reference()))
                    .map_err(ApiError::internal)?,
            };
            Ok(json_response(
                StatusCode::OK,
                &json!({
                    "railReference": accepted.rail_reference,
                    "acceptedAt": dlock_contract::time::format(&accepted.accepted_at),
                }),
            ))
        }
    }
}

async fn statement(
    State(state): State<StubState>,
    RawQuery(query): RawQuery,
) -> Result<Json<Statement>, ApiError> {
    let mut client_ref = None;
    for pair in query
        .as_deref()
        .unwrap_or("")
        .split('&')
        .filter(|p| !p.is_empty())
    {
        match pair.split_once('=') {
            Some(("clientRef", v)) => client_ref = Some(v.to_owned()),
            _ => {
                return Err(ApiError::new(
                    ErrorCode::ValidationFailed,
                    "the only query parameter is clientRef",
                ));
            }
        }
    }
    let ledger = state.ledger.lock().await;
    let transfers = match client_ref {
        Some(r) => ledger
            .by_client_ref
            .get(&r)
            .map(|ix| ix.iter().map(|i| ledger.transfers[*i].clone()).collect())
            .unwrap_or_default(),
        None => ledger.transfers.clone(),
    };
    Ok(Json(Statement { transfers }))
}

async fn healthz() -> Json<serde_json::Value> {
    Json(json!({"status": "ok"}))
}

/// The rail stub's OpenAPI document (C3 §3.6), served at `GET /v1/openapi.json`. Each operation
/// documents the handler of the same name above.
pub mod openapi {
    #![allow(dead_code)]

    use dlock_contract::error::ErrorBody;
    use dlock_contract::rail::Statement;
    use utoipa::OpenApi;

    use super::SubmitRequest;

    #[derive(OpenApi)]
    #[openapi(
        info(
            title = "dlock rail stub",
            description = "A hostile stand-in for the payment rail: slow, lossy, non-idempotent (C3 §3.6)."
        ),
        paths(submit, statement, healthz, readyz)
    )]
    pub struct ApiDoc;

    /// The rail stub's document.
    pub fn document() -> utoipa::openapi::OpenApi {
        ApiDoc::openapi()
    }

    /// One transfer; every accepted call is a fresh transfer.
    #[utoipa::path(post, path = "/submit", request_body = SubmitRequest, responses(
        (status = 200, description = "accepted: railReference, acceptedAt", body = serde_json::Value),
        (status = 400, description = "VALIDATION_FAILED", body = ErrorBody),
        (status = 402, description = "declined (the rail's own body, not the envelope)", body = serde_json::Value),
        (status = 502, description = "the rail failed (the rail's own body, not the envelope)", body = serde_json::Value),
    ))]
    fn submit() {}

    /// The durable statement, optionally for one clientRef.
    #[utoipa::path(get, path = "/statement", params(("clientRef" = Option<String>, Query)), responses(
        (status = 200, body = Statement),
        (status = 400, description = "VALIDATION_FAILED", body = ErrorBody),
    ))]
    fn statement() {}

    /// Process up.
    #[utoipa::path(get, path = "/healthz", responses((status = 200, body = serde_json::Value)))]
    fn healthz() {}

    /// Ready.
    #[utoipa::path(get, path = "/readyz", responses((status = 200, body = serde_json::Value)))]
    fn readyz() {}
}
