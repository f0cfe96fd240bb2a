//! Network faults mid-batch: real partitions (a network namespace, a veth pair, nftables drop
//! rules: the service sees silence, not a refusal) and a userspace proxy that makes the rail
//! slow, silent or rude. Each scenario runs a real batch with `dlock run` executors, applies the
//! fault while it runs, heals it, and ends with the chaos suite's invariant checker plus one more
//! check of the rail proxy's records against the rail's statement.
//!
//! Needs root, `ip` (iproute2) and `nft` (nftables); without them these tests fail and say what
//! to install — they never skip. Alone: `cargo nextest run -p dlock --test it netfault
//! --no-capture`.

use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use dlock_contract::ErrorCode;
use dlock_contract::client::LockClient;
use dlock_contract::payment::{CreateAccountRequest, FundRequest};
use dlock_contract::payment_client::PaymentClient;
use dlock_contract::rail::{RailClient, SubmissionRequest, read_statement};
use dlock_devstack::faultproxy::{Direction, FaultProxy, Mode};
use dlock_devstack::netfault::NetNs;
use dlock_devstack::{
    EtcdServer, ManagedChild, PgServer, free_port, http_status, spawn_logged, wait_until,
};
use dlock_server::config::env_name;
use uuid::Uuid;

use crate::chaos::{CheckedStack, Figures, check_invariants, fenced_out_in, header};
use crate::harness::{Backend, eventually};

const EXE: &str = env!("CARGO_BIN_EXE_dlock");
const OPERATOR_TOKEN: &str = "netfault-operator-token";
const LOOPBACK: IpAddr = IpAddr::V4(Ipv4Addr::LOCALHOST);

/// Which services run inside the namespace (the rest run on the host).
#[derive(Clone, Copy, Default)]
struct Placement {
    lock: bool,
    payment: bool,
    proxy: bool,
}

/// One `dlock serve` process, on the host or inside the namespace.
struct Svc {
    name: &'static str,
    addr: SocketAddr,
    in_ns: bool,
    env: Vec<(String, String)>,
    log: PathBuf,
    child: Option<ManagedChild>,
}

impl Svc {
    fn new(
        name: &'static str,
        ip: IpAddr,
        in_ns: bool,
        dir: &Path,
        pairs: Vec<(&str, String)>,
    ) -> Self {
        let port = free_port().unwrap_or_else(|e| panic!("{e}"));
        let addr = SocketAddr::new(ip, port);
        let mut env: Vec<(String, String)> = vec![(env_name("server.listen"), addr.to_string())];
        env.extend(pairs.into_iter().map(|(k, v)| (env_name(k), v)));
        Self {
            name,
            addr,
            in_ns,
            env,
            log: dir.join(format!("{name}.log")),
            child: None,
        }
    }

    fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    fn start(&mut self, ns: Option<&NetNs>) {
        let args = vec!["serve".to_owned(), self.name.to_owned()];
        let spawned = match ns {
            Some(ns) if self.in_ns => {
                ns.spawn_logged(self.name, Path::new(EXE), &args, &self.env, Some(&self.log))
            }
            _ => spawn_logged(self.name, Path::new(EXE), &args, &self.env, Some(&self.log)),
        };
        let mut child = spawned.unwrap_or_else(|e| panic!("{e:#}"));
        let addr = self.addr;
        wait_until(self.name, Duration::from_secs(60), || {
            !child.exited() && http_status(addr, "/readyz") == Some(200)
        })
        .unwrap_or_else(|e| {
            panic!(
                "{e:#}: {}",
                std::fs::read_to_string(&self.log).unwrap_or_default()
            )
        });
        self.child = Some(child);
    }
}

struct Options<'a> {
    backend: Backend,
    placement: Placement,
    rail: &'a [(&'a str, &'a str)],
    read_timeout_ms: u64,
    /// Put a fault proxy between the rail proxy and the rail stub.
    rail_fault_proxy: bool,
    /// Whether a network namespace is needed at all.
    netns: bool,
}

/// The stack of one scenario. Field order is drop order: processes first, then the stores, the
/// namespace and the directory with the logs.
struct NetStack {
    lock: Svc,
    payment: Svc,
    stub: Svc,
    proxy: Svc,
    rail_fault: Option<FaultProxy>,
    etcd: Option<EtcdServer>,
    pg: PgServer,
    ns: Option<NetNs>,
    dir: tempfile::TempDir,
    read_timeout_ms: u64,
}

impl NetStack {
    fn start(o: Options<'_>) -> Self {
        let ns = o.netns.then(|| {
            NetNs::create().unwrap_or_else(|e| panic!("cannot build a network partition: {e:#}"))
        });
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        // Services on the host listen on the host end of the veth pair, so that services inside
        // the namespace reach them too; so do PostgreSQL and etcd.
        let host_ip = ns.as_ref().map_or(LOOPBACK, NetNs::host_addr);
        let ns_ip = ns.as_ref().map_or(LOOPBACK, NetNs::ns_addr);
        let extra: Vec<IpAddr> = ns.iter().map(NetNs::host_addr).collect();
        let pg = PgServer::start_listening(None, &extra).unwrap_or_else(|e| panic!("{e:#}"));
        pg.create_database("lockdb")
            .unwrap_or_else(|e| panic!("{e:#}"));
        pg.create_database("paydb")
            .unwrap_or_else(|e| panic!("{e:#}"));
        let pg_url = |db: &str, inside: bool| {
            let ip = if inside { host_ip } else { LOOPBACK };
            format!("postgres://postgres@{}/{db}", SocketAddr::new(ip, pg.port))
        };
        let etcd = (o.backend == Backend::Etcd)
            .then(|| EtcdServer::start_listening(None, &extra).unwrap_or_else(|e| panic!("{e:#}")));
        let p = o.placement;
        let at = |inside: bool| if inside { ns_ip } else { host_ip };
        let lock_pairs = match &etcd {
            Some(etcd) => vec![
                ("lock.backend", "etcd".to_owned()),
                (
                    "lock.etcd.endpoints",
                    format!("http://{}", SocketAddr::new(host_ip, etcd.client_port)),
                ),
                ("lock.etcd.connect-timeout-ms", "1000".to_owned()),
                ("lock.etcd.request-timeout-ms", "2000".to_owned()),
            ],
            None => vec![
                ("lock.backend", "pg".to_owned()),
                ("lock.pg.url", pg_url("lockdb", p.lock)),
                ("lock.pg.acquire-timeout-ms", "1000".to_owned()),
            ],
        };
        let mut lock = Svc::new("lock-server", at(p.lock), p.lock, dir.path(), lock_pairs);
        let mut payment = Svc::new(
            "payment-resource",
            at(p.payment),
            p.payment,
            dir.path(),
            vec![
                ("payment.pg.url", pg_url("paydb", p.payment)),
                ("payment.pg.acquire-timeout-ms", "1000".to_owned()),
                ("payment.operator.token", OPERATOR_TOKEN.to_owned()),
            ],
        );
        let mut stub_pairs = vec![(
            "rail.stub.statement-path",
            dir.path().join("statement.jsonl").display().to_string(),
        )];
        stub_pairs.extend(o.rail.iter().map(|(k, v)| (*k, (*v).to_owned())));
        let mut stub = Svc::new("rail-stub", host_ip, false, dir.path(), stub_pairs);
        lock.start(ns.as_ref());
        payment.start(ns.as_ref());
        stub.start(ns.as_ref());
        let rail_fault = o.rail_fault_proxy.then(|| {
            FaultProxy::start(SocketAddr::new(host_ip, 0), stub.addr)
                .unwrap_or_else(|e| panic!("{e:#}"))
        });
        let rail_url = rail_fault
            .as_ref()
            .map_or_else(|| stub.url(), FaultProxy::url);
        let mut proxy = Svc::new(
            "rail-proxy",
            at(p.proxy),
            p.proxy,
            dir.path(),
            vec![
                ("rail.proxy.pg.url", pg_url("paydb", p.proxy)),
                ("rail.proxy.pg.acquire-timeout-ms", "1000".to_owned()),
                ("rail.proxy.rail-url", rail_url),
                ("rail.proxy.read-timeout-ms", o.read_timeout_ms.to_string()),
                ("rail.proxy.unresolved-margin-ms", "500".to_owned()),
                ("rail.proxy.sweep-interval-ms", "200".to_owned()),
                ("rail.proxy.operator-token", OPERATOR_TOKEN.to_owned()),
            ],
        );
        proxy.start(ns.as_ref());
        Self {
            lock,
            payment,
            stub,
            proxy,
            rail_fault,
            etcd,
            pg,
            ns,
            dir,
            read_timeout_ms: o.read_timeout_ms,
        }
    }

    fn ns(&self) -> &NetNs {
        self.ns
            .as_ref()
            .unwrap_or_else(|| panic!("this scenario has no network namespace"))
    }

    /// PostgreSQL as the namespace reaches it (the address its partition rules name).
    fn pg_peer(&self) -> SocketAddr {
        SocketAddr::new(self.ns().host_addr(), self.pg.port)
    }

    fn payment_client(&self) -> PaymentClient {
        PaymentClient::new(&self.payment.url(), "netfault").unwrap_or_else(|e| panic!("{e}"))
    }

    async fn accounts(&self, prefix: &str, n: usize, funds: i64) {
        let payment = self.payment_client();
        for i in 0..n {
            let account = format!("{prefix}-{i:02}");
            let body = CreateAccountRequest {
                account_id: account.clone(),
                currency: "EUR".into(),
            };
            payment
                .create_account(&format!("open-{account}"), &body)
                .await
                .unwrap_or_else(|e| panic!("{e}"));
            let fund = FundRequest {
                amount_minor: funds,
                reference: format!("seed-{account}"),
            };
            payment
                .fund(&account, &format!("fund-{account}"), &fund)
                .await
                .unwrap_or_else(|e| panic!("{e}"));
        }
    }

    /// Writes a batch of `n` payouts spread over `accounts` accounts.
    fn batch(&self, name: &str, prefix: &str, accounts: usize, n: usize) -> PathBuf {
        let mut text = format!(
            "apiVersion: dlock.io/v1alpha1\nkind: PayoutBatch\nmetadata:\n  name: {name}\nspec:\n  workers: 4\n  payouts:\n"
        );
        for i in 0..n {
            text.push_str(&format!(
                "    - key: item-{i:04}\n      accountId: {prefix}-{:02}\n      amountMinor: {}\n      currency: EUR\n      beneficiaryRef: ben-{i}\n",
                i % accounts,
                1_000 + i
            ));
        }
        let path = self.dir.path().join(format!("{name}.yaml"));
        std::fs::write(&path, text).unwrap_or_else(|e| panic!("{e}"));
        path
    }

    fn executor(&self, batch: &Path, owner: &str, extra: &[&str]) -> (ManagedChild, PathBuf) {
        let log = self.dir.path().join(format!("{owner}.log"));
        let mut args: Vec<String> = vec![
            "run".into(),
            "-f".into(),
            batch.display().to_string(),
            "--lock-server".into(),
            self.lock.url(),
            "--payment-resource".into(),
            self.payment.url(),
            "--rail-proxy".into(),
            self.proxy.url(),
            "--workers".into(),
            "4".into(),
            "--owner-id".into(),
            owner.into(),
            "--rail-read-timeout-ms".into(),
            self.read_timeout_ms.to_string(),
        ];
        args.extend(extra.iter().map(|s| (*s).to_owned()));
        let child = spawn_logged(owner, Path::new(EXE), &args, &[], Some(&log))
            .unwrap_or_else(|e| panic!("{e:#}"));
        (child, log)
    }

    /// Waits for an executor; its success and the fenced-out events it reported.
    fn wait(&self, mut executor: ManagedChild, log: &Path, within: Duration) -> (bool, usize) {
        let status = executor.wait_exit(within);
        if status.is_none() {
            executor.stop();
        }
        let text = std::fs::read_to_string(log).unwrap_or_default();
        (status.is_some_and(|s| s.success()), fenced_out_in(&text))
    }

    /// Waits for an executor that must succeed.
    fn finish(&self, executor: ManagedChild, log: &Path) -> usize {
        let (ok, fenced) = self.wait(executor, log, Duration::from_secs(90));
        assert!(
            ok,
            "executor failed:\n{}",
            std::fs::read_to_string(log).unwrap_or_default()
        );
        fenced
    }

    fn count(&self, sql: &str) -> usize {
        self.pg
            .psql("paydb", sql)
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(0)
    }

    fn posted(&self) -> usize {
        self.count("SELECT count(*) FROM payouts WHERE state = 'POSTED'")
    }

    async fn transfers(&self) -> usize {
        read_statement(&self.stub.url(), None)
            .await
            .map(|s| s.transfers.len())
            .unwrap_or_else(|e| panic!("reading the rail statement: {e}"))
    }

    async fn progress(&self, at_least: usize) {
        eventually(
            "the batch makes progress",
            Duration::from_secs(40),
            || async { (self.posted() >= at_least).then_some(()) },
        )
        .await;
    }

    /// The chaos suite's checker, then the proxy's records against the rail's statement.
    async fn check(
        &self,
        scenario: &'static str,
        batches: &[(&str, &str, usize)],
        faults: usize,
        fenced_out: usize,
    ) -> Figures {
        let stack = CheckedStack {
            payment_url: self.payment.url(),
            stub_url: self.stub.url(),
            paydb_url: self.pg.url("paydb"),
            read_timeout_ms: self.read_timeout_ms,
        };
        let figures = check_invariants(&stack, scenario, batches, faults, fenced_out).await;
        let violations = self.proxy_records_match().await;
        assert!(
            violations.is_empty(),
            "{scenario}: the proxy's records and the rail disagree:\n{}",
            violations.join("\n")
        );
        figures
    }

    /// Every transfer on the statement has a durable intent at the proxy (ACKED or TIMEOUT, never
    /// FENCED, REJECTED or none: no forwarding without an intent), every ACKED submission is on
    /// the statement, and every POSTED payout is on it exactly once.
    async fn proxy_records_match(&self) -> Vec<String> {
        let statement = read_statement(&self.stub.url(), None)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        let mut on_rail: HashMap<String, usize> = HashMap::new();
        for t in &statement.transfers {
            *on_rail.entry(t.client_ref.clone()).or_default() += 1;
        }
        let pool = dlock_executor::reconcile::connect(&self.pg.url("paydb"))
            .await
            .unwrap_or_else(|e| panic!("{e:#}"));
        let rows: Vec<(Uuid, String)> =
            sqlx::query_as("SELECT payout_id, outcome FROM rail_submission")
                .fetch_all(&pool)
                .await
                .unwrap_or_else(|e| panic!("{e}"));
        let mut intents: HashMap<String, Vec<String>> = HashMap::new();
        for (payout, outcome) in rows {
            intents.entry(payout.to_string()).or_default().push(outcome);
        }
        let posted: Vec<(Uuid,)> =
            sqlx::query_as("SELECT payout_id FROM payouts WHERE state = 'POSTED'")
                .fetch_all(&pool)
                .await
                .unwrap_or_else(|e| panic!("{e}"));
        let mut violations = Vec::new();
        for client_ref in on_rail.keys() {
            let ok = intents
                .get(client_ref)
                .is_some_and(|o| o.iter().any(|o| o == "ACKED" || o == "TIMEOUT"));
            if !ok {
                violations.push(format!(
                    "{client_ref} is on the rail without an ACKED or TIMEOUT intent: {:?}",
                    intents.get(client_ref)
                ));
            }
        }
        for (payout, outcomes) in &intents {
            if outcomes.iter().any(|o| o == "ACKED") && !on_rail.contains_key(payout) {
                violations.push(format!(
                    "{payout} is ACKED at the proxy but not on the rail"
                ));
            }
            if outcomes.iter().any(|o| o == "unresolved") {
                violations.push(format!("{payout} still has an unresolved intent"));
            }
        }
        for (payout,) in posted {
            let n = on_rail.get(&payout.to_string()).copied().unwrap_or(0);
            if n != 1 {
                violations.push(format!("{payout} is POSTED with {n} transfers on the rail"));
            }
        }
        violations
    }
}

/// An answer that says "the backend is gone": NOT_LEADER, another 5xx, or no answer in time.
fn outage_status<T>(
    answer: Result<Result<T, dlock_contract::client::ClientError>, tokio::time::error::Elapsed>,
) -> Option<&'static str> {
    match answer {
        Err(_) => Some("timeout"),
        Ok(Err(e)) if e.code() == Some(ErrorCode::NotLeader) => Some("NOT_LEADER"),
        Ok(Err(e)) if e.code() == Some(ErrorCode::RailUnavailable) => Some("RAIL_UNAVAILABLE"),
        Ok(Err(e)) if e.code().is_none() => Some("transport"),
        Ok(Err(e)) if e.retry_safe() => Some("503"),
        _ => None,
    }
}

/// Cuts the lock server (in the namespace) from its backend mid-batch.
async fn lock_server_cut_from_backend(backend: Backend, scenario: &'static str, prefix: &str) {
    let stack = NetStack::start(Options {
        backend,
        placement: Placement {
            lock: true,
            ..Placement::default()
        },
        rail: &[("rail.stub.latency-ms", "10")],
        read_timeout_ms: 1_000,
        rail_fault_proxy: false,
        netns: true,
    });
    stack.accounts(prefix, 8, 10_000_000).await;
    let name = format!("{prefix}-batch");
    let batch = stack.batch(&name, prefix, 8, 120);
    // Short leases, so that they lapse while the backend is out of reach.
    let short = ["--lock-ttl-ms", "2000", "--session-ttl-ms", "3000"];
    let (first, first_log) = stack.executor(&batch, &format!("executor-{prefix}-a"), &short);
    stack.progress(25).await;
    let peer = match &stack.etcd {
        Some(etcd) => SocketAddr::new(stack.ns().host_addr(), etcd.client_port),
        None => stack.pg_peer(),
    };
    let cut = Instant::now();
    stack
        .ns()
        .partition(peer)
        .unwrap_or_else(|e| panic!("{e:#}"));
    // The lock server answers NOT_LEADER (or nothing) while its backend is silent.
    let lock = LockClient::new(&stack.lock.url(), "probe").unwrap_or_else(|e| panic!("{e}"));
    let probe = tokio::time::timeout(Duration::from_secs(4), lock.create_session(Some(5_000)));
    let seen = outage_status(probe.await);
    assert!(
        seen.is_some(),
        "{scenario}: the lock server still worked without its backend"
    );
    // Past every lease's local deadline (TTL × 0.7 = 1.4 s) nothing more is posted.
    let settle = Duration::from_millis(2_500).saturating_sub(cut.elapsed());
    tokio::time::sleep(settle).await;
    let frozen = stack.posted();
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    let still = stack.posted();
    let dropped = stack.ns().dropped_packets();
    stack.ns().heal().unwrap_or_else(|e| panic!("{e:#}"));
    assert_eq!(
        frozen, still,
        "{scenario}: payouts were posted under leases that could not be renewed"
    );
    println!(
        "{scenario}: partition held {:.1} s, lock server probe: {}, {dropped} packets dropped, posted frozen at {frozen}",
        cut.elapsed().as_secs_f64(),
        seen.unwrap_or("?")
    );
    // The first run may finish by itself after the heal or give up; a re-run completes the batch.
    let (_, mut fenced) = stack.wait(first, &first_log, Duration::from_secs(25));
    let (again, again_log) = stack.executor(&batch, &format!("executor-{prefix}-b"), &[]);
    fenced += stack.finish(again, &again_log);
    // Positive control: the count that stood still during the partition is the one that moves
    // once the lock server reaches its backend again, so "frozen" was not a blind counter.
    let healed = stack.posted();
    assert!(
        frozen < 120 && healed > frozen,
        "{scenario}: the cut left payouts to post ({frozen} of 120) and the same count rose \
         after the heal ({healed})"
    );
    header();
    stack
        .check(
            scenario,
            &[(&name, prefix, 120)],
            stack.ns().faults_injected(),
            fenced,
        )
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn cutting_the_lock_server_from_postgres_mid_batch_pays_nobody_twice() {
    lock_server_cut_from_backend(Backend::Pg, "lock server cut from PostgreSQL", "lspg").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn cutting_the_lock_server_from_etcd_mid_batch_pays_nobody_twice() {
    lock_server_cut_from_backend(Backend::Etcd, "lock server cut from etcd", "lsetcd").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn cutting_the_rail_proxy_from_the_rail_mid_forward_leaves_payouts_ambiguous() {
    let stack = NetStack::start(Options {
        backend: Backend::Pg,
        placement: Placement {
            proxy: true,
            ..Placement::default()
        },
        // Every forward takes 300 ms, so forwards are in flight when the cut comes.
        rail: &[("rail.stub.latency-ms", "300")],
        read_timeout_ms: 1_000,
        rail_fault_proxy: false,
        netns: true,
    });
    stack.accounts("prail", 8, 10_000_000).await;
    let batch = stack.batch("prail-batch", "prail", 8, 100);
    let (a, a_log) = stack.executor(&batch, "executor-prail-a", &[]);
    let (b, b_log) = stack.executor(&batch, "executor-prail-b", &[]);
    stack.progress(15).await;
    let cut = Instant::now();
    stack
        .ns()
        .partition(stack.stub.addr)
        .unwrap_or_else(|e| panic!("{e:#}"));
    // Held past the read timeout (1 s) plus the connect timeout of the forwards that follow.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let dropped = stack.ns().dropped_packets();
    stack.ns().heal().unwrap_or_else(|e| panic!("{e:#}"));
    println!(
        "proxy cut from the rail: partition held {:.1} s, {dropped} packets dropped",
        cut.elapsed().as_secs_f64()
    );
    let fenced = stack.finish(a, &a_log) + stack.finish(b, &b_log);
    header();
    let figures = stack
        .check(
            "rail proxy cut from the rail",
            &[("prail-batch", "prail", 100)],
            stack.ns().faults_injected(),
            fenced,
        )
        .await;
    assert!(
        figures.ambiguous > 0,
        "forwards cut mid-flight leave their payouts RAIL_AMBIGUOUS"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn cutting_the_rail_proxy_from_paydb_mid_batch_forwards_nothing_without_an_intent() {
    let stack = NetStack::start(Options {
        backend: Backend::Pg,
        placement: Placement {
            proxy: true,
            ..Placement::default()
        },
        rail: &[("rail.stub.latency-ms", "20")],
        read_timeout_ms: 1_000,
        rail_fault_proxy: false,
        netns: true,
    });
    stack.accounts("ppay", 8, 10_000_000).await;
    let batch = stack.batch("ppay-batch", "ppay", 8, 120);
    let (a, a_log) = stack.executor(&batch, "executor-ppay", &[]);
    stack.progress(25).await;
    let cut = Instant::now();
    stack
        .ns()
        .partition(stack.pg_peer())
        .unwrap_or_else(|e| panic!("{e:#}"));
    // A submission while paydb is silent is refused (503) or never answered: no intent, no
    // forward. It names a payout and an account that exist nowhere, so it can change nothing.
    let rail = RailClient::new(&stack.proxy.url(), "probe", Duration::from_secs(1))
        .unwrap_or_else(|e| panic!("{e}"));
    let body = SubmissionRequest {
        payout_id: Uuid::new_v4(),
        account_id: "probe-nowhere".into(),
        amount_minor: 1,
        currency: "EUR".into(),
        beneficiary_ref: "ben-probe".into(),
    };
    let probe = tokio::time::timeout(Duration::from_secs(4), rail.submit(1, "probe-key", &body));
    let seen = outage_status(probe.await);
    assert!(
        seen.is_some(),
        "the proxy admitted a submission without paydb"
    );
    // Forwards whose intent committed before the cut finish within the rail's 20 ms; after that
    // the statement must not grow while the proxy cannot write an intent.
    let settle = Duration::from_millis(1_500).saturating_sub(cut.elapsed());
    tokio::time::sleep(settle).await;
    let before = stack.transfers().await;
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    let after = stack.transfers().await;
    let dropped = stack.ns().dropped_packets();
    stack.ns().heal().unwrap_or_else(|e| panic!("{e:#}"));
    assert_eq!(
        before, after,
        "the proxy forwarded to the rail while it could not record an intent"
    );
    println!(
        "proxy cut from paydb: partition held {:.1} s, submit probe: {}, {dropped} packets dropped, statement frozen at {before}",
        cut.elapsed().as_secs_f64(),
        seen.unwrap_or("?")
    );
    let fenced = stack.finish(a, &a_log);
    // Positive control: the statement that stood still while paydb was out of reach grows once
    // the proxy can record intents again.
    let healed = stack.transfers().await;
    assert!(
        healed > after,
        "the statement grew after the heal ({after} -> {healed}); otherwise \"frozen\" proves nothing"
    );
    header();
    stack
        .check(
            "rail proxy cut from paydb",
            &[("ppay-batch", "ppay", 120)],
            stack.ns().faults_injected(),
            fenced,
        )
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn cutting_the_payment_resource_from_paydb_mid_batch_pays_nobody_twice() {
    let stack = NetStack::start(Options {
        backend: Backend::Pg,
        placement: Placement {
            payment: true,
            ..Placement::default()
        },
        rail: &[("rail.stub.latency-ms", "20")],
        read_timeout_ms: 1_000,
        rail_fault_proxy: false,
        netns: true,
    });
    stack.accounts("pres", 8, 10_000_000).await;
    let batch = stack.batch("pres-batch", "pres", 8, 120);
    let (a, a_log) = stack.executor(&batch, "executor-pres", &[]);
    stack.progress(25).await;
    let cut = Instant::now();
    stack
        .ns()
        .partition(stack.pg_peer())
        .unwrap_or_else(|e| panic!("{e:#}"));
    let payment = stack.payment_client();
    let probe = tokio::time::timeout(Duration::from_secs(4), payment.get_account("pres-00"));
    let seen = outage_status(probe.await);
    assert!(
        seen.is_some(),
        "the payment resource answered without paydb"
    );
    tokio::time::sleep(Duration::from_secs(4).saturating_sub(cut.elapsed())).await;
    let dropped = stack.ns().dropped_packets();
    stack.ns().heal().unwrap_or_else(|e| panic!("{e:#}"));
    println!(
        "payment resource cut from paydb: partition held {:.1} s, probe: {}, {dropped} packets dropped",
        cut.elapsed().as_secs_f64(),
        seen.unwrap_or("?")
    );
    let (_, mut fenced) = stack.wait(a, &a_log, Duration::from_secs(40));
    let (again, again_log) = stack.executor(&batch, "executor-pres-b", &[]);
    fenced += stack.finish(again, &again_log);
    header();
    stack
        .check(
            "payment resource cut from paydb",
            &[("pres-batch", "pres", 120)],
            stack.ns().faults_injected(),
            fenced,
        )
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_rail_answering_at_the_read_timeout_then_silent_then_resetting_pays_nobody_twice() {
    let read_timeout_ms = 800;
    let stack = NetStack::start(Options {
        backend: Backend::Pg,
        placement: Placement::default(),
        rail: &[
            ("rail.stub.latency-ms", "10"),
            ("rail.stub.latency-jitter-ms", "60"),
        ],
        read_timeout_ms,
        rail_fault_proxy: true,
        netns: false,
    });
    let rail = stack
        .rail_fault
        .as_ref()
        .unwrap_or_else(|| panic!("the rail fault proxy is missing"));
    stack.accounts("late", 8, 10_000_000).await;
    let batch = stack.batch("late-batch", "late", 8, 150);
    let (a, a_log) = stack.executor(&batch, "executor-late-a", &[]);
    let (b, b_log) = stack.executor(&batch, "executor-late-b", &[]);
    stack.progress(20).await;
    // 1: answers arrive around the proxy's read timeout: some just before, some just after.
    rail.set_latency(
        Direction::Downstream,
        Duration::from_millis(read_timeout_ms - 40),
    );
    tokio::time::sleep(Duration::from_secs(4)).await;
    rail.set_latency(Direction::Downstream, Duration::ZERO);
    // 2: the rail goes silent (connections accepted and read, nothing answered).
    rail.set_mode(Mode::Blackhole);
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    // 3: every connection is reset, open or new.
    rail.set_mode(Mode::Reset);
    tokio::time::sleep(Duration::from_millis(300)).await;
    rail.set_mode(Mode::Forward);
    let stats = rail.stats();
    println!(
        "late rail: {} connections through the fault proxy, {} reset, {} bytes swallowed",
        stats.accepted, stats.reset, stats.blackholed_bytes
    );
    let fenced = stack.finish(a, &a_log) + stack.finish(b, &b_log);
    header();
    let figures = stack
        .check(
            "rail late, silent, resetting",
            &[("late-batch", "late", 150)],
            3,
            fenced,
        )
        .await;
    assert!(
        figures.ambiguous > 0,
        "answers past the read timeout leave payouts RAIL_AMBIGUOUS"
    );
}
