//! Scenario A: lockdb and paydb on a primary with a synchronous standby; a batch runs; the primary
//! is SIGKILLed at a random point and the standby promoted; the services follow on their own and
//! the batch finishes. Nobody is paid twice, no token is issued twice, no fence goes back, the
//! ledger balances.
//!
//! Knobs: `DLOCK_FAILOVER_PAYOUTS` (default 2000), `DLOCK_FAILOVER_ACCOUNTS` (40),
//! `DLOCK_FAILOVER_WORKERS` (workers per executor, two executors; 8).

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use dlock_contract::client::LockClient;
use dlock_contract::payment_client::PaymentClient;
use dlock_devstack::pg_standby::{PgPair, Replication};
use dlock_devstack::{ManagedChild, PgServer, free_port, spawn_logged};
use rand::Rng;
use tokio::sync::Mutex;

use super::{knob, refusal_code as code, session_gone, sweeping_proxy};
use crate::chaos::{CheckedStack, check_invariants, fenced_out_in};
use crate::harness::{serve_process, session_kept};
use crate::shared::accounts::open_account;
use crate::shared::payouts::{batch_manifest, spread};

pub(crate) const EXE: &str = env!("CARGO_BIN_EXE_dlock");
pub(crate) const OPERATOR_TOKEN: &str = "failover-operator-token";
const READ_TIMEOUT_MS: u64 = 1_000;

/// The four services as processes.
pub(crate) struct Services {
    pub(crate) lock: (ManagedChild, SocketAddr),
    pub(crate) payment: (ManagedChild, SocketAddr),
    pub(crate) stub: (ManagedChild, SocketAddr),
    pub(crate) proxy: (ManagedChild, SocketAddr),
    pub(crate) dir: tempfile::TempDir,
}

pub(crate) fn url(addr: &SocketAddr) -> String {
    format!("http://{addr}")
}

impl Services {
    /// Starts them on `lockdb` and `paydb` (URLs); `extra` are more keys for one service (by its
    /// `dlock serve` name).
    pub(crate) fn start(lockdb: &str, paydb: &str, extra: &[(&str, &str, &str)]) -> Self {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let start = |name: &str, pairs: Vec<(&str, String)>| {
            let addr: SocketAddr = (
                [127, 0, 0, 1],
                free_port().unwrap_or_else(|e| panic!("{e}")),
            )
                .into();
            let mut all: Vec<(String, String)> = vec![("server.listen".into(), addr.to_string())];
            all.extend(pairs.into_iter().map(|(k, v)| (k.to_owned(), v)));
            all.extend(
                extra
                    .iter()
                    .filter(|(s, _, _)| *s == name)
                    .map(|(_, k, v)| ((*k).to_owned(), (*v).to_owned())),
            );
            let child = serve_process(name, addr, &all, &dir.path().join(format!("{name}.log")));
            (child, addr)
        };
        let no_proofs = || ("fencing.insecure-no-proofs", "true".to_owned());
        let lock = start(
            "lock-server",
            vec![
                ("lock.backend", "pg".into()),
                ("lock.pg.url", lockdb.to_owned()),
                no_proofs(),
            ],
        );
        let payment = start(
            "payment-resource",
            vec![
                ("payment.pg.url", paydb.to_owned()),
                ("payment.operator.token", OPERATOR_TOKEN.into()),
                no_proofs(),
            ],
        );
        let statement = dir.path().join("statement.jsonl").display().to_string();
        let stub = start(
            "rail-stub",
            vec![
                ("rail.stub.statement-path", statement),
                ("rail.stub.latency-ms", "5".into()),
                ("auth.mode", "none".into()),
            ],
        );
        let proxy = start(
            "rail-proxy",
            [
                sweeping_proxy(
                    paydb.to_owned(),
                    url(&stub.1),
                    OPERATOR_TOKEN,
                    READ_TIMEOUT_MS,
                ),
                vec![no_proofs()],
            ]
            .concat(),
        );
        Self {
            lock,
            payment,
            stub,
            proxy,
            dir,
        }
    }

    pub(crate) fn payment_client(&self) -> PaymentClient {
        PaymentClient::new(&url(&self.payment.1), "failover").unwrap_or_else(|e| panic!("{e}"))
    }

    /// Writes the batch `name` of `n` payouts over `accounts` accounts `{prefix}-00`….
    pub(crate) fn batch(
        &self,
        name: &str,
        prefix: &str,
        accounts: usize,
        n: usize,
        workers: usize,
    ) -> PathBuf {
        let text = batch_manifest(name, workers, spread(n, 4, prefix, accounts));
        let path = self.dir.path().join(format!("{name}.yaml"));
        std::fs::write(&path, text).unwrap_or_else(|e| panic!("{e}"));
        path
    }

    /// `dlock run -f batch` against these services, logging to `{owner}.log`.
    pub(crate) fn executor(
        &self,
        batch: &Path,
        owner: &str,
        workers: usize,
    ) -> (ManagedChild, PathBuf) {
        let log = self.dir.path().join(format!("{owner}.log"));
        let args: Vec<String> = [
            "run",
            "-f",
            &batch.display().to_string(),
            "--lock-server",
            &url(&self.lock.1),
            "--payment-resource",
            &url(&self.payment.1),
            "--rail-proxy",
            &url(&self.proxy.1),
            "--workers",
            &workers.to_string(),
            "--owner-id",
            owner,
            "--rail-read-timeout-ms",
            &READ_TIMEOUT_MS.to_string(),
            "--settle-timeout-s",
            "120",
        ]
        .iter()
        .map(|s| (*s).to_owned())
        .collect();
        let child = spawn_logged(owner, Path::new(EXE), &args, &[], Some(&log))
            .unwrap_or_else(|e| panic!("{e:#}"));
        (child, log)
    }

    pub(crate) fn checked(&self, paydb: &PgServer) -> CheckedStack {
        CheckedStack {
            payment_url: url(&self.payment.1),
            stub_url: url(&self.stub.1),
            paydb_url: paydb.url("paydb"),
            read_timeout_ms: READ_TIMEOUT_MS,
        }
    }
}

/// What a probe saw: each call's start, and its error code when it failed.
#[derive(Default)]
pub(crate) struct Probe {
    calls: Vec<(Instant, Result<i64, String>)>,
}

impl Probe {
    /// The refused calls by code.
    pub(crate) fn refusals(&self) -> BTreeMap<String, usize> {
        let mut by_code = BTreeMap::new();
        for (_, r) in &self.calls {
            if let Err(code) = r {
                *by_code.entry(code.clone()).or_default() += 1;
            }
        }
        by_code
    }

    /// From `at` to the start of the first call after it that succeeded.
    pub(crate) fn outage(&self, at: Instant) -> Option<Duration> {
        let after = self
            .calls
            .iter()
            .filter(|(t, r)| *t > at && r.is_ok())
            .map(|(t, _)| *t)
            .min()?;
        Some(after - at)
    }

    pub(crate) fn tokens(&self) -> Vec<i64> {
        self.calls
            .iter()
            .filter_map(|(_, r)| r.as_ref().ok().copied())
            .filter(|t| *t > 0)
            .collect()
    }
}

/// A lock client acquiring and releasing `{key}-{n}` (a new key each call) in a loop until `stop`:
/// each acquire's token.
pub(crate) fn lock_probe(
    lock_url: String,
    key: &'static str,
    stop: Arc<AtomicBool>,
    probe: Arc<Mutex<Probe>>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let lock = LockClient::new(&lock_url, "failover-probe").unwrap_or_else(|e| panic!("{e}"));
        let mut session = None;
        let mut calls = 0u64;
        while !stop.load(Ordering::SeqCst) {
            let started = Instant::now();
            let sid = match session_kept(&lock, &mut session, 60_000).await {
                Ok(sid) => sid,
                Err(e) => {
                    probe.lock().await.calls.push((started, Err(code(&e))));
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    continue;
                }
            };
            // A key per call: a release lost in the failover leaves a grant that would hold the
            // next acquire until its TTL, which is not what the probe measures.
            calls += 1;
            let key = format!("{key}-{calls}");
            let result = match lock.acquire(&key, sid, Some(10_000), Some(1_000)).await {
                Ok(grant) => {
                    let _ = lock.release(&key, sid, grant.fencing_token).await;
                    Ok(grant.fencing_token)
                }
                Err(e) => {
                    if session_gone(&e) {
                        session = None;
                    }
                    Err(code(&e))
                }
            };
            let failed = result.is_err();
            probe.lock().await.calls.push((started, result));
            tokio::time::sleep(Duration::from_millis(if failed { 20 } else { 10 })).await;
        }
    })
}

/// A payment client reading `account` in a loop until `stop`.
pub(crate) fn payment_probe(
    payment: PaymentClient,
    account: String,
    stop: Arc<AtomicBool>,
    probe: Arc<Mutex<Probe>>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        while !stop.load(Ordering::SeqCst) {
            let started = Instant::now();
            let result = payment
                .get_account(&account)
                .await
                .map(|_| 0)
                .map_err(|e| code(&e));
            probe.lock().await.calls.push((started, result));
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
}

/// `account → value` from a two-column query on paydb.
pub(crate) fn marks(pg: &PgServer, sql: &str) -> HashMap<String, i64> {
    pg.psql("paydb", sql)
        .unwrap_or_else(|e| panic!("{e:#}"))
        .lines()
        .filter_map(|l| {
            let (k, v) = l.split_once('|')?;
            Some((k.to_owned(), v.parse().ok()?))
        })
        .collect()
}

pub(crate) const FENCES: &str = "SELECT account_id, fence FROM accounts WHERE kind = 'customer'";
pub(crate) const HIGH_WATER: &str = "SELECT account_id, highest_token FROM rail_high_water";

/// Every mark in `before` is at most its value in `after`.
pub(crate) fn none_went_back(
    what: &str,
    before: &HashMap<String, i64>,
    after: &HashMap<String, i64>,
) -> usize {
    let mut back = 0;
    for (k, v) in before {
        let now = after.get(k).copied().unwrap_or(0);
        if now < *v {
            eprintln!("{what} of {k} went back: {v} before the failover, {now} after");
            back += 1;
        }
    }
    back
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_synchronous_standby_promoted_mid_batch_pays_nobody_twice_and_no_fence_goes_back() {
    let payouts = knob("DLOCK_FAILOVER_PAYOUTS", 2_000);
    let accounts = knob("DLOCK_FAILOVER_ACCOUNTS", 40);
    let workers = knob("DLOCK_FAILOVER_WORKERS", 8);
    let began = Instant::now();
    let mut pair = PgPair::start(Replication::Synchronous).unwrap_or_else(|e| panic!("{e:#}"));
    for db in ["lockdb", "paydb"] {
        pair.create_database(db).unwrap_or_else(|e| panic!("{e:#}"));
    }
    let services = Services::start(&pair.url("lockdb"), &pair.url("paydb"), &[]);
    let payment = services.payment_client();
    for i in 0..accounts {
        open_account(&payment, &format!("fo-{i:02}"), Some(10_000_000)).await;
    }
    let batch = services.batch("fo-batch", "fo", accounts, payouts, workers);
    let executors = [
        services.executor(&batch, "executor-fo-a", workers),
        services.executor(&batch, "executor-fo-b", workers),
    ];

    let stop = Arc::new(AtomicBool::new(false));
    let lock_seen = Arc::new(Mutex::new(Probe::default()));
    let pay_seen = Arc::new(Mutex::new(Probe::default()));
    let probes = [
        lock_probe(
            url(&services.lock.1),
            "failover:probe",
            stop.clone(),
            lock_seen.clone(),
        ),
        payment_probe(
            services.payment_client(),
            "fo-00".into(),
            stop.clone(),
            pay_seen.clone(),
        ),
    ];

    // The kill comes once a random share (20 to 60 %) of the batch is posted.
    let at = payouts * rand::rng().random_range(20..=60) / 100;
    let posted = |pg: &PgServer| {
        pg.psql(
            "paydb",
            "SELECT count(*) FROM payouts WHERE state = 'POSTED'",
        )
        .ok()
        .and_then(|s| s.parse::<usize>().ok())
        .unwrap_or(0)
    };
    let waited = Instant::now();
    while posted(&pair.primary) < at {
        assert!(
            waited.elapsed() < Duration::from_secs(120),
            "the batch did not reach {at} posted payouts: {}",
            posted(&pair.primary)
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let fences_before = marks(&pair.primary, FENCES);
    let high_water_before = marks(&pair.primary, HIGH_WATER);
    let posted_at_kill = posted(&pair.primary);
    pair.kill_primary().unwrap_or_else(|e| panic!("{e:#}"));
    let killed = Instant::now();
    let promotion = pair.promote().unwrap_or_else(|e| panic!("{e:#}"));
    let promoted = Instant::now();

    let mut fenced = 0;
    for (mut executor, log) in executors {
        let status = executor.wait_exit(Duration::from_secs(240));
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        assert!(
            status.is_some_and(|s| s.success()),
            "executor failed after the failover:\n{text}"
        );
        fenced += fenced_out_in(&text);
    }
    stop.store(true, Ordering::SeqCst);
    for probe in probes {
        probe.await.unwrap_or_else(|e| panic!("{e}"));
    }

    let new_primary = &pair.standby;
    let back = none_went_back(
        "accounts.fence",
        &fences_before,
        &marks(new_primary, FENCES),
    ) + none_went_back(
        "rail_high_water",
        &high_water_before,
        &marks(new_primary, HIGH_WATER),
    );
    assert_eq!(back, 0, "a fence went back over the failover");

    // No token issued twice: the rail admits a token once per account, so a token given to two
    // keys shows as one token presented for two accounts; the probe's own tokens only grow and
    // none of them was presented for a payout.
    let twice = new_primary
        .psql(
            "paydb",
            "SELECT count(*) FROM (SELECT presented_token FROM rail_submission \
             GROUP BY presented_token HAVING count(DISTINCT account_id) > 1) t",
        )
        .unwrap_or_else(|e| panic!("{e:#}"));
    assert_eq!(twice, "0", "a token was presented for two accounts");
    let probe_tokens = lock_seen.lock().await.tokens();
    assert!(
        probe_tokens.windows(2).all(|w| w[0] < w[1]),
        "the probe's tokens went back or repeated: {probe_tokens:?}"
    );
    let list = probe_tokens
        .iter()
        .map(i64::to_string)
        .collect::<Vec<_>>()
        .join(",");
    let shared = new_primary
        .psql(
            "paydb",
            &format!(
                "SELECT count(*) FROM rail_submission WHERE presented_token = ANY('{{{list}}}'::bigint[])"
            ),
        )
        .unwrap_or_else(|e| panic!("{e:#}"));
    assert_eq!(
        shared, "0",
        "a probe's token was also presented for a payout"
    );

    let figures = check_invariants(
        &services.checked(new_primary),
        "sync standby promoted mid-batch",
        "fo-batch",
        payouts,
        1,
        fenced,
    )
    .await;
    let lock_seen = lock_seen.lock().await;
    let pay_seen = pay_seen.lock().await;
    let ms = |d: Option<Duration>| d.map_or("-".to_owned(), |d| d.as_millis().to_string());
    println!(
        "failover: {payouts} payouts, kill at {posted_at_kill} posted; promotion took {} ms; \
         lock server writes back {} ms after the kill ({} ms after the promotion), refused {:?} \
         of {} probes; payment reads back {} ms after the kill, refused {:?} of {}; \
         {} RAIL_AMBIGUOUS, {fenced} fenced out; whole test {} s",
        promotion.as_millis(),
        ms(lock_seen.outage(killed)),
        ms(lock_seen.outage(promoted)),
        lock_seen.refusals(),
        lock_seen.calls.len(),
        ms(pay_seen.outage(killed)),
        pay_seen.refusals(),
        pay_seen.calls.len(),
        figures.ambiguous,
        began.elapsed().as_secs()
    );
}
