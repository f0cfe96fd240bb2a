//! The answer of an idempotent write (docs/contract.md#idempotency-rules), as it is stored and as
//! it is sent: the first answer's status and bytes, which the identical retry gets back byte for
//! byte. The payment resource keeps one per Idempotency-Key record
//! (services/payment-resource/src/routes/idempotency.rs); the rail proxy one per submission
//! (services/rail-proxy/src/record.rs, docs/contract.md#submit-replay).

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use dlock_contract::error::ApiError;
use dlock_contract::headers::IDEMPOTENT_REPLAY;
use dlock_contract::http::JSON_CONTENT_TYPE;
use serde::Serialize;

/// An answer, as it is stored and sent.
pub struct Reply {
    pub status: StatusCode,
    pub body: Vec<u8>,
}

impl Reply {
    /// `value` serialized, with `status`.
    pub fn json<T: Serialize>(status: StatusCode, value: &T) -> Result<Self, ApiError> {
        serde_json::to_vec(value)
            .map(|body| Self { status, body })
            .map_err(|e| ApiError::internal(format!("response did not serialize: {e}")))
    }

    /// A refusal's answer: its status and its envelope.
    pub fn error(error: &ApiError) -> Result<Self, ApiError> {
        Self::json(error.status, &error.body())
    }

    /// A stored answer, as read back from its record.
    pub fn stored(status: u16, body: Vec<u8>) -> Result<Self, ApiError> {
        let status = StatusCode::from_u16(status)
            .map_err(|_| ApiError::internal(format!("stored status {status}")))?;
        Ok(Self { status, body })
    }

    /// The response: the bytes in the contract's content type, marked with [`IDEMPOTENT_REPLAY`]
    /// when `replayed`.
    pub fn into_response(self, replayed: bool) -> Response {
        let mut response = (self.status, self.body).into_response();
        let headers = response.headers_mut();
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static(JSON_CONTENT_TYPE),
        );
        if replayed {
            headers.insert(IDEMPOTENT_REPLAY, HeaderValue::from_static("true"));
        }
        response
    }
}
