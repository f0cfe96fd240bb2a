//! The operator's recovery acts on evidence, not on say-so (docs/threat-model.md#recovery):
//!
//! - a fence is lowered only down to the highest token the account admitted with a proof
//!   (`accounts.max_seen_token`), while the recovery from a revocation floor that a restored lock
//!   store hands out tokens below still works; the rail proxy's high-water mark likewise, down
//!   to the highest token it admitted a proven submission with (`rail_floor`);
//! - a renew is the holding session's alone: another session of the same owner, or an operator
//!   naming the holder's owner and session, gets no fresh proof;
//! - a resolution of a RAIL_AMBIGUOUS payout must agree with what the rail proxy recorded for the
//!   payout's attempt, here the rail's late acknowledgement of a forward that was timed out.
//!
//! Real PostgreSQL and etcd, real `dlock` processes (`dlock dev up`, rail proxies, a payment
//! resource), the real rail stub.

use std::time::Duration;

use dlock_contract::ErrorCode;
use dlock_contract::client::LockClient;
use serde_json::{Value, json};
use uuid::Uuid;

use crate::auth::DevStack;
use crate::conformance::assert_envelope;
use crate::harness::session;
use crate::harness::{Backend, LockStack, eventually, hold, on_both_backends, party, release};
use crate::rail::{RailWorld, statement, submission};
use crate::shared::payouts::register_payout;

mod findings;
mod rail_floor;
mod support;

use support::{
    Mark, assert_lowering_under, assert_refused, client_as, failed, operator_grant,
    payment_process, posted, process, proxy_pairs, released_then_held, resolutions_audited,
    resolve, scalar, write_with,
};

/// On `dlock dev up` (proofs on): a worker claims with its grant B after an earlier grant A was
/// released. An operator holding A's proof cannot lower the fence to A (below B, which the
/// account admitted): `409 FENCED_OUT` naming B, the fence stays, no recovery row. The recovery
/// the lowering exists for still works: a revocation floor far above anything issued (as a lock
/// store restored from an old snapshot leaves it) fences out the next worker, and the operator
/// lowers the fence to a fresh grant, above B; the worker then claims again.
///
/// On the way, with the worker's grant B live: neither another session of the worker's owner
/// nor the operator naming the worker's owner and session (both public through L7) can renew B
/// and get a fresh proof of it; the worker's own session can.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fence_is_lowered_only_down_to_the_highest_token_the_account_admitted() {
    let stack = DevStack::with_account("acct-e", 1_000_000).await;
    let (lock, payment, _) = stack.services();
    let (executor, operator) = stack.credentials();
    let registrar = stack.registrar_payments();
    let first = register_payout(&registrar, "acct-e", 100, "ben-e1").await;
    let second = register_payout(&registrar, "acct-e", 100, "ben-e2").await;
    let pool = stack.pool("paydb").await;
    let fence = || {
        scalar(
            &pool,
            "SELECT fence FROM accounts WHERE account_id = 'acct-e'",
        )
    };
    let recoveries = || {
        scalar(
            &pool,
            "SELECT count(*) FROM fence_recoveries WHERE account_id = 'acct-e'",
        )
    };

    // Grant A, released; then grant B, which claims.
    let (worker, s1, a, b) = released_then_held(&lock, &executor, "payout:acct-e").await;
    let claim = json!({ "expectedState": "PENDING" });
    let claim_url = |payout: Uuid| format!("{payment}/v1/payouts/{payout}/claim");
    let (status, body) = write_with(&claim_url(first), &executor, "executor/w1", &b, &claim).await;
    assert_eq!(status, 200, "the claim with B: {body}");
    assert_eq!(fence().await, b.fencing_token);

    // Renew of B: never by the operator under the worker's owner, though L7 shows the holder's
    // session (another session of the same owner: renew_is_the_holding_sessions, both backends).
    let info = worker
        .get("payout:acct-e")
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(info.session_id, Some(s1), "L7 shows the holder's session");
    let ops_as_worker = client_as(&lock, "executor/w1", &operator);
    assert_renew_refused(
        &ops_as_worker,
        ("payout:acct-e", s1, b.fencing_token),
        ErrorCode::Forbidden,
        "the operator renewed the worker's grant through its session",
    )
    .await;
    let after = worker
        .get("payout:acct-e")
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        after.expires_at, info.expires_at,
        "the refused renew changed nothing"
    );
    // Positive control: the holding session renews, and gets the proof.
    let own = worker
        .renew("payout:acct-e", s1, b.fencing_token, Some(60_000))
        .await
        .unwrap_or_else(|e| panic!("the holder's own renew: {e}"));
    assert_eq!(own.fencing_token, b.fencing_token);
    assert!(own.fencing_proof.is_some());
    release(&worker, "payout:acct-e", s1, b.fencing_token).await;

    // Lowering to A, a released grant's real proof, under B: refused, nothing changed.
    let mark = Mark::account_fence(&payment, "acct-e");
    let lower_url = mark.lower_url();
    let lower =
        json!({ "operator": "jane.doe", "reason": "INC-7: lower the fence of acct-e to grant A" });
    let (status, body) = write_with(&lower_url, &operator, "ops-console", &a, &lower).await;
    assert_lowering_under("a lowering under B", status, &body, &b, &a);
    assert_eq!(fence().await, b.fencing_token, "the fence stays at B");
    assert_eq!(recoveries().await, 0);
    mark.assert_schema_refuses_lowering(&pool, b.fencing_token, a.fencing_token)
        .await;

    // The legitimate recovery: a revocation floor far above every token issued (a lock store
    // restored from an old snapshot hands out tokens below it) fences the next worker out.
    let floor = b.fencing_token + 1_000_000;
    mark.advance_to_floor(&operator, floor, "INC-7: floor from the old lock store")
        .await;
    let c = hold(&worker, "payout:acct-e", s1, 60_000).await;
    let (status, body) = write_with(&claim_url(second), &executor, "executor/w1", &c, &claim).await;
    assert_eq!(status, 409, "the floor fences the next worker out: {body}");
    assert_envelope("below the floor", status, &body, "FENCED_OUT");
    release(&worker, "payout:acct-e", s1, c.fencing_token).await;
    // The operator's fresh grant D is above B: the fence comes down to it.
    let (ops, ops_session, d) = operator_grant(&lock, &operator, "payout:acct-e").await;
    let (status, body) = write_with(&lower_url, &operator, "ops-console", &d, &lower).await;
    assert_eq!(status, 200, "the lowering to a fresh grant: {body}");
    assert_eq!(body["lowered"], json!(true), "{body}");
    assert_eq!(body["previousToken"], json!(floor));
    assert_eq!(fence().await, d.fencing_token);
    assert_eq!(recoveries().await, 1);
    release(&ops, "payout:acct-e", ops_session, d.fencing_token).await;
    let e = hold(&worker, "payout:acct-e", s1, 60_000).await;
    let (status, body) = write_with(&claim_url(second), &executor, "executor/w1", &e, &claim).await;
    assert_eq!(
        status, 200,
        "the worker claims again after the recovery: {body}"
    );
    // And the account's mark followed: a lowering to D is now under E.
    let (status, body) = write_with(&lower_url, &operator, "ops-console", &d, &lower).await;
    assert_eq!(status, 409, "a lowering under E: {body}");
    assert_eq!(fence().await, e.fencing_token);
    pool.close().await;
}

/// A one-minute renew through `lock` of the grant `(key, session, token)` is refused with `code`
/// (`failure` says what happened if it is not).
async fn assert_renew_refused(
    lock: &LockClient,
    (key, session, token): (&str, Uuid, i64),
    code: ErrorCode,
    failure: &str,
) {
    let renewed = lock.renew(key, session, token, Some(60_000)).await;
    assert_eq!(
        renewed.as_ref().err().and_then(|e| e.code()),
        Some(code),
        "{failure}: {renewed:?}"
    );
}

/// On both backends, without authentication: a renew through another live session of the same
/// owner (the holder's session id is public through L7) is LOCK_LOST and changes nothing; the
/// holding session renews.
async fn renew_is_the_holding_sessions(backend: Backend) {
    let (_stack, url) = LockStack::serving(backend, &[]).await;
    let (alice, a1) = party(&url, "alice", 30_000).await;
    let a2 = session(&alice, 30_000).await;
    let grant = hold(&alice, "evidence:k", a1, 5_000).await;
    assert_renew_refused(
        &alice,
        ("evidence:k", a2, grant.fencing_token),
        ErrorCode::LockLost,
        &format!("{backend:?}: another session of the owner renewed the grant"),
    )
    .await;
    let info = alice
        .get("evidence:k")
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(info.session_id, Some(a1));
    assert_eq!(
        info.expires_at,
        Some(grant.expires_at),
        "{backend:?}: unchanged"
    );
    let renewed = alice
        .renew("evidence:k", a1, grant.fencing_token, Some(60_000))
        .await
        .unwrap_or_else(|e| panic!("{backend:?}: the holder's renew: {e}"));
    assert!(renewed.expires_at > grant.expires_at, "{backend:?}");
}

on_both_backends!(a_renew_through_another_session_of_the_owner_is_lock_lost_on_both_backends => renew_is_the_holding_sessions);

/// A rail proxy and a second replica with a budget shorter than the rail's latency (its sweeper
/// times out the first one's forward while the rail still holds it: a replica configured with
/// a shorter read timeout, or a proxy paused past its budget), a payment resource, all real
/// processes on one paydb, and a rail that answers after 1.5 s.
///
/// The payout the first proxy forwarded is timed out and quarantined RAIL_AMBIGUOUS; the rail
/// then acknowledges it and the proxy records that late answer. A resolution POSTED under another
/// reference is refused naming both, FAILED is refused, and nothing changes; POSTED with the
/// rail's reference resolves it. A payout whose outcome nobody recorded (the short replica's own
/// forward, given up after 100 ms) is not resolved on the operator's say-so alone. The
/// same for a rail that declines late: POSTED is refused, FAILED resolves it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_resolution_must_agree_with_the_rail_answer_the_proxy_recorded() {
    let (mut w, stub) = RailWorld::with_stub("slow", &[("rail.stub.latency-ms", "1500")]).await;
    let declining = w
        .stub(
            "declining",
            &[
                ("rail.stub.latency-ms", "1500"),
                ("rail.stub.decline-rate", "1"),
            ],
        )
        .await;
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let paydb = w.pg().url("paydb");
    let (_proxy, proxy) = process(
        dir.path(),
        "rail-proxy",
        "proxy",
        &proxy_pairs(&paydb, &stub, "6000", "2000"),
    );
    let (_declining_proxy, declining_proxy) = process(
        dir.path(),
        "rail-proxy",
        "declining-proxy",
        &proxy_pairs(&paydb, &declining, "6000", "2000"),
    );
    let (_short, short) = process(
        dir.path(),
        "rail-proxy",
        "short",
        &proxy_pairs(&paydb, &stub, "100", "0"),
    );
    let (_payment, payment) = payment_process(dir.path(), &paydb);
    w.account("acct-l", 10_000).await;

    // The late acknowledgement.
    let late = w.claimed("acct-l", 700, 3).await;
    let client = dlock_contract::client::http_client().unwrap_or_else(|e| panic!("{e}"));
    let answer = submission(&client, &proxy, "acct-l", late, 700, "3")
        .send()
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let status = answer.status().as_u16();
    let body: Value = answer.json().await.unwrap_or_default();
    assert_eq!(status, 409, "timed out under the forward: {body}");
    assert_envelope("the timed-out forward", status, &body, "RAIL_AMBIGUOUS");
    assert_eq!(w.state(late).await, "RAIL_AMBIGUOUS");
    let transfers = statement(&stub, late).await;
    assert_eq!(
        transfers.len(),
        1,
        "the rail took the transfer: {transfers:?}"
    );
    let reference = transfers[0]["railReference"]
        .as_str()
        .unwrap_or_else(|| panic!("{transfers:?}"))
        .to_owned();

    // The operator's say-so against the proxy's record.
    let resolve = |payout: Uuid, body| resolve(&payment, payout, body);
    let audit = || resolutions_audited(&w.pool);
    let (status, body) = resolve(late, posted("rail-made-up-1")).await;
    assert_refused("another reference", status, &body, "railReference");
    let message = body["message"].as_str().unwrap_or_default();
    assert!(
        message.contains(&reference) && message.contains("rail-made-up-1"),
        "the refusal names both references: {body}"
    );
    assert_eq!(body["details"]["recordedReference"], json!(reference));
    let (status, body) = resolve(late, failed()).await;
    assert_eq!(status, 400, "FAILED after the rail acknowledged: {body}");
    assert_envelope("FAILED", status, &body, "VALIDATION_FAILED");
    assert!(
        body["message"]
            .as_str()
            .is_some_and(|m| m.contains(&reference)),
        "{body}"
    );
    assert_eq!(w.state(late).await, "RAIL_AMBIGUOUS", "nothing changed");
    assert_eq!(audit().await, 0);
    let (status, body) = resolve(late, posted(&reference)).await;
    assert_eq!(status, 200, "POSTED with the rail's reference: {body}");
    assert_eq!(w.state(late).await, "POSTED");

    // The late refusal: the rail declines a forward that was timed out. POSTED is refused,
    // FAILED resolves it.
    let declined = w.claimed("acct-l", 200, 5).await;
    let (status, body) = crate::rail::submit(&declining_proxy, "acct-l", declined, 200, "5").await;
    assert_eq!(status, 409, "timed out under the forward: {body}");
    assert_envelope("the timed-out forward", status, &body, "RAIL_AMBIGUOUS");
    assert_eq!(w.state(declined).await, "RAIL_AMBIGUOUS");
    let (status, body) = resolve(declined, posted("rail-made-up-2")).await;
    assert_refused("POSTED after a decline", status, &body, "outcome");
    assert_eq!(body["details"]["recordedOutcome"], json!("REJECTED"));
    assert_eq!(w.state(declined).await, "RAIL_AMBIGUOUS", "nothing changed");
    let (status, body) = resolve(declined, failed()).await;
    assert_eq!(status, 200, "FAILED after the rail declined: {body}");
    assert_eq!(w.state(declined).await, "FAILED");

    // No answer recorded: the operator's say-so is not enough, the reconciler's finding decides
    // (findings.rs shows the resolution on it).
    let unknown = w.claimed("acct-l", 300, 6).await;
    let (status, body) = crate::rail::submit(&short, "acct-l", unknown, 300, "6").await;
    assert_eq!(status, 409, "the short replica gives up: {body}");
    eventually(
        "the slow rail takes the short replica's transfer",
        Duration::from_secs(10),
        || async { (statement(&stub, unknown).await.len() == 1).then_some(()) },
    )
    .await;
    assert_eq!(w.state(unknown).await, "RAIL_AMBIGUOUS");
    let (status, body) = resolve(unknown, posted("rail-from-the-statement-9")).await;
    assert_eq!(
        status, 400,
        "nothing recorded, no reconciler finding: {body}"
    );
    assert_envelope(
        "POSTED without a finding",
        status,
        &body,
        "VALIDATION_FAILED",
    );
    assert_eq!(w.state(unknown).await, "RAIL_AMBIGUOUS", "nothing changed");
    assert_eq!(audit().await, 2);
}
