//! The HTTP side of the contract's envelope: JSON bodies with the contract's content type, and the
//! envelope for an error that was not built as one. (What a service wraps its routes in is
//! `dlock_server::http`.)

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Serialize;

use crate::error::{ApiError, ErrorCode};

/// The one content type of every request and response body.
pub const JSON_CONTENT_TYPE: &str = "application/json; charset=utf-8";
/// The content type of `/metrics`, which Prometheus scrapes as text, not JSON.
pub const METRICS_CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";
/// Serializes `value` as the body of a response with `status`.
pub fn json_response<T: Serialize>(status: StatusCode, value: &T) -> Response {
    match serde_json::to_vec(value) {
        Ok(bytes) => (
            status,
            [(
                header::CONTENT_TYPE,
                HeaderValue::from_static(JSON_CONTENT_TYPE),
            )],
            bytes,
        )
            .into_response(),
        Err(error) => {
            ApiError::internal(format!("response did not serialize: {error}")).into_response()
        }
    }
}
/// `session_id` → `sessionId`: the contract's spelling of a path parameter.
fn camel_case(name: &str) -> String {
    let mut out = String::with_capacity(name.len());
    let mut upper = false;
    for c in name.chars() {
        if c == '_' {
            upper = true;
        } else if upper {
            out.extend(c.to_uppercase());
            upper = false;
        } else {
            out.push(c);
        }
    }
    out
}

/// The envelope for an error response that was not built as one: a rejection of one of axum's
/// own extractors (a path segment that does not decode, a body that could not be read or is too
/// large, a query string that does not parse), which answers in plain text. `text` is its body,
/// `route` the matched route (`/v1/locks/{key}/acquire`), `body_bytes_max` the body limit.
pub fn envelope_for(
    status: StatusCode,
    text: &str,
    route: Option<&str>,
    body_bytes_max: usize,
) -> ApiError {
    let text = text.trim();
    if let Some(rest) = text.strip_prefix("Invalid URL:") {
        let rest = rest.trim();
        // axum names the parameter in these two; otherwise a route with one parameter does.
        let named = rest
            .strip_prefix("Invalid UTF-8 in `")
            .or_else(|| rest.strip_prefix("Cannot parse `"))
            .and_then(|tail| tail.split('`').next())
            .filter(|_| !rest.starts_with("Cannot parse `") || rest.contains("` with value `"));
        let mut params = route
            .unwrap_or_default()
            .split('/')
            .filter_map(|segment| segment.strip_prefix('{')?.strip_suffix('}'))
            .map(|p| p.trim_start_matches('*'));
        let only = match (params.next(), params.next()) {
            (Some(one), None) => Some(one),
            _ => None,
        };
        let field = named.or(only).map_or_else(|| "path".to_owned(), camel_case);
        let reason = if rest.contains("Invalid UTF-8") {
            "is not percent-encoded UTF-8; encode the path segment as UTF-8, then percent-encode it"
        } else {
            "is not a valid value for this path segment; see the API reference"
        };
        return ApiError::field(field, reason);
    }
    if text.starts_with("Failed to deserialize query string") {
        return ApiError::field(
            "query",
            "the query string does not parse; see the API reference for its parameters",
        );
    }
    match status {
        StatusCode::PAYLOAD_TOO_LARGE => ApiError::field(
            "body",
            format!("is larger than this service accepts ({body_bytes_max} bytes at most)"),
        ),
        StatusCode::BAD_REQUEST if text.starts_with("Failed to buffer the request body") => {
            ApiError::field(
                "body",
                "could not be read to its end (the connection or its chunked encoding broke \
                 off); nothing was changed, send the whole request again",
            )
        }
        StatusCode::BAD_REQUEST if text.contains("UTF-8") => {
            ApiError::field("body", "is not valid UTF-8")
        }
        StatusCode::UNSUPPORTED_MEDIA_TYPE => {
            ApiError::field("Content-Type", "must be application/json; charset=utf-8")
        }
        StatusCode::NOT_FOUND => ApiError::new(
            ErrorCode::NotFound,
            "nothing here; see the API reference for the paths this service serves",
        ),
        StatusCode::METHOD_NOT_ALLOWED => ApiError::new(
            ErrorCode::MethodNotAllowed,
            "this path does not accept this method",
        ),
        StatusCode::UNAUTHORIZED => ApiError::new(
            ErrorCode::Unauthenticated,
            "this request needs a credential: send Authorization: Bearer <token>",
        ),
        StatusCode::FORBIDDEN => ApiError::new(ErrorCode::Forbidden, "this request is not allowed"),
        status if status.is_client_error() => ApiError::field(
            "request",
            "was refused before any handler ran; check it against the API reference",
        ),
        _ => ApiError::internal(format!("a non-JSON {status} answer: {text}")),
    }
}
#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::Value;

    #[test]
    fn path_parameters_are_named_as_the_contract_spells_them() {
        assert_eq!(camel_case("session_id"), "sessionId");
        assert_eq!(camel_case("key"), "key");
        let error = envelope_for(
            StatusCode::BAD_REQUEST,
            "Invalid URL: Invalid UTF-8 in `account_id`",
            None,
            10,
        );
        assert_eq!(
            error.details.map(|d| d["fields"][0]["field"].clone()),
            Some(Value::String("accountId".into()))
        );
        let field = |text: &str, route: Option<&str>| {
            envelope_for(StatusCode::BAD_REQUEST, text, route, 10)
                .details
                .map(|d| d["fields"][0]["field"].clone())
                .unwrap_or_default()
        };
        let wrong_type = "Invalid URL: Cannot parse `many` to a `u32`";
        assert_eq!(field(wrong_type, Some("/v1/locks/{key}/renew")), "key");
        assert_eq!(field(wrong_type, Some("/v1/a/{a_id}/b/{b_id}")), "path");
        assert_eq!(field(wrong_type, None), "path");
        assert_eq!(
            field("Invalid URL: Cannot parse `b_id` with value `x`: no", None),
            "bId"
        );
    }
}
