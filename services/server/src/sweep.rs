//! The services' periodic clean-ups: one ticker, and what a sweep logs.

use std::future::Future;
use std::time::Duration;

use tokio::time::{Interval, MissedTickBehavior};

/// A ticker for a periodic job: a tick missed while the job ran late is delayed, never bunched.
pub fn ticker(every: Duration) -> Interval {
    let mut ticker = tokio::time::interval(every);
    ticker.set_missed_tick_behavior(MissedTickBehavior::Delay);
    ticker
}

/// What a sweep logs: the event and sentence when it removed something (debug), and when it
/// failed (warn; it is retried on the next tick).
pub struct SweepLog {
    pub swept: &'static str,
    pub swept_says: &'static str,
    pub failed: &'static str,
    pub failed_says: &'static str,
}

/// Runs `sweep` every `every`, forever, and logs each outcome as `log` says. Correctness never
/// waits for it.
pub async fn forever<F, Fut, E>(every: Duration, log: SweepLog, mut sweep: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<u64, E>>,
    E: std::fmt::Display,
{
    let mut ticker = ticker(every);
    loop {
        ticker.tick().await;
        match sweep().await {
            Ok(0) => {}
            Ok(removed) => tracing::debug!(event = log.swept, removed, "{}", log.swept_says),
            Err(error) => tracing::warn!(event = log.failed, %error, "{}", log.failed_says),
        }
    }
}
