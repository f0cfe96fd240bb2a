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

/// A throwaway PostgreSQL with an empty `database` (panics saying why when it cannot start).
pub fn postgres(database: &str) -> crate::PgServer {
    let pg = crate::PgServer::start(None).unwrap_or_else(|e| panic!("{e:#}"));
    pg.create_database(database)
        .unwrap_or_else(|e| panic!("{e:#}"));
    pg
}
