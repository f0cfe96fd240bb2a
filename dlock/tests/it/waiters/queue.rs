//! The waiter queue of a key: a waiter whose client hangs up leaves the head at once; one session
//! holds at most its share of the queue; waiters of dead sessions (a replica that died mid-wait,
//! then the session ended or expired) are not counted and do not hold the head; the cap holds
//! under a burst of concurrent enqueues.

use super::*;

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

/// The client of a waiting acquire hangs up (its request future is dropped, so its
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

/// With a cap of 3 places, one session's second concurrent wait for the key is
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

/// A replica dies while two of its clients wait (SIGKILL: nothing dequeues them).
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

/// Twelve sessions join a queue of 2 places at once, through two replicas. The
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
