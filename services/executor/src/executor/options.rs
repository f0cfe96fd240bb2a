//! What a run is given: the services' addresses, the run's options, and the owner id and TTLs
//! derived from the process and the rail's read timeout.

use std::sync::Arc;
use std::time::Duration;

use dlock_contract::rail::SUBMIT_READ_MARGIN;

#[derive(Debug, Clone)]
pub struct Endpoints {
    pub lock_server: String,
    pub payment_resource: String,
    pub rail_proxy: String,
}

#[derive(Debug, Clone)]
pub struct RunOptions {
    pub workers: usize,
    pub session_ttl_ms: i64,
    pub lock_ttl_ms: i64,
    pub owner_id: String,
    /// The share of a lock TTL kept as margin (`lock.client.safety-margin`).
    pub safety_margin: f64,
    /// The proxy's read timeout towards the rail; the submit waits this plus 2 s.
    pub rail_read_timeout: Duration,
    /// How long to wait for payouts whose submission is still in flight elsewhere.
    pub settle_timeout: Duration,
    /// Progress on stderr: a bar on a terminal, lines otherwise, nothing when false.
    pub progress: bool,
    /// `payout_execute_total{outcome}` and `payout_backlog_age_seconds`.
    pub metrics: Arc<crate::metrics::Metrics>,
    /// The bearer credential presented to every service (`auth.mode` tokens or tokenreview).
    pub credential: Option<dlock_contract::auth::Credential>,
    /// Who registers the batch's payouts when that is another identity than the executor's
    /// (the registrar role, docs/threat-model.md#roles): its owner id and credential. `None`
    /// registers with `credential`.
    pub registrar: Option<(String, Option<dlock_contract::auth::Credential>)>,
    /// Registers the batch's payouts first (see `register`). Off for callers that register
    /// once and time only the payout cycles (the bench).
    pub register: bool,
    /// Up to this many concurrent calls of one step travel as one batch request
    /// (docs/contract.md#batches); 1 sends each to its single endpoint. Default:
    /// [`dlock_contract::payout_batch::BATCH_MAX_DEFAULT`].
    pub batch_max: usize,
}

impl Default for RunOptions {
    fn default() -> Self {
        Self {
            workers: 4,
            session_ttl_ms: 15_000,
            lock_ttl_ms: 10_000,
            owner_id: default_owner_id(),
            safety_margin: 0.30,
            rail_read_timeout: Duration::from_secs(8),
            settle_timeout: Duration::from_secs(120),
            progress: false,
            metrics: crate::metrics::Metrics::new(),
            credential: None,
            registrar: None,
            register: true,
            batch_max: dlock_contract::payout_batch::BATCH_MAX_DEFAULT as usize,
        }
    }
}

pub fn default_owner_id() -> String {
    owner_id_for(None)
}

/// The worker's X-Owner-Id: `<identity>/<host>-<pid>` when the process has an identity (the
/// servers bind owners to authenticated identities), `dlock-run-<host>-<pid>` otherwise; at
/// most 64 characters, cut on a character boundary.
pub fn owner_id_for(identity: Option<&str>) -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    let host = host.trim();
    let host = if host.is_empty() { "local" } else { host };
    let id = match identity {
        Some(identity) => format!("{identity}/{host}-{}", std::process::id()),
        None => format!("dlock-run-{host}-{}", std::process::id()),
    };
    id.chars().take(64).collect()
}

/// The lock TTL a cycle needs when the rail may take its whole read timeout: the acquire and
/// claim before the submit (a second is plenty), the submit's wait (the read timeout plus
/// [`SUBMIT_READ_MARGIN`]), and the post must still start before the local deadline, which is
/// the TTL less its `safety_margin` share. Shorter, and a slow but successful rail answer finds
/// the deadline passed, so the payout is posted only by a later cycle. At least 10 s.
pub fn lock_ttl_ms_for(rail_read_timeout: Duration, safety_margin: f64) -> i64 {
    const BEFORE_SUBMIT: Duration = Duration::from_secs(1);
    let cycle = rail_read_timeout.saturating_add(SUBMIT_READ_MARGIN + BEFORE_SUBMIT);
    let keep = (1.0 - safety_margin).clamp(0.1, 1.0);
    let ttl = Duration::try_from_secs_f64(cycle.as_secs_f64() / keep).unwrap_or(Duration::MAX);
    i64::try_from(ttl.as_micros().div_ceil(1000))
        .unwrap_or(i64::MAX)
        .max(10_000)
}

/// The session TTL that lets a lock of `lock_ttl_ms` last: a lock's deadline is also capped by
/// the session's expiry as it stood at the acquire, and heartbeats every third of the TTL leave
/// at least two thirds of it then. At least 15 s.
pub fn session_ttl_ms_for(lock_ttl_ms: i64) -> i64 {
    (lock_ttl_ms / 2)
        .saturating_add(lock_ttl_ms)
        .saturating_add(1)
        .max(15_000)
}
