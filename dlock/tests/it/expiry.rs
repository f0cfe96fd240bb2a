//! FR-04: when a session lapses or ends, every lock attached to it is released.

use std::time::Duration;

use dlock_contract::ErrorCode;

use crate::harness::{BOTH, Backend, LockStack, client, eventually};

async fn session_end_releases_every_lock(backend: Backend) {
    let mut stack = LockStack::backend(backend, &[]);
    let url = stack.serve().await;
    let holder = client(&url, "holder");
    let other = client(&url, "other");
    let short = holder
        .create_session(Some(1_000))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let long = holder
        .create_session(Some(30_000))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let watcher = other
        .create_session(Some(30_000))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    for key in ["fr04:a", "fr04:b", "fr04:c"] {
        holder
            .acquire(key, short.session_id, Some(60_000), None)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
    }
    for key in ["fr04:d", "fr04:e"] {
        holder
            .acquire(key, long.session_id, Some(60_000), None)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
    }
    // While the short session lives, its locks are held against others.
    let busy = other
        .acquire("fr04:a", watcher.session_id, None, None)
        .await;
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
    let lapsed = holder.heartbeat(short.session_id).await;
    assert_eq!(
        lapsed.err().and_then(|e| e.code()),
        Some(ErrorCode::SessionExpired)
    );
    for key in ["fr04:a", "fr04:b", "fr04:c"] {
        let info = other.get(key).await.unwrap_or_else(|e| panic!("{e}"));
        assert!(!info.held, "{key} is still held after its session lapsed");
        other
            .acquire(key, watcher.session_id, None, None)
            .await
            .unwrap_or_else(|e| panic!("{key}: {e}"));
    }
    // Ending the long session releases its locks at once.
    holder
        .end_session(long.session_id)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    for key in ["fr04:d", "fr04:e"] {
        other
            .acquire(key, watcher.session_id, None, None)
            .await
            .unwrap_or_else(|e| panic!("{key}: {e}"));
    }
    let held = other.held(None).await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(held.items.len(), 5);
    assert!(held.items.iter().all(|g| g.owner_id == "other"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_lapsed_or_ended_session_releases_every_lock_on_both_backends() {
    for backend in BOTH {
        session_end_releases_every_lock(backend).await;
    }
}
