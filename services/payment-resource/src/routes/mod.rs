//! The HTTP surface: P1–P5, the writes around them (docs/contract.md#extensions) and the health
//! endpoints.
//!
//! Every write follows one shape: validate everything (nothing is written for bad input), open
//! the transaction and claim the idempotency record in it, run the effect (one paydb function),
//! store the answer in the same transaction, commit, and send exactly the stored bytes.

mod accounts;
mod checks;
mod cursor;
mod errors;
mod fundings;
mod idempotency;
mod ledger;
mod payouts;
mod treasury;

use std::sync::Arc;

use axum::Router;
use axum::extract::State;
use axum::response::Response;
use dlock_contract::error::ErrorCode;
use dlock_server::openapi::NotLeader;
use serde_json::json;
use utoipa::OpenApi;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use crate::config::PaymentConfig;
use crate::metrics::Metrics;
use crate::store::PayStore;
pub use idempotency::Reply;

#[derive(Clone)]
pub struct AppState {
    pub store: PayStore,
    pub config: Arc<PaymentConfig>,
    pub metrics: Arc<Metrics>,
    /// The group-commit queues of claims and posts (docs/design.md#group-commit).
    batches: Arc<payouts::Batches>,
}

impl AppState {
    pub fn new(store: PayStore, config: Arc<PaymentConfig>) -> Self {
        let metrics = Metrics::new();
        Self {
            batches: Arc::new(payouts::Batches::new(config.batch_max, &metrics)),
            store,
            config,
            metrics,
        }
    }
}

/// The payment resource's own routes (the batches, `/healthz`, `/metrics` and the document are
/// added by `dlock_server::http`), each with its operation (`#[utoipa::path]` on its handler):
/// [`app`] serves them, and the document ([`crate::openapi::document`]) is made of their
/// operations.
pub(crate) fn routes() -> OpenApiRouter<AppState> {
    OpenApiRouter::with_openapi(crate::openapi::ApiDoc::openapi())
        .routes(routes!(accounts::create_account))
        .routes(routes!(accounts::get_account))
        .routes(routes!(ledger::fund))
        .routes(routes!(treasury::set_limits))
        .routes(routes!(fundings::list_fundings))
        .routes(routes!(treasury::approve_funding))
        .routes(routes!(accounts::advance_fence))
        .routes(routes!(accounts::lower_fence))
        .routes(routes!(payouts::create_payout, payouts::list_payouts))
        .routes(routes!(payouts::get_payout))
        .routes(routes!(payouts::claim))
        .routes(routes!(ledger::post_payout))
        .routes(routes!(payouts::resolve))
        .routes(routes!(payouts::cancel))
        .routes(routes!(readyz))
}

pub fn app(state: AppState) -> Router {
    dlock_server::service_app(routes(), state, &crate::openapi::BATCHES)
}

// ---------------------------------------------------------------------------------------------
// Health and metrics
// ---------------------------------------------------------------------------------------------

/// paydb takes writes.
#[utoipa::path(get, path = "/readyz", responses((status = 200, body = serde_json::Value), NotLeader))]
async fn readyz(State(state): State<AppState>) -> Response {
    let check = state.store.ready().await;
    dlock_server::http::readiness(
        check,
        json!({ "status": "ready" }),
        ErrorCode::NotLeader,
        "paydb",
    )
}

impl dlock_server::ServiceState for AppState {
    fn served(&self) -> &dlock_server::http::Served {
        &self.config.served
    }

    fn metrics_text(&self) -> String {
        self.metrics.encode()
    }
}
