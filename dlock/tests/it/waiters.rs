//! Tests of the lock server's waiter queue, its audit identity and its retention.
//!
//! Item 11: a waiter whose client hangs up leaves the head of its key's queue at once; one
//! session holds at most its share of a key's queue; waiters of dead sessions (a replica that
//! died mid-wait, then the session ended or expired) are not counted and do not hold the head;
//! on etcd the cap holds under a burst of concurrent enqueues.
//! Item 13: a revocation records the authenticated identity beside the free-text `operator`;
//! `POST /v1/sessions` binds the body's `ownerId` to the credential when `X-Owner-Id` is absent.
//! Item 16: `lock_keys_seen` (pg) and `P/seen/` (etcd) are swept after
//! `lock.keys-seen.retention`, a held key is kept, and a key's next token is still above every
//! token and revocation floor before the sweep.

use std::time::{Duration, Instant};

use dlock_contract::ErrorCode;
use dlock_contract::client::{ClientError, LockClient};
use serde_json::{Value, json};
use uuid::Uuid;

use crate::harness::{
    BOTH, Backend, LockStack, client, eventually, hold, on_both_backends, party, port, post_json,
    release, session,
};

const JSON: &str = "application/json; charset=utf-8";

fn code<T: std::fmt::Debug>(result: &Result<T, ClientError>) -> Option<ErrorCode> {
    result.as_ref().err().and_then(ClientError::code)
}

async fn waiter_count(client: &LockClient, key: &str) -> i64 {
    client
        .get(key)
        .await
        .unwrap_or_else(|e| panic!("L7 {key}: {e}"))
        .waiter_count
}

async fn await_waiters(client: &LockClient, key: &str, n: i64, what: &str) {
    eventually(what, Duration::from_secs(10), || async {
        (waiter_count(client, key).await == n).then_some(())
    })
    .await;
}

type Waiting = tokio::task::JoinHandle<Result<dlock_contract::lock::LockGrant, ClientError>>;

/// What a waiting acquire ended with.
async fn joined(waiting: Waiting) -> Result<dlock_contract::lock::LockGrant, ClientError> {
    waiting
        .await
        .unwrap_or_else(|e| panic!("the waiting task: {e}"))
}

/// `key`'s waiter queue, as its holder sees it.
struct Queue<'a> {
    holder: &'a LockClient,
    key: &'a str,
}

impl<'a> Queue<'a> {
    /// `key` granted to `holder` on a new session, both for 60 s: its queue, the session and the
    /// grant.
    async fn held(
        holder: &'a LockClient,
        key: &'a str,
    ) -> (Self, Uuid, dlock_contract::lock::LockGrant) {
        let h = session(holder, 60_000).await;
        let grant = hold(holder, key, h, 60_000).await;
        (Self { holder, key }, h, grant)
    }

    /// `waiter` waits on `session` up to `wait_ms`; returns once the queue holds `place` waiters.
    async fn join(
        &self,
        waiter: &LockClient,
        session: Uuid,
        wait_ms: i64,
        place: i64,
        what: &str,
    ) -> Waiting {
        let waiting = wait_for(waiter, self.key, session, wait_ms);
        await_waiters(self.holder, self.key, place, what).await;
        waiting
    }

    /// `from` releases its grant (`session`, `token`); what `to` then ends with.
    async fn pass(
        &self,
        from: &LockClient,
        session: Uuid,
        token: i64,
        to: Waiting,
    ) -> Result<dlock_contract::lock::LockGrant, ClientError> {
        release(from, self.key, session, token).await;
        joined(to).await
    }

    /// The holder releases its grant (`session`, `token`); what `waiting` ended with and how long
    /// after the release.
    async fn hand_over(
        &self,
        session: Uuid,
        token: i64,
        waiting: Waiting,
    ) -> (
        Result<dlock_contract::lock::LockGrant, ClientError>,
        Duration,
    ) {
        let released = Instant::now();
        release(self.holder, self.key, session, token).await;
        let granted = joined(waiting).await;
        (granted, released.elapsed())
    }
}

fn wait_for(client: &LockClient, key: &str, session: Uuid, wait_ms: i64) -> Waiting {
    let client = client.clone();
    let key = key.to_owned();
    tokio::spawn(async move {
        client
            .acquire(&key, session, Some(30_000), Some(wait_ms))
            .await
    })
}

/// Item 11: the client of a waiting acquire hangs up (its request future is dropped, so its
/// connection closes). Its place must go at once, not at its deadline (waitMillis + 1 s), and
/// the next waiter must be granted as soon as the holder releases.
async fn cancelled_waiter_leaves_the_head(backend: Backend) {
    let (_stack, url) = LockStack::serving(backend, &[]).await;
    let holder = client(&url, "holder");
    let (quitter, q) = party(&url, "quitter", 60_000).await;
    let (next, n) = party(&url, "next", 60_000).await;
    let (queue, h, grant) = Queue::held(&holder, "wait:cancel").await;
    let key = queue.key;

    const WAIT_MS: i64 = 20_000;
    let quitting = queue
        .join(&quitter, q, WAIT_MS, 1, "the quitter queued")
        .await;
    let hung_up = Instant::now();
    quitting.abort();
    let _ = quitting.await;
    await_waiters(&holder, key, 0, "the cancelled waiter left the queue").await;
    let left_after = hung_up.elapsed();

    let waiting = queue
        .join(&next, n, WAIT_MS, 1, "the next waiter queued")
        .await;
    let (granted, granted_after) = queue.hand_over(h, grant.fencing_token, waiting).await;
    let granted =
        granted.unwrap_or_else(|e| panic!("{backend:?}: the next waiter was not granted: {e}"));
    eprintln!(
        "{backend:?}: cancelled waiter (waitMillis {WAIT_MS}) left the queue {} ms after its client hung up; \
         the next waiter was granted {} ms after the release",
        left_after.as_millis(),
        granted_after.as_millis()
    );
    assert_eq!(granted.owner_id, "next");
    assert!(granted.fencing_token > grant.fencing_token);
    assert!(
        left_after < Duration::from_secs(2),
        "{backend:?}: the cancelled waiter stayed {left_after:?}"
    );
    assert!(
        granted_after < Duration::from_secs(2),
        "{backend:?}: the next waiter waited {granted_after:?} after the release (waitMillis {WAIT_MS})"
    );
}

on_both_backends!(a_waiter_whose_client_hangs_up_leaves_the_head_at_once_on_both_backends => cancelled_waiter_leaves_the_head);

/// Item 11: with a cap of 3 places, one session's second concurrent wait for the key is
/// CONTENTION_EXCEEDED, and another session still gets a place; FIFO order holds.
async fn a_session_holds_its_share_only(backend: Backend) {
    let (_stack, url) = LockStack::serving(backend, &[("lock.waiters.max-per-key", "3")]).await;
    let holder = client(&url, "holder");
    let (greedy, g) = party(&url, "greedy", 60_000).await;
    let (other, o) = party(&url, "other", 60_000).await;
    let (queue, h, grant) = Queue::held(&holder, "wait:share").await;
    let key = queue.key;

    let first = queue
        .join(&greedy, g, 20_000, 1, "greedy's first wait queued")
        .await;
    // The same session again, twice: over its share, whatever the free places.
    for _ in 0..2 {
        let (status, content_type, body) = post_json(
            &format!("{url}/v1/locks/{key}/acquire"),
            &[("x-owner-id", "greedy")],
            &json!({ "sessionId": g, "waitMillis": 20_000 }),
        )
        .await;
        assert_eq!(status, 429, "{backend:?}: {body}");
        assert_eq!(content_type, JSON);
        assert_eq!(body["code"], "CONTENTION_EXCEEDED", "{body}");
        assert_eq!(body["retrySafe"], true);
        assert!(body["retryAfterMillis"].as_u64().is_some(), "{body}");
        assert_eq!(body["details"]["sessionWaitersMax"], 1, "{body}");
    }
    assert_eq!(waiter_count(&holder, key).await, 1, "{backend:?}");
    // Another session still gets a place.
    let second = queue
        .join(&other, o, 20_000, 2, "the other session queued")
        .await;

    let g1 = queue.pass(&holder, h, grant.fencing_token, first).await;
    let g1 = g1.unwrap_or_else(|e| panic!("{backend:?}: greedy's wait: {e}"));
    assert_eq!(g1.owner_id, "greedy", "FIFO: the first waiter first");
    let o1 = queue.pass(&greedy, g, g1.fencing_token, second).await;
    let o1 = o1.unwrap_or_else(|e| panic!("{backend:?}: other's wait: {e}"));
    assert_eq!(o1.owner_id, "other");
    assert!(o1.fencing_token > g1.fencing_token);
    // Its wait over, the session may wait again.
    let again = queue
        .join(&greedy, g, 20_000, 1, "greedy queued again")
        .await;
    let g2 = queue.pass(&other, o, o1.fencing_token, again).await;
    let g2 = g2.unwrap_or_else(|e| panic!("{backend:?}: greedy's second wait: {e}"));
    assert!(g2.fencing_token > o1.fencing_token);
}

on_both_backends!(one_session_cannot_fill_a_keys_waiter_queue_on_both_backends => a_session_holds_its_share_only);

/// Item 11: a replica dies while two of its clients wait (SIGKILL: nothing dequeues them).
/// One waiter's session is then ended, the other's expires. Neither may count towards the cap
/// (2) nor hold the head: two live sessions both get a place, and the first is granted as soon
/// as the holder releases, long before the dead waiters' entries would lapse (waitMillis + 1 s).
async fn dead_sessions_waiters_do_not_count(backend: Backend) {
    let (stack, url) = LockStack::serving(backend, &[("lock.waiters.max-per-key", "2")]).await;
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let doomed_port = port();
    let mut doomed = stack.spawn_process(doomed_port, &dir.path().join("doomed.log"));
    let doomed_url = format!("http://127.0.0.1:{doomed_port}");

    let holder = client(&url, "holder");
    let (queue, h, grant) = Queue::held(&holder, "wait:dead").await;
    let key = queue.key;
    // Two waiters through the doomed replica: one whose session will be ended, one whose
    // session (TTL 5 s, never heartbeaten) will expire.
    let ended = client(&doomed_url, "ended");
    let expiring = client(&doomed_url, "expiring");
    let e_session = session(&ended, 60_000).await;
    let x_session = session(&expiring, 5_000).await;
    let w1 = queue
        .join(
            &ended,
            e_session,
            20_000,
            1,
            "the first doomed waiter queued",
        )
        .await;
    let w2 = queue
        .join(
            &expiring,
            x_session,
            20_000,
            2,
            "the second doomed waiter queued",
        )
        .await;
    doomed.kill();
    let _ = (w1.await, w2.await);
    // Positive control: the dead replica's waiters still fill the queue while their sessions live.
    let (live, l) = party(&url, "live", 60_000).await;
    let full = live.acquire(key, l, Some(30_000), Some(5_000)).await;
    assert_eq!(
        code(&full),
        Some(ErrorCode::ContentionExceeded),
        "{backend:?}: {full:?}"
    );

    client(&url, "ended")
        .end_session(e_session)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    // Probed with an acquire that does not wait (a heartbeat would keep the session alive):
    // LOCK_CONTENDED while the session lives, SESSION_EXPIRED once it lapsed.
    let probe = client(&url, "expiring");
    eventually(
        "the unheartbeaten session expired",
        Duration::from_secs(15),
        || async {
            let tried = probe.acquire(key, x_session, Some(30_000), None).await;
            (code(&tried) == Some(ErrorCode::SessionExpired)).then_some(())
        },
    )
    .await;
    assert_eq!(
        waiter_count(&holder, key).await,
        0,
        "{backend:?}: dead sessions' waiters are counted"
    );

    // Both places are free for live sessions.
    let (late, t) = party(&url, "late", 60_000).await;
    let first = queue
        .join(&live, l, 20_000, 1, "the live waiter queued")
        .await;
    let second = queue
        .join(&late, t, 20_000, 2, "the late waiter queued")
        .await;
    let (granted, after) = queue.hand_over(h, grant.fencing_token, first).await;
    let granted = granted.unwrap_or_else(|e| panic!("{backend:?}: the live waiter: {e}"));
    eprintln!(
        "{backend:?}: with two dead sessions' waiters ahead, the live waiter was granted {} ms after the release",
        after.as_millis()
    );
    assert_eq!(granted.owner_id, "live");
    assert!(
        after < Duration::from_secs(2),
        "{backend:?}: a dead waiter held the head for {after:?}"
    );
    let granted = queue.pass(&live, l, granted.fencing_token, second).await;
    let granted = granted.unwrap_or_else(|e| panic!("{backend:?}: the late waiter: {e}"));
    assert_eq!(granted.owner_id, "late");
}

on_both_backends!(waiters_of_dead_sessions_neither_fill_the_cap_nor_hold_the_head_on_both_backends => dead_sessions_waiters_do_not_count);

/// Item 11 (etcd): twelve sessions join a queue of 2 places at once, through two replicas. The
/// cap is a transaction against the whole queue, so exactly 2 are queued and 10 are refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_waiter_cap_holds_under_a_burst_of_enqueues_on_both_backends() {
    for backend in BOTH {
        let mut stack = LockStack::backend(backend, &[("lock.waiters.max-per-key", "2")]);
        let urls = [stack.serve().await, stack.serve().await];
        let (holder, h) = party(&urls[0], "holder", 60_000).await;
        let key = "wait:burst";
        let grant = hold(&holder, key, h, 60_000).await;
        let mut sessions = Vec::new();
        for i in 0..12 {
            let c = client(&urls[i % 2], &format!("burst-{i}"));
            let s = session(&c, 60_000).await;
            sessions.push((c, s));
        }
        let barrier = std::sync::Arc::new(tokio::sync::Barrier::new(sessions.len()));
        let tasks: Vec<_> = sessions
            .iter()
            .map(|(c, s)| {
                let (c, s, barrier) = (c.clone(), *s, barrier.clone());
                tokio::spawn(async move {
                    barrier.wait().await;
                    let grant = c.acquire(key, s, Some(30_000), Some(10_000)).await?;
                    // Released at once, so the next in line is granted.
                    c.release(key, s, grant.fencing_token).await?;
                    Ok::<_, ClientError>(grant)
                })
            })
            .collect();
        // The refusals come back at once; the queued ones wait.
        let refused = eventually("ten refusals", Duration::from_secs(15), || {
            let n = tasks.iter().filter(|t| t.is_finished()).count();
            async move { (n >= 10).then_some(n) }
        })
        .await;
        assert_eq!(refused, 10, "{backend:?}");
        assert_eq!(waiter_count(&holder, key).await, 2, "{backend:?}");
        release(&holder, key, h, grant.fencing_token).await;
        let mut granted = 0;
        let mut contention_exceeded = 0;
        for task in tasks {
            match task.await.unwrap_or_else(|e| panic!("{e}")) {
                Ok(_) => granted += 1,
                Err(e) if e.code() == Some(ErrorCode::ContentionExceeded) => {
                    contention_exceeded += 1
                }
                Err(e) => panic!("{backend:?}: {e}"),
            }
        }
        eprintln!(
            "{backend:?}: burst of 12 on a cap of 2: {granted} granted, {contention_exceeded} refused"
        );
        assert_eq!((granted, contention_exceeded), (2, 10), "{backend:?}");
    }
}

/// A tokens file with a worker and the operator, and its configuration keys.
fn auth_files(dir: &std::path::Path) -> (String, [(&'static str, String); 2]) {
    let path = dir.join("tokens");
    std::fs::write(
        &path,
        "worker-a wrk-a-0123456789abcdef\noperator opr-0123456789abcdef\n",
    )
    .unwrap_or_else(|e| panic!("{e}"));
    (
        path.display().to_string(),
        [
            ("auth.mode", "tokens".to_owned()),
            ("auth.tokens-file", path.display().to_string()),
        ],
    )
}

const WORKER: &str = "Bearer wrk-a-0123456789abcdef";
const OPERATOR: &str = "Bearer opr-0123456789abcdef";

/// Every session the backend holds, as (session id, owner).
async fn stored_sessions(stack: &LockStack) -> Vec<String> {
    match stack.backend {
        Backend::Pg => {
            let pool = lockdb(stack).await;
            let rows: Vec<(Uuid, String)> =
                sqlx::query_as("SELECT session_id, owner_id FROM sessions ORDER BY 1")
                    .fetch_all(&pool)
                    .await
                    .unwrap_or_else(|e| panic!("{e}"));
            rows.into_iter().map(|(s, o)| format!("{s} {o}")).collect()
        }
        Backend::Etcd => {
            let mut etcd = etcd(stack).await;
            let response = etcd
                .get(
                    "/dlock/s/",
                    Some(etcd_client::GetOptions::new().with_prefix()),
                )
                .await
                .unwrap_or_else(|e| panic!("{e}"));
            response
                .kvs()
                .iter()
                .map(|kv| {
                    format!(
                        "{} {}",
                        kv.key_str().unwrap_or_default(),
                        kv.value_str().unwrap_or_default()
                    )
                })
                .collect()
        }
    }
}

async fn lockdb(stack: &LockStack) -> sqlx::PgPool {
    let url = stack
        .pg
        .as_ref()
        .map(|p| p.url("lockdb"))
        .unwrap_or_else(|| panic!("no pg"));
    sqlx::PgPool::connect(&url)
        .await
        .unwrap_or_else(|e| panic!("{e}"))
}

async fn etcd(stack: &LockStack) -> etcd_client::Client {
    let endpoint = stack
        .etcd
        .as_ref()
        .map(|e| e.endpoint())
        .unwrap_or_else(|| panic!("no etcd"));
    etcd_client::Client::connect([endpoint], None)
        .await
        .unwrap_or_else(|e| panic!("{e}"))
}

async fn open_session(
    url: &str,
    auth: &str,
    header: Option<&str>,
    body: Value,
) -> (u16, String, Value) {
    let mut headers = vec![("authorization", auth)];
    headers.extend(header.map(|owner| ("x-owner-id", owner)));
    post_json(&format!("{url}/v1/sessions"), &headers, &body).await
}

/// `POST /v1/sessions` as `auth`, the owner `owner` named in the body only.
async fn open_named(url: &str, auth: &str, owner: &str) -> (u16, String, Value) {
    let body = json!({ "ownerId": owner, "ttlMillis": 5_000 });
    open_session(url, auth, None, body).await
}

/// Item 13: `POST /v1/sessions` with the owner in the body only. The auth layer binds
/// `X-Owner-Id`; the body's `ownerId` is bound by the same rule: a worker cannot open a session
/// in another worker's name (403 FORBIDDEN, nothing stored); its own name, `<identity>/<worker>`
/// and an operator naming anyone still open one.
async fn body_owner_is_bound(backend: Backend) {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let (_, keys) = auth_files(dir.path());
    let extra: Vec<(&str, &str)> = keys.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let (stack, url) = LockStack::serving(backend, &extra).await;

    let before = stored_sessions(&stack).await;
    for foreign in ["worker-b", "worker-ab", "worker-a-x/1"] {
        let (status, content_type, body) = open_named(&url, WORKER, foreign).await;
        assert_eq!(status, 403, "{backend:?}: {foreign}: {body}");
        assert_eq!(content_type, JSON);
        assert_eq!(body["code"], "FORBIDDEN", "{body}");
        assert_eq!(body["retrySafe"], false, "{body}");
    }
    // The header route is refused by the auth layer as before.
    let (status, _, body) = open_session(
        &url,
        WORKER,
        Some("worker-b"),
        json!({ "ttlMillis": 5_000 }),
    )
    .await;
    assert_eq!(status, 403, "{body}");
    assert_eq!(
        stored_sessions(&stack).await,
        before,
        "{backend:?}: a refused session was stored"
    );

    // Positive controls.
    for (auth, owner) in [
        (WORKER, "worker-a"),
        (WORKER, "worker-a/pod-1"),
        (OPERATOR, "worker-b"),
    ] {
        let (status, content_type, body) = open_named(&url, auth, owner).await;
        assert_eq!(status, 201, "{backend:?}: {owner}: {body}");
        assert_eq!(content_type, JSON);
        assert_eq!(body["ownerId"], owner);
    }
    assert_eq!(stored_sessions(&stack).await.len(), before.len() + 3);
}

on_both_backends!(a_session_body_owner_id_is_bound_to_the_credential_on_both_backends => body_owner_is_bound);

/// The stored revocation record: (operator, revoked_by).
async fn stored_revocation(stack: &LockStack, id: &str) -> (String, Option<String>) {
    match stack.backend {
        Backend::Pg => {
            let pool = lockdb(stack).await;
            sqlx::query_as(
                "SELECT operator, revoked_by FROM revocations WHERE revocation_id = $1::uuid",
            )
            .bind(id)
            .fetch_one(&pool)
            .await
            .unwrap_or_else(|e| panic!("{e}"))
        }
        Backend::Etcd => {
            let mut etcd = etcd(stack).await;
            let response = etcd
                .get(format!("/dlock/r/{id}"), None)
                .await
                .unwrap_or_else(|e| panic!("{e}"));
            let kv = response
                .kvs()
                .first()
                .unwrap_or_else(|| panic!("no revocation {id}"));
            let record: Value =
                serde_json::from_slice(kv.value()).unwrap_or_else(|e| panic!("{e}"));
            (
                record["operator"].as_str().unwrap_or_default().to_owned(),
                record["revokedBy"].as_str().map(str::to_owned),
            )
        }
    }
}

/// Item 13: the body's `operator` is free text; the revocation also records who the credential
/// proved the caller to be. Without authentication there is nobody to record.
async fn revocation_records_identity(backend: Backend) {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let (_, keys) = auth_files(dir.path());
    let extra: Vec<(&str, &str)> = keys.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let (stack, url) = LockStack::serving(backend, &extra).await;
    let worker = client(&url, "worker-a/pod-1").with_credential(Some(
        dlock_contract::auth::Credential::fixed("wrk-a-0123456789abcdef"),
    ));
    let s = session(&worker, 60_000).await;
    let grant = hold(&worker, "audit:k", s, 60_000).await;
    let (status, content_type, body) = post_json(
        &format!("{url}/v1/locks/audit:k/revoke"),
        &[("authorization", OPERATOR), ("x-owner-id", "ops")],
        &json!({ "operator": "somebody else entirely", "reason": "stuck worker on audit:k",
                 "expectedToken": grant.fencing_token }),
    )
    .await;
    assert_eq!(status, 200, "{backend:?}: {body}");
    assert_eq!(content_type, JSON);
    let id = body["revocationId"].as_str().unwrap_or_default().to_owned();
    let (operator, revoked_by) = stored_revocation(&stack, &id).await;
    assert_eq!(operator, "somebody else entirely");
    assert_eq!(revoked_by.as_deref(), Some("operator"), "{backend:?}");

    // auth.mode = none: the record says no identity was proved.
    let (open, url) = LockStack::serving(backend, &[]).await;
    let (anyone, s) = party(&url, "anyone", 60_000).await;
    let revocation =
        held_then_revoked(&anyone, "audit:k", s, ("laptop", "testing the audit trail")).await;
    let (operator, revoked_by) =
        stored_revocation(&open, &revocation.revocation_id.to_string()).await;
    assert_eq!(operator, "laptop");
    assert_eq!(revoked_by, None, "{backend:?}");
}

on_both_backends!(a_revocation_records_the_authenticated_identity_on_both_backends => revocation_records_identity);

/// `client` holds `key` on `session` for 60 s, then revokes it as `operator` for `reason`.
async fn held_then_revoked(
    client: &LockClient,
    key: &str,
    session: Uuid,
    (operator, reason): (&str, &str),
) -> dlock_contract::lock::Revocation {
    hold(client, key, session, 60_000).await;
    client
        .revoke(key, operator, reason, None)
        .await
        .unwrap_or_else(|e| panic!("{e}"))
}

async fn status_of(client: &LockClient, key: &str) -> Option<ErrorCode> {
    code(&client.get(key).await)
}

/// Item 16: with `lock.keys-seen.retention` at 1 s and a sweep every 100 ms (a real `dlock serve
/// lock-server` process), a released key and a revoked key are forgotten (L7 404), a held key is
/// kept, and the next grants of the forgotten keys are above every token and floor before.
async fn keys_seen_are_swept(backend: Backend) {
    let stack = LockStack::backend(
        backend,
        &[
            ("lock.keys-seen.retention", "1000"),
            ("lock.sweep.interval-ms", "100"),
        ],
    );
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let p = port();
    let mut server = stack.spawn_process(p, &dir.path().join("lock.log"));
    let url = format!("http://127.0.0.1:{p}");
    let (c, s) = party(&url, "sweeper-test", 60_000).await;

    // Held throughout, and granted first: its last grant is the oldest of all.
    let held = hold(&c, "seen:held", s, 60_000).await;
    let old = hold(&c, "seen:old", s, 60_000).await;
    release(&c, "seen:old", s, old.fencing_token).await;
    let revocation =
        held_then_revoked(&c, "seen:revoked", s, ("test", "retention of keys seen")).await;
    let highest_before = revocation.new_token_floor;
    assert_eq!(c.get("seen:old").await.map(|i| i.held).ok(), Some(false));

    let started = Instant::now();
    for key in ["seen:old", "seen:revoked"] {
        let c = c.clone();
        eventually(
            &format!("{backend:?}: {key} swept"),
            Duration::from_secs(15),
            || {
                let c = c.clone();
                async move { (status_of(&c, key).await == Some(ErrorCode::NotFound)).then_some(()) }
            },
        )
        .await;
    }
    eprintln!(
        "{backend:?}: keys unused for 1 s were forgotten {} ms after the last grant",
        started.elapsed().as_millis()
    );
    // The held key outlived the same sweeps.
    let info = c.get("seen:held").await.unwrap_or_else(|e| panic!("{e}"));
    assert!(info.held, "{backend:?}");
    assert_eq!(info.fencing_token, Some(held.fencing_token));
    if backend == Backend::Pg {
        let pool = lockdb(&stack).await;
        let keys: Vec<(String,)> = sqlx::query_as("SELECT lock_key FROM lock_keys_seen ORDER BY 1")
            .fetch_all(&pool)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(keys, vec![("seen:held".to_owned(),)]);
    }

    // The forgotten keys' next tokens are above everything issued before the sweep.
    for key in ["seen:old", "seen:revoked"] {
        let again = hold(&c, key, s, 60_000).await;
        assert!(
            again.fencing_token > highest_before && again.fencing_token > old.fencing_token,
            "{backend:?}: {key} went backwards: {} after a floor of {highest_before}",
            again.fencing_token
        );
        let info = c.get(key).await.unwrap_or_else(|e| panic!("{e}"));
        assert!(info.held);
    }
    server.stop();
}

on_both_backends!(keys_seen_are_swept_after_their_retention_and_tokens_never_go_back_on_both_backends => keys_seen_are_swept);
