//! The payment resource's metrics (docs/design.md#observability): `lock_fenced_out{resource}`
//! (docs/contract.md#fenced-out-details) and the idempotency hit ratio, key conflicts and
//! in-progress timeouts. Labels are low-cardinality enums only; payout ids, keys and owners go to
//! logs, never to labels.

use std::sync::Arc;

use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use dlock_server::metrics::FencedOut;
pub use dlock_server::metrics::Resource;
use dlock_server::registry::Register;

// Variant names are the label values, hence lower case.
#[allow(non_camel_case_types)]
#[derive(Debug, Clone, Copy, Hash, PartialEq, Eq, EncodeLabelValue)]
pub enum Lookup {
    /// A finished record answered the request (replay).
    hit,
    /// No record: the request ran its effect.
    miss,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct LookupLabels {
    pub outcome: Lookup,
}

/// The writes that are group-committed (docs/design.md#group-commit).
#[allow(non_camel_case_types)]
#[derive(Debug, Clone, Copy, Hash, PartialEq, Eq, EncodeLabelValue)]
pub enum BatchKind {
    claim,
    post,
    /// P4 reads, grouped into one statement the same way.
    read,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct BatchLabels {
    pub kind: BatchKind,
}

/// Buckets 1, 2, 4, … 256: the batch sizes `payment.batch.max` allows.
fn batch_histogram() -> Histogram {
    Histogram::new(exponential_buckets(1.0, 2.0, 9))
}

pub struct Metrics {
    pub registry: Registry,
    fenced_out: FencedOut,
    lookups: Family<LookupLabels, Counter>,
    conflicts: Counter,
    in_progress_timeouts: Counter,
    batch_size: Family<BatchLabels, Histogram, fn() -> Histogram>,
    batch_queued: Family<BatchLabels, Gauge>,
}

impl Metrics {
    pub fn new() -> Arc<Self> {
        let mut registry = Registry::default();
        let metrics = Self {
            fenced_out: FencedOut::register(
                &mut registry,
                "Writes refused because a newer holder's token was stored; each one is incident-grade",
            ),
            lookups: registry.add(
                "idempotency_lookups",
                "Idempotent writes by whether a stored answer replayed them (hit) or they ran (miss)",
            ),
            conflicts: registry.add(
                "idempotency_key_conflicts",
                "Writes that re-used a key and token with a different body",
            ),
            in_progress_timeouts: registry.add(
                "idempotency_in_progress_timeouts",
                "Duplicates that stopped waiting for the identical request still in progress",
            ),
            batch_size: registry.add_made(
                "payment_batch_size",
                "Requests per transaction of the claims and posts, and per statement of the payout reads (1: a request alone)",
                Family::new_with_constructor(batch_histogram as fn() -> Histogram),
            ),
            batch_queued: registry.add(
                "payment_batch_queued",
                "Claims, posts and payout reads waiting for the transaction (statement) of their kind that runs",
            ),
            registry,
        };
        for kind in [BatchKind::claim, BatchKind::post, BatchKind::read] {
            let _ = metrics.batch_size.get_or_create(&BatchLabels { kind });
            let _ = metrics.batch_queued.get_or_create(&BatchLabels { kind });
        }
        // Every label value exists from the start, so a dashboard shows 0 rather than nothing.
        for outcome in [Lookup::hit, Lookup::miss] {
            let _ = metrics.lookups.get_or_create(&LookupLabels { outcome });
        }
        Arc::new(metrics)
    }

    pub fn fenced_out(&self, resource: Resource) {
        self.fenced_out.inc(resource);
    }

    pub fn lookup(&self, outcome: Lookup) {
        self.lookups.get_or_create(&LookupLabels { outcome }).inc();
    }

    pub fn conflict(&self) {
        self.conflicts.inc();
    }

    pub fn in_progress_timeout(&self) {
        self.in_progress_timeouts.inc();
    }

    /// One transaction of `kind` ran `size` requests.
    pub fn batch(&self, kind: BatchKind, size: usize) {
        self.batch_size
            .get_or_create(&BatchLabels { kind })
            .observe(size as f64);
    }

    /// `queued` requests of `kind` wait for the next transaction.
    pub fn queued(&self, kind: BatchKind, queued: usize) {
        self.batch_queued
            .get_or_create(&BatchLabels { kind })
            .set(queued as i64);
    }

    pub fn encode(&self) -> String {
        dlock_server::metrics::encode(&self.registry)
    }
}
