//! The invariants checked at the end of the long run: nobody paid twice (the rail statement
//! against the payouts: each clientRef once), nothing lost (every registered payout POSTED,
//! FAILED or ABANDONED with a reason on record, or RAIL_AMBIGUOUS), and `dlock reconcile` (as a
//! process) without a critical finding, classifying every RAIL_AMBIGUOUS payout.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::time::Duration;

use dlock_contract::rail::read_statement;
use dlock_contract::reconcile::ReconcileSummary;
use dlock_devstack::PgServer;
use dlock_executor::manifest::payout_id;

use super::faults::{Fault, ROTATION};
use super::probe::Seen;
use super::stack::{EXECUTORS, Run, WORKERS, count, exe};
use super::stream::{Knobs, Stream};

/// What the run left behind, read after the stream has stopped.
pub(super) struct Findings {
    /// Transfers on the rail statement per clientRef.
    pub(super) on_rail: HashMap<String, usize>,
    twice: Vec<String>,
    by_state: BTreeMap<String, usize>,
    lost: Vec<String>,
    failed_without_reason: usize,
    abandoned_without_reason: usize,
    /// The payouts POSTED.
    pub(super) posted: Vec<String>,
    posted_off_rail: usize,
    summary: ReconcileSummary,
    reconcile_exit: Option<i32>,
    ambiguous: usize,
    ambiguous_in_db: usize,
}

impl Findings {
    pub(super) async fn gather(run: &Run, stream: &Stream) -> Self {
        // Each clientRef once on the rail statement.
        let on_rail = statement_counts(&run.stub.url()).await;
        let twice = paid_twice(&on_rail);

        // Every registered payout settled or RAIL_AMBIGUOUS; FAILED and ABANDONED with a reason.
        let pg = run.pg();
        let expected: Vec<String> = stream
            .batches
            .iter()
            .flat_map(|(name, n)| {
                (0..*n).map(move |i| payout_id(name, &format!("item-{i:05}")).to_string())
            })
            .collect();
        let (by_state, lost) = settled_or_lost(pg, &expected);
        // A FAILED payout: the rail declined it (its attempt REJECTED), an operator resolved it
        // (audit), or the claim found no funds (none here: every account holds 10^9). An
        // ABANDONED one: its abandonment row.
        let failed_without_reason = count(
            pg,
            "SELECT count(*) FROM payouts p WHERE state = 'FAILED' \
             AND NOT EXISTS (SELECT 1 FROM rail_submission s WHERE s.payout_id = p.payout_id \
                             AND s.outcome = 'REJECTED') \
             AND NOT EXISTS (SELECT 1 FROM audit_log a WHERE a.payout_id = p.payout_id)",
        );
        let abandoned_without_reason = count(
            pg,
            "SELECT count(*) FROM payouts p WHERE state = 'ABANDONED' \
             AND NOT EXISTS (SELECT 1 FROM payout_abandonments a WHERE a.payout_id = p.payout_id)",
        );
        let posted: Vec<String> = pg
            .psql(
                "paydb",
                "SELECT payout_id FROM payouts WHERE state = 'POSTED'",
            )
            .unwrap_or_else(|e| panic!("{e:#}"))
            .lines()
            .map(str::to_owned)
            .collect();
        let posted_off_rail = posted
            .iter()
            .filter(|id| !on_rail.contains_key(*id))
            .count();

        // The reconciler, as an operator runs it: the ledger against the balances and the
        // statement.
        let (summary, reconcile_exit) =
            reconcile(&pg.url("paydb"), &run.stub.url(), &run.dir, "run");
        let ambiguous = by_state.get("RAIL_AMBIGUOUS").copied().unwrap_or(0);
        let ambiguous_in_db = count(
            pg,
            "SELECT count(*) FROM payouts WHERE state = 'RAIL_AMBIGUOUS'",
        );
        Self {
            on_rail,
            twice,
            by_state,
            lost,
            failed_without_reason,
            abandoned_without_reason,
            posted,
            posted_off_rail,
            summary,
            reconcile_exit,
            ambiguous,
            ambiguous_in_db,
        }
    }

    /// The run's figures (docs/faults.md#the-long-chaos-run).
    pub(super) fn print(
        &self,
        run: &Run,
        stream: &Stream,
        knobs: &Knobs,
        seen: &(Seen, Seen),
        ran: Duration,
    ) {
        let Stream {
            batches,
            total,
            fenced,
            lapsed,
            cycles,
            failed_runs,
        } = stream;
        let Knobs {
            batch_size,
            accounts,
            ..
        } = knobs;
        println!(
            "long chaos: {total} payouts in {} batches of {batch_size} over {accounts} accounts, \
             {} executors x {WORKERS} workers each; {} s (debug={})",
            batches.len(),
            EXECUTORS.len(),
            ran.as_secs(),
            cfg!(debug_assertions)
        );
        println!("  states: {:?}", self.by_state);
        println!("  faults struck: {:?}", run.struck);
        println!(
            "  failover: promotion took {} ms",
            run.failover_ms.map_or("-".into(), |m| m.to_string())
        );
        println!(
            "  rail link: {} lost/late answers fired; lock link resets {}, payment link resets {}",
            run.rail_link.fired(),
            run.lock_link.stats().reset,
            run.payment_link.stats().reset
        );
        println!(
            "  probe refusals: lock server {:?} of {}, payment resource {:?} of {}",
            seen.0.refused, seen.0.calls, seen.1.refused, seen.1.calls
        );
        println!(
            "  executors: fenced out {fenced}, woke to a lapsed session {lapsed}, cycles {cycles:?}; \
             runs that failed: {}",
            failed_runs.len()
        );
        println!(
            "  rail statement: {} transfers, {} clientRefs twice; reconciler: {}",
            self.on_rail.values().sum::<usize>(),
            self.twice.len(),
            self.summary.summary()
        );
        println!(
            "  lost: {}; FAILED without a reason {}, ABANDONED without one {}; POSTED not on the \
             rail {}; logs in {}",
            self.lost.len(),
            self.failed_without_reason,
            self.abandoned_without_reason,
            self.posted_off_rail,
            run.dir.display()
        );
    }

    /// The invariants the run broke, each said in a line.
    pub(super) fn broken(&self, run: &Run, stream: &Stream) -> Vec<String> {
        let Self {
            twice,
            lost,
            summary,
            ..
        } = self;
        let (posted_off_rail, reconcile_exit) = (self.posted_off_rail, self.reconcile_exit);
        let (ambiguous, ambiguous_in_db) = (self.ambiguous, self.ambiguous_in_db);
        let without_reason = self.failed_without_reason + self.abandoned_without_reason;
        let failed_runs = &stream.failed_runs;
        let mut broken: Vec<String> = Vec::new();
        let mut fail = |what: String| broken.push(what);
        if !twice.is_empty() {
            fail(format!("paid twice on the rail: {twice:?}"));
        }
        if summary.statement.double_payments > 0 {
            fail(format!(
                "the reconciler found {} double payments",
                summary.statement.double_payments
            ));
        }
        if !lost.is_empty() {
            fail(format!(
                "{} payouts lost: {:?}",
                lost.len(),
                &lost[..lost.len().min(20)]
            ));
        }
        if without_reason > 0 {
            fail("a payout FAILED or ABANDONED without a reason on record".into());
        }
        if posted_off_rail > 0 || summary.statement.posted_not_on_rail > 0 {
            fail(format!(
                "{posted_off_rail} POSTED payouts are not on the rail"
            ));
        }
        if summary.critical > 0 || reconcile_exit != Some(0) {
            fail(format!(
                "the reconciler found critical findings (exit {:?}): {:?}",
                reconcile_exit, summary.findings
            ));
        }
        if summary.statement.ambiguous_found_on_rail + summary.statement.ambiguous_not_on_rail
            != ambiguous_in_db
            || ambiguous_in_db != ambiguous
        {
            fail(format!(
                "RAIL_AMBIGUOUS not all classified: {ambiguous} in the run, {ambiguous_in_db} in \
                 paydb, the reconciler classified {} + {}",
                summary.statement.ambiguous_found_on_rail, summary.statement.ambiguous_not_on_rail
            ));
        }
        if !failed_runs.is_empty() {
            fail(format!("executors failed: {failed_runs:?}"));
        }
        // Every fault kind struck (the failover once).
        for fault in ROTATION.iter().chain([&Fault::DatabaseFailover]) {
            if !run.struck.contains_key(fault) {
                fail(format!("{fault:?} never struck"));
            }
        }
        broken
    }
}

/// How many transfers the rail statement holds per clientRef.
pub(super) async fn statement_counts(stub_url: &str) -> HashMap<String, usize> {
    let statement = read_statement(stub_url, None)
        .await
        .unwrap_or_else(|e| panic!("reading the rail statement: {e}"));
    let mut on_rail: HashMap<String, usize> = HashMap::new();
    for t in &statement.transfers {
        *on_rail.entry(t.client_ref.clone()).or_default() += 1;
    }
    on_rail
}

pub(super) async fn on_rail_count(stub_url: &str, client_ref: &str) -> usize {
    statement_counts(stub_url)
        .await
        .get(client_ref)
        .copied()
        .unwrap_or(0)
}

/// The clientRefs the rail paid more than once, sorted.
pub(super) fn paid_twice(on_rail: &HashMap<String, usize>) -> Vec<String> {
    let mut twice: Vec<String> = on_rail
        .iter()
        .filter(|(_, n)| **n > 1)
        .map(|(r, _)| r.clone())
        .collect();
    twice.sort();
    twice
}

/// The `expected` payouts by state, and those not registered or not settled (nor RAIL_AMBIGUOUS).
pub(super) fn settled_or_lost(
    pg: &PgServer,
    expected: &[String],
) -> (BTreeMap<String, usize>, Vec<String>) {
    let states: HashMap<String, String> = pg
        .psql("paydb", "SELECT payout_id, state FROM payouts")
        .unwrap_or_else(|e| panic!("{e:#}"))
        .lines()
        .filter_map(|l| l.split_once('|'))
        .map(|(id, s)| (id.to_owned(), s.to_owned()))
        .collect();
    let mut by_state: BTreeMap<String, usize> = BTreeMap::new();
    let mut lost = Vec::new();
    for id in expected {
        match states.get(id).map(String::as_str) {
            Some(s @ ("POSTED" | "FAILED" | "ABANDONED" | "RAIL_AMBIGUOUS")) => {
                *by_state.entry(s.to_owned()).or_default() += 1;
            }
            other => lost.push(format!("{id} {other:?}")),
        }
    }
    (by_state, lost)
}

/// `dlock reconcile` as a process, its findings kept as `reconcile-{tag}.json`: its termination
/// summary and exit code.
pub(super) fn reconcile(
    paydb: &str,
    rail: &str,
    dir: &Path,
    tag: &str,
) -> (ReconcileSummary, Option<i32>) {
    let summary_file = dir.join(format!("reconcile-{tag}-summary.json"));
    let output = tokio::task::block_in_place(|| {
        std::process::Command::new(exe())
            .args(["reconcile", "--paydb", paydb, "--rail", rail])
            .args(["--settlement-window-ms", "0", "--json", "--termination-log"])
            .arg(&summary_file)
            .env_remove("DLOCK_TERMINATION_LOG")
            .output()
            .unwrap_or_else(|e| panic!("{} reconcile: {e}", exe().display()))
    });
    std::fs::write(dir.join(format!("reconcile-{tag}.json")), &output.stdout)
        .unwrap_or_else(|e| panic!("{e}"));
    let text = std::fs::read_to_string(&summary_file).unwrap_or_else(|e| {
        panic!(
            "dlock reconcile wrote no summary ({e}): {}",
            String::from_utf8_lossy(&output.stderr)
        )
    });
    let summary = serde_json::from_str(&text)
        .unwrap_or_else(|e| panic!("the reconciler's summary: {e}: {text}"));
    (summary, output.status.code())
}
