//! Trace ids. Every request runs inside a W3C trace: the caller's `traceparent` when it sends a
//! valid one, a fresh trace otherwise. Error bodies carry the trace id and every log line of the
//! request is inside a span that names it, so one `traceId` from a client finds the server's logs.
//!
//! When the process exports spans (OTLP, set up by the `dlock` binary), the same ids are the
//! spans' ids: a request's span is the child of the caller's span named in `traceparent`, an
//! outgoing call names the current span as its parent, and a root span started inside [`scope`]
//! takes the scope's trace id ([`scoped_trace_id`], read by the binary's id generator), so the
//! `traceId` of an error envelope finds its trace in the tracing backend. A service's request
//! middleware is `dlock_server::trace`.

use opentelemetry::trace::{SpanContext, SpanId, TraceContextExt, TraceFlags, TraceId, TraceState};
use rand::RngCore;
use tracing_opentelemetry::OpenTelemetrySpanExt;

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

/// The trace id of the enclosing [`scope`], if there is one.
pub fn scoped_trace_id() -> Option<String> {
    TRACE.try_with(|t| t.trace_id.clone()).ok()
}

/// A `traceparent` for an outgoing call. When spans are exported, the current span is the
/// parent; otherwise the call names the given trace (or the current one) and a fresh span id.
pub fn outgoing_traceparent(trace_id: Option<&str>) -> String {
    let context = tracing::Span::current().context();
    let current = context.span().span_context().clone();
    if current.is_valid() {
        return format!(
            "00-{}-{}-{:02x}",
            current.trace_id(),
            current.span_id(),
            current.trace_flags().to_u8()
        );
    }
    let trace_id = trace_id.map(str::to_owned).unwrap_or_else(current_trace_id);
    format!("00-{trace_id}-{}-01", new_span_id())
}

/// The caller's span as the remote parent of a request's span.
pub fn remote_parent(header: &str) -> Option<opentelemetry::Context> {
    let ctx = parse_traceparent(header)?;
    let flags = header.trim().rsplit('-').next()?;
    let sampled = u8::from_str_radix(flags, 16).ok()? & 1 == 1;
    let span_context = SpanContext::new(
        TraceId::from_hex(&ctx.trace_id).ok()?,
        SpanId::from_hex(ctx.parent_span_id.as_deref()?).ok()?,
        if sampled {
            TraceFlags::SAMPLED
        } else {
            TraceFlags::default()
        },
        true,
        TraceState::default(),
    );
    Some(opentelemetry::Context::new().with_remote_span_context(span_context))
}

/// Runs `fut` inside the given trace, so errors built in it carry its id.
pub async fn scope<F: std::future::Future>(ctx: TraceContext, fut: F) -> F::Output {
    TRACE.scope(ctx, fut).await
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
