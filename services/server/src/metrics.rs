//! What every service's `/metrics` shares.

use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
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

/// A label value that names one kind of a group commit's batches (docs/design.md#group-commit).
pub trait BatchKind:
    EncodeLabelValue + Copy + std::hash::Hash + Eq + std::fmt::Debug + Send + Sync + 'static
{
    /// Every kind, each exported from the start so a dashboard shows 0 rather than nothing.
    const ALL: &'static [Self];
}

/// The labels of a group commit's series: `{kind}`.
type KindLabels<K> = [(&'static str, K); 1];

/// A group commit's two series (docs/design.md#group-commit): `<prefix>_batch_size{kind}`, the
/// requests one transaction ran (buckets 1, 2, 4, … 256, what every `batch.max` allows), and
/// `<prefix>_batch_queued{kind}`, the requests waiting for the next one. Every kind exists from
/// the start. A clone counts into the same series.
#[derive(Clone, Debug)]
pub struct GroupCommit<K: BatchKind> {
    size: Family<KindLabels<K>, Histogram, fn() -> Histogram>,
    queued: Family<KindLabels<K>, Gauge>,
}

fn batch_histogram() -> Histogram {
    Histogram::new(exponential_buckets(1.0, 2.0, 9))
}

impl<K: BatchKind> Default for GroupCommit<K> {
    fn default() -> Self {
        let metrics = Self {
            size: Family::new_with_constructor(batch_histogram as fn() -> Histogram),
            queued: Family::default(),
        };
        for &kind in K::ALL {
            let _ = metrics.size.get_or_create(&[("kind", kind)]);
            let _ = metrics.queued.get_or_create(&[("kind", kind)]);
        }
        metrics
    }
}

impl<K: BatchKind> GroupCommit<K> {
    /// New series, registered as `<prefix>_batch_size` and `<prefix>_batch_queued`.
    pub fn registered(registry: &mut Registry, prefix: &str, size: &str, queued: &str) -> Self {
        let metrics = Self::default();
        metrics.register(registry, prefix, size, queued);
        metrics
    }

    /// Registers these series as `<prefix>_batch_size` (help `size`) and `<prefix>_batch_queued`
    /// (help `queued`).
    pub fn register(&self, registry: &mut Registry, prefix: &str, size: &str, queued: &str) {
        registry.register(format!("{prefix}_batch_size"), size, self.size.clone());
        registry.register(
            format!("{prefix}_batch_queued"),
            queued,
            self.queued.clone(),
        );
    }

    /// One transaction of `kind` ran `size` requests.
    pub fn batch(&self, kind: K, size: usize) {
        self.size
            .get_or_create(&[("kind", kind)])
            .observe(size as f64);
    }

    /// `queued` requests of `kind` wait for the next transaction.
    pub fn queued(&self, kind: K, queued: usize) {
        self.queued
            .get_or_create(&[("kind", kind)])
            .set(queued as i64);
    }
}
