//! A large funding cannot be split under `auth.treasury.dual-approval-above`: the threshold
//! bounds what one treasury identity funds on an account on its own word in a rolling 24 hours
//! (paydb's `pay_fund_as`, migrations/paydb/0039_baseline_payment_writes.sql;
//! docs/threat-model.md#roles), through the real payment resource of `dlock dev up`.

use super::*;

const THRESHOLD: i64 = 100_000;
const TREASURY_2: &str = "treasury-2-window-0123456789abcdef";

/// A funding of `amount` with `reference` as `token`'s identity `who`: the status and the body.
async fn fund(
    payment: &str,
    (who, token): (&str, &str),
    account: &str,
    amount: i64,
    reference: &str,
) -> (u16, Value) {
    let (status, _, body) = write_as(
        &format!("{payment}/v1/accounts/{account}/fund"),
        token,
        &format!("{who}/window"),
        None,
        &json!({ "amountMinor": amount, "reference": reference }),
    )
    .await;
    (status, body)
}

async fn balance(pool: &sqlx::PgPool, account: &str) -> i64 {
    sqlx::query_scalar("SELECT balance_minor FROM accounts WHERE account_id = $1")
        .bind(account)
        .fetch_one(pool)
        .await
        .unwrap_or_else(|e| panic!("{account}: {e}"))
}

/// With the threshold T: one treasury identity funds T−1 (applied) and then 2, which would take
/// what it funded on the account alone in 24 hours above T: 202 with a funding id, the balance
/// shows only T−1. Another treasury identity funding the same account is not counted against
/// the first (its own window), and its approval applies the pending funding. Two concurrent
/// fundings of T/2+1 by one identity on a fresh account: one applies, the other waits (the
/// account row lock decides them one after the other), on each of four accounts. The window's
/// rows cannot be deleted to reset it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_funding_split_under_the_threshold_waits_for_a_second_treasury_identity() {
    let stack = DevStack::with_dual_approval_above(&THRESHOLD.to_string()).await;
    let payment = stack.url("paymentResource");
    let treasury = stack.token("treasury");
    // A second treasury identity in the tokens file, which the services re-read.
    stack
        .add_tokens(&[("treasury-2", TREASURY_2, "treasury")])
        .await;
    let pool = stack.pool("paydb").await;

    open_account(&stack.treasury_payments(), "acct-w", None).await;
    let (status, body) = fund(
        &payment,
        ("treasury", &treasury),
        "acct-w",
        THRESHOLD - 1,
        "w-1",
    )
    .await;
    assert_eq!(status, 200, "T-1 applies at once: {body}");
    assert_eq!(balance(&pool, "acct-w").await, THRESHOLD - 1);
    let (status, body) = fund(&payment, ("treasury", &treasury), "acct-w", 2, "w-2").await;
    assert_eq!(
        status, 202,
        "2 more by the same identity within 24 h waits: {body}"
    );
    assert_eq!(body["status"], "PENDING_APPROVAL", "{body}");
    assert_eq!(body["requestedBy"], "treasury", "{body}");
    let funding = body["fundingId"]
        .as_str()
        .unwrap_or_else(|| panic!("no fundingId: {body}"))
        .to_owned();
    assert_eq!(
        balance(&pool, "acct-w").await,
        THRESHOLD - 1,
        "only T-1 applied"
    );
    // The same request again answers the same pending funding and applies nothing.
    let (status, again) = fund(&payment, ("treasury", &treasury), "acct-w", 2, "w-2").await;
    assert_eq!(
        (status, &again["fundingId"]),
        (202, &body["fundingId"]),
        "{again}"
    );
    assert_eq!(balance(&pool, "acct-w").await, THRESHOLD - 1);

    // Positive control: the window is the identity's own. Another treasury identity's funding
    // under T on the same account applies at once.
    let (status, body) = fund(&payment, ("treasury-2", TREASURY_2), "acct-w", 10, "w-3").await;
    assert_eq!(status, 200, "another identity's own window: {body}");
    assert_eq!(balance(&pool, "acct-w").await, THRESHOLD + 9);

    // The second identity approves the pending funding: applied, once.
    let (status, _, body) = write_as(
        &format!("{payment}/v1/fundings/{funding}/approve"),
        TREASURY_2,
        "treasury-2/window",
        None,
        &json!({}),
    )
    .await;
    assert_eq!(status, 200, "the second identity approves: {body}");
    assert_eq!(body["approvedBy"], "treasury-2", "{body}");
    assert_eq!(balance(&pool, "acct-w").await, THRESHOLD + 11, "applied");

    // Two concurrent fundings of T/2+1 by one identity: both cannot slip under.
    let half = THRESHOLD / 2 + 1;
    for n in 0..4 {
        let account = format!("acct-c{n}");
        open_account(&stack.treasury_payments(), &account, None).await;
        let (a, b) = (format!("c{n}-a"), format!("c{n}-b"));
        let (first, second) = tokio::join!(
            fund(&payment, ("treasury", &treasury), &account, half, &a),
            fund(&payment, ("treasury", &treasury), &account, half, &b),
        );
        let mut statuses = [first.0, second.0];
        statuses.sort_unstable();
        assert_eq!(
            statuses,
            [200, 202],
            "{account}: one applies, the other waits: {first:?} {second:?}"
        );
        assert_eq!(
            balance(&pool, &account).await,
            half,
            "{account}: applied once"
        );
    }

    // The window is only as good as its rows: paydb keeps every one.
    let reset = sqlx::query("DELETE FROM direct_fundings WHERE account_id = 'acct-w'")
        .execute(&pool)
        .await;
    assert!(reset.is_err(), "the window's rows were deleted: {reset:?}");
    let rows: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM direct_fundings \
         WHERE account_id = 'acct-w' OR account_id LIKE 'acct-c_'",
    )
    .fetch_one(&pool)
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        rows,
        2 + 4,
        "acct-w's two direct fundings and one per concurrent pair"
    );
    pool.close().await;
}
