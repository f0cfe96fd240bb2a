//! The payment resource keeps each payout's account, the one a claim's or a post's proof is
//! checked against (docs/design.md#d-8). If what it keeps is stale, a proof for the wrong account
//! must not carry a write: here a payout lost (as with a failover's last commits) and registered
//! again on another account, behind the payment resource's back.

use dlock_contract::auth::Credential;
use dlock_contract::client::LockClient;
use dlock_contract::lock::LockGrant;
use serde_json::json;

use super::{marks, refused, scalar, write};
use crate::auth::DevStack;
use crate::harness::{hold, session};
use crate::shared::accounts::open_account;
use crate::shared::payouts::register_payout;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_proof_checked_against_a_stale_account_writes_nothing_and_the_retry_is_refused() {
    let stack = DevStack::up().await;
    let (lock, payment, _) = stack.services();
    let executor = stack.token("executor");
    for account in ["acct-sa", "acct-sb"] {
        open_account(&stack.treasury_payments(), account, Some(1_000_000)).await;
    }
    // Registered on acct-sa through the payment resource, which keeps acct-sa as its account.
    let payout = register_payout(&stack.registrar_payments(), "acct-sa", 100, "ben-stale").await;
    let pool = stack.pool("paydb").await;
    // paydb loses it and has it registered again on acct-sb, as a lossy failover and another
    // replica could: around the guard that otherwise refuses the delete, straight in paydb.
    for sql in [
        "ALTER TABLE payouts DISABLE TRIGGER payouts_kept".to_owned(),
        format!("DELETE FROM payouts WHERE payout_id = '{payout}'"),
        "ALTER TABLE payouts ENABLE TRIGGER payouts_kept".to_owned(),
        format!("SELECT pay_create_payout('{payout}', 'acct-sb', 100, 'EUR', 'ben-stale')::text"),
    ] {
        sqlx::query(sqlx::AssertSqlSafe(sql.clone()))
            .execute(&pool)
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"));
    }
    assert_eq!(
        scalar(
            &pool,
            &format!(
                "SELECT count(*) FROM payouts WHERE payout_id = '{payout}' AND account_id = 'acct-sb'"
            )
        )
        .await,
        1
    );

    let locks = LockClient::new(&lock, "executor/test")
        .unwrap_or_else(|e| panic!("{e}"))
        .with_credential(Some(Credential::fixed(&executor)));
    let session = session(&locks, 30_000).await;
    let claim_url = format!("{payment}/v1/payouts/{payout}/claim");
    // A claim of the payout under `grant`'s token and proof.
    let claim_under = async |grant: &LockGrant| {
        let proof = grant.fencing_proof.as_deref();
        let body = json!({ "expectedState": "PENDING" });
        write(
            &claim_url,
            &executor,
            "executor/test",
            grant.fencing_token,
            proof,
            &body,
        )
        .await
    };
    let on_a = hold(&locks, "payout:acct-sa", session, 30_000).await;
    let before = marks(&pool, "acct-sb").await;

    // The proof is checked against the kept acct-sa and passes; paydb's claim is on acct-sb:
    // rolled back, retry-safe.
    let answer = claim_under(&on_a).await;
    refused(
        "a claim proven on the stale account",
        &answer,
        503,
        "NOT_LEADER",
    );
    assert_eq!(
        marks(&pool, "acct-sb").await,
        before,
        "nothing was written: no fence, no record, no claim"
    );
    // The retry is checked against the account paydb has: acct-sa's proof proves nothing there.
    let answer = claim_under(&on_a).await;
    refused("the same claim, retried", &answer, 400, "INVALID_TOKEN");
    assert_eq!(marks(&pool, "acct-sb").await, before);

    // Positive control: acct-sb's own grant claims it, and the marks read above move.
    let on_b = hold(&locks, "payout:acct-sb", session, 30_000).await;
    let answer = claim_under(&on_b).await;
    assert_eq!(
        answer.0, 200,
        "acct-sb's grant claims the payout: {}",
        answer.2
    );
    assert_eq!(
        scalar(
            &pool,
            "SELECT fence FROM accounts WHERE account_id = 'acct-sb'"
        )
        .await,
        on_b.fencing_token
    );
    assert_ne!(marks(&pool, "acct-sb").await, before);
    let _ = locks.end_session(session).await;
    pool.close().await;
}
