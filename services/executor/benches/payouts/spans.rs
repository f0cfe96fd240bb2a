//! Span timings: every `payout cycle` span (one per payout cycle) and every server `request`
//! span (by route; an item of a batch request under [`in_batch`] of its route, apart from the
//! route's own requests), recorded from creation to close, for p50/p99 and the per-hop
//! breakdown.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use tracing::span::{Attributes, Id};
use tracing::subscriber::Interest;
use tracing::{Metadata, Subscriber};
use tracing_subscriber::layer::Context;
use tracing_subscriber::registry::LookupSpan;

pub static TIMES: Mutex<BTreeMap<String, Vec<Duration>>> = Mutex::new(BTreeMap::new());

struct Started(Instant, String);

pub struct Timing;

/// What the route of every batch request's span starts with (docs/contract.md#batches).
const BATCH_ROUTES: &str = "POST /v1/batches/";

/// The name under which the items of batch requests that stand for requests of `route` are
/// recorded: each item runs through the service's own routes in a `request` span of its own,
/// inside the batch request's span.
pub fn in_batch(route: &str) -> String {
    format!("{route} in a batch")
}

#[derive(Default)]
struct Name(Option<String>);

impl tracing::field::Visit for Name {
    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        if field.name() == "otel.name" {
            self.0 = Some(format!("{value:?}"));
        }
    }
}

impl<S: Subscriber + for<'a> LookupSpan<'a>> tracing_subscriber::Layer<S> for Timing {
    fn register_callsite(&self, meta: &'static Metadata<'static>) -> Interest {
        if meta.is_span() && matches!(meta.name(), "payout cycle" | "request") {
            Interest::always()
        } else {
            Interest::never()
        }
    }

    fn on_new_span(&self, attrs: &Attributes<'_>, id: &Id, ctx: Context<'_, S>) {
        let mut name = Name::default();
        attrs.record(&mut name);
        let name = name.0.unwrap_or_else(|| attrs.metadata().name().to_owned());
        // Concrete paths name one payout: keep the route's shape only.
        let name = name
            .split('/')
            .map(|seg| if seg.len() > 30 { "{id}" } else { seg })
            .collect::<Vec<_>>()
            .join("/");
        if let Some(span) = ctx.span(id) {
            let batched = span.parent().is_some_and(|parent| {
                parent
                    .extensions()
                    .get::<Started>()
                    .is_some_and(|Started(_, parent)| parent.starts_with(BATCH_ROUTES))
            });
            let name = if batched { in_batch(&name) } else { name };
            span.extensions_mut().insert(Started(Instant::now(), name));
        }
    }

    fn on_close(&self, id: Id, ctx: Context<'_, S>) {
        if let Some(span) = ctx.span(&id)
            && let Some(Started(at, name)) = span.extensions_mut().remove::<Started>()
        {
            let mut times = TIMES.lock().unwrap_or_else(|e| e.into_inner());
            times.entry(name).or_default().push(at.elapsed());
        }
    }
}

pub fn take() -> BTreeMap<String, Vec<Duration>> {
    std::mem::take(&mut *TIMES.lock().unwrap_or_else(|e| e.into_inner()))
}

pub fn quantile(sorted: &[Duration], q: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    sorted[((sorted.len() - 1) as f64 * q).round() as usize]
}
