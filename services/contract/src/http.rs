//! What every dlock HTTP service shares: JSON responses with the contract's content type, the
//! envelope for unknown routes and wrong methods, the trace middleware, the body limit and a
//! request deadline. A service builds its routes and hands them to [`finish`].

use std::time::Duration;

use axum::Router;
use axum::extract::{DefaultBodyLimit, Request};
use axum::http::{HeaderValue, Method, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use serde::Serialize;

use crate::error::{ApiError, ErrorCode};

/// The one content type of every request and response body.
pub const JSON_CONTENT_TYPE: &str = "application/json; charset=utf-8";
/// The content type of `/metrics`, which Prometheus scrapes as text, not JSON.
pub const METRICS_CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Limits every service applies to every request.
#[derive(Debug, Clone, Copy)]
pub struct HttpLimits {
    /// Largest accepted request body; a larger one is `400 VALIDATION_FAILED` (field `body`),
    /// whichever extractor read it.
    pub body_bytes_max: usize,
    /// A request still running after this long is answered with `500 INTERNAL`, outcome unknown.
    pub request_timeout: Duration,
}

impl Default for HttpLimits {
    fn default() -> Self {
        Self {
            body_bytes_max: 64 * 1024,
            request_timeout: Duration::from_secs(40),
        }
    }
}

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

async fn not_found(method: Method, uri: axum::http::Uri) -> ApiError {
    ApiError::new(
        ErrorCode::NotFound,
        format!(
            "no route for {method} {}; see the API reference for the paths this service serves",
            uri.path()
        ),
    )
}

async fn method_not_allowed(method: Method, uri: axum::http::Uri) -> ApiError {
    ApiError::new(
        ErrorCode::MethodNotAllowed,
        format!("{} does not accept {method}", uri.path()),
    )
}

/// The most of a non-JSON error body read to classify it (axum's rejections are one line).
const FOREIGN_ERROR_BODY_MAX: usize = 4 * 1024;

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

/// Gives every response the JSON content type unless it set its own non-JSON one (`/metrics`).
/// Bodiless responses (204) get it too, so no client ever has to special-case a response.
/// An error answered in anything but JSON (axum's own rejections are plain text) becomes the
/// contract's envelope: every non-2xx carries it (C3 §3.1).
async fn json_content_type(body_bytes_max: usize, request: Request, next: Next) -> Response {
    // MatchedPath is reference-counted: cloning it costs no allocation per request.
    let route = request
        .extensions()
        .get::<axum::extract::MatchedPath>()
        .cloned();
    let mut response = next.run(request).await;
    let status = response.status();
    let is_json = response
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/json"));
    if (status.is_client_error() || status.is_server_error()) && !is_json {
        let body = std::mem::take(response.body_mut());
        let text = axum::body::to_bytes(body, FOREIGN_ERROR_BODY_MAX)
            .await
            .map(|bytes| String::from_utf8_lossy(&bytes).into_owned())
            .unwrap_or_default();
        let error = envelope_for(
            status,
            &text,
            route.as_ref().map(axum::extract::MatchedPath::as_str),
            body_bytes_max,
        );
        tracing::debug!(
            event = "plain_error_enveloped",
            status = status.as_u16(),
            code = error.code.as_str(),
            original = text.as_str(),
            "an error answered in plain text was given the contract's envelope"
        );
        return error.into_response();
    }
    let headers = response.headers_mut();
    let keep = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| !v.starts_with("application/json") && !v.starts_with("text/plain"));
    if !keep {
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static(JSON_CONTENT_TYPE),
        );
    }
    response
}

async fn deadline(timeout: Duration, request: Request, next: Next) -> Response {
    match tokio::time::timeout(timeout, next.run(request)).await {
        Ok(response) => response,
        Err(_) => ApiError::new(
            ErrorCode::Internal,
            format!(
                "the request did not finish within {} ms; its outcome is unknown, read the state before acting",
                timeout.as_millis()
            ),
        )
        .into_response(),
    }
}

/// Wraps a service's routes with the shared conventions.
pub fn finish(routes: Router, limits: HttpLimits) -> Router {
    let timeout = limits.request_timeout;
    let body_bytes_max = limits.body_bytes_max;
    routes
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(limits.body_bytes_max))
        .layer(middleware::from_fn(move |req, next| {
            deadline(timeout, req, next)
        }))
        .layer(middleware::from_fn(move |req, next| {
            json_content_type(body_bytes_max, req, next)
        }))
        .layer(middleware::from_fn(crate::trace::middleware))
}

/// Serves `app` on `listener` until `shutdown` resolves, then drains in-flight requests.
pub async fn serve(
    listener: tokio::net::TcpListener,
    app: Router,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    axum::serve(listener, app)
        .with_graceful_shutdown(shutdown)
        .await
}

/// Serves `app` over TLS when `tls` is set, plain HTTP otherwise, until `shutdown` resolves.
pub async fn serve_maybe_tls(
    listener: tokio::net::TcpListener,
    tls: Option<&crate::tls::TlsSettings>,
    app: Router,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    match tls {
        None => serve(listener, app, shutdown).await,
        Some(settings) => {
            let listener = crate::tls::TlsListener::new(listener, settings)?;
            axum::serve(listener, app)
                .with_graceful_shutdown(shutdown)
                .await
        }
    }
}

/// Resolves on SIGINT or SIGTERM.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    tokio::select! {
        () = ctrl_c => {},
        () = term => {},
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::extract::{Path, Query};
    use axum::routing::{get, post};
    use serde_json::Value;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[derive(serde::Deserialize)]
    #[allow(dead_code)]
    struct Page {
        limit: u32,
    }

    /// A service built the way every dlock service is, on a real port.
    async fn service() -> String {
        let routes =
            Router::new()
                .route(
                    "/v1/payouts/{payout_id}",
                    get(|Path(id): Path<String>| async move { crate::json::Json(id) }),
                )
                .route(
                    "/v1/counts/{n}",
                    get(|Path(n): Path<u32>| async move { crate::json::Json(n) }),
                )
                .route(
                    "/v1/pages",
                    get(|Query(page): Query<Page>| async move { crate::json::Json(page.limit) }),
                )
                .route(
                    "/v1/raw",
                    post(|body: bytes::Bytes| async move { crate::json::Json(body.len()) }),
                )
                .route(
                    "/v1/json",
                    post(
                        |crate::json::Json(v): crate::json::Json<Value>| async move {
                            crate::json::Json(v)
                        },
                    ),
                )
                .route(
                    "/v1/plain-fault",
                    get(|| async { (StatusCode::INTERNAL_SERVER_ERROR, "db at 10.0.0.7 is down") }),
                );
        let app = finish(
            routes,
            HttpLimits {
                body_bytes_max: 1_000,
                request_timeout: Duration::from_secs(5),
            },
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        let addr = listener.local_addr().unwrap_or_else(|e| panic!("{e}"));
        tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        format!("http://{addr}")
    }

    /// Status, content type and the envelope's code and `details.fields[0].field`.
    async fn answer(request: reqwest::RequestBuilder) -> (u16, String, Value) {
        let response = request.send().await.unwrap_or_else(|e| panic!("{e}"));
        let status = response.status().as_u16();
        let content_type = response
            .headers()
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_owned();
        let text = response.text().await.unwrap_or_default();
        let body = serde_json::from_str(&text).unwrap_or_else(|e| panic!("not JSON ({e}): {text}"));
        (status, content_type, body)
    }

    fn assert_field(what: &str, got: &(u16, String, Value), field: &str) {
        let (status, content_type, body) = got;
        assert_eq!(*status, 400, "{what}: {body}");
        assert_eq!(content_type, JSON_CONTENT_TYPE, "{what}");
        assert_eq!(body["code"], "VALIDATION_FAILED", "{what}: {body}");
        assert_eq!(
            body["details"]["fields"][0]["field"], field,
            "{what}: {body}"
        );
        assert_eq!(body["retrySafe"], false, "{what}");
        assert!(
            body["traceId"].as_str().is_some_and(|t| t.len() == 32),
            "{what}: {body}"
        );
    }

    #[tokio::test]
    async fn rejections_of_axum_s_own_extractors_are_the_envelope() {
        let url = service().await;
        let http = crate::client::http_client().unwrap_or_else(|e| panic!("{e}"));
        assert_field(
            "a path segment that is not UTF-8",
            &answer(http.get(format!("{url}/v1/payouts/%FF%FE"))).await,
            "payoutId",
        );
        assert_field(
            "a path segment of the wrong type",
            &answer(http.get(format!("{url}/v1/counts/many"))).await,
            "n",
        );
        assert_field(
            "a query string that does not parse",
            &answer(http.get(format!("{url}/v1/pages?limit=lots"))).await,
            "query",
        );
        let big = "x".repeat(5_000);
        let raw_big = answer(http.post(format!("{url}/v1/raw")).body(big.clone())).await;
        assert_field("an oversize body read as bytes", &raw_big, "body");
        assert!(
            raw_big.2["message"]
                .as_str()
                .is_some_and(|m| m.contains("1000 bytes")),
            "{}",
            raw_big.2
        );
        assert_field(
            "an oversize body read as JSON",
            &answer(
                http.post(format!("{url}/v1/json"))
                    .header("content-type", "application/json")
                    .body(format!("{{\"a\":\"{big}\"}}")),
            )
            .await,
            "body",
        );
        // A plain-text fault says nothing of what it said.
        let (status, content_type, body) = answer(http.get(format!("{url}/v1/plain-fault"))).await;
        assert_eq!(status, 500);
        assert_eq!(content_type, JSON_CONTENT_TYPE);
        assert_eq!(body["code"], "INTERNAL");
        assert!(!body.to_string().contains("10.0.0.7"), "{body}");
        // Positive control: what is fine stays fine.
        let (status, _, body) = answer(http.get(format!("{url}/v1/payouts/p%C3%A9-1"))).await;
        assert_eq!((status, body), (200, Value::String("pé-1".into())));
    }

    #[tokio::test]
    async fn a_body_that_breaks_off_is_the_envelope() {
        let url = service().await;
        let addr = url.trim_start_matches("http://");
        let mut stream = tokio::net::TcpStream::connect(addr)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        // A chunk size that is not hexadecimal: the body cannot be read to its end.
        stream
            .write_all(
                b"POST /v1/raw HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
            )
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        let mut reply = Vec::new();
        let _ = tokio::time::timeout(Duration::from_secs(5), stream.read_to_end(&mut reply)).await;
        let reply = String::from_utf8_lossy(&reply);
        let (head, body) = reply.split_once("\r\n\r\n").unwrap_or_default();
        assert!(head.starts_with("HTTP/1.1 400"), "{reply}");
        assert!(
            head.to_ascii_lowercase()
                .contains("content-type: application/json; charset=utf-8"),
            "{reply}"
        );
        let body: Value = serde_json::from_str(body).unwrap_or_else(|e| panic!("{e}: {reply}"));
        assert_eq!(body["code"], "VALIDATION_FAILED");
        assert_eq!(body["details"]["fields"][0]["field"], "body");
    }

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
