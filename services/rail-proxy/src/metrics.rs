//! The rail proxy's metrics: `rail_submission{outcome}`, `rail_duplicate_attempted`,
//! `lock_fenced_out{resource}`. Labels are enums; ids go to logs.

use std::sync::Arc;

use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;

// Variant names are the label values, hence lower case.
#[allow(non_camel_case_types)]
#[derive(Debug, Clone, Copy, Hash, PartialEq, Eq, EncodeLabelValue)]
pub enum SubmissionOutcome {
    acked,
    fenced,
    timeout,
    rejected,
}

#[allow(non_camel_case_types)]
#[derive(Debug, Clone, Copy, Hash, PartialEq, Eq, EncodeLabelValue)]
pub enum Resource {
    account,
    ledger,
    rail,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OutcomeLabels {
    outcome: SubmissionOutcome,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ResourceLabels {
    resource: Resource,
}

pub struct Metrics {
    registry: Registry,
    submissions: Family<OutcomeLabels, Counter>,
    duplicates: Counter,
    fenced: Family<ResourceLabels, Counter>,
}

impl Metrics {
    pub fn new() -> Arc<Self> {
        let mut registry = Registry::default();
        let submissions = Family::<OutcomeLabels, Counter>::default();
        let duplicates = Counter::default();
        let fenced = Family::<ResourceLabels, Counter>::default();
        registry.register(
            "rail_submission",
            "Rail submissions by outcome",
            submissions.clone(),
        );
        registry.register(
            "rail_duplicate_attempted",
            "Second submissions of a payout, refused (each one pages)",
            duplicates.clone(),
        );
        registry.register(
            "lock_fenced_out",
            "Writes refused because a newer token holds the resource",
            fenced.clone(),
        );
        Arc::new(Self {
            registry,
            submissions,
            duplicates,
            fenced,
        })
    }

    pub fn submission(&self, outcome: SubmissionOutcome) {
        self.submissions
            .get_or_create(&OutcomeLabels { outcome })
            .inc();
    }

    pub fn duplicate_attempted(&self) {
        self.duplicates.inc();
    }

    pub fn fenced_out(&self, resource: &str) {
        let resource = match resource {
            "account" => Resource::account,
            "ledger" => Resource::ledger,
            _ => Resource::rail,
        };
        self.fenced
            .get_or_create(&ResourceLabels { resource })
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
