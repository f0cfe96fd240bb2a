//! The rail proxy's OpenAPI document (C3 §3.5), served at `GET /v1/openapi.json`. Each
//! operation documents the handler of the same name in `lib.rs`; the integration test `openapi`
//! sends a request to every documented operation and checks the status is documented.

#![allow(dead_code)]

use dlock_contract::error::ErrorBody;
use dlock_contract::openapi::BearerAuth;
use dlock_contract::rail::*;
use utoipa::OpenApi;

#[derive(OpenApi)]
#[openapi(
    info(title = "dlock rail proxy", description = "The only caller of the rail: durable high-water mark, intent before forward, one forward (C3 §3.5)."),
    paths(submit, high_water, advance_high_water, healthz, readyz),
    modifiers(&BearerAuth)
)]
pub struct ApiDoc;

/// The rail proxy's document.
pub fn document() -> utoipa::openapi::OpenApi {
    ApiDoc::openapi()
}

/// Submits one payout to the rail, once, never retried.
#[utoipa::path(post, path = "/v1/rail/submissions", request_body = SubmissionRequest,
    params(("X-Fencing-Token" = String, Header, description = "decimal int64 > 0"),
           ("X-Owner-Id" = String, Header), ("X-Idempotency-Key" = String, Header)),
    security(("bearerAuth" = [])),
    responses(
        (status = 200, body = SubmissionResponse),
        (status = 400, description = "INVALID_TOKEN or VALIDATION_FAILED", body = ErrorBody),
        (status = 401, description = "UNAUTHENTICATED", body = ErrorBody),
        (status = 403, description = "FORBIDDEN", body = ErrorBody),
        (status = 404, description = "NOT_FOUND: payout", body = ErrorBody),
        (status = 409, description = "FENCED_OUT, DUPLICATE_SUBMISSION, PAYOUT_NOT_CLAIMABLE or RAIL_AMBIGUOUS", body = ErrorBody),
        (status = 422, description = "VALIDATION_FAILED: the rail declined", body = ErrorBody),
        (status = 503, description = "RAIL_UNAVAILABLE", body = ErrorBody),
    ))]
fn submit() {}

/// An account's high-water mark.
#[utoipa::path(get, path = "/v1/rail/high-water/{accountId}", params(("accountId" = String, Path)),
    responses(
        (status = 200, body = HighWater),
        (status = 400, description = "VALIDATION_FAILED", body = ErrorBody),
        (status = 404, description = "NOT_FOUND", body = ErrorBody),
        (status = 503, description = "RAIL_UNAVAILABLE", body = ErrorBody),
    ))]
fn high_water() {}

/// D-3: raises an account's high-water mark to a revocation floor (operator).
#[utoipa::path(post, path = "/v1/rail/high-water/{accountId}", request_body = HighWaterRequest,
    params(("accountId" = String, Path), ("X-Owner-Id" = String, Header)),
    security(("bearerAuth" = [])),
    responses(
        (status = 200, body = HighWater),
        (status = 400, description = "VALIDATION_FAILED", body = ErrorBody),
        (status = 401, description = "UNAUTHENTICATED", body = ErrorBody),
        (status = 403, description = "FORBIDDEN", body = ErrorBody),
        (status = 404, description = "NOT_FOUND", body = ErrorBody),
        (status = 503, description = "RAIL_UNAVAILABLE", body = ErrorBody),
    ))]
fn advance_high_water() {}

/// Process up.
#[utoipa::path(get, path = "/healthz", responses((status = 200, body = serde_json::Value)))]
fn healthz() {}

/// paydb takes writes.
#[utoipa::path(get, path = "/readyz", responses(
    (status = 200, body = serde_json::Value),
    (status = 503, description = "RAIL_UNAVAILABLE", body = ErrorBody),
))]
fn readyz() {}
