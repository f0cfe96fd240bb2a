//! The rail proxy checks a submission by the contract's own rules (`dlock_contract::payment`),
//! the ones the payment resource applies to the payout: what the payment resource would refuse
//! is refused here too, with every field at fault named, before anything is written.

use serde_json::Value;

use crate::conformance::assert_envelope;
use crate::harness::port;
use crate::rail::{RailWorld, statement, submit_to};

/// The fields a VALIDATION_FAILED answer names.
fn fields_named(body: &Value) -> Vec<&str> {
    body["details"]["fields"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|f| f["field"].as_str())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_submission_the_contract_refuses_is_refused_field_by_field_and_writes_nothing() {
    let (w, stub, proxy) = RailWorld::with_proxy("acct-v").await;
    let payout = w.claimed("acct-v", 700, 3).await;
    // A beneficiary with spaces: no reference the contract allows, though 1 to 128 characters.
    let (status, body) = submit_to(&proxy, "acct-v", payout, 700, "3", "ben 1 with spaces").await;
    assert_envelope(
        "beneficiary with spaces",
        status,
        &body,
        "VALIDATION_FAILED",
    );
    assert_eq!(fields_named(&body), ["beneficiaryRef"], "{body}");
    // Refused before admission: no attempt, no mark, nothing at the rail.
    assert!(w.submissions(payout).await.is_empty());
    assert_eq!(w.state(payout).await, "CLAIMED");
    assert!(statement(&stub, payout).await.is_empty());
    // Positive control: the same payout with its own beneficiary, which the contract allows, is
    // paid.
    let (status, body) = submit_to(&proxy, "acct-v", payout, 700, "3", "ben").await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(statement(&stub, payout).await.len(), 1);
}

/// A worker that holds a valid claim on a payout asks a real `dlock serve rail-proxy` process to
/// send the payout's money to another beneficiary, or another sum: both are valid by the
/// contract's field rules, but not the registered payout's, and `rail_admit` compares them with
/// the payout's row in paydb. Refused as `400 VALIDATION_FAILED` naming the field, with nothing
/// recorded, no mark moved and nothing at the rail; the submission that is the payout's own is
/// forwarded (the positive control).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_submission_that_is_not_the_registered_payout_is_refused_and_nothing_reaches_the_rail() {
    let (w, stub) = RailWorld::with_stub("stub", &[]).await;
    w.account("acct-m", 10_000).await;
    let proxy_port = port();
    let _proxy = w.proxy_process(proxy_port, &stub, &[]);
    let proxy = format!("http://127.0.0.1:{proxy_port}");
    let payout = w.claimed("acct-m", 700, 5).await;
    for (what, amount, beneficiary, field) in [
        (
            "another beneficiary",
            700,
            "attacker-0001",
            "beneficiaryRef",
        ),
        ("another amount", 7_000, "ben", "amountMinor"),
    ] {
        let (status, body) = submit_to(&proxy, "acct-m", payout, amount, "5", beneficiary).await;
        assert_envelope(what, status, &body, "VALIDATION_FAILED");
        assert_eq!(fields_named(&body), [field], "{what}: {body}");
        assert!(w.submissions(payout).await.is_empty(), "{what}: no attempt");
        assert_eq!(w.state(payout).await, "CLAIMED", "{what}");
        assert!(
            statement(&stub, payout).await.is_empty(),
            "{what}: no transfer"
        );
    }
    let (mark,): (Option<i64>,) = sqlx::query_as(
        "SELECT (SELECT highest_token FROM rail_high_water WHERE account_id = 'acct-m')",
    )
    .fetch_one(&w.pool)
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    assert!(mark.unwrap_or(0) < 5, "no mark moved: {mark:?}");
    // Positive control: the payout's own submission, same token, is forwarded and paid once.
    let (status, body) = submit_to(&proxy, "acct-m", payout, 700, "5", "ben").await;
    assert_eq!(status, 200, "{body}");
    let transfers = statement(&stub, payout).await;
    assert_eq!(transfers.len(), 1, "{transfers:?}");
    assert_eq!(transfers[0]["amountMinor"], 700, "{transfers:?}");
}
