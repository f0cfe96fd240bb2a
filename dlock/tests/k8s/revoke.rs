//! `kubectl annotate lock … dlock.io/revoke-reason=… dlock.io/revoked-by=…` on a lock that a
//! running `dlock run` executor holds: the operator revokes it at the real lock server and pushes
//! the new floor to the real payment resource and rail proxy (docs/design.md#d-3), and the
//! revoked token is FENCED_OUT at both.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use dlock_contract::payment_client::PaymentClient;
use dlock_devstack::{spawn_logged, wait_until};
use serde_json::Value;

use crate::locks::lock_rows;
use crate::shared::accounts::open_account;
use crate::shared::payouts::{Item, batch_manifest};
use crate::stack::{Stale, rail_high_water};
use crate::world::{EXE, World};

const NS: &str = "ops";
const ACCOUNT: &str = "acct-rev";
// Enough to hold the key for about a minute: the lock mirror polls every 15 s.
const PAYOUTS: usize = 40;

fn batch(name: &str) -> String {
    batch_manifest(
        name,
        1,
        (0..PAYOUTS).map(|i| Item::numbered(i, format!("item-{i}"), ACCOUNT, 1000)),
    )
}

/// The first row of `kubectl get locks -n ns` that `matches`, waited for up to 60 s; the wait's
/// error when none came.
pub(crate) fn wait_for_lock_row(
    world: &World,
    ns: &str,
    what: &str,
    matches: impl Fn(&BTreeMap<String, String>) -> bool,
) -> Result<BTreeMap<String, String>, String> {
    let mut row = BTreeMap::new();
    wait_until(what, Duration::from_secs(60), || {
        match lock_rows(world, ns).into_iter().find(|r| matches(r)) {
            Some(found) => {
                row = found;
                true
            }
            None => false,
        }
    })
    .map_err(|e| format!("{e:#}"))?;
    Ok(row)
}

/// `kubectl annotate lock name -n ns dlock.io/revoke-reason=reason dlock.io/revoked-by=alice`.
pub(crate) fn annotate_revoke(world: &World, name: &str, ns: &str, reason: &str) {
    world.kubectl(&[
        "annotate",
        "lock",
        name,
        "-n",
        ns,
        &format!("dlock.io/revoke-reason={reason}"),
        "dlock.io/revoked-by=alice",
    ]);
}

/// The Lock `name`'s status, read until `done` holds (up to 60 s).
pub(crate) fn lock_status_until(
    world: &World,
    name: &str,
    ns: &str,
    what: &str,
    done: impl Fn(&Value) -> bool,
) -> Value {
    world.wait_for(
        what,
        Duration::from_secs(60),
        || {
            world
                .try_kubectl(&["get", "lock", name, "-n", ns, "-o", "json"])
                .ok()
                .and_then(|t| serde_json::from_str::<Value>(&t).ok())
                .map(|l| l["status"].clone())
                .unwrap_or(Value::Null)
        },
        done,
    )
}

/// The floor a revocation's result (a Lock's `status.revocation`, a LockRevocation's
/// `status.result`) records, once it says the grant it revoked is the one of `token`.
#[track_caller]
pub(crate) fn floor_revoking(result: &Value, token: i64) -> i64 {
    assert_eq!(result["revokedToken"], token, "{result}");
    result["newTokenFloor"]
        .as_i64()
        .unwrap_or_else(|| panic!("{result}"))
}

/// Both enforcement points hold `floor` for `account`: the account's fence (through `payment`)
/// and the rail high-water mark (in paydb at `paydb`).
pub(crate) async fn assert_floor_at_both_points(
    payment: &PaymentClient,
    paydb: &str,
    account: &str,
    floor: i64,
) {
    let fence = payment
        .get_account(account)
        .await
        .unwrap_or_else(|e| panic!("{e}"))
        .fence;
    assert!(fence >= floor, "account fence {fence} < floor {floor}");
    let high = rail_high_water(paydb, account).await;
    assert!(high >= floor, "rail high-water {high} < floor {floor}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn kubectl_annotate_revokes_a_running_executors_lock_and_fences_it_out_at_both_points() {
    let mut world = World::with_operator(NS, &["--rail-latency-ms", "1500"]).await;
    world.apply_stack_ready(NS);
    let services = world.services();
    let payment = services.payments_as("executor/setup");
    // The executor's credential for the cycles, the registrar's for registering the batch.
    let run_env = services.run_env();
    let rail_url = services.url("railStub");
    let paydb = services.url("paydb");
    let proof_keys = services.line["proofKeysFile"]
        .as_str()
        .unwrap_or_else(|| panic!("dev up runs with fencing-token proofs: {}", services.line))
        .to_owned();
    let urls = [
        ("DLOCK_LOCK_SERVER", services.url("lockServer")),
        ("DLOCK_PAYMENT_RESOURCE", services.url("paymentResource")),
        ("DLOCK_RAIL_PROXY", services.url("railProxy")),
    ];
    open_account(&services.treasury_payments(), ACCOUNT, Some(1_000_000)).await;

    // A real executor: one worker, one payout after another on the account, each holding
    // payout:acct-rev for about the rail's 1.5 s.
    let manifest = world.cluster.dir().join("rev-batch.yaml");
    std::fs::write(&manifest, batch("rev-batch")).unwrap_or_else(|e| panic!("{e}"));
    let mut env: Vec<(String, String)> = urls
        .iter()
        .map(|(k, v)| ((*k).to_owned(), v.clone()))
        .collect();
    env.extend(run_env);
    env.push(("DLOCK_IDENTITY".into(), "executor".into()));
    let log = world.cluster.dir().join("executor.log");
    let mut run = spawn_logged(
        "dlock run",
        Path::new(EXE),
        &[
            "run".to_owned(),
            "-f".to_owned(),
            manifest.display().to_string(),
        ],
        &env,
        Some(&log),
    )
    .unwrap_or_else(|e| panic!("{e:#}"));

    // The held lock as kubectl shows it.
    let key = format!("payout:{ACCOUNT}");
    let row = wait_for_lock_row(
        &world,
        NS,
        "the executor's lock in kubectl get locks",
        |r| r.get("KEY") == Some(&key),
    )
    .unwrap_or_else(|e| {
        panic!(
            "{e}\n{}{}",
            std::fs::read_to_string(&log).unwrap_or_default(),
            world.diagnostics()
        )
    });
    let name = row["NAME"].clone();
    annotate_revoke(&world, &name, NS, "e2e: the worker looks stuck");
    let status = lock_status_until(
        &world,
        &name,
        NS,
        "the Lock's status records the revocation",
        |status| status["revocation"]["outcome"] == "Complete",
    );
    let result = &status["revocation"];
    assert_eq!(result["paymentFenced"], true, "{result}");
    assert_eq!(result["railFenced"], true, "{result}");
    let revoked = result["revokedToken"]
        .as_i64()
        .unwrap_or_else(|| panic!("{result}"));
    let floor = result["newTokenFloor"]
        .as_i64()
        .unwrap_or_else(|| panic!("{result}"));
    assert!(floor > revoked, "{result}");

    // Both enforcement points hold the floor, read from the services and paydb.
    assert_floor_at_both_points(&payment, &paydb, ACCOUNT, floor).await;

    // A write with the revoked token is FENCED_OUT at the account and at the rail.
    // The evicted worker still holds its grant: the revoked token and the lock server's proof of
    // it (signed here with the local stack's proof keys, as the grant carried it).
    let keys = dlock_server::proof::ProofKeys::load(Path::new(&proof_keys))
        .unwrap_or_else(|e| panic!("{e}"));
    let proof = keys
        .sign(&key, revoked)
        .unwrap_or_else(|| panic!("no signing key"));
    let stale = Stale {
        owner: "executor/stale",
        token: revoked,
        proof: Some(proof),
    };
    let (stale, claim) = stale
        .is_fenced_out_at_both_points(world.services(), ACCOUNT)
        .await;
    assert_eq!(claim["details"]["resourceType"], "account", "{claim}");

    // The Event a person sees.
    let events = world.kubectl(&[
        "get",
        "events",
        "-n",
        NS,
        "--field-selector",
        &format!("involvedObject.name={name}"),
    ]);
    assert!(
        events.contains("Revok"),
        "an Event names the revocation: {events}"
    );

    // The executor goes on (a new lock, a newer token) and finishes; the annotation, still on
    // the Lock, is not run a second time against the new holder.
    let exit = tokio::task::spawn_blocking(move || {
        let status = run.wait_exit(Duration::from_secs(120));
        (status, run)
    })
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    assert!(
        exit.0.is_some(),
        "the executor finished: {}",
        std::fs::read_to_string(&log).unwrap_or_default()
    );
    let lock = world.get_json(&["lock", &name, "-n", NS]);
    assert_eq!(
        lock["status"]["revocation"]["revocationId"], result["revocationId"],
        "one revocation per annotation value: {lock}"
    );
    let statement = dlock_contract::rail::read_statement(&rail_url, None)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let mut per_payout: BTreeMap<String, usize> = BTreeMap::new();
    for t in statement.transfers {
        *per_payout.entry(t.client_ref).or_default() += 1;
    }
    assert!(
        per_payout.values().all(|n| *n == 1),
        "nobody paid twice: {per_payout:?}"
    );
    assert!(
        !per_payout.contains_key(&stale.to_string()),
        "the stale write never reached the rail"
    );
    eprintln!(
        "revoked token {revoked}, floor {floor}; executor exit {:?}; scenario done in {} ms",
        exit.0,
        world.elapsed_ms()
    );
}
