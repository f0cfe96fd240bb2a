//! Network faults mid-batch: real partitions (a network namespace, a veth pair, nftables drop
//! rules: the service sees silence, not a refusal) and a userspace proxy that makes the rail
//! slow, silent or rude. Each scenario runs a real batch with `dlock run` executors, applies the
//! fault while it runs, heals it, and ends with the chaos suite's invariant checker plus one more
//! check of the rail proxy's records against the rail's statement.
//!
//! Needs root, `ip` (iproute2) and `nft` (nftables); without them these tests fail and say what
//! to install — they never skip. Alone: `cargo nextest run -p dlock --test it netfault
//! --no-capture`.

use std::collections::HashMap;
use std::future::Future;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use dlock_contract::ErrorCode;
use dlock_contract::client::{ClientError, LockClient};
use dlock_contract::rail::{RailClient, SubmissionRequest, read_statement};
use dlock_devstack::ManagedChild;
use dlock_devstack::faultproxy::{Direction, Mode};
use dlock_devstack::stack::{Role, StackBuilder};
use uuid::Uuid;

use crate::chaos::{Chaos, Figures, fault_stack};
use crate::harness::{Backend, eventually};

/// The fault suites' stack with short backend timeouts, so that a service cut from its store
/// answers (or fails) within a second or two.
fn net_stack(backend: Backend, rail: &[(&str, &str)], read_timeout_ms: u64) -> StackBuilder {
    let builder = fault_stack(backend, rail, read_timeout_ms)
        .set(
            Role::PaymentResource,
            "payment.pg.acquire-timeout-ms",
            "1000",
        )
        .set(Role::RailProxy, "rail.proxy.pg.acquire-timeout-ms", "1000");
    match backend {
        Backend::Pg => builder.set(Role::LockServer, "lock.pg.acquire-timeout-ms", "1000"),
        Backend::Etcd => builder
            .set(Role::LockServer, "lock.etcd.connect-timeout-ms", "1000")
            .set(Role::LockServer, "lock.etcd.request-timeout-ms", "2000"),
    }
}

async fn progress(stack: &Chaos, at_least: usize) {
    stack
        .progressed(
            "the batch makes progress",
            at_least,
            Duration::from_secs(40),
        )
        .await;
}

/// The chaos suite's checker, then the proxy's records against the rail's statement.
async fn check(
    stack: &Chaos,
    scenario: &'static str,
    batch: (&str, usize),
    faults: usize,
    fenced_out: usize,
) -> Figures {
    let figures = stack.check(scenario, batch, faults, fenced_out).await;
    let violations = proxy_records_match(stack).await;
    assert!(
        violations.is_empty(),
        "{scenario}: the proxy's records and the rail disagree:\n{}",
        violations.join("\n")
    );
    figures
}

/// Every transfer on the statement has a durable intent at the proxy (ACKED or TIMEOUT, never
/// FENCED, REJECTED or none: no forwarding without an intent), every ACKED submission is on
/// the statement, and every POSTED payout is on it exactly once.
async fn proxy_records_match(stack: &Chaos) -> Vec<String> {
    let statement = read_statement(&stack.stub().url(), None)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let mut on_rail: HashMap<String, usize> = HashMap::new();
    for t in &statement.transfers {
        *on_rail.entry(t.client_ref.clone()).or_default() += 1;
    }
    let pool = dlock_executor::reconcile::connect(&stack.pg().url("paydb"))
        .await
        .unwrap_or_else(|e| panic!("{e:#}"));
    let rows: Vec<(Uuid, String)> =
        sqlx::query_as("SELECT payout_id, outcome FROM rail_submission")
            .fetch_all(&pool)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
    let mut intents: HashMap<String, Vec<String>> = HashMap::new();
    for (payout, outcome) in rows {
        intents.entry(payout.to_string()).or_default().push(outcome);
    }
    let posted: Vec<(Uuid,)> =
        sqlx::query_as("SELECT payout_id FROM payouts WHERE state = 'POSTED'")
            .fetch_all(&pool)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
    let mut violations = Vec::new();
    for client_ref in on_rail.keys() {
        let ok = intents
            .get(client_ref)
            .is_some_and(|o| o.iter().any(|o| o == "ACKED" || o == "TIMEOUT"));
        if !ok {
            violations.push(format!(
                "{client_ref} is on the rail without an ACKED or TIMEOUT intent: {:?}",
                intents.get(client_ref)
            ));
        }
    }
    for (payout, outcomes) in &intents {
        if outcomes.iter().any(|o| o == "ACKED") && !on_rail.contains_key(payout) {
            violations.push(format!(
                "{payout} is ACKED at the proxy but not on the rail"
            ));
        }
        if outcomes.iter().any(|o| o == "unresolved") {
            violations.push(format!("{payout} still has an unresolved intent"));
        }
    }
    for (payout,) in posted {
        let n = on_rail.get(&payout.to_string()).copied().unwrap_or(0);
        if n != 1 {
            violations.push(format!("{payout} is POSTED with {n} transfers on the rail"));
        }
    }
    violations
}

/// An answer that says "the backend is gone": NOT_LEADER, another 5xx, or no answer in time.
fn outage_status<T>(
    answer: Result<Result<T, ClientError>, tokio::time::error::Elapsed>,
) -> Option<&'static str> {
    match answer {
        Err(_) => Some("timeout"),
        Ok(Err(e)) if e.code() == Some(ErrorCode::NotLeader) => Some("NOT_LEADER"),
        Ok(Err(e)) if e.code() == Some(ErrorCode::RailUnavailable) => Some("RAIL_UNAVAILABLE"),
        Ok(Err(e)) if e.code().is_none() => Some("transport"),
        Ok(Err(e)) if e.retry_safe() => Some("503"),
        _ => None,
    }
}

/// Probes a service cut from its backend: the answer (within 4 s) must say the backend is gone,
/// else the test fails saying `refusal`. What the answer was.
async fn outage<T>(
    refusal: &str,
    probe: impl Future<Output = Result<T, ClientError>>,
) -> &'static str {
    let answer = tokio::time::timeout(Duration::from_secs(4), probe).await;
    outage_status(answer).unwrap_or_else(|| panic!("{refusal}"))
}

/// The positive control of an outage probe: once the cut is healed, the same probe gets an
/// answer that is no outage, so the outage it saw was the cut's doing (not a wrong address or a
/// dead process, which the probe would take for one too).
async fn answers_again<T, F, Fut>(what: &str, probe: F)
where
    F: Fn() -> Fut,
    Fut: Future<Output = Result<T, ClientError>>,
{
    eventually(what, Duration::from_secs(20), || async {
        let answer = tokio::time::timeout(Duration::from_secs(4), probe()).await;
        outage_status(answer).is_none().then_some(())
    })
    .await;
}

/// A stack on pg (the rail answering in 20 ms) with `role` in the namespace, the one whose link
/// to paydb the test cuts.
fn paydb_client_in_netns(role: Role) -> Chaos {
    Chaos(
        net_stack(Backend::Pg, &[("rail.stub.latency-ms", "20")], 1_000)
            .in_netns(&[role])
            .start(),
    )
}

/// The batch of 120 payouts on `prefix`'s 8 accounts, and one executor paying it (and its log),
/// 25 of them posted.
async fn paying(stack: &Chaos, prefix: &str) -> (PathBuf, ManagedChild, PathBuf) {
    let batch = stack.funded_batch(prefix, 8, 120).await;
    let (executor, log) = stack.executor(&batch, &format!("executor-{prefix}"), &[]);
    progress(stack, 25).await;
    (batch, executor, log)
}

/// Gives the first run `within` to finish by itself after the heal (or to give up), then a re-run
/// as `executor-{prefix}-b` completes the batch; how many fenced-out events both reported.
fn rerun(
    stack: &Chaos,
    (first, first_log): (ManagedChild, PathBuf),
    within: Duration,
    batch: &Path,
    prefix: &str,
) -> usize {
    let (_, fenced) = stack.wait(first, &first_log, within);
    let (again, again_log) = stack.executor(batch, &format!("executor-{prefix}-b"), &[]);
    fenced + stack.finish(again, &again_log)
}

/// The namespace cut from one peer, since the moment the cut began.
struct Cut<'a> {
    stack: &'a Chaos,
    began: Instant,
}

/// Cuts the namespace from `peer`.
fn cut_from(stack: &Chaos, peer: SocketAddr) -> Cut<'_> {
    let began = Instant::now();
    stack
        .ns()
        .partition(peer)
        .unwrap_or_else(|e| panic!("{e:#}"));
    Cut { stack, began }
}

impl Cut<'_> {
    fn elapsed(&self) -> Duration {
        self.began.elapsed()
    }

    /// Reads `count` once `settle` has passed since the cut, and again 2.5 s later: a count that
    /// the cut should hold still, before and after.
    async fn held_still<F, Fut>(&self, settle: Duration, count: F) -> (usize, usize)
    where
        F: Fn() -> Fut,
        Fut: Future<Output = usize>,
    {
        tokio::time::sleep(settle.saturating_sub(self.elapsed())).await;
        let before = count().await;
        tokio::time::sleep(Duration::from_millis(2_500)).await;
        (before, count().await)
    }

    /// Heals the partition; how many packets it dropped.
    fn heal(&self) -> u64 {
        let dropped = self.stack.ns().dropped_packets();
        self.stack.ns().heal().unwrap_or_else(|e| panic!("{e:#}"));
        dropped
    }
}

/// Cuts the lock server (in the namespace) from its backend mid-batch.
async fn lock_server_cut_from_backend(backend: Backend, scenario: &'static str, prefix: &str) {
    let stack = Chaos(
        net_stack(backend, &[("rail.stub.latency-ms", "10")], 1_000)
            .in_netns(&[Role::LockServer])
            .start(),
    );
    let batch = stack.funded_batch(prefix, 8, 120).await;
    // Short leases, so that they lapse while the backend is out of reach.
    let short = ["--lock-ttl-ms", "2000", "--session-ttl-ms", "3000"];
    let first = stack.executor(&batch, &format!("executor-{prefix}-a"), &short);
    progress(&stack, 25).await;
    let peer = stack.etcd_peer().unwrap_or_else(|| stack.pg_peer());
    let cut = cut_from(&stack, peer);
    // The lock server answers NOT_LEADER (or nothing) while its backend is silent.
    let lock = LockClient::new(&stack.lock().url(), "probe").unwrap_or_else(|e| panic!("{e}"));
    let seen = outage(
        &format!("{scenario}: the lock server still worked without its backend"),
        lock.create_session(Some(5_000)),
    )
    .await;
    // Past every lease's local deadline (TTL × 0.7 = 1.4 s) nothing more is posted.
    let (frozen, still) = cut
        .held_still(Duration::from_millis(2_500), || async { stack.posted() })
        .await;
    let dropped = cut.heal();
    assert_eq!(
        frozen, still,
        "{scenario}: payouts were posted under leases that could not be renewed"
    );
    println!(
        "{scenario}: partition held {:.1} s, lock server probe: {seen}, {dropped} packets dropped, posted frozen at {frozen}",
        cut.elapsed().as_secs_f64(),
    );
    answers_again("the lock server answers the probe after the heal", || {
        lock.create_session(Some(5_000))
    })
    .await;
    let fenced = rerun(&stack, first, Duration::from_secs(25), &batch, prefix);
    // Positive control: the count that stood still during the partition is the one that moves
    // once the lock server reaches its backend again, so "frozen" was not a blind counter.
    let healed = stack.posted();
    assert!(
        frozen < 120 && healed > frozen,
        "{scenario}: the cut left payouts to post ({frozen} of 120) and the same count rose \
         after the heal ({healed})"
    );
    let faults = stack.ns().faults_injected();
    check(&stack, scenario, (prefix, 120), faults, fenced).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn cutting_the_lock_server_from_postgres_mid_batch_pays_nobody_twice() {
    lock_server_cut_from_backend(Backend::Pg, "lock server cut from PostgreSQL", "lspg").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn cutting_the_lock_server_from_etcd_mid_batch_pays_nobody_twice() {
    lock_server_cut_from_backend(Backend::Etcd, "lock server cut from etcd", "lsetcd").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn cutting_the_rail_proxy_from_the_rail_mid_forward_leaves_payouts_ambiguous() {
    // Every forward takes 300 ms, so forwards are in flight when the cut comes.
    let stack = Chaos(
        net_stack(Backend::Pg, &[("rail.stub.latency-ms", "300")], 1_000)
            .in_netns(&[Role::RailProxy])
            .start(),
    );
    let batch = stack.funded_batch("prail", 8, 100).await;
    let executors = stack.two_executors(&batch, "prail");
    progress(&stack, 15).await;
    let cut = cut_from(&stack, stack.stub().addr);
    // Held past the read timeout (1 s) plus the connect timeout of the forwards that follow.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let dropped = cut.heal();
    println!(
        "proxy cut from the rail: partition held {:.1} s, {dropped} packets dropped",
        cut.elapsed().as_secs_f64()
    );
    let fenced = stack.finish_all(executors);
    let faults = stack.ns().faults_injected();
    check(
        &stack,
        "rail proxy cut from the rail",
        ("prail", 100),
        faults,
        fenced,
    )
    .await
    .left_ambiguous("forwards cut mid-flight leave their payouts RAIL_AMBIGUOUS");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn cutting_the_rail_proxy_from_paydb_mid_batch_forwards_nothing_without_an_intent() {
    let stack = paydb_client_in_netns(Role::RailProxy);
    let (_, a, a_log) = paying(&stack, "ppay").await;
    let cut = cut_from(&stack, stack.pg_peer());
    // A submission while paydb is silent is refused (503) or never answered: no intent, no
    // forward. It names a payout and an account that exist nowhere, so it can change nothing.
    let rail = RailClient::new(&stack.proxy().url(), "probe", Duration::from_secs(1))
        .unwrap_or_else(|e| panic!("{e}"));
    let body = SubmissionRequest {
        payout_id: Uuid::new_v4(),
        account_id: "probe-nowhere".into(),
        amount_minor: 1,
        currency: "EUR".into(),
        beneficiary_ref: "ben-probe".into(),
    };
    let seen = outage(
        "the proxy admitted a submission without paydb",
        rail.submit(1, "probe-key", &body),
    )
    .await;
    // Forwards whose intent committed before the cut finish within the rail's 20 ms; after that
    // the statement must not grow while the proxy cannot write an intent.
    let (before, after) = cut
        .held_still(Duration::from_millis(1_500), || stack.transfers())
        .await;
    let dropped = cut.heal();
    assert_eq!(
        before, after,
        "the proxy forwarded to the rail while it could not record an intent"
    );
    println!(
        "proxy cut from paydb: partition held {:.1} s, submit probe: {seen}, {dropped} packets dropped, statement frozen at {before}",
        cut.elapsed().as_secs_f64(),
    );
    let fenced = stack.finish(a, &a_log);
    // Positive control: the statement that stood still while paydb was out of reach grows once
    // the proxy can record intents again.
    let healed = stack.transfers().await;
    assert!(
        healed > after,
        "the statement grew after the heal ({after} -> {healed}); otherwise \"frozen\" proves nothing"
    );
    let faults = stack.ns().faults_injected();
    check(
        &stack,
        "rail proxy cut from paydb",
        ("ppay", 120),
        faults,
        fenced,
    )
    .await;
    // Only after the checks (it may put a transfer on the statement): the same submission is
    // answered once paydb is back.
    answers_again("the proxy answers the probe after the heal", || {
        rail.submit(1, "probe-key", &body)
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn cutting_the_payment_resource_from_paydb_mid_batch_pays_nobody_twice() {
    let stack = paydb_client_in_netns(Role::PaymentResource);
    let (batch, a, a_log) = paying(&stack, "pres").await;
    let cut = cut_from(&stack, stack.pg_peer());
    let payment = stack.payment_client();
    let seen = outage(
        "the payment resource answered without paydb",
        payment.get_account("pres-00"),
    )
    .await;
    tokio::time::sleep(Duration::from_secs(4).saturating_sub(cut.elapsed())).await;
    let dropped = cut.heal();
    println!(
        "payment resource cut from paydb: partition held {:.1} s, probe: {seen}, {dropped} packets dropped",
        cut.elapsed().as_secs_f64(),
    );
    answers_again(
        "the payment resource answers the probe after the heal",
        || payment.get_account("pres-00"),
    )
    .await;
    let fenced = rerun(&stack, (a, a_log), Duration::from_secs(40), &batch, "pres");
    let faults = stack.ns().faults_injected();
    check(
        &stack,
        "payment resource cut from paydb",
        ("pres", 120),
        faults,
        fenced,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_rail_answering_at_the_read_timeout_then_silent_then_resetting_pays_nobody_twice() {
    let read_timeout_ms = 800;
    let rail = [
        ("rail.stub.latency-ms", "10"),
        ("rail.stub.latency-jitter-ms", "60"),
    ];
    let stack = Chaos(
        net_stack(Backend::Pg, &rail, read_timeout_ms)
            .rail_fault_proxy()
            .start(),
    );
    let rail = stack.rail_fault();
    let batch = stack.funded_batch("late", 8, 150).await;
    let executors = stack.two_executors(&batch, "late");
    progress(&stack, 20).await;
    // 1: answers arrive around the proxy's read timeout: some just before, some just after.
    rail.set_latency(
        Direction::Downstream,
        Duration::from_millis(read_timeout_ms - 40),
    );
    tokio::time::sleep(Duration::from_secs(4)).await;
    rail.set_latency(Direction::Downstream, Duration::ZERO);
    // 2: the rail goes silent (connections accepted and read, nothing answered).
    rail.set_mode(Mode::Blackhole);
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    // 3: every connection is reset, open or new.
    rail.set_mode(Mode::Reset);
    tokio::time::sleep(Duration::from_millis(300)).await;
    rail.set_mode(Mode::Forward);
    let stats = rail.stats();
    println!(
        "late rail: {} connections through the fault proxy, {} reset, {} bytes swallowed",
        stats.accepted, stats.reset, stats.blackholed_bytes
    );
    let fenced = stack.finish_all(executors);
    check(
        &stack,
        "rail late, silent, resetting",
        ("late", 150),
        3,
        fenced,
    )
    .await
    .left_ambiguous("answers past the read timeout leave payouts RAIL_AMBIGUOUS");
}
