//! The request middleware of every service: each request runs inside its W3C trace (the caller's
//! `traceparent`, or a fresh one) and a span that names what an on-call engineer searches by.

use axum::extract::Request;
use axum::middleware::Next;
use axum::response::Response;
use dlock_contract::{headers, trace};
use tracing::Instrument;
use tracing_opentelemetry::OpenTelemetrySpanExt;

/// Axum middleware: sets up the request's trace and its span. The span carries what an
/// on-call engineer searches by: the route, the owner, the fencing token, the payout and the
/// answer's status.
pub async fn middleware(request: Request, next: Next) -> Response {
    let traceparent = request
        .headers()
        .get(headers::TRACEPARENT)
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let ctx = traceparent
        .as_deref()
        .and_then(trace::parse_traceparent)
        .unwrap_or_else(|| trace::TraceContext {
            trace_id: trace::new_trace_id(),
            parent_span_id: None,
        });
    let path = request.uri().path().to_owned();
    let route = request
        .extensions()
        .get::<axum::extract::MatchedPath>()
        .map(|m| m.as_str().to_owned())
        .unwrap_or_else(|| path.clone());
    let segment = |prefix: &str| {
        path.strip_prefix(prefix)
            .and_then(|rest| rest.split('/').next())
            .filter(|s| !s.is_empty())
            .map(|s| s.chars().take(160).collect::<String>())
    };
    let payout = segment("/v1/payouts/");
    let lock_key = segment("/v1/locks/");
    let method = request.method().clone();
    let (owner, token) = {
        let header = |name: &str| {
            request
                .headers()
                .get(name)
                .and_then(|v| v.to_str().ok())
                .map(|v| v.chars().take(128).collect::<String>())
        };
        (header(headers::OWNER_ID), header(headers::FENCING_TOKEN))
    };
    let trace_id = ctx.trace_id.clone();
    trace::scope(ctx, async move {
        // Made inside the scope: a root span takes the scope's trace id.
        let span = tracing::info_span!(
            "request",
            otel.name = %format_args!("{method} {route}"),
            otel.kind = "server",
            otel.status_code = tracing::field::Empty,
            method = %method,
            path = %path,
            trace_id = %trace_id,
            owner = tracing::field::Empty,
            fencing.token = tracing::field::Empty,
            payout.id = tracing::field::Empty,
            lock.key = tracing::field::Empty,
            http.response.status_code = tracing::field::Empty,
        );
        // Attributes only where the request has them.
        for (field, value) in [
            ("owner", owner),
            ("fencing.token", token),
            ("payout.id", payout),
            ("lock.key", lock_key),
        ] {
            if let Some(value) = value {
                span.record(field, value);
            }
        }
        if let Some(parent) = traceparent.as_deref().and_then(trace::remote_parent) {
            // Ignored when no exporter is installed.
            let _ = span.set_parent(parent);
        }
        let response = next.run(request).instrument(span.clone()).await;
        let status = response.status();
        span.record("http.response.status_code", status.as_u16());
        if status.is_server_error() {
            span.record("otel.status_code", "ERROR");
        }
        response
    })
    .await
}
