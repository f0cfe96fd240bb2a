//! Bad input of every kind gets its code, the envelope and the JSON content type, and changes
//! nothing in the store (checked in the store itself afterwards).

use reqwest::Method;
use serde_json::{Value, json};

use crate::conformance::assert_envelope;
use crate::harness::{Backend, LockStack, client, raw};

/// What the store holds, read from the store itself.
async fn snapshot(stack: &LockStack) -> String {
    match stack.backend {
        Backend::Pg => stack
            .pg
            .as_ref()
            .map(|pg| {
                pg.psql(
                    "lockdb",
                    "SELECT (SELECT count(*) FROM sessions), (SELECT count(*) FROM locks), \
                     (SELECT count(*) FROM lock_waiters), (SELECT count(*) FROM revocations), \
                     (SELECT string_agg(lock_key || '=' || fencing_token || '@' || expires_at, ',' ORDER BY lock_key) FROM locks), \
                     (SELECT string_agg(session_id || '@' || expires_at, ',' ORDER BY session_id) FROM sessions), \
                     (SELECT last_value FROM fencing_token_seq)",
                )
                .unwrap_or_else(|e| panic!("{e}"))
            })
            .unwrap_or_default(),
        Backend::Etcd => {
            let endpoint = stack.etcd.as_ref().map(|e| e.endpoint()).unwrap_or_default();
            let mut etcd = etcd_client::Client::connect([endpoint], None)
                .await
                .unwrap_or_else(|e| panic!("{e}"));
            let all = etcd
                .get("/dlock/", Some(etcd_client::GetOptions::new().with_prefix()))
                .await
                .unwrap_or_else(|e| panic!("{e}"));
            let revision = all.header().map(|h| h.revision()).unwrap_or_default();
            let keys: Vec<String> = all
                .kvs()
                .iter()
                .map(|kv| format!("{}@{}", kv.key_str().unwrap_or("?"), kv.mod_revision()))
                .collect();
            format!("revision {revision}: {}", keys.join(","))
        }
    }
}

struct Case {
    name: &'static str,
    method: Method,
    path: String,
    headers: Vec<(&'static str, String)>,
    body: Option<String>,
    status: u16,
    code: &'static str,
    field: Option<&'static str>,
}

/// One row of the table; flat on purpose, like the table it builds.
#[allow(clippy::too_many_arguments)]
fn case(
    name: &'static str,
    method: Method,
    path: impl Into<String>,
    headers: &[(&'static str, &str)],
    body: Option<&str>,
    status: u16,
    code: &'static str,
    field: Option<&'static str>,
) -> Case {
    Case {
        name,
        method,
        path: path.into(),
        headers: headers.iter().map(|(k, v)| (*k, (*v).to_owned())).collect(),
        body: body.map(str::to_owned),
        status,
        code,
        field,
    }
}

async fn run(backend: Backend) {
    let mut stack = LockStack::backend(backend, &[]);
    let url = stack.serve().await;
    let owner = client(&url, "owner");
    let session = owner
        .create_session(Some(30_000))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let grant = owner
        .acquire("bad:held", session.session_id, Some(30_000), None)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let sid = session.session_id.to_string();
    let token = grant.fencing_token.to_string();
    let before = snapshot(&stack).await;

    let json = ("content-type", "application/json");
    let own = ("x-owner-id", "owner");
    let sid_body = json!({"sessionId": sid}).to_string();
    let big = format!("{{\"ownerId\":\"{}\"}}", "x".repeat(200_000));
    let long_owner = "o".repeat(65);
    let acquire = "/v1/locks/bad:held/acquire".to_owned();
    let renew = "/v1/locks/bad:held/renew".to_owned();
    let release = "/v1/locks/bad:held".to_owned();
    let revoke = "/v1/locks/bad:held/revoke".to_owned();
    let mut cases = vec![
        case(
            "unparsable body",
            Method::POST,
            "/v1/sessions",
            &[json],
            Some("{"),
            400,
            "VALIDATION_FAILED",
            Some("body"),
        ),
        case(
            "array body",
            Method::POST,
            "/v1/sessions",
            &[json],
            Some("[]"),
            400,
            "VALIDATION_FAILED",
            Some("body"),
        ),
        case(
            "ttl as string",
            Method::POST,
            "/v1/sessions",
            &[json],
            Some(r#"{"ownerId":"a","ttlMillis":"5000"}"#),
            400,
            "VALIDATION_FAILED",
            Some("ttlMillis"),
        ),
        case(
            "ttl as float",
            Method::POST,
            "/v1/sessions",
            &[json],
            Some(r#"{"ownerId":"a","ttlMillis":5000.5}"#),
            400,
            "VALIDATION_FAILED",
            Some("ttlMillis"),
        ),
        case(
            "ttl overflowing",
            Method::POST,
            "/v1/sessions",
            &[json],
            Some(r#"{"ownerId":"a","ttlMillis":99999999999999999999}"#),
            400,
            "VALIDATION_FAILED",
            Some("ttlMillis"),
        ),
        case(
            "ttl zero",
            Method::POST,
            "/v1/sessions",
            &[json],
            Some(r#"{"ownerId":"a","ttlMillis":0}"#),
            400,
            "VALIDATION_FAILED",
            Some("ttlMillis"),
        ),
        case(
            "owner as number",
            Method::POST,
            "/v1/sessions",
            &[json],
            Some(r#"{"ownerId":5}"#),
            400,
            "VALIDATION_FAILED",
            Some("ownerId"),
        ),
        case(
            "unknown field",
            Method::POST,
            "/v1/sessions",
            &[json],
            Some(r#"{"ownerId":"a","colour":"red"}"#),
            400,
            "VALIDATION_FAILED",
            Some("colour"),
        ),
        case(
            "not JSON content type",
            Method::POST,
            "/v1/sessions",
            &[("content-type", "text/plain")],
            Some(r#"{"ownerId":"a"}"#),
            400,
            "VALIDATION_FAILED",
            Some("Content-Type"),
        ),
        case(
            "oversize body",
            Method::POST,
            "/v1/sessions",
            &[json],
            Some(&big),
            400,
            "VALIDATION_FAILED",
            Some("body"),
        ),
        case(
            "owner header too long",
            Method::POST,
            "/v1/sessions",
            &[("x-owner-id", &long_owner)],
            None,
            400,
            "VALIDATION_FAILED",
            Some("X-Owner-Id"),
        ),
        case(
            "owner header and body differ",
            Method::POST,
            "/v1/sessions",
            &[json, ("x-owner-id", "a")],
            Some(r#"{"ownerId":"b"}"#),
            400,
            "VALIDATION_FAILED",
            Some("ownerId"),
        ),
        case(
            "heartbeat session not a uuid",
            Method::POST,
            "/v1/sessions/not-a-uuid/heartbeat",
            &[own],
            None,
            400,
            "VALIDATION_FAILED",
            Some("sessionId"),
        ),
        case(
            "heartbeat without owner",
            Method::POST,
            format!("/v1/sessions/{sid}/heartbeat"),
            &[],
            None,
            400,
            "VALIDATION_FAILED",
            Some("X-Owner-Id"),
        ),
        case(
            "end session without owner",
            Method::DELETE,
            format!("/v1/sessions/{sid}"),
            &[],
            None,
            400,
            "VALIDATION_FAILED",
            Some("X-Owner-Id"),
        ),
        case(
            "acquire without owner",
            Method::POST,
            acquire.clone(),
            &[json],
            Some(&sid_body),
            400,
            "VALIDATION_FAILED",
            Some("X-Owner-Id"),
        ),
        case(
            "acquire session not a uuid",
            Method::POST,
            acquire.clone(),
            &[json, own],
            Some(r#"{"sessionId":"nope"}"#),
            400,
            "VALIDATION_FAILED",
            Some("sessionId"),
        ),
        case(
            "acquire ttl too long",
            Method::POST,
            acquire.clone(),
            &[json, own],
            Some(&json!({"sessionId": sid, "ttlMillis": 60001}).to_string()),
            400,
            "VALIDATION_FAILED",
            Some("ttlMillis"),
        ),
        case(
            "acquire wait negative",
            Method::POST,
            acquire.clone(),
            &[json, own],
            Some(&json!({"sessionId": sid, "waitMillis": -5}).to_string()),
            400,
            "VALIDATION_FAILED",
            Some("waitMillis"),
        ),
        case(
            "acquire key alphabet",
            Method::POST,
            "/v1/locks/a%2Fb/acquire",
            &[json, own],
            Some(&sid_body),
            400,
            "VALIDATION_FAILED",
            Some("key"),
        ),
        case(
            "acquire unknown field",
            Method::POST,
            acquire.clone(),
            &[json, own],
            Some(&json!({"sessionId": sid, "force": true}).to_string()),
            400,
            "VALIDATION_FAILED",
            Some("force"),
        ),
        case(
            "release without session",
            Method::DELETE,
            release.clone(),
            &[own, ("x-fencing-token", &token)],
            None,
            400,
            "VALIDATION_FAILED",
            Some("sessionId"),
        ),
        case(
            "release unknown query",
            Method::DELETE,
            format!("{release}?sessionId={sid}&all=1"),
            &[own, ("x-fencing-token", &token)],
            None,
            400,
            "VALIDATION_FAILED",
            Some("all"),
        ),
        case(
            "revoke short reason",
            Method::POST,
            revoke.clone(),
            &[json, own],
            Some(r#"{"operator":"ops","reason":"short"}"#),
            400,
            "VALIDATION_FAILED",
            Some("reason"),
        ),
        case(
            "revoke empty operator",
            Method::POST,
            revoke.clone(),
            &[json, own],
            Some(r#"{"operator":"","reason":"long enough reason"}"#),
            400,
            "VALIDATION_FAILED",
            Some("operator"),
        ),
        case(
            "revoke expectedToken zero",
            Method::POST,
            revoke.clone(),
            &[json, own],
            Some(r#"{"operator":"ops","reason":"long enough reason","expectedToken":0}"#),
            400,
            "VALIDATION_FAILED",
            Some("expectedToken"),
        ),
        case(
            "revoke expectedToken as string",
            Method::POST,
            revoke.clone(),
            &[json, own],
            Some(r#"{"operator":"ops","reason":"long enough reason","expectedToken":"5"}"#),
            400,
            "VALIDATION_FAILED",
            Some("expectedToken"),
        ),
        case(
            "held list limit not a number",
            Method::GET,
            "/v1/locks?limit=abc",
            &[],
            None,
            400,
            "VALIDATION_FAILED",
            Some("limit"),
        ),
        case(
            "held list limit too large",
            Method::GET,
            "/v1/locks?limit=1001",
            &[],
            None,
            400,
            "VALIDATION_FAILED",
            Some("limit"),
        ),
        case(
            "held list unknown parameter",
            Method::GET,
            "/v1/locks?owner=x",
            &[],
            None,
            400,
            "VALIDATION_FAILED",
            Some("owner"),
        ),
        case(
            "info key too long",
            Method::GET,
            format!("/v1/locks/{}", "k".repeat(129)),
            &[],
            None,
            400,
            "VALIDATION_FAILED",
            Some("key"),
        ),
        case(
            "unknown route",
            Method::POST,
            "/v2/sessions",
            &[json],
            Some("{}"),
            404,
            "NOT_FOUND",
            None,
        ),
        case(
            "wrong method",
            Method::PATCH,
            "/v1/sessions",
            &[json],
            Some("{}"),
            405,
            "METHOD_NOT_ALLOWED",
            None,
        ),
    ];
    for bad_token in [
        "0",
        "-1",
        "+5",
        "1e3",
        "0x10",
        "9223372036854775808",
        "",
        "05",
        "5.0",
        "5,6",
    ] {
        for (name, method, path) in [
            ("renew", Method::POST, &renew),
            ("release", Method::DELETE, &release),
        ] {
            let mut c = case(
                if name == "renew" {
                    "renew with a malformed token"
                } else {
                    "release with a malformed token"
                },
                method,
                path.clone(),
                &[json, own],
                Some(&sid_body),
                400,
                "INVALID_TOKEN",
                None,
            );
            c.headers.push(("x-fencing-token", bad_token.to_owned()));
            cases.push(c);
        }
    }
    cases.push(case(
        "renew without a token",
        Method::POST,
        renew.clone(),
        &[json, own],
        Some(&sid_body),
        400,
        "INVALID_TOKEN",
        None,
    ));
    cases.push(case(
        "release without a token",
        Method::DELETE,
        release.clone(),
        &[json, own],
        Some(&sid_body),
        400,
        "INVALID_TOKEN",
        None,
    ));

    for c in &cases {
        let headers: Vec<(&str, &str)> = c.headers.iter().map(|(k, v)| (*k, v.as_str())).collect();
        let (status, content_type, body) = raw(
            c.method.clone(),
            &format!("{url}{}", c.path),
            &headers,
            c.body.as_deref(),
        )
        .await;
        let step = format!("{backend:?} {}: {:?}", c.name, c.headers);
        assert_eq!(status, c.status, "{step}: {body}");
        assert_eq!(content_type, "application/json; charset=utf-8", "{step}");
        assert_envelope(&step, status, &body, c.code);
        if let Some(field) = c.field {
            let fields: Vec<&str> = body["details"]["fields"]
                .as_array()
                .map(|a| a.iter().filter_map(|f| f["field"].as_str()).collect())
                .unwrap_or_default();
            assert!(
                fields.contains(&field),
                "{step}: details.fields {fields:?} should name {field}"
            );
        }
    }
    let after = snapshot(&stack).await;
    assert_eq!(before, after, "{backend:?}: bad input changed the store");
    let still: Value = serde_json::to_value(
        owner
            .get("bad:held")
            .await
            .unwrap_or_else(|e| panic!("{e}")),
    )
    .unwrap_or_default();
    assert_eq!(still["fencingToken"], json!(grant.fencing_token));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn bad_input_gets_its_code_and_changes_nothing_on_pg() {
    run(Backend::Pg).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn bad_input_gets_its_code_and_changes_nothing_on_etcd() {
    run(Backend::Etcd).await;
}
