//! End-to-end payouts/s: the executor moving a batch through the lock server, the payment
//! resource, the rail proxy and the rail stub (latency 0), at 1, 8 and 32 workers, over 100
//! accounts and over a single hot account, on the `pg` and the `etcd` lock backends — with p50
//! and p99 per payout cycle, beside the lock server's own acquire+release cycles/s and the raw
//! commit rate of the same PostgreSQL (one conditional `UPDATE` per transaction, sequential and
//! at 32 connections), the commits per payout, the commit bound and our ratio to it, the server
//! time per hop of one payout, and the process's RSS. All services run in this process on real
//! loopback ports against one throwaway PostgreSQL and one throwaway etcd.
//!
//! `cargo bench -p dlock-executor --bench payouts` (optionally `-- --payouts 1200`). PostgreSQL
//! runs with production's durability (fsync on) unless `DLOCK_BENCH_PG=fast`; the raw commit
//! rate of the same server at 1 and 32 updates per commit (pgbench) is printed first.
//! `-- --group-commit` compares the payment resource's commit paths; `-- --batch-endpoints` the
//! executor sending one request per payout per step against batch requests
//! (docs/contract.md#batches), alternating in one run, at 1, 8, 32 and 128 workers over 100 and
//! 1 000 accounts and at 32 on one hot account, then for the batch requests the mean items per
//! backend transaction and per request on the wire of each step (acquire, release, claim, post,
//! submit), and the server time per route (p50, p99) of the headline row (128 workers, 1 000
//! accounts); `-- --replicas` one replica of each service against two, with two runners racing
//! over one batch and with the batch split between them by account (asserting on the rail's
//! statement that no payout was paid twice).

use std::sync::Arc;
use std::time::{Duration, Instant};

use dlock_contract::client::LockClient;
use dlock_contract::payment_client::PaymentClient;
use dlock_devstack::{EtcdServer, PgServer};
use dlock_executor::manifest::{BatchItem, BatchSpec, Metadata, PayoutBatch};
use dlock_executor::{Endpoints, RunOptions};
use dlock_server::config::RawConfig;

/// The allocator of the `dlock` binary (dlock/src/main.rs), so that the services in this process
/// allocate as they do in production.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Each service's PostgreSQL pool size (`DLOCK_BENCH_POOL`, 32 by default).
fn pool_max() -> String {
    std::env::var("DLOCK_BENCH_POOL").unwrap_or_else(|_| "32".into())
}

/// A service's configuration with fencing-token proofs on, as production runs
/// (docs/design.md#d-8): the lock server signs each grant's token, and the payment resource and
/// the rail proxy check the proof of every fenced write. The rail stub ignores the key.
fn raw(pairs: &[(&str, String)]) -> RawConfig {
    let mut pairs = pairs.to_vec();
    pairs.push(("fencing.proof-keys-file", proof_keys_file()));
    RawConfig::from_pairs(&pairs).unwrap_or_else(|e| panic!("{e}"))
}

/// The run's proof keys file (`<key-id> <secret>`, a fresh secret), shared by every service
/// of the run.
fn proof_keys_file() -> String {
    static FILE: std::sync::OnceLock<(tempfile::TempDir, String)> = std::sync::OnceLock::new();
    let (_, path) = FILE.get_or_init(|| {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let path = dir.path().join("fencing-proof-keys");
        let secret: String = (0..48)
            .map(|_| char::from_digit(rand::random_range(0..16u32), 16).unwrap_or('0'))
            .collect();
        std::fs::write(&path, format!("bench {secret}\n")).unwrap_or_else(|e| panic!("{e}"));
        let path = path.display().to_string();
        (dir, path)
    });
    path.clone()
}

async fn bind() -> (tokio::net::TcpListener, String) {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let addr = l.local_addr().unwrap_or_else(|e| panic!("{e}"));
    (l, addr.to_string())
}

fn serve(l: tokio::net::TcpListener, app: axum::Router) {
    tokio::spawn(async move {
        let _ = dlock_server::http::serve(l, app, std::future::pending()).await;
    });
}

/// A lock server on `backend` (`pg` on lockdb, or `etcd`), serving on a loopback port.
async fn lock_server(pg: &PgServer, etcd: &EtcdServer, backend: &str) -> String {
    let (l, lock_addr) = bind().await;
    let mut pairs = vec![
        ("server.listen", lock_addr.clone()),
        ("lock.backend", backend.to_owned()),
    ];
    if backend == "pg" {
        pairs.push(("lock.pg.url", pg.url("lockdb")));
        pairs.push(("lock.pg.pool-max", pool_max()));
    } else {
        pairs.push(("lock.etcd.endpoints", etcd.endpoint()));
    }
    let config = dlock_lock_server::LockServerConfig::from_raw(&mut raw(&pairs))
        .unwrap_or_else(|e| panic!("{e}"));
    let store = dlock_lock_server::open_store(&config)
        .await
        .unwrap_or_else(|e| panic!("{e:#}"));
    serve(
        l,
        dlock_lock_server::app(dlock_lock_server::AppState::new(store, Arc::new(config))),
    );
    format!("http://{lock_addr}")
}

/// The payment resource (with `payment.batch.max = batch_max`), the rail stub and the rail
/// proxy, on paydb; and the payment resource's state, whose metrics give the batch sizes.
async fn stack(
    pg: &PgServer,
    dir: &std::path::Path,
    lock_server: String,
    batch_max: usize,
) -> (Endpoints, dlock_payment_resource::AppState) {
    let (payment_resource, state) = payment_resource(pg, batch_max).await;
    let stub = rail_stub(dir).await;
    let rail_proxy = rail_proxy(pg, &stub).await;
    (
        Endpoints {
            lock_server,
            payment_resource,
            rail_proxy,
        },
        state,
    )
}

/// A payment resource on paydb with `payment.batch.max = batch_max`: its URL and its state.
async fn payment_resource(
    pg: &PgServer,
    batch_max: usize,
) -> (String, dlock_payment_resource::AppState) {
    let (l, pay_addr) = bind().await;
    let config = dlock_payment_resource::PaymentConfig::from_raw(&mut raw(&[
        ("server.listen", pay_addr.clone()),
        ("payment.pg.url", pg.url("paydb")),
        ("payment.pg.pool-max", pool_max()),
        ("payment.batch.max", batch_max.to_string()),
    ]))
    .unwrap_or_else(|e| panic!("{e}"));
    let store = dlock_payment_resource::open_store(&config)
        .await
        .unwrap_or_else(|e| panic!("{e:#}"));
    let state = dlock_payment_resource::AppState::new(store, Arc::new(config));
    serve(l, dlock_payment_resource::app(state.clone()));
    (format!("http://{pay_addr}"), state)
}

/// A rail stub (latency 0) keeping its statement in `dir`: its URL.
async fn rail_stub(dir: &std::path::Path) -> String {
    let (l, stub_addr) = bind().await;
    let config = dlock_rail_stub::RailStubConfig::from_raw(&mut raw(&[
        ("server.listen", stub_addr.clone()),
        ("auth.mode", "none".to_owned()),
        (
            "rail.stub.statement-path",
            dir.join("statement.jsonl").display().to_string(),
        ),
    ]))
    .unwrap_or_else(|e| panic!("{e}"));
    let stub = dlock_rail_stub::StubState::open(config).unwrap_or_else(|e| panic!("{e:#}"));
    serve(l, dlock_rail_stub::app(stub));
    format!("http://{stub_addr}")
}

/// A rail proxy on paydb in front of the rail at `rail`: its URL.
async fn rail_proxy(pg: &PgServer, rail: &str) -> String {
    let (l, proxy_addr) = bind().await;
    let config = dlock_rail_proxy::RailProxyConfig::from_raw(&mut raw(&[
        ("server.listen", proxy_addr.clone()),
        ("rail.proxy.pg.url", pg.url("paydb")),
        ("rail.proxy.rail-url", rail.to_owned()),
        ("rail.proxy.pg.pool-max", pool_max()),
    ]))
    .unwrap_or_else(|e| panic!("{e}"));
    let pool = dlock_rail_proxy::connect(&config)
        .await
        .unwrap_or_else(|e| panic!("{e:#}"));
    let proxy =
        dlock_rail_proxy::AppState::new(pool, Arc::new(config)).unwrap_or_else(|e| panic!("{e:#}"));
    serve(l, dlock_rail_proxy::app(proxy));
    format!("http://{proxy_addr}")
}

/// (transactions, requests) of the payment resource's group commit so far, claims and posts
/// together (`payment_batch_size`'s count and sum).
fn batches(state: &dlock_payment_resource::AppState) -> (f64, f64) {
    let text = state.metrics.encode();
    (
        sample(&text, "payment_batch_size_count", None),
        sample(&text, "payment_batch_size_sum", None),
    )
}

/// Opening and funding an account, the same file as dlock's integration tests use.
#[path = "../../../dlock/tests/shared/accounts.rs"]
mod shared_accounts;

/// Accounts `{prefix}-000` onwards, each funded with 10^9 minor units.
async fn accounts(payment: &PaymentClient, prefix: &str, n: usize) {
    for i in 0..n {
        let account = format!("{prefix}-{i:03}");
        shared_accounts::open_account(payment, &account, Some(1_000_000_000)).await;
    }
}

fn batch(name: &str, prefix: &str, accounts: usize, payouts: usize) -> PayoutBatch {
    PayoutBatch {
        api_version: "dlock.io/v1alpha1".into(),
        kind: "PayoutBatch".into(),
        metadata: Metadata {
            name: name.into(),
            namespace: None,
        },
        spec: BatchSpec {
            workers: 1,
            batch_max: 1,
            payouts: (0..payouts)
                .map(|i| BatchItem {
                    key: format!("item-{i:05}"),
                    account_id: format!("{prefix}-{:03}", i % accounts),
                    amount_minor: 100 + i as i64,
                    currency: "EUR".into(),
                    beneficiary_ref: format!("ben-{i}"),
                })
                .collect(),
        },
    }
}

/// What `clients` tasks got done per second in `run_for`: `client(c, deadline)` is client
/// `c`'s task, which counts what it does until the deadline.
async fn per_second<F, Fut>(clients: usize, run_for: Duration, client: F) -> f64
where
    F: Fn(usize, Instant) -> Fut,
    Fut: std::future::Future<Output = usize> + Send + 'static,
{
    let deadline = Instant::now() + run_for;
    let tasks: Vec<_> = (0..clients)
        .map(|c| tokio::spawn(client(c, deadline)))
        .collect();
    let mut total = 0;
    for t in tasks {
        total += t.await.unwrap_or_else(|e| panic!("{e}"));
    }
    total as f64 / run_for.as_secs_f64()
}

/// The lock server's own acquire+release cycles/s, 16 clients on their own keys, for scale.
async fn lock_cycles(url: &str, run_for: Duration) -> f64 {
    per_second(16, run_for, |c, deadline| {
        let client = LockClient::new(url, &format!("bench-{c}")).unwrap_or_else(|e| panic!("{e}"));
        async move {
            let s = client
                .create_session(Some(60_000))
                .await
                .unwrap_or_else(|e| panic!("{e}"));
            let mut n = 0usize;
            while Instant::now() < deadline {
                let key = format!("cycles:{c}");
                let g = client
                    .acquire(&key, s.session_id, None, None)
                    .await
                    .unwrap_or_else(|e| panic!("{e}"));
                client
                    .release(&key, s.session_id, g.fencing_token)
                    .await
                    .unwrap_or_else(|e| panic!("{e}"));
                n += 1;
            }
            n
        }
    })
    .await
}

#[path = "payouts/spans.rs"]
mod spans;

/// Commits/s of the same PostgreSQL: one conditional `UPDATE` per transaction (autocommit,
/// synchronous commit as configured), from `clients` connections over `rows` rows.
async fn raw_commits(url: &str, clients: usize, rows: i32, run_for: Duration) -> f64 {
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(clients as u32 + 1)
        .connect(url)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS raw_commit (id int PRIMARY KEY, fence bigint NOT NULL DEFAULT 0)",
    )
    .execute(&pool)
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    sqlx::query(
        "INSERT INTO raw_commit (id) SELECT g FROM generate_series(0, 99) g ON CONFLICT DO NOTHING",
    )
    .execute(&pool)
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    let rate = per_second(clients, run_for, |c, deadline| {
        let pool = pool.clone();
        async move {
            let mut n = 0usize;
            while Instant::now() < deadline {
                let id = ((c + n) as i32) % rows;
                sqlx::query("UPDATE raw_commit SET fence = fence + 1 WHERE id = $1 AND fence >= 0")
                    .bind(id)
                    .execute(&pool)
                    .await
                    .unwrap_or_else(|e| panic!("{e}"));
                n += 1;
            }
            n
        }
    })
    .await;
    pool.close().await;
    rate
}

/// Commits PostgreSQL counted so far in paydb and lockdb (the statistics lag by up to a
/// second; the bench waits that out around each run).
async fn commits(pool: &sqlx::PgPool) -> i64 {
    sqlx::query_scalar(
        "SELECT sum(xact_commit)::bigint FROM pg_stat_database \
         WHERE datname IN ('paydb', 'lockdb')",
    )
    .fetch_one(pool)
    .await
    .unwrap_or_else(|e| panic!("{e}"))
}

/// `DLOCK_BENCH_PERF=<dir>`: each timed run is sampled by `perf record -a -g` (call graphs of
/// every process, PostgreSQL's backends included) into `<dir>/<run prefix>.data`, from the
/// executor's first request to its last answer; registration and setup are left out. Read it
/// with `perf report -i <file> --comm postgres --no-children`.
mod perf {
    use std::io::{BufRead, Write};

    pub struct Recording {
        child: std::process::Child,
    }

    pub fn start(prefix: &str) -> Option<Recording> {
        let dir = std::path::PathBuf::from(std::env::var("DLOCK_BENCH_PERF").ok()?);
        let fail = |e: &dyn std::fmt::Display| -> ! {
            panic!("DLOCK_BENCH_PERF is set but perf could not start recording: {e}")
        };
        let (ctl, ack) = (
            dir.join(format!("{prefix}.ctl")),
            dir.join(format!("{prefix}.ack")),
        );
        for fifo in [&ctl, &ack] {
            let _ = std::fs::remove_file(fifo);
            let made = std::process::Command::new("mkfifo").arg(fifo).status();
            if !made.is_ok_and(|s| s.success()) {
                fail(&format!("mkfifo {} failed", fifo.display()));
            }
        }
        // Started with its events off (-D -1); they go on when perf acknowledges `enable` on
        // its control pipe, so the recording covers the run from its first request.
        let child = std::process::Command::new("perf")
            .args(["record", "-a", "-g", "-F", "199", "-D", "-1", "--control"])
            .arg(format!("fifo:{},{}", ctl.display(), ack.display()))
            .arg("-o")
            .arg(dir.join(format!("{prefix}.data")))
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap_or_else(|e| fail(&e));
        let mut ctl = std::fs::OpenOptions::new()
            .write(true)
            .open(&ctl)
            .unwrap_or_else(|e| fail(&e));
        let ack = std::fs::File::open(&ack).unwrap_or_else(|e| fail(&e));
        ctl.write_all(b"enable\n").unwrap_or_else(|e| fail(&e));
        let mut line = String::new();
        std::io::BufReader::new(ack)
            .read_line(&mut line)
            .unwrap_or_else(|e| fail(&e));
        Some(Recording { child })
    }

    /// Stops the recording as Ctrl-C would, so that perf writes its file out whole.
    pub fn stop(recording: Option<Recording>) {
        let Some(mut recording) = recording else {
            return;
        };
        let _ = std::process::Command::new("kill")
            .args(["-INT", &recording.child.id().to_string()])
            .status();
        let _ = recording.child.wait();
    }
}

/// CPU time (user + system) from /proc, in milliseconds: this process (every service and the
/// executor run in it) and a server with all its children (PostgreSQL's backends; etcd). Unlike
/// wall time it does not depend on what else the two cores were doing, so it shows which part
/// a payout's work is in.
mod cpu {
    /// `getconf CLK_TCK`, asked once.
    fn ticks_per_second() -> f64 {
        static TICKS: std::sync::OnceLock<f64> = std::sync::OnceLock::new();
        *TICKS.get_or_init(|| {
            std::process::Command::new("getconf")
                .arg("CLK_TCK")
                .output()
                .ok()
                .and_then(|o| String::from_utf8(o.stdout).ok())
                .and_then(|s| s.trim().parse::<f64>().ok())
                .unwrap_or(100.0)
        })
    }

    /// (ppid, utime + stime, cutime + cstime) of one process, in ticks.
    fn stat(pid: &str) -> Option<(u32, u64, u64)> {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        // Fields after the command name, which may itself hold spaces: state is field 3.
        let rest: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
        let n = |i: usize| rest.get(i - 3)?.parse::<u64>().ok();
        Some((n(4)? as u32, n(14)? + n(15)?, n(16)? + n(17)?))
    }

    pub fn own() -> f64 {
        stat("self").map_or(0.0, |(_, own, _)| own as f64 * 1000.0 / ticks_per_second())
    }

    /// The process, the children it has reaped, and its live children.
    pub fn tree(pid: Option<u32>) -> f64 {
        let Some(pid) = pid else { return 0.0 };
        let Some((_, own, reaped)) = stat(&pid.to_string()) else {
            return 0.0;
        };
        let live: u64 = std::fs::read_dir("/proc")
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| e.file_name().to_str().map(str::to_owned))
            .filter(|name| name.bytes().all(|b| b.is_ascii_digit()))
            .filter_map(|name| stat(&name))
            .filter(|(ppid, _, _)| *ppid == pid)
            .map(|(_, t, _)| t)
            .sum();
        (own + reaped + live) as f64 * 1000.0 / ticks_per_second()
    }
}

/// Where PostgreSQL's time goes, statement by statement.
#[path = "payouts/statements.rs"]
mod statements;

fn rss_mib() -> f64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        .map_or(0.0, |kb| kb / 1024.0)
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// What the timed runs share: the servers and the statistics connection.
struct Bench<'a> {
    pg: &'a PgServer,
    etcd: &'a EtcdServer,
    stats: sqlx::PgPool,
}

/// One timed batch: its rate, cycle quantiles, commits and CPU per payout, and its spans.
struct Run {
    rate: f64,
    p50: f64,
    p99: f64,
    xacts: f64,
    cpu_ms: (f64, f64, f64),
    cores: f64,
    cycles: usize,
    times: std::collections::BTreeMap<String, Vec<Duration>>,
}

/// A pool on the database `db` of `pg`.
async fn pool(pg: &PgServer, db: &str) -> sqlx::PgPool {
    sqlx::PgPool::connect(&pg.url(db))
        .await
        .unwrap_or_else(|e| panic!("{e}"))
}

impl<'a> Bench<'a> {
    /// The bench on `pg` and `etcd`, its transactions counted on paydb.
    async fn new(pg: &'a PgServer, etcd: &'a EtcdServer) -> Self {
        let stats = pool(pg, "paydb").await;
        Self { pg, etcd, stats }
    }

    /// `n` payouts over `accounts_n` fresh accounts named after `prefix`, by `workers` workers.
    async fn run(
        &self,
        endpoints: &Endpoints,
        prefix: &str,
        accounts_n: usize,
        n: usize,
        workers: usize,
        client_batch: usize,
    ) -> Run {
        // Through the payment resource of `endpoints`: the paths under comparison may be on
        // different databases.
        let payment = PaymentClient::new(&endpoints.payment_resource, "bench")
            .unwrap_or_else(|e| panic!("{e}"));
        accounts(&payment, prefix, accounts_n).await;
        let batch = batch(&format!("bench-{prefix}"), prefix, accounts_n, n);
        // Register outside the timed run: it is a one-off per batch, not payout work.
        dlock_executor::register(&batch, &payment)
            .await
            .unwrap_or_else(|e| panic!("{e:#}"));
        let options = RunOptions {
            workers,
            owner_id: format!("bench-{prefix}"),
            register: false,
            batch_max: client_batch,
            ..RunOptions::default()
        };
        tokio::time::sleep(Duration::from_millis(1_100)).await;
        let commits_before = commits(&self.stats).await;
        spans::take();
        statements::reset(&self.stats).await;
        let (pg, etcd) = (self.pg.pid(), self.etcd.pid());
        let cpu_before = (cpu::own(), cpu::tree(pg), cpu::tree(etcd));
        let perf = perf::start(prefix);
        let started = Instant::now();
        let report = dlock_executor::execute(&batch, endpoints, options)
            .await
            .unwrap_or_else(|e| panic!("{e:#}"));
        let seconds = started.elapsed().as_secs_f64();
        perf::stop(perf);
        let cpu_ms = (
            (cpu::own() - cpu_before.0) / n as f64,
            (cpu::tree(pg) - cpu_before.1) / n as f64,
            (cpu::tree(etcd) - cpu_before.2) / n as f64,
        );
        let times = spans::take();
        tokio::time::sleep(Duration::from_millis(1_100)).await;
        let xacts = (commits(&self.stats).await - commits_before) as f64 / n as f64;
        assert!(report.complete, "the batch settled");
        assert_eq!(
            report.states.get("POSTED").copied(),
            Some(n),
            "every payout posted"
        );
        let mut cycles = times.get("payout cycle").cloned().unwrap_or_default();
        cycles.sort();
        Run {
            rate: n as f64 / seconds,
            p50: ms(spans::quantile(&cycles, 0.50)),
            p99: ms(spans::quantile(&cycles, 0.99)),
            xacts,
            cpu_ms,
            cores: (cpu_ms.0 + cpu_ms.1 + cpu_ms.2) * n as f64 / 1000.0 / seconds,
            cycles: cycles.len(),
            times,
        }
    }
}

/// One row of the table; `raw` is the raw commit rate the commit bound is taken from.
fn print_row(backend: &str, label: &str, workers: usize, n: usize, run: &Run, raw: f64) {
    let bound = raw / run.xacts.max(1.0);
    println!(
        "{:<8} {:<14} {:>7} {:>8} {:>10.0} {:>8.2} {:>8.2} {:>9.1} {:>8.0} {:>9.2} {:>10.2} {:>9.2} {:>10.2} {:>6.2}",
        backend,
        label,
        workers,
        n,
        run.rate,
        run.p50,
        run.p99,
        run.xacts,
        bound,
        run.rate / bound,
        run.cpu_ms.0,
        run.cpu_ms.1,
        run.cpu_ms.2,
        run.cores
    );
}

/// The raw commit rate of the tables' `raw commit/s` column: pgbench, 32 connections, 1 update
/// per commit, for 1 s (just before the row).
fn raw_now(pg: &PgServer) -> f64 {
    pg.raw_commits("rawdb", 32, 1, 1)
        .unwrap_or_else(|e| panic!("{e:#}"))
        .commits_per_second
}

/// The run's raw commit rates, as the tables' notes give them.
fn baseline_note(baseline: &dlock_devstack::bench::Baseline) -> String {
    format!(
        "the run's baseline: {:.0}/s at 1 and {:.0} updates/s at {} per commit",
        baseline.one.commits_per_second,
        baseline.k.updates_per_second(),
        baseline.k.updates
    )
}

/// The load averages, as /proc/loadavg has them.
fn load_average() -> String {
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    load.trim().to_owned()
}

/// The 1-minute load average.
fn load_now() -> String {
    let load = load_average();
    load.split_whitespace().next().unwrap_or("?").to_owned()
}

/// The header of the `--group-commit` and `--batch-endpoints` tables, whose rows
/// are [`batch_row`]s named in the column `first`.
fn batch_header(first: &str) {
    println!(
        "{:<15} {:>8} {:>7} {:>10} {:>8} {:>8} {:>9} {:>10} {:>9} {:>10} {:>12}  load",
        first,
        "accounts",
        "workers",
        "payouts/s",
        "p50 ms",
        "p99 ms",
        "xacts/p",
        "dlock cpu",
        "pg cpu",
        "mean batch",
        "raw commit/s"
    );
}

/// `run` and the mean size of the payment resource's group-commit batches during it (claims and
/// posts per paydb transaction).
async fn with_mean_batch(
    state: &dlock_payment_resource::AppState,
    run: impl std::future::Future<Output = Run>,
) -> (Run, f64) {
    let before = batches(state);
    let run = run.await;
    let after = batches(state);
    (run, (after.1 - before.1) / (after.0 - before.0).max(1.0))
}

/// One row of the `--group-commit` and `--batch-endpoints` tables, with the 1-minute load
/// average after it.
fn batch_row(label: &str, accounts_n: usize, workers: usize, run: &Run, mean: f64, raw: f64) {
    println!(
        "{:<15} {:>8} {:>7} {:>10.0} {:>8.2} {:>8.2} {:>9.2} {:>10.2} {:>9.2} {:>10.2} {:>12.0}  {}",
        label,
        accounts_n,
        workers,
        run.rate,
        run.p50,
        run.p99,
        run.xacts,
        run.cpu_ms.0,
        run.cpu_ms.1,
        mean,
        raw,
        load_now()
    );
}

/// What every mode but the default table runs with: the servers, a scratch directory, the URL of
/// the lock server on the pg backend, the payouts per row and the raw commit rate measured first.
#[derive(Clone, Copy)]
struct Setup<'a> {
    pg: &'a PgServer,
    etcd: &'a EtcdServer,
    dir: &'a std::path::Path,
    lock: &'a str,
    payouts: usize,
    baseline: &'a dlock_devstack::bench::Baseline,
}

impl<'a> Setup<'a> {
    /// [`stack`] on paydb with `payment.batch.max = 32` behind the pg lock server, and a
    /// [`Bench`] on it.
    async fn pg_stack(self) -> (Endpoints, dlock_payment_resource::AppState, Bench<'a>) {
        let (endpoints, state) = stack(self.pg, self.dir, self.lock.to_owned(), 32).await;
        (endpoints, state, Bench::new(self.pg, self.etcd).await)
    }
}

/// `--group-commit`: the pg backend at 32 and 128 workers over 100 and 1 000 accounts, two
/// paths of the payment resource in one run: one transaction per request (`payment.batch.max =
/// 1`) and group commit (32), on paydb as it is; with the commits, CPU and mean batch size per
/// payout beside the raw commit rate of the same server.
async fn group_commit(setup: Setup<'_>) {
    let Setup { pg, payouts, .. } = setup;
    let mut stacks = Vec::new();
    for (n, (label, batch_max)) in [("batch 1", 1usize), ("batch 32", 32)]
        .into_iter()
        .enumerate()
    {
        let sub = setup.dir.join(format!("path{n}"));
        std::fs::create_dir_all(&sub).unwrap_or_else(|e| panic!("{e}"));
        let (endpoints, state) = stack(pg, &sub, setup.lock.to_owned(), batch_max).await;
        stacks.push((label, endpoints, state));
    }
    let bench = Bench::new(pg, setup.etcd).await;
    println!(
        "group commit, pg backend, {payouts} payouts per row (load average at start: {})",
        load_average()
    );
    batch_header("path");
    for accounts_n in [100usize, 1_000] {
        for workers in [32usize, 128] {
            for (label, endpoints, state) in &stacks {
                let raw_now = raw_now(pg);
                let prefix = format!("gc{}a{accounts_n}w{workers}", label.replace([' ', ','], ""));
                let run = bench.run(endpoints, &prefix, accounts_n, payouts, workers, 1);
                let (run, mean) = with_mean_batch(state, run).await;
                batch_row(label, accounts_n, workers, &run, mean, raw_now);
            }
        }
    }
    println!(
        "(raw commit/s: pgbench, 32 connections, 1 update per commit, 1 s just before the row; \
         load: the 1-minute load average after the row; {})",
        baseline_note(setup.baseline)
    );
}

/// The payouts of a `--batch-endpoints` row of `workers` over `accounts_n` accounts, out of
/// `payouts`: a quarter at 1 worker and on one hot account, half at 8 workers, all of them
/// otherwise, so that the slow rows stay short.
fn row_payouts(payouts: usize, accounts_n: usize, workers: usize) -> usize {
    if accounts_n == 1 || workers == 1 {
        payouts / 4
    } else if workers <= 8 {
        payouts / 2
    } else {
        payouts
    }
}

/// The steps of the `--batch-endpoints` step table: (column, the service's batch-size histogram,
/// its `kind`, the single route an item stands for, the step's batch route). The rail proxy's
/// submit runs two transactions, `admit` and `record`, on one request.
const STEPS: [(&str, &str, &str, &str, &str); 6] = [
    (
        "acquire",
        "lock_batch_size",
        "acquire",
        "POST /v1/locks/{key}/acquire",
        "POST /v1/batches/acquire",
    ),
    (
        "release",
        "lock_batch_size",
        "release",
        "DELETE /v1/locks/{key}",
        "POST /v1/batches/release",
    ),
    (
        "claim",
        "payment_batch_size",
        "claim",
        "POST /v1/payouts/{payout_id}/claim",
        "POST /v1/batches/claim",
    ),
    (
        "post",
        "payment_batch_size",
        "post",
        "POST /v1/payouts/{payout_id}/post",
        "POST /v1/batches/post",
    ),
    (
        "admit",
        "rail_batch_size",
        "admit",
        "POST /v1/rail/submissions",
        "POST /v1/batches/submit",
    ),
    (
        "record",
        "rail_batch_size",
        "record",
        "POST /v1/rail/submissions",
        "POST /v1/batches/submit",
    ),
];

/// The `/metrics` text (as `GET /metrics` answers it) of the lock server, the payment resource
/// and the rail proxy of `endpoints`, one after the other: their series' names do not overlap.
async fn scrape(endpoints: &Endpoints) -> String {
    let http = dlock_contract::client::http_client().unwrap_or_else(|e| panic!("{e}"));
    let mut text = String::new();
    for base in [
        &endpoints.lock_server,
        &endpoints.payment_resource,
        &endpoints.rail_proxy,
    ] {
        let url = format!("{base}/metrics");
        let answer = http
            .get(&url)
            .send()
            .await
            .and_then(|answer| answer.error_for_status())
            .unwrap_or_else(|e| panic!("GET {url}: {e}"));
        text += &answer
            .text()
            .await
            .unwrap_or_else(|e| panic!("GET {url}: {e}"));
    }
    text
}

/// The sum of the samples of the series `name` (`lock_batch_size_sum`, …) in the Prometheus
/// text `text`: those labelled `kind="<kind>"`, or all of them for `None`.
fn sample(text: &str, name: &str, kind: Option<&str>) -> f64 {
    let label = kind.map(|kind| format!("kind=\"{kind}\""));
    text.lines()
        .filter(|l| {
            l.split_once('{').is_some_and(|(series, labels)| {
                series == name && label.as_ref().is_none_or(|label| labels.contains(label))
            })
        })
        .filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok())
        .sum()
}

/// The mean requests per backend transaction of the batch-size histogram `histogram{kind}`
/// between the scrapes `before` and `after` (the `_sum` and `_count` deltas; 0 for none).
fn mean_between(before: &str, after: &str, histogram: &str, kind: &str) -> f64 {
    let delta = |suffix: &str| {
        let name = format!("{histogram}_{suffix}");
        sample(after, &name, Some(kind)) - sample(before, &name, Some(kind))
    };
    delta("sum") / delta("count").max(1.0)
}

/// The mean items per request the executor sent for a step, from the servers' spans in `times`:
/// the items of its batch requests (`batch`) and its lone requests to `single` (a batch of one
/// goes to the single endpoint), over those requests.
fn wire_items(
    times: &std::collections::BTreeMap<String, Vec<Duration>>,
    single: &str,
    batch: &str,
) -> f64 {
    let count = |name: &str| times.get(name).map_or(0, Vec::len) as f64;
    let singles = count(single);
    (count(&spans::in_batch(single)) + singles) / (count(batch) + singles).max(1.0)
}

/// The header of the `--batch-endpoints` step table, whose lines are [`step_line`]s.
fn step_header() {
    let (backend, wire) = (&STEPS, &STEPS[..5]);
    println!(
        "{:>17} {:<48} {:<29}",
        "", "items per backend transaction", "items per request on the wire"
    );
    print!("{:>8} {:>7} ", "accounts", "workers");
    for (step, ..) in backend {
        print!(" {step:>7}");
    }
    print!(" ");
    for (step, ..) in wire {
        let step = if *step == "admit" { "submit" } else { step };
        print!(" {step:>7}");
    }
    println!();
}

/// One line of the step table: per step, the mean items per backend transaction between the
/// scrapes `before` and `after`, then the mean items per request the executor sent in `run`.
fn step_line(accounts_n: usize, workers: usize, before: &str, after: &str, run: &Run) -> String {
    let mut line = format!("{accounts_n:>8} {workers:>7} ");
    for (_, histogram, kind, ..) in &STEPS {
        line += &format!(" {:>7.2}", mean_between(before, after, histogram, kind));
    }
    line += " ";
    for (_, _, _, single, batch) in &STEPS[..5] {
        line += &format!(" {:>7.2}", wire_items(&run.times, single, batch));
    }
    line
}

/// The server time per route of `run` (`n` payouts), one line per span name: count, per payout,
/// p50 and p99.
fn hop_table(run: &Run, n: usize) {
    println!(
        "{:<52} {:>7} {:>10} {:>8} {:>8}",
        "span", "count", "per payout", "p50 ms", "p99 ms"
    );
    for (name, d) in &run.times {
        let mut d = d.clone();
        d.sort();
        println!(
            "{:<52} {:>7} {:>10.2} {:>8.2} {:>8.2}",
            name,
            d.len(),
            d.len() as f64 / n.max(1) as f64,
            ms(spans::quantile(&d, 0.5)),
            ms(spans::quantile(&d, 0.99))
        );
    }
}

/// `--batch-endpoints`: the pg backend, every service batching its commits at its default, and
/// the executor sending one request per payout per step (client batch 1) or each step's
/// concurrent calls as batch requests of up to 32 items (docs/contract.md#batches), alternating
/// in one run on one stack, at 1, 8, 32 and 128 workers over 100 and 1 000 accounts and at 32 on
/// one hot account ([`row_payouts`] each). Prints the table ([`batch_row`]s); then, for the
/// client batch 32 rows, the step table: per step the mean items per backend transaction (each
/// service's `<prefix>_batch_size{kind}` over the row, from its `/metrics`) and the mean items
/// per request the executor sent (from the servers' spans); then the server time per route
/// (count, per payout, p50, p99) of the headline row, 128 workers over 1 000 accounts at client
/// batch 32.
async fn batch_endpoints(setup: Setup<'_>) {
    let payouts = setup.payouts;
    let (endpoints, state, bench) = setup.pg_stack().await;
    println!(
        "batch endpoints, pg backend, {payouts} payouts per row, {} at 8 workers, {} at 1 worker \
         and on 1 account (load average at start: {})",
        payouts / 2,
        payouts / 4,
        load_average()
    );
    batch_header("client batch");
    let mut rows = Vec::new();
    for accounts_n in [100usize, 1_000] {
        for workers in [1usize, 8, 32, 128] {
            rows.push((accounts_n, workers));
        }
    }
    rows.push((1, 32));
    let mut steps = Vec::new();
    let mut headline = None;
    for (accounts_n, workers) in rows {
        for client_batch in [1usize, 32] {
            let raw_now = raw_now(setup.pg);
            let prefix = format!("be{client_batch}a{accounts_n}w{workers}");
            let n = row_payouts(payouts, accounts_n, workers);
            let before = scrape(&endpoints).await;
            let run = bench.run(&endpoints, &prefix, accounts_n, n, workers, client_batch);
            let (run, mean) = with_mean_batch(&state, run).await;
            let after = scrape(&endpoints).await;
            let label = format!("client {client_batch}");
            batch_row(&label, accounts_n, workers, &run, mean, raw_now);
            if client_batch == 32 {
                steps.push(step_line(accounts_n, workers, &before, &after, &run));
                if (accounts_n, workers) == (1_000, 128) {
                    headline = Some((n, run));
                }
            }
        }
    }
    println!(
        "(payouts per row: {payouts}, {} at 8 workers, {} at 1 worker and on 1 account; mean \
         batch: claims and posts per paydb transaction of the payment resource; raw commit/s: \
         pgbench, 32 connections, 1 update per commit, 1 s just before the row; {})",
        payouts / 2,
        payouts / 4,
        baseline_note(setup.baseline)
    );
    println!("\nbatch sizes per step, client batch 32:");
    step_header();
    for line in steps {
        println!("{line}");
    }
    println!(
        "(backend: each service's <prefix>_batch_size{{kind}}, _sum over _count across the row, \
         from its /metrics: lock acquire and release per lockdb transaction, claim and post per \
         paydb transaction of the payment resource, the rail proxy's admit and record per paydb \
         transaction (one submit runs both); wire: items the executor sent per request of the \
         step, a lone item going to the single endpoint as a request of one, from the servers' \
         request spans)"
    );
    if let Some((n, run)) = headline {
        println!(
            "\nserver time per route, 1 000 accounts, 128 workers, client batch 32 ({n} payouts, \
             {} cycles; \"in a batch\": the items of batch requests, each run through its single \
             route):",
            run.cycles
        );
        hop_table(&run, n);
    }
}

/// `--plans`: paydb's and lockdb's functions planning through their indexes without JIT (as the
/// baselines create them, migrations/paydb/0037_baseline_tables.sql) against the same functions
/// with sequential scans and JIT allowed again (the settings reset on every function),
/// alternating on one stack, client batch 32, each row twice (or `--rounds N` times).
async fn plans(setup: Setup<'_>) {
    let Setup { pg, payouts, .. } = setup;
    let (endpoints, state, bench) = setup.pg_stack().await;
    println!(
        "index plans, pg backend, {payouts} payouts per row, client batch 32 (load average at \
         start: {})",
        load_average()
    );
    // `--top`: every statement tracked, and the ones that took the most time after each row.
    let top = std::env::args().any(|a| a == "--top");
    if top {
        statements::track(pg, "all");
    }
    batch_header("plans");
    // `--workers N --accounts N` runs that row alone, `--rounds N` times (2 unless given).
    let rows = if std::env::args().any(|a| a == "--workers") {
        vec![(arg("--accounts", 1_000), arg("--workers", 128))]
    } else {
        vec![(100usize, 32usize), (100, 128), (1_000, 128)]
    };
    for round in 0..arg("--rounds", 2) {
        for &(accounts_n, workers) in &rows {
            for index_plans in [true, false] {
                index_plans_on(pg, index_plans);
                let raw_now = raw_now(pg);
                let label = if index_plans { "index" } else { "scans" };
                let prefix = format!("pl{round}{label}a{accounts_n}w{workers}");
                let run = bench.run(&endpoints, &prefix, accounts_n, payouts, workers, 32);
                let (run, mean) = with_mean_batch(&state, run).await;
                batch_row(label, accounts_n, workers, &run, mean, raw_now);
                if top {
                    println!("{}", statements::top(&bench.stats, payouts).await);
                }
            }
        }
    }
    index_plans_on(pg, true);
    println!(
        "(index: the functions as migrated; scans: enable_seqscan and jit reset on every \
         function; {})",
        baseline_note(setup.baseline)
    );
}

/// Sets (or resets) `enable_seqscan = off` and `jit = off` on every PL/pgSQL function of paydb
/// and lockdb that is not a trigger function, the settings each one is created with (why: the
/// headers of migrations/paydb/0037_baseline_tables.sql and migrations/lockdb/0016_baseline.sql).
/// Set again, they come after `plan_cache_mode` as the functions declare them.
fn index_plans_on(pg: &PgServer, on: bool) {
    let (seqscan, jit) = if on {
        ("SET enable_seqscan = off", "SET jit = off")
    } else {
        ("RESET enable_seqscan", "RESET jit")
    };
    let sql = format!(
        "DO $$
         DECLARE
             f regprocedure;
         BEGIN
             FOR f IN SELECT p.oid::regprocedure
                        FROM pg_proc p
                        JOIN pg_language l ON l.oid = p.prolang
                       WHERE p.pronamespace = 'public'::regnamespace
                         AND l.lanname = 'plpgsql'
                         AND p.prorettype <> 'trigger'::regtype
                       ORDER BY 1 LOOP
                 EXECUTE format('ALTER FUNCTION %s {seqscan}', f);
                 EXECUTE format('ALTER FUNCTION %s {jit}', f);
             END LOOP;
         END $$;"
    );
    for database in ["paydb", "lockdb"] {
        pg.psql(database, &sql)
            .unwrap_or_else(|e| panic!("{database}: index plans {on}: {e:#}"));
    }
}

/// `--profile`: where PostgreSQL's time goes at 128 workers over 1 000 accounts with batch
/// requests of up to 32 items: the row once untracked, then again with every statement tracked
/// (pg_stat_statements), and the statements that took the most time per payout.
async fn profile(setup: Setup<'_>) {
    let Setup { pg, payouts, .. } = setup;
    let (endpoints, state, bench) = setup.pg_stack().await;
    // `--workers N` and `--accounts N` choose the row (128 workers over 1 000 accounts unless
    // given).
    let (workers, accounts) = (arg("--workers", 128), arg("--accounts", 1_000));
    for (i, track) in ["none", "top", "all"].into_iter().enumerate() {
        statements::track(pg, track);
        let prefix = format!("prof{i}");
        let run = bench.run(&endpoints, &prefix, accounts, payouts, workers, 32);
        let (run, mean) = with_mean_batch(&state, run).await;
        batch_row(
            &format!("track {track}"),
            accounts,
            workers,
            &run,
            mean,
            0.0,
        );
        if track != "none" {
            println!("{}", statements::top(&bench.stats, payouts).await);
        }
    }
}

/// `--replicas`: one replica of each service (the lock server, the payment resource, the rail
/// proxy) against two, all on one lockdb and one paydb and paying through one rail stub, each
/// replica batching on its own. With two, two executors each go through their own replicas
/// with half the workers, either racing over the whole batch (`race`, as two `dlock run` on one
/// file would) or each running its half of it, the payouts of every other account (`split`, as
/// a batch divided by account between two runners); every executor sends batch requests of up
/// to 32 items. Each row checks the rail's statement: every payout paid, none twice.
async fn replicas(setup: Setup<'_>) {
    let Setup { pg, payouts, .. } = setup;
    let stats = pool(pg, "paydb").await;
    let stub = rail_stub(setup.dir).await;
    let mut sets = Vec::new();
    for _ in 0..2 {
        let lock_server = lock_server(pg, setup.etcd, "pg").await;
        let (payment_resource, state) = payment_resource(pg, 32).await;
        let rail_proxy = rail_proxy(pg, &stub).await;
        let endpoints = Endpoints {
            lock_server,
            payment_resource,
            rail_proxy,
        };
        sets.push((endpoints, state));
    }
    println!(
        "replicas, pg backend, {payouts} payouts per row, client batch 32 (load average at start: {})",
        load_average()
    );
    println!(
        "{:<9} {:>8} {:>7} {:>10} {:>9} {:>10} {:>9} {:>10} {:>9} {:>12}  load",
        "replicas",
        "accounts",
        "workers",
        "payouts/s",
        "xacts/p",
        "dlock cpu",
        "pg cpu",
        "mean batch",
        "paid twice",
        "raw commit/s"
    );
    for (accounts_n, workers) in [(1_000usize, 128usize), (100, 32)] {
        for (replicas, split) in [(1usize, false), (2, false), (2, true)] {
            let shape = match (replicas, split) {
                (1, _) => "1".to_owned(),
                (_, false) => format!("{replicas} race"),
                (_, true) => format!("{replicas} split"),
            };
            let prefix = format!("rep{}a{accounts_n}w{workers}", shape.replace(' ', ""));
            let payment = PaymentClient::new(&sets[0].0.payment_resource, "bench")
                .unwrap_or_else(|e| panic!("{e}"));
            accounts(&payment, &prefix, accounts_n).await;
            let batch = batch(&format!("bench-{prefix}"), &prefix, accounts_n, payouts);
            dlock_executor::register(&batch, &payment)
                .await
                .unwrap_or_else(|e| panic!("{e:#}"));
            let raw_now = raw_now(pg);
            let paid_before = dlock_contract::rail::read_statement(&stub, None)
                .await
                .unwrap_or_else(|e| panic!("{e}"))
                .transfers
                .len();
            let batches_before: Vec<_> = sets.iter().map(|(_, state)| batches(state)).collect();
            tokio::time::sleep(Duration::from_millis(1_100)).await;
            let commits_before = commits(&stats).await;
            let cpu_before = (cpu::own(), cpu::tree(pg.pid()));
            let started = Instant::now();
            // Split: runner i takes the payouts of the accounts whose number is i modulo the
            // replicas (`batch` gives payout j to account j modulo the accounts, an even number).
            let part = |i: usize| -> PayoutBatch {
                let mut part = batch.clone();
                if split {
                    part.spec.payouts = (batch.spec.payouts.iter().enumerate())
                        .filter(|(j, _)| j % replicas == i)
                        .map(|(_, item)| item.clone())
                        .collect();
                }
                part
            };
            let parts: Vec<PayoutBatch> = (0..replicas).map(part).collect();
            let reports = futures::future::join_all(sets.iter().zip(&parts).enumerate().map(
                |(i, ((endpoints, _), batch))| {
                    let options = RunOptions {
                        workers: workers / replicas,
                        owner_id: format!("bench-{prefix}-{i}"),
                        register: false,
                        batch_max: 32,
                        ..RunOptions::default()
                    };
                    dlock_executor::execute(batch, endpoints, options)
                },
            ))
            .await;
            let seconds = started.elapsed().as_secs_f64();
            let cpu_ms = (
                (cpu::own() - cpu_before.0) / payouts as f64,
                (cpu::tree(pg.pid()) - cpu_before.1) / payouts as f64,
            );
            tokio::time::sleep(Duration::from_millis(1_100)).await;
            let xacts = (commits(&stats).await - commits_before) as f64 / payouts as f64;
            for report in reports {
                let report = report.unwrap_or_else(|e| panic!("{e:#}"));
                assert!(report.complete, "the batch settled");
            }
            let statement = dlock_contract::rail::read_statement(&stub, None)
                .await
                .unwrap_or_else(|e| panic!("{e}"));
            let paid = &statement.transfers[paid_before.min(statement.transfers.len())..];
            let once: std::collections::HashSet<&str> =
                paid.iter().map(|t| t.client_ref.as_str()).collect();
            assert_eq!(once.len(), payouts, "every payout paid: {}", paid.len());
            let (count, sum) = sets
                .iter()
                .zip(&batches_before)
                .map(|((_, state), before)| {
                    let after = batches(state);
                    (after.0 - before.0, after.1 - before.1)
                })
                .fold((0.0, 0.0), |a, b| (a.0 + b.0, a.1 + b.1));
            println!(
                "{:<9} {:>8} {:>7} {:>10.0} {:>9.2} {:>10.2} {:>9.2} {:>10.2} {:>9} {:>12.0}  {}",
                shape,
                accounts_n,
                workers,
                payouts as f64 / seconds,
                xacts,
                cpu_ms.0,
                cpu_ms.1,
                sum / count.max(1.0),
                paid.len() - once.len(),
                raw_now,
                load_now()
            );
            assert_eq!(
                paid.len(),
                once.len(),
                "{} transfers on the rail's statement for {} payouts: {} paid twice with {shape} \
                 replicas over {accounts_n} accounts at {workers} workers",
                paid.len(),
                once.len(),
                paid.len() - once.len()
            );
        }
    }
    println!(
        "(race: two runners over the whole batch; split: each its half, by account; paid twice: \
         transfers on the rail's statement beyond one per payout; mean batch: claims and posts \
         per paydb transaction over both payment resources; {})",
        baseline_note(setup.baseline)
    );
}

/// The number after `name` on the command line, or `default`.
fn arg(name: &str, default: usize) -> usize {
    std::env::args()
        .skip_while(|a| a != name)
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(default)
}

fn main() {
    use tracing_subscriber::layer::SubscriberExt;
    let payouts = arg("--payouts", 600);
    tracing::subscriber::set_global_default(tracing_subscriber::registry().with(spans::Timing))
        .unwrap_or_else(|e| panic!("{e}"));
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap_or_else(|e| panic!("{e}"));
    let mut pg = dlock_devstack::bench::postgres_server();
    for db in ["lockdb", "paydb", "rawdb"] {
        pg.create_database(db).unwrap_or_else(|e| panic!("{e:#}"));
    }
    statements::enable(&mut pg);
    let etcd = EtcdServer::start(None).unwrap_or_else(|e| panic!("{e:#}"));
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    runtime.block_on(async {
        let rss_start = rss_mib();
        let baseline = dlock_devstack::bench::Baseline::measure(&pg, "rawdb", 32, 32);
        println!("{}", baseline.describe(&pg));
        let raw_seq = raw_commits(&pg.url("rawdb"), 1, 100, Duration::from_secs(2)).await;
        let raw_32 = raw_commits(&pg.url("rawdb"), 32, 100, Duration::from_secs(2)).await;
        let raw_hot = raw_commits(&pg.url("rawdb"), 32, 1, Duration::from_secs(2)).await;
        let pg_lock = lock_server(&pg, &etcd, "pg").await;
        let etcd_lock = lock_server(&pg, &etcd, "etcd").await;
        let setup = Setup {
            pg: &pg,
            etcd: &etcd,
            dir: dir.path(),
            lock: &pg_lock,
            payouts,
            baseline: &baseline,
        };
        // The first of these flags given chooses the mode; without any, the table below.
        let modes = [
            "--replicas",
            "--plans",
            "--profile",
            "--batch-endpoints",
            "--group-commit",
        ];
        match modes.into_iter().find(|mode| std::env::args().any(|a| a == *mode)) {
            Some("--replicas") => return replicas(setup).await,
            Some("--plans") => return plans(setup).await,
            Some("--profile") => return profile(setup).await,
            Some("--batch-endpoints") => return batch_endpoints(setup).await,
            Some("--group-commit") => return group_commit(setup).await,
            _ => {}
        }
        let (mut endpoints, _) = stack(&pg, dir.path(), pg_lock.clone(), 32).await;
        let bench = Bench::new(&pg, &etcd).await;
        let cycles_pg = lock_cycles(&pg_lock, Duration::from_secs(3)).await;
        let cycles_etcd = lock_cycles(&etcd_lock, Duration::from_secs(3)).await;
        let rss_rest = rss_mib();
        spans::take();
        println!("end-to-end payouts (acquire, claim, submit, post, release), rail latency 0");
        println!(
            "raw PostgreSQL (one conditional UPDATE per commit): {raw_seq:.0}/s sequential, {raw_32:.0}/s at 32 connections over 100 rows, {raw_hot:.0}/s at 32 on one row"
        );
        println!(
            "lock server alone (16 clients, acquire+release cycles/s): {cycles_pg:.0} on pg, {cycles_etcd:.0} on etcd"
        );
        println!(
            "{:<8} {:<14} {:>7} {:>8} {:>10} {:>8} {:>8} {:>9} {:>8} {:>9} {:>10} {:>9} {:>10} {:>6}",
            "backend", "accounts", "workers", "payouts", "payouts/s", "p50 ms", "p99 ms",
            "xacts/p", "bound/s", "of bound", "dlock cpu", "pg cpu", "etcd cpu", "cores"
        );
        println!("{:>102} {:>9} {:>10}", "ms/payout", "ms/payout", "ms/payout");
        let mut hops = None;
        let mut table_payouts = 0;
        let seq_before = statements::seq_rows(&pg);
        for (backend, lock_url) in [("pg", pg_lock.clone()), ("etcd", etcd_lock.clone())] {
            endpoints.lock_server = lock_url;
            for (label, accounts_n, n) in [
                ("100 accounts", 100usize, payouts),
                ("1 hot account", 1usize, payouts / 2),
            ] {
                for workers in [1usize, 8, 32] {
                    let prefix = format!("{backend}{accounts_n}w{workers}");
                    let run = bench.run(&endpoints, &prefix, accounts_n, n, workers, 1).await;
                    table_payouts += n;
                    let raw = if accounts_n == 1 { raw_seq } else { raw_32 };
                    print_row(backend, label, workers, n, &run, raw);
                    if hops.is_none() && workers == 1 {
                        hops = Some((run.cycles, run.times));
                    }
                }
            }
        }
        // Every run already waited for the backends' statistics to reach the counters.
        let seq_after = statements::seq_rows(&pg);
        println!("\nrows read by sequential scans during the table, per payout ({table_payouts} payouts; tables under 0.5 left out):");
        for (table, after) in &seq_after {
            let per = (after - seq_before.get(table).copied().unwrap_or(0)) as f64 / table_payouts as f64;
            if per >= 0.5 {
                println!("{table:<44} {per:>9.1}");
            }
        }
        // The breakdown: the first row again, every statement tracked, between two runs
        // without tracking (so the tracking's cost is read against neighbours, not against a
        // run on emptier tables at the start).
        println!(
            "\nthe first row again, pg_stat_statements.track = none, all, none (what tracking every statement costs):"
        );
        endpoints.lock_server = pg_lock.clone();
        let mut breakdown = String::new();
        for (i, track) in ["none", "all", "none"].into_iter().enumerate() {
            statements::track(&pg, track);
            let prefix = format!("pg100track{i}");
            let run = bench.run(&endpoints, &prefix, 100, payouts, 1, 1).await;
            print_row("pg", &format!("track {track}"), 1, payouts, &run, raw_32);
            if track == "all" {
                breakdown = statements::top(&bench.stats, payouts).await;
            }
        }
        if let Some((cycles, times)) = hops {
            println!("\nserver time per hop, pg backend, 1 worker, 100 accounts ({cycles} cycles):");
            println!("{:<44} {:>7} {:>9} {:>9}", "span", "count", "p50 ms", "per payout");
            for (name, mut d) in times {
                d.sort();
                let total: Duration = d.iter().sum();
                println!(
                    "{:<44} {:>7} {:>9.2} {:>9.2}",
                    name,
                    d.len(),
                    ms(spans::quantile(&d, 0.5)),
                    ms(total) / cycles.max(1) as f64
                );
            }
        }
        println!(
            "\nPostgreSQL time per statement, in the tracked run (pg_stat_statements, nested statements included; a function's time includes its statements'):"
        );
        println!("{breakdown}");
        println!(
            "\nRSS of this process (all services and the executor): {rss_start:.0} MiB at start, {rss_rest:.0} MiB at rest, {:.0} MiB after the runs",
            rss_mib()
        );
    });
    drop(etcd);
    drop(pg);
}
