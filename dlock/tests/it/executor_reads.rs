//! What the executor reads before it claims. A payout the run registered afresh was PENDING when
//! the payment resource answered its registration, so its first cycle claims it without reading
//! it first: the claim is conditional on PENDING and is refused if anyone moved it since. A
//! payout whose registration was a replay (the same file run again) is read first, as every
//! later cycle is. The payment resource counts its payout reads (`payment_batch_size_sum`,
//! kind `read`), and the run goes through real services.

use std::time::Duration;

use crate::harness::endpoints;
use crate::payment::metric;
use crate::shared::accounts::open_account;
use dlock_contract::payment_client::PaymentClient;
use dlock_devstack::stack::Stack;
use dlock_executor::executor::{RunOptions, execute};

const EXE: &str = env!("CARGO_BIN_EXE_dlock");

/// Six payouts over three accounts, each with the money for both of its payouts.
const BATCH: &str = r#"
apiVersion: dlock.io/v1alpha1
kind: PayoutBatch
metadata:
  name: first-cycle-reads
spec:
  payouts:
    - {key: a-1, accountId: reads-a, amountMinor: 100, currency: EUR, beneficiaryRef: ben-1}
    - {key: a-2, accountId: reads-a, amountMinor: 100, currency: EUR, beneficiaryRef: ben-2}
    - {key: b-1, accountId: reads-b, amountMinor: 100, currency: EUR, beneficiaryRef: ben-3}
    - {key: b-2, accountId: reads-b, amountMinor: 100, currency: EUR, beneficiaryRef: ben-4}
    - {key: c-1, accountId: reads-c, amountMinor: 100, currency: EUR, beneficiaryRef: ben-5}
    - {key: c-2, accountId: reads-c, amountMinor: 100, currency: EUR, beneficiaryRef: ben-6}
"#;

/// The payout reads (P4) the payment resource has served so far.
async fn payout_reads(stack: &Stack) -> f64 {
    let text = reqwest::get(format!("{}/metrics", stack.payment().url()))
        .await
        .unwrap_or_else(|e| panic!("payment resource /metrics: {e}"))
        .text()
        .await
        .unwrap_or_else(|e| panic!("payment resource /metrics body: {e}"));
    metric(&text, "payment_batch_size_sum{kind=\"read\"}")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_payout_registered_afresh_is_claimed_without_a_read_and_a_replayed_one_is_read() {
    let stack = Stack::builder(EXE)
        .operator_token("reads-operator-token")
        .start();
    let client =
        PaymentClient::new(&stack.payment().url(), "reads").unwrap_or_else(|e| panic!("{e}"));
    for account in ["reads-a", "reads-b", "reads-c"] {
        open_account(&client, account, Some(1_000)).await;
    }
    let batch = dlock_executor::manifest::parse(BATCH).unwrap_or_else(|e| panic!("{e}"));
    let endpoints = endpoints(&stack);
    let options = RunOptions {
        workers: 3,
        settle_timeout: Duration::from_secs(30),
        ..RunOptions::default()
    };

    // First run: every payout is registered afresh and settles in its first cycle (one worker
    // per account, nobody else moves them), and its post answers POSTED, which the final report
    // keeps. So the run reads none of them.
    let before = payout_reads(&stack).await;
    let first = execute(&batch, &endpoints, options.clone())
        .await
        .unwrap_or_else(|e| panic!("{e:#}"));
    assert!(first.complete, "{first:?}");
    assert_eq!(first.states.get("POSTED"), Some(&6), "{first:?}");
    assert_eq!(first.cycles, 6, "one cycle per payout: {first:?}");
    let after_first = payout_reads(&stack).await;
    assert_eq!(
        after_first - before,
        0.0,
        "payouts registered afresh are claimed without a read"
    );

    // Second run of the same file (the positive control): every registration is a replay,
    // which says what the payout was, not what it is, so each cycle reads the payout first and
    // finds it POSTED. The count above would have seen these reads.
    let second = execute(&batch, &endpoints, options)
        .await
        .unwrap_or_else(|e| panic!("{e:#}"));
    assert!(second.complete, "{second:?}");
    assert_eq!(second.states.get("POSTED"), Some(&6), "{second:?}");
    assert_eq!(second.cycles, 6, "{second:?}");
    assert_eq!(
        payout_reads(&stack).await - after_first,
        6.0,
        "a replayed registration is read before its cycle does anything"
    );
}
