//! One conformance script for L1–L8, run against both backends, as tables of steps (see
//! `steps.rs`). Each step asserts its status and code; then the two transcripts, with ids,
//! tokens and times normalised, must be identical (the backend is invisible on the wire:
//! docs/design.md#lock-backends).

use std::time::Duration;

use reqwest::Method;
use serde_json::{Value, json};

use crate::harness::{Backend, LockStack, eventually, raw};
use crate::steps::{Check, Runner, Step, delete, get, normalise, post, step};

pub use crate::steps::assert_envelope;

const INVALID: &str = "VALIDATION_FAILED";

/// L1 and L2: sessions (the clamp of `lock.session.ttl-max`, the default TTL, validation).
fn sessions() -> Vec<Step> {
    let create = |name: &str| post(name, "/v1/sessions");
    vec![
        create("L1 create")
            .json(json!({"ownerId": "alice", "ttlMillis": 10000}))
            .answers(201)
            .has("/ownerId", "alice")
            .has("/ttlMillis", 10000)
            .save("alice", "/sessionId"),
        create("L1 clamped down")
            .json(json!({"ownerId": "alice", "ttlMillis": 45000}))
            .answers(201)
            .check(
                Check::Eq("/ttlMillis", json!(30000)),
                "clamped to lock.session.ttl-max",
            ),
        create("L1 owner from header")
            .owner("bob")
            .json(json!({}))
            .answers(201)
            .has("/ownerId", "bob")
            .check(
                Check::Eq("/ttlMillis", json!(10000)),
                "lock.session.ttl default",
            )
            .save("bob", "/sessionId"),
        create("L1 ttl below range")
            .json(json!({"ownerId": "x", "ttlMillis": 999}))
            .fails(400, INVALID),
        create("L1 ttl above range")
            .json(json!({"ownerId": "x", "ttlMillis": 60001}))
            .fails(400, INVALID),
        create("L1 no owner").json(json!({})).fails(400, INVALID),
        create("L1 owner too long")
            .json(json!({"ownerId": "o".repeat(65)}))
            .fails(400, INVALID),
        create("L1 carol")
            .owner("carol")
            .answers(201)
            .save("carol", "/sessionId"),
        post("L2 heartbeat", "/v1/sessions/$alice/heartbeat")
            .owner("alice")
            .has("/heldLockCount", 0),
        post(
            "L2 unknown session",
            format!("/v1/sessions/{}/heartbeat", uuid::Uuid::new_v4()),
        )
        .owner("alice")
        .fails(404, "SESSION_UNKNOWN"),
        post(
            "L2 another owner's session",
            "/v1/sessions/$alice/heartbeat",
        )
        .owner("bob")
        .fails(404, "SESSION_UNKNOWN"),
    ]
}

/// L4, L7 and L5: grants, contention, validation, lock info, renewals.
fn grants() -> Vec<Step> {
    let acquire = |name: &str, key: &str| post(name, format!("/v1/locks/{key}/acquire"));
    let bad_acquire = |name: &str, key: &str, body: Value| {
        acquire(name, key)
            .owner("bob")
            .json(body)
            .fails(400, INVALID)
    };
    let renew = |name: &str| post(name, "/v1/locks/payout:acct-1/renew").owner("alice");
    vec![
        acquire("L4 acquire", "payout:acct-1")
            .owner("alice")
            .json(json!({"sessionId": "$alice", "ttlMillis": 15000}))
            .check(Check::Gt("/fencingToken", 0), "")
            .has("/ownerId", "alice")
            .check(Check::Span("/acquiredAt", "/expiresAt", 15000), "")
            .save("t1", "/fencingToken")
            .save("g1_acquired", "/acquiredAt")
            .save("g1_expires", "/expiresAt"),
        post("L2 counts held locks", "/v1/sessions/$alice/heartbeat")
            .owner("alice")
            .has("/heldLockCount", 1),
        acquire("L4 contended", "payout:acct-1")
            .owner("bob")
            .session("$bob")
            .fails(409, "LOCK_CONTENDED")
            .has("/details/holderOwnerId", "alice")
            .has_saved("/details/expiresAt", "g1_expires"),
        acquire("L4 ttl clamped down", "payout:acct-2")
            .owner("bob")
            .json(json!({"sessionId": "$bob", "ttlMillis": 25000}))
            .check(Check::Span("/acquiredAt", "/expiresAt", 20000), "")
            .above("/fencingToken", "t1", "tokens are ordered across keys")
            .save("t_acct2", "/fencingToken"),
        bad_acquire(
            "L4 ttl below range",
            "k",
            json!({"sessionId": "$bob", "ttlMillis": 500}),
        ),
        bad_acquire(
            "L4 wait above range",
            "k",
            json!({"sessionId": "$bob", "waitMillis": 30001}),
        ),
        bad_acquire(
            "L4 negative wait",
            "k",
            json!({"sessionId": "$bob", "waitMillis": -1}),
        ),
        bad_acquire("L4 key alphabet", "bad%20key", json!({"sessionId": "$bob"})),
        bad_acquire(
            "L4 key too long",
            &"k".repeat(129),
            json!({"sessionId": "$bob"}),
        ),
        bad_acquire("L4 no session id", "k", json!({})),
        acquire("L4 unknown session", "k")
            .owner("bob")
            .json(json!({"sessionId": uuid::Uuid::new_v4()}))
            .fails(404, "SESSION_UNKNOWN"),
        get("L7 held", "/v1/locks/payout:acct-1")
            .has("/held", true)
            .has("/ownerId", "alice")
            .has_saved("/fencingToken", "t1")
            .has("/waiterCount", 0),
        get("L7 never seen", "/v1/locks/never-seen").fails(404, "NOT_FOUND"),
        renew("L5 renew")
            .token("$t1")
            .json(json!({"sessionId": "$alice", "ttlMillis": 12000}))
            .check(Check::Saved("/fencingToken", "t1"), "renew never re-issues")
            .has_saved("/acquiredAt", "g1_acquired")
            .check(Check::SpanAtLeast("/acquiredAt", "/expiresAt", 12000), ""),
    ]
}

/// L5 refused: a token that is not the holder's (`$t1_plus_1000`), malformed, or none.
fn bad_renewals() -> Vec<Step> {
    let renew = |name: &str| post(name, "/v1/locks/payout:acct-1/renew").owner("alice");
    vec![
        renew("L5 wrong token")
            .token("$t1_plus_1000")
            .session("$alice")
            .fails(409, "LOCK_LOST")
            .has_saved("/details/storedToken", "t1"),
        renew("L5 malformed token")
            .token("1e3")
            .session("$alice")
            .fails(400, "INVALID_TOKEN"),
        renew("L5 no token")
            .session("$alice")
            .fails(400, "INVALID_TOKEN"),
    ]
}

/// While bob waits on payout:acct-1: carol finds the queue full, and is not queued ahead.
fn queue() -> Vec<Step> {
    let acquire = |name: &str| post(name, "/v1/locks/payout:acct-1/acquire").owner("carol");
    vec![
        acquire("L4 queue full")
            .json(json!({"sessionId": "$carol", "waitMillis": 5000}))
            .fails(429, "CONTENTION_EXCEEDED")
            .has("/details/waiterCount", 1),
        acquire("L4 queued ahead of a non-waiter")
            .session("$carol")
            .fails(409, "LOCK_CONTENDED"),
    ]
}

/// L6 after bob's grant (`$t2`), L8 revocation, the held list, L3.
fn releases_and_revocations() -> Vec<Step> {
    let release = |name: &str| delete(name, "/v1/locks/payout:acct-1");
    let revoke = |name: &str, body: Value| {
        post(name, "/v1/locks/payout:acct-1/revoke")
            .owner("ops")
            .json(body)
    };
    vec![
        release("L6 release twice")
            .owner("alice")
            .token("$t1")
            .session("$alice")
            .fails(409, "LOCK_LOST")
            .has_saved("/details/storedToken", "t2"),
        release("L6 malformed token")
            .owner("alice")
            .token("-1")
            .session("$alice")
            .fails(400, "INVALID_TOKEN"),
        delete(
            "L6 session id in the query",
            "/v1/locks/payout:acct-2?sessionId=$bob",
        )
        .owner("bob")
        .token("$t_acct2")
        .answers(204),
        revoke(
            "L8 stale expectedToken",
            json!({"operator": "ops", "reason": "stuck worker", "expectedToken": "$t1"}),
        )
        .fails(409, "FENCED_OUT")
        .has_saved("/details/presentedToken", "t1")
        .has_saved("/details/highestToken", "t2"),
        revoke(
            "L8 short reason",
            json!({"operator": "ops", "reason": "short"}),
        )
        .fails(400, INVALID),
        revoke("L8 no operator", json!({"reason": "stuck worker"})).fails(400, INVALID),
        revoke(
            "L8 revoke",
            json!({"operator": "ops", "reason": "stuck worker", "expectedToken": "$t2"}),
        )
        .has_saved("/revokedToken", "t2")
        .has("/revokedOwnerId", "bob")
        .above(
            "/newTokenFloor",
            "t2",
            "the floor exceeds the revoked token",
        )
        .save("floor", "/newTokenFloor"),
        revoke(
            "L8 not held",
            json!({"operator": "ops", "reason": "stuck worker"}),
        )
        .fails(404, "NOT_FOUND"),
        post("L5 after revoke", "/v1/locks/payout:acct-1/renew")
            .owner("bob")
            .token("$t2")
            .session("$bob")
            .fails(409, "LOCK_LOST"),
        get("L7 after revoke", "/v1/locks/payout:acct-1").has("/held", false),
        post("L4 after revoke", "/v1/locks/payout:acct-1/acquire")
            .owner("alice")
            .session("$alice")
            .above(
                "/fencingToken",
                "floor",
                "tokens after a revocation exceed its floor",
            ),
        get("held list", "/v1/locks?limit=10")
            .check(Check::Len("/items", 1), "")
            .has("/items/0/key", "payout:acct-1"),
        get("held list bad limit", "/v1/locks?limit=0").fails(400, INVALID),
        delete("L3 end session", "/v1/sessions/$alice")
            .owner("alice")
            .answers(204),
        get("L7 after session end", "/v1/locks/payout:acct-1").check(
            Check::Eq("/held", json!(false)),
            "ending a session releases its locks",
        ),
        delete("L3 twice", "/v1/sessions/$alice")
            .owner("alice")
            .fails(404, "SESSION_UNKNOWN"),
        post("L2 after end", "/v1/sessions/$alice/heartbeat")
            .owner("alice")
            .fails(404, "SESSION_UNKNOWN"),
    ]
}

/// dave's short session and his grant on payout:acct-3.
fn short_session() -> Vec<Step> {
    vec![
        post("L1 short session", "/v1/sessions")
            .owner("dave")
            .json(json!({"ttlMillis": 1000}))
            .answers(201)
            .save("dave", "/sessionId"),
        post("L4 dave acquires", "/v1/locks/payout:acct-3/acquire")
            .owner("dave")
            .json(json!({"sessionId": "$dave", "ttlMillis": 30000}))
            .save("t5", "/fencingToken"),
    ]
}

/// Once dave's session has lapsed: 410 everywhere, and his lock is free.
fn expired_session() -> Vec<Step> {
    let expired = "SESSION_EXPIRED";
    vec![
        post("L2 expired", "/v1/sessions/$dave/heartbeat")
            .owner("dave")
            .fails(410, expired),
        post("L4 expired session", "/v1/locks/payout:acct-9/acquire")
            .owner("dave")
            .session("$dave")
            .fails(410, expired),
        post("L5 expired session", "/v1/locks/payout:acct-3/renew")
            .owner("dave")
            .token("$t5")
            .session("$dave")
            .fails(410, expired),
        get("L7 expired holder", "/v1/locks/payout:acct-3").check(
            Check::Eq("/held", json!(false)),
            "a lapsed session's locks are released (docs/contract.md#lock-lifecycle)",
        ),
        post("L4 take over", "/v1/locks/payout:acct-3/acquire")
            .owner("carol")
            .session("$carol")
            .above("/fencingToken", "t5", ""),
        delete("L3 expired", "/v1/sessions/$dave")
            .owner("dave")
            .fails(410, expired),
        delete("L6 lapsed grant", "/v1/locks/payout:acct-3")
            .owner("dave")
            .token("$t5")
            .session("$dave")
            .fails(409, "LOCK_LOST"),
        // Conventions on unknown routes and methods.
        get("unknown route", "/v1/nothing").fails(404, "NOT_FOUND"),
        step("wrong method", Method::PUT, "/v1/locks/payout:acct-1")
            .fails(405, "METHOD_NOT_ALLOWED"),
    ]
}

/// Waits until `probe` holds of the lock info at `path`.
async fn until_lock(url: &str, path: &str, what: &str, probe: fn(&Value) -> bool) {
    let info_url = format!("{url}{path}");
    eventually(what, Duration::from_secs(15), || {
        let info_url = info_url.clone();
        async move {
            let (_, _, info) = raw(Method::GET, &info_url, &[], None).await;
            probe(&info).then_some(())
        }
    })
    .await;
}

async fn script(backend: Backend) -> Vec<(String, u16, Value)> {
    let settings = [
        ("lock.session.ttl-max", "30000"),
        ("lock.ttl-max", "20000"),
        ("lock.waiters.max-per-key", "1"),
        ("lock.session.expired-retention", "600000"),
    ];
    let (stack, url) = LockStack::serving(backend, &settings).await;
    let mut s = Runner::new(&url, format!("{backend:?}"));
    s.run_all(&sessions()).await;
    s.run_all(&grants()).await;
    let t1 = s.int("t1");
    s.set("t1_plus_1000", json!(t1 + 1000));
    s.run_all(&bad_renewals()).await;

    // L4 with waitMillis: bob queues, carol finds the queue full, alice releases, bob is granted.
    let waiter_url = url.clone();
    let bob_sid = s.var("bob").clone();
    let waiter = tokio::spawn(async move {
        raw(
            Method::POST,
            &format!("{waiter_url}/v1/locks/payout:acct-1/acquire"),
            &[("x-owner-id", "bob"), ("content-type", "application/json")],
            Some(&json!({"sessionId": bob_sid, "waitMillis": 10000}).to_string()),
        )
        .await
    });
    until_lock(&url, "/v1/locks/payout:acct-1", "bob is queued", |info| {
        info["waiterCount"] == 1
    })
    .await;
    s.run_all(&queue()).await;
    s.run(
        &delete("L6 release", "/v1/locks/payout:acct-1")
            .owner("alice")
            .token("$t1")
            .session("$alice")
            .answers(204),
    )
    .await;
    let (status, _, g3) = waiter.await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        status, 200,
        "the waiter is granted once the holder releases: {g3}"
    );
    let t2 = g3["fencingToken"]
        .as_i64()
        .unwrap_or_else(|| panic!("fencingToken missing in {g3}"));
    assert!(t2 > t1, "a new grant gets a greater token");
    s.set("t2", json!(t2));
    s.transcript
        .push(("L4 waiter granted".into(), status, normalise(&g3)));
    s.run_all(&releases_and_revocations()).await;

    // Expiry: a session whose heartbeat lapses answers 410 everywhere, and its lock is free.
    s.run_all(&short_session()).await;
    // Watch the lock, not the session: a heartbeat would keep the session alive.
    until_lock(
        &url,
        "/v1/locks/payout:acct-3",
        "dave's session expires",
        |info| info["held"] == false,
    )
    .await;
    s.run_all(&expired_session()).await;
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

/// With the backend gone, every call that needs it answers 503 NOT_LEADER.
fn backend_down() -> Vec<Step> {
    let down = |step: Step| step.owner("w").fails(503, "NOT_LEADER");
    vec![
        down(post("L1 backend down", "/v1/sessions")),
        down(post("L2 backend down", "/v1/sessions/$sid/heartbeat")),
        down(post("L4 backend down", "/v1/locks/k/acquire").session("$sid")),
        down(delete("L3 backend down", "/v1/sessions/$sid")),
        get("readyz backend down", "/readyz").fails(503, "NOT_LEADER"),
    ]
}

async fn not_leader(backend: Backend) -> Vec<(String, u16, Value)> {
    // Short backend timeouts, so that each refused request answers quickly. The schema goes in
    // first through a pool of its own: under a loaded machine, connecting and migrating may take
    // longer than the short timeout meant for the refused requests.
    // The keys of this backend only: a service's configuration file holds no unknown key.
    let settings: &[(&str, &str)] = match backend {
        Backend::Pg => &[
            ("lock.pg.acquire-timeout-ms", "1000"),
            ("lock.pg.migrate", "false"),
        ],
        Backend::Etcd => &[("lock.etcd.request-timeout-ms", "1500")],
    };
    let mut stack = LockStack::backend(backend, settings);
    if let Some(pg) = stack.pg() {
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
    let mut s = Runner::new(&url, format!("{backend:?}"));
    s.run(
        &post("L1 while up", "/v1/sessions")
            .owner("w")
            .answers(201)
            .save("sid", "/sessionId"),
    )
    .await;
    match backend {
        Backend::Pg => stack.pg_mut().map(|p| p.kill()),
        Backend::Etcd => stack.etcd_mut().map(|e| e.kill()),
    };
    s.run_all(&backend_down()).await;
    let (status, _, _) = raw(Method::GET, &format!("{url}/healthz"), &[], None).await;
    assert_eq!(status, 200, "the process itself is healthy");
    s.transcript
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_unreachable_backend_is_not_leader_on_both_backends() {
    let (pg, etcd) = tokio::join!(not_leader(Backend::Pg), not_leader(Backend::Etcd));
    assert_eq!(pg, etcd);
}
