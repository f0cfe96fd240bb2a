//! What only the dlock services need; the clients' side, and everything on the wire, is
//! `dlock-contract`. A client (the executor, the operator, the CLI) has no use for any of this.

pub mod auth;
pub mod batch;
pub mod checks;
pub mod config;
pub mod extract;
/// The group-commit queue lives in the contract crate, which its clients share
/// (services/contract/src/group_commit.rs); re-exported for the services.
pub use dlock_contract::group_commit;
pub mod http;
pub mod idempotency;
pub mod metrics;
pub mod openapi;
pub mod pg;
pub mod proof;
pub mod registry;
pub mod squash;
pub mod sweep;
pub mod tls;
pub mod trace;
pub mod warm;
pub mod watch;

/// Logs, once at start, what a service checks: its callers' credentials and, where it has them,
/// fencing proofs.
pub fn announce(service: &str, auth: &auth::Authenticator, proof_keys: Option<&proof::ProofKeys>) {
    auth.announce(service);
    proof::announce(proof_keys, service);
}

/// A service's state as [`service_app`] needs it: how the service is served and its metrics.
pub trait ServiceState: Clone + Send + Sync + 'static {
    /// The service's `server.*` and `auth.*`.
    fn served(&self) -> &http::Served;
    /// The service's metrics in the OpenMetrics text format, what `GET /metrics` answers.
    fn metrics_text(&self) -> String;
}

/// A service's router: its `routes` through [`http::Served::app`] with the state's own
/// [`http::Served`], `GET /metrics` answering [`ServiceState::metrics_text`].
pub fn service_app<S: ServiceState>(
    routes: utoipa_axum::router::OpenApiRouter<S>,
    state: S,
    batches: &openapi::BatchEndpoints,
) -> axum::Router {
    state
        .served()
        .app(routes, state.clone(), batches, metrics::<S>)
}

async fn metrics<S: ServiceState>(
    axum::extract::State(state): axum::extract::State<S>,
) -> axum::response::Response {
    http::metrics_response(state.metrics_text())
}
