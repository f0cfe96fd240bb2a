//! The operator's recovery acts on evidence, not on say-so (docs/threat-model.md#recovery):
//!
//! - a fence is lowered only down to the highest token the account admitted with a proof
//!   (`accounts.max_seen_token`), while the recovery from a revocation floor that a restored lock
//!   store hands out tokens below still works;
//! - a renew is the holding session's alone: another session of the same owner, or an operator
//!   naming the holder's owner and session, gets no fresh proof;
//! - a resolution of a RAIL_AMBIGUOUS payout must agree with what the rail proxy recorded for the
//!   payout's attempt, here the rail's late acknowledgement of a forward that was timed out.
//!
//! Real PostgreSQL and etcd, real `dlock` processes (`dlock dev up`, rail proxies, a payment
//! resource), the real rail stub.

use std::net::SocketAddr;
use std::time::Duration;

use dlock_contract::ErrorCode;
use dlock_contract::auth::Credential;
use dlock_contract::client::LockClient;
use dlock_devstack::ManagedChild;
use reqwest::Method;
use serde_json::{Value, json};
use uuid::Uuid;

use crate::auth::DevStack;
use crate::conformance::assert_envelope;
use crate::harness::{Backend, LockStack, eventually, hold, on_both_backends, party, port, raw};
use crate::harness::{serve_process, session};
use crate::rail::{RailWorld, statement, submission};
use crate::shared::accounts::open_account;
use crate::shared::payouts::register_payout;

async fn scalar(pool: &sqlx::PgPool, sql: &str) -> i64 {
    sqlx::query_scalar::<_, i64>(sqlx::AssertSqlSafe(sql.to_owned()))
        .fetch_one(pool)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"))
}

/// A fenced write on the dev stack: `bearer`'s credential as `owner`, with `token` and `proof`.
async fn write(
    url: &str,
    bearer: &str,
    owner: &str,
    token: Option<(i64, &str)>,
    body: &Value,
) -> (u16, Value) {
    let bearer = format!("Bearer {bearer}");
    let key = format!("evidence-{}", Uuid::new_v4());
    let token_text = token.map(|(t, _)| t.to_string()).unwrap_or_default();
    let mut headers = vec![
        ("content-type", "application/json"),
        ("authorization", bearer.as_str()),
        ("x-owner-id", owner),
        ("x-idempotency-key", key.as_str()),
    ];
    if let Some((_, proof)) = token {
        headers.push(("x-fencing-token", token_text.as_str()));
        headers.push(("x-fencing-proof", proof));
    }
    let (status, _, body) = raw(Method::POST, url, &headers, Some(&body.to_string())).await;
    (status, body)
}

fn proof_of(grant: &dlock_contract::lock::LockGrant) -> String {
    grant
        .fencing_proof
        .clone()
        .unwrap_or_else(|| panic!("the grant carries its proof: {grant:?}"))
}

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
    let stack = DevStack::up().await;
    let (lock, payment, _) = stack.services();
    let (executor, operator) = stack.credentials();
    open_account(&stack.treasury_payments(), "acct-e", Some(1_000_000)).await;
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
    let worker = LockClient::new(&lock, "executor/w1")
        .unwrap_or_else(|e| panic!("{e}"))
        .with_credential(Some(Credential::fixed(&executor)));
    let s1 = session(&worker, 60_000).await;
    let a = hold(&worker, "payout:acct-e", s1, 60_000).await;
    worker
        .release("payout:acct-e", s1, a.fencing_token)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let b = hold(&worker, "payout:acct-e", s1, 60_000).await;
    assert!(b.fencing_token > a.fencing_token);
    let claim = json!({ "expectedState": "PENDING" });
    let claim_url = |payout: Uuid| format!("{payment}/v1/payouts/{payout}/claim");
    let (status, body) = write(
        &claim_url(first),
        &executor,
        "executor/w1",
        Some((b.fencing_token, &proof_of(&b))),
        &claim,
    )
    .await;
    assert_eq!(status, 200, "the claim with B: {body}");
    assert_eq!(fence().await, b.fencing_token);

    // Renew of B: never by the operator under the worker's owner, though L7 shows the holder's
    // session (another session of the same owner: renew_is_the_holding_sessions, both backends).
    let info = worker
        .get("payout:acct-e")
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(info.session_id, Some(s1), "L7 shows the holder's session");
    let ops_as_worker = LockClient::new(&lock, "executor/w1")
        .unwrap_or_else(|e| panic!("{e}"))
        .with_credential(Some(Credential::fixed(&operator)));
    let renewed = ops_as_worker
        .renew("payout:acct-e", s1, b.fencing_token, Some(60_000))
        .await;
    assert_eq!(
        renewed.as_ref().err().and_then(|e| e.code()),
        Some(ErrorCode::Forbidden),
        "the operator renewed the worker's grant through its session: {renewed:?}"
    );
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
    worker
        .release("payout:acct-e", s1, b.fencing_token)
        .await
        .unwrap_or_else(|e| panic!("{e}"));

    // Lowering to A, a released grant's real proof, under B: refused, nothing changed.
    let lower_url = format!("{payment}/v1/accounts/acct-e/fence/lower");
    let lower =
        json!({ "operator": "jane.doe", "reason": "INC-7: lower the fence of acct-e to grant A" });
    let (status, body) = write(
        &lower_url,
        &operator,
        "ops-console",
        Some((a.fencing_token, &proof_of(&a))),
        &lower,
    )
    .await;
    assert_eq!(status, 409, "a lowering under B: {body}");
    assert_envelope("a lowering under B", status, &body, "FENCED_OUT");
    assert_eq!(
        body["details"]["highestToken"],
        json!(b.fencing_token),
        "{body}"
    );
    assert_eq!(body["details"]["presentedToken"], json!(a.fencing_token));
    assert_eq!(fence().await, b.fencing_token, "the fence stays at B");
    assert_eq!(recoveries().await, 0);
    // The schema holds the rule whatever the code path: a lowering under B with its recovery
    // row, in one transaction (what the guard on the fence asks for), breaks the CHECK; and the
    // mark itself never goes down.
    let mut tx = pool.begin().await.unwrap_or_else(|e| panic!("{e}"));
    sqlx::query(
        "INSERT INTO fence_recoveries (resource, account_id, previous_token, new_token, \
         operator, identity, owner_id, reason) \
         VALUES ('account', 'acct-e', $1, $2, 'psql', 'psql', 'psql', 'a quiet lowering')",
    )
    .bind(b.fencing_token)
    .bind(a.fencing_token)
    .execute(&mut *tx)
    .await
    .unwrap_or_else(|e| panic!("the recovery row: {e}"));
    let quiet = sqlx::query("UPDATE accounts SET fence = $1 WHERE account_id = 'acct-e'")
        .bind(a.fencing_token)
        .execute(&mut *tx)
        .await;
    assert!(
        quiet
            .as_ref()
            .is_err_and(|e| e.to_string().contains("accounts_fence_covers_seen_check")),
        "a recorded lowering under B in SQL: {quiet:?}"
    );
    tx.rollback().await.unwrap_or_else(|e| panic!("{e}"));
    let down = sqlx::query("UPDATE accounts SET max_seen_token = 0 WHERE account_id = 'acct-e'")
        .execute(&pool)
        .await;
    assert!(
        down.as_ref()
            .is_err_and(|e| e.to_string().contains("may not go down")),
        "the mark went down: {down:?}"
    );
    assert_eq!(fence().await, b.fencing_token);

    // The legitimate recovery: a revocation floor far above every token issued (a lock store
    // restored from an old snapshot hands out tokens below it) fences the next worker out.
    let floor = b.fencing_token + 1_000_000;
    let (status, body) = write(
        &format!("{payment}/v1/accounts/acct-e/fence"),
        &operator,
        "ops-console",
        None,
        &json!({ "floor": floor, "revocationId": Uuid::new_v4(), "operator": "jane.doe",
                 "reason": "INC-7: floor from the old lock store" }),
    )
    .await;
    assert_eq!(status, 200, "the fence advance: {body}");
    let c = hold(&worker, "payout:acct-e", s1, 60_000).await;
    let (status, body) = write(
        &claim_url(second),
        &executor,
        "executor/w1",
        Some((c.fencing_token, &proof_of(&c))),
        &claim,
    )
    .await;
    assert_eq!(status, 409, "the floor fences the next worker out: {body}");
    assert_envelope("below the floor", status, &body, "FENCED_OUT");
    worker
        .release("payout:acct-e", s1, c.fencing_token)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    // The operator's fresh grant D is above B: the fence comes down to it.
    let ops = LockClient::new(&lock, "ops-console")
        .unwrap_or_else(|e| panic!("{e}"))
        .with_credential(Some(Credential::fixed(&operator)));
    let ops_session = session(&ops, 60_000).await;
    let d = hold(&ops, "payout:acct-e", ops_session, 60_000).await;
    let (status, body) = write(
        &lower_url,
        &operator,
        "ops-console",
        Some((d.fencing_token, &proof_of(&d))),
        &lower,
    )
    .await;
    assert_eq!(status, 200, "the lowering to a fresh grant: {body}");
    assert_eq!(body["lowered"], json!(true), "{body}");
    assert_eq!(body["previousToken"], json!(floor));
    assert_eq!(fence().await, d.fencing_token);
    assert_eq!(recoveries().await, 1);
    ops.release("payout:acct-e", ops_session, d.fencing_token)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let e = hold(&worker, "payout:acct-e", s1, 60_000).await;
    let (status, body) = write(
        &claim_url(second),
        &executor,
        "executor/w1",
        Some((e.fencing_token, &proof_of(&e))),
        &claim,
    )
    .await;
    assert_eq!(
        status, 200,
        "the worker claims again after the recovery: {body}"
    );
    // And the account's mark followed: a lowering to D is now under E.
    let (status, body) = write(
        &lower_url,
        &operator,
        "ops-console",
        Some((d.fencing_token, &proof_of(&d))),
        &lower,
    )
    .await;
    assert_eq!(status, 409, "a lowering under E: {body}");
    assert_eq!(fence().await, e.fencing_token);
    pool.close().await;
}

/// On both backends, without authentication: a renew through another live session of the same
/// owner (the holder's session id is public through L7) is LOCK_LOST and changes nothing; the
/// holding session renews.
async fn renew_is_the_holding_sessions(backend: Backend) {
    let (_stack, url) = LockStack::serving(backend, &[]).await;
    let (alice, a1) = party(&url, "alice", 30_000).await;
    let a2 = session(&alice, 30_000).await;
    let grant = hold(&alice, "evidence:k", a1, 5_000).await;
    let renewed = alice
        .renew("evidence:k", a2, grant.fencing_token, Some(60_000))
        .await;
    assert_eq!(
        renewed.as_ref().err().and_then(|e| e.code()),
        Some(ErrorCode::LockLost),
        "{backend:?}: another session of the owner renewed the grant: {renewed:?}"
    );
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

const OPERATOR_TOKEN: &str = "evidence-operator-credential-0123456789";

/// `dlock serve {service}` on a free port with `pairs`; the process and its URL.
fn process(
    dir: &std::path::Path,
    service: &str,
    name: &str,
    pairs: &[(&str, String)],
) -> (ManagedChild, String) {
    let listen: SocketAddr = ([127, 0, 0, 1], port()).into();
    let mut config: Vec<(String, String)> = vec![("server.listen".into(), listen.to_string())];
    // Without fencing-token proofs unless `pairs` gives `fencing.*` keys: said by name, as a
    // service requires (docs/threat-model.md#safe-defaults).
    if !pairs.iter().any(|(k, _)| k.starts_with("fencing.")) {
        config.push(("fencing.insecure-no-proofs".into(), "true".to_owned()));
    }
    config.extend(pairs.iter().map(|(k, v)| ((*k).to_owned(), v.clone())));
    let log = dir.join(format!("{name}.log"));
    (
        serve_process(service, listen, &config, &log),
        format!("http://{listen}"),
    )
}

/// A rail proxy and a second replica with a budget shorter than the rail's latency (its sweeper
/// times out the first one's forward while the rail still holds it: a replica configured with
/// a shorter read timeout, or a proxy paused past its budget), a payment resource, all real
/// processes on one paydb, and a rail that answers after 1.5 s.
///
/// The payout the first proxy forwarded is timed out and quarantined RAIL_AMBIGUOUS; the rail
/// then acknowledges it and the proxy records that late answer. A resolution POSTED under another
/// reference is refused naming both, FAILED is refused, and nothing changes; POSTED with the
/// rail's reference resolves it. A payout whose outcome nobody recorded (the short replica's own
/// forward, given up after 100 ms) is still resolved on the operator's statement evidence. The
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
    let paydb = w.pg.url("paydb");
    let proxy_pairs = |rail: &str, read_ms: &str, margin_ms: &str| {
        vec![
            ("rail.proxy.pg.url", paydb.clone()),
            ("rail.proxy.rail-url", rail.to_owned()),
            ("rail.proxy.operator-token", "test-operator".to_owned()),
            ("rail.proxy.read-timeout-ms", read_ms.to_owned()),
            ("rail.proxy.unresolved-margin-ms", margin_ms.to_owned()),
            ("rail.proxy.sweep-interval-ms", "50".to_owned()),
        ]
    };
    let (_proxy, proxy) = process(
        dir.path(),
        "rail-proxy",
        "proxy",
        &proxy_pairs(&stub, "6000", "2000"),
    );
    let (_declining_proxy, declining_proxy) = process(
        dir.path(),
        "rail-proxy",
        "declining-proxy",
        &proxy_pairs(&declining, "6000", "2000"),
    );
    let (_short, short) = process(
        dir.path(),
        "rail-proxy",
        "short",
        &proxy_pairs(&stub, "100", "0"),
    );
    let (_payment, payment) = process(
        dir.path(),
        "payment-resource",
        "payment",
        &[
            ("payment.pg.url", paydb.clone()),
            ("payment.operator.token", OPERATOR_TOKEN.to_owned()),
        ],
    );
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
    let resolve = |payout: Uuid, body: Value| {
        let payment = payment.clone();
        async move {
            let key = format!("resolve-{}", Uuid::new_v4());
            let bearer = format!("Bearer {OPERATOR_TOKEN}");
            raw(
                Method::POST,
                &format!("{payment}/v1/payouts/{payout}/resolve"),
                &[
                    ("content-type", "application/json"),
                    ("authorization", bearer.as_str()),
                    ("x-owner-id", "operator-cli"),
                    ("x-idempotency-key", key.as_str()),
                ],
                Some(&body.to_string()),
            )
            .await
        }
    };
    let audit = || {
        scalar(
            &w.pool,
            "SELECT count(*) FROM audit_log WHERE action = 'ambiguous_resolved'",
        )
    };
    let posted = |reference: &str| {
        json!({ "outcome": "POSTED", "railReference": reference, "operator": "bob",
                "evidence": "the rail statement of today" })
    };
    let (status, _, body) = resolve(late, posted("rail-made-up-1")).await;
    assert_eq!(status, 400, "POSTED under another reference: {body}");
    assert_envelope("another reference", status, &body, "VALIDATION_FAILED");
    let message = body["message"].as_str().unwrap_or_default();
    assert!(
        message.contains(&reference) && message.contains("rail-made-up-1"),
        "the refusal names both references: {body}"
    );
    assert_eq!(body["details"]["recordedReference"], json!(reference));
    assert_eq!(
        body["details"]["fields"][0]["field"],
        json!("railReference")
    );
    let failed = json!({ "outcome": "FAILED", "operator": "bob",
                         "evidence": "not on the rail statement, we think" });
    let (status, _, body) = resolve(late, failed.clone()).await;
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
    let (status, _, body) = resolve(late, posted(&reference)).await;
    assert_eq!(status, 200, "POSTED with the rail's reference: {body}");
    assert_eq!(w.state(late).await, "POSTED");

    // The late refusal: the rail declines a forward that was timed out. POSTED is refused,
    // FAILED resolves it.
    let declined = w.claimed("acct-l", 200, 5).await;
    let (status, body) = crate::rail::submit(&declining_proxy, "acct-l", declined, 200, "5").await;
    assert_eq!(status, 409, "timed out under the forward: {body}");
    assert_envelope("the timed-out forward", status, &body, "RAIL_AMBIGUOUS");
    assert_eq!(w.state(declined).await, "RAIL_AMBIGUOUS");
    let (status, _, body) = resolve(declined, posted("rail-made-up-2")).await;
    assert_eq!(status, 400, "POSTED after the rail declined: {body}");
    assert_envelope("POSTED after a decline", status, &body, "VALIDATION_FAILED");
    assert_eq!(body["details"]["fields"][0]["field"], json!("outcome"));
    assert_eq!(body["details"]["recordedOutcome"], json!("REJECTED"));
    assert_eq!(w.state(declined).await, "RAIL_AMBIGUOUS", "nothing changed");
    let (status, _, body) = resolve(declined, failed).await;
    assert_eq!(status, 200, "FAILED after the rail declined: {body}");
    assert_eq!(w.state(declined).await, "FAILED");

    // Positive control of the limit: no answer recorded, the operator's evidence decides.
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
    let (status, _, body) = resolve(unknown, posted("rail-from-the-statement-9")).await;
    assert_eq!(status, 200, "nothing recorded to contradict: {body}");
    assert_eq!(audit().await, 3);
}
