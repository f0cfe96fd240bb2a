//! The rail proxy's configuration.

use std::path::{Path, PathBuf};
use std::time::Duration;

use dlock_contract::auth::Credential;
use dlock_server::config::{ConfigError, RawConfig};
use dlock_server::http::Served;
use dlock_server::pg::PgSettings;
use dlock_server::proof::ProofKeys;

#[derive(Debug, Clone)]
pub struct RailProxyConfig {
    /// `server.*` and `auth.*`; `rail.proxy.operator-token` is one more operator credential.
    pub served: Served,
    /// `rail.proxy.pg.*`: paydb, where the high-water marks and the intents live.
    pub pg: PgSettings,
    /// `rail.proxy.rail-url`: the rail (the stub in development).
    pub rail_url: String,
    /// `rail.proxy.connect-timeout-ms`: 1 s by default.
    pub rail_connect_timeout: Duration,
    /// `rail.proxy.read-timeout-ms`: 8 s by default, below the executor's submit budget.
    pub rail_read_timeout: Duration,
    /// `rail.proxy.unresolved-margin-ms`: added to the read timeout before an unresolved intent
    /// is declared ambiguous (docs/design.md#d-5).
    pub unresolved_margin: Duration,
    /// `rail.proxy.sweep-interval-ms`: how often unresolved intents are checked (and FENCED
    /// attempts past their retention deleted).
    pub sweep_interval: Duration,
    /// `rail.proxy.fenced-retention-ms`: how long a FENCED attempt (a stale writer refused
    /// before any rail call) is kept as evidence before the sweep deletes it. 30 days by default.
    pub fenced_retention: Duration,
    /// `rail.proxy.operator-token`: the credential of operator-only calls (high-water advance).
    pub operator_token: Option<String>,
    /// `rail.proxy.rail-credential-file`: the bearer token this proxy presents to the rail.
    pub rail_credential: Option<Credential>,
    /// `rail.proxy.rail-ca-file`: the CA bundle of an HTTPS rail (the system's roots otherwise).
    pub rail_ca_file: Option<PathBuf>,
    /// `fencing.proof-keys-file` (docs/design.md#d-8): when set, a submission needs the lock
    /// server's `X-Fencing-Proof` of its token on `payout:{accountId}`, and high-water recovery is
    /// possible.
    pub proof_keys: Option<ProofKeys>,
    /// `rail.batch.max` (docs/design.md#group-commit): the most admissions one paydb transaction
    /// takes when they queue behind a running one, at most one per payout and per account. 32 by
    /// default, as the payment resource's `payment.batch.max`: paydb spends 11 % less CPU per
    /// payout than with 16 (docs/benchmarks.md#the-run-before-the-rail-proxys-batches-of-32); 1
    /// admits every submission in its own transaction.
    pub batch_max: usize,
}

impl RailProxyConfig {
    pub fn from_raw(raw: &mut RawConfig) -> Result<Self, ConfigError> {
        let listen = raw.socket_addr("server.listen", "127.0.0.1:7080")?;
        let pg = PgSettings::from_raw(
            raw,
            "rail.proxy.pg",
            16,
            "is required (postgres://user@host:port/paydb)",
        )?;
        let rail_url = raw.string_required("rail.proxy.rail-url", "http://rail-stub:7090")?;
        let read_ms = raw.integer("rail.proxy.read-timeout-ms", 8_000, 100..=120_000)?;
        let operator_token = raw.secret("rail.proxy.operator-token")?;
        // A forward may take the whole read timeout; the request must outlive it.
        let request_timeout = Duration::from_millis(read_ms as u64 + 5_000);
        let served = Served::from_raw(raw, listen, request_timeout, operator_token.as_deref())?;
        let config = Self {
            pg,
            rail_url,
            rail_connect_timeout: raw.millis(
                "rail.proxy.connect-timeout-ms",
                1_000,
                10..=60_000,
            )?,
            rail_read_timeout: Duration::from_millis(read_ms as u64),
            unresolved_margin: raw.millis("rail.proxy.unresolved-margin-ms", 2_000, 0..=600_000)?,
            sweep_interval: raw.millis("rail.proxy.sweep-interval-ms", 5_000, 50..=600_000)?,
            fenced_retention: raw.millis(
                "rail.proxy.fenced-retention-ms",
                30 * 24 * 3_600_000,
                1_000..=365 * 24 * 3_600_000,
            )?,
            rail_credential: match raw.string_optional("rail.proxy.rail-credential-file")? {
                None => None,
                Some(path) => Some(Credential::from_file(Path::new(&path)).map_err(|message| {
                    ConfigError::new("rail.proxy.rail-credential-file", message)
                })?),
            },
            rail_ca_file: raw
                .string_optional("rail.proxy.rail-ca-file")?
                .map(PathBuf::from),
            served,
            operator_token,
            proof_keys: ProofKeys::from_raw(raw)?,
            batch_max: raw.integer("rail.batch.max", 32, 1..=256)? as usize,
        };
        Ok(config)
    }
}
