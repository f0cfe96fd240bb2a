//! The HTTP surface L1–L8, the held-locks list and the health endpoints: sessions, locks (acquire
//! with its waiting, renew, release, reads), revoke, each handler extract → store → map.

mod acquire;
mod checks;
mod errors;
mod locks;
mod revoke;
mod sessions;

use std::hash::{Hash, Hasher};
use std::sync::Arc;

use axum::Router;
use axum::extract::State;
use axum::response::Response;
use dlock_contract::error::ErrorCode;
use dlock_contract::lock::LockGrant;
use dlock_server::openapi::NotLeader;
use serde_json::json;
use tokio::sync::Notify;
use utoipa::OpenApi;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use crate::config::LockServerConfig;
use crate::metrics::{Backend, Metrics};
use crate::store::Store;

pub use locks::HELD_LIMIT_MAX;

/// Wake-ups for waiters on this replica; waiters on other replicas find out by polling.
/// Keys share buckets, so a wake-up may be spurious; the waiter just tries again.
const WAKE_BUCKETS: usize = 64;

#[derive(Clone)]
pub struct AppState {
    pub store: Store,
    pub config: Arc<LockServerConfig>,
    pub metrics: Arc<Metrics>,
    wake: Arc<Vec<Notify>>,
}

impl AppState {
    pub fn new(store: Store, config: Arc<LockServerConfig>) -> Self {
        let backend = match store {
            Store::Pg(_) => Backend::pg,
            Store::Etcd(_) => Backend::etcd,
        };
        let metrics = Metrics::new(backend, store.batch_metrics(), store.etcd_metrics());
        Self {
            store,
            config,
            metrics,
            wake: Arc::new((0..WAKE_BUCKETS).map(|_| Notify::new()).collect()),
        }
    }

    fn bucket(&self, key: &str) -> &Notify {
        let mut hasher = std::collections::hash_map::DefaultHasher::new();
        key.hash(&mut hasher);
        &self.wake[(hasher.finish() as usize) % WAKE_BUCKETS]
    }

    fn wake(&self, key: &str) {
        self.bucket(key).notify_waiters();
    }

    /// The grant as it is answered (L4, L5): with the proof of (key, token) when this server
    /// has proof keys. This is the only place a proof is made; lists and L7 never carry one.
    fn proven(&self, mut grant: LockGrant) -> LockGrant {
        grant.fencing_proof = self
            .config
            .proof_keys
            .as_ref()
            .and_then(|keys| keys.sign(&grant.key, grant.fencing_token));
        grant
    }
}

/// The lock server's own routes (the batches, `/healthz`, `/metrics` and the document are added by
/// `dlock_server::http`), each with its operation (`#[utoipa::path]` on its handler): [`app`]
/// serves them, and the document ([`crate::openapi::document`]) is made of their operations.
pub(crate) fn routes() -> OpenApiRouter<AppState> {
    OpenApiRouter::with_openapi(crate::openapi::ApiDoc::openapi())
        .routes(routes!(sessions::create_session))
        .routes(routes!(sessions::heartbeat))
        .routes(routes!(sessions::end_session))
        .routes(routes!(locks::held_locks))
        .routes(routes!(acquire::acquire))
        .routes(routes!(locks::renew))
        .routes(routes!(revoke::revoke))
        .routes(routes!(locks::lock_info, locks::release))
        .routes(routes!(readyz))
}

pub fn app(state: AppState) -> Router {
    dlock_server::service_app(routes(), state, &crate::openapi::BATCHES)
}

/// The backend takes writes.
#[utoipa::path(get, path = "/readyz", responses((status = 200, body = serde_json::Value), NotLeader))]
async fn readyz(State(state): State<AppState>) -> Response {
    let ready = json!({ "status": "ready", "backend": state.store.backend_name() });
    let check = state.store.ready().await;
    dlock_server::http::readiness(check, ready, ErrorCode::NotLeader, "the backend")
}

impl dlock_server::ServiceState for AppState {
    fn served(&self) -> &dlock_server::http::Served {
        &self.config.served
    }

    fn metrics_text(&self) -> String {
        self.metrics.encode()
    }
}
