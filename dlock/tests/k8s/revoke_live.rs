//! `kubectl annotate lock … dlock.io/revoke-reason=…` means "fence out whoever holds this key
//! now": on a key that changed hands after the Lock mirror last refreshed (a busy account, a new
//! grant per payout), the operator reads the key's live grant from the real lock server when it
//! handles the annotation and revokes that one, not the token the mirror still shows.

use crate::revoke::{
    annotate_revoke, assert_floor_at_both_points, floor_revoking, lock_status_until,
    wait_for_lock_row,
};
use crate::shared::accounts::open_account;
use crate::world::World;

const NS: &str = "live";

/// What one attempt at the scenario found.
enum Attempt {
    /// The annotation was handled while the mirror still showed the first grant.
    Done,
    /// The mirror refreshed to the live grant before the operator handled the annotation (a
    /// LockServer status event of a just-Ready stack reconciles, and so mirrors, early): the
    /// revocation is then an ordinary one, and the scenario has to be set up again.
    MirrorRefreshedEarly(serde_json::Value),
}

// Each attempt takes an account and key of its own, so a revocation recorded by an attempt that
// did not happen as named leaves nothing behind for the next.
const ATTEMPTS: usize = 3;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_revoke_annotation_fences_out_the_live_holder_when_the_mirror_is_a_grant_behind() {
    let mut world = World::with_operator(NS, &[]).await;
    world.apply_stack_ready(NS);
    let mut early = Vec::new();
    for attempt in 1..=ATTEMPTS {
        match scenario(&mut world, &format!("acct-live-{attempt}")).await {
            Attempt::Done => {
                eprintln!(
                    "scenario done in {} ms, at attempt {attempt} (mirror refreshed early \
                     before: {early:?})",
                    world.elapsed_ms()
                );
                return;
            }
            Attempt::MirrorRefreshedEarly(status) => early.push(status),
        }
    }
    panic!(
        "the mirror refreshed before the annotation was handled in all {ATTEMPTS} attempts; the \
         scenario never happened: {early:?}{}",
        world.diagnostics()
    );
}

async fn scenario(world: &mut World, account: &str) -> Attempt {
    let services = world.services();
    let paydb = services.url("paydb");
    let payment = services.payments_as("executor/setup");
    open_account(&services.treasury_payments(), account, Some(1_000)).await;
    let lock = services.executor_locks();
    let session = lock
        .create_session(Some(60_000))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let key = format!("payout:{account}");
    let world = &*world;

    // The first grant, as the mirror shows it: the mirror has just refreshed, and its next
    // refresh is a whole period (15 s) away.
    let first = lock
        .acquire(&key, session.session_id, Some(60_000), None)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let row = wait_for_lock_row(world, NS, "the first grant in kubectl get locks", |r| {
        r.get("KEY") == Some(&key) && r.get("TOKEN") == Some(&first.fencing_token.to_string())
    })
    .unwrap_or_else(|e| panic!("{e}{}", world.diagnostics()));
    let name = row["NAME"].clone();

    // The key changes hands (the next payout's grant) before the mirror refreshes again.
    lock.release(&key, session.session_id, first.fencing_token)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let live = lock
        .acquire(&key, session.session_id, Some(60_000), None)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(live.fencing_token > first.fencing_token);
    annotate_revoke(world, &name, NS, "e2e: the holder looks stuck");
    let result = lock_status_until(
        world,
        &name,
        NS,
        "the Lock's status records the revocation's outcome",
        |status| {
            status["revocation"]["outcome"] == "Complete"
                || status["revocation"]["outcome"] == "Refused"
        },
    );
    // The scenario is the one named only if, when the revocation was recorded, the mirror still
    // showed the first grant.
    if result["token"] != first.fencing_token {
        return Attempt::MirrorRefreshedEarly(result);
    }
    let revocation = &result["revocation"];
    assert_eq!(revocation["outcome"], "Complete", "{revocation}");
    // The live grant is revoked, not the mirror's.
    let floor = floor_revoking(revocation, live.fencing_token);
    assert!(floor > live.fencing_token, "{revocation}");

    // The live holder is out: its grant is gone at the lock server (its renew is LOCK_LOST), and
    // both enforcement points hold the floor above its token.
    let renew = lock
        .renew(&key, session.session_id, live.fencing_token, Some(60_000))
        .await;
    assert!(
        matches!(&renew, Err(dlock_contract::client::ClientError::Api { status: 409, body })
            if body.code == dlock_contract::error::ErrorCode::LockLost),
        "{renew:?}"
    );
    assert_floor_at_both_points(&payment, &paydb, account, floor).await;
    eprintln!(
        "{account}: mirror showed {}, live {} revoked, floor {floor}",
        first.fencing_token, live.fencing_token
    );
    Attempt::Done
}
