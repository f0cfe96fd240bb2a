//! The executor: moves a batch's payouts through acquire → claim → submit → post → release.
//!
//! The rules it keeps (docs/design.md#executor, docs/contract.md#s3-7, docs/contract.md#s3-8):
//! - one lock per payout cycle, on `payout:{accountId}`, and a fresh token per payout;
//! - a local deadline on the monotonic clock, TTL × (1 − safety margin) from sending the
//!   acquire: no protected write starts after it;
//! - the payout is re-read after every acquire, and the state decides what to do: a RAIL_ACKED
//!   payout is posted, never submitted again. The one exception is a payout's first cycle of the
//!   run (with registration, of a payout this run registered afresh): it claims the payout as
//!   PENDING without reading it, and when the claim, which is conditional on PENDING, is refused,
//!   reads it then;
//! - the release is not waited for: the account's next cycle waits for it instead;
//! - submit is tried exactly once, ever; FENCED_OUT aborts the whole critical section; an
//!   ambiguous outcome is reported, the lock released and the payout left alone.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use backon::Retryable;
use dlock_contract::ErrorCode;
use dlock_contract::client::{ClientError, LockClient};
use dlock_contract::payment::{Payout, PayoutState};
use dlock_contract::payment_client::{Fence, PaymentClient};
use dlock_contract::rail::RailClient;
use dlock_contract::session::{HeldLock, LockSession, retry_policy};
use futures::StreamExt;
use tokio::sync::{Mutex, Notify};
use tokio::task::JoinHandle;
use uuid::Uuid;

use crate::manifest::{PayoutBatch, PlannedPayout};

mod options;
mod outcome;
mod report;

pub use options::{
    Endpoints, RunOptions, default_owner_id, lock_ttl_ms_for, owner_id_for, session_ttl_ms_for,
};
pub use outcome::CycleOutcome;
use outcome::{Step, outcome_of};
pub use report::Report;

/// The clients of one payout's trace.
struct Hops {
    lock: LockClient,
    payment: PaymentClient,
    rail: RailClient,
}

struct Shared {
    options: RunOptions,
    session: LockSession,
    lock: LockClient,
    payment: PaymentClient,
    rail: RailClient,
    queue: Mutex<VecDeque<(String, Vec<PlannedPayout>)>>,
    wake: Notify,
    settled: AtomicUsize,
    fenced: AtomicUsize,
    cycles: AtomicUsize,
    outcomes: Mutex<BTreeMap<String, usize>>,
    /// The terminal state the payment resource answered for a payout during this run (a GET
    /// that found it settled, or the post's answer). A terminal state has no way out, so the
    /// final report reads again only the payouts missing here.
    terminal: std::sync::Mutex<HashMap<Uuid, PayoutState>>,
    total: usize,
    /// Cycles refused with RECOVERY_REQUIRED since the last one that was not: the back-off's
    /// exponent, shared by every worker (paydb refuses them all alike).
    recovery_streak: AtomicU32,
    /// The payouts whose last cycle paydb refused with RECOVERY_REQUIRED.
    recovery_refused: std::sync::Mutex<BTreeSet<Uuid>>,
    /// The payouts whose first cycle of this run is still to come, and claims them as PENDING
    /// without reading them first: with `--no-register` every payout of the batch, else those
    /// this run registered afresh (not a replay: PENDING when they were registered).
    unread: std::sync::Mutex<HashSet<Uuid>>,
    /// Each account's last release, under way: the account's next cycle waits for it, and the
    /// run waits for all of them before it closes its session.
    releases: std::sync::Mutex<HashMap<String, JoinHandle<()>>>,
    /// The run is stopping before its payouts settled (its registration failed).
    stopping: AtomicBool,
}

impl Shared {
    /// Remembers a state the payment resource answered, when it is terminal.
    fn saw(&self, payout_id: Uuid, state: PayoutState) {
        if state.is_terminal() {
            self.terminal
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .insert(payout_id, state);
        }
    }

    /// Notes how a payout's cycle ended for the RECOVERY_REQUIRED back-off and report; the
    /// first refusal of a streak is logged as an error naming what the operator does.
    fn recovery(&self, payout: Uuid, outcome: CycleOutcome) {
        let mut refused = self
            .recovery_refused
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if outcome != CycleOutcome::RecoveryRequired {
            refused.remove(&payout);
            if outcome == CycleOutcome::Settled {
                self.recovery_streak.store(0, Ordering::SeqCst);
            }
            return;
        }
        refused.insert(payout);
        if self.recovery_streak.fetch_add(1, Ordering::SeqCst) == 0 {
            tracing::error!(
                event = "paydb_recovery_required",
                payout_id = %payout,
                "paydb refuses every write (503 RECOVERY_REQUIRED): it may have lost writes in a \
                 failover. Nothing was written; the run backs off and retries until its settle \
                 timeout. An operator runs dlock reconcile, then dlock recover paydb-epoch \
                 (docs/runbook.md)"
            );
        }
    }

    /// Whether this is `payout`'s first cycle of the run, and it is to claim without reading.
    fn first_cycle_unread(&self, payout: Uuid) -> bool {
        self.unread
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .remove(&payout)
    }

    /// Waits for `account`'s last release, if one is under way.
    async fn released(&self, account: &str) {
        let release = self
            .releases
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .remove(account);
        if let Some(release) = release {
            let _ = release.await;
        }
    }

    /// Waits for every release under way.
    async fn all_released(&self) {
        let releases: Vec<JoinHandle<()>> = self
            .releases
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .drain()
            .map(|(_, release)| release)
            .collect();
        for release in releases {
            let _ = release.await;
        }
    }

    fn hops(&self, payout: Uuid) -> Hops {
        // One payout is one trace, across every cycle and every process.
        let trace = payout.simple().to_string();
        Hops {
            lock: self.lock.in_trace(&trace),
            payment: self.payment.in_trace(&trace),
            rail: self.rail.in_trace(&trace),
        }
    }
}

/// How many payouts are registered at once: the payment resource's default pool
/// (`payment.pg.pool-max`), so that each create has a connection and its commit shares
/// PostgreSQL's WAL flush with the others'.
const REGISTER_IN_FLIGHT: usize = 32;

/// Registers the batch's payouts (idempotently: the same file twice registers nothing new).
pub async fn register(batch: &PayoutBatch, payment: &PaymentClient) -> Result<()> {
    let results: Vec<Result<(Uuid, bool)>> = futures::stream::iter(
        batch
            .plan()
            .into_iter()
            .map(|p| register_one(payment.clone(), p)),
    )
    .buffer_unordered(REGISTER_IN_FLIGHT)
    .collect()
    .await;
    results.into_iter().collect::<Result<Vec<_>>>()?;
    Ok(())
}

/// How many times a registration is sent again: with the policy's backoff (50 ms doubling to
/// 1 s), about 5 s, long enough for a payment resource to restart.
const REGISTER_RETRIES: usize = 8;

/// Registers one payout, retried while that is safe: its id, and whether this call registered
/// it (a fresh answer, not the replay of an earlier registration).
async fn register_one(payment: PaymentClient, p: PlannedPayout) -> Result<(Uuid, bool)> {
    let body = p.registration();
    let key = format!("register-{}", p.payout_id);
    // A registration is idempotent by its key: sent again after its answer was lost, it replays
    // that answer, or registers the payout once if the first never arrived
    // (docs/contract.md#idempotency-rules). So an unknown outcome is retried too.
    // RECOVERY_REQUIRED is retry-safe but lasts until an operator acts: not retried.
    let (payout, replayed) = (|| payment.register_payout(&key, &body))
        .retry(retry_policy(REGISTER_RETRIES))
        .when(|e: &ClientError| {
            e.code() != Some(ErrorCode::RecoveryRequired)
                && (e.retry_safe() || e.outcome_unknown() || e.code() == Some(ErrorCode::NotLeader))
        })
        .await
        .with_context(|| format!("registering payout {} ({})", p.payout_id, p.item.key))?;
    Ok((
        p.payout_id,
        !replayed && payout.state == PayoutState::Pending,
    ))
}

/// Registers the payouts of `accounts` in their order, [`REGISTER_IN_FLIGHT`] at once, and
/// hands each account to the workers as soon as all its payouts are registered: the first
/// accounts are paid while the last are still being registered.
async fn register_into_queue(
    shared: Arc<Shared>,
    payment: PaymentClient,
    accounts: VecDeque<(String, Vec<PlannedPayout>)>,
) -> Result<()> {
    let mut answers = futures::stream::iter(
        accounts
            .iter()
            .flat_map(|(_, payouts)| payouts.iter().cloned())
            .map(|p| register_one(payment.clone(), p))
            .collect::<Vec<_>>(),
    )
    .buffered(REGISTER_IN_FLIGHT);
    for (account, payouts) in accounts {
        for _ in 0..payouts.len() {
            let Some(answer) = answers.next().await else {
                anyhow::bail!("the registration ended before account {account}'s payouts");
            };
            let (payout_id, fresh) = answer?;
            if fresh {
                shared
                    .unread
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .insert(payout_id);
            }
        }
        shared.queue.lock().await.push_back((account, payouts));
        shared.wake.notify_one();
    }
    Ok(())
}

/// Registers the batch (see [`register`], unless `options.register` is off) and runs it until
/// every payout is terminal or RAIL_AMBIGUOUS, or the settle timeout.
///
/// The run has a thread and a single-threaded runtime of its own, whatever runtime calls it. The
/// clients batch a step's requests while the tasks that are ready have their turn
/// (docs/design.md#group-commit): on one thread, the workers that one answer wakes all take
/// their turn before their next step's batch leaves, so they reach it together. On a runtime of
/// several threads the woken workers are spread over the threads, and each thread's share went
/// in a batch of its own: in a new user's run (scripts/run-processes, docs/benchmarks.md) the
/// payment resource's claims and posts came in batches half as large, and every part of the
/// stack spent more CPU per payout. Dropping the returned future stops the run, as it would
/// on the caller's runtime.
pub async fn execute(
    batch: &PayoutBatch,
    endpoints: &Endpoints,
    options: RunOptions,
) -> Result<Report> {
    let (batch, endpoints) = (batch.clone(), endpoints.clone());
    let (report_tx, report_rx) = tokio::sync::oneshot::channel();
    // Dropped with this future: the run stops at its next await.
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let span = tracing::Span::current();
    std::thread::Builder::new()
        .name("dlock-executor".to_owned())
        .spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .context("starting the executor's runtime");
            let report = runtime.and_then(|runtime| {
                runtime.block_on(tracing::Instrument::instrument(
                    async move {
                        tokio::select! {
                            report = run(&batch, &endpoints, options) => report,
                            _ = stop_rx => Err(anyhow::anyhow!("the run was stopped")),
                        }
                    },
                    span,
                ))
            });
            let _ = report_tx.send(report);
        })
        .context("starting the executor's thread")?;
    let report = report_rx
        .await
        .context("the executor's thread ended without a report (it panicked; see the log)")?;
    drop(stop_tx);
    report
}

/// [`execute`]'s run, on the executor's own runtime.
async fn run(batch: &PayoutBatch, endpoints: &Endpoints, options: RunOptions) -> Result<Report> {
    let started = Instant::now();
    let credential = options.credential.clone();
    let lock = LockClient::new(&endpoints.lock_server, &options.owner_id)?
        .with_credential(credential.clone())
        .with_batching(options.batch_max);
    let payment = PaymentClient::new(&endpoints.payment_resource, &options.owner_id)?
        .with_credential(credential.clone());
    let registrar = match &options.registrar {
        Some((owner_id, registrar)) => PaymentClient::new(&endpoints.payment_resource, owner_id)?
            .with_credential(registrar.clone()),
        None => payment.clone(),
    };
    let payment = payment.with_batching(options.batch_max);
    let rail = RailClient::new(
        &endpoints.rail_proxy,
        &options.owner_id,
        options.rail_read_timeout,
    )?
    .with_credential(credential)
    .with_batching(options.batch_max);
    let session = LockSession::open(lock.clone(), options.session_ttl_ms)
        .await
        .context("opening a lock-server session")?;

    // Work is queued per account: a worker takes an account, runs one lock cycle of its next
    // payout and puts it back, so no two workers of a run queue on the same lock. Processes
    // start at different places, so several `dlock run` on one file share the work.
    let mut by_account: BTreeMap<String, Vec<PlannedPayout>> = BTreeMap::new();
    let plan = batch.plan();
    let total = plan.len();
    for p in plan {
        by_account
            .entry(p.item.account_id.clone())
            .or_default()
            .push(p);
    }
    let mut queue: VecDeque<(String, Vec<PlannedPayout>)> = by_account.into_iter().collect();
    let offset = rand::random_range(0..queue.len().max(1));
    queue.rotate_left(offset);
    // With registration, the accounts reach the queue as their payouts are registered.
    let to_register = if options.register {
        Some(std::mem::take(&mut queue))
    } else {
        None
    };
    // Without registration, nothing is known of the payouts: each one's first cycle claims it as
    // PENDING, what a batch's payouts are until it runs.
    let unread: HashSet<Uuid> = if to_register.is_some() {
        HashSet::new()
    } else {
        queue
            .iter()
            .flat_map(|(_, payouts)| payouts.iter().map(|p| p.payout_id))
            .collect()
    };
    let shared = Arc::new(Shared {
        options: options.clone(),
        session,
        lock,
        payment,
        rail,
        queue: Mutex::new(queue),
        wake: Notify::new(),
        settled: AtomicUsize::new(0),
        fenced: AtomicUsize::new(0),
        cycles: AtomicUsize::new(0),
        outcomes: Mutex::new(BTreeMap::new()),
        terminal: std::sync::Mutex::new(HashMap::new()),
        total,
        recovery_streak: AtomicU32::new(0),
        recovery_refused: std::sync::Mutex::new(BTreeSet::new()),
        unread: std::sync::Mutex::new(unread),
        releases: std::sync::Mutex::new(HashMap::new()),
        stopping: AtomicBool::new(false),
    });
    let progress = crate::progress::Progress::start(options.progress, total as u64);
    let mut workers = Vec::new();
    for _ in 0..options.workers.max(1) {
        workers.push(tokio::spawn(worker(shared.clone(), progress.clone())));
    }
    if let Some(accounts) = to_register {
        let registered = register_into_queue(shared.clone(), registrar, accounts).await;
        if let Err(e) = registered {
            // Nothing more can be paid: stop the workers (a cycle under way finishes) and say why.
            shared.stopping.store(true, Ordering::SeqCst);
            shared.wake.notify_waiters();
            for w in workers {
                let _ = w.await;
            }
            shared.all_released().await;
            // Ending the session releases whatever a cut-short cycle left held.
            if let Some(shared) = Arc::into_inner(shared) {
                let _ = shared.session.close().await;
            }
            return Err(e);
        }
    }
    for w in workers {
        w.await.context("a worker task failed")?;
    }
    progress.finish();
    shared.all_released().await;
    let shared = Arc::into_inner(shared).context("a worker outlived the run")?;
    // Ending the session releases whatever a cut-short cycle left held.
    let _ = shared.session.close().await;

    // The final table, from the payment resource's own record.
    let mut report = Report {
        payouts: total,
        fenced_out: shared.fenced.load(Ordering::SeqCst),
        cycles: shared.cycles.load(Ordering::SeqCst),
        outcomes: shared.outcomes.lock().await.clone(),
        ..Report::default()
    };
    let mut complete = true;
    // A payout whose terminal state the resource answered during the run keeps it; every other
    // one is read again, 16 at a time (one by one, the final read of a large batch took longer
    // than paying it).
    let terminal = std::mem::take(
        &mut *shared
            .terminal
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner),
    );
    let read: Vec<Result<PayoutState>> = futures::stream::iter(batch.plan().into_iter().map(|p| {
        let payment = shared.payment.clone();
        let known = terminal.get(&p.payout_id).copied();
        async move {
            if let Some(state) = known {
                return Ok(state);
            }
            (|| payment.get_payout(p.payout_id))
                .retry(retry_policy(2))
                .await
                .map(|payout| payout.state)
                .with_context(|| format!("reading payout {}", p.payout_id))
        }
    }))
    .buffered(16)
    .collect()
    .await;
    let refused = std::mem::take(
        &mut *shared
            .recovery_refused
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner),
    );
    for (p, state) in batch.plan().into_iter().zip(read) {
        let state = state?;
        if refused.contains(&p.payout_id) && !state.is_terminal() {
            report.recovery_required.push(p.payout_id);
        }
        *report.states.entry(state.as_str().to_owned()).or_default() += 1;
        if state == PayoutState::RailAmbiguous {
            report.ambiguous.push(p.payout_id);
        }
        if !(state.is_terminal() || state == PayoutState::RailAmbiguous) {
            complete = false;
        }
    }
    report.complete = complete;
    report.elapsed = started.elapsed();
    Ok(report)
}

async fn worker(shared: Arc<Shared>, progress: crate::progress::Progress) {
    let started = Instant::now();
    let deadline = started + shared.options.settle_timeout;
    loop {
        // Every payout is registered as the run starts, so the oldest unsettled one is as old
        // as the run while any is left.
        let backlog = shared
            .total
            .saturating_sub(shared.settled.load(Ordering::SeqCst));
        shared.options.metrics.backlog(if backlog > 0 {
            started.elapsed()
        } else {
            Duration::ZERO
        });
        if shared.settled.load(Ordering::SeqCst) >= shared.total
            || Instant::now() >= deadline
            || shared.stopping.load(Ordering::SeqCst)
        {
            shared.wake.notify_waiters();
            return;
        }
        let wake = shared.wake.notified();
        let next = shared.queue.lock().await.pop_front();
        let Some((account, payouts)) = next else {
            // Everything left is being worked on by other workers; wait for one to hand back.
            tokio::select! {
                () = wake => {},
                () = tokio::time::sleep(Duration::from_millis(200)) => {},
            }
            continue;
        };
        // One lock cycle of the account's next payout, then the account goes to the back of
        // the queue: every account moves at the same pace, so the end of the run does not wait
        // for a few accounts with many payouts left, each behind one worker.
        let mut left = payouts;
        if left.is_empty() {
            continue;
        }
        let payout = left.remove(0);
        // The account's last release first: its next acquire would find the lock held.
        shared.released(&account).await;
        let (outcome, release) = traced_cycle(&shared, &payout).await;
        if let Some(release) = release {
            shared
                .releases
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .insert(account.clone(), release);
        }
        shared.recovery(payout.payout_id, outcome);
        shared.cycles.fetch_add(1, Ordering::SeqCst);
        shared.options.metrics.executed(outcome.label());
        *shared
            .outcomes
            .lock()
            .await
            .entry(format!("{outcome:?}"))
            .or_default() += 1;
        let mut pause = false;
        match outcome {
            CycleOutcome::Settled | CycleOutcome::Ambiguous => {
                shared.settled.fetch_add(1, Ordering::SeqCst);
                progress.inc();
            }
            // The lock is someone else's: the account's next cycle is this payout's again.
            CycleOutcome::Contended => {
                pause = true;
                left.insert(0, payout);
            }
            CycleOutcome::FencedOut => {
                shared.fenced.fetch_add(1, Ordering::SeqCst);
                left.push(payout);
            }
            CycleOutcome::Pending | CycleOutcome::DeadlinePassed | CycleOutcome::Unavailable => {
                pause = true;
                left.push(payout);
            }
            // paydb waits for an operator (docs/runbook.md): the account's other payouts would
            // be refused alike. Back off, growing with the refusals, never past the settle
            // timeout.
            CycleOutcome::RecoveryRequired => {
                left.insert(0, payout);
                let streak = shared.recovery_streak.load(Ordering::SeqCst);
                let wait = recovery_backoff(streak)
                    .mul_f64(0.75 + rand::random_range(0.0..0.5))
                    .min(deadline.saturating_duration_since(Instant::now()));
                tracing::debug!(event = "recovery_backoff", account = %account, wait_ms = wait.as_millis() as u64, refusals = streak, "paydb refuses writes until its recovery; waiting before the next cycle");
                tokio::time::sleep(wait).await;
            }
        }
        if left.is_empty() {
            continue;
        }
        if pause {
            // Give the other holder, or the in-flight submission, a moment.
            tokio::time::sleep(Duration::from_millis(20 + rand::random_range(0..30))).await;
        }
        shared.queue.lock().await.push_back((account, left));
        shared.wake.notify_one();
    }
}

/// The first wait after paydb refused a cycle with RECOVERY_REQUIRED.
pub(crate) const RECOVERY_BACKOFF_FIRST: Duration = Duration::from_millis(250);
/// The longest: an operator's recovery takes minutes, so a run looks again this often.
pub(crate) const RECOVERY_BACKOFF_MAX: Duration = Duration::from_secs(10);

/// The wait after the `refusals`-th RECOVERY_REQUIRED in a row: doubling from
/// [`RECOVERY_BACKOFF_FIRST`] up to [`RECOVERY_BACKOFF_MAX`].
pub(crate) fn recovery_backoff(refusals: u32) -> Duration {
    let doublings = refusals.saturating_sub(1).min(16);
    RECOVERY_BACKOFF_FIRST
        .saturating_mul(1 << doublings)
        .min(RECOVERY_BACKOFF_MAX)
}

/// One lock cycle inside the payout's trace: a span named for the payout (its id, account,
/// owner, fencing token and outcome as attributes) whose trace id is the payout's own, so every
/// cycle of one payout, in any process, lands in one trace. Returns the cycle's outcome and its
/// release under way, in the same span: the worker goes on to its next account while the release
/// runs, and the account's next cycle waits for it first (see [`Shared::releases`]).
async fn traced_cycle(
    shared: &Shared,
    planned: &PlannedPayout,
) -> (CycleOutcome, Option<JoinHandle<()>>) {
    let trace = dlock_contract::trace::TraceContext {
        trace_id: planned.payout_id.simple().to_string(),
        parent_span_id: None,
    };
    let span = tracing::info_span!(
        "payout cycle",
        otel.kind = "internal",
        payout.id = %planned.payout_id,
        account.id = %planned.item.account_id,
        owner = %shared.options.owner_id,
        fencing.token = tracing::field::Empty,
        outcome = tracing::field::Empty,
    );
    let (outcome, held) = dlock_contract::trace::scope(
        trace.clone(),
        tracing::Instrument::instrument(cycle(shared, planned), span.clone()),
    )
    .await;
    span.record("outcome", format!("{outcome:?}"));
    let release = held.map(|(held, lock)| {
        let release = async move {
            // Release is tried once: if it fails, the lease lapses by itself.
            if let Err(e) = held.release(&lock).await {
                tracing::debug!(event = "release_failed", key = %held.grant.key, token = held.token(), error = %e, "release failed; the lease lapses by itself");
            }
        };
        tokio::spawn(dlock_contract::trace::scope(
            trace,
            tracing::Instrument::instrument(release, span),
        ))
    });
    (outcome, release)
}

/// One lock cycle for one payout: its outcome, and the lock to release with its client (none
/// when the acquire was refused).
async fn cycle(
    shared: &Shared,
    planned: &PlannedPayout,
) -> (CycleOutcome, Option<(HeldLock, LockClient)>) {
    let hops = shared.hops(planned.payout_id);
    let key = format!("payout:{}", planned.item.account_id);
    let held = match shared
        .session
        .acquire(
            &hops.lock,
            &key,
            shared.options.lock_ttl_ms,
            None,
            shared.options.safety_margin,
        )
        .await
    {
        Ok(held) => held,
        Err(e) => return (refused(shared, planned, None, Step::Acquire, &e), None),
    };
    tracing::Span::current().record("fencing.token", held.token());
    let outcome = critical_section(shared, &hops, planned, &held).await;
    (outcome, Some((held, hops.lock)))
}

/// The outcome of a refused step, logged as an operator needs it.
fn refused(
    shared: &Shared,
    planned: &PlannedPayout,
    held: Option<&HeldLock>,
    step: Step,
    e: &ClientError,
) -> CycleOutcome {
    let outcome = outcome_of(step, e);
    let id = planned.payout_id;
    let hop = step.name();
    match outcome {
        CycleOutcome::FencedOut => tracing::error!(
            event = "fenced_out",
            hop,
            payout_id = %id,
            idempotency_key = %planned.idempotency_key,
            token = held.map(HeldLock::token),
            error = %e,
            "a newer holder exists; the critical section is aborted"
        ),
        CycleOutcome::Ambiguous => tracing::warn!(
            event = "rail_ambiguous",
            payout_id = %id,
            idempotency_key = %planned.idempotency_key,
            owner_id = %shared.options.owner_id,
            "the rail's outcome is unknown; the payout is quarantined, releasing and stopping"
        ),
        CycleOutcome::Pending if e.code() == Some(ErrorCode::DuplicateSubmission) => {
            tracing::error!(event = "duplicate_rail_submission_attempted", payout_id = %id, "the proxy already had a submission for this payout")
        }
        CycleOutcome::Unavailable => {
            tracing::debug!(event = "step_failed", hop, payout_id = %id, error = %e, "no verdict; retried in a later cycle")
        }
        _ => {}
    }
    outcome
}

/// How a protected write to the payment resource ended.
enum Write<T> {
    Done(Result<T, ClientError>),
    /// The deadline passed before the write (or its retry) could start: nothing was sent.
    DeadlinePassed,
}

/// A write to the payment resource: no retry on a 409, one on a 503 or a connect failure. No
/// attempt starts past the deadline, the retry included (docs/contract.md#client-deadline): a retry
/// is a protected write.
async fn payment_write<T, F, Fut>(held: &HeldLock, call: F) -> Write<T>
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = Result<T, ClientError>>,
{
    if held.past_deadline() {
        return Write::DeadlinePassed;
    }
    // Not on RECOVERY_REQUIRED: paydb waits for an operator, and the worker backs off instead.
    match call().await {
        Err(e)
            if e.code() == Some(ErrorCode::NotLeader)
                || matches!(e, ClientError::Transport { connect: true, .. }) =>
        {
            tokio::time::sleep(Duration::from_millis(50)).await;
            if held.past_deadline() {
                tracing::debug!(event = "retry_skipped", error = %e, "the local deadline passed; the write is not retried under this grant");
                return Write::DeadlinePassed;
            }
            Write::Done(call().await)
        }
        other => Write::Done(other),
    }
}

/// Reads the payout (retried twice on a failure without a verdict) and notes a terminal state.
async fn read_payout(shared: &Shared, hops: &Hops, id: Uuid) -> Result<Payout, CycleOutcome> {
    match (|| hops.payment.get_payout(id))
        .retry(retry_policy(2))
        .await
    {
        Ok(p) => {
            shared.saw(id, p.state);
            Ok(p)
        }
        Err(_) => Err(CycleOutcome::Unavailable),
    }
}

/// What a cycle does with a payout it read that it may not claim: a terminal or quarantined
/// payout is settled, a RAIL_ACKED one is posted (its rail reference and attempt), and any other
/// is left for a later cycle.
fn to_post(payout: Payout) -> Result<(String, Uuid), CycleOutcome> {
    match payout.state {
        PayoutState::Posted
        | PayoutState::Failed
        | PayoutState::Abandoned
        | PayoutState::RailAmbiguous => Err(CycleOutcome::Settled),
        PayoutState::RailAcked => payout
            .rail_reference
            .zip(payout.submission_id)
            .ok_or(CycleOutcome::Pending),
        PayoutState::Pending | PayoutState::Claimed | PayoutState::Submitting => {
            Err(CycleOutcome::Pending)
        }
    }
}

/// How a claim ended.
enum Claim {
    /// Claimed under this cycle's token.
    Granted,
    /// `409 PAYOUT_NOT_CLAIMABLE`: the payout is not in the state the claim expected.
    NotClaimable(ClientError),
    /// Any other end: the cycle's outcome.
    Ended(CycleOutcome),
}

async fn claim(
    shared: &Shared,
    hops: &Hops,
    planned: &PlannedPayout,
    held: &HeldLock,
    expected: PayoutState,
) -> Claim {
    let id = planned.payout_id;
    let token = held.token();
    // docs/design.md#d-8: the lock server's proof of the token travels beside it on every
    // protected write (None when the lock server has no proof keys; the services need none then).
    let fence = Fence::new(planned.idempotency_key.as_str(), token, held.proof());
    match payment_write(held, || hops.payment.claim(id, fence, expected)).await {
        Write::DeadlinePassed => Claim::Ended(CycleOutcome::DeadlinePassed),
        // Only a claim granted to this very token may lead to a submit under it.
        Write::Done(Ok(claim)) if claim.claim_token == token => Claim::Granted,
        Write::Done(Ok(claim)) => {
            tracing::error!(event = "invariant_violated", rule = "the claim answers with the caller's token", payout_id = %id, token, claim_token = claim.claim_token, "the payment resource granted the claim to another token; not submitting");
            Claim::Ended(CycleOutcome::Unavailable)
        }
        Write::Done(Err(e)) if e.code() == Some(ErrorCode::PayoutNotClaimable) => {
            Claim::NotClaimable(e)
        }
        Write::Done(Err(e)) => Claim::Ended(refused(shared, planned, Some(held), Step::Claim, &e)),
    }
}

/// The submission of a payout this cycle claimed: exactly once, whatever happens next.
async fn submit(
    shared: &Shared,
    hops: &Hops,
    planned: &PlannedPayout,
    held: &HeldLock,
) -> Result<(String, Uuid), CycleOutcome> {
    if held.past_deadline() {
        return Err(CycleOutcome::DeadlinePassed);
    }
    let body = planned.submission();
    let key = planned.idempotency_key.as_str();
    match hops
        .rail
        .submit_proven(held.token(), held.proof(), key, &body)
        .await
    {
        Ok(ack) => Ok((ack.rail_reference, ack.submission_id)),
        Err(e) => Err(refused(shared, planned, Some(held), Step::Submit, &e)),
    }
}

async fn critical_section(
    shared: &Shared,
    hops: &Hops,
    planned: &PlannedPayout,
    held: &HeldLock,
) -> CycleOutcome {
    let id = planned.payout_id;
    let acked = if shared.first_cycle_unread(id) {
        // docs/design.md#executor: a payout's first cycle in a run claims it as PENDING without
        // reading it first. The claim is conditional on PENDING: when the payout is in another
        // state, it is refused with nothing written, and the payout is read then, under the same
        // grant, as any later cycle reads it.
        match claim(shared, hops, planned, held, PayoutState::Pending).await {
            Claim::Granted => submit(shared, hops, planned, held).await,
            Claim::Ended(outcome) => Err(outcome),
            // A CLAIMED payout is claimed again by a later cycle, which reads it first: this
            // token's claim under this idempotency key is answered already.
            Claim::NotClaimable(_) => match read_payout(shared, hops, id).await {
                Ok(payout) => to_post(payout),
                Err(outcome) => Err(outcome),
            },
        }
    } else {
        // What the payout is now decides what this cycle does.
        match read_payout(shared, hops, id).await {
            Ok(payout) if matches!(payout.state, PayoutState::Pending | PayoutState::Claimed) => {
                match claim(shared, hops, planned, held, payout.state).await {
                    Claim::Granted => submit(shared, hops, planned, held).await,
                    Claim::Ended(outcome) => Err(outcome),
                    Claim::NotClaimable(e) => {
                        Err(refused(shared, planned, Some(held), Step::Claim, &e))
                    }
                }
            }
            Ok(payout) => to_post(payout),
            Err(outcome) => Err(outcome),
        }
    };
    let (rail_reference, submission_id) = match acked {
        Ok(acked) => acked,
        Err(outcome) => return outcome,
    };
    let fence = Fence::new(planned.idempotency_key.as_str(), held.token(), held.proof());
    match payment_write(held, || {
        hops.payment.post(id, fence, &rail_reference, submission_id)
    })
    .await
    {
        Write::DeadlinePassed => CycleOutcome::DeadlinePassed,
        Write::Done(Ok(posted)) => {
            shared.saw(id, posted.state);
            CycleOutcome::Settled
        }
        Write::Done(Err(e)) => refused(shared, planned, Some(held), Step::Post, &e),
    }
}

#[cfg(test)]
mod tests;
