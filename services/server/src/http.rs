//! What every dlock HTTP service shares: the envelope for unknown routes and wrong methods, every
//! response in the contract's content type, the trace middleware, the body limit and a request
//! deadline. A service builds its routes and hands them to [`finish`].

use std::time::Duration;

use axum::Router;
use axum::extract::connect_info::Connected;
use axum::extract::{DefaultBodyLimit, Request};
use axum::http::{HeaderValue, Method, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::serve::IncomingStream;
use dlock_contract::Json;
use dlock_contract::error::{ApiError, ErrorCode};
use dlock_contract::http::{JSON_CONTENT_TYPE, METRICS_CONTENT_TYPE, envelope_for};

use utoipa_axum::router::OpenApiRouter;

use crate::auth::Authenticator;
use crate::openapi::BatchEndpoints;

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

/// What every service serves with: where it listens, the limits of a request, TLS on the
/// listener and who may call. Each service's configuration fills it in (`server.listen`,
/// `server.tls.*` through [`crate::tls::TlsSettings::from_raw`], `auth.*`).
#[derive(Debug, Clone)]
pub struct Served {
    /// `server.listen`.
    pub listen: std::net::SocketAddr,
    /// `server.body-limit-bytes` and `server.request-timeout-ms`.
    pub http: HttpLimits,
    /// `server.tls.*`: TLS on the listener when set.
    pub tls: Option<crate::tls::TlsSettings>,
    /// `auth.*`: who may call.
    pub auth: Authenticator,
}

impl Served {
    /// `server.*` and `auth.*` of a service whose bodies are small JSON (`server.body-limit-bytes`
    /// 16 KiB by default, at most 1 MiB) and whose operator-only calls take `operator_token`
    /// besides the operator identities, refused to everybody when neither is set.
    pub fn from_raw(
        raw: &mut crate::config::RawConfig,
        listen: std::net::SocketAddr,
        request_timeout: Duration,
        operator_token: Option<&str>,
    ) -> Result<Self, crate::config::ConfigError> {
        let body_bytes_max = raw.integer("server.body-limit-bytes", 16 * 1024, 1024..=1 << 20)?;
        let auth = Authenticator::new(
            &crate::auth::AuthSettings::from_raw(raw)?,
            operator_token,
            crate::auth::OperatorWithoutAuth::Refused,
        )?;
        Ok(Self {
            listen,
            http: HttpLimits {
                body_bytes_max: body_bytes_max as usize,
                request_timeout,
            },
            tls: crate::tls::TlsSettings::from_raw(raw)?,
            auth,
        })
    }

    /// Opens the listener on `server.listen`.
    pub async fn bind(&self) -> std::io::Result<tokio::net::TcpListener> {
        let listen = self.listen;
        tokio::net::TcpListener::bind(listen).await.map_err(|e| {
            std::io::Error::new(
                e.kind(),
                format!("cannot listen on {listen} (server.listen): {e}"),
            )
        })
    }

    /// A service's router: its `routes` (each with its operation, `GET /readyz` among them),
    /// then `GET /metrics` answered by `metrics`, then the tail of [`service`] with this
    /// listener's credential check and limits.
    pub fn app<S, M, MT>(
        &self,
        routes: OpenApiRouter<S>,
        state: S,
        batches: &BatchEndpoints,
        metrics: M,
    ) -> axum::Router
    where
        S: Clone + Send + Sync + 'static,
        M: axum::handler::Handler<MT, S>,
        MT: 'static,
    {
        let routes = routes.route("/metrics", axum::routing::get(metrics));
        service(routes, state, batches, &self.auth, self.http)
    }

    /// Says once what `service` checks (see [`crate::announce`]), then serves `app` on
    /// `listener`, over TLS when configured, until SIGINT or SIGTERM; then drains in-flight
    /// requests and stops the service's background `sweeper`.
    pub async fn serve(
        &self,
        service: &str,
        proof_keys: Option<&crate::proof::ProofKeys>,
        listener: tokio::net::TcpListener,
        app: axum::Router,
        sweeper: tokio::task::JoinHandle<()>,
    ) -> std::io::Result<()> {
        crate::announce(service, &self.auth, proof_keys);
        serve_until_signal(listener, self.tls.as_ref(), app).await?;
        sweeper.abort();
        Ok(())
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
/// Gives every response the JSON content type unless it set its own non-JSON one (`/metrics`).
/// Bodiless responses (204) get it too, so no client ever has to special-case a response.
/// An error answered in anything but JSON (axum's own rejections are plain text) becomes the
/// contract's envelope: every non-2xx carries it (docs/contract.md#error-envelope).
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

/// The tail every service's router shares: `GET /healthz` ([`healthz`]) with its operation, the
/// service's OpenAPI [`document`] at `GET /v1/openapi.json`, the state, the `batches`
/// ([`crate::batch`]), the credential check in front of every route, then [`finish`].
pub fn service<S: Clone + Send + Sync + 'static>(
    routes: OpenApiRouter<S>,
    state: S,
    batches: &BatchEndpoints,
    auth: &Authenticator,
    limits: HttpLimits,
) -> Router {
    let (routes, document) = with_health(routes).split_for_parts();
    let document = std::sync::Arc::new(crate::openapi::published(document));
    let routes = routes
        .route(
            dlock_contract::openapi::PATH,
            get(move || {
                let document = document.clone();
                async move { dlock_contract::openapi::response(&document) }
            }),
        )
        .with_state(state);
    let singles = singles(routes.clone(), limits);
    let routes = batches
        .routes()
        .into_iter()
        .fold(routes, |routes, add| add(routes, singles.clone()));
    finish(auth.protect(routes), limits)
}

/// The OpenAPI document of a service whose own routes are `routes` (each with its operation):
/// theirs and `GET /healthz`'s, as [`service`] serves it ([`crate::openapi::published`]).
pub fn document<S: Clone + Send + Sync + 'static>(
    routes: OpenApiRouter<S>,
) -> utoipa::openapi::OpenApi {
    crate::openapi::published(with_health(routes).into_openapi())
}

/// `routes` and `GET /healthz` ([`healthz`]), every service's.
fn with_health<S: Clone + Send + Sync + 'static>(routes: OpenApiRouter<S>) -> OpenApiRouter<S> {
    routes.routes(utoipa_axum::routes!(healthz))
}

/// The routes a batch's items run through ([`crate::batch`]): the service's own, with the
/// envelope for every error and a span per item; the credential check, the body limit and the
/// deadline are the batch request's.
fn singles(routes: Router, limits: HttpLimits) -> Router {
    let body_bytes_max = limits.body_bytes_max;
    routes
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(middleware::from_fn(move |req, next| {
            json_content_type(body_bytes_max, req, next)
        }))
        .layer(middleware::from_fn(crate::trace::middleware))
}

/// Process up.
#[utoipa::path(get, path = "/healthz", responses((status = 200, body = serde_json::Value)))]
pub async fn healthz() -> Json<serde_json::Value> {
    Json(serde_json::json!({ "status": "ok" }))
}

/// `GET /readyz`: ready when `check` passed (the answer is `ready`); otherwise the contract's
/// `code` (NOT_LEADER for the lock server and the payment resource) naming `what` was checked,
/// and the failure in the log.
pub fn readiness<E: std::fmt::Display>(
    check: Result<(), E>,
    ready: serde_json::Value,
    code: ErrorCode,
    what: &str,
) -> Response {
    match check {
        Ok(()) => dlock_contract::http::json_response(axum::http::StatusCode::OK, &ready),
        Err(error) => {
            tracing::warn!(event = "not_ready", %error, "{what} check failed");
            ApiError::new(
                code,
                format!("{what} is not ready for writes; this replica should not receive traffic"),
            )
            .into_response()
        }
    }
}

/// `GET /metrics`: `text` (the OpenMetrics encoding) with its own content type.
pub fn metrics_response(text: String) -> Response {
    ([(header::CONTENT_TYPE, METRICS_CONTENT_TYPE)], text).into_response()
}

/// Serves a service's `app` on `listener`, over TLS when `tls` is set, until SIGINT or SIGTERM;
/// then drains in-flight requests.
pub async fn serve_until_signal(
    listener: tokio::net::TcpListener,
    tls: Option<&crate::tls::TlsSettings>,
    app: Router,
) -> std::io::Result<()> {
    serve_maybe_tls(listener, tls, app, shutdown_signal()).await
}

/// The TCP peer of a request's connection, as `ConnectInfo<PeerAddr>` (the same over plain
/// HTTP and TLS).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeerAddr(pub std::net::SocketAddr);

impl Connected<IncomingStream<'_, tokio::net::TcpListener>> for PeerAddr {
    fn connect_info(stream: IncomingStream<'_, tokio::net::TcpListener>) -> Self {
        Self(*stream.remote_addr())
    }
}

impl Connected<IncomingStream<'_, crate::tls::TlsListener>> for PeerAddr {
    fn connect_info(stream: IncomingStream<'_, crate::tls::TlsListener>) -> Self {
        Self(*stream.remote_addr())
    }
}

/// Serves `app` on `listener` until `shutdown` resolves, then drains in-flight requests. Every
/// request carries its TCP peer's address (`ConnectInfo<PeerAddr>`: the auth layer budgets
/// TokenReviews per source address).
pub async fn serve(
    listener: tokio::net::TcpListener,
    app: Router,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    axum::serve(
        listener,
        app.into_make_service_with_connect_info::<PeerAddr>(),
    )
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
            axum::serve(
                listener,
                app.into_make_service_with_connect_info::<PeerAddr>(),
            )
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
    use axum::http::StatusCode;
    use axum::routing::post;
    use serde_json::Value;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[derive(serde::Deserialize)]
    #[allow(dead_code)]
    struct Page {
        limit: u32,
    }

    /// A service built the way every dlock service is, on a real port.
    async fn service() -> String {
        let routes = Router::new()
            .route(
                "/v1/payouts/{payout_id}",
                get(|Path(id): Path<String>| async move { dlock_contract::Json(id) }),
            )
            .route(
                "/v1/counts/{n}",
                get(|Path(n): Path<u32>| async move { dlock_contract::Json(n) }),
            )
            .route(
                "/v1/pages",
                get(|Query(page): Query<Page>| async move { dlock_contract::Json(page.limit) }),
            )
            .route(
                "/v1/raw",
                post(|body: bytes::Bytes| async move { dlock_contract::Json(body.len()) }),
            )
            .route(
                "/v1/json",
                post(
                    |dlock_contract::Json(v): dlock_contract::Json<Value>| async move {
                        dlock_contract::Json(v)
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
        let http = dlock_contract::client::http_client().unwrap_or_else(|e| panic!("{e}"));
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
}
