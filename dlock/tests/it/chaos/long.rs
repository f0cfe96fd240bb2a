//! The long chaos run: every fault kind on one stack at once, over a stream of batches. lockdb and
//! paydb live on a PostgreSQL pair (a synchronous standby, services/devstack/src/pg_standby.rs);
//! the four services run as processes; three `dlock run` executors work each batch; the rail stub
//! is hostile (late, duplicate, lost and declined answers) behind a fault proxy; the executors
//! reach the lock server and the payment resource through fault proxies too. While the batches
//! run, faults strike in turn, each once the stream has settled a given number of payouts:
//!
//! - an executor paused (SIGSTOP) past its lease while the others go on, then SIGCONT;
//! - the lock server's and the payment resource's links slowed, then reset;
//! - a rail answer lost after the rail took the transfer, and one held past the read timeout;
//! - kill -9 and restart of the lock server, the payment resource and the rail proxy;
//! - once per run, the primary SIGKILLed and the standby promoted (the services follow through
//!   their multi-host URL).
//!
//! At the end: nobody paid twice (the rail statement against the payouts: each clientRef once),
//! nothing lost (every registered payout POSTED, FAILED or ABANDONED with a reason on record, or
//! RAIL_AMBIGUOUS), no imbalance and every RAIL_AMBIGUOUS payout classified (`dlock reconcile`
//! against the statement, as a process). docs/faults.md#the-long-chaos-run has the figures.
//!
//! Knobs: `DLOCK_CHAOS_PAYOUTS` (at least this many payouts; 2000), `DLOCK_CHAOS_SECONDS` (and
//! at least this long; 0), `DLOCK_CHAOS_BATCH` (payouts per batch; 1000), `DLOCK_CHAOS_ACCOUNTS`
//! (40), `DLOCK_CHAOS_KEEP` (a directory to keep the logs in), `DLOCK_BIN` (the `dlock` binary
//! for the services, the executors and the reconciler; by default the one cargo built with this
//! test, which a rebuild during a long run would replace). e2e/chaos-long.sh runs it for an hour.
//!
//! The pieces: `stack` (the PostgreSQL pair, the services as processes, the fault proxies, the
//! executors), `faults` (what strikes and how), `probe` (a client beside the executors),
//! `stream` (the batches and when the faults strike), `checks` (the invariants at the end) and
//! `controls` (the positive controls of those checks).

mod checks;
mod controls;
mod faults;
mod probe;
mod stack;
mod stream;

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use dlock_contract::payment_client::PaymentClient;
use tokio::sync::Mutex;

use crate::failover::knob;
use crate::shared::accounts::open_account;
use checks::Findings;
use controls::positive_controls;
use probe::{Seen, probe};
use stack::Run;
use stream::{Knobs, run_stream};

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_fault_at_once_over_a_long_stream_pays_nobody_twice_and_loses_nothing() {
    let knobs = Knobs {
        target: knob("DLOCK_CHAOS_PAYOUTS", 2_000),
        seconds: knob("DLOCK_CHAOS_SECONDS", 0),
        batch_size: knob("DLOCK_CHAOS_BATCH", 1_000),
        accounts: knob("DLOCK_CHAOS_ACCOUNTS", 40),
    };
    let began = Instant::now();
    let tmp = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let dir = match std::env::var("DLOCK_CHAOS_KEEP") {
        Ok(keep) => {
            std::fs::create_dir_all(&keep).unwrap_or_else(|e| panic!("{keep}: {e}"));
            PathBuf::from(keep)
        }
        Err(_) => tmp.path().to_path_buf(),
    };

    let mut run = Run::start(&dir);
    let direct = PaymentClient::new(&run.payment.url(), "long").unwrap_or_else(|e| panic!("{e}"));
    for i in 0..knobs.accounts {
        open_account(&direct, &format!("long-{i:02}"), Some(1_000_000_000)).await;
    }

    let stop = Arc::new(AtomicBool::new(false));
    let seen = Arc::new(Mutex::new((Seen::default(), Seen::default())));
    let prober = probe(
        run.lock_link.url(),
        run.payment_link.url(),
        stop.clone(),
        seen.clone(),
    );
    let stream = run_stream(&mut run, &knobs, began).await;
    stop.store(true, Ordering::SeqCst);
    prober.await.unwrap_or_else(|e| panic!("{e}"));
    let ran = began.elapsed();

    let findings = Findings::gather(&run, &stream).await;
    findings.print(&run, &stream, &knobs, &*seen.lock().await, ran);
    let mut broken = findings.broken(&run, &stream);
    positive_controls(&run, &direct, &findings.posted, &mut broken).await;
    if !broken.is_empty() {
        // Keep the logs of a run that broke an invariant.
        let kept = tmp.keep();
        panic!(
            "{}\n(logs in {} and {})",
            broken.join("\n"),
            dir.display(),
            kept.display()
        );
    }
}
