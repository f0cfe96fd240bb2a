//! The chaos suite: the whole payout path as real processes — lock server, payment resource,
//! rail stub, rail proxy and `dlock run` executors — started and torn down here, with faults
//! injected while batches run. Every scenario ends with one shared invariant checker and prints
//! its figures.

mod faults;
mod fencing;
mod long;

use std::collections::HashMap;
use std::ops::{Deref, DerefMut};
use std::path::{Path, PathBuf};
use std::time::Duration;

use dlock_contract::client::LockClient;
use dlock_contract::payment::{CreatePayoutRequest, PayoutState};
use dlock_contract::payment_client::{Fence, PaymentClient};
use dlock_contract::rail::{RailClient, SubmissionRequest, read_statement};
use dlock_devstack::stack::{LockBackend, Role, Stack, StackBuilder};
use dlock_devstack::{ManagedChild, Signal};
use dlock_executor::manifest::{idempotency_key, payout_id};

use uuid::Uuid;

use crate::harness::{Backend, assert_fenced_out, eventually, eventually_or, stale_post_is_fenced};
use crate::shared::accounts::open_account;

pub(crate) const OPERATOR_TOKEN: &str = "chaos-operator-token";
pub(crate) const EXE: &str = env!("CARGO_BIN_EXE_dlock");

/// One scenario's figures row (shared with the netfault suite).
#[derive(Debug, Default)]
pub(crate) struct Figures {
    pub(crate) scenario: &'static str,
    pub(crate) payouts: usize,
    pub(crate) faults: usize,
    pub(crate) fenced_out: usize,
    pub(crate) ambiguous: usize,
    pub(crate) double_payments: usize,
    pub(crate) lost: usize,
}

impl Figures {
    /// Asserts that the scenario left some payouts RAIL_AMBIGUOUS; `why` says why it must have.
    pub(crate) fn left_ambiguous(&self, why: &str) {
        assert!(self.ambiguous > 0, "{why}");
    }

    pub(crate) fn print(&self) {
        println!(
            "| {:<34} | {:>7} | {:>6} | {:>10} | {:>9} | {:>15} | {:>12} |",
            self.scenario,
            self.payouts,
            self.faults,
            self.fenced_out,
            self.ambiguous,
            self.double_payments,
            self.lost
        );
    }
}

/// The stack of the fault suites (chaos, netfault, etcd leader, monitoring): all four services
/// as processes, the rail as given, and a rail proxy that sweeps its unresolved submissions
/// quickly (every 200 ms, 500 ms past the read timeout).
pub(crate) fn fault_stack(
    backend: Backend,
    rail: &[(&str, &str)],
    read_timeout_ms: u64,
) -> StackBuilder {
    Stack::builder(EXE)
        .lock_backend(match backend {
            Backend::Pg => LockBackend::Pg,
            Backend::Etcd => LockBackend::Etcd,
        })
        .rail_stub(rail)
        .rail_read_timeout_ms(read_timeout_ms)
        .operator_token(OPERATOR_TOKEN)
        .set(Role::RailProxy, "rail.proxy.unresolved-margin-ms", "500")
        .set(Role::RailProxy, "rail.proxy.sweep-interval-ms", "200")
}

/// A started fault stack and what the scenarios do with it.
pub(crate) struct Chaos(pub(crate) Stack);

impl Deref for Chaos {
    type Target = Stack;
    fn deref(&self) -> &Stack {
        &self.0
    }
}

impl DerefMut for Chaos {
    fn deref_mut(&mut self) -> &mut Stack {
        &mut self.0
    }
}

impl Chaos {
    pub(crate) fn start(backend: Backend, rail: &[(&str, &str)], read_timeout_ms: u64) -> Self {
        Self::start_on(backend, None, rail, read_timeout_ms)
    }

    /// Like [`Chaos::start`], the lock server configured by `lock_pairs` when given (an etcd
    /// cluster the test runs itself, say) instead of a backend started here.
    pub(crate) fn start_on(
        backend: Backend,
        lock_pairs: Option<Vec<(&'static str, String)>>,
        rail: &[(&str, &str)],
        read_timeout_ms: u64,
    ) -> Self {
        let mut builder = fault_stack(backend, rail, read_timeout_ms)
            .executor_args(&["--settle-timeout-s", "120"]);
        if let Some(pairs) = lock_pairs {
            builder = builder.lock_backend(LockBackend::Config(pairs));
        }
        Self(builder.start())
    }

    pub(crate) fn payment_client(&self) -> PaymentClient {
        PaymentClient::new(&self.payment().url(), "chaos").unwrap_or_else(|e| panic!("{e}"))
    }

    /// Opens accounts `{prefix}-00`… and funds each with `funds`.
    pub(crate) async fn accounts(&self, prefix: &str, n: usize, funds: i64) {
        let payment = self.payment_client();
        for i in 0..n {
            open_account(&payment, &format!("{prefix}-{i:02}"), Some(funds)).await;
        }
    }

    /// Opens `accounts` accounts `{prefix}-00`… funded with 10 000 000 each and writes the batch
    /// `{prefix}-batch` of `n` payouts over them.
    pub(crate) async fn funded_batch(&self, prefix: &str, accounts: usize, n: usize) -> PathBuf {
        self.accounts(prefix, accounts, 10_000_000).await;
        self.batch(&format!("{prefix}-batch"), prefix, accounts, n)
    }

    /// Two executors on `batch`, `executor-{prefix}-a` and `executor-{prefix}-b`, competing for
    /// its accounts.
    pub(crate) fn two_executors(&self, batch: &Path, prefix: &str) -> [(ManagedChild, PathBuf); 2] {
        ["a", "b"].map(|run| self.executor(batch, &format!("executor-{prefix}-{run}"), &[]))
    }

    /// Waits for executors that must all succeed, in turn; how many fenced-out events they
    /// reported.
    pub(crate) fn finish_all(
        &self,
        executors: impl IntoIterator<Item = (ManagedChild, PathBuf)>,
    ) -> usize {
        executors
            .into_iter()
            .map(|(executor, log)| self.finish(executor, &log))
            .sum()
    }

    /// Waits up to `within` for an executor; its success and the fenced-out events it reported.
    pub(crate) fn wait(
        &self,
        executor: ManagedChild,
        log: &Path,
        within: Duration,
    ) -> (bool, usize) {
        let (ok, text) = self.wait_executor(executor, log, within);
        (ok, fenced_out_in(&text))
    }

    /// Waits for an executor that must succeed; how many fenced-out events it reported.
    pub(crate) fn finish(&self, executor: ManagedChild, log: &Path) -> usize {
        let (ok, fenced) = self.wait(executor, log, Duration::from_secs(180));
        assert!(
            ok,
            "executor failed:\n{}",
            std::fs::read_to_string(log).unwrap_or_default()
        );
        fenced
    }

    /// How many transfers the rail's statement holds.
    pub(crate) async fn transfers(&self) -> usize {
        read_statement(&self.stub().url(), None)
            .await
            .map(|s| s.transfers.len())
            .unwrap_or_else(|e| panic!("reading the rail statement: {e}"))
    }

    pub(crate) async fn posted_count(&self) -> usize {
        self.posted()
    }

    /// Waits up to `timeout` until `at_least` payouts are posted; `what` names the wait. If they
    /// are not, the failure shows the payouts by state and the end of every log of the stack
    /// (the services' and the executors').
    pub(crate) async fn progressed(&self, what: &str, at_least: usize, timeout: Duration) {
        eventually_or(
            what,
            timeout,
            || async { (self.posted() >= at_least).then_some(()) },
            || self.stalled(),
        )
        .await;
    }

    /// The payouts by state and the last lines of each log in the stack's directory.
    fn stalled(&self) -> String {
        let states = self
            .pg()
            .psql(
                "paydb",
                "SELECT string_agg(state || ' ' || n, ', ') FROM \
                 (SELECT state, count(*) AS n FROM payouts GROUP BY state ORDER BY state) s",
            )
            .unwrap_or_else(|e| format!("(paydb unreadable: {e:#})"));
        let mut out = format!("\npayouts by state: {states}");
        let mut logs: Vec<_> = std::fs::read_dir(self.dir().join("logs"))
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.extension().is_some_and(|x| x == "log"))
            .collect();
        logs.sort();
        for log in logs {
            let text = std::fs::read_to_string(&log).unwrap_or_default();
            let lines: Vec<&str> = text.lines().collect();
            let tail = lines[lines.len().saturating_sub(15)..].join("\n");
            out.push_str(&format!("\n--- the end of {}:\n{tail}", log.display()));
        }
        out
    }

    /// What the invariant checker reads.
    pub(crate) fn checked(&self) -> CheckedStack {
        CheckedStack {
            payment_url: self.payment().url(),
            stub_url: self.stub().url(),
            paydb_url: self.pg().url("paydb"),
            read_timeout_ms: self.read_timeout_ms(),
        }
    }

    /// The shared invariant checker over the batch `{prefix}-batch` of `payouts`; its figures row
    /// is printed under the table's header.
    pub(crate) async fn check(
        &self,
        scenario: &'static str,
        (prefix, payouts): (&str, usize),
        faults: usize,
        fenced_out: usize,
    ) -> Figures {
        header();
        let batch = format!("{prefix}-batch");
        check_invariants(
            &self.checked(),
            scenario,
            &batch,
            payouts,
            faults,
            fenced_out,
        )
        .await
    }
}

/// How many fenced-out events an executor's log reports (its final table's line).
pub(crate) fn fenced_out_in(text: &str) -> usize {
    text.lines()
        .find_map(|l| {
            l.split(" fenced out")
                .next()
                .filter(|_| l.contains(" fenced out"))?
                .rsplit(' ')
                .next()?
                .parse()
                .ok()
        })
        .unwrap_or(0)
}

/// What the invariant checker reads: the payment resource, the rail stub's statement and paydb.
pub(crate) struct CheckedStack {
    pub(crate) payment_url: String,
    pub(crate) stub_url: String,
    pub(crate) paydb_url: String,
    pub(crate) read_timeout_ms: u64,
}

/// The shared invariant checker: at most one transfer per payout on the rail statement, every
/// payout terminal or RAIL_AMBIGUOUS, no critical reconciler finding (ledger = balance, …), every
/// RAIL_AMBIGUOUS payout classified. Prints the figures row and asserts.
pub(crate) async fn check_invariants(
    stack: &CheckedStack,
    scenario: &'static str,
    batch: &str,
    payouts: usize,
    faults: usize,
    fenced_out: usize,
) -> Figures {
    let payment = PaymentClient::new(&stack.payment_url, "chaos").unwrap_or_else(|e| panic!("{e}"));
    let statement = read_statement(&stack.stub_url, None)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let mut on_rail: HashMap<String, usize> = HashMap::new();
    for t in &statement.transfers {
        *on_rail.entry(t.client_ref.clone()).or_default() += 1;
    }
    let mut figures = Figures {
        scenario,
        faults,
        fenced_out,
        ..Figures::default()
    };
    for i in 0..payouts {
        let id = payout_id(batch, &format!("item-{i:04}"));
        figures.payouts += 1;
        let payout = payment.get_payout(id).await;
        match payout.map(|p| p.state) {
            Ok(s) if s.is_terminal() || s == PayoutState::RailAmbiguous => {
                if s == PayoutState::RailAmbiguous {
                    figures.ambiguous += 1;
                }
            }
            other => {
                figures.lost += 1;
                eprintln!("{scenario}: payout {id} not settled: {other:?}");
            }
        }
        if on_rail.get(&id.to_string()).copied().unwrap_or(0) > 1 {
            figures.double_payments += 1;
        }
    }
    let pool = dlock_executor::reconcile::connect(&stack.paydb_url)
        .await
        .unwrap_or_else(|e| panic!("{e:#}"));
    let findings = dlock_executor::reconcile::reconcile(
        &pool,
        &stack.stub_url,
        Duration::from_millis(stack.read_timeout_ms + 2_000),
    )
    .await
    .unwrap_or_else(|e| panic!("{e:#}"));
    figures.print();
    assert_eq!(
        figures.double_payments, 0,
        "{scenario}: a payout was paid twice"
    );
    assert_eq!(
        findings.statement.double_payments, 0,
        "{scenario}: the rail statement holds a double payment"
    );
    assert_eq!(figures.lost, 0, "{scenario}: payouts did not settle");
    assert!(
        !findings.critical(),
        "{scenario}: critical findings:\n{}",
        findings.table()
    );
    let (ambiguous_total,): (i64,) =
        sqlx::query_as("SELECT count(*) FROM payouts WHERE state = 'RAIL_AMBIGUOUS'")
            .fetch_one(&pool)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        (findings.statement.ambiguous_found_on_rail + findings.statement.ambiguous_not_on_rail)
            as i64,
        ambiguous_total,
        "{scenario}: every RAIL_AMBIGUOUS payout is classified"
    );
    figures
}

/// The figures table's header row.
fn header() {
    println!(
        "| scenario                           | payouts | faults | fenced out | ambiguous | double payments | lost payouts |"
    );
}

/// A worker that acquires and claims, then "pauses": the test drives its steps by hand.
pub(crate) struct ScriptedHolder {
    lock: LockClient,
    payment: PaymentClient,
    rail: RailClient,
    session: Uuid,
    token: i64,
}

impl ScriptedHolder {
    pub(crate) async fn claim(chaos: &Chaos, account: &str, payout: Uuid, ttl_ms: i64) -> Self {
        let lock =
            LockClient::new(&chaos.lock().url(), "paused-holder").unwrap_or_else(|e| panic!("{e}"));
        let payment = PaymentClient::new(&chaos.payment().url(), "paused-holder")
            .unwrap_or_else(|e| panic!("{e}"));
        let rail = RailClient::new(
            &chaos.proxy().url(),
            "paused-holder",
            Duration::from_millis(chaos.read_timeout_ms()),
        )
        .unwrap_or_else(|e| panic!("{e}"));
        let session = lock
            .create_session(Some(ttl_ms))
            .await
            .unwrap_or_else(|e| panic!("{e}"))
            .session_id;
        let grant = lock
            .acquire(
                &format!("payout:{account}"),
                session,
                Some(ttl_ms),
                Some(5_000),
            )
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        payment
            .claim(
                payout,
                Fence::new(&idempotency_key(payout), grant.fencing_token, None),
                PayoutState::Pending,
            )
            .await
            .unwrap_or_else(|e| panic!("the holder's claim: {e}"));
        Self {
            lock,
            payment,
            rail,
            session,
            token: grant.fencing_token,
        }
    }

    /// The holder wakes up and carries on with its old token: every write must be fenced.
    pub(crate) async fn resume(&self, account: &str, payout: Uuid, amount: i64) -> usize {
        let key = idempotency_key(payout);
        let body = SubmissionRequest {
            payout_id: payout,
            account_id: account.into(),
            amount_minor: amount,
            currency: "EUR".into(),
            beneficiary_ref: "ben-0".into(),
        };
        let submit = self.rail.submit(self.token, &key, &body).await;
        assert_fenced_out(submit, "the stale submit is fenced at the rail");
        stale_post_is_fenced(
            &self.payment,
            payout,
            self.token,
            "the stale post is fenced at the account",
        )
        .await;
        let _ = self.lock.end_session(self.session).await;
        2
    }
}

pub(crate) async fn register_one(chaos: &Chaos, batch: &str, account: &str, amount: i64) -> Uuid {
    let id = payout_id(batch, "item-0000");
    let body = CreatePayoutRequest {
        payout_id: id,
        account_id: account.into(),
        amount_minor: amount,
        currency: "EUR".into(),
        beneficiary_ref: "ben-0".into(),
    };
    chaos
        .payment_client()
        .create_payout(&format!("register-{id}"), &body)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    id
}
