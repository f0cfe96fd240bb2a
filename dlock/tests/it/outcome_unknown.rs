//! Writes whose answer from the backend never came (docs/contract.md#outcome-unknown,
//! docs/faults.md#outcome-unknown). A fault proxy sits between the lock server and its backend,
//! lets one write through untouched and then cuts (PostgreSQL) or stalls past
//! `lock.etcd.request-timeout-ms` (etcd) its answer. The backend applied the write, and the
//! caller must hear `503 OUTCOME_UNKNOWN`, not retry-safe, never `503 NOT_LEADER` ("nothing was
//! changed"). The contract client settles such an acquire by reading the key, never by a blind
//! retry. Ending a session is one step on both backends: with the end's answer lost, the key
//! passes to another session and a retry of the end hears 404, never a 204 on a half-ended
//! session. A release whose answer is lost is OUTCOME_UNKNOWN too, and resent it is the benign
//! LOCK_LOST. Positive control: a backend reset before anything is sent is still `NOT_LEADER`,
//! retry-safe, and nothing changed.

use std::net::SocketAddr;
use std::time::Duration;

use dlock_contract::ErrorCode;
use dlock_contract::client::{ClientError, LockClient};
use dlock_contract::session::LockSession;
use dlock_devstack::faultproxy::{AfterMatch, FaultProxy, Mode};
use uuid::Uuid;

use crate::harness::{Backend, LockStack, client, hold, on_each_backend, session};

/// etcd's per-request deadline here; a stalled answer outlasts it.
const ETCD_TIMEOUT_MS: u64 = 1_000;
/// How long a stalled etcd answer is held back: past the deadline, and short enough that a read
/// sent right after the deadline is answered within its own.
const STALL: Duration = Duration::from_millis(1_600);

/// A lock server whose backend is reached through a fault proxy.
pub(crate) struct Proxied {
    pub(crate) stack: LockStack,
    pub(crate) proxy: FaultProxy,
    pub(crate) url: String,
}

impl Proxied {
    /// Awaits `call`, a write whose answer this proxy loses (`what`): asserts that it went through
    /// (the proxy fired once) and that its caller got an error; the error.
    async fn answer_lost<T>(
        &self,
        what: &str,
        call: impl std::future::Future<Output = Result<T, ClientError>>,
    ) -> ClientError {
        let lost = call
            .await
            .err()
            .unwrap_or_else(|| panic!("{what}: its answer was to be lost"));
        assert_eq!(self.proxy.fired(), 1, "{what}: it went through");
        lost
    }

    /// A session of the contract client's of `owner` on this lock server, a lock client of the
    /// same owner, and a new key: what a client's settling of a lost answer is tried with.
    async fn client_session(
        &self,
        owner: &str,
        backend: Backend,
    ) -> (LockSession, LockClient, String) {
        let session = LockSession::open(client(&self.url, owner), 30_000)
            .await
            .unwrap_or_else(|e| panic!("{backend:?} session: {e}"));
        (
            session,
            client(&self.url, owner),
            format!("ou:{}", Uuid::new_v4()),
        )
    }

    /// The proxy lost a second answer: `what`'s.
    fn assert_second_lost(&self, what: &str) {
        assert_eq!(self.proxy.fired(), 2, "{what}'s answer was lost");
    }
}

/// L7 of `key` through `lock`, on `backend`.
pub(crate) async fn l7(
    lock: &dlock_contract::client::LockClient,
    key: &str,
    backend: Backend,
) -> dlock_contract::lock::LockInfo {
    lock.get(key)
        .await
        .unwrap_or_else(|e| panic!("{backend:?} L7: {e}"))
}

fn port_of(url: &str) -> u16 {
    let tail = url.rsplit(':').next().unwrap_or_default();
    let digits: String = tail.chars().take_while(char::is_ascii_digit).collect();
    digits
        .parse()
        .unwrap_or_else(|e| panic!("no port in {url}: {e}"))
}

pub(crate) async fn proxied(backend: Backend) -> Proxied {
    let mut stack = LockStack::backend(backend, &[]);
    let upstream_port = match backend {
        Backend::Pg => port_of(&stack.pg().map(|p| p.url("lockdb")).unwrap_or_default()),
        Backend::Etcd => port_of(&stack.etcd().map(|e| e.endpoint()).unwrap_or_default()),
    };
    let upstream: SocketAddr = ([127, 0, 0, 1], upstream_port).into();
    let proxy = FaultProxy::start(([127, 0, 0, 1], 0).into(), upstream)
        .unwrap_or_else(|e| panic!("fault proxy: {e:#}"));
    let through = proxy.addr().port();
    let settings: Vec<(String, String)> = match backend {
        Backend::Pg => vec![
            (
                "lock.pg.url".into(),
                format!("postgres://postgres@127.0.0.1:{through}/lockdb"),
            ),
            ("lock.pg.acquire-timeout-ms".into(), "1000".into()),
        ],
        Backend::Etcd => vec![
            ("lock.etcd.endpoints".into(), proxy.url()),
            (
                "lock.etcd.request-timeout-ms".into(),
                ETCD_TIMEOUT_MS.to_string(),
            ),
        ],
    };
    stack.extra.extend(settings);
    let url = stack.serve().await;
    Proxied { stack, proxy, url }
}

impl Proxied {
    /// Arms the proxy for the write whose request carries `pattern` (after `skip` earlier
    /// requests that carry it): its answer is cut (PostgreSQL, a broken connection after the
    /// statement committed) or stalled past the request deadline (etcd).
    pub(crate) fn lose_answer_of(&self, pattern: &[u8], skip: usize) {
        let then = match self.stack.backend {
            Backend::Pg => AfterMatch::CutAnswer,
            Backend::Etcd => AfterMatch::StallAnswer(STALL),
        };
        self.proxy.after_request(pattern, skip, then);
    }
}

/// The answer is `503 OUTCOME_UNKNOWN`, not retry-safe, with what to do in its message.
fn assert_outcome_unknown(what: &str, error: &ClientError) {
    let ClientError::Api { status, body } = error else {
        panic!("{what}: expected the envelope, got {error}");
    };
    assert_eq!(
        (*status, body.code),
        (503, ErrorCode::OutcomeUnknown),
        "{what}: a write the backend applied must not be NOT_LEADER: {error}"
    );
    assert!(
        !body.retry_safe,
        "{what}: OUTCOME_UNKNOWN is never retry-safe"
    );
    assert!(body.retry_after_millis.is_none(), "{what}: {error}");
    assert!(
        body.message.contains("GET /v1/locks/"),
        "{what}: the message says to read the key first: {}",
        body.message
    );
    assert!(error.outcome_unknown(), "{what}: the client reads it so");
}

/// An acquire whose answer is lost is OUTCOME_UNKNOWN although it took the key; the contract
/// client's session settles one (reads the key, ends the orphan grant, acquires again) and
/// holds the key under a grant of its own; the positive control: a backend reset before the
/// write is sent is NOT_LEADER and changes nothing.
async fn acquire_answer_lost(backend: Backend) {
    let _ = tracing_subscriber::fmt().with_test_writer().try_init();
    let p = proxied(backend).await;
    let lock = client(&p.url, "worker-a");
    let sid = session(&lock, 30_000).await;
    let key = format!("ou:{}", Uuid::new_v4());
    // On etcd the key's `P/seen/` entry is written only by the granting transaction.
    let pattern = match backend {
        Backend::Pg => key.clone(),
        Backend::Etcd => format!("/seen/{key}"),
    };
    p.lose_answer_of(pattern.as_bytes(), 0);
    let what = format!("{backend:?} acquire");
    let lost = p
        .answer_lost(&what, lock.acquire(&key, sid, Some(20_000), None))
        .await;
    assert_outcome_unknown(&what, &lost);
    // The write was applied: the key is this session's. NOT_LEADER would have said otherwise.
    let info = l7(&lock, &key, backend).await;
    assert!(
        info.held && info.session_id == Some(sid),
        "{backend:?}: the acquire whose answer was lost took the key: {info:?}"
    );
    let orphan = info.fencing_token.unwrap_or_default();

    // The same through the contract client's session: the acquire's answer is lost, the client
    // reads the key, ends the grant it finds there and acquires again.
    let (worker, lock_b, key_b) = p.client_session("worker-b", backend).await;
    let pattern_b = match backend {
        Backend::Pg => key_b.clone(),
        Backend::Etcd => format!("/seen/{key_b}"),
    };
    p.lose_answer_of(pattern_b.as_bytes(), 0);
    let held = worker
        .acquire(&lock_b, &key_b, 20_000, None, 0.3)
        .await
        .unwrap_or_else(|e| panic!("{backend:?}: the session settles a lost acquire: {e}"));
    p.assert_second_lost(&format!("{backend:?}: the first acquire"));
    let info_b = l7(&lock_b, &key_b, backend).await;
    assert_eq!(
        (info_b.session_id, info_b.fencing_token),
        (Some(worker.id().await), Some(held.token())),
        "{backend:?}: the key is held by the grant the client got"
    );
    held.release(&lock_b)
        .await
        .unwrap_or_else(|e| panic!("{backend:?} release: {e}"));

    // Positive control: with every connection to the backend reset, nothing reaches it; the
    // acquire is NOT_LEADER, retry-safe, and took nothing.
    let key_c = format!("ou:{}", Uuid::new_v4());
    let resets = p.proxy.stats().reset;
    p.proxy.set_mode(Mode::Reset);
    // The lock server's open connections are reset before the acquire is sent.
    crate::harness::eventually("the open connections reset", Duration::from_secs(5), || {
        let reset = p.proxy.stats().reset;
        async move { (reset > resets).then_some(()) }
    })
    .await;
    let refused = lock
        .acquire(&key_c, sid, Some(20_000), None)
        .await
        .err()
        .unwrap_or_else(|| panic!("{backend:?}: an acquire without a backend was granted"));
    assert_eq!(
        refused.code(),
        Some(ErrorCode::NotLeader),
        "{backend:?}: nothing was sent, so nothing was changed: {refused}"
    );
    assert!(refused.retry_safe(), "{backend:?}: {refused}");
    p.proxy.set_mode(Mode::Forward);
    let after = crate::harness::eventually(
        "the lock server reaches its backend again",
        Duration::from_secs(20),
        || {
            let lock = lock.clone();
            let key_c = key_c.clone();
            async move {
                match lock.get(&key_c).await {
                    Err(e) if e.code() == Some(ErrorCode::NotFound) => Some(None),
                    Ok(info) => Some(Some(info)),
                    Err(_) => None,
                }
            }
        },
    )
    .await;
    assert!(
        after.is_none(),
        "{backend:?}: the refused acquire took nothing: {after:?}"
    );
    println!(
        "{backend:?}: acquire with its answer lost -> 503 OUTCOME_UNKNOWN, key held by the caller \
         (token {orphan}); LockSession settled one and holds token {}; backend reset -> 503 \
         NOT_LEADER, nothing taken",
        held.token()
    );
}

on_each_backend!(acquire_answer_lost =>
    an_acquire_whose_answer_is_lost_is_outcome_unknown_on_pg,
    an_acquire_whose_answer_is_lost_is_outcome_unknown_on_etcd);

/// The revision at which each of `keys` was deleted, from etcd's history after `since`.
async fn deletions(endpoint: &str, since: i64, keys: &[String]) -> Vec<i64> {
    let mut etcd = etcd_client::Client::connect([endpoint], None)
        .await
        .unwrap_or_else(|e| panic!("etcd: {e}"));
    let options = etcd_client::WatchOptions::new()
        .with_prefix()
        .with_start_revision(since + 1);
    let mut stream = etcd
        .watch("/dlock/", Some(options))
        .await
        .unwrap_or_else(|e| panic!("etcd watch: {e}"));
    let mut found: Vec<Option<i64>> = vec![None; keys.len()];
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while found.iter().any(Option::is_none) {
        let message = tokio::time::timeout_at(deadline, stream.message())
            .await
            .unwrap_or_else(|_| panic!("deletes of {keys:?} not seen: {found:?}"))
            .unwrap_or_else(|e| panic!("etcd watch: {e}"))
            .unwrap_or_else(|| panic!("the watch ended"));
        for event in message.events() {
            if event.event_type() != etcd_client::EventType::Delete {
                continue;
            }
            let Some(kv) = event.kv() else { continue };
            let name = kv.key_str().unwrap_or_default();
            if let Some(i) = keys.iter().position(|k| k == name) {
                found[i].get_or_insert(kv.mod_revision());
            }
        }
    }
    found.into_iter().flatten().collect()
}

/// Ending a session whose answer is lost: the end took everything with it at once (etcd: the
/// session and both grants deleted at one revision), another session takes a key at once, and
/// the retried end hears 404 SESSION_UNKNOWN, never 204 on a session still half alive.
async fn end_answer_lost(backend: Backend) {
    let p = proxied(backend).await;
    let lock = client(&p.url, "ender");
    let sid = session(&lock, 30_000).await;
    let keys = [
        format!("ou:{}", Uuid::new_v4()),
        format!("ou:{}", Uuid::new_v4()),
    ];
    for key in &keys {
        hold(&lock, key, sid, 30_000).await;
    }
    let before = match p.stack.etcd() {
        Some(etcd) => {
            let mut c = etcd_client::Client::connect([etcd.endpoint()], None)
                .await
                .unwrap_or_else(|e| panic!("etcd: {e}"));
            let answer = c
                .get("/dlock/ready", None)
                .await
                .unwrap_or_else(|e| panic!("etcd: {e}"));
            answer.header().map(|h| h.revision()).unwrap_or_default()
        }
        None => 0,
    };
    match backend {
        // dlock_end_session's session id, bound as 16 bytes.
        Backend::Pg => p.lose_answer_of(sid.as_bytes(), 0),
        // The tombstone is read once (the session's check), then deleted by the end.
        Backend::Etcd => p.lose_answer_of(format!("/t/{sid}").as_bytes(), 1),
    }
    let lost = p
        .answer_lost(&format!("{backend:?} end"), lock.end_session(sid))
        .await;
    let ClientError::Api { body, .. } = &lost else {
        panic!("{backend:?}: {lost}");
    };
    assert_eq!(
        body.code,
        ErrorCode::OutcomeUnknown,
        "{backend:?}: an end the backend applied must not be NOT_LEADER: {lost}"
    );
    assert!(!body.retry_safe);

    // The grants went with it: another session takes the first key at once.
    let other = client(&p.url, "next");
    let next = session(&other, 30_000).await;
    let taken = hold(&other, &keys[0], next, 30_000).await;
    let again = lock.end_session(sid).await;
    assert_eq!(
        again.as_ref().err().and_then(ClientError::code),
        Some(ErrorCode::SessionUnknown),
        "{backend:?}: the retried end must not answer 204 while {} is held elsewhere: {again:?}",
        keys[0]
    );
    let info = other
        .get(&keys[0])
        .await
        .unwrap_or_else(|e| panic!("L7: {e}"));
    assert_eq!(
        info.fencing_token,
        Some(taken.fencing_token),
        "{backend:?}: the retried end touched the grant that passed on"
    );
    if let Some(etcd) = p.stack.etcd() {
        let names = [
            format!("/dlock/s/{sid}"),
            format!("/dlock/l/{}", keys[0]),
            format!("/dlock/l/{}", keys[1]),
        ];
        let revisions = deletions(&etcd.endpoint(), before, &names).await;
        assert!(
            revisions.windows(2).all(|w| w[0] == w[1]),
            "the session and its grants go in one transaction: {names:?} deleted at {revisions:?}"
        );
        println!("etcd: session end deleted {names:?} at revisions {revisions:?}");
    }
    println!(
        "{backend:?}: end with its answer lost -> 503 OUTCOME_UNKNOWN; key passed to another \
         session (token {}); the retried end -> 404 SESSION_UNKNOWN",
        taken.fencing_token
    );
}

on_each_backend!(end_answer_lost =>
    ending_a_session_whose_answer_is_lost_is_one_step_on_pg,
    ending_a_session_whose_answer_is_lost_is_one_step_on_etcd);

/// A release whose answer is lost is OUTCOME_UNKNOWN although the grant is gone; resent, it is
/// the benign LOCK_LOST, never a second effect; `HeldLock::release` through the same fault reads
/// the key, finds its token gone and is done.
async fn release_answer_lost(backend: Backend) {
    let p = proxied(backend).await;
    let lock = client(&p.url, "releaser");
    let sid = session(&lock, 30_000).await;
    // What only the release's write carries: the key in dlock_release's Bind (pg), the grant's
    // index entry in the deleting transaction (etcd).
    let pattern = |key: &str, sid: Uuid| match backend {
        Backend::Pg => key.to_owned(),
        Backend::Etcd => format!("/i/{sid}/{key}"),
    };
    let key = format!("ou:{}", Uuid::new_v4());
    let grant = hold(&lock, &key, sid, 30_000).await;
    p.lose_answer_of(pattern(&key, sid).as_bytes(), 0);
    let what = format!("{backend:?} release");
    let lost = p
        .answer_lost(&what, lock.release(&key, sid, grant.fencing_token))
        .await;
    assert_outcome_unknown(&what, &lost);
    let info = l7(&lock, &key, backend).await;
    assert!(
        !info.held,
        "{backend:?}: the release whose answer was lost ended the grant: {info:?}"
    );
    let again = lock.release(&key, sid, grant.fencing_token).await;
    assert_eq!(
        again.as_ref().err().and_then(ClientError::code),
        Some(ErrorCode::LockLost),
        "{backend:?}: the resent release finds the grant gone: {again:?}"
    );

    let (worker, lock_b, key_b) = p.client_session("releaser-b", backend).await;
    let held = worker
        .acquire(&lock_b, &key_b, 20_000, None, 0.3)
        .await
        .unwrap_or_else(|e| panic!("{backend:?} acquire: {e}"));
    p.lose_answer_of(pattern(&key_b, worker.id().await).as_bytes(), 0);
    held.release(&lock_b)
        .await
        .unwrap_or_else(|e| panic!("{backend:?}: the client settles a lost release: {e}"));
    p.assert_second_lost(&format!("{backend:?}: the release"));
    let info_b = l7(&lock_b, &key_b, backend).await;
    assert!(!info_b.held, "{backend:?}: released: {info_b:?}");
    println!(
        "{backend:?}: release with its answer lost -> 503 OUTCOME_UNKNOWN, grant gone, resent -> \
         409 LOCK_LOST; HeldLock::release settled one by reading the key"
    );
}

on_each_backend!(release_answer_lost =>
    a_release_whose_answer_is_lost_is_outcome_unknown_on_pg,
    a_release_whose_answer_is_lost_is_outcome_unknown_on_etcd);
