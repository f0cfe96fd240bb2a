//! The operator's own Prometheus metrics. Labels are low-cardinality enums only (kind, outcome),
//! never object names.

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

pub struct Metrics {
    pub registry: Registry,
    pub reconciles: Family<ReconcileLabels, Counter>,
    pub revocations: Family<ReconcileLabels, Counter>,
}

impl Default for Metrics {
    fn default() -> Self {
        let mut registry = Registry::with_prefix("dlock_operator");
        Self {
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

    pub fn encode(&self) -> String {
        dlock_server::metrics::encode(&self.registry)
    }
}
