//! Holds: a claim is admitted only if balance - holds covers it; otherwise the payout FAILS and
//! that answer is stored for replay.

use super::PayStack;

#[tokio::test]
async fn the_second_of_two_sixty_payouts_on_a_hundred_fails_for_insufficient_funds() {
    let stack = PayStack::funded("acct-h", 100).await;
    let first = stack.payout("acct-h", 60, "EUR").await;
    let second = stack.payout("acct-h", 60, "EUR").await;

    let t1 = stack.claimed(first).await;
    let account = stack.get("/v1/accounts/acct-h").await;
    let a = account.expect("P5", 200, None);
    assert_eq!(a["balanceMinor"], 100);
    assert_eq!(a["heldMinor"], 60);
    assert_eq!(a["availableMinor"], 40);

    let t2 = stack.token();
    let refused = stack.claim(second, t2, "PENDING").await;
    let body = refused.expect("second claim", 422, Some("INSUFFICIENT_FUNDS"));
    assert_eq!(body["details"]["state"], "FAILED");
    assert_eq!(body["details"]["availableMinor"], 40);
    assert_eq!(body["details"]["amountMinor"], 60);
    assert_eq!(stack.state_of(second).await, "FAILED");
    // The answer is stored: the same request replays it byte for byte, the effect once.
    let replay = stack.claim(second, t2, "PENDING").await;
    assert_eq!(replay.status, 422);
    replay.replays("second claim again", &refused);
    // FAILED is terminal: a newer holder cannot claim it.
    stack
        .not_claimable("claim a FAILED payout", second, "PENDING")
        .await;

    // The hold stays until the first payout leaves the held states; posting spends it. The
    // refused claim advanced the account's fence to t2, so a later holder posts
    // (docs/design.md#d-1).
    stack.rail_ack(first).await;
    stack
        .post(first, t1)
        .await
        .expect("post under the superseded token", 409, Some("FENCED_OUT"));
    stack
        .post(first, stack.token())
        .await
        .expect("post", 200, None);
    let account = stack.get("/v1/accounts/acct-h").await;
    let a = account.expect("P5 after post", 200, None);
    assert_eq!(a["balanceMinor"], 40);
    assert_eq!(a["heldMinor"], 0);
    assert_eq!(a["ledgerSumMinor"], 40);
}

#[tokio::test]
async fn an_ambiguous_payout_keeps_its_hold() {
    let stack = PayStack::funded("acct-q", 100).await;
    let ambiguous = stack.payout("acct-q", 70, "EUR").await;
    let next = stack.payout("acct-q", 40, "EUR").await;
    stack.claimed(ambiguous).await;
    stack.make_ambiguous(ambiguous);
    // Even if the ambiguous one was paid, the account must not go negative: 100 - 70 < 40.
    stack.claim(next, stack.token(), "PENDING").await.expect(
        "claim past an ambiguous hold",
        422,
        Some("INSUFFICIENT_FUNDS"),
    );
    // Quarantined: nobody claims it under any token.
    stack
        .not_claimable("claim a RAIL_AMBIGUOUS payout", ambiguous, "CLAIMED")
        .await;
}
