//! The rail proxy's high-water mark is lowered only down to the highest token the proxy admitted
//! a proven submission with (`rail_high_water.max_seen_token`,
//! migrations/paydb/0040_baseline_idempotency_and_rail.sql), as the account fence is
//! (docs/threat-model.md#recovery).

use serde_json::json;

use super::support::{
    Mark, assert_lowering_under, operator_grant, released_then_held, scalar, write_with,
};
use crate::auth::DevStack;
use crate::harness::release;
use crate::shared::payouts::register_payout;

/// On `dlock dev up` (proofs on): a worker's grant A is released, its grant B claims a payout
/// and submits it through the real rail proxy, which the rail acknowledges. An operator holding
/// A's valid proof cannot lower the rail high-water mark to A, under B: `409 FENCED_OUT` naming
/// B, the mark stays, no recovery row; psql cannot either (a CHECK), and the seen mark never
/// goes down. The recovery the lowering exists for still works: after a revocation floor far
/// above every token issued, the operator's fresh grant D (above B) brings the mark down to D.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rail_high_water_is_lowered_only_down_to_the_highest_token_the_proxy_admitted() {
    let stack = DevStack::with_account("acct-h", 1_000_000).await;
    let (lock, payment, proxy) = stack.services();
    let (executor, operator) = stack.credentials();
    let payout = register_payout(&stack.registrar_payments(), "acct-h", 250, "ben-h1").await;
    let pool = stack.pool("paydb").await;
    let high = || {
        scalar(
            &pool,
            "SELECT coalesce(max(highest_token), 0) FROM rail_high_water \
             WHERE account_id = 'acct-h'",
        )
    };
    let recoveries = || {
        scalar(
            &pool,
            "SELECT count(*) FROM fence_recoveries \
             WHERE account_id = 'acct-h' AND resource = 'rail'",
        )
    };

    // Grant A, released; then grant B, which claims and submits.
    let (worker, s1, a, b) = released_then_held(&lock, &executor, "payout:acct-h").await;
    let (status, body) = write_with(
        &format!("{payment}/v1/payouts/{payout}/claim"),
        &executor,
        "executor/w1",
        &b,
        &json!({ "expectedState": "PENDING" }),
    )
    .await;
    assert_eq!(status, 200, "the claim with B: {body}");
    let (status, body) = write_with(
        &format!("{proxy}/v1/rail/submissions"),
        &executor,
        "executor/w1",
        &b,
        &json!({ "payoutId": payout, "accountId": "acct-h", "amountMinor": 250,
                 "currency": "EUR", "beneficiaryRef": "ben-h1" }),
    )
    .await;
    assert_eq!(status, 200, "the submission with B: {body}");
    assert_eq!(body["outcome"], json!("ACKED"), "{body}");
    assert_eq!(high().await, b.fencing_token);
    assert_eq!(
        scalar(
            &pool,
            "SELECT max_seen_token FROM rail_high_water WHERE account_id = 'acct-h'"
        )
        .await,
        b.fencing_token,
        "the proven submission is the mark's floor"
    );
    release(&worker, "payout:acct-h", s1, b.fencing_token).await;

    // Lowering the mark to A, a released grant's real proof, under B: refused, nothing changed.
    let mark = Mark::rail_high_water(&proxy, "acct-h");
    let lower_url = mark.lower_url();
    let lower = json!({ "operator": "jane.doe",
                        "reason": "INC-8: lower the rail high-water of acct-h to grant A" });
    let (status, body) = write_with(&lower_url, &operator, "ops-console", &a, &lower).await;
    assert_lowering_under("a rail lowering under B", status, &body, &b, &a);
    assert_eq!(body["details"]["resourceType"], json!("rail"), "{body}");
    assert_eq!(body["details"]["resourceId"], json!("acct-h"), "{body}");
    assert_eq!(high().await, b.fencing_token, "the mark stays at B");
    assert_eq!(recoveries().await, 0, "nothing recorded");
    mark.assert_schema_refuses_lowering(&pool, b.fencing_token, a.fencing_token)
        .await;

    // Positive control, the legitimate recovery: a revocation floor far above every token
    // issued raises the mark; the operator's fresh grant D, above B, brings it down to D.
    let floor = b.fencing_token + 1_000_000;
    mark.advance_to_floor(&operator, floor, "INC-8: floor from the old lock store")
        .await;
    assert_eq!(high().await, floor);
    let (ops, ops_session, d) = operator_grant(&lock, &operator, "payout:acct-h").await;
    assert!(d.fencing_token > b.fencing_token);
    let (status, body) = write_with(&lower_url, &operator, "ops-console", &d, &lower).await;
    assert_eq!(status, 200, "the lowering to a fresh grant: {body}");
    assert_eq!(body["lowered"], json!(true), "{body}");
    assert_eq!(body["resource"], json!("rail"), "{body}");
    assert_eq!(body["previousToken"], json!(floor));
    assert_eq!(body["token"], json!(d.fencing_token));
    assert_eq!(high().await, d.fencing_token);
    assert_eq!(recoveries().await, 1);
    release(&ops, "payout:acct-h", ops_session, d.fencing_token).await;
    pool.close().await;
}
