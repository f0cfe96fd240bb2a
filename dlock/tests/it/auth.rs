//! Authentication and TLS, end to end: the `dlock dev up` stack (every service with
//! `auth.mode = "tokens"`), a TLS listener, and TokenReview against a stand-in Kubernetes API.
//!
//! Every refused request is checked for the envelope and the JSON content type, and the durable
//! state of paydb, lockdb and the rail's statement is compared before and after: a refused
//! request changes nothing.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use dlock_contract::payment_client::PaymentClient;
use dlock_devstack::{ManagedChild, free_port, spawn_logged};
use reqwest::Method;
use serde_json::{Value, json};
use sqlx::Row;

use crate::harness::{eventually, loopback, raw, until_ready};
use crate::shared::accounts::open_account;

use crate::shared::dev_up::DevUp;
use crate::shared::payouts::{Item, batch_manifest};

const EXE: &str = env!("CARGO_BIN_EXE_dlock");
const JSON: &str = "application/json; charset=utf-8";

/// `dlock dev up` as a process, its JSON line parsed; shared by the tests that need the stack.
pub(crate) struct DevStack(DevUp);

impl std::ops::Deref for DevStack {
    type Target = DevUp;

    fn deref(&self) -> &DevUp {
        &self.0
    }
}

impl DevStack {
    pub(crate) fn start() -> Self {
        Self::start_with_env(&[])
    }

    /// The stack with extra environment for every process of it (e.g. an OTLP endpoint).
    pub(crate) fn start_with_env(env: &[(&str, &str)]) -> Self {
        Self(DevUp::start(&[], env))
    }

    /// [`DevStack::start`], off the async runtime's threads.
    pub(crate) async fn up() -> Self {
        tokio::task::spawn_blocking(Self::start)
            .await
            .unwrap_or_else(|e| panic!("{e}"))
    }

    /// A payment client of the executor identity, with its credential.
    pub(crate) fn executor_payments(&self) -> PaymentClient {
        self.payments_as("executor/test")
    }

    /// `dlock run` of a batch `name` of `n` payouts on `account` (2 workers) as the executor
    /// identity with its credential; whether it succeeded, and its log.
    pub(crate) async fn run_batch(&self, name: &str, account: &str, n: usize) -> (bool, String) {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let text = batch_manifest(
            name,
            2,
            (0..n).map(|i| Item::numbered(i, format!("item-{i:02}"), account, 100)),
        );
        let batch = dir.path().join("batch.yaml");
        std::fs::write(&batch, text).unwrap_or_else(|e| panic!("{e}"));
        let log = dir.path().join("run.log");
        let args: Vec<String> = [
            "run",
            "-f",
            &batch.display().to_string(),
            "--lock-server",
            &self.url("lockServer"),
            "--payment-resource",
            &self.url("paymentResource"),
            "--rail-proxy",
            &self.url("railProxy"),
            "--identity",
            "executor",
        ]
        .iter()
        .map(|s| (*s).to_owned())
        .collect();
        let env = vec![("DLOCK_CREDENTIAL".to_owned(), self.token("executor"))];
        let mut run = spawn_logged("dlock run", Path::new(EXE), &args, &env, Some(&log))
            .unwrap_or_else(|e| panic!("{e:#}"));
        let status = tokio::task::spawn_blocking(move || run.wait_exit(Duration::from_secs(120)))
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        (
            status.is_some_and(|s| s.success()),
            std::fs::read_to_string(&log).unwrap_or_default(),
        )
    }

    /// The URLs of the lock server, the payment resource and the rail proxy.
    pub(crate) fn services(&self) -> (String, String, String) {
        (
            self.url("lockServer"),
            self.url("paymentResource"),
            self.url("railProxy"),
        )
    }

    /// The credentials of the executor and the operator identity.
    pub(crate) fn credentials(&self) -> (String, String) {
        (self.token("executor"), self.token("operator"))
    }

    /// A connection pool on the stack's `db` (`paydb`, `lockdb`).
    pub(crate) async fn pool(&self, db: &str) -> sqlx::PgPool {
        sqlx::PgPool::connect(&self.url(db))
            .await
            .unwrap_or_else(|e| panic!("{db}: {e}"))
    }

    /// A digest of every row of every table of paydb and lockdb, and the rail's statement.
    async fn snapshot(&self) -> Vec<(String, String)> {
        let mut out = Vec::new();
        for db in ["paydb", "lockdb"] {
            let pool = self.pool(db).await;
            let tables: Vec<String> = sqlx::query_scalar(
                "SELECT tablename::text FROM pg_tables WHERE schemaname = 'public' ORDER BY 1",
            )
            .fetch_all(&pool)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
            for table in tables {
                // The table names come from pg_tables, quoted.
                let row = sqlx::query(sqlx::AssertSqlSafe(format!(
                    "SELECT count(*)::text AS n, \
                     coalesce(md5(string_agg(t::text, '|' ORDER BY t::text)), '') AS d \
                     FROM \"{table}\" t"
                )))
                .fetch_one(&pool)
                .await
                .unwrap_or_else(|e| panic!("{table}: {e}"));
                let n: String = row.get("n");
                let d: String = row.get("d");
                out.push((format!("{db}.{table}"), format!("{n}:{d}")));
            }
            pool.close().await;
        }
        let (_, _, statement) = raw(
            Method::GET,
            &format!("{}/statement", self.url("railStub")),
            &[],
            None,
        )
        .await;
        out.push(("rail statement".into(), statement.to_string()));
        out
    }
}

fn assert_refused(step: &str, answer: &(u16, String, Value), status: u16, code: &str) {
    let (got, content_type, body) = answer;
    assert_eq!(*got, status, "{step}: {body}");
    assert_eq!(content_type, JSON, "{step}: content type");
    assert_eq!(body["code"], code, "{step}: {body}");
    assert!(
        body["message"].as_str().is_some_and(|m| !m.is_empty()),
        "{step}: the envelope says what happened: {body}"
    );
    assert_eq!(
        body["retrySafe"],
        json!(code == "AUTH_UNAVAILABLE"),
        "{step}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_the_dev_stack_every_write_needs_a_credential_and_a_refusal_changes_nothing() {
    let stack = DevStack::up().await;
    let (lock, payment, proxy) = stack.services();
    let stub = stack.url("railStub");
    let (executor, operator) = stack.credentials();

    // Some state to protect: an account with funds, opened by the treasury.
    let client = stack.executor_payments();
    open_account(&stack.treasury_payments(), "acct-a", Some(100_000)).await;
    let before = stack.snapshot().await;

    let session = "0195e3b4-0000-7000-8000-000000000001";
    let payout = "0195e3b4-0000-7000-8000-000000000002";
    let acquire = format!(r#"{{"sessionId":"{session}","ttlMillis":5000}}"#);
    let writes: Vec<(Method, String, String)> = vec![
        (
            Method::POST,
            format!("{lock}/v1/sessions"),
            r#"{"ttlMillis":10000}"#.into(),
        ),
        (
            Method::POST,
            format!("{lock}/v1/sessions/{session}/heartbeat"),
            String::new(),
        ),
        (
            Method::DELETE,
            format!("{lock}/v1/sessions/{session}"),
            String::new(),
        ),
        (
            Method::POST,
            format!("{lock}/v1/locks/payout:acct-a/acquire"),
            acquire.clone(),
        ),
        (
            Method::POST,
            format!("{lock}/v1/locks/payout:acct-a/renew"),
            acquire.clone(),
        ),
        (
            Method::DELETE,
            format!("{lock}/v1/locks/payout:acct-a"),
            acquire,
        ),
        (
            Method::POST,
            format!("{lock}/v1/locks/payout:acct-a/revoke"),
            r#"{"operator":"op","reason":"a paused worker holds it"}"#.into(),
        ),
        (Method::GET, format!("{lock}/v1/locks"), String::new()),
        (
            Method::POST,
            format!("{payment}/v1/accounts"),
            r#"{"accountId":"acct-z","currency":"EUR"}"#.into(),
        ),
        (
            Method::POST,
            format!("{payment}/v1/accounts/acct-a/fund"),
            r#"{"amountMinor":500,"reference":"more"}"#.into(),
        ),
        (
            Method::POST,
            format!("{payment}/v1/accounts/acct-a/fence"),
            format!(
                r#"{{"floor":99,"operator":"op","reason":"revoked","revocationId":"{session}"}}"#
            ),
        ),
        (
            Method::POST,
            format!("{payment}/v1/payouts"),
            format!(
                r#"{{"payoutId":"{payout}","accountId":"acct-a","amountMinor":100,"currency":"EUR","beneficiaryRef":"b"}}"#
            ),
        ),
        (
            Method::GET,
            format!("{payment}/v1/accounts/acct-a"),
            String::new(),
        ),
        (
            Method::POST,
            format!("{payment}/v1/payouts/{payout}/claim"),
            r#"{"expectedState":"PENDING"}"#.into(),
        ),
        (
            Method::POST,
            format!("{payment}/v1/payouts/{payout}/resolve"),
            r#"{"outcome":"FAILED","operator":"op","evidence":"statement"}"#.into(),
        ),
        (
            Method::POST,
            format!("{proxy}/v1/rail/submissions"),
            format!(
                r#"{{"payoutId":"{payout}","accountId":"acct-a","amountMinor":100,"currency":"EUR","beneficiaryRef":"b"}}"#
            ),
        ),
        (
            Method::POST,
            format!("{proxy}/v1/rail/high-water/acct-a"),
            r#"{"floor":99,"operator":"op","reason":"revoked"}"#.into(),
        ),
        (
            Method::POST,
            format!("{stub}/submit"),
            r#"{"clientRef":"x","amountMinor":100,"currency":"EUR"}"#.into(),
        ),
    ];
    let base = [
        ("content-type", "application/json"),
        ("x-owner-id", "executor/test"),
        ("idempotency-key", "auth-probe-0001"),
        ("x-fencing-token", "7"),
    ];
    let mut refused = 0;
    for (method, url, body) in &writes {
        let body = (!body.is_empty()).then_some(body.as_str());
        let step = format!("{method} {url}");
        let none = raw(method.clone(), url, &base, body).await;
        assert_refused(
            &format!("{step} without a credential"),
            &none,
            401,
            "UNAUTHENTICATED",
        );
        let wrong = [
            &base[..],
            &[("authorization", "Bearer not-a-token-of-this-stack")],
        ]
        .concat();
        let answer = raw(method.clone(), url, &wrong, body).await;
        assert_refused(
            &format!("{step} with a wrong credential"),
            &answer,
            401,
            "UNAUTHENTICATED",
        );
        let basic = [&base[..], &[("authorization", "Basic ZXhlY3V0b3I6eA==")]].concat();
        let answer = raw(method.clone(), url, &basic, body).await;
        assert_refused(
            &format!("{step} with Basic"),
            &answer,
            401,
            "UNAUTHENTICATED",
        );
        refused += 3;
    }

    // The executor identity may not write in another owner's name...
    let bearer = format!("Bearer {executor}");
    let foreign = [
        ("content-type", "application/json"),
        ("x-owner-id", "someone-else"),
        ("authorization", bearer.as_str()),
    ];
    for (method, url, body) in &writes[..2] {
        let body = (!body.is_empty()).then_some(body.as_str());
        let answer = raw(method.clone(), url, &foreign, body).await;
        assert_refused(
            &format!("{method} {url} as a foreign owner"),
            &answer,
            403,
            "FORBIDDEN",
        );
        refused += 1;
    }
    // ...nor run an operator-only operation.
    let own = [
        ("content-type", "application/json"),
        ("x-owner-id", "executor/test"),
        ("idempotency-key", "auth-probe-0002"),
        ("authorization", bearer.as_str()),
    ];
    for (method, url, body) in writes.iter().filter(|(_, url, _)| {
        url.ends_with("/revoke")
            || url.ends_with("/fence")
            || url.ends_with("/resolve")
            || url.contains("/high-water/")
    }) {
        let answer = raw(method.clone(), url, &own, Some(body)).await;
        assert_refused(
            &format!("{method} {url} as the executor"),
            &answer,
            403,
            "FORBIDDEN",
        );
        refused += 1;
    }
    // ...nor create money: opening and funding an account are the treasury's alone (the
    // treasury opened and funded acct-a above), and the operator is no treasury either.
    let operator_bearer = format!("Bearer {operator}");
    let minters = [
        ("executor", bearer.as_str(), "executor/test"),
        ("operator", operator_bearer.as_str(), "ops-console"),
    ];
    for (who, credential, owner) in minters {
        let mints = [
            (
                format!("{payment}/v1/accounts"),
                r#"{"accountId":"acct-minted","currency":"EUR"}"#,
            ),
            (
                format!("{payment}/v1/accounts/acct-a/fund"),
                r#"{"amountMinor":1000000000000000,"reference":"minted-1"}"#,
            ),
        ];
        for (url, body) in mints {
            let headers = [
                ("content-type", "application/json"),
                ("x-owner-id", owner),
                ("x-idempotency-key", "auth-probe-mint"),
                ("authorization", credential),
            ];
            let answer = raw(Method::POST, &url, &headers, Some(body)).await;
            assert_refused(
                &format!("POST {url} as the {who}"),
                &answer,
                403,
                "FORBIDDEN",
            );
            refused += 1;
        }
    }
    let after = stack.snapshot().await;
    assert_eq!(before, after, "{refused} refused requests changed nothing");
    assert!(refused >= 64, "{refused}");

    // Probes, scrapes and the statement stay open.
    for url in [
        format!("{lock}/healthz"),
        format!("{payment}/readyz"),
        format!("{stub}/statement"),
    ] {
        let (status, _, _) = raw(Method::GET, &url, &[], None).await;
        assert_eq!(status, 200, "{url}");
    }

    // The operator identity may name any owner and revoke; the executor, with credentials,
    // pays a whole batch through every hop (proxy → rail with the proxy's own credential).
    let op_bearer = format!("Bearer {operator}");
    let answer = raw(
        Method::POST,
        &format!("{proxy}/v1/rail/high-water/acct-a"),
        &[
            ("content-type", "application/json"),
            ("x-owner-id", "ops-console"),
            ("authorization", op_bearer.as_str()),
        ],
        Some(r#"{"floor":5,"operator":"op","reason":"an operator raises a floor"}"#),
    )
    .await;
    assert_eq!(answer.0, 200, "{}", answer.2);
    // Positive control: the snapshot that saw no change from the refused requests sees this
    // accepted one.
    assert_ne!(
        after,
        stack.snapshot().await,
        "an accepted write changes what the snapshot reads"
    );

    let (ok, output) = stack.run_batch("auth-batch", "acct-a", 12).await;
    assert!(
        ok,
        "dlock run with a credential finishes the batch: {output}"
    );
    let page = client
        .list_payouts(None, None, Some(100), None)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let posted = page
        .items
        .iter()
        .filter(|p| p.state.as_str() == "POSTED")
        .count();
    assert_eq!(posted, 12, "{output}");
}

/// A self-signed certificate for 127.0.0.1 and localhost, written as PEM files.
fn certificate(dir: &Path) -> (std::path::PathBuf, std::path::PathBuf) {
    let cert = rcgen::generate_simple_self_signed(vec!["127.0.0.1".into(), "localhost".into()])
        .unwrap_or_else(|e| panic!("{e}"));
    let cert_file = dir.join("tls.crt");
    let key_file = dir.join("tls.key");
    std::fs::write(&cert_file, cert.cert.pem()).unwrap_or_else(|e| panic!("{e}"));
    std::fs::write(&key_file, cert.signing_key.serialize_pem()).unwrap_or_else(|e| panic!("{e}"));
    (cert_file, key_file)
}

fn serve(name: &str, env: Vec<(String, String)>, log: &Path) -> ManagedChild {
    let args = vec!["serve".to_owned(), name.to_owned()];
    spawn_logged(name, Path::new(EXE), &args, &env, Some(log)).unwrap_or_else(|e| panic!("{e:#}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tls_listener_serves_https_only_to_clients_that_trust_its_ca() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let (cert, key) = certificate(dir.path());
    let port = free_port().unwrap_or_else(|e| panic!("{e}"));
    let env = vec![
        (
            "DLOCK_SERVER_LISTEN".to_owned(),
            format!("127.0.0.1:{port}"),
        ),
        (
            "DLOCK_SERVER_TLS_CERT_FILE".to_owned(),
            cert.display().to_string(),
        ),
        (
            "DLOCK_SERVER_TLS_KEY_FILE".to_owned(),
            key.display().to_string(),
        ),
        (
            "DLOCK_RAIL_STUB_STATEMENT_PATH".to_owned(),
            dir.path().join("statement.jsonl").display().to_string(),
        ),
    ];
    let _stub = serve("rail-stub", env, &dir.path().join("stub.log"));
    let tls = dlock_contract::tls::client_config(Some(&cert)).unwrap_or_else(|e| panic!("{e}"));
    let trusting = reqwest::Client::builder()
        .use_preconfigured_tls(tls)
        .build()
        .unwrap_or_else(|e| panic!("{e}"));
    let https = format!("https://127.0.0.1:{port}");
    eventually("the TLS listener answers", Duration::from_secs(30), || {
        let trusting = trusting.clone();
        let url = format!("{https}/healthz");
        async move {
            let response = trusting.get(&url).send().await.ok()?;
            (response.status() == 200).then_some(())
        }
    })
    .await;
    let response = trusting
        .post(format!("{https}/submit"))
        .header("content-type", "application/json")
        .body(r#"{"clientRef":"tls-1","amountMinor":100,"currency":"EUR"}"#)
        .send()
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(response.status(), 200);
    assert_eq!(
        response
            .headers()
            .get("content-type")
            .and_then(|v| v.to_str().ok()),
        Some(JSON)
    );
    // The system's roots do not know this CA: the handshake fails, nothing is sent.
    let untrusting = dlock_contract::client::http_client().unwrap_or_else(|e| panic!("{e}"));
    assert!(
        untrusting
            .get(format!("{https}/healthz"))
            .send()
            .await
            .is_err()
    );
    // Plain HTTP to a TLS port gets no HTTP answer.
    let plain = untrusting
        .get(format!("http://127.0.0.1:{port}/healthz"))
        .timeout(Duration::from_secs(5))
        .send()
        .await;
    assert!(plain.is_err(), "{plain:?}");
}

#[derive(Clone)]
struct FakeApi {
    reviews: Arc<AtomicUsize>,
    service_token: String,
}

/// The one Kubernetes API call dlock makes: a TokenReview, answered as the API server would.
async fn token_review(
    axum::extract::State(api): axum::extract::State<FakeApi>,
    headers: axum::http::HeaderMap,
    axum::Json(review): axum::Json<Value>,
) -> (axum::http::StatusCode, axum::Json<Value>) {
    api.reviews.fetch_add(1, Ordering::SeqCst);
    let caller = headers
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default();
    if caller != format!("Bearer {}", api.service_token) {
        return (axum::http::StatusCode::UNAUTHORIZED, axum::Json(json!({})));
    }
    let token = review["spec"]["token"].as_str().unwrap_or_default();
    let audiences = review["spec"]["audiences"].clone();
    let status = match token {
        "projected-executor-token" => json!({
            "authenticated": true,
            "user": {"username": "system:serviceaccount:payments:executor"},
            "audiences": audiences,
        }),
        "token-for-another-audience" => json!({
            "authenticated": true,
            "user": {"username": "system:serviceaccount:payments:executor"},
            "audiences": ["https://kubernetes.default.svc"],
        }),
        _ => json!({"authenticated": false, "error": "invalid bearer token"}),
    };
    (
        axum::http::StatusCode::CREATED,
        axum::Json(
            json!({"apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview", "status": status}),
        ),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokenreview_names_the_service_account_caches_the_answer_and_fails_closed() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let api = FakeApi {
        reviews: Arc::new(AtomicUsize::new(0)),
        service_token: "the-stub-s-own-service-account-token".into(),
    };
    let own_token = dir.path().join("sa-token");
    std::fs::write(&own_token, &api.service_token).unwrap_or_else(|e| panic!("{e}"));
    let (listener, api_addr) = loopback().await;
    let app = axum::Router::new()
        .route(
            "/apis/authentication.k8s.io/v1/tokenreviews",
            axum::routing::post(token_review),
        )
        .with_state(api.clone());
    let api_server = tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });

    let port = free_port().unwrap_or_else(|e| panic!("{e}"));
    let env = vec![
        (
            "DLOCK_SERVER_LISTEN".to_owned(),
            format!("127.0.0.1:{port}"),
        ),
        ("DLOCK_AUTH_MODE".to_owned(), "tokenreview".to_owned()),
        (
            "DLOCK_AUTH_TOKENREVIEW_URL".to_owned(),
            format!("http://{api_addr}"),
        ),
        ("DLOCK_AUTH_TOKENREVIEW_CA_FILE".to_owned(), String::new()),
        (
            "DLOCK_AUTH_TOKENREVIEW_TOKEN_FILE".to_owned(),
            own_token.display().to_string(),
        ),
        (
            "DLOCK_AUTH_TOKENREVIEW_AUDIENCES".to_owned(),
            "dlock".to_owned(),
        ),
        (
            "DLOCK_RAIL_STUB_STATEMENT_PATH".to_owned(),
            dir.path().join("statement.jsonl").display().to_string(),
        ),
    ];
    let _stub = serve("rail-stub", env, &dir.path().join("stub.log"));
    let url = format!("http://127.0.0.1:{port}");
    until_ready("the stub", port).await;
    let submit = |token: &'static str, n: u32| {
        let url = format!("{url}/submit");
        async move {
            let bearer = format!("Bearer {token}");
            let body = format!(r#"{{"clientRef":"tr-{n}","amountMinor":100,"currency":"EUR"}}"#);
            raw(
                Method::POST,
                &url,
                &[
                    ("content-type", "application/json"),
                    ("authorization", bearer.as_str()),
                ],
                Some(&body),
            )
            .await
        }
    };
    let first = submit("projected-executor-token", 1).await;
    assert_eq!(first.0, 200, "{}", first.2);
    let second = submit("projected-executor-token", 2).await;
    assert_eq!(second.0, 200, "{}", second.2);
    assert_eq!(
        api.reviews.load(Ordering::SeqCst),
        1,
        "the second call is answered from the cache"
    );

    assert_refused(
        "an unknown token",
        &submit("a-token-nobody-minted", 3).await,
        401,
        "UNAUTHENTICATED",
    );
    assert_refused(
        "a token for another audience",
        &submit("token-for-another-audience", 4).await,
        401,
        "UNAUTHENTICATED",
    );
    // The API server is gone: a token not in the cache cannot be checked, and is not let in.
    api_server.abort();
    let _ = api_server.await;
    assert_refused(
        "the API server is down",
        &submit("another-projected-token", 5).await,
        503,
        "AUTH_UNAVAILABLE",
    );
    let (_, _, statement) = raw(Method::GET, &format!("{url}/statement"), &[], None).await;
    let refs: Vec<&str> = statement["transfers"]
        .as_array()
        .map(|t| t.iter().filter_map(|t| t["clientRef"].as_str()).collect())
        .unwrap_or_default();
    assert_eq!(
        refs,
        ["tr-1", "tr-2"],
        "only the authenticated submits reached the rail"
    );
}
