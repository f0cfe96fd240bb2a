//! The error answers the services' OpenAPI documents share, each with the contract's status and
//! envelope (docs/contract.md#error-envelope). An operation names the sets it may answer in its
//! `responses(...)`, after its success; a tuple listed after a set replaces that set's entry for
//! its status (a more precise description).

use dlock_contract::error::ErrorBody;
use utoipa::IntoResponses;

/// 400: the request failed validation.
#[derive(IntoResponses)]
pub enum Invalid {
    #[response(status = 400, description = "VALIDATION_FAILED")]
    ValidationFailed(ErrorBody),
}

/// 400 on a fenced call: the token header, or anything else, failed validation.
#[derive(IntoResponses)]
pub enum InvalidToken {
    #[response(status = 400, description = "INVALID_TOKEN or VALIDATION_FAILED")]
    InvalidToken(ErrorBody),
}

/// 401 and 403: an authenticated write.
#[derive(IntoResponses)]
pub enum Unauthorized {
    #[response(status = 401, description = "UNAUTHENTICATED")]
    Unauthenticated(ErrorBody),
    #[response(status = 403, description = "FORBIDDEN")]
    Forbidden(ErrorBody),
}

/// 404: nothing by that name.
#[derive(IntoResponses)]
pub enum NotFound {
    #[response(status = 404, description = "NOT_FOUND")]
    NotFound(ErrorBody),
}

/// 422 and 429: a write under `X-Idempotency-Key`.
#[derive(IntoResponses)]
pub enum Idempotent {
    #[response(status = 422, description = "IDEMPOTENCY_CONFLICT")]
    IdempotencyConflict(ErrorBody),
    #[response(
        status = 429,
        description = "CONTENTION_EXCEEDED: an identical request still holds the idempotency record; retry after retryAfterMillis"
    )]
    ContentionExceeded(ErrorBody),
}

/// 503: the database or cluster behind the service takes no writes here.
#[derive(IntoResponses)]
pub enum NotLeader {
    #[response(status = 503, description = "NOT_LEADER")]
    NotLeader(ErrorBody),
}

/// 503 from the rail proxy: paydb or the rail is not available.
#[derive(IntoResponses)]
pub enum RailUnavailable {
    #[response(status = 503, description = "RAIL_UNAVAILABLE")]
    RailUnavailable(ErrorBody),
}
