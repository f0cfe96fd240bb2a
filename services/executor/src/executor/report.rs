//! What a run did: the payouts by final state and the cycles by outcome.

use std::collections::BTreeMap;
use std::time::Duration;

use uuid::Uuid;

#[derive(Debug, Default, Clone)]
pub struct Report {
    pub payouts: usize,
    pub states: BTreeMap<String, usize>,
    pub ambiguous: Vec<Uuid>,
    pub fenced_out: usize,
    pub cycles: usize,
    pub outcomes: BTreeMap<String, usize>,
    pub elapsed: Duration,
    /// Every payout is terminal or RAIL_AMBIGUOUS.
    pub complete: bool,
    /// Payouts not moved because paydb refused their last cycle with RECOVERY_REQUIRED: it waits
    /// for an operator's `dlock recover paydb-epoch` (docs/runbook.md).
    pub recovery_required: Vec<Uuid>,
}

impl Report {
    pub fn table(&self) -> String {
        let mut out = String::from("state            payouts\n");
        for (state, n) in &self.states {
            out.push_str(&format!("{state:<16} {n:>7}\n"));
        }
        out.push_str(&format!(
            "total            {:>7}   ({} cycles, {} fenced out, {:.1} s)\n",
            self.payouts,
            self.cycles,
            self.fenced_out,
            self.elapsed.as_secs_f64()
        ));
        // Why cycles ended, so a cycle spent waiting for an answer is visible after the run.
        let outcomes: Vec<String> = self
            .outcomes
            .iter()
            .map(|(outcome, n)| format!("{n} {outcome}"))
            .collect();
        if !outcomes.is_empty() {
            out.push_str(&format!("cycles           {}\n", outcomes.join(", ")));
        }
        if !self.recovery_required.is_empty() {
            const SHOWN: usize = 5;
            let mut ids: Vec<String> = self
                .recovery_required
                .iter()
                .take(SHOWN)
                .map(Uuid::to_string)
                .collect();
            if self.recovery_required.len() > SHOWN {
                ids.push(format!("and {} more", self.recovery_required.len() - SHOWN));
            }
            out.push_str(&format!(
                "not moved        {} payouts: paydb refuses writes (503 RECOVERY_REQUIRED) after a \
                 failover that may have lost writes; an operator runs dlock reconcile, then dlock \
                 recover paydb-epoch, then this batch again ({})\n",
                self.recovery_required.len(),
                ids.join(", ")
            ));
        }
        out
    }
}
