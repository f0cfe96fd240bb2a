//! The rail proxy's OpenAPI document (docs/contract.md#s3-5), served at `GET /v1/openapi.json`.
//! Each operation documents the handler of the same name (in `admission.rs`, `high_water.rs` and
//! `lib.rs`), the batch the batch route of its step (`dlock_server::batch`); `scripts/check-openapi`
//! checks that the committed `docs/openapi/rail-proxy.json` is this document.

#![allow(dead_code)]

use dlock_contract::batch::{BatchAnswer, BatchRequest, SubmitItem};
use dlock_contract::error::ErrorBody;
use dlock_contract::openapi::BearerAuth;
use dlock_contract::proof::{FenceLowerRequest, FenceLowered};
use dlock_contract::rail::*;
use dlock_server::openapi::{
    BatchEndpoint, BatchEndpoints, Invalid, InvalidToken, NotFound, RailUnavailable, Unauthorized,
};
use utoipa::OpenApi;

#[derive(OpenApi)]
#[openapi(
    info(title = "dlock rail proxy", description = "The only caller of the rail: durable high-water mark, intent before forward, one forward."),
    paths(submit, high_water, advance_high_water, lower_high_water, batch_submit, healthz, readyz),
    modifiers(&BearerAuth, &BATCHES)
)]
pub struct ApiDoc;

/// The batch endpoint's owner header, security and refusals.
const BATCHES: BatchEndpoints = BatchEndpoints(&[BatchEndpoint::new(
    "/v1/batches/submit",
    "submissions",
    "the submission's",
    "nothing ran or was forwarded. An item paydb or the rail does not take is that item's 503 \
     RAIL_UNAVAILABLE, in its answer",
)]);

/// The rail proxy's document.
pub fn document() -> utoipa::openapi::OpenApi {
    ApiDoc::openapi()
}

/// Submits one payout to the rail, once, never retried. The identical request retried (same
/// X-Idempotency-Key, X-Fencing-Token and body) gets the first attempt's answer, status and
/// body, and is never forwarded again.
#[utoipa::path(post, path = "/v1/rail/submissions", request_body = SubmissionRequest,
    params(("X-Fencing-Token" = String, Header, description = "decimal int64 > 0"),
           ("X-Fencing-Proof" = Option<String>, Header, description = "the grant's fencingProof (`<key-id>.<hex>`) on payout:{accountId}; required when fencing.proof-keys-file is set, else INVALID_TOKEN"),
           ("X-Owner-Id" = String, Header), ("X-Idempotency-Key" = String, Header)),
    security(("bearerAuth" = [])),
    responses((status = 200, body = SubmissionResponse), InvalidToken, Unauthorized, RailUnavailable,
        (status = 404, description = "NOT_FOUND: payout", body = ErrorBody),
        (status = 409, description = "FENCED_OUT, DUPLICATE_SUBMISSION, PAYOUT_NOT_CLAIMABLE or RAIL_AMBIGUOUS", body = ErrorBody),
        (status = 422, description = "VALIDATION_FAILED: the rail declined; IDEMPOTENCY_CONFLICT: this key and token were already used with another body", body = ErrorBody),
        (status = 429, description = "CONTENTION_EXCEEDED: the identical request's first attempt is still in flight (retry-safe after retryAfterMillis, nothing forwarded again)", body = ErrorBody),
    ))]
fn submit() {}

/// An account's high-water mark.
#[utoipa::path(get, path = "/v1/rail/high-water/{accountId}", params(("accountId" = String, Path)),
    responses((status = 200, body = HighWater), Invalid, NotFound, RailUnavailable))]
fn high_water() {}

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

/// Raises an account's high-water mark to a revocation floor (operator; docs/design.md#d-3).
#[utoipa::path(post, path = "/v1/rail/high-water/{accountId}", request_body = HighWaterRequest,
    params(("accountId" = String, Path), ("X-Owner-Id" = String, Header)),
    security(("bearerAuth" = [])),
    responses((status = 200, body = HighWaterAdvanced), Invalid, Unauthorized, NotFound, RailUnavailable))]
fn advance_high_water() {}

/// Lowers a high-water mark poisoned by a forged token (docs/design.md#d-8) to the token of the
/// operator's own grant on `payout:{accountId}` (operator; needs fencing.proof-keys-file), never
/// under the highest token the proxy admitted a proven submission with. Audited in
/// fence_recoveries.
#[utoipa::path(post, path = "/v1/rail/high-water/{accountId}/lower", request_body = FenceLowerRequest,
    params(("accountId" = String, Path),
           ("X-Fencing-Token" = String, Header, description = "the operator's grant on payout:{accountId}"),
           ("X-Fencing-Proof" = String, Header, description = "that grant's fencingProof"),
           ("X-Owner-Id" = String, Header)),
    security(("bearerAuth" = [])),
    responses((status = 200, body = FenceLowered), InvalidToken, Unauthorized, NotFound, RailUnavailable,
        (status = 403, description = "FORBIDDEN (not an operator, or no proof keys)", body = ErrorBody),
        (status = 409, description = "FENCED_OUT: the token is below the highest token the proxy admitted a submission with, its proof verified (details.highestToken); nothing changed", body = ErrorBody),
    ))]
fn lower_high_water() {}

/// A batch of submissions (docs/contract.md#batches).
///
/// Each item is one submission and is answered exactly as `POST /v1/rail/submissions` answers it:
/// in the 200's `items`, in the request's order, the status and body the submission answers for
/// that item (the rail's acknowledgement, or its error envelope). Each item is forwarded at most
/// once, as that submission would be; one item's refusal changes nothing for its neighbours.
/// `X-Owner-Id` and the credential are the batch request's and apply to every item; the batch
/// needs the submission's roles. Never send an item again after any answer, or after none: no
/// answer to the batch request leaves every item's outcome unknown.
#[utoipa::path(post, path = "/v1/batches/submit", request_body = BatchRequest<SubmitItem>,
    responses((status = 200, description = "one answer per item, in the request's order: what POST /v1/rail/submissions answers for it", body = BatchAnswer)))]
fn batch_submit() {}

/// Process up.
#[utoipa::path(get, path = "/healthz", responses((status = 200, body = serde_json::Value)))]
fn healthz() {}

/// paydb takes writes.
#[utoipa::path(get, path = "/readyz", responses((status = 200, body = serde_json::Value), RailUnavailable))]
fn readyz() {}
