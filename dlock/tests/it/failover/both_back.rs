//! lockdb and paydb both go back: one asynchronous pair holds both databases, the primary
//! acknowledges grants and a claim the standby never receives, and the standby is promoted. No
//! grant has run lockdb's epoch check yet when the operator recovers paydb or revokes a lock, and
//! the promoted sequence is below the lost tokens (positive control): the recovery's token floor
//! and a revocation's floor must still be above every lost token
//! (migrations/lockdb/0016_baseline.sql, docs/design.md#d-12).

use std::time::Duration;

use dlock_contract::ErrorCode;
use dlock_contract::client::LockClient;
use dlock_contract::payment::{Resolution, ResolveRequest};
use dlock_contract::rail::{RailClient, read_statement};
use dlock_devstack::PgServer;
use dlock_devstack::pg_standby::{PgPair, Replication};
use dlock_executor::manifest::idempotency_key;
use uuid::Uuid;

use super::scenario_a::{EXE, OPERATOR_TOKEN, Services, url};
use super::{
    claim, fail_over, last_token, new_session, number, recover_paydb_epoch, register,
    scratch_grants, submission,
};
use crate::harness::eventually;
use crate::shared::accounts::open_account;
use crate::shared::process::succeeded;

const ACCOUNT: &str = "both-back-00";
const KEY: &str = "payout:both-back-00";
const HELD: &str = "both-back:held";

/// Both databases promoted after losing 41 grants, and a claim of `p1` with the last lost token
/// and its submission, which the rail received. `p2` is PENDING throughout.
struct BothBack {
    pair: PgPair,
    services: Services,
    lock: LockClient,
    p1: Uuid,
    p2: Uuid,
    /// The lost token the claim was made with, the highest lockdb issued.
    stale: i64,
    /// The promoted sequence's last value, below `stale`.
    sequence: i64,
}

async fn both_back() -> BothBack {
    let mut pair = PgPair::start(Replication::Asynchronous).unwrap_or_else(|e| panic!("{e:#}"));
    for db in ["lockdb", "paydb"] {
        pair.create_database(db).unwrap_or_else(|e| panic!("{e:#}"));
    }
    let services = Services::start(&pair.url("lockdb"), &pair.url("paydb"), &[]);
    let payment = services.payment_client();
    open_account(&payment, ACCOUNT, Some(1_000_000)).await;
    let (p1, p2) = (Uuid::new_v4(), Uuid::new_v4());
    register(&payment, ACCOUNT, &[p1, p2]).await;
    let lock =
        LockClient::new(&url(&services.lock.1), "both-back").unwrap_or_else(|e| panic!("{e}"));
    let session = new_session(&lock).await;
    // Before the cut: a grant held across the promotion (the one a revocation evicts).
    lock.acquire(HELD, session, Some(60_000), None)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    pair.caught_up().unwrap_or_else(|e| panic!("{e:#}"));

    // After the cut: 40 grants (more than the 32 values a sequence logs ahead), then a claim with
    // the last one, all acknowledged by the primary alone.
    pair.cut().unwrap_or_else(|e| panic!("{e:#}"));
    scratch_grants(&lock, session, "both-back:scratch").await;
    let stale = lock
        .acquire(KEY, session, Some(60_000), None)
        .await
        .unwrap_or_else(|e| panic!("{e}"))
        .fencing_token;
    claim(&payment, p1, stale)
        .await
        .unwrap_or_else(|e| panic!("the lost claim: {e}"));
    // The rail receives p1; paydb's record of it (the intent, the acknowledgement) is lost next.
    RailClient::new(&url(&services.proxy.1), "both-back", Duration::from_secs(2))
        .unwrap_or_else(|e| panic!("{e}"))
        .submit(stale, &idempotency_key(p1), &submission(ACCOUNT, p1))
        .await
        .unwrap_or_else(|e| panic!("the lost submission: {e}"));
    fail_over(&mut pair);
    // Positive controls: the promotion lost the grants, the sequence's advance and the claim.
    let sequence = last_token(&pair.standby);
    assert!(sequence < stale, "sequence {sequence}, lost token {stale}");
    assert_eq!(
        number(
            &pair.standby,
            "paydb",
            &format!("SELECT count(*) FROM payouts WHERE payout_id = '{p1}' AND state = 'PENDING'"),
        ),
        1,
        "the claim and the submission are lost"
    );
    assert_eq!(
        number(
            &pair.standby,
            "lockdb",
            "SELECT count(*) FROM store_epoch_changes"
        ),
        0,
        "no grant has run lockdb's epoch check yet"
    );
    BothBack {
        pair,
        services,
        lock,
        p1,
        p2,
        stale,
        sequence,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_recovery_quarantines_what_the_rail_received_and_fences_every_lost_token() {
    let back = both_back().await;
    let (p1, p2, stale, sequence) = (back.p1, back.p2, back.stale, back.sequence);
    let (standby, services, lock) = (&back.pair.standby, &back.services, &back.lock);
    let (paydb, lockdb) = (standby.url("paydb"), standby.url("lockdb"));
    let recover = |rail: &str| {
        recover_paydb_epoch(
            &["--paydb", &paydb, "--lockdb", &lockdb, "--rail", rail],
            "both databases promoted after losing writes; reconciled against the rail",
        )
    };
    // Before the recovery paydb refuses every write with 503 RECOVERY_REQUIRED, at the payment
    // resource and at the rail proxy (not NOT_LEADER / RAIL_UNAVAILABLE, which promise that a
    // retry soon succeeds), once their pools are on the promoted server; until then a pooled
    // connection to the dead primary answers NOT_LEADER / RAIL_UNAVAILABLE. Anything else fails.
    let refusal = |what: &'static str, transient: ErrorCode, answer: Option<ErrorCode>| match answer
    {
        Some(ErrorCode::RecoveryRequired) => Some(()),
        Some(code) if code == transient => None,
        other => panic!("{what} on the promoted paydb before the recovery: {other:?}"),
    };
    eventually(
        "RECOVERY_REQUIRED at the payment resource",
        Duration::from_secs(20),
        || async {
            let claim = claim(&services.payment_client(), p2, stale).await;
            refusal(
                "a claim",
                ErrorCode::NotLeader,
                claim.err().and_then(|e| e.code()),
            )
        },
    )
    .await;
    let proxy = RailClient::new(&url(&services.proxy.1), "both-back", Duration::from_secs(2))
        .unwrap_or_else(|e| panic!("{e}"));
    eventually(
        "RECOVERY_REQUIRED at the rail proxy",
        Duration::from_secs(20),
        || async {
            let submit = proxy
                .submit(stale, &idempotency_key(p2), &submission(ACCOUNT, p2))
                .await;
            refusal(
                "a submit",
                ErrorCode::RailUnavailable,
                submit.err().and_then(|e| e.code()),
            )
        },
    )
    .await;
    // The rail's statement unreadable (nothing listens there): the recovery refuses and paydb
    // is still on its old epoch.
    let closed = format!(
        "http://127.0.0.1:{}",
        std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .unwrap_or_else(|e| panic!("{e}"))
            .port()
    );
    let refused = recover(&closed);
    assert!(
        !refused.status.success()
            && String::from_utf8_lossy(&refused.stderr).contains("reading the rail's statement"),
        "dlock recover without the statement: {refused:?}"
    );
    assert_eq!(
        number(
            standby,
            "paydb",
            "SELECT count(*) FROM pay_store_epoch_changes"
        ),
        0,
        "the refused recovery changed nothing"
    );
    let said = succeeded(&recover(&url(&services.stub.1)), "dlock recover");
    let floor = number(
        standby,
        "paydb",
        "SELECT token_floor FROM pay_store_epoch_changes WHERE decided_by = 'operator'",
    );
    assert!(
        floor > stale,
        "the recovery's floor {floor} is not above the lost token {stale} (the raw sequence \
         said {sequence})"
    );
    assert!(said.contains("1 payouts on the rail's statement"), "{said}");
    // What the rail received is out of reach: quarantined, holding its amount, recorded.
    assert_eq!(
        standby
            .psql(
                "paydb",
                &format!(
                    "SELECT p.state || ' ' || q.from_state || ' ' || a.held_minor FROM payouts p \
                     JOIN pay_epoch_quarantined q USING (payout_id) \
                     JOIN accounts a USING (account_id) WHERE p.payout_id = '{p1}'"
                ),
            )
            .unwrap_or_else(|e| panic!("{e:#}")),
        "RAIL_AMBIGUOUS PENDING 1000"
    );
    // The lost token's holder wakes and claims again: fenced out at the account.
    let payment = services.payment_client();
    let claim = |id: Uuid, token: i64| claim(&payment, id, token);
    // NOT_LEADER is retry-safe (nothing was written): a pooled connection may still be on its
    // way to the promoted server.
    let answer = |id: Uuid, token: i64| {
        let claim = &claim;
        eventually(
            "an answer other than NOT_LEADER",
            Duration::from_secs(20),
            move || async move {
                match claim(id, token).await {
                    Err(e) if e.code() == Some(ErrorCode::NotLeader) => None,
                    other => Some(other),
                }
            },
        )
    };
    let stale_claim = answer(p2, stale).await;
    assert_eq!(
        stale_claim.err().and_then(|e| e.code()),
        Some(ErrorCode::FencedOut),
        "the lost token's claim after the recovery"
    );
    // A holder after the recovery claims p2 (positive control: writes go through) but cannot
    // claim p1 again, so the rail never sees it twice. The lock server's pool may still hold a
    // connection to the dead primary for a moment: NOT_LEADER is retry-safe.
    let session = eventually(
        "a session other than NOT_LEADER",
        Duration::from_secs(20),
        || async {
            match lock.create_session(Some(60_000)).await {
                Err(e) if e.code() == Some(ErrorCode::NotLeader) => None,
                other => Some(other),
            }
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"))
    .session_id;
    let fresh = lock
        .acquire("payout:both-back-fresh", session, Some(60_000), None)
        .await
        .unwrap_or_else(|e| panic!("{e}"))
        .fencing_token;
    assert!(fresh > floor, "fresh {fresh}, floor {floor}");
    answer(p2, fresh)
        .await
        .unwrap_or_else(|e| panic!("a fresh holder's claim of p2: {e}"));
    // A newer token still (the account's fence is at `fresh` now): refused for the payout's
    // state, not for its token.
    let newer = lock
        .acquire("payout:both-back-newer", session, Some(60_000), None)
        .await
        .unwrap_or_else(|e| panic!("{e}"))
        .fencing_token;
    let again = answer(p1, newer).await;
    assert!(
        matches!(&again, Err(e) if e.code() != Some(ErrorCode::FencedOut)),
        "p1 after the recovery: {again:?}"
    );
    let transfers = read_statement(&url(&services.stub.1), Some(&p1.to_string()))
        .await
        .unwrap_or_else(|e| panic!("{e}"))
        .transfers
        .len();
    assert_eq!(transfers, 1, "p1 is on the rail once");
    // The quarantined payout is resolved on the reconciler's finding, never on say-so: FAILED
    // (which would release its hold while the rail has it) is refused before any finding, and
    // nothing changes.
    let resolve = |key: &'static str, outcome: Resolution, reference: Option<String>| {
        let payment = &payment;
        async move {
            payment
                .as_operator(OPERATOR_TOKEN)
                .resolve(
                    p1,
                    &format!("{key}-{p1}"),
                    &ResolveRequest {
                        outcome,
                        rail_reference: reference,
                        operator: "ops-on-call".into(),
                        evidence: "after the store-epoch recovery".into(),
                    },
                )
                .await
        }
    };
    let failed = resolve("resolve-failed", Resolution::Failed, None).await;
    assert_eq!(
        failed.err().and_then(|e| e.code()),
        Some(ErrorCode::ValidationFailed),
        "FAILED of a quarantined payout the rail has, without a finding"
    );
    let state = |db: &PgServer| {
        db.psql(
            "paydb",
            &format!("SELECT state FROM payouts WHERE payout_id = '{p1}'"),
        )
        .unwrap_or_else(|e| panic!("{e:#}"))
    };
    assert_eq!(
        state(standby),
        "RAIL_AMBIGUOUS",
        "the refusal changed nothing"
    );
    // Positive control: `dlock reconcile` finds it on the statement, and POSTED under the
    // reference it found is accepted. The rail's line for p1 is matched to p1 by its clientRef
    // (paydb lost the attempt): one finding, p1 ambiguous and found on the rail, and no
    // critical `rail_transfer_without_payout` beside it, so the run exits 0.
    let reconcile = || {
        let out = std::process::Command::new(EXE)
            .args(["reconcile", "--paydb"])
            .arg(standby.url("paydb"))
            .args(["--rail", &url(&services.stub.1), "--json"])
            .output()
            .unwrap_or_else(|e| panic!("{e}"));
        let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
            panic!(
                "dlock reconcile --json: {e}: {}",
                String::from_utf8_lossy(&out.stderr)
            )
        });
        let findings: Vec<(String, String, String)> = json["findings"]
            .as_array()
            .unwrap_or_else(|| panic!("no findings: {json}"))
            .iter()
            .map(|f| {
                let field = |k: &str| f[k].as_str().unwrap_or_default().to_owned();
                (field("severity"), field("kind"), field("subject"))
            })
            .collect();
        (out.status.code(), findings, json)
    };
    let (exit, findings, json) = reconcile();
    assert_eq!(
        findings,
        vec![(
            "info".to_owned(),
            "ambiguous_found_on_rail".to_owned(),
            p1.to_string()
        )],
        "{json}"
    );
    assert_eq!(
        (
            &json["ambiguousFoundOnRail"],
            &json["transfersWithoutPayout"]
        ),
        (&serde_json::json!(1), &serde_json::json!(0)),
        "{json}"
    );
    assert_eq!(exit, Some(0), "{json}");
    let found = standby
        .psql(
            "paydb",
            &format!(
                "SELECT rail_reference FROM reconcile_findings \
                 WHERE payout_id = '{p1}' AND verdict = 'present' LIMIT 1"
            ),
        )
        .unwrap_or_else(|e| panic!("{e:#}"));
    assert!(
        !found.is_empty(),
        "the reconciler recorded no present finding for p1"
    );
    resolve("resolve-posted", Resolution::Posted, Some(found))
        .await
        .unwrap_or_else(|e| panic!("POSTED under the found reference: {e}"));
    assert_eq!(state(standby), "POSTED");
    // Resolved, p1's line is still its own: no finding at all (the attempt is still missing).
    let (exit, findings, json) = reconcile();
    assert_eq!(findings, vec![], "{json}");
    assert_eq!(exit, Some(0), "{json}");
    println!("both back: lost token {stale}, promoted sequence {sequence}, recovery floor {floor}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_revocation_on_a_lockdb_that_went_back_fences_out_every_lost_token() {
    // `back` holds the lock server and the databases to the end.
    let back = both_back().await;
    let (lock, stale, sequence) = (&back.lock, back.stale, back.sequence);
    let revoked = eventually(
        "a revocation on the promoted lockdb",
        Duration::from_secs(20),
        || async {
            lock.revoke(HELD, "ops-on-call", "evicting after the failover", None)
                .await
                .ok()
        },
    )
    .await;
    assert!(
        revoked.new_token_floor > stale,
        "the revocation's floor {} is not above the lost token {stale} (the raw sequence said \
         {sequence})",
        revoked.new_token_floor
    );
    assert_eq!(
        number(
            &back.pair.standby,
            "lockdb",
            "SELECT count(*) FROM store_epoch_changes"
        ),
        1,
        "the revocation ran the epoch check"
    );
    println!(
        "both back: lost token {stale}, promoted sequence {sequence}, revocation floor {}",
        revoked.new_token_floor
    );
}
