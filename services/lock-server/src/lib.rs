//! The dlock lock server: sessions, leases and fencing tokens (docs/contract.md#s3-3), on
//! PostgreSQL or etcd.
//!
//! [`app`] builds the router over a [`Store`]; [`run`] is what `dlock serve lock-server` calls.
//! A replica keeps nothing in memory that decides who holds a lock: the waiter queue, the grants
//! and the token sequence all live in the backend, so two replicas behave as one.

pub mod config;
pub mod metrics;
pub mod openapi;
pub mod routes;
pub mod store;

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use config::BackendSettings;
pub use config::LockServerConfig;
pub use routes::{AppState, app};
pub use store::Store;

/// Opens the configured backend (applying lockdb migrations first for `pg`).
pub async fn open_store(config: &LockServerConfig) -> anyhow::Result<Store> {
    Ok(match &config.backend {
        BackendSettings::Pg(pg) => {
            Store::Pg(store::pg::PgStore::connect(pg, config.pg_batch_max).await?)
        }
        BackendSettings::Etcd(etcd) => Store::Etcd(Box::new(
            store::etcd::EtcdStore::connect(etcd, config.expired_session_retention_ms).await?,
        )),
    })
}

/// Serves until SIGINT or SIGTERM. Migrations are applied before the listener opens, so a new
/// pod never serves against an old schema.
pub async fn run(config: LockServerConfig) -> anyhow::Result<()> {
    let store = open_store(&config).await?;
    let listener = config.served.bind().await?;
    let state = AppState::new(store.clone(), Arc::new(config.clone()));
    let retention = store::SweepRetention {
        expired_sessions_ms: config.expired_session_retention_ms,
        keys_seen_ms: config.keys_seen_retention_ms,
    };
    let sweeper = tokio::spawn(dlock_server::sweep::forever(
        Duration::from_millis(config.sweep_interval_ms),
        SWEEP_LOG,
        move || {
            let store = store.clone();
            async move { store.sweep(&retention).await }
        },
    ));
    tracing::info!(
        event = "lock_server_started",
        listen = %listener.local_addr()?,
        backend = config.backend_name(),
        tls = config.served.tls.is_some(),
        "lock server is serving"
    );
    let proof_keys = config.proof_keys.as_ref();
    (config.served)
        .serve("lock-server", proof_keys, listener, app(state), sweeper)
        .await
        .context("the HTTP server failed")?;
    tracing::info!(event = "lock_server_stopped", "lock server stopped");
    Ok(())
}

const SWEEP_LOG: dlock_server::sweep::SweepLog = dlock_server::sweep::SweepLog {
    swept: "lock_sweep",
    swept_says: "swept lapsed rows and keys past lock.keys-seen.retention",
    failed: "lock_sweep_failed",
    failed_says: "sweeping lapsed locks failed; it is retried on the next tick",
};
