//! The payment resource's OpenAPI document (docs/contract.md#s3-4), served at
//! `GET /v1/openapi.json`. Each route's operation is declared once, on its handler in `routes/`
//! (`#[utoipa::path]`), and collected from the router (`crate::routes::routes`); below are the
//! document's own parts, the headers the writes share and the batches, whose route
//! `dlock_server::batch` adds for their step. `scripts/check-openapi` checks that the committed
//! `docs/openapi/payment-resource.json` is this document.

// The batches' stand-in functions and the types below only document.
#![allow(dead_code)]

use dlock_contract::batch::{BatchAnswer, BatchRequest, ClaimItem, Item, PostItem};
use dlock_contract::openapi::BearerAuth;
use dlock_server::openapi::{BatchEndpoint, BatchEndpoints};
use utoipa::{IntoParams, OpenApi};

#[derive(OpenApi)]
#[openapi(
    info(title = "dlock payment resource", description = "Payouts, accounts and a double-entry ledger; fenced claims and postings."),
    paths(batch_claim, batch_post),
    modifiers(&BearerAuth, &BATCHES)
)]
pub struct ApiDoc;

/// The batch endpoints: their routes, owner header, security and refusals.
pub(crate) const BATCHES: BatchEndpoints = BatchEndpoints(&[
    BatchEndpoint::new::<ClaimItem>("claims", "P2's", NOT_LEADER),
    BatchEndpoint::new::<PostItem>("postings", "P3's", NOT_LEADER),
]);
const NOT_LEADER: &str =
    "nothing ran. An item paydb does not take is that item's 503 NOT_LEADER, in its answer";

/// The payment resource's document: this one's, then the operation of each of its routes
/// (`crate::routes::routes`) and of what every service serves.
pub fn document() -> utoipa::openapi::OpenApi {
    dlock_server::http::document(crate::routes::routes())
}

/// The headers of every write: who writes, and the key it runs once under.
#[derive(IntoParams)]
#[into_params(parameter_in = Header)]
pub(crate) struct WriteParams {
    #[param(rename = "X-Owner-Id")]
    owner_id: String,
    #[param(rename = "X-Idempotency-Key")]
    idempotency_key: String,
}

/// The headers of a fenced write on a payout (P2, P3), before [`WriteParams`]'s.
#[derive(IntoParams)]
#[into_params(parameter_in = Header)]
pub(crate) struct FencedParams {
    /// decimal int64 > 0
    #[param(rename = "X-Fencing-Token")]
    fencing_token: String,
    /// the grant's fencingProof (`<key-id>.<hex>`); required when fencing.proof-keys-file is set, else INVALID_TOKEN
    #[param(rename = "X-Fencing-Proof")]
    fencing_proof: Option<String>,
}

/// A batch of P2 claims (docs/contract.md#batches).
///
/// Each item is one payout's claim and is answered exactly as `POST /v1/payouts/{payoutId}/claim`
/// (P2) answers it: in the 200's `items`, in the request's order, the status and body P2 answers
/// for that item (its claim, or its error envelope). The items run concurrently, each through
/// P2's own checks, idempotency record and group commit; one item's refusal changes nothing for
/// its neighbours, and two items of one account are answered as two concurrent claims would be.
/// `X-Owner-Id` and the credential are the batch request's and apply to every item; the batch
/// needs P2's roles.
#[utoipa::path(post, path = ClaimItem::PATH, request_body = BatchRequest<ClaimItem>,
    responses((status = 200, description = "one answer per item, in the request's order: what P2 answers for it", body = BatchAnswer)))]
fn batch_claim() {}

/// A batch of P3 postings (docs/contract.md#batches).
///
/// Each item is one payout's posting and is answered exactly as `POST /v1/payouts/{payoutId}/post`
/// (P3) answers it: in the 200's `items`, in the request's order, the status and body P3 answers
/// for that item (its posting, or its error envelope). The items run concurrently, each through
/// P3's own checks, idempotency record and group commit; one item's refusal changes nothing for
/// its neighbours. `X-Owner-Id` and the credential are the batch request's and apply to every
/// item; the batch needs P3's roles.
#[utoipa::path(post, path = PostItem::PATH, request_body = BatchRequest<PostItem>,
    responses((status = 200, description = "one answer per item, in the request's order: what P3 answers for it", body = BatchAnswer)))]
fn batch_post() {}
