//! The stream of batches: three executors per batch, and faults striking as payouts settle.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use dlock_devstack::ManagedChild;

use super::super::fenced_out_in;
use super::faults::{Fault, ROTATION};
use super::stack::{EXECUTORS, Run, WORKERS};
use crate::shared::payouts::{batch_manifest, spread};

/// The size of the run: at least `target` payouts and at least `seconds`, in batches of
/// `batch_size` over `accounts` accounts.
pub(super) struct Knobs {
    pub(super) target: usize,
    pub(super) seconds: usize,
    pub(super) batch_size: usize,
    pub(super) accounts: usize,
}

/// What the stream ran and what its executors said.
#[derive(Default)]
pub(super) struct Stream {
    /// Each batch's name and size.
    pub(super) batches: Vec<(String, usize)>,
    pub(super) total: usize,
    /// Executors fenced out, and woken to a lapsed session.
    pub(super) fenced: usize,
    pub(super) lapsed: usize,
    /// Cycles by outcome, from the executors' final tables.
    pub(super) cycles: BTreeMap<String, usize>,
    /// The logs of the executor runs that did not exit 0.
    pub(super) failed_runs: Vec<String>,
}

impl Stream {
    /// Counts what one executor's log says.
    fn read_log(&mut self, text: &str) {
        self.fenced += fenced_out_in(text);
        self.lapsed += text.matches("event=\"session_lost\"").count();
        // "cycles           10 Ambiguous, 7 Contended, 990 Settled, 35 Unavailable"
        if let Some(line) = text.lines().find(|l| l.starts_with("cycles ")) {
            for part in line["cycles ".len()..].split(',') {
                if let Some((n, kind)) = part.trim().split_once(' ') {
                    *self.cycles.entry(kind.to_owned()).or_default() +=
                        n.parse::<usize>().unwrap_or(0);
                }
            }
        }
    }
}

/// Batches until both the payout count and the duration are reached. Each batch: three
/// executors, and a fault every ninth of the batch (settled payouts, not time); the database
/// fails over in the first batch, halfway.
pub(super) async fn run_stream(run: &mut Run, knobs: &Knobs, began: Instant) -> Stream {
    let Knobs {
        target,
        seconds,
        batch_size,
        accounts,
    } = *knobs;
    let mut stream = Stream::default();
    let mut rotation = ROTATION.iter().cycle();
    while stream.total < target || began.elapsed() < Duration::from_secs(seconds as u64) {
        let name = format!("long-{:03}", stream.batches.len());
        let yaml = batch_manifest(&name, WORKERS, spread(batch_size, 5, "long", accounts));
        let file = run.dir.join(format!("{name}.yaml"));
        std::fs::write(&file, yaml).unwrap_or_else(|e| panic!("{e}"));
        let base = run.settled();
        let mut executors: Vec<(ManagedChild, PathBuf)> = EXECUTORS
            .iter()
            .map(|x| run.executor(&file, &format!("executor-{name}-{x}")))
            .collect();
        let first = stream.batches.is_empty();
        for k in 1..=8 {
            run.settled_at_least(base + batch_size * k / 9, &mut executors)
                .await;
            let fault = if first && k == 4 {
                Fault::DatabaseFailover
            } else {
                *rotation.next().unwrap_or(&Fault::KillRailProxy)
            };
            run.strike(fault, batch_size, &mut executors).await;
        }
        for (mut executor, log) in executors {
            let status =
                tokio::task::block_in_place(|| executor.wait_exit(Duration::from_secs(600)));
            stream.read_log(&std::fs::read_to_string(&log).unwrap_or_default());
            if !status.is_some_and(|s| s.success()) {
                executor.stop();
                stream
                    .failed_runs
                    .push(format!("{} ({status:?})", log.display()));
            }
        }
        stream.total += batch_size;
        stream.batches.push((name, batch_size));
        println!(
            "long chaos: {} payouts in {} batches, {} s, struck {:?}",
            stream.total,
            stream.batches.len(),
            began.elapsed().as_secs(),
            run.struck
        );
    }
    stream
}
