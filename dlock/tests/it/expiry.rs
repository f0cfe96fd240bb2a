//! docs/contract.md#lock-lifecycle: when a session lapses or ends, every lock attached to it is
//! released.

use std::time::{Duration, Instant};

use dlock_contract::ErrorCode;
use dlock_contract::session::LockSession;

use crate::harness::{Backend, LockStack, client, eventually, hold, on_both_backends, session};

async fn session_end_releases_every_lock(backend: Backend) {
    let (_stack, url) = LockStack::serving(backend, &[]).await;
    let holder = client(&url, "holder");
    let other = client(&url, "other");
    let short = session(&holder, 1_000).await;
    let long = session(&holder, 30_000).await;
    let watcher = session(&other, 30_000).await;
    for key in ["fr04:a", "fr04:b", "fr04:c"] {
        hold(&holder, key, short, 60_000).await;
    }
    for key in ["fr04:d", "fr04:e"] {
        hold(&holder, key, long, 60_000).await;
    }
    // While the short session lives, its locks are held against others.
    let busy = other.acquire("fr04:a", watcher, None, None).await;
    assert_eq!(
        busy.err().and_then(|e| e.code()),
        Some(ErrorCode::LockContended)
    );
    // Without heartbeats it lapses; its grants end with it although their own TTL is a minute.
    // Watch a lock, not the session: a heartbeat would keep the session alive.
    eventually(
        "the short session lapses",
        Duration::from_secs(15),
        || async { (!other.get("fr04:a").await.ok()?.held).then_some(()) },
    )
    .await;
    let lapsed = holder.heartbeat(short).await;
    assert_eq!(
        lapsed.err().and_then(|e| e.code()),
        Some(ErrorCode::SessionExpired)
    );
    for key in ["fr04:a", "fr04:b", "fr04:c"] {
        let info = other.get(key).await.unwrap_or_else(|e| panic!("{e}"));
        assert!(!info.held, "{key} is still held after its session lapsed");
        other
            .acquire(key, watcher, None, None)
            .await
            .unwrap_or_else(|e| panic!("{key}: {e}"));
    }
    // Ending the long session releases its locks at once.
    holder
        .end_session(long)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    for key in ["fr04:d", "fr04:e"] {
        other
            .acquire(key, watcher, None, None)
            .await
            .unwrap_or_else(|e| panic!("{key}: {e}"));
    }
    let held = other.held(None).await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(held.items.len(), 5);
    assert!(held.items.iter().all(|g| g.owner_id == "other"));
}

on_both_backends!(a_lapsed_or_ended_session_releases_every_lock_on_both_backends => session_end_releases_every_lock);

/// The contract's `LockSession` keeps a session alive past its TTL, gives each held lock a
/// deadline from the granted lease, and says when the session is lost (here: ended behind its
/// back), opening a new one for later acquires.
async fn a_lock_session_lives_on_heartbeats_and_says_when_it_is_lost(backend: Backend) {
    let (_stack, url) = LockStack::serving(backend, &[]).await;
    let holder = client(&url, "holder");
    let other = client(&url, "other");
    let session = LockSession::open(holder.clone(), 1_500)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let first = session.liveness().await;
    assert_eq!(first.ttl_ms, 1_500);
    let mut lost = session.lost();
    let before = Instant::now();
    let held = session
        .acquire(&holder, "session:a", 10_000, None, 0.30)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let after = Instant::now();
    // The lease is cut at the session's expiry (at most 1.5 s away, not the lock's 10 s), and
    // 30 % of that is kept as margin.
    assert!(held.deadline <= after + Duration::from_millis(1_050));
    assert!(held.deadline > before, "a fresh grant has time left");
    // Heartbeats keep it: three session TTLs later the lock is still held and nothing was lost.
    tokio::time::sleep(Duration::from_millis(4_500)).await;
    let info = other
        .get("session:a")
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(info.held, "the session lapsed despite its heartbeats");
    assert_eq!(*lost.borrow_and_update(), 0);
    assert_eq!(session.id().await, first.id);
    // Ended behind its back: the loss is signalled and a new session is opened.
    holder
        .end_session(first.id)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    tokio::time::timeout(Duration::from_secs(10), lost.changed())
        .await
        .unwrap_or_else(|_| panic!("{backend:?}: no loss signalled within 10 s"))
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(*lost.borrow(), 1);
    let renewed = eventually("a new session", Duration::from_secs(10), || async {
        let now = session.liveness().await;
        (now.id != first.id).then_some(now)
    })
    .await;
    let again = session
        .acquire(&holder, "session:a", 10_000, None, 0.30)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(again.grant.session_id, renewed.id);
    assert!(again.token() > held.token());
    again
        .release(&holder)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    session.close().await.unwrap_or_else(|e| panic!("{e}"));
    let closed = holder.heartbeat(renewed.id).await;
    assert!(
        matches!(
            closed.err().and_then(|e| e.code()),
            Some(ErrorCode::SessionUnknown | ErrorCode::SessionExpired)
        ),
        "close ends the session at the server"
    );
}

on_both_backends!(a_lock_session_lives_on_heartbeats_and_says_when_it_is_lost_on_both_backends => a_lock_session_lives_on_heartbeats_and_says_when_it_is_lost);
