//! A LockRevocation from a manifest, guarded by the revoked token: it outlives the lock and a
//! leader change and finishes its fences with the recorded floor, and the same manifest
//! re-created later (a cluster rebuilt from Git) never revokes a newer holder.

use std::time::Duration;

use dlock_devstack::free_port;
use serde_json::Value;

use crate::revoke::floor_revoking;
use crate::shared::accounts::open_account;
use crate::stack::{Held, hold, rail_high_water};
use crate::world::{SERVICE_PORT, World};

const NS: &str = "gitops";
const ACCOUNT: &str = "acct-git";
const NAME: &str = "revoke-acct-git";

fn manifest(expected_token: i64) -> String {
    format!(
        "apiVersion: dlock.io/v1alpha1\nkind: LockRevocation\nmetadata:\n  name: {NAME}\nspec:\n  \
         key: payout:{ACCOUNT}\n  accountId: {ACCOUNT}\n  reason: e2e executor wedged past its lease\n  \
         revokedBy: oncall-ana\n  expectedToken: {expected_token}\n"
    )
}

fn result(world: &World) -> Value {
    world
        .try_kubectl(&["get", "lockrevocation", NAME, "-n", NS, "-o", "json"])
        .ok()
        .and_then(|t| serde_json::from_str::<Value>(&t).ok())
        .map(|r| r["status"]["result"].clone())
        .unwrap_or(Value::Null)
}

fn wait_result(world: &World, what: &str, check: impl Fn(&Value) -> bool) -> Value {
    world.wait_for(what, Duration::from_secs(90), || result(world), check)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_lock_revocation_survives_the_lock_and_a_leader_change_and_never_revokes_a_newer_holder()
{
    let mut world = World::with_namespace(NS).await;
    let services = world.services();
    let executor = services.token("executor");
    let lock_url = services.url("lockServer");
    let treasury = services.treasury_payments();
    let paydb = services.url("paydb");
    // The first operator cannot reach the rail proxy (its address leads nowhere): the account
    // fence is pushed, the rail's is not.
    let nowhere = free_port().unwrap_or_else(|e| panic!("{e}"));
    let mut map = world.service_addresses(&[NS]);
    map = map
        .split(',')
        .map(|entry| {
            if entry.starts_with(&format!("rail-proxy.{NS}.svc:{SERVICE_PORT}=")) {
                format!("rail-proxy.{NS}.svc:{SERVICE_PORT}=127.0.0.1:{nowhere}")
            } else {
                entry.to_owned()
            }
        })
        .collect::<Vec<_>>()
        .join(",");
    let (first, _) = world.start_operator(&[NS], &[("DLOCK_SERVICE_ADDRESSES", &map)]);
    world.apply_stack_ready(NS);
    open_account(&treasury, ACCOUNT, None).await;
    let key = format!("payout:{ACCOUNT}");
    let Held {
        client: holder,
        grant,
        ..
    } = hold(&lock_url, &executor, "executor/wedged", &key).await;

    // kubectl apply -f lockrevocation.yaml, guarded by the wedged holder's token.
    world
        .apply(NS, &manifest(grant.fencing_token))
        .unwrap_or_else(|e| panic!("{e:#}"));
    let incomplete = wait_result(&world, "the revocation, one fence short", |r| {
        r["outcome"] == "Incomplete" && r["paymentFenced"] == true
    });
    assert_eq!(incomplete["railFenced"], false, "{incomplete}");
    let floor = floor_revoking(&incomplete, grant.fencing_token);
    let info = holder.get(&key).await.unwrap_or_else(|e| panic!("{e}"));
    assert!(!info.held, "the lock server revoked the grant: {info:?}");

    // The lock is gone from the mirror; the LockRevocation stays.
    world.wait_kubectl(
        "the Lock leaves the mirror",
        Duration::from_secs(60),
        &["get", "locks", "-n", NS, "-o", "name"],
        |t| t.trim().is_empty(),
    );
    assert!(
        world
            .try_kubectl(&["get", "lockrevocation", NAME, "-n", NS])
            .is_ok()
    );

    // A leader change: the first operator stops, a second one (which reaches the rail proxy)
    // takes the Lease and finishes the rail's fence with the recorded floor, without a second
    // L8.
    world.stop_operator(first);
    world.start_operator(&[NS], &[]);
    let complete = wait_result(&world, "the revocation completes", |r| {
        r["outcome"] == "Complete"
    });
    assert_eq!(complete["railFenced"], true, "{complete}");
    assert_eq!(
        complete["newTokenFloor"], floor,
        "the recorded floor: {complete}"
    );
    assert_eq!(
        complete["revocationId"], incomplete["revocationId"],
        "the same revocation, resumed"
    );
    let high = rail_high_water(&paydb, ACCOUNT).await;
    assert!(high >= floor, "rail high-water {high} < floor {floor}");

    // A newer holder takes the key. The same manifest, deleted and re-created as a cluster
    // rebuilt from Git would, is refused by the token guard and leaves the newer holder alone.
    let Held {
        client: newer,
        session: next_session,
        grant: next,
    } = hold(&lock_url, &executor, "executor/next", &key).await;
    assert!(next.fencing_token > floor);
    world.kubectl(&["delete", "lockrevocation", NAME, "-n", NS, "--wait=true"]);
    world
        .apply(NS, &manifest(grant.fencing_token))
        .unwrap_or_else(|e| panic!("{e:#}"));
    let refused = wait_result(&world, "the re-created revocation is refused", |r| {
        r["outcome"] == "Refused"
    });
    assert!(
        refused["revocationId"].is_null(),
        "no new revocation: {refused}"
    );
    let info = newer.get(&key).await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        (info.held, info.fencing_token),
        (true, Some(next.fencing_token)),
        "the newer holder keeps its lock"
    );
    newer
        .renew(&key, next_session.session_id, next.fencing_token, None)
        .await
        .unwrap_or_else(|e| panic!("the newer holder's grant is intact: {e}"));
    eprintln!(
        "floor {floor}; refused: {}; scenario done in {} ms",
        refused["summary"],
        world.elapsed_ms()
    );
}
