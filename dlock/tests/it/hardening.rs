//! Tests of TokenReview bounds, what errors and --help never show, and envelope gaps.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use dlock_devstack::{ManagedChild, free_port, spawn_logged};
use reqwest::header::{CONTENT_TYPE, HeaderMap, RETRY_AFTER};
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::auth::DevStack;
use crate::harness::{eventually, until_ready};

const EXE: &str = env!("CARGO_BIN_EXE_dlock");
const JSON: &str = "application/json; charset=utf-8";

/// One request; its status, headers and JSON body (a body that is not JSON fails the test).
async fn send(request: reqwest::RequestBuilder) -> (u16, HeaderMap, Value) {
    let response = request.send().await.unwrap_or_else(|e| panic!("{e}"));
    let status = response.status().as_u16();
    let headers = response.headers().clone();
    let text = response.text().await.unwrap_or_default();
    let body = serde_json::from_str(&text)
        .unwrap_or_else(|e| panic!("the body of a {status} is not JSON ({e}): {text}"));
    (status, headers, body)
}

fn content_type(headers: &HeaderMap) -> &str {
    headers
        .get(CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
}

/// A `400 VALIDATION_FAILED` envelope naming `field`, in JSON with its charset.
fn assert_validation(step: &str, (status, headers, body): &(u16, HeaderMap, Value), field: &str) {
    assert_eq!(*status, 400, "{step}: {body}");
    assert_eq!(content_type(headers), JSON, "{step}");
    assert_eq!(body["code"], "VALIDATION_FAILED", "{step}: {body}");
    assert_eq!(body["retrySafe"], false, "{step}: {body}");
    assert_eq!(
        body["details"]["fields"][0]["field"], field,
        "{step}: {body}"
    );
    assert!(
        body["message"].as_str().is_some_and(|m| !m.is_empty()),
        "{step}: {body}"
    );
    assert!(
        body["traceId"].as_str().is_some_and(|t| t.len() == 32),
        "{step}: {body}"
    );
}

#[test]
fn help_names_secret_environment_variables_but_never_prints_their_values() {
    let secrets = [
        (
            "DLOCK_PAYDB",
            "postgres://pay:paydb-secret-9f2@db.internal:5432/paydb",
        ),
        ("DLOCK_OPERATOR_TOKEN", "operator-secret-7c1d"),
        (
            "DLOCK_CREDENTIAL_FILE",
            "/var/run/credential-secret-3a8/token",
        ),
    ];
    let visible = [
        ("DLOCK_PAYMENT_RESOURCE", "http://payment-visible:8080"),
        ("DLOCK_RAIL", "http://rail-visible:9090"),
        ("DLOCK_LOCK_SERVER", "http://lock-visible:7070"),
        ("POD_NAME", "pod-visible-0"),
    ];
    // (subcommand, the secret variables it reads, a non-secret variable it shows)
    let commands: [(&[&str], &[&str], &str); 5] = [
        (&["reconcile"], &["DLOCK_PAYDB"], "rail-visible"),
        (&["resolve"], &["DLOCK_OPERATOR_TOKEN"], "payment-visible"),
        (&["revoke"], &["DLOCK_OPERATOR_TOKEN"], "lock-visible"),
        (&["run"], &["DLOCK_CREDENTIAL_FILE"], "payment-visible"),
        (
            &["operator"],
            &["DLOCK_OPERATOR_TOKEN", "DLOCK_CREDENTIAL_FILE"],
            "pod-visible-0",
        ),
    ];
    for (args, reads, shown) in commands {
        let output = Command::new(EXE)
            .args(args)
            .arg("--help")
            .envs(secrets)
            .envs(visible)
            .output()
            .unwrap_or_else(|e| panic!("dlock {args:?} --help: {e}"));
        assert!(output.status.success(), "dlock {args:?} --help");
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
        for (name, value) in secrets {
            assert!(
                !text.contains(value),
                "dlock {args:?} --help shows {name}: {text}"
            );
        }
        for name in reads {
            assert!(
                text.contains(&format!("[env: {name}]")),
                "dlock {args:?} --help should still name {name}: {text}"
            );
        }
        // Positive control: a value that is no secret is still shown.
        assert!(text.contains(shown), "dlock {args:?} --help: {text}");
    }
}

/// A request whose chunked body breaks off: a chunk size that is not hexadecimal. The reply's
/// head (lower case) and body.
async fn broken_body(url: &str, path: &str, token: &str) -> (String, Value) {
    let addr = url.trim_start_matches("http://");
    let mut stream = tokio::net::TcpStream::connect(addr)
        .await
        .unwrap_or_else(|e| panic!("{addr}: {e}"));
    let request = format!(
        "POST {path} HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer {token}\r\n\
         X-Owner-Id: executor\r\nContent-Type: application/json\r\n\
         Transfer-Encoding: chunked\r\n\r\nzz\r\n{{}}\r\n"
    );
    stream
        .write_all(request.as_bytes())
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let mut reply = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut reply))
        .await
        .unwrap_or_else(|_| panic!("{path}: no reply within 10 s"))
        .unwrap_or_else(|e| panic!("{e}"));
    let reply = String::from_utf8_lossy(&reply).into_owned();
    let (head, body) = reply
        .split_once("\r\n\r\n")
        .unwrap_or_else(|| panic!("{path}: {reply}"));
    let body = serde_json::from_str(body)
        .unwrap_or_else(|e| panic!("{path}: the body is not JSON ({e}): {reply}"));
    (head.to_ascii_lowercase(), body)
}

/// A claim (the executor's write at the payment resource, docs/contract.md#roles) of a payout
/// that need not exist: the body is refused before anything is looked up.
const CLAIM: &str = "/v1/payouts/0195e3b4-0000-7000-8000-00000000c1a1/claim";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_path_segments_and_bad_bodies_get_the_envelope_on_every_service() {
    let stack = DevStack::up().await;
    let token = stack.token("executor");
    let bearer = format!("Bearer {token}");
    let http = dlock_contract::client::http_client().unwrap_or_else(|e| panic!("{e}"));
    let (lock, payment, proxy) = stack.services();
    let stub = stack.url("railStub");

    // A path segment whose percent-encoding is not UTF-8, on every route family with one.
    for (url, path, field) in [
        (&lock, "/v1/locks/%FF%FE", "key"),
        (&payment, "/v1/payouts/%FF%FE", "payoutId"),
        (&payment, "/v1/accounts/%C3%28", "accountId"),
        (&proxy, "/v1/rail/high-water/%FF", "accountId"),
    ] {
        let answer = send(
            http.get(format!("{url}{path}"))
                .header("authorization", &bearer),
        )
        .await;
        assert_validation(&format!("GET {path}"), &answer, field);
    }
    let heartbeat = send(
        http.post(format!("{lock}/v1/sessions/%FF/heartbeat"))
            .header("authorization", &bearer)
            .header("x-owner-id", "executor"),
    )
    .await;
    assert_validation("heartbeat on a bad session id", &heartbeat, "sessionId");

    // A body over the service's limit (64 KiB for the lock server, 16 KiB for the others),
    // whether the route reads it as JSON or as bytes (release).
    let big = format!("{{\"pad\":\"{}\"}}", "x".repeat(100_000));
    for (method, url, path) in [
        (reqwest::Method::POST, &lock, "/v1/sessions"),
        (reqwest::Method::DELETE, &lock, "/v1/locks/hardening:k"),
        // A write of the executor's role: the role check comes before the body is read.
        (reqwest::Method::POST, &payment, CLAIM),
        (reqwest::Method::POST, &proxy, "/v1/rail/submissions"),
        (reqwest::Method::POST, &stub, "/submit"),
    ] {
        let answer = send(
            http.request(method.clone(), format!("{url}{path}"))
                .header("authorization", &bearer)
                .header("x-owner-id", "executor")
                .header("content-type", "application/json")
                .body(big.clone()),
        )
        .await;
        assert_validation(&format!("oversize {method} {path}"), &answer, "body");
    }

    // A body that cannot be read to its end.
    for (url, path) in [
        (&lock, "/v1/sessions"),
        (&payment, CLAIM),
        (&proxy, "/v1/rail/submissions"),
        (&stub, "/submit"),
    ] {
        let (head, body) = broken_body(url, path, &token).await;
        assert!(head.starts_with("http/1.1 400"), "{path}: {head}");
        assert!(
            head.contains(&format!("content-type: {JSON}")),
            "{path}: {head}"
        );
        assert_eq!(body["code"], "VALIDATION_FAILED", "{path}: {body}");
        assert_eq!(
            body["details"]["fields"][0]["field"], "body",
            "{path}: {body}"
        );
    }

    // Positive control: the same credential and a good path are answered as usual.
    let (status, headers, body) = send(
        http.get(format!("{lock}/v1/locks/hardening:never-seen"))
            .header("authorization", &bearer),
    )
    .await;
    assert_eq!(
        (status, body["code"].as_str()),
        (404, Some("NOT_FOUND")),
        "{body}"
    );
    assert_eq!(content_type(&headers), JSON);
}

/// `dlock serve {name}` with the configuration `pairs` (in a file beside `log`).
fn serve(name: &str, pairs: Vec<(String, String)>, log: &Path) -> ManagedChild {
    let args = crate::harness::serve_args(name, &pairs, log);
    spawn_logged(name, Path::new(EXE), &args, &[], Some(log)).unwrap_or_else(|e| panic!("{e:#}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_api_server_and_a_flood_of_unknown_tokens_get_503_that_names_nothing_internal()
 {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    // An API server address nobody listens on: every review fails to connect.
    let api_port = free_port().unwrap_or_else(|e| panic!("{e}"));
    let api_url = format!("http://127.0.0.1:{api_port}");
    let own_token = dir.path().join("own-service-account-token");
    std::fs::write(&own_token, "the-stub-s-own-token").unwrap_or_else(|e| panic!("{e}"));
    let port = free_port().unwrap_or_else(|e| panic!("{e}"));
    let env: Vec<(String, String)> = [
        ("server.listen", format!("127.0.0.1:{port}")),
        ("auth.mode", "tokenreview".to_owned()),
        ("auth.tokenreview.url", api_url.clone()),
        ("auth.tokenreview.ca-file", String::new()),
        (
            "auth.tokenreview.token-file",
            own_token.display().to_string(),
        ),
        ("auth.tokenreview.reviews-per-second", "1".to_owned()),
        ("auth.tokenreview.review-burst", "2".to_owned()),
        (
            "rail.stub.statement-path",
            dir.path().join("statement.jsonl").display().to_string(),
        ),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v))
    .collect();
    let log = dir.path().join("stub.log");
    let _stub = serve("rail-stub", env, &log);
    let url = format!("http://127.0.0.1:{port}");
    until_ready("the stub", port).await;
    let http = dlock_contract::client::http_client().unwrap_or_else(|e| panic!("{e}"));
    let mut answers = Vec::new();
    for n in 0..12 {
        answers.push(
            send(
                http.post(format!("{url}/submit"))
                    .header("authorization", format!("Bearer made-up-token-{n}"))
                    .header("content-type", "application/json")
                    .body(format!(
                        r#"{{"clientRef":"flood-{n}","amountMinor":100,"currency":"EUR"}}"#
                    )),
            )
            .await,
        );
    }
    let mut throttled = 0;
    for (n, (status, headers, body)) in answers.iter().enumerate() {
        assert_eq!(*status, 503, "{n}: {body}");
        assert_eq!(content_type(headers), JSON, "{n}");
        assert_eq!(body["code"], "AUTH_UNAVAILABLE", "{n}: {body}");
        assert_eq!(body["retrySafe"], true, "{n}: {body}");
        let wait = body["retryAfterMillis"].as_u64().unwrap_or_default();
        assert!(wait > 0 && wait <= 1_000, "{n}: {body}");
        let retry_after = headers
            .get(RETRY_AFTER)
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default();
        assert_eq!(retry_after, "1", "{n}: Retry-After");
        let text = body.to_string();
        for internal in [
            api_url.as_str(),
            &api_port.to_string(),
            "127.0.0.1",
            "own-service-account-token",
            &dir.path().display().to_string(),
        ] {
            assert!(!text.contains(internal), "{n} shows {internal}: {text}");
        }
        if text.contains("too many credentials") {
            throttled += 1;
        }
    }
    // The burst of two was asked for (and failed to connect); the rest was never sent, bar
    // one more if the loop outlasted a second.
    assert!((9..=10).contains(&throttled), "{throttled} of 12 throttled");
    // The operator's log has what the callers were not told.
    let logged = eventually(
        "tokenreview_failed is logged",
        Duration::from_secs(10),
        || {
            let log = log.clone();
            async move {
                let text = std::fs::read_to_string(&log).unwrap_or_default();
                (text.contains("tokenreview_failed") && text.contains("tokenreview_throttled"))
                    .then_some(text)
            }
        },
    )
    .await;
    assert!(logged.contains(&api_url), "the log names the API server");
    // Nothing reached the rail.
    let statement = send(http.get(format!("{url}/statement"))).await.2;
    assert_eq!(
        statement["transfers"].as_array().map(Vec::len),
        Some(0),
        "{statement}"
    );
}
