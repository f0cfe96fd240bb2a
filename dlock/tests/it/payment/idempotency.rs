//! docs/design.md#d-7 and docs/design.md#idempotency: replay byte for byte, conflicts, in-progress
//! duplicates, the sweep.

use std::time::Duration;

use futures::future::join_all;
use serde_json::json;

use super::{PayStack, post_body};
use crate::harness::{eventually, metric};

#[tokio::test]
async fn replays_are_byte_for_byte_and_a_different_body_conflicts() {
    let (stack, payout) = PayStack::with_payout(&[], "acct-i").await;
    let token = stack.token();

    let first = stack.claim(payout, token, "PENDING").await;
    first.expect("claim", 200, None);
    assert!(!first.replayed);
    let second = stack.claim(payout, token, "PENDING").await;
    second.expect("replayed claim", 200, None);
    second.replays("replayed claim", &first);
    assert_eq!(
        stack.psql(&format!(
            "SELECT attempt_count FROM payouts WHERE payout_id = '{payout}'"
        )),
        "1"
    );

    // Same key and token, different body: IDEMPOTENCY_CONFLICT, nothing changes.
    let conflict = stack.claim(payout, token, "CLAIMED").await;
    conflict.expect("conflicting claim", 422, Some("IDEMPOTENCY_CONFLICT"));
    assert_eq!(
        stack.psql(&format!(
            "SELECT attempt_count FROM payouts WHERE payout_id = '{payout}'"
        )),
        "1"
    );

    // Post and its replay.
    stack.rail_ack(payout).await;
    let posted = stack.post(payout, token).await;
    posted.expect("post", 200, None);
    let replayed = stack.post(payout, token).await;
    assert_eq!(replayed.status, 200);
    replayed.replays("post again", &posted);
    let mut other = post_body(payout);
    other["railReference"] = json!("another-reference");
    stack
        .write(
            &format!("/v1/payouts/{payout}/post"),
            &format!("payout-{payout}"),
            Some(token),
            &other,
        )
        .await
        .expect("post with another body", 422, Some("IDEMPOTENCY_CONFLICT"));
    assert_eq!(
        stack.psql("SELECT count(*) FROM ledger_entries WHERE kind = 'payout'"),
        "2"
    );

    // The records hold a hash, never the body.
    assert_eq!(
        stack.psql(
            "SELECT count(*) FROM idempotency_records WHERE octet_length(payload_hash) <> 32"
        ),
        "0"
    );
    let metrics = stack.metrics().await;
    assert_eq!(metric(&metrics, "idempotency_key_conflicts_total"), 2.0);
    assert!(metric(&metrics, "idempotency_lookups_total{outcome=\"hit\"}") >= 2.0);
}

#[tokio::test]
async fn twenty_concurrent_identical_claims_run_the_effect_once() {
    let (stack, payout) = PayStack::with_payout(&[], "acct-c").await;
    let token = stack.token();
    let answers = join_all((0..20).map(|_| stack.claim(payout, token, "PENDING"))).await;
    for answer in &answers {
        answer.expect("concurrent claim", 200, None);
        assert_eq!(
            answer.bytes, answers[0].bytes,
            "every duplicate gets the same answer"
        );
    }
    assert_eq!(
        answers.iter().filter(|a| !a.replayed).count(),
        1,
        "exactly one ran the effect"
    );
    assert_eq!(
        stack.psql(&format!(
            "SELECT attempt_count, state FROM payouts WHERE payout_id = '{payout}'"
        )),
        "1|CLAIMED"
    );
    assert_eq!(
        stack.psql("SELECT held_minor FROM accounts WHERE account_id = 'acct-c'"),
        "100"
    );
}

#[tokio::test]
async fn a_duplicate_waits_for_the_request_in_progress_only_so_long() {
    let (stack, payout) = PayStack::with_payout(
        &[("payment.idempotency.in-progress-wait-ms", "200")],
        "acct-w",
    )
    .await;
    let token = stack.token();
    // Another transaction holds the record, as an identical request still running would.
    let mut holder = stack.pool.begin().await.unwrap_or_else(|e| panic!("{e}"));
    sqlx::query(
        "INSERT INTO idempotency_records (route, idempotency_key, fencing_token, owner_id, \
         payload_hash, status, expires_at) VALUES ($1, $2, $3, 'w', $4, 'in_progress', \
         clock_timestamp() + interval '1 hour')",
    )
    .bind(format!("POST /v1/payouts/{payout}/claim"))
    .bind(format!("payout-{payout}"))
    .bind(token)
    .bind(vec![0u8; 32])
    .execute(&mut *holder)
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    let waited = stack.claim(payout, token, "PENDING").await;
    let body = waited.expect(
        "duplicate of an in-progress request",
        429,
        Some("CONTENTION_EXCEEDED"),
    );
    // The contract's code (docs/contract.md#error-codes) for a caller's own retry that came too
    // soon, not NOT_LEADER (paydb is fine).
    assert_eq!(body["retrySafe"], true);
    assert_eq!(body["retryAfterMillis"], 200);
    assert_eq!(body["details"]["status"], "in_progress");
    assert_eq!(stack.state_of(payout).await, "PENDING");
    let metrics = stack.metrics().await;
    assert_eq!(
        metric(&metrics, "idempotency_in_progress_timeouts_total"),
        1.0
    );
    // The 429 was not stored; once the other request is gone, the retry runs.
    holder.rollback().await.unwrap_or_else(|e| panic!("{e}"));
    stack
        .claim(payout, token, "PENDING")
        .await
        .expect("retry", 200, None);
}

#[tokio::test]
async fn expired_records_are_swept() {
    let (stack, payout) =
        PayStack::with_payout(&[("payment.idempotency.sweep-interval-ms", "50")], "acct-s").await;
    stack.claimed(payout).await;
    // Retention: 72 h for payout writes, 7 days for ledger postings.
    let claim_hours = stack.psql(&format!(
        "SELECT round(extract(epoch FROM expires_at - first_seen_at) / 3600) FROM idempotency_records WHERE route LIKE '%{payout}/claim'"
    ));
    assert_eq!(claim_hours, "72");
    let fund_hours = stack.psql(
        "SELECT round(extract(epoch FROM expires_at - first_seen_at) / 3600) FROM idempotency_records WHERE route LIKE '%/fund'",
    );
    assert_eq!(fund_hours, "168");
    let total: i64 = stack
        .psql("SELECT count(*) FROM idempotency_records")
        .parse()
        .unwrap_or(0);
    assert!(total >= 4);
    stack.psql(&format!(
        "UPDATE idempotency_records SET first_seen_at = first_seen_at - interval '80 hours', \
         expires_at = expires_at - interval '80 hours' WHERE route LIKE '%{payout}/claim'"
    ));
    eventually(
        "the expired record is swept",
        Duration::from_secs(10),
        || async {
            (stack
                .psql("SELECT count(*) FROM idempotency_records")
                .parse::<i64>()
                .unwrap_or(-1)
                == total - 1)
                .then_some(())
        },
    )
    .await;
    assert_eq!(
        stack.psql(&format!(
            "SELECT count(*) FROM idempotency_records WHERE route LIKE '%{payout}/claim'"
        )),
        "0"
    );
}
