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
        let pool = match multi_host(&self.url)
            .map_err(|e| ConnectError(format!("{prefix}.url is not a PostgreSQL URL: {e}")))?
        {
            Some(hosts) => {
                Failover::open(
                    hosts,
                    application,
                    database,
                    self.pool_max,
                    self.acquire_timeout,
                )
                .await
            }
            None => {
                let options: PgConnectOptions = self.url.parse().map_err(|e| {
                    ConnectError(format!("{prefix}.url is not a PostgreSQL URL: {e}"))
                })?;
                pool_options(self.pool_max, self.acquire_timeout)
                    .connect_lazy_with(options.application_name(application))
            }
        };
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
        // A connection that failed while it was being opened sent no statement: something
        // that is not PostgreSQL (or a dying one) answered the SSLRequest, or TLS failed.
        sqlx::Error::Tls(_) => Some(format!("{database} is unreachable: {error}")),
        sqlx::Error::Protocol(message) if opening_failed(message) => {
            Some(format!("{database} is unreachable: {error}"))
        }
        sqlx::Error::Database(db) => match db.code().as_deref() {
            // read_only_sql_transaction: this is a standby; admin_shutdown, crash_shutdown,
            // cannot_connect_now: the server is going away or still starting.
            Some("25006") => Some(format!("{database} is a read-only replica")),
            Some("57P01") | Some("57P02") | Some("57P03") => {
                Some(format!("{database} is not accepting writes: {error}"))
            }
            // Raised by paydb's epoch guard (migrations/paydb/0038_baseline_guards.sql) in the
            // write's own transaction: paydb may have gone back in time and takes no write until an
            // operator confirms a recovery (docs/design.md#d-12). Nothing was written.
            Some(EPOCH_CHANGED) => {
                let hint = db
                    .try_downcast_ref::<sqlx::postgres::PgDatabaseError>()
                    .and_then(|pg| pg.hint())
                    .unwrap_or_default();
                Some(format!("{}; {hint}", db.message()))
            }
            _ => None,
        },
        _ => None,
    }
}

/// Whether a protocol error is one of opening a connection (no statement was sent on it), as
/// seen when a dead primary's port was answered by something else during a failover.
pub fn opening_failed(message: &str) -> bool {
    message.contains("SSLRequest") || message.starts_with("establish:")
}

/// The SQLSTATE of paydb's epoch guard: paydb is on a new timeline after a primary that was not
/// replicating synchronously (docs/design.md#d-12).
pub const EPOCH_CHANGED: &str = "DL012";

/// The hosts of a multi-host `<prefix>.url` and how to choose among them.
#[derive(Debug, Clone)]
pub struct MultiHost {
    /// One set of connect options per host, in the URL's order.
    pub hosts: Vec<PgConnectOptions>,
    /// `target_session_attrs=read-write` (or `primary`): only a server that takes writes will do.
    pub read_write: bool,
}

/// `Some` when `url` names more than one host, as libpq spells it: the URL form
/// `postgres://user@h1:p1,h2:p2/db?target_session_attrs=read-write` or the key/value form
/// `host=h1,h2 port=p1,p2 dbname=db user=user target_session_attrs=read-write`. `None` for one
/// host, which is opened exactly as before (sqlx's own parsing).
pub fn multi_host(url: &str) -> Result<Option<MultiHost>, String> {
    let url = url.trim();
    let (hosts, mut params): (Vec<HostPort>, Vec<(String, String)>) = if let Some(rest) = url
        .strip_prefix("postgres://")
        .or_else(|| url.strip_prefix("postgresql://"))
    {
        let end = rest.find(['/', '?']).unwrap_or(rest.len());
        let (authority, tail) = rest.split_at(end);
        let (userinfo, hostlist) = match authority.rfind('@') {
            Some(at) => (Some(&authority[..at]), &authority[at + 1..]),
            None => (None, authority),
        };
        if !hostlist.contains(',') {
            return Ok(None);
        }
        let hosts = hostlist
            .split(',')
            .map(host_port)
            .collect::<Result<Vec<_>, _>>()?;
        let (path, query) = match tail.find('?') {
            Some(q) => (&tail[..q], &tail[q + 1..]),
            None => (tail, ""),
        };
        let mut params = Vec::new();
        if let Some(userinfo) = userinfo {
            let (user, password) = match userinfo.find(':') {
                Some(c) => (&userinfo[..c], Some(&userinfo[c + 1..])),
                None => (userinfo, None),
            };
            params.push(("user".to_owned(), percent_decode(user)?));
            if let Some(password) = password {
                params.push(("password".to_owned(), percent_decode(password)?));
            }
        }
        let database = path.trim_start_matches('/');
        if !database.is_empty() {
            params.push(("dbname".to_owned(), percent_decode(database)?));
        }
        for pair in query.split('&').filter(|p| !p.is_empty()) {
            let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
            params.push((percent_decode(key)?, percent_decode(value)?));
        }
        (hosts, params)
    } else if url.contains('=') {
        let params = key_values(url)?;
        let hosts: Vec<&str> = params
            .iter()
            .find(|(k, _)| k == "host")
            .map(|(_, v)| v.split(',').collect())
            .unwrap_or_default();
        if hosts.len() < 2 {
            return Ok(None);
        }
        let ports: Vec<&str> = params
            .iter()
            .find(|(k, _)| k == "port")
            .map(|(_, v)| v.split(',').collect())
            .unwrap_or_default();
        if ports.len() > 1 && ports.len() != hosts.len() {
            return Err(format!(
                "{} hosts but {} ports: give one port for all or one per host",
                hosts.len(),
                ports.len()
            ));
        }
        let hosts = hosts
            .iter()
            .enumerate()
            .map(|(i, h)| {
                let port = match ports.len() {
                    0 => None,
                    1 => Some(ports[0]),
                    _ => Some(ports[i]),
                };
                let port = port
                    .map(|p| {
                        p.trim()
                            .parse::<u16>()
                            .map_err(|_| format!("port {p:?} is not a port number"))
                    })
                    .transpose()?;
                Ok((h.trim().to_owned(), port))
            })
            .collect::<Result<Vec<_>, String>>()?;
        let params = params
            .into_iter()
            .filter(|(k, _)| k != "host" && k != "port")
            .collect();
        (hosts, params)
    } else {
        return Ok(None);
    };
    if hosts.iter().any(|(h, _)| h.is_empty()) {
        return Err("an empty host in the host list".to_owned());
    }
    let mut read_write = false;
    params.retain(|(key, value)| {
        if key == "target_session_attrs" {
            read_write = matches!(value.as_str(), "read-write" | "primary");
            false
        } else {
            true
        }
    });
    if let Some((_, v)) = url
        .split(['?', '&', ' '])
        .filter_map(|p| p.split_once('='))
        .find(|(k, _)| *k == "target_session_attrs")
        && !matches!(v, "read-write" | "primary" | "any")
    {
        return Err(format!(
            "target_session_attrs={v} is not supported: a service writes, so give read-write \
             (or any)"
        ));
    }
    // The other parameters are sqlx's own, read by its URL parser from a URL without a host.
    let query = params
        .iter()
        .map(|(k, v)| format!("{}={}", percent_encode(k), percent_encode(v)))
        .collect::<Vec<_>>()
        .join("&");
    let base: PgConnectOptions = format!("postgres://localhost/?{query}")
        .parse()
        .map_err(|e| format!("{e}"))?;
    let hosts = hosts
        .into_iter()
        .map(|(host, port)| {
            let options = base.clone().host(&host);
            match port {
                Some(port) => options.port(port),
                None => options.port(5432),
            }
        })
        .collect();
    Ok(Some(MultiHost { hosts, read_write }))
}

/// A host and its port, when given.
type HostPort = (String, Option<u16>);

/// `host`, `host:port` or `[v6]:port` of a URL's host list.
fn host_port(item: &str) -> Result<HostPort, String> {
    let item = item.trim();
    let (host, port) = if let Some(rest) = item.strip_prefix('[') {
        let close = rest
            .find(']')
            .ok_or_else(|| format!("{item:?}: an IPv6 address without its `]`"))?;
        let port = rest[close + 1..].strip_prefix(':');
        (&rest[..close], port)
    } else {
        match item.rsplit_once(':') {
            Some((h, p)) => (h, Some(p)),
            None => (item, None),
        }
    };
    let port = port
        .map(|p| {
            p.parse::<u16>()
                .map_err(|_| format!("{item:?}: {p:?} is not a port number"))
        })
        .transpose()?;
    Ok((percent_decode(host)?, port))
}

/// The `key=value` pairs of a libpq key/value connection string (values may be single-quoted,
/// with `\'` and `\\` escapes).
fn key_values(text: &str) -> Result<Vec<(String, String)>, String> {
    let mut pairs = Vec::new();
    let mut chars = text.chars().peekable();
    loop {
        while chars.peek().is_some_and(|c| c.is_whitespace()) {
            chars.next();
        }
        if chars.peek().is_none() {
            return Ok(pairs);
        }
        let mut key = String::new();
        while let Some(&c) = chars.peek() {
            if c == '=' || c.is_whitespace() {
                break;
            }
            key.push(c);
            chars.next();
        }
        while chars.peek().is_some_and(|c| c.is_whitespace()) {
            chars.next();
        }
        if chars.next() != Some('=') {
            return Err(format!("{key:?} has no `=value`"));
        }
        while chars.peek().is_some_and(|c| c.is_whitespace()) {
            chars.next();
        }
        let mut value = String::new();
        if chars.peek() == Some(&'\'') {
            chars.next();
            loop {
                match chars.next() {
                    Some('\\') => value.extend(chars.next()),
                    Some('\'') => break,
                    Some(c) => value.push(c),
                    None => return Err(format!("the value of {key:?} has no closing quote")),
                }
            }
        } else {
            while let Some(&c) = chars.peek() {
                if c.is_whitespace() {
                    break;
                }
                value.push(c);
                chars.next();
            }
        }
        pairs.push((key, value));
    }
}

fn percent_decode(text: &str) -> Result<String, String> {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = text
                .get(i + 1..i + 3)
                .and_then(|h| u8::from_str_radix(h, 16).ok())
                .ok_or_else(|| "a `%` not followed by two hex digits".to_owned())?;
            out.push(hex);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).map_err(|_| "percent-encoding that is not UTF-8".to_owned())
}

fn percent_encode(text: &str) -> String {
    text.bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~') {
                (b as char).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
}

/// How often the pool of a multi-host URL asks its current host whether it still takes writes.
pub const FAILOVER_CHECK_EVERY: Duration = Duration::from_millis(500);

/// A pool over the hosts of a multi-host URL that follows a failover on its own: new connections
/// go to the host chosen last (sqlx opens every connection from the pool's one set of connect
/// options, so choosing is replacing them, `Pool::set_connect_options`); a watcher asks that host
/// every [`FAILOVER_CHECK_EVERY`] whether it still takes writes, on a connection of its own, and
/// when it does not (or cannot be reached) tries the hosts in the URL's order and takes the first
/// that does; a connection that finds itself on a standby is refused and wakes the watcher; a
/// pooled connection opened before a switch is closed instead of handed out. Nothing restarts.
struct Failover {
    hosts: Vec<PgConnectOptions>,
    read_write: bool,
    database: String,
    /// The index of the host new connections go to.
    current: std::sync::atomic::AtomicUsize,
    /// When the last switch happened: connections older than this were opened to the old host.
    switched: std::sync::Mutex<Option<std::time::Instant>>,
    wake: tokio::sync::Notify,
}

impl Failover {
    async fn open(
        hosts: MultiHost,
        application: &str,
        database: &str,
        pool_max: u32,
        acquire_timeout: Duration,
    ) -> PgPool {
        let failover = std::sync::Arc::new(Self {
            hosts: hosts
                .hosts
                .into_iter()
                .map(|h| h.application_name(application))
                .collect(),
            read_write: hosts.read_write,
            database: database.to_owned(),
            current: std::sync::atomic::AtomicUsize::new(0),
            switched: std::sync::Mutex::new(None),
            wake: tokio::sync::Notify::new(),
        });
        // Start on the host that takes writes now, when one answers; else the first.
        let mut probe = failover.choose(acquire_timeout).await;
        let start = failover.current();
        let on_connect = failover.clone();
        let on_acquire = failover.clone();
        let pool = PgPoolOptions::new()
            .max_connections(pool_max)
            .acquire_timeout(acquire_timeout)
            .test_before_acquire(false)
            .after_connect(move |conn, _meta| {
                let failover = on_connect.clone();
                Box::pin(async move {
                    if let Some(why) = failover.refuses(conn).await? {
                        failover.wake.notify_one();
                        return Err(sqlx::Error::Configuration(why.into()));
                    }
                    Ok(())
                })
            })
            .before_acquire(move |conn, meta| {
                let failover = on_acquire.clone();
                Box::pin(async move {
                    let switched = failover
                        .switched
                        .lock()
                        .ok()
                        .and_then(|s| s.map(|at| at.elapsed()));
                    if switched.is_some_and(|since| meta.age > since) {
                        return Ok(false);
                    }
                    if meta.idle_for >= IDLE_PING_AFTER {
                        sqlx::Connection::ping(conn).await?;
                    }
                    Ok(true)
                })
            })
            .connect_lazy_with(failover.hosts[start].clone());
        let watched = pool.clone();
        tokio::spawn(async move {
            let closed = watched.close_event();
            tokio::pin!(closed);
            loop {
                tokio::select! {
                    _ = &mut closed => return,
                    _ = failover.wake.notified() => {}
                    _ = tokio::time::sleep(FAILOVER_CHECK_EVERY) => {}
                }
                let fine = match probe.as_mut() {
                    Some(conn) => matches!(
                        tokio::time::timeout(acquire_timeout, failover.refuses(conn)).await,
                        Ok(Ok(None))
                    ),
                    None => false,
                };
                if fine {
                    continue;
                }
                let was = failover.current();
                probe = failover.choose(acquire_timeout).await;
                let now = failover.current();
                if probe.is_some() && now != was {
                    if let Ok(mut switched) = failover.switched.lock() {
                        *switched = Some(std::time::Instant::now());
                    }
                    watched.set_connect_options(failover.hosts[now].clone());
                    tracing::warn!(
                        database = %failover.database,
                        from = %failover.describe(was),
                        to = %failover.describe(now),
                        "{} failed over: new connections go to {}, which takes writes; \
                         connections to {} are closed as they come back",
                        failover.database,
                        failover.describe(now),
                        failover.describe(was),
                    );
                }
            }
        });
        pool
    }

    fn current(&self) -> usize {
        self.current.load(std::sync::atomic::Ordering::SeqCst)
    }

    fn describe(&self, index: usize) -> String {
        let host = &self.hosts[index];
        format!("{}:{}", host.get_host(), host.get_port())
    }

    /// Why `conn` will not do (a standby, or read-only, when writes are wanted), or `None`.
    async fn refuses(&self, conn: &mut sqlx::PgConnection) -> Result<Option<String>, sqlx::Error> {
        if !self.read_write {
            sqlx::Connection::ping(conn).await?;
            return Ok(None);
        }
        let (read_only,): (bool,) = sqlx::query_as(
            "SELECT pg_is_in_recovery() OR current_setting('transaction_read_only')::bool",
        )
        .fetch_one(conn)
        .await?;
        Ok(read_only.then(|| {
            format!(
                "{} here does not take writes (a standby): target_session_attrs=read-write \
                 looks for the primary among the URL's other hosts",
                self.database
            )
        }))
    }

    /// Tries the hosts in order and makes the first that will do the current one; its connection
    /// (kept by the watcher to ask again), or `None` when none will (the current one stays).
    async fn choose(&self, wait: Duration) -> Option<sqlx::PgConnection> {
        use sqlx::ConnectOptions;
        for (index, options) in self.hosts.iter().enumerate() {
            let Ok(Ok(mut conn)) = tokio::time::timeout(wait, options.connect()).await else {
                continue;
            };
            if matches!(self.refuses(&mut conn).await, Ok(None)) {
                self.current
                    .store(index, std::sync::atomic::Ordering::SeqCst);
                return Some(conn);
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hosts(url: &str) -> Vec<(String, u16)> {
        multi_host(url)
            .unwrap_or_else(|e| panic!("{e}"))
            .unwrap_or_else(|| panic!("{url} names one host"))
            .hosts
            .iter()
            .map(|h| (h.get_host().to_owned(), h.get_port()))
            .collect()
    }

    #[test]
    fn a_connection_that_failed_to_open_is_unreachable_a_broken_answer_is_not() {
        // Seen during a failover: the dead primary's port answered by something else.
        let opening = sqlx::Error::Protocol("unexpected response from SSLRequest: 0x00".into());
        assert!(unavailable(&opening, "lockdb").is_some_and(|w| w.contains("unreachable")));
        // Positive control: a garbled answer to a statement is not "nothing was sent".
        let garbled = sqlx::Error::Protocol("unexpected message: DataRow".into());
        assert_eq!(unavailable(&garbled, "lockdb"), None);
    }

    #[test]
    fn one_host_is_left_to_sqlx() {
        assert!(matches!(multi_host("postgres://u@h:5/db"), Ok(None)));
        assert!(matches!(multi_host("host=h port=5 dbname=db"), Ok(None)));
    }

    #[test]
    fn the_url_form_names_every_host_and_keeps_the_rest() {
        let url = "postgres://us%40r:p%3Aw@10.0.0.1:5433,[::1]:5434,db3/pay?target_session_attrs=read-write&sslmode=disable";
        assert_eq!(
            hosts(url),
            [
                ("10.0.0.1".to_owned(), 5433),
                ("::1".to_owned(), 5434),
                ("db3".to_owned(), 5432)
            ]
        );
        let parsed = multi_host(url).unwrap_or_else(|e| panic!("{e}"));
        let parsed = parsed.unwrap_or_else(|| panic!("several hosts"));
        assert!(parsed.read_write);
        let first = &parsed.hosts[0];
        assert_eq!(first.get_username(), "us@r");
        assert_eq!(first.get_database(), Some("pay"));
    }

    #[test]
    fn the_key_value_form_pairs_hosts_and_ports() {
        assert_eq!(
            hosts("host=a,b port=1,2 dbname=x user=postgres target_session_attrs=primary"),
            [("a".to_owned(), 1), ("b".to_owned(), 2)]
        );
        assert_eq!(
            hosts("host=a,b port=7 dbname='x y'"),
            [("a".to_owned(), 7), ("b".to_owned(), 7)]
        );
        assert!(multi_host("host=a,b port=1,2,3").is_err());
        assert!(multi_host("postgres://a:1,b:x/db").is_err());
        assert!(multi_host("postgres://a:1,b:2/db?target_session_attrs=standby").is_err());
    }
}
