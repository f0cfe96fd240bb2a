//! The lock server's metrics (docs/design.md#observability): acquisition latency, contention,
//! timeouts. Labels are low-cardinality enums only; keys, owners and tokens go to logs, never to
//! labels.

use std::sync::Arc;

use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use dlock_server::registry::Register;

// Variant names are the label values, hence lower case.
#[allow(non_camel_case_types)]
#[derive(Debug, Clone, Copy, Hash, PartialEq, Eq, EncodeLabelValue)]
pub enum Backend {
    pg,
    etcd,
}

#[allow(non_camel_case_types)]
#[derive(Debug, Clone, Copy, Hash, PartialEq, Eq, EncodeLabelValue)]
pub enum AcquireOutcome {
    granted,
    contended,
    queue_full,
    timeout,
    error,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct AcquireLabels {
    pub backend: Backend,
    pub outcome: AcquireOutcome,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct BackendLabels {
    pub backend: Backend,
}

pub struct Metrics {
    pub backend: Backend,
    pub registry: Registry,
    acquire_latency: Family<AcquireLabels, Histogram, fn() -> Histogram>,
    contention: Family<BackendLabels, Counter>,
    timeouts: Family<BackendLabels, Counter>,
    revocations: Family<BackendLabels, Counter>,
}

fn latency_histogram() -> Histogram {
    // 0.25 ms to about 8 s.
    Histogram::new(exponential_buckets(0.000_25, 2.0, 16))
}

impl Metrics {
    pub fn new(backend: Backend) -> Arc<Self> {
        let mut registry = Registry::default();
        let metrics = Self {
            backend,
            acquire_latency: registry.add_made(
                "lock_acquisition_latency_seconds",
                "Time from receiving an acquire to answering it, by outcome",
                Family::new_with_constructor(latency_histogram),
            ),
            contention: registry.add(
                "lock_contention",
                "Acquires that found the key held or the queue ahead of them",
            ),
            timeouts: registry.add(
                "lock_timeouts",
                "Acquires whose server-side wait ended without the lock",
            ),
            revocations: registry.add(
                "lock_revocations",
                "Forced revocations that ended a grant and advanced the token",
            ),
            registry,
        };
        // The counters exist from the start at 0, so the first contention or timeout is an
        // increase a rule can see (a series born at 1 has no increase).
        for family in [&metrics.contention, &metrics.timeouts, &metrics.revocations] {
            let _ = family.get_or_create(&BackendLabels { backend });
        }
        Arc::new(metrics)
    }

    pub fn observe_acquire(&self, outcome: AcquireOutcome, seconds: f64) {
        self.acquire_latency
            .get_or_create(&AcquireLabels {
                backend: self.backend,
                outcome,
            })
            .observe(seconds);
        let labels = BackendLabels {
            backend: self.backend,
        };
        match outcome {
            AcquireOutcome::contended | AcquireOutcome::queue_full => {
                self.contention.get_or_create(&labels).inc();
            }
            AcquireOutcome::timeout => {
                self.contention.get_or_create(&labels).inc();
                self.timeouts.get_or_create(&labels).inc();
            }
            AcquireOutcome::granted | AcquireOutcome::error => {}
        }
    }

    pub fn revoked(&self) {
        self.revocations
            .get_or_create(&BackendLabels {
                backend: self.backend,
            })
            .inc();
    }

    pub fn encode(&self) -> String {
        dlock_server::metrics::encode(&self.registry)
    }
}
