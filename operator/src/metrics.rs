//! The operator's own Prometheus metrics. Labels are low-cardinality enums only (kind, outcome),
//! never object names.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;

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
        let reconciles = Family::<ReconcileLabels, Counter>::default();
        let revocations = Family::<ReconcileLabels, Counter>::default();
        registry.register(
            "reconcile",
            "Reconciles by kind and outcome (ok, error, paused)",
            reconciles.clone(),
        );
        registry.register(
            "revocation",
            "Forced revocations by kind and outcome (Complete, Incomplete, Refused)",
            revocations.clone(),
        );
        Self {
            registry,
            reconciles,
            revocations,
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
        let mut text = String::new();
        if prometheus_client::encoding::text::encode(&mut text, &self.registry).is_err() {
            text.clear();
        }
        text
    }
}
