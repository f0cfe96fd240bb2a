//! The executor's final report is the payment resource's record. A payout whose
//! terminal state the resource answered during the run (the post's answer, or a re-read that
//! found it settled) is not read again at the end; every other one is. Either way the report
//! must say what paydb says, which this test reads directly from the real database after runs
//! that take each path.

use std::collections::BTreeMap;
use std::time::Duration;

use crate::shared::accounts::open_account;
use dlock_contract::payment_client::PaymentClient;
use dlock_devstack::stack::Stack;
use dlock_executor::executor::{RunOptions, execute};

use crate::harness::endpoints;

const EXE: &str = env!("CARGO_BIN_EXE_dlock");

/// `rich` pays all three of its payouts; `poor` holds money for one of its two, so the other is
/// refused at the claim (FAILED, a state the run learns only from the refusal, not from an
/// answer carrying the payout's state).
const BATCH: &str = r#"
apiVersion: dlock.io/v1alpha1
kind: PayoutBatch
metadata:
  name: report-truth
spec:
  payouts:
    - key: rich-1
      accountId: rich
      amountMinor: 100
      currency: EUR
      beneficiaryRef: ben-1
    - key: rich-2
      accountId: rich
      amountMinor: 200
      currency: EUR
      beneficiaryRef: ben-2
    - key: rich-3
      accountId: rich
      amountMinor: 300
      currency: EUR
      beneficiaryRef: ben-3
    - key: poor-1
      accountId: poor
      amountMinor: 400
      currency: EUR
      beneficiaryRef: ben-4
    - key: poor-2
      accountId: poor
      amountMinor: 400
      currency: EUR
      beneficiaryRef: ben-5
"#;

/// paydb's own count of the batch's payouts by state.
fn states_in_paydb(stack: &Stack) -> BTreeMap<String, usize> {
    let out = stack
        .pg()
        .psql(
            "paydb",
            "SELECT state || '=' || count(*) FROM payouts GROUP BY state ORDER BY state",
        )
        .unwrap_or_else(|e| panic!("{e:#}"));
    out.lines()
        .filter_map(|l| l.trim().split_once('='))
        .map(|(s, n)| {
            (
                s.to_owned(),
                n.parse().unwrap_or_else(|e| panic!("{n}: {e}")),
            )
        })
        .collect()
}

/// A stack whose payment resource has `accounts` open, each with its funds.
pub async fn stack_with_accounts(name: &str, accounts: &[(String, i64)]) -> Stack {
    let stack = Stack::builder(EXE)
        .operator_token(&format!("{name}-operator-token"))
        .start();
    let client = PaymentClient::new(&stack.payment().url(), name).unwrap_or_else(|e| panic!("{e}"));
    for (account, funds) in accounts {
        open_account(&client, account, Some(*funds)).await;
    }
    stack
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_final_report_says_what_paydb_says_whether_a_state_was_answered_or_read() {
    let stack =
        stack_with_accounts("report", &[("rich".into(), 10_000), ("poor".into(), 500)]).await;
    let batch = dlock_executor::manifest::parse(BATCH).unwrap_or_else(|e| panic!("{e}"));
    let endpoints = endpoints(&stack);
    let options = RunOptions {
        workers: 2,
        settle_timeout: Duration::from_secs(30),
        ..RunOptions::default()
    };

    // First run: four payouts end on an answer (three posts, one refused claim), so the report
    // mixes states the run remembered with one it read again.
    let first = execute(&batch, &endpoints, options.clone())
        .await
        .unwrap_or_else(|e| panic!("{e:#}"));
    let truth = states_in_paydb(&stack);
    assert_eq!(
        truth,
        BTreeMap::from([("FAILED".to_owned(), 1), ("POSTED".to_owned(), 4)]),
        "paydb: the poor account pays one of its two payouts"
    );
    assert!(first.complete, "{first:?}");
    assert_eq!(first.states, truth, "the first run's report");

    // Second run of the same file: every payout is settled already, so each cycle's re-read
    // finds a terminal state and the report is built from those answers alone.
    let second = execute(&batch, &endpoints, options)
        .await
        .unwrap_or_else(|e| panic!("{e:#}"));
    assert!(second.complete, "{second:?}");
    assert_eq!(second.states, truth, "the second run's report");
    assert_eq!(states_in_paydb(&stack), truth, "a second run pays nothing");
}
