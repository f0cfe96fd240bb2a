//! What the benchmarks share: their `--seconds` argument, a runtime, timing and the summary of
//! a run.

use std::future::Future;
use std::time::{Duration, Instant};

/// The value of `--seconds N` on the command line, or `default`.
pub fn seconds_arg(default: u64) -> u64 {
    std::env::args()
        .skip_while(|a| a != "--seconds")
        .nth(1)
        .and_then(|s| s.parse::<u64>().ok())
        .unwrap_or(default)
}

/// A multi-threaded tokio runtime with every driver on.
pub fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap_or_else(|e| panic!("{e}"))
}

/// Runs `work`, adding how long it took to `into`.
pub async fn timed<T>(into: &mut Vec<Duration>, work: impl Future<Output = T>) -> T {
    let started = Instant::now();
    let out = work.await;
    into.push(started.elapsed());
    out
}

/// `d` in milliseconds.
pub fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// The median of `times`, in milliseconds (0 when there are none).
pub fn median_ms(times: &[Duration]) -> f64 {
    ms(percentile(times, 0.5))
}

/// The `p` quantile (0 to 1) of `times`, nearest rank (zero when there are none).
pub fn percentile(times: &[Duration], p: f64) -> Duration {
    let mut sorted = times.to_vec();
    sorted.sort();
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

/// `count` operations over `elapsed`, with the latency of each.
#[derive(Debug, Default)]
pub struct Run {
    pub count: usize,
    pub elapsed: Duration,
    pub latencies: Vec<Duration>,
}

impl Run {
    /// Adds `other`'s operations, time and latencies: one run of several spells.
    pub fn add(&mut self, other: Run) {
        self.count += other.count;
        self.elapsed += other.elapsed;
        self.latencies.extend(other.latencies);
    }

    pub fn per_second(&self) -> f64 {
        self.count as f64 / self.elapsed.as_secs_f64()
    }

    /// Throughput, p50 and p99 (ms), as a row of the benchmarks' tables prints them.
    pub fn summary(&self) -> (f64, f64, f64) {
        (
            self.per_second(),
            ms(percentile(&self.latencies, 0.50)),
            ms(percentile(&self.latencies, 0.99)),
        )
    }
}

/// Which way a benchmark does its work: through the service over HTTP, or the same work
/// straight on the backend.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Via {
    Service,
    Raw,
}

/// The benches' PostgreSQL mode: `DLOCK_BENCH_PG=fast` for the devstack's fast mode (fsync off),
/// production's durable mode otherwise (docs/benchmarks.md#running-the-benchmarks). Panics on
/// any other value, naming the two.
pub fn durability() -> crate::Durability {
    match std::env::var("DLOCK_BENCH_PG").as_deref() {
        Err(_) | Ok("durable") | Ok("") => crate::Durability::Durable,
        Ok("fast") => crate::Durability::Fast,
        Ok(other) => panic!("DLOCK_BENCH_PG={other:?}: use `durable` (the default) or `fast`"),
    }
}

/// A throwaway PostgreSQL in the mode [`durability`] says (panics saying why when it cannot
/// start).
pub fn postgres_server() -> crate::PgServer {
    crate::PgServer::start_durability(durability()).unwrap_or_else(|e| panic!("{e:#}"))
}

/// The raw baseline of a run, measured on `pg`'s `database` before the service's figures:
/// commits/s with 1 and with `k` conditional updates per commit from `clients` connections.
pub struct Baseline {
    pub one: crate::RawCommits,
    pub k: crate::RawCommits,
}

impl Baseline {
    pub fn measure(pg: &crate::PgServer, database: &str, clients: usize, k: usize) -> Self {
        let seconds = 3;
        let measure = |updates| {
            pg.raw_commits(database, clients, updates, seconds)
                .unwrap_or_else(|e| panic!("{e:#}"))
        };
        Self {
            one: measure(1),
            k: measure(k),
        }
    }

    /// Updates/s at `k` per commit over updates/s at 1 per commit: what grouping buys at most.
    pub fn ratio(&self) -> f64 {
        self.k.updates_per_second() / self.one.updates_per_second().max(f64::MIN_POSITIVE)
    }

    /// Two lines: the mode and the baseline.
    pub fn describe(&self, pg: &crate::PgServer) -> String {
        format!(
            "PostgreSQL mode: {} (DLOCK_BENCH_PG=fast|durable)\n\
             raw PostgreSQL baseline (pgbench, {} connections, each updating rows of its own): \
             {:.0} commits/s at 1 update per commit, {:.0} commits/s = {:.0} updates/s at {} per \
             commit; ratio {:.1}x",
            pg.durability.name(),
            self.one.clients,
            self.one.commits_per_second,
            self.k.commits_per_second,
            self.k.updates_per_second(),
            self.k.updates,
            self.ratio()
        )
    }
}

/// A throwaway PostgreSQL with an empty `database` (panics saying why when it cannot start), in
/// the devstack's fast mode (the lock server's bench).
pub fn postgres(database: &str) -> crate::PgServer {
    with_database(
        crate::PgServer::start(None).unwrap_or_else(|e| panic!("{e:#}")),
        database,
    )
}

/// Like [`postgres`], in the mode [`durability`] says (production's unless told otherwise).
pub fn postgres_bench(database: &str) -> crate::PgServer {
    with_database(postgres_server(), database)
}

fn with_database(pg: crate::PgServer, database: &str) -> crate::PgServer {
    pg.create_database(database)
        .unwrap_or_else(|e| panic!("{e:#}"));
    pg
}
