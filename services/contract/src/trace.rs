//! Trace ids. Every request runs inside a W3C trace: the caller's `traceparent` when it sends a
//! valid one, a fresh trace otherwise. Error bodies carry the trace id and every log line of the
//! request is inside a span that names it, so one `traceId` from a client finds the server's logs.

use axum::extract::Request;
use axum::middleware::Next;
use axum::response::Response;
use rand::RngCore;
use tracing::Instrument;

#[derive(Debug, Clone)]
pub struct TraceContext {
    pub trace_id: String,
    pub parent_span_id: Option<String>,
}

tokio::task_local! {
    static TRACE: TraceContext;
}

fn random_hex(bytes: usize) -> String {
    let mut buf = vec![0u8; bytes];
    rand::rng().fill_bytes(&mut buf);
    buf.iter().map(|b| format!("{b:02x}")).collect()
}

pub fn new_trace_id() -> String {
    random_hex(16)
}

pub fn new_span_id() -> String {
    random_hex(8)
}

fn is_lower_hex(s: &str, len: usize) -> bool {
    s.len() == len
        && s.bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
        && s.bytes().any(|b| b != b'0')
}

/// Parses `00-<trace-id>-<parent-id>-<flags>`; anything else is ignored, as W3C asks.
pub fn parse_traceparent(value: &str) -> Option<TraceContext> {
    let mut parts = value.trim().split('-');
    let version = parts.next()?;
    let trace_id = parts.next()?;
    let parent = parts.next()?;
    let flags = parts.next()?;
    if version != "00" || parts.next().is_some() || flags.len() != 2 {
        return None;
    }
    if !is_lower_hex(trace_id, 32) || !is_lower_hex(parent, 16) {
        return None;
    }
    Some(TraceContext {
        trace_id: trace_id.to_owned(),
        parent_span_id: Some(parent.to_owned()),
    })
}

/// The trace id of the request being served, or a fresh one outside a request.
pub fn current_trace_id() -> String {
    TRACE
        .try_with(|t| t.trace_id.clone())
        .unwrap_or_else(|_| new_trace_id())
}

/// A `traceparent` for an outgoing call: the current trace, a new span.
pub fn outgoing_traceparent(trace_id: Option<&str>) -> String {
    let trace_id = trace_id.map(str::to_owned).unwrap_or_else(current_trace_id);
    format!("00-{trace_id}-{}-01", new_span_id())
}

/// Runs `fut` inside the given trace, so errors built in it carry its id.
pub async fn scope<F: std::future::Future>(ctx: TraceContext, fut: F) -> F::Output {
    TRACE.scope(ctx, fut).await
}

/// Axum middleware: sets up the request's trace and its span.
pub async fn middleware(request: Request, next: Next) -> Response {
    let ctx = request
        .headers()
        .get(crate::headers::TRACEPARENT)
        .and_then(|v| v.to_str().ok())
        .and_then(parse_traceparent)
        .unwrap_or_else(|| TraceContext {
            trace_id: new_trace_id(),
            parent_span_id: None,
        });
    let span = tracing::info_span!(
        "request",
        method = %request.method(),
        path = %request.uri().path(),
        trace_id = %ctx.trace_id,
    );
    TRACE.scope(ctx, next.run(request).instrument(span)).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn traceparent_is_parsed_strictly() {
        let ok = parse_traceparent("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01");
        assert_eq!(
            ok.map(|c| c.trace_id).as_deref(),
            Some("4bf92f3577b34da6a3ce929d0e0e4736")
        );
        for bad in [
            "",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
        ] {
            assert!(parse_traceparent(bad).is_none(), "{bad}");
        }
    }
}
