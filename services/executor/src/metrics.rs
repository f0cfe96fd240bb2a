//! The executor's metrics: `payout_execute_total{outcome}` (one per lock cycle) and
//! `payout_backlog_age_seconds` (how long the oldest unsettled payout has waited: work starved,
//! not lost, when a budget is too tight). Labels are the outcome enum only.

use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use dlock_server::registry::Register;

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OutcomeLabels {
    outcome: &'static str,
}

#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    executed: Family<OutcomeLabels, Counter>,
    backlog_age: Gauge<f64, AtomicU64>,
}

impl Metrics {
    pub fn new() -> Arc<Self> {
        let mut registry = Registry::default();
        Arc::new(Self {
            executed: registry.add("payout_execute", "Payout lock cycles by outcome"),
            backlog_age: registry.add(
                "payout_backlog_age_seconds",
                "Age of the oldest payout of the batch that is not settled yet",
            ),
            registry,
        })
    }

    pub fn executed(&self, outcome: &'static str) {
        self.executed
            .get_or_create(&OutcomeLabels { outcome })
            .inc();
    }

    pub fn backlog(&self, age: Duration) {
        self.backlog_age.set(age.as_secs_f64());
    }

    pub fn encode(&self) -> String {
        dlock_server::metrics::encode(&self.registry)
    }

    /// Serves `/metrics` (and `/healthz`) on `addr` until the task is dropped.
    pub async fn serve(self: Arc<Self>, addr: std::net::SocketAddr) -> anyhow::Result<()> {
        use axum::routing::get;
        let listener = tokio::net::TcpListener::bind(addr).await?;
        let metrics = self.clone();
        let app = axum::Router::new()
            .route(
                "/metrics",
                get(move || {
                    let metrics = metrics.clone();
                    async move {
                        (
                            [(
                                axum::http::header::CONTENT_TYPE,
                                dlock_contract::http::METRICS_CONTENT_TYPE,
                            )],
                            metrics.encode(),
                        )
                    }
                }),
            )
            .route("/healthz", get(|| async { "{\"status\":\"ok\"}" }));
        dlock_server::http::serve(listener, app, std::future::pending()).await?;
        Ok(())
    }
}
