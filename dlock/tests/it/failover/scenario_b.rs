//! Scenario B: lockdb on a primary with an asynchronous standby, cut off from it; the primary
//! acknowledges grants the standby never receives, one of them held by a worker that claims a
//! payout with it and then pauses; the primary dies and the standby is promoted. The promoted
//! lockdb's sequence is below the lost tokens (positive control), yet no token is issued twice:
//! the first grant on the new timeline moves the sequence past everything lockdb could have issued
//! (migrations/lockdb/0016_baseline.sql, docs/design.md#d-12), and the paused worker's token
//! is fenced at the account and at the rail once the newer holder has written.

use std::collections::HashSet;
use std::time::Duration;

use dlock_contract::ErrorCode;
use dlock_contract::client::LockClient;
use dlock_contract::rail::RailClient;
use dlock_devstack::PgServer;
use dlock_devstack::pg_standby::{PgPair, Replication};
use dlock_executor::manifest::idempotency_key;
use uuid::Uuid;

use super::scenario_a::{Services, url};
use super::{
    claim, fail_over, last_token, new_session, number, recover_paydb_epoch, register,
    scratch_grants, submission,
};
use crate::harness::{assert_fenced_out, eventually, stale_post_is_fenced};
use crate::shared::accounts::open_account;
use crate::shared::process::succeeded;

const ACCOUNT: &str = "epoch-00";
const KEY: &str = "payout:epoch-00";

/// An asynchronous pair holding the database `paired`, and a PostgreSQL of its own holding
/// `alone`.
fn paired_and_alone(paired: &str, alone: &str) -> (PgPair, PgServer) {
    let pair = PgPair::start(Replication::Asynchronous).unwrap_or_else(|e| panic!("{e:#}"));
    pair.create_database(paired)
        .unwrap_or_else(|e| panic!("{e:#}"));
    let server = PgServer::start(None).unwrap_or_else(|e| panic!("{e:#}"));
    server
        .create_database(alone)
        .unwrap_or_else(|e| panic!("{e:#}"));
    (pair, server)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_asynchronous_promotion_that_lost_grants_issues_no_token_twice_and_fences_their_holder()
{
    // paydb is elsewhere, and keeps what it was told.
    let (mut pair, paydb) = paired_and_alone("lockdb", "paydb");
    let services = Services::start(&pair.url("lockdb"), &paydb.url("paydb"), &[]);
    let payment = services.payment_client();
    open_account(&payment, ACCOUNT, Some(1_000_000)).await;
    let (p1, p2) = (Uuid::new_v4(), Uuid::new_v4());
    register(&payment, ACCOUNT, &[p1, p2]).await;
    let lock_url = url(&services.lock.1);
    let lock = LockClient::new(&lock_url, "epoch-worker").unwrap_or_else(|e| panic!("{e}"));
    let mut issued = Vec::new();

    // Before the cut: a grant the standby receives.
    let session = new_session(&lock).await;
    let first = lock
        .acquire(KEY, session, Some(10_000), None)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    issued.push(first.fencing_token);
    lock.release(KEY, session, first.fencing_token)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    pair.caught_up().unwrap_or_else(|e| panic!("{e:#}"));

    // After the cut: 40 grants (more than the 32 values a sequence logs ahead), then the paused
    // worker's, all acknowledged by the primary alone.
    pair.cut().unwrap_or_else(|e| panic!("{e:#}"));
    issued.extend(scratch_grants(&lock, session, "epoch:scratch").await);
    let stale_session = new_session(&lock).await;
    let stale = lock
        .acquire(KEY, stale_session, Some(60_000), None)
        .await
        .unwrap_or_else(|e| panic!("{e}"))
        .fencing_token;
    issued.push(stale);
    claim(&payment, p1, stale)
        .await
        .unwrap_or_else(|e| panic!("the paused worker's claim: {e}"));
    let lost_on_primary = last_token(&pair.primary);

    fail_over(&mut pair);
    // Positive control: the promoted lockdb lost those grants and the sequence's advance.
    let sequence = last_token(&pair.standby);
    assert!(
        sequence < stale,
        "the promotion lost nothing: sequence {sequence}, lost token {stale} (primary had \
         {lost_on_primary})"
    );
    assert_eq!(
        pair.standby
            .psql("lockdb", "SELECT count(*) FROM locks")
            .unwrap_or_else(|e| panic!("{e:#}")),
        "0",
        "the paused worker's grant is gone with the lost commits"
    );

    // A newer worker takes the key as soon as the lock server has followed the promotion.
    let newer = LockClient::new(&lock_url, "epoch-newer").unwrap_or_else(|e| panic!("{e}"));
    let (newer_session, grant) = eventually(
        "an acquire on the promoted lockdb",
        Duration::from_secs(20),
        || async {
            let session = newer.create_session(Some(60_000)).await.ok()?.session_id;
            let grant = newer.acquire(KEY, session, Some(60_000), None).await.ok()?;
            Some((session, grant))
        },
    )
    .await;
    let token = grant.fencing_token;
    assert!(
        token > stale,
        "the first token after the promotion, {token}, is not above the lost {stale}"
    );
    let (floor, gap, changes) = {
        let row = pair
            .standby
            .psql(
                "lockdb",
                "SELECT floor, token_gap, (SELECT count(*) FROM store_epoch_changes) \
                 FROM store_epoch",
            )
            .unwrap_or_else(|e| panic!("{e:#}"));
        let v: Vec<i64> = row.split('|').filter_map(|x| x.parse().ok()).collect();
        (v[0], v[1], v[2])
    };
    assert_eq!(changes, 1, "one new epoch recorded");
    assert!(
        token > floor && floor >= sequence + gap,
        "{token} {floor} {sequence} {gap}"
    );
    for i in 0..10 {
        let key = format!("epoch:after-{i}");
        let g = newer
            .acquire(&key, newer_session, Some(10_000), None)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        assert!(g.fencing_token > floor);
        issued.push(g.fencing_token);
    }
    issued.push(token);
    let distinct: HashSet<i64> = issued.iter().copied().collect();
    assert_eq!(
        distinct.len(),
        issued.len(),
        "a token was issued twice: {issued:?}"
    );

    // The newer holder claims and submits; the paused worker wakes with its lost token.
    claim(&payment, p2, token)
        .await
        .unwrap_or_else(|e| panic!("the newer holder's claim: {e}"));
    let rail = |owner: &str| {
        RailClient::new(&url(&services.proxy.1), owner, Duration::from_millis(1_000))
            .unwrap_or_else(|e| panic!("{e}"))
    };
    rail("epoch-newer")
        .submit(token, &idempotency_key(p2), &submission(ACCOUNT, p2))
        .await
        .unwrap_or_else(|e| panic!("the newer holder's submit: {e}"));
    let submit = rail("epoch-worker")
        .submit(stale, &idempotency_key(p1), &submission(ACCOUNT, p1))
        .await;
    assert_fenced_out(submit, "the lost token's submit is fenced at the rail");
    stale_post_is_fenced(
        &payment,
        p1,
        stale,
        "the lost token's post is fenced at the account",
    )
    .await;
    let renew = lock.renew(KEY, stale_session, stale, None).await;
    assert!(
        matches!(
            renew.as_ref().err().and_then(|e| e.code()),
            Some(ErrorCode::SessionUnknown | ErrorCode::LockLost)
        ),
        "the lost grant cannot be renewed: {renew:?}"
    );
    println!(
        "scenario B: lost tokens up to {stale} (primary's sequence {lost_on_primary}); the \
         promoted sequence was at {sequence}; first token after the promotion {token} (floor \
         {floor}, gap {gap}); {} tokens, all distinct",
        issued.len()
    );
}

/// The `dlock` binary's `recover paydb-epoch`, as an operator runs it; its stdout.
fn recover(paydb: &str, rail: &str, floor: i64) -> String {
    let floor = floor.to_string();
    let out = recover_paydb_epoch(
        &["--paydb", paydb, "--rail", rail, "--token-floor", &floor],
        "paydb promoted after losing writes; reconciled against the rail statement",
    );
    succeeded(&out, "dlock recover")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn paydb_promoted_after_losing_writes_takes_no_write_until_an_operator_confirms() {
    // lockdb is elsewhere, and keeps every token it issued.
    let (mut pair, lockdb) = paired_and_alone("paydb", "lockdb");
    let services = Services::start(&lockdb.url("lockdb"), &pair.url("paydb"), &[]);
    let payment = services.payment_client();
    open_account(&payment, ACCOUNT, Some(1_000_000)).await;
    let (p1, p2, p3) = (Uuid::new_v4(), Uuid::new_v4(), Uuid::new_v4());
    // A batch's payout, for the executor run on the refusing paydb below.
    let run = dlock_executor::manifest::parse(&format!(
        "apiVersion: dlock.io/v1alpha1\nkind: PayoutBatch\nmetadata:\n  name: epoch-run\nspec:\n  \
         payouts:\n    - key: k\n      accountId: {ACCOUNT}\n      amountMinor: 1000\n      \
         currency: EUR\n      beneficiaryRef: ben-0\n"
    ))
    .unwrap_or_else(|e| panic!("{e}"));
    let p4 = dlock_contract::payout_batch::payout_id("epoch-run", "k");
    register(&payment, ACCOUNT, &[p1, p2, p3, p4]).await;
    let lock_url = url(&services.lock.1);
    let claim = |id: Uuid, token: i64| {
        let payment = services.payment_client();
        async move { claim(&payment, id, token).await }
    };
    let acquire = |owner: &'static str, ttl: i64| {
        let lock_url = lock_url.clone();
        async move {
            let lock = LockClient::new(&lock_url, owner).unwrap_or_else(|e| panic!("{e}"));
            let session = new_session(&lock).await;
            let token = eventually("the key", Duration::from_secs(10), || async {
                lock.acquire(KEY, session, Some(ttl), None).await.ok()
            })
            .await
            .fencing_token;
            (lock, session, token)
        }
    };

    // Before the cut: a claim the standby receives.
    let (_, _, t1) = acquire("epoch-first", 1_000).await;
    claim(p1, t1)
        .await
        .unwrap_or_else(|e| panic!("the first claim: {e}"));
    pair.caught_up().unwrap_or_else(|e| panic!("{e:#}"));
    pair.cut().unwrap_or_else(|e| panic!("{e:#}"));
    // After the cut: a worker acquires and pauses; its grant lapses and a newer holder claims,
    // raising the fence past the paused worker's token, on the primary alone.
    let (_, _, paused) = acquire("epoch-paused", 1_000).await;
    let (newer_lock, newer_session, newer) = acquire("epoch-newer", 60_000).await;
    claim(p2, newer)
        .await
        .unwrap_or_else(|e| panic!("the newer holder's claim: {e}"));
    let stale = claim(p3, paused).await;
    assert_fenced_out(stale, "before the failover the paused worker is fenced out");
    fail_over(&mut pair);
    let fence = number(
        &pair.standby,
        "paydb",
        &format!("SELECT fence FROM accounts WHERE account_id = '{ACCOUNT}'"),
    );
    // Positive control: the promotion lost the newer claim, and the fence went back below the
    // paused worker's token, which would pass it now.
    assert!(
        fence == t1 && t1 < paused && paused < newer,
        "fence {fence}, tokens {t1} < {paused} < {newer}"
    );

    // The paused worker wakes: refused, and so is everyone, once the payment resource is on the
    // promoted paydb, with 503 RECOVERY_REQUIRED (not NOT_LEADER, which promises that a retry
    // soon succeeds) naming the command, and its log says why: the epoch guard, not an
    // unreachable database; nothing is written. Until its pool is on the promoted paydb a pooled
    // connection to the dead primary answers NOT_LEADER (nothing written); anything else fails.
    let log = services.dir.path().join("payment-resource.log");
    let guard_said = || {
        std::fs::read_to_string(&log)
            .unwrap_or_default()
            .contains("by a primary that was not replicating synchronously")
    };
    let refused = eventually(
        "the epoch guard refusing on the promoted paydb",
        Duration::from_secs(20),
        || async {
            match claim(p3, paused).await {
                Err(e) if e.code() == Some(ErrorCode::RecoveryRequired) => Some(e),
                Err(e) if e.code() == Some(ErrorCode::NotLeader) => None,
                other => panic!("the paused worker's claim on the promoted paydb: {other:?}"),
            }
        },
    )
    .await;
    assert!(
        guard_said(),
        "the payment resource's log names the epoch guard"
    );
    assert!(
        refused.retry_safe() && refused.to_string().contains("dlock recover paydb-epoch"),
        "RECOVERY_REQUIRED is retry-safe and names the command: {refused}"
    );
    let refused_newer = claim(p2, newer).await;
    assert_eq!(
        refused_newer.err().and_then(|e| e.code()),
        Some(ErrorCode::RecoveryRequired),
        "the newer holder is refused too, until the recovery"
    );
    // The rail proxy records no intent either, so it forwards nothing: the first holder's claim
    // of p1 survived the promotion, its submit is refused before the rail, by the epoch guard
    // (RECOVERY_REQUIRED, its log says so) once the proxy's pool is on the promoted paydb: until
    // then a pooled connection to the dead primary refuses it as RAIL_UNAVAILABLE (nothing
    // recorded); anything else fails.
    let proxy = RailClient::new(
        &url(&services.proxy.1),
        "epoch-first",
        Duration::from_secs(1),
    )
    .unwrap_or_else(|e| panic!("{e}"));
    let proxy_log = services.dir.path().join("rail-proxy.log");
    let refused_at_rail = eventually(
        "the epoch guard refusing at the rail proxy",
        Duration::from_secs(20),
        || async {
            match proxy
                .submit(t1, &idempotency_key(p1), &submission(ACCOUNT, p1))
                .await
            {
                Err(e) if e.code() == Some(ErrorCode::RecoveryRequired) => Some(e),
                Err(e) if e.code() == Some(ErrorCode::RailUnavailable) => None,
                other => panic!("the submit on the promoted paydb: {other:?}"),
            }
        },
    )
    .await;
    assert!(
        refused_at_rail.retry_safe()
            && refused_at_rail
                .to_string()
                .contains("dlock recover paydb-epoch"),
        "{refused_at_rail}"
    );
    let proxy_said = std::fs::read_to_string(&proxy_log).unwrap_or_default();
    assert!(
        proxy_said.contains("by a primary that was not replicating synchronously")
            && proxy_said.contains("paydb_recovery_required"),
        "the rail proxy's log names the epoch guard and the recovery"
    );
    // The executor does not spin on it: it backs off (250 ms doubling) and reports the payout
    // it could not move. Requeued after 20-50 ms as for NOT_LEADER, 4 s would take dozens of
    // cycles. The newer holder lets go of the key first, so the executor's claims reach paydb.
    newer_lock
        .release(KEY, newer_session, newer)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let report = dlock_executor::executor::execute(
        &run,
        &dlock_executor::executor::Endpoints {
            lock_server: lock_url.clone(),
            payment_resource: url(&services.payment.1),
            rail_proxy: url(&services.proxy.1),
        },
        dlock_executor::executor::RunOptions {
            workers: 1,
            settle_timeout: Duration::from_secs(4),
            register: false,
            ..dlock_executor::executor::RunOptions::default()
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e:#}"));
    let refusals = report
        .outcomes
        .get("RecoveryRequired")
        .copied()
        .unwrap_or(0);
    assert!(
        !report.complete && report.recovery_required == vec![p4] && refusals >= 1,
        "{report:?}"
    );
    assert!(
        report.cycles <= 8,
        "the executor spun on RECOVERY_REQUIRED: {report:?}"
    );
    assert!(report.table().contains("dlock recover paydb-epoch"));
    let transfers = dlock_contract::rail::read_statement(&url(&services.stub.1), None)
        .await
        .unwrap_or_else(|e| panic!("{e}"))
        .transfers
        .len();
    assert_eq!(transfers, 0, "nothing reached the rail");
    payment
        .get_payout(p3)
        .await
        .unwrap_or_else(|e| panic!("reads are served: {e}"));
    assert_eq!(
        number(
            &pair.standby,
            "paydb",
            &format!(
                "SELECT count(*) FROM payouts WHERE payout_id = '{p3}' AND state <> 'PENDING'"
            )
        ),
        0,
        "the refused claim wrote nothing"
    );

    // The operator reconciles and confirms, with the highest token the lock server has issued.
    let floor = last_token(&lockdb);
    let said = recover(&pair.standby.url("paydb"), &url(&services.stub.1), floor);
    assert!(said.contains("takes writes again"), "{said}");
    let again = recover(&pair.standby.url("paydb"), &url(&services.stub.1), floor);
    assert!(again.contains("nothing changed"), "{again}");
    let audit = pair
        .standby
        .psql(
            "paydb",
            "SELECT decided_by || ' ' || operator || ' ' || token_floor || ' ' || fences_raised \
             FROM pay_store_epoch_changes",
        )
        .unwrap_or_else(|e| panic!("{e:#}"));
    assert_eq!(audit, format!("operator ops-on-call {floor} 1"));
    // Every token issued before is fenced out; a holder acquires again and carries on.
    let stale = claim(p3, paused).await;
    assert_fenced_out(stale, "the paused worker after the recovery");
    let (_, _, fresh) = acquire("epoch-fresh", 60_000).await;
    assert!(fresh > floor, "fresh {fresh}, floor {floor}");
    claim(p2, fresh)
        .await
        .unwrap_or_else(|e| panic!("a fresh holder's claim after the recovery: {e}"));
    println!(
        "paydb epoch: fence went back to {fence} (tokens {t1} < paused {paused} < newer {newer}); \
         refused: {refused}; the executor's run on the refusing paydb: {} cycles in {:.1} s; \
         recovered with floor {floor}; fresh token {fresh}",
        report.cycles,
        report.elapsed.as_secs_f64()
    );
}
