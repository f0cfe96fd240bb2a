//! The rail proxy's OpenAPI document (docs/contract.md#s3-5), served at `GET /v1/openapi.json`.
//! Each route's operation is declared once, on its handler (`admission.rs`, `high_water.rs`,
//! `lib.rs`: `#[utoipa::path]`), and collected from the router (`crate::routes`); below are the
//! document's own parts and the batch, whose route `dlock_server::batch` adds for its step.
//! `scripts/check-openapi` checks that the committed `docs/openapi/rail-proxy.json` is this
//! document.

// The batches' stand-in functions and the types below only document.
#![allow(dead_code)]

use dlock_contract::batch::{BatchAnswer, BatchRequest, Item, SubmitItem};
use dlock_contract::openapi::BearerAuth;
use dlock_server::openapi::{BatchEndpoint, BatchEndpoints};
use utoipa::OpenApi;

#[derive(OpenApi)]
#[openapi(
    info(title = "dlock rail proxy", description = "The only caller of the rail: durable high-water mark, intent before forward, one forward."),
    paths(batch_submit),
    modifiers(&BearerAuth, &BATCHES)
)]
pub struct ApiDoc;

/// The batch endpoint: its route, owner header, security and refusals.
pub(crate) const BATCHES: BatchEndpoints = BatchEndpoints(&[BatchEndpoint::new::<SubmitItem>(
    "submissions",
    "the submission's",
    "nothing ran or was forwarded. An item paydb or the rail does not take is that item's 503 \
     RAIL_UNAVAILABLE, in its answer",
)]);

/// The rail proxy's document: this one's, then the operation of each of its routes
/// (`crate::routes`) and of what every service serves.
pub fn document() -> utoipa::openapi::OpenApi {
    dlock_server::http::document(crate::routes())
}

/// The answer of a high-water advance: the mark before and after, and who raised it (the
/// typed-in operator and the identity the credential authenticated as, both recorded in
/// rail_fence_advances).
#[derive(serde::Serialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct HighWaterAdvanced {
    pub account_id: String,
    pub previous_token: i64,
    pub highest_token: i64,
    pub floor: i64,
    pub operator: String,
    pub identity: String,
}

/// A batch of submissions (docs/contract.md#batches).
///
/// Each item is one submission and is answered exactly as `POST /v1/rail/submissions` answers it:
/// in the 200's `items`, in the request's order, the status and body the submission answers for
/// that item (the rail's acknowledgement, or its error envelope). Each item is forwarded at most
/// once, as that submission would be; one item's refusal changes nothing for its neighbours.
/// `X-Owner-Id` and the credential are the batch request's and apply to every item; the batch
/// needs the submission's roles. Never send an item again after any answer, or after none: no
/// answer to the batch request leaves every item's outcome unknown.
#[utoipa::path(post, path = SubmitItem::PATH, request_body = BatchRequest<SubmitItem>,
    responses((status = 200, description = "one answer per item, in the request's order: what POST /v1/rail/submissions answers for it", body = BatchAnswer)))]
fn batch_submit() {}
