//! The PostgreSQL pool every service opens (lockdb and paydb alike), its settings, and what a
//! database failure means to a caller.

use std::time::Duration;

use sqlx::PgPool;
use sqlx::migrate::Migrator;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

use crate::config::{ConfigError, RawConfig};

/// Who makes an operator write and why, for its audit row: the operator as typed, what the
/// caller's credential authenticated as, the owner the write names, and the reason.
#[derive(Debug, Clone, Copy)]
pub struct Audit<'a> {
    pub operator: &'a str,
    pub identity: &'a str,
    pub owner_id: &'a str,
    pub reason: &'a str,
}

impl<'a> Audit<'a> {
    /// The audit of a write whose body carries `operator` and `reason`, both trimmed.
    pub fn new(operator: &'a str, reason: &'a str, identity: &'a str, owner_id: &'a str) -> Self {
        Self {
            operator: operator.trim(),
            identity,
            owner_id,
            reason: reason.trim(),
        }
    }

    /// A docs/design.md#d-8 recovery, `sql` (`SELECT … FROM <function>($1, …, $6)`), bound with the
    /// key whose fence or mark it lowers, the token it lowers to, then the operator, the identity,
    /// the owner and the reason.
    pub fn lowering<O>(
        self,
        sql: &'static str,
        key: &'a str,
        to: i64,
    ) -> sqlx::query::QueryAs<'a, sqlx::Postgres, O, sqlx::postgres::PgArguments>
    where
        O: for<'r> sqlx::FromRow<'r, sqlx::postgres::PgRow>,
    {
        sqlx::query_as(sql)
            .bind(key)
            .bind(to)
            .bind(self.operator)
            .bind(self.identity)
            .bind(self.owner_id)
            .bind(self.reason)
    }
}

/// A pooled connection idle this long is pinged before it is used.
pub const IDLE_PING_AFTER: Duration = Duration::from_secs(1);

/// Pool options with at most `max_connections`, waiting at most `acquire_timeout` for one;
/// a connection is pinged before use only when it was idle for IDLE_PING_AFTER or longer.
pub fn pool_options(max_connections: u32, acquire_timeout: Duration) -> PgPoolOptions {
    PgPoolOptions::new()
        .max_connections(max_connections)
        .acquire_timeout(acquire_timeout)
        // sqlx pings a connection before handing it out: one more round trip in front of
        // every call (0.2 ms of a 0.25 ms `SELECT 1` here). It pings again when the
        // connection comes back, which catches one broken in use. What is left to catch is a
        // connection cut while idle (a restarted or failed-over primary): only one idle for
        // longer than IDLE_PING_AFTER is pinged. A cut one that slips through fails its call
        // with an I/O error and is dropped. The lock server pings before each write and answers
        // OUTCOME_UNKNOWN for an I/O error after the send (docs/contract.md#outcome-unknown); the
        // payment resource answers NOT_LEADER, which its writes bear because each is idempotent
        // by its key: a retry with the same key replays a write that did commit.
        .test_before_acquire(false)
        .before_acquire(|conn, meta| {
            Box::pin(async move {
                if meta.idle_for >= IDLE_PING_AFTER {
                    sqlx::Connection::ping(conn).await?;
                }
                Ok(true)
            })
        })
}

/// `<prefix>.url`, `<prefix>.pool-max`, `<prefix>.acquire-timeout-ms`, `<prefix>.migrate`: the
/// database a service opens (`lock.pg`, `payment.pg`, `rail.proxy.pg`).
#[derive(Debug, Clone)]
pub struct PgSettings {
    /// `<prefix>.url`: the primary.
    pub url: String,
    /// `<prefix>.pool-max`.
    pub pool_max: u32,
    /// `<prefix>.acquire-timeout-ms`.
    pub acquire_timeout: Duration,
    /// `<prefix>.migrate`: apply the migrations before serving, so a new replica never serves
    /// against an old schema.
    pub migrate: bool,
    /// The configuration prefix these came from, for the messages.
    pub prefix: String,
}

impl PgSettings {
    /// Reads the four keys under `prefix`; `url_required` is the message when the URL is unset.
    pub fn from_raw(
        raw: &mut RawConfig,
        prefix: &str,
        pool_max_default: i64,
        url_required: &str,
    ) -> Result<Self, ConfigError> {
        let url_key = format!("{prefix}.url");
        // The URL carries the database password: `{prefix}.url-file` names a file mounted from a
        // Secret that holds it.
        let url = raw.secret(&url_key)?.ok_or_else(|| ConfigError {
            key: url_key.clone(),
            origin: String::new(),
            message: format!("{url_required}; or `{url_key}-file`, a file holding it"),
        })?;
        Ok(Self {
            url,
            pool_max: raw.integer(&format!("{prefix}.pool-max"), pool_max_default, 1..=512)? as u32,
            acquire_timeout: Duration::from_millis(raw.integer(
                &format!("{prefix}.acquire-timeout-ms"),
                2_000,
                50..=60_000,
            )? as u64),
            migrate: raw.boolean(&format!("{prefix}.migrate"), true)?,
            prefix: prefix.to_owned(),
        })
    }

    /// Opens the pool (lazily) as `application`; applies `migrator` to `database` first when
    /// `migrate` is set, after adopting a database built by the migrations its baseline squashed
    /// ([`crate::squash`]).
    pub async fn connect(
        &self,
        application: &str,
        migrator: &Migrator,
        database: &str,
    ) -> Result<PgPool, ConnectError> {
        let prefix = &self.prefix;
        let options: PgConnectOptions = self
            .url
            .parse()
            .map_err(|e| ConnectError(format!("{prefix}.url is not a PostgreSQL URL: {e}")))?;
        let pool = pool_options(self.pool_max, self.acquire_timeout)
            .connect_lazy_with(options.application_name(application));
        if self.migrate {
            let adopted = crate::squash::adopt(&pool, migrator, database)
                .await
                .map_err(|e| ConnectError(e.to_string()))?;
            if let crate::squash::Adoption::Adopted { retired, baseline } = adopted {
                tracing::info!(
                    database,
                    retired,
                    baseline = ?baseline,
                    "the {database} migration history was squashed into versions {baseline:?}: \
                     its {retired} applied migrations are now recorded as those"
                );
            }
            migrator.run(&pool).await.map_err(|e| {
                ConnectError(format!(
                    "applying the {database} migrations failed (is {prefix}.url the {database} \
                     primary?): {e}"
                ))
            })?;
        }
        Ok(pool)
    }
}

/// Why [`PgSettings::connect`] opened no pool: the URL is not one, or the migrations failed.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct ConnectError(String);

/// Whether `database` behind `pool` takes writes: `None` for a primary, `Some(why)` for a standby
/// in recovery.
pub async fn standby(pool: &PgPool, database: &str) -> Result<Option<String>, sqlx::Error> {
    let (in_recovery,): (bool,) = sqlx::query_as("SELECT pg_is_in_recovery()")
        .fetch_one(pool)
        .await?;
    Ok(in_recovery.then(|| format!("{database} is in recovery (a standby)")))
}

/// What a database failure lets the caller conclude (docs/design.md#d-4): `Some(why)` when
/// `database` cannot take writes here (unreachable, a read-only replica, shutting down or still
/// starting), so nothing happened and the call may be retried elsewhere (NOT_LEADER); `None` for
/// any other failure.
pub fn unavailable(error: &sqlx::Error, database: &str) -> Option<String> {
    match error {
        sqlx::Error::PoolTimedOut | sqlx::Error::PoolClosed | sqlx::Error::Io(_) => {
            Some(format!("{database} is unreachable: {error}"))
        }
        sqlx::Error::Database(db) => match db.code().as_deref() {
            // read_only_sql_transaction: this is a standby; admin_shutdown, crash_shutdown,
            // cannot_connect_now: the server is going away or still starting.
            Some("25006") => Some(format!("{database} is a read-only replica")),
            Some("57P01") | Some("57P02") | Some("57P03") => {
                Some(format!("{database} is not accepting writes: {error}"))
            }
            _ => None,
        },
        _ => None,
    }
}
