//! Retention of the keys seen: `lock_keys_seen` (pg) and `P/seen/` (etcd) are swept after
//! `lock.keys-seen.retention`, a held key is kept, and a key's next token is still above every
//! token and revocation floor before the sweep.

use super::*;

async fn status_of(client: &LockClient, key: &str) -> Option<ErrorCode> {
    code(&client.get(key).await)
}

/// With `lock.keys-seen.retention` at 1 s and a sweep every 100 ms (a real `dlock serve
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
