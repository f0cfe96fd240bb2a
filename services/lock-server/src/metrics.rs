//! The lock server's metrics (docs/design.md#observability): acquisition latency, contention,
//! timeouts. Labels are low-cardinality enums only; keys, owners and tokens go to logs, never to
//! labels.

use std::sync::Arc;

use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use dlock_server::metrics::GroupCommit;
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

/// What a group-committed transaction of the `pg` store runs (docs/design.md#group-commit).
#[allow(non_camel_case_types)]
#[derive(Debug, Clone, Copy, Hash, PartialEq, Eq, EncodeLabelValue)]
pub enum BatchKind {
    acquire,
    release,
}

impl dlock_server::metrics::BatchKind for BatchKind {
    const ALL: &'static [Self] = &[BatchKind::acquire, BatchKind::release];
}

/// The batches of the `pg` store: made by the store, registered with [`Metrics`]. A clone
/// counts into the same series.
pub type BatchMetrics = GroupCommit<BatchKind>;

/// The `etcd` store's refusals while etcd's revision is below the tokens already answered (etcd
/// restored to an older revision, docs/design.md#d-12-etcd): made by the store's high-water
/// (`lock.etcd.high-water.url`), registered with [`Metrics`]. A clone counts into the same
/// series. Without a high-water (or on `pg`) nothing counts them and they stay 0.
#[derive(Clone, Default)]
pub struct EtcdMetrics {
    revision_behind: Counter,
    revisions_to_go: Gauge,
}

impl EtcdMetrics {
    /// An acquire refused: etcd is at `revision`, tokens up to `high_water` were answered.
    pub fn refused(&self, revision: i64, high_water: i64) {
        self.revision_behind.inc();
        self.behind(revision, high_water);
    }

    /// etcd is at `revision`, tokens up to `high_water` were answered: the revisions etcd still
    /// has to advance before a grant is answered again.
    pub fn behind(&self, revision: i64, high_water: i64) {
        self.revisions_to_go
            .set(high_water.saturating_sub(revision).saturating_add(1).max(0));
    }

    /// A token was answered: etcd's revision is past the high-water.
    pub fn caught_up(&self) {
        self.revisions_to_go.set(0);
    }
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
    /// `batches`: the `pg` store's group commit, when it has one; `etcd`: the `etcd` store's
    /// high-water, when it has one (its series are exported at 0 otherwise, so a rule on them
    /// has them on every lock server).
    pub fn new(
        backend: Backend,
        batches: Option<BatchMetrics>,
        etcd: Option<EtcdMetrics>,
    ) -> Arc<Self> {
        let mut registry = Registry::default();
        if let Some(batches) = batches {
            batches.register(
                &mut registry,
                "lock",
                "Acquires (releases) per lockdb transaction of the pg store (1: a request alone)",
                "Acquires (releases) waiting for the lockdb transaction of their kind that runs",
            );
        }
        let etcd = etcd.unwrap_or_default();
        registry.register(
            "lock_etcd_revision_behind",
            "Acquires refused because etcd's revision went back below the tokens already \
             answered (etcd restored to an older revision; lock.etcd.high-water.url)",
            etcd.revision_behind,
        );
        registry.register(
            "lock_etcd_revisions_to_go",
            "Revisions etcd must still advance before a grant is answered again, as of the last \
             refused acquire (or the start); 0 once a token is answered",
            etcd.revisions_to_go,
        );
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
