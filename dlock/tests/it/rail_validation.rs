//! The rail proxy checks a submission by the contract's own rules (`dlock_contract::payment`),
//! the ones the payment resource applies to the payout: what the payment resource would refuse
//! is refused here too, with every field at fault named, before anything is written.

use crate::conformance::assert_envelope;
use crate::rail::{RailWorld, statement, submit_to};

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
    let fields: Vec<&str> = body["details"]["fields"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|f| f["field"].as_str())
        .collect();
    assert_eq!(fields, ["beneficiaryRef"], "{body}");
    // Refused before admission: no attempt, no mark, nothing at the rail.
    assert!(w.submissions(payout).await.is_empty());
    assert_eq!(w.state(payout).await, "CLAIMED");
    assert!(statement(&stub, payout).await.is_empty());
    // Positive control: the same payout with a beneficiary the contract allows is paid.
    let (status, body) = submit_to(&proxy, "acct-v", payout, 700, "3", "ben-0001").await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(statement(&stub, payout).await.len(), 1);
}
