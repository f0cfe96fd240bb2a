//! Fencing-token proofs (docs/design.md#d-8): a forged token cannot move a fence, a
//! proof is bound to its lock key and token, a rotated key still verifies, a real executor pays
//! with proofs on, and an account poisoned before proofs is recovered by an operator only, only
//! while nobody else holds its lock, with an audit row.

use dlock_contract::auth::Credential;
use dlock_contract::client::LockClient;
use reqwest::Method;
use serde_json::{Value, json};
use uuid::Uuid;

use crate::auth::DevStack;
use crate::conformance::assert_envelope;
use crate::harness::{Backend, LockStack, hold, raw, session};
use crate::payment::PayStack;
use crate::shared::accounts::open_account;
use crate::shared::payouts::register_payout;

mod stale_account;

const FORGED: i64 = i64::MAX;
const SECRET_A: &str = "0123456789abcdef0123456789abcdef-old";
const SECRET_B: &str = "fedcba9876543210fedcba9876543210-new";

async fn scalar(pool: &sqlx::PgPool, sql: &str) -> i64 {
    sqlx::query_scalar::<_, i64>(sqlx::AssertSqlSafe(sql.to_owned()))
        .fetch_one(pool)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"))
}

/// The durable marks of an account and what a refused write could have left behind.
async fn marks(pool: &sqlx::PgPool, account: &str) -> Vec<i64> {
    vec![
        scalar(
            pool,
            &format!("SELECT fence FROM accounts WHERE account_id = '{account}'"),
        )
        .await,
        scalar(
            pool,
            &format!(
                "SELECT coalesce(max(highest_token), 0) FROM rail_high_water WHERE account_id = '{account}'"
            ),
        )
        .await,
        scalar(pool, "SELECT count(*) FROM idempotency_records").await,
        scalar(pool, "SELECT count(*) FROM rail_submission").await,
        scalar(
            pool,
            &format!(
                "SELECT count(*) FROM payouts WHERE account_id = '{account}' AND state <> 'PENDING'"
            ),
        )
        .await,
    ]
}

fn refused(step: &str, answer: &(u16, String, Value), status: u16, code: &str) {
    assert_eq!(answer.0, status, "{step}: {}", answer.2);
    assert_envelope(step, answer.0, &answer.2, code);
}

/// A write with the given credential, token and proof.
async fn write(
    url: &str,
    bearer: &str,
    owner: &str,
    token: i64,
    proof: Option<&str>,
    body: &Value,
) -> (u16, String, Value) {
    let bearer = format!("Bearer {bearer}");
    let token = token.to_string();
    let key = format!("proof-{}", Uuid::new_v4());
    let mut headers = vec![
        ("content-type", "application/json"),
        ("authorization", bearer.as_str()),
        ("x-owner-id", owner),
        ("x-idempotency-key", key.as_str()),
        ("x-fencing-token", token.as_str()),
    ];
    if let Some(proof) = proof {
        headers.push(("x-fencing-proof", proof));
    }
    raw(Method::POST, url, &headers, Some(&body.to_string())).await
}

/// On `dlock dev up` (proofs on): a claim and a submit with a forged huge token and no proof, a
/// garbage proof, or another key's real proof are 400 INVALID_TOKEN (not retry-safe) and change
/// nothing in paydb; grants carry a proof and the lock lists never show one; the executor pays a
/// whole batch with proofs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forged_tokens_move_no_fence_and_a_real_executor_still_pays_with_proofs_on() {
    let stack = DevStack::up().await;
    assert!(
        std::fs::read_to_string(stack.url("proofKeysFile")).is_ok_and(|t| t.contains("dev ")),
        "dev up writes a proof keys file"
    );
    let (lock, payment, proxy) = stack.services();
    let executor = stack.token("executor");
    open_account(&stack.treasury_payments(), "acct-p", Some(1_000_000)).await;
    open_account(&stack.treasury_payments(), "acct-q", Some(1_000_000)).await;
    let payout = register_payout(&stack.registrar_payments(), "acct-p", 100, "ben-forged").await;
    let pool = stack.pool("paydb").await;

    // A real grant on another account's key, with its proof.
    let locks = LockClient::new(&lock, "executor/test")
        .unwrap_or_else(|e| panic!("{e}"))
        .with_credential(Some(Credential::fixed(&executor)));
    let session = session(&locks, 30_000).await;
    let other = hold(&locks, "payout:acct-q", session, 30_000).await;
    let other_proof = other
        .fencing_proof
        .clone()
        .unwrap_or_else(|| panic!("the acquire answer carries fencingProof: {other:?}"));
    assert!(other_proof.starts_with("dev."), "{other_proof}");
    // The proof is the holder's alone: neither L7 nor the held-locks list shows it.
    let bearer = format!("Bearer {executor}");
    for url in [
        format!("{lock}/v1/locks/payout:acct-q"),
        format!("{lock}/v1/locks"),
    ] {
        let (status, _, body) = raw(
            Method::GET,
            &url,
            &[("authorization", bearer.as_str())],
            None,
        )
        .await;
        assert_eq!(status, 200, "{url}: {body}");
        assert!(
            body.to_string().contains(&other.fencing_token.to_string()),
            "{url} shows the token: {body}"
        );
        assert!(
            !body.to_string().contains("fencingProof") && !body.to_string().contains(&other_proof),
            "{url} must not show the proof: {body}"
        );
    }

    let before = marks(&pool, "acct-p").await;
    let claim_url = format!("{payment}/v1/payouts/{payout}/claim");
    let submit_url = format!("{proxy}/v1/rail/submissions");
    let claim_body = json!({ "expectedState": "PENDING" });
    let submit_body = json!({
        "payoutId": payout, "accountId": "acct-p", "amountMinor": 100,
        "currency": "EUR", "beneficiaryRef": "ben-forged",
    });
    let garbage = format!("dev.{}", "0".repeat(64));
    for (what, proof) in [
        ("no proof", None),
        ("a garbage proof", Some(garbage.as_str())),
        ("another key's proof", Some(other_proof.as_str())),
    ] {
        for (hop, url, body) in [
            ("claim", &claim_url, &claim_body),
            ("submit", &submit_url, &submit_body),
        ] {
            let answer = write(url, &executor, "executor/test", FORGED, proof, body).await;
            refused(
                &format!("a forged {hop} with {what}"),
                &answer,
                400,
                "INVALID_TOKEN",
            );
        }
    }
    // Another key's token with its own, valid proof is refused on this account too.
    let answer = write(
        &claim_url,
        &executor,
        "executor/test",
        other.fencing_token,
        Some(&other_proof),
        &claim_body,
    )
    .await;
    refused(
        "payout:acct-q's grant on acct-p",
        &answer,
        400,
        "INVALID_TOKEN",
    );
    assert_eq!(
        marks(&pool, "acct-p").await,
        before,
        "refused writes moved no fence, no mark, no record"
    );
    let _ = locks.end_session(session).await;

    let (ok, log) = stack.run_batch("proof-batch", "acct-p", 8).await;
    assert!(ok, "dlock run pays with proofs on: {log}");
    let posted = scalar(
        &pool,
        "SELECT count(*) FROM payouts WHERE account_id = 'acct-p' AND state = 'POSTED'",
    )
    .await;
    assert_eq!(posted, 8, "{log}");
    // Positive control: the marks that the refused writes left alone are the ones a paying
    // run moves, so "unchanged" above was not a blind reading.
    let paid = marks(&pool, "acct-p").await;
    assert!(
        before.iter().zip(&paid).all(|(b, p)| b != p),
        "a paying run moves the fence, the high-water mark and every record: {before:?} -> {paid:?}"
    );
    pool.close().await;
}

/// On `dlock dev up`: an account poisoned before proofs existed (fence and high-water mark at
/// int64 max, written straight into paydb) is lowered only by an operator, only with a proven
/// grant of the operator on the account's key (which the lock server gives only once the
/// holder's lock is revoked or lapsed), and each lowering writes an audit row. Then the
/// executor pays on the account again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_poisoned_fence_is_lowered_only_by_an_operator_once_the_lock_is_not_held() {
    let stack = DevStack::with_account("acct-r", 1_000_000).await;
    let (lock, payment, proxy) = stack.services();
    let (executor, operator) = stack.credentials();
    let pool = stack.pool("paydb").await;
    for sql in [
        "UPDATE accounts SET fence = 9223372036854775807 WHERE account_id = 'acct-r'",
        "INSERT INTO rail_high_water (account_id, highest_token) \
         VALUES ('acct-r', 9223372036854775807)",
    ] {
        sqlx::query(sql)
            .execute(&pool)
            .await
            .unwrap_or_else(|e| panic!("poisoning: {e}"));
    }
    // The database refuses a lowering without a recovery record.
    let quiet = sqlx::query("UPDATE accounts SET fence = 5 WHERE account_id = 'acct-r'")
        .execute(&pool)
        .await;
    assert!(quiet.is_err(), "a fence cannot be lowered quietly");
    let quiet =
        sqlx::query("UPDATE rail_high_water SET highest_token = 5 WHERE account_id = 'acct-r'")
            .execute(&pool)
            .await;
    assert!(
        quiet.is_err(),
        "a high-water mark cannot be lowered quietly"
    );

    // A worker holds the account's lock.
    let worker = LockClient::new(&lock, "executor/worker")
        .unwrap_or_else(|e| panic!("{e}"))
        .with_credential(Some(Credential::fixed(&executor)));
    let worker_session = session(&worker, 60_000).await;
    let held = hold(&worker, "payout:acct-r", worker_session, 60_000).await;
    let held_proof = held.fencing_proof.clone().unwrap_or_default();
    let lower_account = format!("{payment}/v1/accounts/acct-r/fence/lower");
    let lower_rail = format!("{proxy}/v1/rail/high-water/acct-r/lower");
    let body =
        json!({ "operator": "jane.doe", "reason": "INC-42: fence poisoned by a forged token" });
    let recoveries = "SELECT count(*) FROM fence_recoveries";

    // Not an operator: even with a real, proven grant on the key.
    for url in [&lower_account, &lower_rail] {
        let answer = write(
            url,
            &executor,
            "executor/worker",
            held.fencing_token,
            Some(&held_proof),
            &body,
        )
        .await;
        refused(&format!("{url} by the executor"), &answer, 403, "FORBIDDEN");
    }
    // The operator cannot take the lock while the worker holds it, and without a proven grant
    // of its own there is nothing to lower to.
    let ops = LockClient::new(&lock, "ops-console")
        .unwrap_or_else(|e| panic!("{e}"))
        .with_credential(Some(Credential::fixed(&operator)));
    let ops_session = session(&ops, 60_000).await;
    let contended = ops
        .acquire("payout:acct-r", ops_session, Some(60_000), None)
        .await;
    assert_eq!(
        contended.err().and_then(|e| e.code()),
        Some(dlock_contract::ErrorCode::LockContended)
    );
    for url in [&lower_account, &lower_rail] {
        for proof in [None, Some(format!("dev.{}", "1".repeat(64)))] {
            let answer = write(
                url,
                &operator,
                "ops-console",
                FORGED - 1,
                proof.as_deref(),
                &body,
            )
            .await;
            refused(
                &format!("{url} without a grant"),
                &answer,
                400,
                "INVALID_TOKEN",
            );
        }
    }
    assert_eq!(scalar(&pool, recoveries).await, 0);
    assert_eq!(
        scalar(
            &pool,
            "SELECT fence FROM accounts WHERE account_id = 'acct-r'"
        )
        .await,
        FORGED
    );

    // Revoke the worker's lock (L8); now the operator's grant proves nobody else holds it.
    ops.revoke(
        "payout:acct-r",
        "jane.doe",
        "INC-42: recover a poisoned fence",
        None,
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    let grant = hold(&ops, "payout:acct-r", ops_session, 60_000).await;
    let proof = grant.fencing_proof.clone().unwrap_or_default();
    assert!(grant.fencing_token > held.fencing_token);
    for (url, resource) in [(&lower_account, "account"), (&lower_rail, "rail")] {
        let answer = write(
            url,
            &operator,
            "ops-console",
            grant.fencing_token,
            Some(&proof),
            &body,
        )
        .await;
        assert_eq!(answer.0, 200, "{url}: {}", answer.2);
        assert_eq!(answer.2["lowered"], json!(true), "{}", answer.2);
        assert_eq!(answer.2["resource"], json!(resource));
        assert_eq!(answer.2["previousToken"], json!(FORGED));
        assert_eq!(answer.2["token"], json!(grant.fencing_token));
    }
    assert_eq!(
        scalar(
            &pool,
            "SELECT fence FROM accounts WHERE account_id = 'acct-r'"
        )
        .await,
        grant.fencing_token
    );
    assert_eq!(
        scalar(
            &pool,
            "SELECT highest_token FROM rail_high_water WHERE account_id = 'acct-r'"
        )
        .await,
        grant.fencing_token
    );
    let rows: Vec<(String, i64, i64, String, String, String, String)> = sqlx::query_as(
        "SELECT resource, previous_token, new_token, operator, identity, owner_id, reason \
         FROM fence_recoveries ORDER BY recovery_id",
    )
    .fetch_all(&pool)
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(rows.len(), 2, "{rows:?}");
    for (row, resource) in rows.iter().zip(["account", "rail"]) {
        assert_eq!(
            row,
            &(
                resource.to_owned(),
                FORGED,
                grant.fencing_token,
                "jane.doe".to_owned(),
                "operator".to_owned(),
                "ops-console".to_owned(),
                "INC-42: fence poisoned by a forged token".to_owned()
            )
        );
    }
    let tamper = sqlx::query("DELETE FROM fence_recoveries")
        .execute(&pool)
        .await;
    assert!(tamper.is_err(), "the audit is append-only");
    ops.release("payout:acct-r", ops_session, grant.fencing_token)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let _ = ops.end_session(ops_session).await;

    let (ok, log) = stack.run_batch("recovered-batch", "acct-r", 4).await;
    assert!(ok, "the recovered account pays again: {log}");
    pool.close().await;
}

/// A lock server that signs with the new key (second in the payment resource's file) and a
/// payment resource that still lists the old key first. A proof of key A is refused for key B
/// and for another token; the rotated proof verifies.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_proof_is_bound_to_its_key_and_token_and_a_rotated_key_still_verifies() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let lock_keys = dir.path().join("lock-keys");
    let pay_keys = dir.path().join("pay-keys");
    std::fs::write(&lock_keys, format!("new {SECRET_B}\nold {SECRET_A}\n"))
        .unwrap_or_else(|e| panic!("{e}"));
    std::fs::write(&pay_keys, format!("old {SECRET_A}\nnew {SECRET_B}\n"))
        .unwrap_or_else(|e| panic!("{e}"));
    let stack = PayStack::start_with(&[(
        "fencing.proof-keys-file",
        pay_keys.display().to_string().as_str(),
    )])
    .await;
    let (lock_stack, lock_url) = LockStack::serving(
        Backend::Pg,
        &[(
            "fencing.proof-keys-file",
            lock_keys.display().to_string().as_str(),
        )],
    )
    .await;
    let locks = LockClient::new(&lock_url, "worker-1").unwrap_or_else(|e| panic!("{e}"));
    let session = session(&locks, 30_000).await;

    stack.account("acct-a", "EUR").await;
    stack.account("acct-b", "EUR").await;
    stack.fund("acct-a", 10_000).await;
    stack.fund("acct-b", 10_000).await;
    let pa = stack.payout("acct-a", 100, "EUR").await;
    let pb = stack.payout("acct-b", 100, "EUR").await;
    let a = hold(&locks, "payout:acct-a", session, 30_000).await;
    let b = hold(&locks, "payout:acct-b", session, 30_000).await;
    let proof_a = a.fencing_proof.clone().unwrap_or_default();
    assert!(
        proof_a.starts_with("new."),
        "the first key signs: {proof_a}"
    );
    // Renew keeps the token and answers the same proof.
    let renewed = locks
        .renew("payout:acct-a", session, a.fencing_token, Some(30_000))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(renewed.fencing_proof.as_deref(), Some(proof_a.as_str()));

    let claim = |payout: Uuid, token: i64, proof: String| {
        let stack = &stack;
        async move {
            stack
                .send(
                    Method::POST,
                    &format!("/v1/payouts/{payout}/claim"),
                    &[
                        ("x-owner-id", "worker-1".to_owned()),
                        ("x-idempotency-key", format!("payout-{payout}")),
                        ("x-fencing-token", token.to_string()),
                        ("x-fencing-proof", proof),
                    ],
                    Some(r#"{"expectedState":"PENDING"}"#),
                )
                .await
        }
    };
    let fence = |account: &'static str| {
        let pool = stack.pool.clone();
        async move {
            scalar(
                &pool,
                &format!("SELECT fence FROM accounts WHERE account_id = '{account}'"),
            )
            .await
        }
    };
    // Key A's proof for key B (with A's token, and with B's token).
    for token in [a.fencing_token, b.fencing_token] {
        claim(pb, token, proof_a.clone()).await.expect(
            "A's proof on B",
            400,
            Some("INVALID_TOKEN"),
        );
    }
    // Key A's proof for another token on A: the next one, and a forged one.
    for token in [a.fencing_token + 1, b.fencing_token, FORGED] {
        claim(pa, token, proof_a.clone()).await.expect(
            "A's proof for another token",
            400,
            Some("INVALID_TOKEN"),
        );
    }
    assert_eq!((fence("acct-a").await, fence("acct-b").await), (0, 0));
    assert_eq!(stack.state_of(pa).await, "PENDING");
    // The real pairs, signed with the key listed second here, are admitted.
    claim(pa, a.fencing_token, proof_a.clone())
        .await
        .expect("A's own grant", 200, None);
    claim(
        pb,
        b.fencing_token,
        b.fencing_proof.clone().unwrap_or_default(),
    )
    .await
    .expect("B's own grant", 200, None);
    assert_eq!(
        (fence("acct-a").await, fence("acct-b").await),
        (a.fencing_token, b.fencing_token)
    );
    drop(lock_stack);
}
