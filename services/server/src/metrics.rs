//! What every service's `/metrics` shares.

use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;

/// The registry in the OpenMetrics text format (empty if it cannot be encoded).
pub fn encode(registry: &Registry) -> String {
    let mut text = String::new();
    if prometheus_client::encoding::text::encode(&mut text, registry).is_err() {
        text.clear();
    }
    text
}

/// The resource a fenced-out write hit. The same three values as the `resourceType` of the
/// FENCED_OUT body and the `resource` field of the `fenced_out` log event.
// Variant names are the label values, hence lower case.
#[allow(non_camel_case_types)]
#[derive(Debug, Clone, Copy, Hash, PartialEq, Eq, EncodeLabelValue)]
pub enum Resource {
    account,
    ledger,
    rail,
}

impl Resource {
    pub const ALL: [Resource; 3] = [Resource::account, Resource::ledger, Resource::rail];

    pub fn as_str(self) -> &'static str {
        match self {
            Resource::account => "account",
            Resource::ledger => "ledger",
            Resource::rail => "rail",
        }
    }
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ResourceLabels {
    resource: Resource,
}

/// `lock_fenced_out{resource}` (docs/design.md#observability): writes refused because a newer token
/// holds the resource. Every series exists from the start at 0, so the first fence-out is an
/// increase a rule can see (a series born at 1 has no increase).
#[derive(Clone, Default)]
pub struct FencedOut(Family<ResourceLabels, Counter>);

impl FencedOut {
    /// Registers the counter under `help`, each series at 0.
    pub fn register(registry: &mut Registry, help: &str) -> Self {
        let counter = Self::default();
        registry.register("lock_fenced_out", help, counter.0.clone());
        for resource in Resource::ALL {
            let _ = counter.0.get_or_create(&ResourceLabels { resource });
        }
        counter
    }

    pub fn inc(&self, resource: Resource) {
        self.0.get_or_create(&ResourceLabels { resource }).inc();
    }
}
