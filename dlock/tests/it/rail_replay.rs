//! docs/contract.md#submit-replay and docs/design.md#d-7 at the rail proxy: the identical request
//! (same X-Idempotency-Key, same X-Fencing-Token, same body) retried gets the first answer back,
//! never a second forward and never a page; the same key and token with another body is
//! IDEMPOTENCY_CONFLICT. And a forward, once admitted, runs to its recorded outcome whatever the
//! caller does.

use std::time::Duration;

use crate::conformance::assert_envelope;
use crate::harness::eventually;
use crate::rail::{RailWorld, Rails, metric, statement, submission, submit, submit_to, taken_late};

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_identical_retry_gets_the_first_answer_and_another_body_conflicts() {
    let (
        mut w,
        Rails {
            good,
            slow,
            declining: _,
            proxy,
            timing_out,
            declining_proxy,
        },
    ) = RailWorld::with_three_rails().await;
    let slow_proxy = w.proxy(&slow, &[]).await;
    let impatient_replica = w
        .proxy(
            &slow,
            &[
                ("rail.proxy.read-timeout-ms", "300"),
                ("rail.proxy.unresolved-margin-ms", "200"),
            ],
        )
        .await;
    w.account("acct-r", 100_000).await;

    // ACKED: the retry is the same 200 body, not a duplicate; the rail saw one transfer.
    let (p1, status, first) = w.submit_claimed(&proxy, "acct-r", 1_000, 10).await;
    assert_eq!(status, 200, "{first}");
    let (status, again) = submit(&proxy, "acct-r", p1, 1_000, "10").await;
    assert_eq!(status, 200, "replay: {again}");
    assert_eq!(again, first, "the replay is the first answer");
    // Another body under the same key and token: IDEMPOTENCY_CONFLICT, not a duplicate.
    let (status, conflict) = submit_to(&proxy, "acct-r", p1, 1_000, "10", "someone-else").await;
    assert_eq!(status, 422, "{conflict}");
    assert_envelope("conflict", status, &conflict, "IDEMPOTENCY_CONFLICT");
    assert_eq!(conflict["retrySafe"], false);
    assert_eq!(metric(&proxy, "rail_duplicate_attempted_total").await, 0.0);
    assert_eq!(statement(&good, p1).await.len(), 1);
    assert_eq!(w.submissions(p1).await, vec![("ACKED".to_owned(), 10)]);
    assert_eq!(w.state(p1).await, "RAIL_ACKED");
    // A newer token for the same payout is still a duplicate, counted.
    let (status, dup) = submit(&proxy, "acct-r", p1, 1_000, "11").await;
    assert_eq!(status, 409, "{dup}");
    assert_envelope("newer token", status, &dup, "DUPLICATE_SUBMISSION");
    assert_eq!(metric(&proxy, "rail_duplicate_attempted_total").await, 1.0);
    assert_eq!(statement(&good, p1).await.len(), 1);

    // REJECTED: the retry is the same 422 VALIDATION_FAILED.
    let (p2, status, first) = w
        .submit_claimed(&declining_proxy, "acct-r", 1_000, 20)
        .await;
    assert_eq!(status, 422, "{first}");
    assert_eq!(first["code"], "VALIDATION_FAILED");
    let (status, again) = submit(&declining_proxy, "acct-r", p2, 1_000, "20").await;
    assert_eq!(status, 422, "replay: {again}");
    assert_eq!(again, first, "the replay is the first answer");
    assert_eq!(w.state(p2).await, "FAILED");
    assert_eq!(
        metric(&declining_proxy, "rail_duplicate_attempted_total").await,
        0.0
    );

    // TIMEOUT: the retry is the same 409 RAIL_AMBIGUOUS, and the rail never hears of it.
    let (p3, status, first) = w.submit_claimed(&timing_out, "acct-r", 1_000, 30).await;
    assert_eq!(status, 409, "{first}");
    assert_envelope("ambiguous", status, &first, "RAIL_AMBIGUOUS");
    taken_late(&slow, p3).await;
    let (status, again) = submit(&timing_out, "acct-r", p3, 1_000, "30").await;
    assert_eq!(status, 409, "replay: {again}");
    assert_eq!(again, first, "the replay is the first answer");
    assert_eq!(w.state(p3).await, "RAIL_AMBIGUOUS");
    assert_eq!(w.submissions(p3).await, vec![("TIMEOUT".to_owned(), 30)]);
    assert_eq!(
        metric(&timing_out, "rail_duplicate_attempted_total").await,
        0.0
    );

    // In flight: a retry waits for the first answer only as long as the attempt can be in
    // flight (this replica: read timeout 300 ms + margin 200 ms), then says so, retry-safe,
    // having forwarded nothing. A retry that outlasts the attempt gets its answer.
    let p4 = w.claimed("acct-r", 1_000, 40).await;
    let first = tokio::spawn({
        let slow_proxy = slow_proxy.clone();
        async move { submit(&slow_proxy, "acct-r", p4, 1_000, "40").await }
    });
    eventually(
        "the intent is committed",
        Duration::from_secs(10),
        || async { (w.submissions(p4).await == vec![("unresolved".to_owned(), 40)]).then_some(()) },
    )
    .await;
    let (status, in_flight) = submit(&impatient_replica, "acct-r", p4, 1_000, "40").await;
    assert_eq!(status, 429, "{in_flight}");
    assert_eq!(in_flight["code"], "CONTENTION_EXCEEDED", "{in_flight}");
    assert_eq!(in_flight["retrySafe"], true, "{in_flight}");
    assert!(
        in_flight["retryAfterMillis"].as_u64().is_some(),
        "{in_flight}"
    );
    assert_eq!(in_flight["details"]["outcome"], "unresolved", "{in_flight}");
    let (waited_status, waited) = submit(&slow_proxy, "acct-r", p4, 1_000, "40").await;
    let (status, first) = first.await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(status, 200, "{first}");
    assert_eq!(
        (waited_status, &waited),
        (200, &first),
        "the waiting retry gets the first answer"
    );
    let (status, again) = submit(&slow_proxy, "acct-r", p4, 1_000, "40").await;
    assert_eq!((status, &again), (200, &first), "replay after it settled");
    for replica in [&slow_proxy, &impatient_replica] {
        assert_eq!(metric(replica, "rail_duplicate_attempted_total").await, 0.0);
    }
    assert_eq!(statement(&slow, p4).await.len(), 1);
    assert_eq!(w.submissions(p4).await, vec![("ACKED".to_owned(), 40)]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_caller_that_hangs_up_mid_forward_still_gets_the_outcome_recorded() {
    let (mut w, stub) = RailWorld::with_stub("slow", &[("rail.stub.latency-ms", "1500")]).await;
    let proxy = w.proxy(&stub, &[]).await;
    w.account("acct-h", 10_000).await;
    let payout = w.claimed("acct-h", 700, 5).await;
    // The caller gives up long before the rail answers: the handler's connection is gone.
    let impatient = reqwest::Client::builder()
        .timeout(Duration::from_millis(400))
        .build()
        .unwrap_or_else(|e| panic!("{e}"));
    let answer = submission(&impatient, &proxy, "acct-h", payout, 700, "5")
        .send()
        .await;
    assert!(answer.is_err(), "the caller hung up: {answer:?}");
    drop(impatient);
    // The forward and its record ran to completion anyway.
    eventually(
        "the attempt is recorded ACKED",
        Duration::from_secs(15),
        || async { (w.submissions(payout).await == vec![("ACKED".to_owned(), 5)]).then_some(()) },
    )
    .await;
    assert_eq!(w.state(payout).await, "RAIL_ACKED");
    assert_eq!(statement(&stub, payout).await.len(), 1);
    // And the caller's retry gets that answer, not a page.
    let (status, body) = submit(&proxy, "acct-h", payout, 700, "5").await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["outcome"], "ACKED");
    assert_eq!(metric(&proxy, "rail_duplicate_attempted_total").await, 0.0);
}
