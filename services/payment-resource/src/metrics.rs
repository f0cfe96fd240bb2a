//! The payment resource's metrics (docs/design.md#observability): `lock_fenced_out{resource}`
//! (docs/contract.md#fenced-out-details) and the idempotency hit ratio, key conflicts and
//! in-progress timeouts. Labels are low-cardinality enums only; payout ids, keys and owners go to
//! logs, never to labels.

use std::sync::Arc;

use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;

pub use dlock_server::metrics::Resource;
use dlock_server::metrics::{FencedOut, GroupCommit};
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
    /// Registrations (`POST /v1/payouts`).
    register,
    claim,
    post,
    /// P4 reads, grouped into one statement the same way.
    read,
}

impl dlock_server::metrics::BatchKind for BatchKind {
    const ALL: &'static [Self] = &[
        BatchKind::register,
        BatchKind::claim,
        BatchKind::post,
        BatchKind::read,
    ];
}

pub struct Metrics {
    pub registry: Registry,
    fenced_out: FencedOut,
    lookups: Family<LookupLabels, Counter>,
    conflicts: Counter,
    in_progress_timeouts: Counter,
    batches: GroupCommit<BatchKind>,
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
            batches: GroupCommit::registered(
                &mut registry,
                "payment",
                "Requests per transaction of the claims and posts, and per statement of the payout reads (1: a request alone)",
                "Claims, posts and payout reads waiting for the transaction (statement) of their kind that runs",
            ),
            registry,
        };
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
        self.batches.batch(kind, size);
    }

    /// `queued` requests of `kind` wait for the next transaction.
    pub fn queued(&self, kind: BatchKind, queued: usize) {
        self.batches.queued(kind, queued);
    }

    pub fn encode(&self) -> String {
        dlock_server::metrics::encode(&self.registry)
    }
}
