//! The long run's stack: PostgreSQL pair, the four services as `dlock serve` processes that can
//! be killed and started again, the fault proxies in front of them, and its executors.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use dlock_devstack::faultproxy::FaultProxy;
use dlock_devstack::pg_standby::{PgPair, Replication};
use dlock_devstack::{ManagedChild, PgServer, free_port, spawn_logged};

use super::super::{EXE, OPERATOR_TOKEN};
use super::faults::Fault;
use crate::failover::sweeping_proxy;
use crate::harness::serve_process_of;

pub(super) const READ_TIMEOUT_MS: u64 = 1_000;
/// The executors' lock and session TTL: a paused executor is stopped for longer than this.
pub(super) const LEASE_MS: u64 = 3_000;
pub(super) const EXECUTORS: [&str; 3] = ["a", "b", "c"];
pub(super) const WORKERS: usize = 4;

/// The `dlock` binary this run starts: `DLOCK_BIN`, or the one built with the test.
pub(super) fn exe() -> PathBuf {
    std::env::var_os("DLOCK_BIN").map_or_else(|| PathBuf::from(EXE), PathBuf::from)
}

/// `dlock serve {service}` with `pairs`, its output in `log`; waits until it answers `/readyz`.
fn serve(
    service: &str,
    listen: SocketAddr,
    pairs: &[(String, String)],
    log: &Path,
) -> ManagedChild {
    serve_process_of(&exe(), service, listen, pairs, log, Duration::from_secs(60))
}

/// One `dlock serve` process that can be killed and started again on the same address.
pub(super) struct Svc {
    name: &'static str,
    pub(super) addr: SocketAddr,
    pairs: Vec<(String, String)>,
    log: PathBuf,
    child: Option<ManagedChild>,
}

impl Svc {
    fn start(name: &'static str, dir: &Path, pairs: Vec<(&str, String)>) -> Self {
        let addr: SocketAddr = (
            [127, 0, 0, 1],
            free_port().unwrap_or_else(|e| panic!("{e}")),
        )
            .into();
        let mut all = vec![("server.listen".to_owned(), addr.to_string())];
        all.extend(pairs.into_iter().map(|(k, v)| (k.to_owned(), v)));
        let log = dir.join(format!("{name}.log"));
        let child = serve(name, addr, &all, &log);
        Self {
            name,
            addr,
            pairs: all,
            log,
            child: Some(child),
        }
    }

    pub(super) fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// SIGKILL (no shutdown path runs), then the same process again; waits until it is ready.
    pub(super) fn kill_and_restart(&mut self) {
        if let Some(mut child) = self.child.take() {
            child.kill();
        }
        self.child = Some(serve(self.name, self.addr, &self.pairs, &self.log));
    }
}

/// Payouts of the run that left PENDING/CLAIMED/SUBMITTING (what the faults wait for).
const SETTLED: &str = "SELECT count(*) FROM payouts \
     WHERE state IN ('POSTED', 'FAILED', 'ABANDONED', 'RAIL_AMBIGUOUS')";

pub(super) fn count(pg: &PgServer, sql: &str) -> usize {
    pg.psql("paydb", sql)
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(0)
}

/// The stack of the run, and what struck it.
pub(super) struct Run {
    pub(super) pair: PgPair,
    pub(super) failed_over: bool,
    pub(super) lock: Svc,
    pub(super) payment: Svc,
    pub(super) proxy: Svc,
    pub(super) stub: Svc,
    pub(super) lock_link: FaultProxy,
    pub(super) payment_link: FaultProxy,
    pub(super) rail_link: FaultProxy,
    pub(super) dir: PathBuf,
    pub(super) struck: BTreeMap<Fault, usize>,
    pub(super) failover_ms: Option<u128>,
}

impl Run {
    /// lockdb and paydb on a synchronous PostgreSQL pair, the four services as processes in
    /// `dir` (their logs there too), and fault proxies in front of the lock server, the payment
    /// resource and the rail stub.
    pub(super) fn start(dir: &Path) -> Self {
        let pair = PgPair::start(Replication::Synchronous).unwrap_or_else(|e| panic!("{e:#}"));
        for db in ["lockdb", "paydb"] {
            pair.create_database(db).unwrap_or_else(|e| panic!("{e:#}"));
        }
        let no_proofs = || ("fencing.insecure-no-proofs", "true".to_owned());
        let lock = Svc::start(
            "lock-server",
            dir,
            vec![
                ("lock.backend", "pg".into()),
                ("lock.pg.url", pair.url("lockdb")),
                no_proofs(),
            ],
        );
        let payment = Svc::start(
            "payment-resource",
            dir,
            vec![
                ("payment.pg.url", pair.url("paydb")),
                ("payment.operator.token", OPERATOR_TOKEN.into()),
                no_proofs(),
            ],
        );
        // Hostile: late (jitter), duplicate acknowledgements, answers lost after the transfer was
        // taken (a failure hangs past the read timeout), declines, redirects.
        let stub = Svc::start(
            "rail-stub",
            dir,
            vec![
                (
                    "rail.stub.statement-path",
                    dir.join("statement.jsonl").display().to_string(),
                ),
                ("rail.stub.latency-ms", "5".into()),
                ("rail.stub.latency-jitter-ms", "40".into()),
                ("rail.stub.failure-rate", "0.02".into()),
                ("rail.stub.hang-ms", "1500".into()),
                ("rail.stub.duplicate-ack-rate", "0.2".into()),
                ("rail.stub.decline-rate", "0.01".into()),
                ("rail.stub.redirect-rate", "0.005".into()),
                ("auth.mode", "none".into()),
            ],
        );
        let link = |to: SocketAddr| {
            FaultProxy::start("127.0.0.1:0".parse().unwrap_or_else(|e| panic!("{e}")), to)
                .unwrap_or_else(|e| panic!("{e:#}"))
        };
        let rail_link = link(stub.addr);
        let proxy = Svc::start(
            "rail-proxy",
            dir,
            [
                sweeping_proxy(
                    pair.url("paydb"),
                    rail_link.url(),
                    OPERATOR_TOKEN,
                    READ_TIMEOUT_MS,
                ),
                vec![no_proofs()],
            ]
            .concat(),
        );
        Self {
            lock_link: link(lock.addr),
            payment_link: link(payment.addr),
            rail_link,
            pair,
            failed_over: false,
            lock,
            payment,
            proxy,
            stub,
            dir: dir.to_path_buf(),
            struck: BTreeMap::new(),
            failover_ms: None,
        }
    }

    /// The PostgreSQL that is the primary now.
    pub(super) fn pg(&self) -> &PgServer {
        if self.failed_over {
            &self.pair.standby
        } else {
            &self.pair.primary
        }
    }

    pub(super) fn settled(&self) -> usize {
        count(self.pg(), SETTLED)
    }

    /// Waits until `n` payouts of the run are settled, up to 5 minutes; `executors` are checked
    /// for having all exited (then the wait is over: nothing more will settle).
    pub(super) async fn settled_at_least(
        &self,
        n: usize,
        executors: &mut [(ManagedChild, PathBuf)],
    ) {
        let began = Instant::now();
        loop {
            if tokio::task::block_in_place(|| self.settled()) >= n {
                return;
            }
            if executors.iter_mut().all(|(e, _)| e.exited()) {
                return;
            }
            assert!(
                began.elapsed() < Duration::from_secs(300),
                "the stream did not reach {n} settled payouts in 5 minutes: {}",
                self.settled()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    pub(super) fn executor(&self, batch: &Path, owner: &str) -> (ManagedChild, PathBuf) {
        let log = self.dir.join(format!("{owner}.log"));
        let lease = LEASE_MS.to_string();
        let args: Vec<String> = [
            "run",
            "-f",
            &batch.display().to_string(),
            "--lock-server",
            &self.lock_link.url(),
            "--payment-resource",
            &self.payment_link.url(),
            "--rail-proxy",
            &self.proxy.url(),
            "--workers",
            &WORKERS.to_string(),
            "--owner-id",
            owner,
            "--rail-read-timeout-ms",
            &READ_TIMEOUT_MS.to_string(),
            "--lock-ttl-ms",
            &lease,
            "--session-ttl-ms",
            &lease,
            "--settle-timeout-s",
            "300",
        ]
        .iter()
        .map(|s| (*s).to_owned())
        .collect();
        let child =
            spawn_logged(owner, &exe(), &args, &[], Some(&log)).unwrap_or_else(|e| panic!("{e:#}"));
        (child, log)
    }
}
