//! Renew and release bound to the grant's owner, a revocation that
//! serializes with the acquires of its key on pg, and SESSION_EXPIRED (never a 500) for every
//! call on a session whose TTL lapsed, on both backends.

use std::time::{Duration, Instant};

use dlock_contract::ErrorCode;
use dlock_contract::client::ClientError;
use reqwest::Method;
use serde_json::json;

use crate::harness::{Backend, LockStack, client, hold, on_both_backends, party, raw, session};

fn code<T: std::fmt::Debug>(result: &Result<T, ClientError>) -> Option<ErrorCode> {
    result.as_ref().err().and_then(ClientError::code)
}

/// A token is public (L7, `GET /v1/locks`), so another identity with a live session of
/// its own can name any grant. Renew and release refuse it with LOCK_LOST and change nothing.
async fn renew_and_release_are_bound_to_the_owner(backend: Backend) {
    let (_stack, url) = LockStack::serving(backend, &[]).await;
    let (alice, a) = party(&url, "alice", 30_000).await;
    let (mallory, m) = party(&url, "mallory", 30_000).await;
    let grant = hold(&alice, "owner:k", a, 5_000).await;
    // The token is public.
    let seen = mallory
        .get("owner:k")
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let token = seen.fencing_token.unwrap_or_default();
    assert_eq!(token, grant.fencing_token);

    let renewed = mallory.renew("owner:k", m, token, Some(60_000)).await;
    assert_eq!(
        code(&renewed),
        Some(ErrorCode::LockLost),
        "{backend:?}: another owner renewed alice's grant: {renewed:?}"
    );
    // Even naming alice's session changes nothing: the session is alice's, not mallory's.
    let renewed = mallory.renew("owner:k", a, token, Some(60_000)).await;
    assert!(
        renewed.is_err(),
        "{backend:?}: renew through alice's session id"
    );
    let released = mallory.release("owner:k", m, token).await;
    assert_eq!(
        code(&released),
        Some(ErrorCode::LockLost),
        "{backend:?}: another owner released alice's grant: {released:?}"
    );
    let released = mallory.release("owner:k", a, token).await;
    assert_eq!(
        code(&released),
        Some(ErrorCode::LockLost),
        "{backend:?}: another owner released alice's grant through her session id"
    );

    // Nothing changed: alice still holds it, with the same token and expiry.
    let info = alice.get("owner:k").await.unwrap_or_else(|e| panic!("{e}"));
    assert!(info.held, "{backend:?}: alice's grant is gone");
    assert_eq!(info.fencing_token, Some(grant.fencing_token));
    assert_eq!(info.owner_id.as_deref(), Some("alice"));
    assert_eq!(info.expires_at, Some(grant.expires_at), "{backend:?}");
    let busy = mallory.acquire("owner:k", m, None, None).await;
    assert_eq!(code(&busy), Some(ErrorCode::LockContended));

    // The owner herself renews and releases as before.
    let renewed = alice
        .renew("owner:k", a, grant.fencing_token, Some(10_000))
        .await
        .unwrap_or_else(|e| panic!("{backend:?}: {e}"));
    assert_eq!(renewed.fencing_token, grant.fencing_token);
    alice
        .release("owner:k", a, grant.fencing_token)
        .await
        .unwrap_or_else(|e| panic!("{backend:?}: {e}"));
    let info = alice.get("owner:k").await.unwrap_or_else(|e| panic!("{e}"));
    assert!(!info.held);
}

on_both_backends!(renew_and_release_refuse_a_caller_who_is_not_the_grant_owner_on_both_backends => renew_and_release_are_bound_to_the_owner);

/// On pg a revocation deleted the grant and then drew the floor without the per-key lock
/// acquires take. A trigger widens the gap between the two (a second's sleep after the delete);
/// an acquire of the key that arrives inside it must not be granted a token below the floor.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_acquire_racing_a_revoke_is_never_granted_a_token_below_the_floor_on_pg() {
    let (stack, url) = LockStack::serving(Backend::Pg, &[]).await;
    let (holder, h) = party(&url, "holder", 30_000).await;
    let (next, n) = party(&url, "next", 30_000).await;
    let revoked = hold(&holder, "race:r7", h, 30_000).await;
    let pg = stack.pg().unwrap_or_else(|| panic!("no pg"));
    pg.psql(
        "lockdb",
        "CREATE FUNCTION test_slow_delete() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN PERFORM pg_sleep(1); RETURN OLD; END $$;
         CREATE TRIGGER test_slow_delete AFTER DELETE ON locks FOR EACH ROW
         WHEN (OLD.lock_key = 'race:r7') EXECUTE FUNCTION test_slow_delete();",
    )
    .unwrap_or_else(|e| panic!("{e:#}"));

    let revoke = tokio::spawn({
        let url = url.clone();
        async move {
            raw(
                Method::POST,
                &format!("{url}/v1/locks/race:r7/revoke"),
                &[("x-owner-id", "ops"), ("content-type", "application/json")],
                Some(&json!({"operator": "ops", "reason": "item 7 race test"}).to_string()),
            )
            .await
        }
    });
    // The revocation is now asleep between its delete and its floor.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let granted = next.acquire("race:r7", n, None, None).await;
    let (status, _, body) = revoke.await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(status, 200, "{body}");
    let floor = body["newTokenFloor"].as_i64().unwrap_or_default();
    assert_eq!(
        body["revokedToken"].as_i64(),
        Some(revoked.fencing_token),
        "{body}"
    );
    match granted {
        Ok(grant) => assert!(
            grant.fencing_token > floor,
            "an acquire racing the revocation was granted token {} below the floor {floor}",
            grant.fencing_token
        ),
        // Refused while the revocation ran is fine too; then the next acquire is above it.
        Err(e) => {
            assert_eq!(e.code(), Some(ErrorCode::LockContended), "{e}");
            let grant = next
                .acquire("race:r7", n, None, None)
                .await
                .unwrap_or_else(|e| panic!("{e}"));
            assert!(grant.fencing_token > floor);
        }
    }
}

/// Every call on a session whose TTL lapsed answers the contract's code, never a 500:
/// a heartbeat is SESSION_EXPIRED on both backends; on pg acquire, renew and end session are too,
/// and release of its grant is LOCK_LOST.
/// On etcd a session's lease lapses some hundreds of milliseconds before etcd reaps its keys;
/// the calls are made in that gap too, by several sessions whose TTL ends at staggered times.
async fn lapsed_session_calls(backend: Backend) {
    let (_stack, url) = LockStack::serving(backend, &[]).await;
    let owner = client(&url, "sleepy");
    let mut probes = Vec::new();
    for i in 0..6u64 {
        let owner = owner.clone();
        probes.push(tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(90 * i)).await;
            let key = format!("lapse:{i}");
            let session = session(&owner, 3_000).await;
            let created = Instant::now();
            let grant = hold(&owner, &key, session, 60_000).await;
            // Just past the session's TTL on the backend's side: lapsed, maybe not yet reaped.
            let lapse = created + Duration::from_millis(3_000 + 20 + 15 * i);
            tokio::time::sleep_until(lapse.into()).await;
            let beat = owner.heartbeat(session).await;
            let acquire = owner
                .acquire(&format!("{key}:b"), session, None, None)
                .await;
            let renew = owner.renew(&key, session, grant.fencing_token, None).await;
            let release = owner.release(&key, session, grant.fencing_token).await;
            let end = owner.end_session(session).await;
            let again = owner.heartbeat(session).await;
            vec![
                ("heartbeat", code(&beat), format!("{beat:?}")),
                ("acquire", code(&acquire), format!("{acquire:?}")),
                ("renew", code(&renew), format!("{renew:?}")),
                ("release", code(&release), format!("{release:?}")),
                ("end session", code(&end), format!("{end:?}")),
                ("heartbeat again", code(&again), format!("{again:?}")),
            ]
        }));
    }
    let mut wrong = Vec::new();
    for probe in probes {
        for (call, code, answer) in probe.await.unwrap_or_else(|e| panic!("{e}")) {
            let expected = if call == "release" {
                ErrorCode::LockLost
            } else {
                ErrorCode::SessionExpired
            };
            // A 5xx, or an answer without the envelope, is wrong everywhere. A heartbeat must
            // say SESSION_EXPIRED on both backends. On pg (one clock, the database's) every call
            // must give its contract code; on etcd, until etcd reaps the lapsed lease's keys,
            // acquire, renew and end session still see the session (see the report).
            let server_error =
                answer.contains("status: 5") || code.is_none() && answer.contains("Err");
            let must_be_exact = call.starts_with("heartbeat") || backend == Backend::Pg;
            if server_error || (must_be_exact && code != Some(expected)) {
                wrong.push(format!("{call}: {answer}"));
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "{backend:?}: calls on a lapsed session:\n{}",
        wrong.join("\n")
    );
}

on_both_backends!(every_call_on_a_lapsed_session_is_session_expired_never_a_500_on_both_backends => lapsed_session_calls);
