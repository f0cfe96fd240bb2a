//! Traces over OTLP, received by a real OpenTelemetry backend: Jaeger v2 (an OpenTelemetry
//! Collector distribution with in-memory storage), built from its Go module by `scripts/otel-bin`
//! (`DLOCK_JAEGER_BIN`, else the script's cache). The services of `dlock dev up` export over
//! OTLP/HTTP and `dlock run` over OTLP/gRPC, the two protocols of the standard variables; the
//! test reads the trees back through Jaeger's query API.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use dlock_contract::payment::{CreateAccountRequest, FundRequest};
use dlock_contract::payment_client::PaymentClient;
use dlock_devstack::{ManagedChild, free_port, spawn_logged};
use reqwest::Method;
use serde_json::Value;

use crate::auth::{DevStack, run_logged};
use crate::harness::{eventually, raw};

fn jaeger_bin() -> PathBuf {
    let path = std::env::var_os("DLOCK_JAEGER_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            let home = std::env::var_os("HOME").unwrap_or_default();
            Path::new(&home).join(".cache/dlock/otel-bin/jaeger-v1.75.0/jaeger")
        });
    assert!(
        path.is_file(),
        "the trace test needs Jaeger at {}: build it with scripts/otel-bin (Go >= 1.26) or set \
         DLOCK_JAEGER_BIN",
        path.display()
    );
    path
}

/// A Jaeger process on free loopback ports: OTLP over HTTP and gRPC in, the query API out.
struct Jaeger {
    _child: ManagedChild,
    _dir: tempfile::TempDir,
    otlp_http: String,
    otlp_grpc: String,
    query: String,
}

impl Jaeger {
    async fn start() -> Self {
        dlock_contract::tls::install_crypto_provider();
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let port = || free_port().unwrap_or_else(|e| panic!("{e:#}"));
        let (http, grpc, query, query_grpc) = (port(), port(), port(), port());
        let config = format!(
            "service:
  extensions: [jaeger_storage, jaeger_query]
  pipelines:
    traces:
      receivers: [otlp]
      exporters: [jaeger_storage_exporter]
  telemetry:
    metrics:
      level: none
    logs:
      level: warn
extensions:
  jaeger_storage:
    backends:
      memstore:
        memory:
          max_traces: 10000
  jaeger_query:
    storage:
      traces: memstore
    http:
      endpoint: 127.0.0.1:{query}
    grpc:
      endpoint: 127.0.0.1:{query_grpc}
receivers:
  otlp:
    protocols:
      http:
        endpoint: 127.0.0.1:{http}
      grpc:
        endpoint: 127.0.0.1:{grpc}
exporters:
  jaeger_storage_exporter:
    trace_storage: memstore
"
        );
        let file = dir.path().join("jaeger.yaml");
        std::fs::write(&file, config).unwrap_or_else(|e| panic!("{e}"));
        let args = vec!["--config".to_owned(), format!("file:{}", file.display())];
        let log = dir.path().join("jaeger.log");
        let child = spawn_logged("jaeger", &jaeger_bin(), &args, &[], Some(&log))
            .unwrap_or_else(|e| panic!("{e:#}"));
        let jaeger = Self {
            _child: child,
            _dir: dir,
            otlp_http: format!("http://127.0.0.1:{http}"),
            otlp_grpc: format!("http://127.0.0.1:{grpc}"),
            query: format!("http://127.0.0.1:{query}"),
        };
        let services = format!("{}/api/services", jaeger.query);
        eventually(
            "Jaeger's query API answers",
            Duration::from_secs(30),
            || async {
                let answer = reqwest::get(&services).await.ok()?;
                answer.status().is_success().then_some(())
            },
        )
        .await;
        jaeger
    }

    /// The trace's spans once `until` holds for them, keyed by span id.
    async fn trace(
        &self,
        trace_id: &str,
        until: impl Fn(&[Span]) -> bool,
    ) -> BTreeMap<String, Span> {
        let url = format!("{}/api/traces/{trace_id}", self.query);
        let spans = eventually(
            &format!("trace {trace_id} in Jaeger"),
            Duration::from_secs(30),
            || {
                let url = url.clone();
                let until = &until;
                async move {
                    let answer = reqwest::get(&url).await.ok()?;
                    let body: Value = answer.json().await.ok()?;
                    let spans = Span::all(body.get("data")?.get(0)?);
                    until(&spans).then_some(spans)
                }
            },
        )
        .await;
        spans.into_iter().map(|s| (s.id.clone(), s)).collect()
    }
}

/// One span as Jaeger's query API shows it.
#[derive(Debug, Clone)]
struct Span {
    id: String,
    trace_id: String,
    parent: Option<String>,
    service: String,
    name: String,
    tags: BTreeMap<String, Value>,
}

impl Span {
    fn all(trace: &Value) -> Vec<Span> {
        let processes = &trace["processes"];
        trace["spans"]
            .as_array()
            .map(Vec::as_slice)
            .unwrap_or_default()
            .iter()
            .map(|s| Span {
                id: s["spanID"].as_str().unwrap_or_default().to_owned(),
                trace_id: s["traceID"].as_str().unwrap_or_default().to_owned(),
                parent: s["references"]
                    .as_array()
                    .and_then(|refs| refs.iter().find(|r| r["refType"] == "CHILD_OF"))
                    .and_then(|r| r["spanID"].as_str())
                    .map(str::to_owned),
                service: processes[s["processID"].as_str().unwrap_or_default()]["serviceName"]
                    .as_str()
                    .unwrap_or_default()
                    .to_owned(),
                name: s["operationName"].as_str().unwrap_or_default().to_owned(),
                tags: s["tags"]
                    .as_array()
                    .map(Vec::as_slice)
                    .unwrap_or_default()
                    .iter()
                    .filter_map(|t| Some((t["key"].as_str()?.to_owned(), t["value"].clone())))
                    .collect(),
            })
            .collect()
    }

    /// A tag's value as text, whatever type Jaeger gave it.
    fn tag(&self, key: &str) -> Option<String> {
        self.tags.get(key).map(|v| match v {
            Value::String(s) => s.clone(),
            other => other.to_string(),
        })
    }
}

fn find<'a>(spans: &'a BTreeMap<String, Span>, service: &str, name: &str) -> &'a Span {
    spans
        .values()
        .find(|s| s.service == service && s.name == name)
        .unwrap_or_else(|| {
            let seen: Vec<_> = spans
                .values()
                .map(|s| format!("{} {}", s.service, s.name))
                .collect();
            panic!("no span {service} {name:?} in the trace; it has {seen:?}")
        })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_payout_is_one_trace_from_the_executor_to_the_rail_and_an_error_names_its_trace() {
    let jaeger = Jaeger::start().await;
    let stack = DevStack::start_with_env(&[
        ("OTEL_EXPORTER_OTLP_ENDPOINT", jaeger.otlp_http.as_str()),
        ("OTEL_BSP_SCHEDULE_DELAY", "100"),
    ]);
    let (lock, payment, _) = stack.services();
    let executor = stack.token("executor");

    // One account, funded, and a batch of one payout.
    let client = PaymentClient::new(&payment, "executor/trace-test")
        .unwrap_or_else(|e| panic!("{e}"))
        .with_credential(Some(dlock_contract::auth::Credential::fixed(&executor)));
    let account = CreateAccountRequest {
        account_id: "acct-trace".to_owned(),
        currency: "EUR".to_owned(),
    };
    // Only the treasury opens and funds accounts; the executor's client reads.
    let treasury = stack.treasury_payments();
    treasury
        .create_account("trace-open", &account)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let fund = FundRequest {
        amount_minor: 10_000,
        reference: "trace-fund".to_owned(),
    };
    treasury
        .fund("acct-trace", "trace-fund", &fund)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let batch = dir.path().join("batch.yaml");
    std::fs::write(
        &batch,
        "apiVersion: dlock.io/v1alpha1\nkind: PayoutBatch\nmetadata:\n  name: traced\nspec:\n  \
         workers: 1\n  payouts:\n    - key: one\n      accountId: acct-trace\n      \
         amountMinor: 1250\n      currency: EUR\n      beneficiaryRef: ben-1\n",
    )
    .unwrap_or_else(|e| panic!("{e}"));
    let args = stack.run_args(&batch.display().to_string(), &[]);
    // The executor exports over gRPC, the services over HTTP: both protocols reach one trace.
    let mut env = stack.run_env();
    env.extend([
        (
            "OTEL_EXPORTER_OTLP_ENDPOINT".to_owned(),
            jaeger.otlp_grpc.clone(),
        ),
        ("OTEL_EXPORTER_OTLP_PROTOCOL".to_owned(), "grpc".to_owned()),
    ]);
    let log = dir.path().join("run.log");
    let (ok, output) = run_logged(&args, &env, &log, Duration::from_secs(60)).await;
    assert!(ok, "dlock run: {output}");
    let page = client
        .list_payouts(None, Some("acct-trace"), Some(10), None)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let [payout] = page.items.as_slice() else {
        panic!("one payout registered: {:?}", page.items);
    };
    assert_eq!(payout.state.as_str(), "POSTED", "{output}");

    // The payout's trace id is its id; every process's spans arrive in it.
    let trace_id = payout.payout_id.simple().to_string();
    // Each process exports on its own schedule: wait for every span asserted below.
    let expected = [
        ("dlock-executor", "payout cycle"),
        ("dlock-lock-server", "POST /v1/locks/{key}/acquire"),
        (
            "dlock-payment-resource",
            "POST /v1/payouts/{payout_id}/claim",
        ),
        (
            "dlock-payment-resource",
            "POST /v1/payouts/{payout_id}/post",
        ),
        ("dlock-rail-proxy", "POST /v1/rail/submissions"),
        ("dlock-rail-proxy", "rail submit"),
        ("dlock-rail-stub", "POST /submit"),
        ("dlock-lock-server", "DELETE /v1/locks/{key}"),
    ];
    let spans = jaeger
        .trace(&trace_id, |spans| {
            expected.iter().all(|(service, name)| {
                spans
                    .iter()
                    .any(|s| s.service == *service && s.name == *name)
            })
        })
        .await;
    assert!(spans.values().all(|s| s.trace_id == trace_id), "{spans:?}");

    // The tree: executor → lock server, payment resource, rail proxy → rail.
    let cycle = find(&spans, "dlock-executor", "payout cycle");
    assert_eq!(cycle.parent, None, "the payout cycle is the root");
    let payout_id = payout.payout_id.to_string();
    assert_eq!(cycle.tag("payout.id").as_deref(), Some(payout_id.as_str()));
    assert_eq!(cycle.tag("account.id").as_deref(), Some("acct-trace"));
    assert!(
        cycle
            .tag("owner")
            .is_some_and(|o| o.starts_with("executor/")),
        "{cycle:?}"
    );
    assert_eq!(cycle.tag("outcome").as_deref(), Some("Settled"));
    let token = cycle
        .tag("fencing.token")
        .unwrap_or_else(|| panic!("the cycle names its token: {cycle:?}"));
    assert!(token.parse::<i64>().is_ok_and(|t| t > 0), "{token}");

    let acquire = find(&spans, "dlock-lock-server", "POST /v1/locks/{key}/acquire");
    assert_eq!(acquire.parent.as_deref(), Some(cycle.id.as_str()));
    assert_eq!(
        acquire.tag("lock.key").as_deref(),
        Some("payout:acct-trace")
    );
    assert_eq!(
        acquire.tag("http.response.status_code").as_deref(),
        Some("200")
    );
    for name in [
        "POST /v1/payouts/{payout_id}/claim",
        "POST /v1/payouts/{payout_id}/post",
    ] {
        let span = find(&spans, "dlock-payment-resource", name);
        assert_eq!(span.parent.as_deref(), Some(cycle.id.as_str()), "{name}");
        assert_eq!(span.tag("payout.id").as_deref(), Some(payout_id.as_str()));
        assert_eq!(span.tag("fencing.token").as_deref(), Some(token.as_str()));
    }
    let submission = find(&spans, "dlock-rail-proxy", "POST /v1/rail/submissions");
    assert_eq!(submission.parent.as_deref(), Some(cycle.id.as_str()));
    assert_eq!(
        submission.tag("payout.id").as_deref(),
        Some(payout_id.as_str())
    );
    let forward = find(&spans, "dlock-rail-proxy", "rail submit");
    assert_eq!(forward.parent.as_deref(), Some(submission.id.as_str()));
    let rail = find(&spans, "dlock-rail-stub", "POST /submit");
    assert_eq!(rail.parent.as_deref(), Some(forward.id.as_str()));
    let release = find(&spans, "dlock-lock-server", "DELETE /v1/locks/{key}");
    assert_eq!(release.parent.as_deref(), Some(cycle.id.as_str()));

    // An error envelope's traceId finds its trace: without a traceparent (a fresh trace) and
    // with one (the caller's trace, the caller's span as the parent). The bad body goes to
    // account opening as the treasury, whose role it is, so the refusal is the body's.
    let bearer = format!("Bearer {}", stack.token("treasury"));
    let headers = [
        ("content-type", "application/json"),
        ("x-owner-id", "treasury"),
        ("x-idempotency-key", "trace-bad-body"),
        ("authorization", bearer.as_str()),
    ];
    let (status, _, body) = raw(
        Method::POST,
        &format!("{payment}/v1/accounts"),
        &headers,
        Some(r#"{"accountId": 17}"#),
    )
    .await;
    assert_eq!(status, 400, "{body}");
    let fresh = body["traceId"].as_str().unwrap_or_default().to_owned();
    assert_eq!(fresh.len(), 32, "{body}");
    let spans = jaeger
        .trace(&fresh, |spans| {
            spans.iter().any(|s| s.service == "dlock-payment-resource")
        })
        .await;
    let refused = find(&spans, "dlock-payment-resource", "POST /v1/accounts");
    assert_eq!(refused.parent, None, "{refused:?}");
    assert_eq!(
        refused.tag("http.response.status_code").as_deref(),
        Some("400")
    );

    let caller_trace = "4bf92f3577b34da6a3ce929d0e0e4736";
    let caller_span = "00f067aa0ba902b7";
    let traceparent = format!("00-{caller_trace}-{caller_span}-01");
    // A renew with a bad body, as the executor (whose role renews).
    let executor_bearer = format!("Bearer {executor}");
    let mut with_parent = vec![
        ("content-type", "application/json"),
        ("x-owner-id", "executor/trace-test"),
        ("x-idempotency-key", "trace-bad-body"),
        ("authorization", executor_bearer.as_str()),
    ];
    with_parent.push(("traceparent", traceparent.as_str()));
    let (status, _, body) = raw(
        Method::POST,
        &format!("{lock}/v1/locks/payout:acct-trace/renew"),
        &with_parent,
        Some(r#"{"sessionId": "not-a-uuid"}"#),
    )
    .await;
    assert_eq!(status, 400, "{body}");
    assert_eq!(body["traceId"], caller_trace, "{body}");
    let spans = jaeger
        .trace(caller_trace, |spans| {
            spans.iter().any(|s| s.service == "dlock-lock-server")
        })
        .await;
    let renew = find(&spans, "dlock-lock-server", "POST /v1/locks/{key}/renew");
    assert_eq!(renew.parent.as_deref(), Some(caller_span));
}
