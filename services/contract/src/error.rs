//! The error envelope and the error-code catalogue of the wire contract (docs/contract.md#s3-1,
//! docs/contract.md#s3-2).

use axum::response::{IntoResponse, Response};
use http::StatusCode;
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// Stable machine identifiers. Alerts filter on these, never on the message.
///
/// The first fifteen are the contract's catalogue. The rest are the project's own, for
/// situations the catalogue does not name but a JSON client still has to tell apart: an unknown
/// route, a wrong method, a missing or wrong credential, a credential that could not be checked
/// because the identity provider (Kubernetes TokenReview) did not answer, a server fault, a
/// write the lock server sent to its backend without hearing back (docs/contract.md#outcome-unknown),
/// a payout above its account's limit, and paydb refusing writes until an operator's recovery.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum ErrorCode {
    LockContended,
    ContentionExceeded,
    NotLeader,
    LockLost,
    SessionUnknown,
    SessionExpired,
    InvalidToken,
    FencedOut,
    PayoutNotClaimable,
    DuplicateSubmission,
    InsufficientFunds,
    IdempotencyConflict,
    RailUnavailable,
    RailAmbiguous,
    ValidationFailed,
    NotFound,
    MethodNotAllowed,
    Unauthenticated,
    Forbidden,
    AuthUnavailable,
    Internal,
    OutcomeUnknown,
    /// A payout above its account's limit (docs/contract.md#account-limits).
    LimitExceeded,
    /// paydb is on a new timeline after a failover that may have lost writes and refuses every
    /// write until an operator runs `dlock recover paydb-epoch` (docs/design.md#d-12). Nothing
    /// was written; unlike NOT_LEADER, no other replica and no retry soon will do better.
    RecoveryRequired,
}

impl ErrorCode {
    pub const ALL: [ErrorCode; 24] = [
        ErrorCode::LockContended,
        ErrorCode::ContentionExceeded,
        ErrorCode::NotLeader,
        ErrorCode::LockLost,
        ErrorCode::SessionUnknown,
        ErrorCode::SessionExpired,
        ErrorCode::InvalidToken,
        ErrorCode::FencedOut,
        ErrorCode::PayoutNotClaimable,
        ErrorCode::DuplicateSubmission,
        ErrorCode::InsufficientFunds,
        ErrorCode::IdempotencyConflict,
        ErrorCode::RailUnavailable,
        ErrorCode::RailAmbiguous,
        ErrorCode::ValidationFailed,
        ErrorCode::NotFound,
        ErrorCode::MethodNotAllowed,
        ErrorCode::Unauthenticated,
        ErrorCode::Forbidden,
        ErrorCode::AuthUnavailable,
        ErrorCode::Internal,
        ErrorCode::OutcomeUnknown,
        ErrorCode::LimitExceeded,
        ErrorCode::RecoveryRequired,
    ];

    /// The HTTP status the catalogue assigns to the code.
    pub fn status(self) -> StatusCode {
        use ErrorCode::*;
        match self {
            LockContended | LockLost | FencedOut | PayoutNotClaimable | DuplicateSubmission
            | RailAmbiguous => StatusCode::CONFLICT,
            ContentionExceeded => StatusCode::TOO_MANY_REQUESTS,
            NotLeader | RailUnavailable | AuthUnavailable | OutcomeUnknown | RecoveryRequired => {
                StatusCode::SERVICE_UNAVAILABLE
            }
            SessionUnknown | NotFound => StatusCode::NOT_FOUND,
            SessionExpired => StatusCode::GONE,
            InvalidToken | ValidationFailed => StatusCode::BAD_REQUEST,
            InsufficientFunds | IdempotencyConflict | LimitExceeded => {
                StatusCode::UNPROCESSABLE_ENTITY
            }
            MethodNotAllowed => StatusCode::METHOD_NOT_ALLOWED,
            Unauthenticated => StatusCode::UNAUTHORIZED,
            Forbidden => StatusCode::FORBIDDEN,
            Internal => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// The server's verdict on whether the identical request may be re-sent by the same caller
    /// with the same token without risking a duplicate side effect. Not "was it transient":
    /// RECOVERY_REQUIRED is retry-safe (nothing was written) and lasts until an operator acts.
    pub fn retry_safe(self) -> bool {
        use ErrorCode::*;
        matches!(
            self,
            LockContended
                | ContentionExceeded
                | NotLeader
                | RailUnavailable
                | AuthUnavailable
                | RecoveryRequired
        )
    }

    /// Whether the catalogue puts `retryAfterMillis` on this code. Not on RECOVERY_REQUIRED: it
    /// ends when an operator has run the recovery, which no server can time.
    pub fn carries_retry_after(self) -> bool {
        use ErrorCode::*;
        matches!(
            self,
            LockContended | ContentionExceeded | NotLeader | RailUnavailable | AuthUnavailable
        )
    }

    pub fn as_str(self) -> &'static str {
        use ErrorCode::*;
        match self {
            LockContended => "LOCK_CONTENDED",
            ContentionExceeded => "CONTENTION_EXCEEDED",
            NotLeader => "NOT_LEADER",
            LockLost => "LOCK_LOST",
            SessionUnknown => "SESSION_UNKNOWN",
            SessionExpired => "SESSION_EXPIRED",
            InvalidToken => "INVALID_TOKEN",
            FencedOut => "FENCED_OUT",
            PayoutNotClaimable => "PAYOUT_NOT_CLAIMABLE",
            DuplicateSubmission => "DUPLICATE_SUBMISSION",
            InsufficientFunds => "INSUFFICIENT_FUNDS",
            IdempotencyConflict => "IDEMPOTENCY_CONFLICT",
            RailUnavailable => "RAIL_UNAVAILABLE",
            RailAmbiguous => "RAIL_AMBIGUOUS",
            ValidationFailed => "VALIDATION_FAILED",
            NotFound => "NOT_FOUND",
            MethodNotAllowed => "METHOD_NOT_ALLOWED",
            Unauthenticated => "UNAUTHENTICATED",
            Forbidden => "FORBIDDEN",
            AuthUnavailable => "AUTH_UNAVAILABLE",
            Internal => "INTERNAL",
            OutcomeUnknown => "OUTCOME_UNKNOWN",
            LimitExceeded => "LIMIT_EXCEEDED",
            RecoveryRequired => "RECOVERY_REQUIRED",
        }
    }
}

impl std::fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One field at fault in a rejected request, listed under `details.fields[]`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct FieldError {
    /// The JSON path of the field (`ttlMillis`, `payouts[3].amountMinor`), a header name
    /// (`X-Owner-Id`), a path parameter (`key`) or `body` for the body as a whole.
    pub field: String,
    pub reason: String,
}

impl FieldError {
    pub fn new(field: impl Into<String>, reason: impl Into<String>) -> Self {
        Self {
            field: field.into(),
            reason: reason.into(),
        }
    }
}

/// The envelope as it travels on the wire. Field order is the contract's.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct ErrorBody {
    pub code: ErrorCode,
    pub message: String,
    pub retry_safe: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry_after_millis: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub details: Option<Value>,
    pub trace_id: String,
}

/// An error a handler answers with. It becomes the envelope, with the status of its code unless
/// a row of the contract says otherwise (the rail's decline is `422 VALIDATION_FAILED`).
#[derive(Debug, Clone)]
pub struct ApiError {
    pub code: ErrorCode,
    pub status: StatusCode,
    pub message: String,
    pub retry_after_millis: Option<u64>,
    pub details: Option<Value>,
}

/// The `retryAfterMillis` used when a code must carry one and the caller gave no better figure.
pub const DEFAULT_RETRY_AFTER_MS: u64 = 250;

impl ApiError {
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        Self {
            code,
            status: code.status(),
            message: message.into(),
            retry_after_millis: code.carries_retry_after().then_some(DEFAULT_RETRY_AFTER_MS),
            details: None,
        }
    }

    pub fn with_status(mut self, status: StatusCode) -> Self {
        self.status = status;
        self
    }

    pub fn with_retry_after_ms(mut self, ms: u64) -> Self {
        self.retry_after_millis = Some(ms.max(1));
        self
    }

    pub fn with_details(mut self, details: Value) -> Self {
        self.details = Some(details);
        self
    }

    /// `409 FENCED_OUT` with its details: an incident-grade refusal
    /// (docs/contract.md#fenced-out-details), so every enforcement point says the same things in
    /// the same shape.
    pub fn fenced_out(message: &str, details: &FencedOutDetails) -> Self {
        Self::new(ErrorCode::FencedOut, message)
            .with_details(serde_json::to_value(details).unwrap_or(serde_json::Value::Null))
    }

    /// `400 VALIDATION_FAILED` naming every field at fault.
    pub fn validation(fields: Vec<FieldError>) -> Self {
        let message = match fields.as_slice() {
            [] => "the request is not valid".to_owned(),
            [one] => format!("{}: {}", one.field, one.reason),
            [first, rest @ ..] => format!(
                "{}: {} (and {} more field(s), see details.fields)",
                first.field,
                first.reason,
                rest.len()
            ),
        };
        Self::new(ErrorCode::ValidationFailed, message)
            .with_details(serde_json::json!({ "fields": fields }))
    }

    pub fn field(field: impl Into<String>, reason: impl Into<String>) -> Self {
        Self::validation(vec![FieldError::new(field, reason)])
    }

    pub fn invalid_token(reason: impl Into<String>) -> Self {
        Self::new(
            ErrorCode::InvalidToken,
            format!(
                "X-Fencing-Token {}; send the decimal token of your grant",
                reason.into()
            ),
        )
    }

    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::NotFound, message)
    }

    /// A server fault. The body says nothing internal; the cause is logged here, inside the
    /// request's span, so the trace id in the body finds it.
    pub fn internal(cause: impl std::fmt::Display) -> Self {
        tracing::error!(event = "internal_error", error = %cause, "request failed inside the server");
        Self::new(
            ErrorCode::Internal,
            "the server failed to complete the request; quote the traceId when reporting it",
        )
    }

    /// Checks an invariant of a money-moving write on the side that sees its answer (TIGER_STYLE:
    /// both sides assert what the other promised). A violation is a server fault: it is logged
    /// as `invariant_violated` naming the rule, the request answers 500, and nothing further is
    /// done under it. It never panics: a serving process keeps its other requests.
    pub fn invariant(holds: bool, rule: &str) -> Result<(), Self> {
        if holds {
            return Ok(());
        }
        tracing::error!(
            event = "invariant_violated",
            rule,
            "an invariant of a money-moving write does not hold; nothing further is done under it"
        );
        Err(Self::new(
            ErrorCode::Internal,
            "the server found an invariant broken and stopped; quote the traceId when reporting it",
        ))
    }

    pub fn body(&self) -> ErrorBody {
        ErrorBody {
            code: self.code,
            message: self.message.clone(),
            retry_safe: self.code.retry_safe(),
            retry_after_millis: self.retry_after_millis,
            details: self.details.clone(),
            trace_id: crate::trace::current_trace_id(),
        }
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} ({}): {}",
            self.code,
            self.status.as_u16(),
            self.message
        )
    }
}

impl std::error::Error for ApiError {}

/// `Retry-After` in whole seconds (rounded up) for a wait of `millis`: what proxies and generic
/// HTTP clients read on a 429 or 503, beside the envelope's exact `retryAfterMillis`.
pub fn retry_after_seconds(millis: u64) -> u64 {
    millis.div_ceil(1_000).max(1)
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = crate::http::json_response(self.status, &self.body());
        if let Some(millis) = self.retry_after_millis
            && matches!(
                self.status,
                StatusCode::TOO_MANY_REQUESTS | StatusCode::SERVICE_UNAVAILABLE
            )
        {
            response.headers_mut().insert(
                http::header::RETRY_AFTER,
                http::HeaderValue::from(retry_after_seconds(millis)),
            );
        }
        response
    }
}

/// The details of `FENCED_OUT`: the token presented, the newest one stored, where, and who
/// presented it. `resourceType` is `account`, `ledger` or `rail` at the payment enforcement points
/// and absent at the lock server (a revocation's `expectedToken` that is no longer the grant's).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct FencedOutDetails {
    pub presented_token: i64,
    pub highest_token: i64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resource_type: Option<String>,
    pub resource_id: String,
    pub owner_id: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn catalogue_statuses_and_retry_safety_match_the_contract() {
        let expected: [(ErrorCode, u16, bool); 16] = [
            (ErrorCode::LockContended, 409, true),
            (ErrorCode::ContentionExceeded, 429, true),
            (ErrorCode::NotLeader, 503, true),
            (ErrorCode::LockLost, 409, false),
            (ErrorCode::SessionUnknown, 404, false),
            (ErrorCode::SessionExpired, 410, false),
            (ErrorCode::InvalidToken, 400, false),
            (ErrorCode::FencedOut, 409, false),
            (ErrorCode::PayoutNotClaimable, 409, false),
            (ErrorCode::DuplicateSubmission, 409, false),
            (ErrorCode::InsufficientFunds, 422, false),
            (ErrorCode::IdempotencyConflict, 422, false),
            (ErrorCode::LimitExceeded, 422, false),
            (ErrorCode::RailUnavailable, 503, true),
            (ErrorCode::RailAmbiguous, 409, false),
            (ErrorCode::ValidationFailed, 400, false),
        ];
        for (code, status, retry_safe) in expected {
            assert_eq!(code.status().as_u16(), status, "{code}");
            assert_eq!(code.retry_safe(), retry_safe, "{code}");
            let wire = serde_json::to_value(code).unwrap_or_default();
            assert_eq!(wire, serde_json::Value::String(code.as_str().to_owned()));
        }
    }

    #[test]
    fn outcome_unknown_is_a_503_that_is_never_retry_safe() {
        // The write reached the backend and no answer came back: a blind retry may act twice
        // (docs/contract.md#outcome-unknown). Only NOT_LEADER says nothing was changed.
        let code = ErrorCode::OutcomeUnknown;
        assert_eq!(code.status().as_u16(), 503);
        assert!(!code.retry_safe());
        assert!(!code.carries_retry_after());
        assert_eq!(
            serde_json::to_value(code).unwrap_or_default(),
            serde_json::json!("OUTCOME_UNKNOWN")
        );
        assert!(ErrorCode::NotLeader.retry_safe());
    }

    #[test]
    fn recovery_required_is_a_retry_safe_503_that_promises_no_quick_retry() {
        // paydb refuses every write until `dlock recover paydb-epoch` (docs/design.md#d-12):
        // nothing was written, so the identical request may be sent again, but only after the
        // recovery; no retryAfterMillis, no Retry-After, and never NOT_LEADER's promise.
        let code = ErrorCode::RecoveryRequired;
        assert_eq!(code.status().as_u16(), 503);
        assert!(code.retry_safe());
        assert!(!code.carries_retry_after());
        assert_ne!(code, ErrorCode::NotLeader);
        assert_eq!(
            serde_json::to_value(code).unwrap_or_default(),
            serde_json::json!("RECOVERY_REQUIRED")
        );
        let parsed = serde_json::from_value::<ErrorCode>(serde_json::json!("RECOVERY_REQUIRED"));
        assert_eq!(parsed.ok(), Some(code));
        assert!(ErrorCode::ALL.contains(&code));
        let response = ApiError::new(code, "x").into_response();
        assert_eq!(response.status().as_u16(), 503);
        assert!(response.headers().get(http::header::RETRY_AFTER).is_none());
    }

    #[test]
    fn a_429_or_503_with_a_wait_says_retry_after_in_whole_seconds() {
        let header = |error: ApiError| {
            error
                .into_response()
                .headers()
                .get(http::header::RETRY_AFTER)
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned)
        };
        assert_eq!(
            header(ApiError::new(ErrorCode::AuthUnavailable, "x").with_retry_after_ms(1_001)),
            Some("2".to_owned())
        );
        assert_eq!(
            header(ApiError::new(ErrorCode::ContentionExceeded, "x").with_retry_after_ms(20)),
            Some("1".to_owned())
        );
        // LOCK_CONTENDED carries retryAfterMillis but is a 409: no Retry-After.
        assert_eq!(header(ApiError::new(ErrorCode::LockContended, "x")), None);
        assert_eq!(
            header(ApiError::new(ErrorCode::ValidationFailed, "x")),
            None
        );
    }

    #[test]
    fn retry_after_is_present_exactly_where_the_catalogue_lists_it() {
        for code in ErrorCode::ALL {
            let body = ApiError::new(code, "x").body();
            assert_eq!(
                body.retry_after_millis.is_some(),
                matches!(
                    code,
                    ErrorCode::LockContended
                        | ErrorCode::ContentionExceeded
                        | ErrorCode::NotLeader
                        | ErrorCode::RailUnavailable
                        | ErrorCode::AuthUnavailable
                ),
                "{code}"
            );
        }
    }

    #[test]
    fn a_broken_invariant_is_a_500_that_names_nothing_internal() {
        assert!(ApiError::invariant(true, "holds").is_ok());
        let broken = ApiError::invariant(false, "claim token equals the caller's token")
            .err()
            .unwrap_or_else(|| panic!("a false invariant passed"));
        assert_eq!(broken.code, ErrorCode::Internal);
        assert_eq!(broken.status, StatusCode::INTERNAL_SERVER_ERROR);
        assert!(
            !broken.message.contains("claim token"),
            "{}",
            broken.message
        );
    }
}
