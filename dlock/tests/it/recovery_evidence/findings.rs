//! An attempt whose outcome nobody recorded (the rail proxy gave up on the forward: a timeout,
//! a reset, a proxy that died) is resolved on the reconciler's finding recorded in paydb, and a
//! POSTED reference belongs to one payout (docs/contract.md#resolve-evidence).
//!
//! Real PostgreSQL, real rail proxies, payment resource and `dlock reconcile` processes, the real
//! rail stub, and a rail that accepts the connection and never answers.

use std::time::Duration;

use uuid::Uuid;

use super::support::{
    assert_refused, failed, payment_process, posted, process, proxy_pairs, resolutions_audited,
    resolve, scalar,
};
use crate::conformance::assert_envelope;
use crate::harness::eventually;
use crate::rail::{RailWorld, statement};
use crate::shared::process::reconcile;

/// Two payouts whose attempts nobody recorded: one the slow rail took after the proxy gave up
/// (on the statement), one sent to a rail that never answers (not on it). Before `dlock
/// reconcile` ran, FAILED and POSTED are both refused naming what is missing, nothing changes,
/// nothing is audited. The reconciler records one finding per payout in paydb, append-only. A
/// finding read before the settlement window after the attempt does not resolve FAILED; one read
/// after it does (positive control). The payout on the statement: FAILED and POSTED under another
/// reference are refused, POSTED under the found reference resolves it. That reference is then
/// refused for the other payout.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_unrecorded_attempt_is_resolved_on_the_reconcilers_finding() {
    let (w, stub) = RailWorld::with_stub("slow", &[("rail.stub.latency-ms", "1500")]).await;
    // A rail that takes the connection and never answers: nothing reaches a statement.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap_or_else(|e| panic!("{e}"));
    let silent_url = format!(
        "http://{}",
        silent.local_addr().unwrap_or_else(|e| panic!("{e}"))
    );
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for conn in silent.incoming().flatten() {
            held.push(conn);
        }
    });
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let paydb = w.pg().url("paydb");
    let short = |rail: &str| proxy_pairs(&paydb, rail, "100", "0");
    let (_short, short_proxy) = process(dir.path(), "rail-proxy", "short", &short(&stub));
    let (_silent, silent_proxy) = process(dir.path(), "rail-proxy", "silent", &short(&silent_url));
    let (_payment, payment) = payment_process(dir.path(), &paydb);
    w.account("acct-f", 10_000).await;

    let on_rail = w.claimed("acct-f", 300, 3).await;
    let (status, body) = crate::rail::submit(&short_proxy, "acct-f", on_rail, 300, "3").await;
    assert_eq!(status, 409, "the short proxy gives up: {body}");
    let transfers = eventually(
        "the slow rail takes the transfer",
        Duration::from_secs(10),
        || async {
            let t = statement(&stub, on_rail).await;
            (t.len() == 1).then_some(t)
        },
    )
    .await;
    let reference = transfers[0]["railReference"]
        .as_str()
        .unwrap_or_else(|| panic!("{transfers:?}"))
        .to_owned();
    let lost = w.claimed("acct-f", 200, 4).await;
    let (status, body) = crate::rail::submit(&silent_proxy, "acct-f", lost, 200, "4").await;
    assert_eq!(status, 409, "the silent rail's forward is given up: {body}");
    assert_envelope("the given-up forward", status, &body, "RAIL_AMBIGUOUS");
    assert_eq!(w.state(on_rail).await, "RAIL_AMBIGUOUS");
    assert_eq!(w.state(lost).await, "RAIL_AMBIGUOUS");
    let recorded = scalar(
        &w.pool,
        &format!(
            "SELECT count(*) FROM rail_submission WHERE payout_id IN ('{on_rail}', '{lost}')
              AND outcome = 'TIMEOUT' AND late_outcome IS NULL"
        ),
    )
    .await;
    assert_eq!(
        recorded, 2,
        "nobody recorded the rail's answer to either attempt"
    );

    let resolve = |payout: Uuid, body| resolve(&payment, payout, body);
    let audit = || resolutions_audited(&w.pool);
    let refused = assert_refused;

    // No finding yet: both refused, naming the reconciler.
    let (status, body) = resolve(lost, failed()).await;
    refused("FAILED without a finding", status, &body, "outcome");
    assert!(
        body["message"]
            .as_str()
            .is_some_and(|m| m.contains("dlock reconcile")),
        "{body}"
    );
    let (status, body) = resolve(on_rail, posted(&reference)).await;
    refused("POSTED without a finding", status, &body, "railReference");
    assert_eq!(audit().await, 0);
    assert_eq!(w.state(lost).await, "RAIL_AMBIGUOUS", "nothing changed");

    // A finding read long before the settlement window after the attempt ends.
    reconcile(&paydb, &stub, 600_000, &["--json"]);
    let findings = |payout: Uuid, verdict: &'static str| {
        let pool = w.pool.clone();
        async move {
            let sql = format!(
                "SELECT count(*) FROM reconcile_findings
                  WHERE payout_id = '{payout}' AND verdict = '{verdict}'"
            );
            scalar(&pool, &sql).await
        }
    };
    assert_eq!(findings(lost, "absent").await, 1);
    assert_eq!(findings(on_rail, "present").await, 1);
    let rewrite = sqlx::query("UPDATE reconcile_findings SET verdict = 'absent'")
        .execute(&w.pool)
        .await;
    assert!(rewrite.is_err(), "findings are append-only: {rewrite:?}");
    let (status, body) = resolve(lost, failed()).await;
    refused(
        "FAILED inside the settlement window",
        status,
        &body,
        "outcome",
    );

    // The found payout: only POSTED under the found reference.
    let (status, body) = resolve(on_rail, failed()).await;
    refused(
        "FAILED of a payout on the statement",
        status,
        &body,
        "outcome",
    );
    assert!(
        body["message"]
            .as_str()
            .is_some_and(|m| m.contains(&reference)),
        "{body}"
    );
    let (status, body) = resolve(on_rail, posted("rail-made-up-7")).await;
    refused(
        "POSTED under another reference",
        status,
        &body,
        "railReference",
    );
    assert_eq!(audit().await, 0);
    let (status, body) = resolve(on_rail, posted(&reference)).await;
    assert_eq!(status, 200, "POSTED under the found reference: {body}");
    assert_eq!(w.state(on_rail).await, "POSTED");

    // A reference names one payout.
    let (status, body) = resolve(lost, posted(&reference)).await;
    refused(
        "POSTED under another payout's reference",
        status,
        &body,
        "railReference",
    );
    assert!(
        body["message"]
            .as_str()
            .is_some_and(|m| m.contains("another payout")),
        "{body}"
    );
    assert_eq!(w.state(lost).await, "RAIL_AMBIGUOUS", "nothing changed");

    // Positive control: a statement read the settlement window (1 s) after the attempt.
    eventually(
        "paydb's clock passes the attempt plus 1 s",
        Duration::from_secs(10),
        || async {
            let past = scalar(
                &w.pool,
                &format!(
                    "SELECT count(*) FROM rail_submission WHERE payout_id = '{lost}'
                      AND submitted_at + interval '1 second' < clock_timestamp()"
                ),
            )
            .await;
            (past == 1).then_some(())
        },
    )
    .await;
    reconcile(&paydb, &stub, 1_000, &["--json"]);
    assert_eq!(findings(lost, "absent").await, 2);
    let (status, body) = resolve(lost, failed()).await;
    assert_eq!(status, 200, "FAILED on the reconciler's finding: {body}");
    assert_eq!(w.state(lost).await, "FAILED");
    assert_eq!(audit().await, 2);
}
