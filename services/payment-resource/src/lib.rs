//! The dlock payment resource: payouts, accounts and the double-entry ledger
//! (docs/contract.md#s3-4, P1–P5), on paydb. This is enforcement point (a,
//! docs/design.md#enforcement-points): it trusts no lock state, only the token a request presents
//! and the fence paydb stores, and every money-moving write is one conditional write that the
//! database itself checks.
//!
//! [`app`] builds the router over a [`PayStore`]; [`run`] is what
//! `dlock serve payment-resource` calls. A replica keeps nothing in memory that decides anything,
//! so any number of them on one paydb behave as one.

pub mod config;
pub mod metrics;
pub mod openapi;
pub mod routes;
pub mod store;

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
pub use config::PaymentConfig;
pub use routes::{AppState, app};
pub use store::PayStore;

/// Opens paydb (applying its migrations first unless `payment.pg.migrate = false`).
pub async fn open_store(config: &PaymentConfig) -> anyhow::Result<PayStore> {
    PayStore::connect(&config.pg).await
}

/// Serves until SIGINT or SIGTERM. Migrations are applied before the listener opens, so a new
/// pod never serves against an old schema.
pub async fn run(config: PaymentConfig) -> anyhow::Result<()> {
    let store = open_store(&config).await?;
    let listener = config.served.bind().await?;
    let sweeper = tokio::spawn(sweep_forever(
        store.clone(),
        Duration::from_millis(config.idempotency.sweep_interval_ms),
    ));
    if config.operator_token.is_none()
        && config.served.auth.mode() == dlock_server::auth::AuthMode::None
    {
        tracing::warn!(
            event = "operator_credential_missing",
            "neither auth.mode nor payment.operator.token is set; fence advances and resolutions are refused"
        );
    }
    let state = AppState::new(store, Arc::new(config));
    tracing::info!(
        event = "payment_resource_started",
        listen = %listener.local_addr()?,
        "payment resource is serving"
    );
    let config = state.config.clone();
    let proof_keys = config.proof_keys.as_ref();
    (config.served)
        .serve(
            "payment-resource",
            proof_keys,
            listener,
            app(state),
            sweeper,
        )
        .await
        .context("the HTTP server failed")?;
    tracing::info!(
        event = "payment_resource_stopped",
        "payment resource stopped"
    );
    Ok(())
}

/// Deletes expired idempotency records on a fixed interval (docs/design.md#idempotency: expiry is
/// a sweep, not a lazy surprise). A failed sweep is retried on the next tick.
pub async fn sweep_forever(store: PayStore, every: Duration) {
    let log = dlock_server::sweep::SweepLog {
        swept: "idempotency_sweep",
        swept_says: "swept expired idempotency records",
        failed: "idempotency_sweep_failed",
        failed_says: "sweeping expired idempotency records failed; it is retried on the next tick",
    };
    dlock_server::sweep::forever(every, log, move || {
        let store = store.clone();
        async move { store.sweep().await }
    })
    .await
}
