//! Logs and traces of every dlock process.
//!
//! Logs go to stderr: JSON lines for the services and the operator, text for the commands people
//! run, colours only on a terminal. Spans are exported over OTLP when the standard
//! `OTEL_EXPORTER_OTLP_ENDPOINT` (or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) is set, with
//! `OTEL_EXPORTER_OTLP_PROTOCOL` `http/protobuf` (the default, port 4318) or `grpc` (port 4317);
//! `OTEL_SERVICE_NAME` overrides the service name, `OTEL_SDK_DISABLED=true` turns export off.
//! One payout is one trace: its trace id is the payout id's 32 hex digits (see
//! `dlock_contract::trace`), and the id generator below gives a root span started inside a
//! trace scope that id.

use opentelemetry::trace::{SpanId, TraceId, TracerProvider as _};
use opentelemetry_otlp::{Protocol, WithExportConfig};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::trace::{IdGenerator, RandomIdGenerator, SdkTracerProvider};
use tracing_subscriber::filter::{EnvFilter, LevelFilter, Targets};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{Layer, Registry};

/// Flushes the exported spans when dropped (the batch exporter holds up to a few seconds).
pub struct Telemetry {
    provider: Option<SdkTracerProvider>,
}

impl Drop for Telemetry {
    fn drop(&mut self) {
        if let Some(provider) = self.provider.take()
            && let Err(error) = provider.shutdown()
        {
            eprintln!("dlock: could not flush the last spans to the OTLP endpoint: {error}");
        }
    }
}

/// Root spans inside a `dlock_contract::trace::scope` take the scope's trace id.
#[derive(Debug)]
struct ScopedTraceIds(RandomIdGenerator);

impl IdGenerator for ScopedTraceIds {
    fn new_trace_id(&self) -> TraceId {
        dlock_contract::trace::scoped_trace_id()
            .and_then(|hex| TraceId::from_hex(&hex).ok())
            .unwrap_or_else(|| self.0.new_trace_id())
    }

    fn new_span_id(&self) -> SpanId {
        self.0.new_span_id()
    }
}

fn env_set(name: &str) -> bool {
    std::env::var(name).is_ok_and(|v| !v.trim().is_empty())
}

/// Whether the environment asks for spans to be exported.
fn export_wanted() -> bool {
    let disabled = std::env::var("OTEL_SDK_DISABLED").is_ok_and(|v| v.eq_ignore_ascii_case("true"));
    !disabled
        && (env_set("OTEL_EXPORTER_OTLP_ENDPOINT") || env_set("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))
}

fn tracer_provider(service_name: &str) -> Result<SdkTracerProvider, String> {
    // The exporter's HTTP client is rustls without a built-in provider: ring, as everywhere.
    dlock_contract::tls::install_crypto_provider();
    let protocol = std::env::var("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        .or_else(|_| std::env::var("OTEL_EXPORTER_OTLP_PROTOCOL"))
        .unwrap_or_else(|_| "http/protobuf".to_owned());
    // The builders read the endpoint, headers and timeout from the standard variables.
    let exporter = match protocol.as_str() {
        "grpc" => opentelemetry_otlp::SpanExporter::builder()
            .with_tonic()
            .build(),
        "http/protobuf" => opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_protocol(Protocol::HttpBinary)
            .build(),
        other => {
            return Err(format!(
                "OTEL_EXPORTER_OTLP_PROTOCOL={other} is not supported: use http/protobuf or grpc"
            ));
        }
    }
    .map_err(|e| format!("the OTLP exporter could not be built: {e}"))?;
    let mut resource = Resource::builder();
    if !env_set("OTEL_SERVICE_NAME") {
        resource = resource.with_service_name(service_name.to_owned());
    }
    Ok(SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_id_generator(ScopedTraceIds(RandomIdGenerator::default()))
        .with_resource(resource.build())
        .build())
}

/// Sets up logging, and span export when asked for. `default_filter` applies to the logs when
/// `DLOCK_LOG` (or `RUST_LOG`) is unset; exported spans are dlock's own at info and above.
pub fn init(default_filter: &str, json_by_default: bool, service_name: &str) -> Telemetry {
    let filter = EnvFilter::try_from_env("DLOCK_LOG")
        .or_else(|_| EnvFilter::try_from_default_env())
        .unwrap_or_else(|_| EnvFilter::new(default_filter));
    // Services log JSON lines for machines; commands people run log text unless told otherwise.
    let json = std::env::var("DLOCK_LOG_FORMAT")
        .map(|f| f != "text")
        .unwrap_or(json_by_default);
    // Colour codes only where a person reads a terminal: a CI log or `2> file` gets plain text.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let logs = if json {
        tracing_subscriber::fmt::layer()
            .json()
            .flatten_event(true)
            .with_current_span(true)
            .with_span_list(false)
            .with_writer(std::io::stderr)
            .with_filter(filter)
            .boxed()
    } else {
        tracing_subscriber::fmt::layer()
            .with_ansi(ansi)
            .with_writer(std::io::stderr)
            .with_filter(filter)
            .boxed()
    };
    let mut problem = None;
    let provider = if export_wanted() {
        match tracer_provider(service_name) {
            Ok(provider) => Some(provider),
            Err(e) => {
                problem = Some(e);
                None
            }
        }
    } else {
        None
    };
    let spans = provider.as_ref().map(|provider| {
        tracing_opentelemetry::layer()
            .with_tracer(provider.tracer("dlock"))
            .with_filter(
                Targets::new()
                    .with_default(LevelFilter::OFF)
                    .with_target("dlock", LevelFilter::INFO),
            )
    });
    Registry::default().with(logs).with(spans).init();
    if let Some(problem) = problem {
        tracing::warn!(event = "otlp_disabled", "{problem}; spans are not exported");
    }
    Telemetry { provider }
}
