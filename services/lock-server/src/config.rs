//! The lock server's configuration (docs/design.md#configuration keys plus the server's own
//! limits).

use std::path::PathBuf;
use std::time::Duration;

use dlock_contract::lock::{TTL_MS_MAX, TTL_MS_MIN, WAIT_MS_MAX};
use dlock_server::auth::{AuthSettings, Authenticator, OperatorWithoutAuth};
use dlock_server::config::{ConfigError, RawConfig};
use dlock_server::http::{HttpLimits, Served};
use dlock_server::pg::PgSettings;
use dlock_server::proof::ProofKeys;
use dlock_server::tls::TlsSettings;

#[derive(Debug, Clone)]
pub struct EtcdSettings {
    pub endpoints: Vec<String>,
    /// Every key the lock server writes starts with this prefix.
    pub prefix: String,
    pub connect_timeout: Duration,
    pub request_timeout: Duration,
    /// `lock.etcd.ca-file`, `cert-file`, `key-file`: TLS to etcd (https endpoints).
    pub tls: Option<EtcdTlsFiles>,
    /// `lock.etcd.username` and `lock.etcd.password-file`: etcd's own authentication.
    pub user: Option<EtcdUser>,
    /// `lock.etcd.high-water.url` (and `.url-file`, `.pool-max`, `.acquire-timeout-ms`,
    /// `.migrate`): the lockdb that records the highest token answered, outside etcd, so a
    /// restore of etcd to an older revision is caught (docs/design.md#d-12-etcd). Unset: not
    /// detected.
    pub high_water: Option<PgSettings>,
}

/// The PEM files of the lock server's TLS to etcd, re-read when they change.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EtcdTlsFiles {
    /// The CA bundle that etcd's serving certificate must chain to.
    pub ca_file: PathBuf,
    /// The client certificate and key (for etcd's `--client-cert-auth`), both or neither.
    pub client: Option<(PathBuf, PathBuf)>,
}

/// An etcd user; the password stays in its file (re-read when it changes), never in memory
/// longer than a connection attempt and never in a log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EtcdUser {
    pub name: String,
    pub password_file: PathBuf,
}

/// Reads `lock.etcd.ca-file`, `cert-file`, `key-file`, `username` and `password-file`, and
/// checks them against the endpoints' schemes. The files themselves are read (and a bad one
/// named) when the store connects.
fn etcd_credentials(
    raw: &mut RawConfig,
    endpoints: &[String],
) -> Result<(Option<EtcdTlsFiles>, Option<EtcdUser>), ConfigError> {
    let ca = raw.string_optional("lock.etcd.ca-file")?;
    let cert = raw.string_optional("lock.etcd.cert-file")?;
    let key = raw.string_optional("lock.etcd.key-file")?;
    let client = match (cert, key) {
        (Some(cert), Some(key)) => Some((PathBuf::from(cert), PathBuf::from(key))),
        (None, None) => None,
        _ => {
            return Err(ConfigError::new(
                "lock.etcd.cert-file",
                "lock.etcd.cert-file and lock.etcd.key-file go together: set both for a client \
                 certificate, or neither",
            ));
        }
    };
    let tls = match (ca, client) {
        (Some(ca), client) => Some(EtcdTlsFiles {
            ca_file: ca.into(),
            client,
        }),
        (None, Some(_)) => {
            return Err(ConfigError::new(
                "lock.etcd.ca-file",
                "is required with lock.etcd.cert-file: name the CA bundle that signed etcd's \
                 serving certificate",
            ));
        }
        (None, None) => None,
    };
    for endpoint in endpoints {
        let https = endpoint.starts_with("https://");
        if tls.is_some() && endpoint.starts_with("http://") {
            return Err(ConfigError::new(
                "lock.etcd.endpoints",
                format!(
                    "{endpoint:?} is plain HTTP but lock.etcd.ca-file is set: write https:// \
                     endpoints for TLS"
                ),
            ));
        }
        if tls.is_none() && https {
            return Err(ConfigError::new(
                "lock.etcd.ca-file",
                format!(
                    "is required for the https endpoint {endpoint:?}: name the CA bundle that \
                     signed etcd's serving certificate"
                ),
            ));
        }
    }
    let username = raw.string_optional("lock.etcd.username")?;
    let password_file = raw.string_optional("lock.etcd.password-file")?;
    let user = match (username, password_file) {
        (Some(name), Some(file)) => Some(EtcdUser {
            name,
            password_file: file.into(),
        }),
        (None, None) => None,
        (Some(_), None) => {
            return Err(ConfigError::new(
                "lock.etcd.password-file",
                "is required with lock.etcd.username: name the file holding the user's password",
            ));
        }
        (None, Some(_)) => {
            return Err(ConfigError::new(
                "lock.etcd.username",
                "is required with lock.etcd.password-file",
            ));
        }
    };
    Ok((tls, user))
}

#[derive(Debug, Clone)]
pub enum BackendSettings {
    Pg(PgSettings),
    Etcd(EtcdSettings),
}

#[derive(Debug, Clone)]
pub struct LockServerConfig {
    /// `server.*` and `auth.*`. L8 (revoke) needs an operator identity once auth is on.
    pub served: Served,
    pub backend: BackendSettings,
    /// `lock.session.ttl`: a session's TTL when the request names none.
    pub session_ttl_default_ms: i64,
    /// `lock.session.ttl-max`: longer requested session TTLs are clamped down to this.
    pub session_ttl_max_ms: i64,
    /// `lock.default.ttl`: a grant's TTL when the request names none.
    pub lock_ttl_default_ms: i64,
    /// `lock.ttl-max`: longer requested grant TTLs are clamped down to this.
    pub lock_ttl_max_ms: i64,
    /// `lock.session.expired-retention`: how long an expired session still answers 410.
    pub expired_session_retention_ms: i64,
    /// `lock.waiters.max-per-key`: the cap of a key's FIFO waiter queue.
    pub waiters_per_key_max: i64,
    /// `lock.waiters.max-per-session`: how many places of one key's queue one session may hold
    /// at once (default 1), so no session can fill a key's queue alone.
    pub waiters_per_session_max: i64,
    /// `lock.waiters.poll-ms`: how often a waiter re-checks a key another replica may release.
    pub waiter_poll_ms: u64,
    /// `lock.contention.retry-after-ms`: the `retryAfterMillis` of CONTENTION_EXCEEDED.
    pub contention_retry_after_ms: u64,
    /// `lock.client.safety-margin`: the clients' share of a TTL kept as margin (served for them).
    pub client_safety_margin: f64,
    /// `lock.sweep.interval-ms`: how often lapsed rows are cleaned up.
    pub sweep_interval_ms: u64,
    /// `lock.keys-seen.retention`: how long a key nobody holds or waits for is remembered after
    /// its last grant (L7 answers 404 for it afterwards).
    pub keys_seen_retention_ms: i64,
    /// `auth.owner-binding`, which the server applies to the body's `ownerId` of L1 too (the
    /// auth layer sees only the `X-Owner-Id` header).
    pub owner_binding: bool,
    /// `fencing.proof-keys-file`: the keys that sign every grant (docs/design.md#d-8). Unset:
    /// grants carry no proof, and the enforcement points cannot tell a forged token from a real
    /// one.
    pub proof_keys: Option<ProofKeys>,
    /// `lock.pg.batch.max`: the most acquires (releases) one lockdb transaction takes when they
    /// queue behind a running one (docs/design.md#group-commit); 1 runs each alone. 1 on etcd.
    pub pg_batch_max: usize,
}

impl LockServerConfig {
    pub fn from_raw(raw: &mut RawConfig) -> Result<Self, ConfigError> {
        let listen = raw.socket_addr("server.listen", "127.0.0.1:7070")?;
        let backend = match raw.choice("lock.backend", "pg", &["pg", "etcd"])?.as_str() {
            "etcd" => {
                let endpoints =
                    raw.string_list("lock.etcd.endpoints", &["http://127.0.0.1:2379"])?;
                if endpoints.is_empty() {
                    return Err(ConfigError {
                        key: "lock.etcd.endpoints".into(),
                        origin: String::new(),
                        message: "must name at least one etcd endpoint".into(),
                    });
                }
                let (tls, user) = etcd_credentials(raw, &endpoints)?;
                let high_water = match raw.secret("lock.etcd.high-water.url")? {
                    Some(_) => Some(PgSettings::from_raw(
                        raw,
                        "lock.etcd.high-water",
                        4,
                        "is required for the high-water (postgres://user@host:port/lockdb)",
                    )?),
                    None => None,
                };
                BackendSettings::Etcd(EtcdSettings {
                    tls,
                    user,
                    high_water,
                    endpoints,
                    prefix: raw.string("lock.etcd.prefix", "/dlock")?,
                    connect_timeout: raw.millis(
                        "lock.etcd.connect-timeout-ms",
                        2_000,
                        100..=60_000,
                    )?,
                    // Below the callers' 2 s write timeout (docs/contract.md#s3-8): a write stalled
                    // by an election is answered 503 NOT_LEADER before the caller gives up on it.
                    request_timeout: raw.millis(
                        "lock.etcd.request-timeout-ms",
                        1_500,
                        100..=60_000,
                    )?,
                })
            }
            _ => BackendSettings::Pg(PgSettings::from_raw(
                raw,
                "lock.pg",
                16,
                "is required when lock.backend = \"pg\" (postgres://user@host:port/lockdb)",
            )?),
        };
        let pg_batch_max = match backend {
            BackendSettings::Pg(_) => raw.integer("lock.pg.batch.max", 32, 1..=256)? as usize,
            BackendSettings::Etcd(_) => 1,
        };
        let range = TTL_MS_MIN..=TTL_MS_MAX;
        let session_ttl_max_ms = raw.integer("lock.session.ttl-max", TTL_MS_MAX, range.clone())?;
        let lock_ttl_max_ms = raw.integer("lock.ttl-max", TTL_MS_MAX, range.clone())?;
        let session_ttl_default_ms =
            raw.integer("lock.session.ttl", 10_000, TTL_MS_MIN..=session_ttl_max_ms)?;
        let lock_ttl_default_ms =
            raw.integer("lock.default.ttl", 10_000, TTL_MS_MIN..=lock_ttl_max_ms)?;
        let http = HttpLimits {
            body_bytes_max: raw.integer("server.body-limit-bytes", 64 * 1024, 1024..=16 << 20)?
                as usize,
            request_timeout: raw.millis(
                "server.request-timeout-ms",
                WAIT_MS_MAX + 10_000,
                WAIT_MS_MAX + 1_000..=600_000,
            )?,
        };
        let auth_settings = AuthSettings::from_raw(raw)?;
        let auth = Authenticator::new(&auth_settings, None, OperatorWithoutAuth::Open)?;
        let served = Served {
            listen,
            http,
            tls: TlsSettings::from_raw(raw)?,
            auth,
        };
        let proof_keys = ProofKeys::from_raw(raw)?;
        let waiters_per_key_max = raw.integer("lock.waiters.max-per-key", 64, 1..=10_000)?;
        Ok(Self {
            served,
            backend,
            session_ttl_default_ms,
            session_ttl_max_ms,
            lock_ttl_default_ms,
            lock_ttl_max_ms,
            expired_session_retention_ms: raw.integer(
                "lock.session.expired-retention",
                3_600_000,
                0..=30 * 86_400_000,
            )?,
            waiters_per_key_max,
            waiters_per_session_max: raw.integer(
                "lock.waiters.max-per-session",
                1,
                1..=waiters_per_key_max,
            )?,
            waiter_poll_ms: raw.integer("lock.waiters.poll-ms", 25, 1..=1_000)? as u64,
            contention_retry_after_ms: raw.integer(
                "lock.contention.retry-after-ms",
                500,
                1..=60_000,
            )? as u64,
            client_safety_margin: raw.decimal("lock.client.safety-margin", 0.30, 0.05..=0.9)?,
            sweep_interval_ms: raw.integer("lock.sweep.interval-ms", 30_000, 100..=3_600_000)?
                as u64,
            keys_seen_retention_ms: raw.integer(
                "lock.keys-seen.retention",
                7 * 86_400_000,
                1_000..=366 * 86_400_000,
            )?,
            owner_binding: auth_settings.owner_binding,
            proof_keys,
            pg_batch_max,
        })
    }

    pub fn backend_name(&self) -> &'static str {
        match self.backend {
            BackendSettings::Pg(_) => "pg",
            BackendSettings::Etcd(_) => "etcd",
        }
    }
}
