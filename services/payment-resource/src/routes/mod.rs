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
use axum::routing::{get, post};
use dlock_contract::error::ErrorCode;
use dlock_contract::payment::{CreateAccountRequest, CreatePayoutRequest};
use serde_json::json;

use crate::config::PaymentConfig;
use crate::metrics::Metrics;
use crate::openapi::document;
use crate::store::PayStore;
use accounts::{advance_fence, get_account, lower_fence};
use idempotency::create;
pub use idempotency::{REPLAY_HEADER, Reply};
use ledger::{fund, post_payout};
use payouts::{cancel, claim, get_payout, list_payouts, resolve};

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

pub fn app(state: AppState) -> Router {
    let routes = Router::new()
        .route("/v1/accounts", post(create::<CreateAccountRequest>))
        .route("/v1/accounts/{account_id}", get(get_account))
        .route("/v1/accounts/{account_id}/fund", post(fund))
        .route(
            "/v1/accounts/{account_id}/limits",
            post(treasury::set_limits),
        )
        .route("/v1/fundings", get(fundings::list_fundings))
        .route(
            "/v1/fundings/{funding_id}/approve",
            post(treasury::approve_funding),
        )
        .route("/v1/accounts/{account_id}/fence", post(advance_fence))
        .route("/v1/accounts/{account_id}/fence/lower", post(lower_fence))
        .route(
            "/v1/payouts",
            post(create::<CreatePayoutRequest>).get(list_payouts),
        )
        .route("/v1/payouts/{payout_id}", get(get_payout))
        .route("/v1/payouts/{payout_id}/claim", post(claim))
        .route("/v1/payouts/{payout_id}/post", post(post_payout))
        .route("/v1/payouts/{payout_id}/resolve", post(resolve))
        .route("/v1/payouts/{payout_id}/cancel", post(cancel));
    let config = state.config.clone();
    config.served.app(
        routes,
        state,
        &[
            dlock_server::batch::route::<dlock_contract::batch::ClaimItem>,
            dlock_server::batch::route::<dlock_contract::batch::PostItem>,
        ],
        document,
        readyz,
        metrics,
    )
}

// ---------------------------------------------------------------------------------------------
// Health and metrics
// ---------------------------------------------------------------------------------------------

async fn readyz(State(state): State<AppState>) -> Response {
    let check = state.store.ready().await;
    dlock_server::http::readiness(
        check,
        json!({ "status": "ready" }),
        ErrorCode::NotLeader,
        "paydb",
    )
}

async fn metrics(State(state): State<AppState>) -> Response {
    dlock_server::http::metrics_response(state.metrics.encode())
}
