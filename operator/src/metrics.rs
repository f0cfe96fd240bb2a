//! The operator's own Prometheus metrics. Labels are low-cardinality enums only (kind, outcome),
//! never object names.

use std::collections::HashMap;
use std::sync::Mutex;

use dlock_contract::reconcile::{ReconcileSummary, StatementCounts};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;

use dlock_server::registry::Register;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReconcileLabels {
    pub kind: &'static str,
    pub outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct FindingLabels {
    /// The finding's kind, as the reconciler names it.
    pub class: &'static str,
}

/// How many findings of one class a run's summary holds.
pub type FindingCount = fn(&StatementCounts) -> usize;

/// The reconciler's finding classes the operator counts, each with its count in a run's
/// summary. Every class is exported from the start (at zero), so that the first finding is an
/// increase Prometheus sees.
pub const FINDING_CLASSES: [(&str, FindingCount); 7] = [
    ("rail_transfer_without_payout", |s| {
        s.transfers_without_payout
    }),
    ("rail_transfer_differs_from_payout", |s| {
        s.transfers_differing_from_payout
    }),
    ("posted_payout_not_on_rail", |s| s.posted_not_on_rail),
    ("released_payout_paid_on_rail", |s| s.released_paid_on_rail),
    ("double_payment_on_rail", |s| s.double_payments),
    ("ambiguous_found_on_rail", |s| s.ambiguous_found_on_rail),
    ("ambiguous_not_on_rail", |s| s.ambiguous_not_on_rail),
];

pub struct Metrics {
    pub registry: Registry,
    pub reconciles: Family<ReconcileLabels, Counter>,
    pub revocations: Family<ReconcileLabels, Counter>,
    pub findings: Family<FindingLabels, Counter>,
    /// The reconciler run (its pod) last counted per Reconciliation (`namespace/name`), so that
    /// a run is counted once however often its object is reconciled.
    counted: Mutex<HashMap<String, String>>,
}

impl Default for Metrics {
    fn default() -> Self {
        let mut registry = Registry::with_prefix("dlock_operator");
        let findings: Family<FindingLabels, Counter> = registry.add(
            "reconciliation_findings",
            "Findings of the reconciler's finished runs, by class (each run counted once)",
        );
        for (class, _) in FINDING_CLASSES {
            findings.get_or_create(&FindingLabels { class }).inc_by(0);
        }
        Self {
            findings,
            counted: Mutex::new(HashMap::new()),
            reconciles: registry.add(
                "reconcile",
                "Reconciles by kind and outcome (ok, error, paused)",
            ),
            revocations: registry.add(
                "revocation",
                "Forced revocations by kind and outcome (Complete, Incomplete, Refused)",
            ),
            registry,
        }
    }
}

impl Metrics {
    pub fn count(&self, kind: &'static str, outcome: &'static str) {
        self.reconciles
            .get_or_create(&ReconcileLabels { kind, outcome })
            .inc();
    }

    /// Counts the findings of a Reconciliation's finished run, once per run: `run` names it (its
    /// pod); the same run seen again (every later reconcile of the object) adds nothing.
    pub fn count_findings(&self, reconciliation: &str, run: &str, summary: &ReconcileSummary) {
        let mut counted = self
            .counted
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if counted.get(reconciliation).map(String::as_str) == Some(run) {
            return;
        }
        counted.insert(reconciliation.to_owned(), run.to_owned());
        for (class, count) in FINDING_CLASSES {
            self.findings
                .get_or_create(&FindingLabels { class })
                .inc_by(count(&summary.statement) as u64);
        }
    }

    pub fn encode(&self) -> String {
        dlock_server::metrics::encode(&self.registry)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(metrics: &Metrics, class: &str) -> Option<u64> {
        let needle = format!("dlock_operator_reconciliation_findings_total{{class=\"{class}\"}} ");
        metrics
            .encode()
            .lines()
            .find_map(|l| l.strip_prefix(needle.as_str()))
            .and_then(|v| v.trim().parse().ok())
    }

    #[test]
    fn every_class_is_exported_at_zero_and_a_run_is_counted_once() {
        let metrics = Metrics::default();
        for (class, _) in FINDING_CLASSES {
            assert_eq!(
                sample(&metrics, class),
                Some(0),
                "{class}\n{}",
                metrics.encode()
            );
        }
        let run = ReconcileSummary {
            statement: StatementCounts {
                transfers_without_payout: 2,
                released_paid_on_rail: 1,
                ..StatementCounts::default()
            },
            ..ReconcileSummary::default()
        };
        metrics.count_findings("ns/nightly", "nightly-1", &run);
        metrics.count_findings("ns/nightly", "nightly-1", &run);
        assert_eq!(sample(&metrics, "rail_transfer_without_payout"), Some(2));
        assert_eq!(sample(&metrics, "released_payout_paid_on_rail"), Some(1));
        assert_eq!(sample(&metrics, "posted_payout_not_on_rail"), Some(0));
        // The next run, and another Reconciliation's run, are counted.
        metrics.count_findings("ns/nightly", "nightly-2", &run);
        metrics.count_findings("ns/once", "nightly-2", &run);
        assert_eq!(sample(&metrics, "rail_transfer_without_payout"), Some(6));
    }
}
