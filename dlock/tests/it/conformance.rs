//! One conformance script for L1–L8, run against both backends. Each step asserts its status
//! and code; then the two transcripts, with ids, tokens and times normalised, must be identical
//! (FR-09: the backend is invisible on the wire).

use std::time::Duration;

use reqwest::Method;
use serde_json::{Value, json};

use crate::harness::{Backend, LockStack, eventually, raw};

const RETRY_AFTER_CODES: [&str; 4] = [
    "LOCK_CONTENDED",
    "CONTENTION_EXCEEDED",
    "NOT_LEADER",
    "RAIL_UNAVAILABLE",
];
const RETRY_SAFE_CODES: [&str; 4] = RETRY_AFTER_CODES;

pub struct Script {
    pub url: String,
    pub transcript: Vec<(String, u16, Value)>,
}

/// Replaces what legitimately differs between runs and backends.
pub fn normalise(value: &Value) -> Value {
    match value {
        Value::Object(map) => Value::Object(
            map.iter()
                .map(|(k, v)| {
                    let v = match k.as_str() {
                        "traceId" => json!("<trace>"),
                        "fencingToken" | "revokedToken" | "newTokenFloor" | "storedToken"
                        | "presentedToken" | "highestToken"
                            if v.is_number() =>
                        {
                            json!("<token>")
                        }
                        "retryAfterMillis" => json!("<ms>"),
                        _ => normalise(v),
                    };
                    (k.clone(), v)
                })
                .collect(),
        ),
        Value::Array(items) => Value::Array(items.iter().map(normalise).collect()),
        Value::String(s) if uuid::Uuid::parse_str(s).is_ok() => json!("<uuid>"),
        Value::String(s) if chrono::DateTime::parse_from_rfc3339(s).is_ok() => {
            assert!(
                s.ends_with('Z') && s.len() == 24,
                "not RFC 3339 UTC with ms: {s}"
            );
            json!("<time>")
        }
        other => other.clone(),
    }
}

/// Checks the envelope of an error body against the catalogue.
pub fn assert_envelope(step: &str, status: u16, body: &Value, code: &str) {
    assert_eq!(body["code"], json!(code), "{step}: code, body {body}");
    assert!(
        body["message"].as_str().is_some_and(|m| !m.is_empty()),
        "{step}: message"
    );
    assert_eq!(
        body["retrySafe"],
        json!(RETRY_SAFE_CODES.contains(&code)),
        "{step}: retrySafe"
    );
    assert_eq!(
        body.get("retryAfterMillis").is_some(),
        RETRY_AFTER_CODES.contains(&code),
        "{step}: retryAfterMillis presence"
    );
    let trace = body["traceId"].as_str().unwrap_or_default();
    assert!(
        trace.len() == 32 && trace.bytes().all(|b| b.is_ascii_hexdigit()),
        "{step}: traceId {trace}"
    );
    assert!(status >= 400, "{step}");
}

impl Script {
    pub fn new(url: &str) -> Self {
        Self {
            url: url.to_owned(),
            transcript: Vec::new(),
        }
    }

    /// One request; asserts its status (and code for errors) and records it. The argument list
    /// is the row of a conformance table, so it stays flat.
    #[allow(clippy::too_many_arguments)]
    pub async fn call(
        &mut self,
        step: &str,
        method: Method,
        path: &str,
        headers: &[(&str, &str)],
        body: Option<Value>,
        status: u16,
        code: Option<&str>,
    ) -> Value {
        let mut all: Vec<(&str, &str)> = headers.to_vec();
        if body.is_some() {
            all.push(("content-type", "application/json"));
        }
        let text = body.map(|b| b.to_string());
        let (got, content_type, json) = raw(
            method,
            &format!("{}{path}", self.url),
            &all,
            text.as_deref(),
        )
        .await;
        assert_eq!(got, status, "{step}: status, body {json}");
        assert_eq!(
            content_type, "application/json; charset=utf-8",
            "{step}: content type"
        );
        if let Some(code) = code {
            assert_envelope(step, got, &json, code);
        }
        self.transcript
            .push((step.to_owned(), got, normalise(&json)));
        json
    }
}

fn token(v: &Value, field: &str) -> i64 {
    v[field]
        .as_i64()
        .unwrap_or_else(|| panic!("{field} missing in {v}"))
}

fn millis_between(v: &Value, from: &str, to: &str) -> i64 {
    let parse = |f: &str| {
        chrono::DateTime::parse_from_rfc3339(v[f].as_str().unwrap_or_default())
            .unwrap_or_else(|e| panic!("{f}: {e} in {v}"))
    };
    (parse(to) - parse(from)).num_milliseconds()
}

async fn script(backend: Backend) -> Vec<(String, u16, Value)> {
    let mut stack = LockStack::backend(
        backend,
        &[
            ("lock.session.ttl-max", "30000"),
            ("lock.ttl-max", "20000"),
            ("lock.waiters.max-per-key", "1"),
            ("lock.session.expired-retention", "600000"),
        ],
    );
    let url = stack.serve().await;
    let mut s = Script::new(&url);
    use Method as M;
    let alice_h = [("x-owner-id", "alice")];
    let bob_h = [("x-owner-id", "bob")];

    // L1
    let alice = s
        .call(
            "L1 create",
            M::POST,
            "/v1/sessions",
            &[],
            Some(json!({"ownerId": "alice", "ttlMillis": 10000})),
            201,
            None,
        )
        .await;
    assert_eq!(alice["ownerId"], "alice");
    assert_eq!(alice["ttlMillis"], 10000);
    let clamped = s
        .call(
            "L1 clamped down",
            M::POST,
            "/v1/sessions",
            &[],
            Some(json!({"ownerId": "alice", "ttlMillis": 45000})),
            201,
            None,
        )
        .await;
    assert_eq!(
        clamped["ttlMillis"], 30000,
        "clamped to lock.session.ttl-max"
    );
    let bob = s
        .call(
            "L1 owner from header",
            M::POST,
            "/v1/sessions",
            &bob_h,
            Some(json!({})),
            201,
            None,
        )
        .await;
    assert_eq!(bob["ownerId"], "bob");
    assert_eq!(bob["ttlMillis"], 10000, "lock.session.ttl default");
    s.call(
        "L1 ttl below range",
        M::POST,
        "/v1/sessions",
        &[],
        Some(json!({"ownerId": "x", "ttlMillis": 999})),
        400,
        Some("VALIDATION_FAILED"),
    )
    .await;
    s.call(
        "L1 ttl above range",
        M::POST,
        "/v1/sessions",
        &[],
        Some(json!({"ownerId": "x", "ttlMillis": 60001})),
        400,
        Some("VALIDATION_FAILED"),
    )
    .await;
    s.call(
        "L1 no owner",
        M::POST,
        "/v1/sessions",
        &[],
        Some(json!({})),
        400,
        Some("VALIDATION_FAILED"),
    )
    .await;
    s.call(
        "L1 owner too long",
        M::POST,
        "/v1/sessions",
        &[],
        Some(json!({"ownerId": "o".repeat(65)})),
        400,
        Some("VALIDATION_FAILED"),
    )
    .await;
    let carol = s
        .call(
            "L1 carol",
            M::POST,
            "/v1/sessions",
            &[("x-owner-id", "carol")],
            None,
            201,
            None,
        )
        .await;
    let alice_sid = alice["sessionId"].as_str().unwrap_or_default().to_owned();
    let bob_sid = bob["sessionId"].as_str().unwrap_or_default().to_owned();
    let carol_sid = carol["sessionId"].as_str().unwrap_or_default().to_owned();

    // L2
    let beat = s
        .call(
            "L2 heartbeat",
            M::POST,
            &format!("/v1/sessions/{alice_sid}/heartbeat"),
            &alice_h,
            None,
            200,
            None,
        )
        .await;
    assert_eq!(beat["heldLockCount"], 0);
    s.call(
        "L2 unknown session",
        M::POST,
        &format!("/v1/sessions/{}/heartbeat", uuid::Uuid::new_v4()),
        &alice_h,
        None,
        404,
        Some("SESSION_UNKNOWN"),
    )
    .await;
    s.call(
        "L2 another owner's session",
        M::POST,
        &format!("/v1/sessions/{alice_sid}/heartbeat"),
        &bob_h,
        None,
        404,
        Some("SESSION_UNKNOWN"),
    )
    .await;

    // L4
    let g1 = s
        .call(
            "L4 acquire",
            M::POST,
            "/v1/locks/payout:acct-1/acquire",
            &alice_h,
            Some(json!({"sessionId": alice_sid, "ttlMillis": 15000})),
            200,
            None,
        )
        .await;
    let t1 = token(&g1, "fencingToken");
    assert!(t1 > 0);
    assert_eq!(g1["ownerId"], "alice");
    assert_eq!(millis_between(&g1, "acquiredAt", "expiresAt"), 15000);
    let beat = s
        .call(
            "L2 counts held locks",
            M::POST,
            &format!("/v1/sessions/{alice_sid}/heartbeat"),
            &alice_h,
            None,
            200,
            None,
        )
        .await;
    assert_eq!(beat["heldLockCount"], 1);
    let busy = s
        .call(
            "L4 contended",
            M::POST,
            "/v1/locks/payout:acct-1/acquire",
            &bob_h,
            Some(json!({"sessionId": bob_sid})),
            409,
            Some("LOCK_CONTENDED"),
        )
        .await;
    assert_eq!(busy["details"]["holderOwnerId"], "alice");
    assert_eq!(busy["details"]["expiresAt"], g1["expiresAt"]);
    let g2 = s
        .call(
            "L4 ttl clamped down",
            M::POST,
            "/v1/locks/payout:acct-2/acquire",
            &bob_h,
            Some(json!({"sessionId": bob_sid, "ttlMillis": 25000})),
            200,
            None,
        )
        .await;
    assert_eq!(millis_between(&g2, "acquiredAt", "expiresAt"), 20000);
    assert!(
        token(&g2, "fencingToken") > t1,
        "tokens are ordered across keys"
    );
    s.call(
        "L4 ttl below range",
        M::POST,
        "/v1/locks/k/acquire",
        &bob_h,
        Some(json!({"sessionId": bob_sid, "ttlMillis": 500})),
        400,
        Some("VALIDATION_FAILED"),
    )
    .await;
    s.call(
        "L4 wait above range",
        M::POST,
        "/v1/locks/k/acquire",
        &bob_h,
        Some(json!({"sessionId": bob_sid, "waitMillis": 30001})),
        400,
        Some("VALIDATION_FAILED"),
    )
    .await;
    s.call(
        "L4 negative wait",
        M::POST,
        "/v1/locks/k/acquire",
        &bob_h,
        Some(json!({"sessionId": bob_sid, "waitMillis": -1})),
        400,
        Some("VALIDATION_FAILED"),
    )
    .await;
    s.call(
        "L4 key alphabet",
        M::POST,
        "/v1/locks/bad%20key/acquire",
        &bob_h,
        Some(json!({"sessionId": bob_sid})),
        400,
        Some("VALIDATION_FAILED"),
    )
    .await;
    s.call(
        "L4 key too long",
        M::POST,
        &format!("/v1/locks/{}/acquire", "k".repeat(129)),
        &bob_h,
        Some(json!({"sessionId": bob_sid})),
        400,
        Some("VALIDATION_FAILED"),
    )
    .await;
    s.call(
        "L4 no session id",
        M::POST,
        "/v1/locks/k/acquire",
        &bob_h,
        Some(json!({})),
        400,
        Some("VALIDATION_FAILED"),
    )
    .await;
    s.call(
        "L4 unknown session",
        M::POST,
        "/v1/locks/k/acquire",
        &bob_h,
        Some(json!({"sessionId": uuid::Uuid::new_v4()})),
        404,
        Some("SESSION_UNKNOWN"),
    )
    .await;

    // L7
    let info = s
        .call(
            "L7 held",
            M::GET,
            "/v1/locks/payout:acct-1",
            &[],
            None,
            200,
            None,
        )
        .await;
    assert_eq!(info["held"], true);
    assert_eq!(info["ownerId"], "alice");
    assert_eq!(token(&info, "fencingToken"), t1);
    assert_eq!(info["waiterCount"], 0);
    s.call(
        "L7 never seen",
        M::GET,
        "/v1/locks/never-seen",
        &[],
        None,
        404,
        Some("NOT_FOUND"),
    )
    .await;

    // L5
    let renewed = s
        .call(
            "L5 renew",
            M::POST,
            "/v1/locks/payout:acct-1/renew",
            &[
                ("x-owner-id", "alice"),
                ("x-fencing-token", &t1.to_string()),
            ],
            Some(json!({"sessionId": alice_sid, "ttlMillis": 12000})),
            200,
            None,
        )
        .await;
    assert_eq!(token(&renewed, "fencingToken"), t1, "renew never re-issues");
    assert_eq!(renewed["acquiredAt"], g1["acquiredAt"]);
    assert!(millis_between(&renewed, "acquiredAt", "expiresAt") >= 12000);
    let lost = s
        .call(
            "L5 wrong token",
            M::POST,
            "/v1/locks/payout:acct-1/renew",
            &[
                ("x-owner-id", "alice"),
                ("x-fencing-token", &(t1 + 1000).to_string()),
            ],
            Some(json!({"sessionId": alice_sid})),
            409,
            Some("LOCK_LOST"),
        )
        .await;
    assert_eq!(token(&lost["details"], "storedToken"), t1);
    s.call(
        "L5 malformed token",
        M::POST,
        "/v1/locks/payout:acct-1/renew",
        &[("x-owner-id", "alice"), ("x-fencing-token", "1e3")],
        Some(json!({"sessionId": alice_sid})),
        400,
        Some("INVALID_TOKEN"),
    )
    .await;
    s.call(
        "L5 no token",
        M::POST,
        "/v1/locks/payout:acct-1/renew",
        &alice_h,
        Some(json!({"sessionId": alice_sid})),
        400,
        Some("INVALID_TOKEN"),
    )
    .await;

    // L4 with waitMillis: bob queues, carol finds the queue full, alice releases, bob is granted.
    let waiter_url = url.clone();
    let bob_sid2 = bob_sid.clone();
    let waiter = tokio::spawn(async move {
        raw(
            Method::POST,
            &format!("{waiter_url}/v1/locks/payout:acct-1/acquire"),
            &[("x-owner-id", "bob"), ("content-type", "application/json")],
            Some(&json!({"sessionId": bob_sid2, "waitMillis": 10000}).to_string()),
        )
        .await
    });
    let info_url = format!("{url}/v1/locks/payout:acct-1");
    eventually("bob is queued", Duration::from_secs(10), || {
        let info_url = info_url.clone();
        async move {
            let (_, _, info) = raw(Method::GET, &info_url, &[], None).await;
            (info["waiterCount"] == 1).then_some(())
        }
    })
    .await;
    let full = s
        .call(
            "L4 queue full",
            M::POST,
            "/v1/locks/payout:acct-1/acquire",
            &[("x-owner-id", "carol")],
            Some(json!({"sessionId": carol_sid, "waitMillis": 5000})),
            429,
            Some("CONTENTION_EXCEEDED"),
        )
        .await;
    assert_eq!(full["details"]["waiterCount"], 1);
    s.call(
        "L4 queued ahead of a non-waiter",
        M::POST,
        "/v1/locks/payout:acct-1/acquire",
        &[("x-owner-id", "carol")],
        Some(json!({"sessionId": carol_sid})),
        409,
        Some("LOCK_CONTENDED"),
    )
    .await;

    // L6
    s.call(
        "L6 release",
        M::DELETE,
        "/v1/locks/payout:acct-1",
        &[
            ("x-owner-id", "alice"),
            ("x-fencing-token", &t1.to_string()),
        ],
        Some(json!({"sessionId": alice_sid})),
        204,
        None,
    )
    .await;
    let (status, _, g3) = waiter.await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        status, 200,
        "the waiter is granted once the holder releases: {g3}"
    );
    let t2 = token(&g3, "fencingToken");
    assert!(t2 > t1, "a new grant gets a greater token");
    s.transcript
        .push(("L4 waiter granted".into(), status, normalise(&g3)));
    let lost = s
        .call(
            "L6 release twice",
            M::DELETE,
            "/v1/locks/payout:acct-1",
            &[
                ("x-owner-id", "alice"),
                ("x-fencing-token", &t1.to_string()),
            ],
            Some(json!({"sessionId": alice_sid})),
            409,
            Some("LOCK_LOST"),
        )
        .await;
    assert_eq!(token(&lost["details"], "storedToken"), t2);
    s.call(
        "L6 malformed token",
        M::DELETE,
        "/v1/locks/payout:acct-1",
        &[("x-owner-id", "alice"), ("x-fencing-token", "-1")],
        Some(json!({"sessionId": alice_sid})),
        400,
        Some("INVALID_TOKEN"),
    )
    .await;
    s.call(
        "L6 session id in the query",
        M::DELETE,
        &format!("/v1/locks/payout:acct-2?sessionId={bob_sid}"),
        &[
            ("x-owner-id", "bob"),
            ("x-fencing-token", &token(&g2, "fencingToken").to_string()),
        ],
        None,
        204,
        None,
    )
    .await;

    // L8
    let stale = s
        .call(
            "L8 stale expectedToken",
            M::POST,
            "/v1/locks/payout:acct-1/revoke",
            &[("x-owner-id", "ops")],
            Some(json!({"operator": "ops", "reason": "stuck worker", "expectedToken": t1})),
            409,
            Some("FENCED_OUT"),
        )
        .await;
    assert_eq!(token(&stale["details"], "presentedToken"), t1);
    assert_eq!(token(&stale["details"], "highestToken"), t2);
    s.call(
        "L8 short reason",
        M::POST,
        "/v1/locks/payout:acct-1/revoke",
        &[("x-owner-id", "ops")],
        Some(json!({"operator": "ops", "reason": "short"})),
        400,
        Some("VALIDATION_FAILED"),
    )
    .await;
    s.call(
        "L8 no operator",
        M::POST,
        "/v1/locks/payout:acct-1/revoke",
        &[("x-owner-id", "ops")],
        Some(json!({"reason": "stuck worker"})),
        400,
        Some("VALIDATION_FAILED"),
    )
    .await;
    let revoked = s
        .call(
            "L8 revoke",
            M::POST,
            "/v1/locks/payout:acct-1/revoke",
            &[("x-owner-id", "ops")],
            Some(json!({"operator": "ops", "reason": "stuck worker", "expectedToken": t2})),
            200,
            None,
        )
        .await;
    assert_eq!(token(&revoked, "revokedToken"), t2);
    assert_eq!(revoked["revokedOwnerId"], "bob");
    let floor = token(&revoked, "newTokenFloor");
    assert!(floor > t2, "the floor exceeds the revoked token");
    s.call(
        "L8 not held",
        M::POST,
        "/v1/locks/payout:acct-1/revoke",
        &[("x-owner-id", "ops")],
        Some(json!({"operator": "ops", "reason": "stuck worker"})),
        404,
        Some("NOT_FOUND"),
    )
    .await;
    s.call(
        "L5 after revoke",
        M::POST,
        "/v1/locks/payout:acct-1/renew",
        &[("x-owner-id", "bob"), ("x-fencing-token", &t2.to_string())],
        Some(json!({"sessionId": bob_sid})),
        409,
        Some("LOCK_LOST"),
    )
    .await;
    let info = s
        .call(
            "L7 after revoke",
            M::GET,
            "/v1/locks/payout:acct-1",
            &[],
            None,
            200,
            None,
        )
        .await;
    assert_eq!(info["held"], false);
    let g4 = s
        .call(
            "L4 after revoke",
            M::POST,
            "/v1/locks/payout:acct-1/acquire",
            &alice_h,
            Some(json!({"sessionId": alice_sid})),
            200,
            None,
        )
        .await;
    assert!(
        token(&g4, "fencingToken") > floor,
        "tokens after a revocation exceed its floor"
    );

    // Held-locks list.
    let held = s
        .call(
            "held list",
            M::GET,
            "/v1/locks?limit=10",
            &[],
            None,
            200,
            None,
        )
        .await;
    assert_eq!(held["items"].as_array().map(Vec::len), Some(1));
    assert_eq!(held["items"][0]["key"], "payout:acct-1");
    s.call(
        "held list bad limit",
        M::GET,
        "/v1/locks?limit=0",
        &[],
        None,
        400,
        Some("VALIDATION_FAILED"),
    )
    .await;

    // L3
    s.call(
        "L3 end session",
        M::DELETE,
        &format!("/v1/sessions/{alice_sid}"),
        &alice_h,
        None,
        204,
        None,
    )
    .await;
    let info = s
        .call(
            "L7 after session end",
            M::GET,
            "/v1/locks/payout:acct-1",
            &[],
            None,
            200,
            None,
        )
        .await;
    assert_eq!(info["held"], false, "ending a session releases its locks");
    s.call(
        "L3 twice",
        M::DELETE,
        &format!("/v1/sessions/{alice_sid}"),
        &alice_h,
        None,
        404,
        Some("SESSION_UNKNOWN"),
    )
    .await;
    s.call(
        "L2 after end",
        M::POST,
        &format!("/v1/sessions/{alice_sid}/heartbeat"),
        &alice_h,
        None,
        404,
        Some("SESSION_UNKNOWN"),
    )
    .await;

    // Expiry: a session whose heartbeat lapses answers 410 everywhere, and its lock is free.
    let dave = s
        .call(
            "L1 short session",
            M::POST,
            "/v1/sessions",
            &[("x-owner-id", "dave")],
            Some(json!({"ttlMillis": 1000})),
            201,
            None,
        )
        .await;
    let dave_sid = dave["sessionId"].as_str().unwrap_or_default().to_owned();
    let g5 = s
        .call(
            "L4 dave acquires",
            M::POST,
            "/v1/locks/payout:acct-3/acquire",
            &[("x-owner-id", "dave")],
            Some(json!({"sessionId": dave_sid, "ttlMillis": 30000})),
            200,
            None,
        )
        .await;
    // Watch the lock, not the session: a heartbeat would keep the session alive.
    let info_url = format!("{url}/v1/locks/payout:acct-3");
    eventually("dave's session expires", Duration::from_secs(15), || {
        let info_url = info_url.clone();
        async move {
            let (_, _, info) = raw(Method::GET, &info_url, &[], None).await;
            (info["held"] == false).then_some(())
        }
    })
    .await;
    s.call(
        "L2 expired",
        M::POST,
        &format!("/v1/sessions/{dave_sid}/heartbeat"),
        &[("x-owner-id", "dave")],
        None,
        410,
        Some("SESSION_EXPIRED"),
    )
    .await;
    s.call(
        "L4 expired session",
        M::POST,
        "/v1/locks/payout:acct-9/acquire",
        &[("x-owner-id", "dave")],
        Some(json!({"sessionId": dave_sid})),
        410,
        Some("SESSION_EXPIRED"),
    )
    .await;
    s.call(
        "L5 expired session",
        M::POST,
        "/v1/locks/payout:acct-3/renew",
        &[
            ("x-owner-id", "dave"),
            ("x-fencing-token", &token(&g5, "fencingToken").to_string()),
        ],
        Some(json!({"sessionId": dave_sid})),
        410,
        Some("SESSION_EXPIRED"),
    )
    .await;
    let info = s
        .call(
            "L7 expired holder",
            M::GET,
            "/v1/locks/payout:acct-3",
            &[],
            None,
            200,
            None,
        )
        .await;
    assert_eq!(
        info["held"], false,
        "a lapsed session's locks are released (FR-04)"
    );
    let g6 = s
        .call(
            "L4 take over",
            M::POST,
            "/v1/locks/payout:acct-3/acquire",
            &[("x-owner-id", "carol")],
            Some(json!({"sessionId": carol_sid})),
            200,
            None,
        )
        .await;
    assert!(token(&g6, "fencingToken") > token(&g5, "fencingToken"));
    s.call(
        "L3 expired",
        M::DELETE,
        &format!("/v1/sessions/{dave_sid}"),
        &[("x-owner-id", "dave")],
        None,
        410,
        Some("SESSION_EXPIRED"),
    )
    .await;
    s.call(
        "L6 lapsed grant",
        M::DELETE,
        "/v1/locks/payout:acct-3",
        &[
            ("x-owner-id", "dave"),
            ("x-fencing-token", &token(&g5, "fencingToken").to_string()),
        ],
        Some(json!({"sessionId": dave_sid})),
        409,
        Some("LOCK_LOST"),
    )
    .await;

    // Conventions on unknown routes and methods.
    s.call(
        "unknown route",
        M::GET,
        "/v1/nothing",
        &[],
        None,
        404,
        Some("NOT_FOUND"),
    )
    .await;
    s.call(
        "wrong method",
        M::PUT,
        "/v1/locks/payout:acct-1",
        &[],
        None,
        405,
        Some("METHOD_NOT_ALLOWED"),
    )
    .await;
    drop(stack);
    s.transcript
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_l_row_answers_identically_on_pg_and_etcd() {
    let (pg, etcd) = tokio::join!(script(Backend::Pg), script(Backend::Etcd));
    assert_eq!(pg.len(), etcd.len());
    for (a, b) in pg.iter().zip(etcd.iter()) {
        assert_eq!(a, b, "pg and etcd answered step {:?} differently", a.0);
    }
}

async fn not_leader(backend: Backend) -> Vec<(String, u16, Value)> {
    // Short backend timeouts, so that each refused request answers quickly. The schema goes in
    // first through a pool of its own: under a loaded machine, connecting and migrating may take
    // longer than the short timeout meant for the refused requests.
    let mut stack = LockStack::backend(
        backend,
        &[
            ("lock.pg.acquire-timeout-ms", "1000"),
            ("lock.pg.migrate", "false"),
            ("lock.etcd.request-timeout-ms", "1500"),
        ],
    );
    if let Some(pg) = &stack.pg {
        let pool = sqlx::PgPool::connect(&pg.url("lockdb"))
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        dlock_lock_server::store::pg::MIGRATOR
            .run(&pool)
            .await
            .unwrap_or_else(|e| panic!("lockdb migrations: {e}"));
        pool.close().await;
    }
    let url = stack.serve().await;
    let mut s = Script::new(&url);
    let session = s
        .call(
            "L1 while up",
            Method::POST,
            "/v1/sessions",
            &[("x-owner-id", "w")],
            None,
            201,
            None,
        )
        .await;
    let sid = session["sessionId"].as_str().unwrap_or_default().to_owned();
    match backend {
        Backend::Pg => stack.pg.as_mut().map(|p| p.kill()),
        Backend::Etcd => stack.etcd.as_mut().map(|e| e.kill()),
    };
    s.call(
        "L1 backend down",
        Method::POST,
        "/v1/sessions",
        &[("x-owner-id", "w")],
        None,
        503,
        Some("NOT_LEADER"),
    )
    .await;
    s.call(
        "L2 backend down",
        Method::POST,
        &format!("/v1/sessions/{sid}/heartbeat"),
        &[("x-owner-id", "w")],
        None,
        503,
        Some("NOT_LEADER"),
    )
    .await;
    s.call(
        "L4 backend down",
        Method::POST,
        "/v1/locks/k/acquire",
        &[("x-owner-id", "w")],
        Some(json!({"sessionId": sid})),
        503,
        Some("NOT_LEADER"),
    )
    .await;
    s.call(
        "L3 backend down",
        Method::DELETE,
        &format!("/v1/sessions/{sid}"),
        &[("x-owner-id", "w")],
        None,
        503,
        Some("NOT_LEADER"),
    )
    .await;
    s.call(
        "readyz backend down",
        Method::GET,
        "/readyz",
        &[],
        None,
        503,
        Some("NOT_LEADER"),
    )
    .await;
    let (status, _, _) = raw(Method::GET, &format!("{url}/healthz"), &[], None).await;
    assert_eq!(status, 200, "the process itself is healthy");
    s.transcript
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_unreachable_backend_is_not_leader_on_both_backends() {
    let (pg, etcd) = tokio::join!(not_leader(Backend::Pg), not_leader(Backend::Etcd));
    assert_eq!(pg, etcd);
}
