//! What `dlock run` does with its registration.
//!
//! What the executor reads before it claims. A payout the run registered afresh was PENDING when
//! the payment resource answered its registration, so its first cycle claims it without reading
//! it first: the claim is conditional on PENDING and is refused if anyone moved it since. A
//! payout whose registration was a replay (the same file run again) is read first, as every
//! later cycle is. The payment resource counts its payout reads (`payment_batch_size_sum`,
//! kind `read`), and the run goes through real services.
//!
//! Without registration (`dlock run --no-register`, as the operator's Job runs), a run knows
//! nothing of its payouts, and a batch's payouts are PENDING until it runs: each payout's first
//! cycle claims it as PENDING without reading it, and reads it only when that claim is refused,
//! then goes on under the same grant (a settled payout is left, a RAIL_ACKED one posted).
//!
//! When the payouts are paid. The run registers account by account and hands an account to the
//! workers as soon as its payouts are registered, so the first payouts are posted while the
//! last are still being registered; paydb's timestamps show it.

use std::time::Duration;

use crate::executor_report::stack_with_accounts;
use crate::harness::{endpoints, metric, metrics_of};
use crate::shared::payouts::{Item, batch_manifest};
use dlock_contract::client::LockClient;
use dlock_contract::payment::PayoutState;
use dlock_contract::payment_client::{Fence, PaymentClient};
use dlock_contract::payout_batch::PlannedPayout;
use dlock_contract::rail::RailClient;
use dlock_contract::session::LockSession;
use dlock_devstack::faultproxy::{AfterMatch, FaultProxy};
use dlock_devstack::stack::Stack;
use dlock_executor::executor::{Report, RunOptions, execute, register};
use dlock_executor::manifest::PayoutBatch;

/// A batch named `name` of `per_account` payouts on each of `accounts` (amounts from `base`): the
/// payout `n` (from 1) of account `a` has the key `a-n`.
fn batch(name: &str, accounts: &[&str], per_account: usize, base: i64) -> PayoutBatch {
    let items = accounts.iter().flat_map(|account| {
        (1..=per_account).map(move |n| Item::numbered(n, format!("{account}-{n}"), account, base))
    });
    let yaml = batch_manifest(name, 1, items);
    dlock_executor::manifest::parse(&yaml).unwrap_or_else(|e| panic!("{e}"))
}

/// The payout reads (P4) the payment resource has served so far.
async fn payout_reads(stack: &Stack) -> f64 {
    let text = metrics_of(&stack.payment().url()).await;
    metric(&text, "payment_batch_size_sum{kind=\"read\"}")
}

/// Runs `batch` to the end: its report, and how many payout reads the payment resource served
/// meanwhile.
async fn run_counting_reads(
    stack: &Stack,
    batch: &PayoutBatch,
    options: &RunOptions,
) -> (Report, f64) {
    let before = payout_reads(stack).await;
    let report = execute(batch, &endpoints(stack), options.clone())
        .await
        .unwrap_or_else(|e| panic!("{e:#}"));
    assert!(report.complete, "{report:?}");
    (report, payout_reads(stack).await - before)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_payout_registered_afresh_is_claimed_without_a_read_and_a_replayed_one_is_read() {
    let accounts = ["reads-a", "reads-b", "reads-c"].map(|a| (a.to_owned(), 1_000));
    let stack = stack_with_accounts("reads", &accounts).await;
    // Six payouts over three accounts, each with the money for both of its payouts.
    let batch = batch(
        "first-cycle-reads",
        &["reads-a", "reads-b", "reads-c"],
        2,
        100,
    );
    let options = RunOptions {
        workers: 3,
        settle_timeout: Duration::from_secs(30),
        ..RunOptions::default()
    };

    for (reads_expected, why) in [
        // First run: every payout is registered afresh and settles in its first cycle (one
        // worker per account, nobody else moves them), and its post answers POSTED, which the
        // final report keeps. So the run reads none of them.
        (0.0, "payouts registered afresh are claimed without a read"),
        // Second run of the same file (the positive control): every registration is a replay,
        // which says what the payout was, not what it is, so each cycle reads the payout first
        // and finds it POSTED. The count of the first run would have seen these reads.
        (
            6.0,
            "a replayed registration is read before its cycle does anything",
        ),
    ] {
        let (report, reads) = run_counting_reads(&stack, &batch, &options).await;
        assert_eq!(report.states.get("POSTED"), Some(&6), "{report:?}");
        assert_eq!(report.cycles, 6, "one cycle per payout: {report:?}");
        assert_eq!(reads, reads_expected, "{why}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_first_accounts_are_paid_while_the_last_are_still_being_registered() {
    const ACCOUNTS: usize = 10;
    const PER_ACCOUNT: usize = 60;
    let accounts: Vec<(String, i64)> = (0..ACCOUNTS)
        .map(|a| (format!("overlap-{a}"), 1_000_000))
        .collect();
    let stack = stack_with_accounts("overlap", &accounts).await;
    let names: Vec<&str> = accounts.iter().map(|(a, _)| a.as_str()).collect();
    let batch = batch("overlap", &names, PER_ACCOUNT, 10);
    let options = RunOptions {
        workers: ACCOUNTS,
        settle_timeout: Duration::from_secs(120),
        ..RunOptions::default()
    };
    let report = execute(&batch, &endpoints(&stack), options)
        .await
        .unwrap_or_else(|e| panic!("{e:#}"));
    assert!(report.complete, "{report:?}");
    assert_eq!(
        report.states.get("POSTED"),
        Some(&(ACCOUNTS * PER_ACCOUNT)),
        "{report:?}"
    );
    // A POSTED payout's updated_at is when it was posted (POSTED is terminal); created_at is
    // when it was registered. Registered first and paid after, the first post would come after
    // the last registration.
    let order = stack
        .pg()
        .psql(
            "paydb",
            "SELECT (SELECT min(updated_at) FROM payouts WHERE state = 'POSTED') \
                    < (SELECT max(created_at) FROM payouts)",
        )
        .unwrap_or_else(|e| panic!("{e:#}"));
    assert_eq!(
        order.trim(),
        "t",
        "the first payout was posted before the last one was registered"
    );
}

/// Takes `planned` to RAIL_ACKED by hand, as an executor that stopped after the rail's answer
/// leaves it: a grant on its account's key, the claim, the rail submission, the release.
async fn leave_rail_acked(stack: &Stack, planned: &PlannedPayout) {
    let lock = LockClient::new(&stack.lock().url(), "by-hand").unwrap_or_else(|e| panic!("{e}"));
    let payment =
        PaymentClient::new(&stack.payment().url(), "by-hand").unwrap_or_else(|e| panic!("{e}"));
    let rail = RailClient::new(&stack.proxy().url(), "by-hand", Duration::from_secs(8))
        .unwrap_or_else(|e| panic!("{e}"));
    let session = LockSession::open(lock.clone(), 30_000)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let key = format!("payout:{}", planned.item.account_id);
    let held = session
        .acquire(&lock, &key, 10_000, None, 0.3)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let fence = Fence::new(&planned.idempotency_key, held.token(), held.proof());
    payment
        .claim(planned.payout_id, fence, PayoutState::Pending)
        .await
        .unwrap_or_else(|e| panic!("claim: {e}"));
    let body = planned.submission();
    rail.submit_proven(held.token(), held.proof(), &planned.idempotency_key, &body)
        .await
        .unwrap_or_else(|e| panic!("rail submission: {e}"));
    held.release(&lock)
        .await
        .unwrap_or_else(|e| panic!("release: {e}"));
    let payout = payment
        .get_payout(planned.payout_id)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(payout.state, PayoutState::RailAcked, "{payout:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_registration_a_run_claims_first_and_reads_only_a_payout_the_claim_refuses() {
    let accounts = ["first-a", "first-b"].map(|a| (a.to_owned(), 1_000));
    let stack = stack_with_accounts("claims-first", &accounts).await;
    // Four payouts over two accounts.
    let batch = batch("claims-first", &["first-a", "first-b"], 2, 100);
    let plan = batch.plan();
    let registrar =
        PaymentClient::new(&stack.payment().url(), "registrar").unwrap_or_else(|e| panic!("{e}"));
    register(&batch, &registrar)
        .await
        .unwrap_or_else(|e| panic!("{e:#}"));
    let options = RunOptions {
        workers: 2,
        register: false,
        settle_timeout: Duration::from_secs(30),
        ..RunOptions::default()
    };

    // first-a-1 is paid by a run of its own (the same batch name, so the same payout), which
    // claims it without a read: a run without registration knows nothing of its payouts, and
    // a batch's payouts are PENDING until it runs.
    let mut only_a1 = batch.clone();
    only_a1.spec.payouts.retain(|p| p.key == "first-a-1");
    let (first, reads) = run_counting_reads(&stack, &only_a1, &options).await;
    assert_eq!(first.states.get("POSTED"), Some(&1), "{first:?}");
    assert_eq!(reads, 0.0, "a PENDING payout is claimed without a read");

    // first-b-1 is left RAIL_ACKED, as by an executor that stopped after the rail's answer.
    let b1 = plan
        .iter()
        .find(|p| p.item.key == "first-b-1")
        .unwrap_or_else(|| panic!("first-b-1 is in the batch"));
    leave_rail_acked(&stack, b1).await;

    // The whole batch: first-a-2 and first-b-2 are claimed without a read; first-a-1 (POSTED)
    // and first-b-1 (RAIL_ACKED) refuse the claim as PENDING and are read then (the positive
    // control of the count above), under the same grant: first-a-1 is settled and first-b-1
    // posted in that one cycle, without a second rail submission.
    let (run, reads) = run_counting_reads(&stack, &batch, &options).await;
    assert_eq!(run.states.get("POSTED"), Some(&4), "{run:?}");
    assert_eq!(run.cycles, 4, "one cycle per payout: {run:?}");
    assert_eq!(
        reads, 2.0,
        "only the two payouts whose claim was refused are read"
    );
    let submissions = stack
        .pg()
        .psql(
            "paydb",
            &format!(
                "SELECT count(*) FROM rail_submission WHERE payout_id = '{}'",
                b1.payout_id
            ),
        )
        .unwrap_or_else(|e| panic!("{e:#}"));
    assert_eq!(
        submissions.trim(),
        "1",
        "first-b-1 went to the rail once, before the run"
    );
}

/// A registration whose answer was lost on its way back is sent again under its key, and the run
/// goes on: the payment resource had registered the payout, and the identical request replays
/// that answer. A fault proxy between the run and the payment resource lets the first
/// registration through and cuts its answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_registration_whose_answer_was_lost_is_sent_again_and_the_run_pays() {
    let accounts = ["lost-a", "lost-b"].map(|a| (a.to_owned(), 1_000));
    let stack = stack_with_accounts("lost", &accounts).await;
    let payment = stack.payment().url();
    let port: u16 = payment
        .rsplit(':')
        .next()
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(|| panic!("no port in {payment}"));
    let proxy = FaultProxy::start(([127, 0, 0, 1], 0).into(), ([127, 0, 0, 1], port).into())
        .unwrap_or_else(|e| panic!("fault proxy: {e:#}"));
    // Registrations are `POST /v1/payouts`; claims and posts go to longer paths.
    proxy.after_request(b"POST /v1/payouts HTTP", 0, AfterMatch::CutAnswer);
    let mut through = endpoints(&stack);
    through.payment_resource = proxy.url();
    let batch = batch("lost-answer", &["lost-a", "lost-b"], 2, 100);
    let options = RunOptions {
        workers: 2,
        settle_timeout: Duration::from_secs(30),
        ..RunOptions::default()
    };

    let report = execute(&batch, &through, options)
        .await
        .unwrap_or_else(|e| panic!("the run stopped: {e:#}"));
    // The cut happened (so the run did meet a lost answer) ...
    assert_eq!(proxy.fired(), 1, "the first registration's answer was cut");
    // ... and every payout was registered once and paid once.
    assert!(report.complete, "{report:?}");
    assert_eq!(report.states.get("POSTED"), Some(&4), "{report:?}");
    let payouts: Vec<_> = batch.plan().iter().map(|p| p.payout_id).collect();
    let client =
        PaymentClient::new(&stack.payment().url(), "lost").unwrap_or_else(|e| panic!("{e}"));
    for payout in payouts {
        let read = client
            .get_payout(payout)
            .await
            .unwrap_or_else(|e| panic!("{payout}: {e}"));
        assert_eq!(read.state, PayoutState::Posted, "{payout}");
    }
}
