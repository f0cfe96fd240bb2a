//! The lock server's OpenAPI document (docs/contract.md#s3-3), served at `GET /v1/openapi.json`.
//! Each route's operation is declared once, on its handler in `routes/` (`#[utoipa::path]`), and
//! collected from the router (`crate::routes::routes`); below are the document's own parts and the
//! batches, whose route `dlock_server::batch` adds for their step. `scripts/check-openapi` checks
//! that the committed `docs/openapi/lock-server.json` is this document.

// The batches' stand-in functions and the types below only document.
#![allow(dead_code)]

use dlock_contract::batch::{AcquireItem, BatchAnswer, BatchRequest, Item, ReleaseItem};
use dlock_contract::error::ErrorBody;
use dlock_contract::openapi::BearerAuth;
use dlock_server::openapi::{BatchEndpoint, BatchEndpoints};
use utoipa::OpenApi;

#[derive(OpenApi)]
#[openapi(
    info(title = "dlock lock server", description = "Sessions, leases and fencing tokens."),
    paths(batch_acquire, batch_release),
    modifiers(&BearerAuth, &BATCHES)
)]
pub struct ApiDoc;

/// The batch endpoints: their routes, owner header, security and refusals.
pub(crate) const BATCHES: BatchEndpoints = BatchEndpoints(&[
    BatchEndpoint::new::<AcquireItem>("acquires", "L4's", NOT_LEADER),
    BatchEndpoint::new::<ReleaseItem>("releases", "L6's", NOT_LEADER),
]);
const NOT_LEADER: &str =
    "nothing ran. An item the backend does not take is that item's 503 NOT_LEADER, in its answer";

/// A batch of L4 acquires (docs/contract.md#batches).
///
/// Each item is one key's acquire and is answered exactly as `POST /v1/locks/{key}/acquire` (L4)
/// answers it: in the 200's `items`, in the request's order, the status and body L4 answers for
/// that item (a grant, or its error envelope). The items run concurrently, each through L4's own
/// checks and waiting; one item's refusal changes nothing for its neighbours. `X-Owner-Id` and the
/// credential are the batch request's and apply to every item; the batch needs L4's roles. No
/// answer to the batch request leaves every item's outcome unknown: read each key (L7).
#[utoipa::path(post, path = AcquireItem::PATH, request_body = BatchRequest<AcquireItem>,
    responses((status = 200, description = "one answer per item, in the request's order: what L4 answers for it", body = BatchAnswer)))]
fn batch_acquire() {}

/// A batch of L6 releases (docs/contract.md#batches).
///
/// Each item is one grant's release and is answered exactly as `DELETE /v1/locks/{key}` (L6)
/// answers it: in the 200's `items`, in the request's order, the status L6 answers for that item
/// (no body for its 204, else its error envelope). The items run concurrently, each through L6's
/// own checks; one item's refusal changes nothing for its neighbours. `X-Owner-Id` and the
/// credential are the batch request's and apply to every item; the batch needs L6's roles.
#[utoipa::path(post, path = ReleaseItem::PATH, request_body = BatchRequest<ReleaseItem>,
    responses((status = 200, description = "one answer per item, in the request's order: what L6 answers for it", body = BatchAnswer)))]
fn batch_release() {}

/// 404 and 410: a session-bound call on a session that is unknown or has expired.
#[derive(utoipa::IntoResponses)]
pub(crate) enum SessionGone {
    #[response(status = 404, description = "SESSION_UNKNOWN")]
    SessionUnknown(ErrorBody),
    #[response(status = 410, description = "SESSION_EXPIRED")]
    SessionExpired(ErrorBody),
}

/// The lock server's document: this one's, then the operation of each of its routes
/// (`crate::routes::routes`) and of what every service serves.
pub fn document() -> utoipa::openapi::OpenApi {
    dlock_server::http::document(crate::routes::routes())
}
