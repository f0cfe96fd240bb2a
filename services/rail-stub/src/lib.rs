//! The rail stub (docs/contract.md#s3-6): a stand-in for a payment rail we cannot change.
//!
//! It knows nothing of locks, tokens, sessions or fences, and it is deliberately not idempotent:
//! every accepted call is a transfer, and a repeated `clientRef` may be accepted again under a
//! new reference. Every safety property of dlock must hold with this stub treated as a hostile,
//! memoryless black box; making it idempotent would prove nothing.
//!
//! What it has accepted is its statement (`GET /statement`), which survives a restart: each
//! accepted transfer is appended to a file before the stub answers. The statement stays on
//! disk: lookups by clientRef go through an index file beside it (redb, bounded cache) and the
//! whole statement is streamed from the file, so memory does not grow with the transfers.
//!
//! Only the rail proxy may submit: `POST /submit` needs a credential (`auth.mode` tokens or
//! tokenreview) whose identity is in `rail.stub.submitter-identities`; anything else is refused
//! before a transfer is recorded. `auth.mode` has no default here, so a stub that takes transfers
//! from anyone is configured so by name (`auth.mode = "none"`). The statement stays readable
//! without a credential, for the reconciler and the tour: it shows transfers, it cannot make one.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use axum::Router;
use dlock_server::config::{ConfigError, RawConfig};
use dlock_server::http::HttpLimits;
use ledger::Ledger;
use serde::Deserialize;
use tokio::sync::Mutex;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

mod handlers;
mod ledger;

pub use ledger::INDEX_CACHE_BYTES;

/// The key naming who may submit transfers.
pub const SUBMITTERS_KEY: &str = "rail.stub.submitter-identities";
/// The identity that may submit when `rail.stub.submitter-identities` is not set: the rail
/// proxy's on the local stack (`dlock dev up`).
pub const DEFAULT_SUBMITTER: &str = "rail-proxy";

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
    pub tls: Option<dlock_server::tls::TlsSettings>,
    /// `auth.*`: how callers are authenticated. `auth.mode` has no default here: a stub that
    /// takes transfers from anyone says so by name (`auth.mode = "none"`).
    pub auth: dlock_server::auth::Authenticator,
    /// `rail.stub.submitter-identities`: who may `POST /submit` once authenticated (the rail
    /// proxy's identity; `rail-proxy` by default). Any other identity is `403 FORBIDDEN`.
    pub submitters: Vec<String>,
}

impl RailStubConfig {
    pub fn from_raw(raw: &mut RawConfig) -> Result<Self, ConfigError> {
        let listen = raw.socket_addr("server.listen", "127.0.0.1:7090")?;
        if raw.string_optional("auth.mode")?.is_none() {
            return Err(ConfigError {
                key: "auth.mode".into(),
                origin: String::new(),
                message: format!(
                    "is required for the rail stub: `tokens` or `tokenreview`, so that only the \
                     rail proxy ({SUBMITTERS_KEY}, `{DEFAULT_SUBMITTER}` by default) may submit \
                     transfers; or `none` to take transfers from anyone who can reach it"
                ),
            });
        }
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
            tls: dlock_server::tls::TlsSettings::from_raw(raw)?,
            auth: dlock_server::auth::Authenticator::new(
                &dlock_server::auth::AuthSettings::from_raw(raw)?,
                None,
                dlock_server::auth::OperatorWithoutAuth::Refused,
            )?
            // The stub is no dlock service: it admits rail.stub.submitter-identities itself.
            .without_roles(),
            submitters: raw.string_list(SUBMITTERS_KEY, &[DEFAULT_SUBMITTER])?,
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

/// The rail stub's own routes (`/healthz` and the document are added by `dlock_server::http`), each
/// with its operation (`#[utoipa::path]` on its handler): [`app`] serves them, and the document
/// ([`openapi::document`]) is made of their operations.
fn routes() -> OpenApiRouter<StubState> {
    OpenApiRouter::with_openapi(<openapi::ApiDoc as utoipa::OpenApi>::openapi())
        .routes(routes!(handlers::submit))
        .routes(routes!(handlers::statement))
        .routes(routes!(handlers::readyz))
}

pub fn app(state: StubState) -> Router {
    let limits = HttpLimits {
        body_bytes_max: 16 * 1024,
        request_timeout: Duration::from_secs(3_600),
    };
    let auth = &state.config.auth;
    let batches = &dlock_server::openapi::BatchEndpoints(&[]);
    dlock_server::http::service(routes(), state.clone(), batches, auth, limits)
}

pub async fn run(config: RailStubConfig) -> anyhow::Result<()> {
    let listen = config.listen;
    let tls = config.tls.clone();
    config.auth.announce("rail-stub");
    if config.auth.mode() != dlock_server::auth::AuthMode::None {
        tracing::info!(
            event = "rail_submitters",
            submitters = ?config.submitters,
            "only these identities may submit transfers; the statement stays readable by anyone"
        );
    }
    let state = StubState::open(config)?;
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .with_context(|| format!("cannot listen on {listen} (server.listen)"))?;
    tracing::info!(event = "rail_stub_started", listen = %listener.local_addr()?, "rail stub is serving");
    dlock_server::http::serve_until_signal(listener, tls.as_ref(), app(state))
        .await
        .context("the HTTP server failed")?;
    Ok(())
}

/// The rail stub's OpenAPI document (docs/contract.md#s3-6), served at `GET /v1/openapi.json`. Each
/// route's operation is declared once, on its handler (`#[utoipa::path]`), and collected from the
/// router ([`routes`]).
pub mod openapi {
    use utoipa::OpenApi;

    #[derive(OpenApi)]
    #[openapi(info(
        title = "dlock rail stub",
        description = "A hostile stand-in for the payment rail: slow, lossy, non-idempotent."
    ))]
    pub struct ApiDoc;

    /// The rail stub's document: this one's, then the operation of each of its routes
    /// (`super::routes`) and of what every service serves.
    pub fn document() -> utoipa::openapi::OpenApi {
        dlock_server::http::document(super::routes())
    }
}
