//! The rail proxy's metrics: `rail_submission{outcome}`, `rail_duplicate_attempted`,
//! `lock_fenced_out{resource}`, `rail_batch_size{kind}` and `rail_batch_queued{kind}` (group
//! commit), and the RAIL_AMBIGUOUS payouts waiting for an operator
//! (`payout_ambiguous`, `payout_ambiguous_oldest_age_seconds`, read from paydb at each scrape).
//! Labels are enums; ids go to logs.

use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::Duration;

use dlock_server::metrics::{FencedOut, GroupCommit, Resource};
use dlock_server::registry::Register;
use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use sqlx::PgPool;

// Variant names are the label values, hence lower case.
#[allow(non_camel_case_types)]
#[derive(Debug, Clone, Copy, Hash, PartialEq, Eq, EncodeLabelValue)]
pub enum SubmissionOutcome {
    acked,
    fenced,
    timeout,
    rejected,
}

/// What a group commit batches (docs/design.md#group-commit).
#[allow(non_camel_case_types)]
#[derive(Debug, Clone, Copy, Hash, PartialEq, Eq, EncodeLabelValue)]
pub enum BatchKind {
    /// `rail_admit`: the intent row and the mark, before the forward.
    admit,
    /// `rail_record`: the rail's answer, after the forward.
    record,
}

impl dlock_server::metrics::BatchKind for BatchKind {
    const ALL: &'static [Self] = &[BatchKind::admit, BatchKind::record];
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OutcomeLabels {
    outcome: SubmissionOutcome,
}

pub struct Metrics {
    registry: Registry,
    submissions: Family<OutcomeLabels, Counter>,
    duplicates: Counter,
    fenced: FencedOut,
    ambiguous: Gauge,
    ambiguous_oldest_age: Gauge<f64, AtomicU64>,
    batches: GroupCommit<BatchKind>,
}

impl Metrics {
    pub fn new() -> Arc<Self> {
        let mut registry = Registry::default();
        Arc::new(Self {
            submissions: registry.add("rail_submission", "Rail submissions by outcome"),
            duplicates: registry.add(
                "rail_duplicate_attempted",
                "Second submissions of a payout, refused (each one pages)",
            ),
            fenced: FencedOut::register(
                &mut registry,
                "Writes refused because a newer token holds the resource",
            ),
            ambiguous: registry.add(
                "payout_ambiguous",
                "Payouts in RAIL_AMBIGUOUS, waiting for an operator to resolve them from the rail statement",
            ),
            ambiguous_oldest_age: registry.add(
                "payout_ambiguous_oldest_age_seconds",
                "Time since the oldest RAIL_AMBIGUOUS payout became ambiguous (0 when there is none)",
            ),
            batches: GroupCommit::registered(
                &mut registry,
                "rail",
                "Submissions per paydb transaction of their kind (1: a submission alone)",
                "Submissions waiting for the paydb transaction of their kind that runs",
            ),
            registry,
        })
    }

    /// One transaction of `kind` ran `size` submissions.
    pub fn batch(&self, kind: BatchKind, size: usize) {
        self.batches.batch(kind, size);
    }

    /// `queued` submissions of `kind` wait for the next transaction.
    pub fn queued(&self, kind: BatchKind, queued: usize) {
        self.batches.queued(kind, queued);
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
        self.fenced.inc(resource);
    }

    /// Reads the RAIL_AMBIGUOUS payouts from paydb (an index range on `payouts (state, …)`).
    /// On failure the previous values stay and the failure is logged: `/readyz` reports paydb.
    pub async fn refresh_ambiguous(&self, pool: &PgPool) {
        let query = sqlx::query_as::<_, (i64, f64)>(
            "SELECT count(*), COALESCE(EXTRACT(EPOCH FROM clock_timestamp() - min(updated_at)), 0)::float8 \
             FROM payouts WHERE state = 'RAIL_AMBIGUOUS'",
        )
        .fetch_one(pool);
        match tokio::time::timeout(Duration::from_secs(2), query).await {
            Ok(Ok((count, age))) => {
                self.ambiguous.set(count);
                self.ambiguous_oldest_age.set(age.max(0.0));
            }
            Ok(Err(error)) => {
                tracing::warn!(event = "metrics_ambiguous_failed", %error, "counting RAIL_AMBIGUOUS payouts failed; payout_ambiguous keeps its last value until paydb answers");
            }
            Err(_) => {
                tracing::warn!(
                    event = "metrics_ambiguous_failed",
                    "counting RAIL_AMBIGUOUS payouts took over 2 s; payout_ambiguous keeps its last value until paydb answers"
                );
            }
        }
    }

    pub fn encode(&self) -> String {
        dlock_server::metrics::encode(&self.registry)
    }
}
