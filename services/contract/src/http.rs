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
    /// Largest accepted request body; a larger one is `400 VALIDATION_FAILED`.
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

/// Gives every response the JSON content type unless it set its own non-JSON one (`/metrics`).
/// Bodiless responses (204) get it too, so no client ever has to special-case a response.
async fn json_content_type(request: Request, next: Next) -> Response {
    let mut response = next.run(request).await;
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
    routes
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(limits.body_bytes_max))
        .layer(middleware::from_fn(move |req, next| {
            deadline(timeout, req, next)
        }))
        .layer(middleware::from_fn(json_content_type))
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
