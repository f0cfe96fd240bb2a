//! `kubectl apply -f payoutbatch.yaml` for real: the operator's executor Job runs `dlock run`
//! (through the test's kubelet) against the real services, and the rail's statement is the judge
//! of whether anybody was paid twice, across re-applies and a delete and re-create.

use std::collections::BTreeMap;
use std::time::Duration;

use dlock_contract::payment::PayoutState;
use dlock_contract::payment_client::PaymentClient;
use dlock_devstack::wait_until;
use serde_json::Value;

use crate::shared::accounts::open_account;
use crate::shared::payouts::{Item, batch_manifest};
use crate::world::{World, condition};

const NS: &str = "payroll";
const BATCH: &str = "payroll-2026-12";

/// The example batch with the executor's credential: the Secret the operator hands to the Job.
fn batch_yaml() -> String {
    crate::world::example_batch_with_executor_credential()
}

/// Every payout of the batch with its state, from the real payment resource.
async fn states(payment: &PaymentClient, accounts: &[&str]) -> BTreeMap<String, PayoutState> {
    let mut out = BTreeMap::new();
    for account in accounts {
        let page = payment
            .list_payouts(None, Some(account), Some(500), None)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        for p in page.items {
            out.insert(p.payout_id.to_string(), p.state);
        }
    }
    out
}

/// How many transfers the rail took per payout (clientRef).
async fn statement(rail: &str) -> BTreeMap<String, usize> {
    let statement = dlock_contract::rail::read_statement(rail, None)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let mut out = BTreeMap::new();
    for t in statement.transfers {
        *out.entry(t.client_ref).or_insert(0) += 1;
    }
    out
}

/// The batch's four payouts, each in `state` (`why` says what that shows).
async fn all_in(
    payment: &PaymentClient,
    accounts: &[&str],
    state: PayoutState,
    why: &str,
) -> BTreeMap<String, PayoutState> {
    let states = states(payment, accounts).await;
    assert_eq!(states.len(), 4, "{states:?}");
    assert!(states.values().all(|s| *s == state), "{why}: {states:?}");
    states
}

/// [`all_in`] `state`, each of them on the rail's statement once: the states and the statement.
async fn all_paid_once(
    payment: &PaymentClient,
    rail: &str,
    accounts: &[&str],
    state: PayoutState,
    why: &str,
) -> (BTreeMap<String, PayoutState>, BTreeMap<String, usize>) {
    let states = all_in(payment, accounts, state, why).await;
    let paid = statement(rail).await;
    for id in states.keys() {
        assert_eq!(paid.get(id), Some(&1), "payout {id} on the statement once");
    }
    (states, paid)
}

/// [`all_paid_once`] POSTED: every payout paid, once.
async fn all_posted_once(
    payment: &PaymentClient,
    rail: &str,
    accounts: &[&str],
) -> (BTreeMap<String, PayoutState>, BTreeMap<String, usize>) {
    let why = "every payout paid";
    all_paid_once(payment, rail, accounts, PayoutState::Posted, why).await
}

fn job_done(world: &World) -> bool {
    let job = world
        .try_kubectl(&[
            "get",
            "job",
            &format!("{BATCH}-executor"),
            "-n",
            NS,
            "-o",
            "json",
        ])
        .ok()
        .and_then(|t| serde_json::from_str::<Value>(&t).ok());
    job.is_some_and(|j| {
        j["status"]["conditions"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|c| (c["type"] == "Complete" || c["type"] == "Failed") && c["status"] == "True")
    })
}

/// A world with the payroll namespace, ready for a batch: the services started with
/// `dlock dev up ARGS`, the operator and the kubelet running, two funded accounts on the real
/// payment resource, the stack applied and the executor's Secret in place. Returns the world,
/// the payment client, the rail's URL (for its statement) and the accounts.
async fn payroll(args: &[&str]) -> (World, PaymentClient, String, [&'static str; 2]) {
    let mut world = World::with_operator(NS, args).await;
    world.start_kubelet(&[NS]);
    let services = world.services();
    let executor_token = services.token("executor");
    let payment = services.payments_as("executor/setup");
    let rail = services.url("railStub");
    let accounts = ["acct-17", "acct-18"];
    for account in accounts {
        open_account(&services.treasury_payments(), account, Some(1_000_000)).await;
    }
    world.apply_stack(NS);
    let secret = format!(
        "apiVersion: v1\nkind: Secret\nmetadata:\n  name: executor-credential\n\
         stringData:\n  token: {executor_token}\n"
    );
    world.apply(NS, &secret).unwrap_or_else(|e| panic!("{e:#}"));
    (world, payment, rail, accounts)
}

/// `kubectl apply -f examples/payoutbatch.yaml` (with the executor's credential).
fn apply_batch(world: &World) {
    world
        .apply(NS, &batch_yaml())
        .unwrap_or_else(|e| panic!("{e:#}"));
}

/// Waits until the batch's executor Job has ended (diagnostics on failure).
fn wait_job_done(world: &World, what: &str) {
    if let Err(e) = wait_until(what, Duration::from_secs(180), || job_done(world)) {
        panic!(
            "{e:#}\nran: {:?}{}",
            world.kubelet().ran(),
            world.diagnostics()
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn kubectl_apply_of_a_payout_batch_pays_each_payout_once_across_reapply_and_recreate() {
    let (mut world, payment, rail, accounts) = payroll(&[]).await;

    // kubectl apply -f examples/payoutbatch.yaml
    apply_batch(&world);
    // The operator creates the Job; the kubelet runs its pod; the Job controller completes it.
    wait_job_done(&world, "the executor Job ends");
    world.kubectl(&[
        "wait",
        "--for=condition=Complete",
        &format!("job/{BATCH}-executor"),
        "-n",
        NS,
        "--timeout=10s",
    ]);
    let ran = world.kubelet().ran();
    assert_eq!(ran.len(), 1, "one executor pod ran: {ran:?}");
    assert_eq!(ran[0].exit_code, Some(0));
    assert_eq!(ran[0].args.first().map(String::as_str), Some("run"));

    let (posted, paid) = all_posted_once(&payment, &rail, &accounts).await;

    // The batch's status, as kubectl shows it.
    world.wait_kubectl(
        "the batch's status counts",
        Duration::from_secs(60),
        &[
            "get",
            "payoutbatch",
            BATCH,
            "-n",
            NS,
            "-o",
            "jsonpath={.status.summary}",
        ],
        |s| s.contains("4"),
    );
    let table = world.kubectl(&["get", "payoutbatch", "-n", NS]);
    eprintln!("{table}");
    // Argo CD's health of each object as the API server holds it.
    for (kind, resource, name) in [
        ("PayoutBatch", "payoutbatch", BATCH),
        ("LockServer", "lockserver", "lock-server"),
        ("PaymentResource", "paymentresource", "payment-resource"),
        ("RailProxy", "railproxy", "rail-proxy"),
    ] {
        let object = world.get_json(&[resource, name, "-n", NS]);
        let (status, message) = crate::world::argocd_health(kind, &object);
        assert_eq!(status, "Healthy", "{kind} {name}: {message}");
    }

    // Re-apply: nothing changes, nobody is paid again.
    apply_batch(&world);
    // A sync with another worker count: accepted (nothing immutable is patched), and the
    // batch stays Ready without paying anyone again.
    let edited = batch_yaml().replace("workers: 8", "workers: 3");
    assert_ne!(edited, batch_yaml(), "the edit changes spec.workers");
    world.apply(NS, &edited).unwrap_or_else(|e| panic!("{e:#}"));
    let generation = world.get_json(&["payoutbatch", BATCH, "-n", NS])["metadata"]["generation"]
        .as_i64()
        .unwrap_or_default();
    world.wait_until("the edit is observed", Duration::from_secs(60), || {
        let object = world.get_json(&["payoutbatch", BATCH, "-n", NS]);
        object["status"]["observedGeneration"].as_i64() == Some(generation)
    });
    let object = world.get_json(&["payoutbatch", BATCH, "-n", NS]);
    let (status, message) = crate::world::argocd_health("PayoutBatch", &object);
    assert_eq!(status, "Healthy", "after the workers edit: {message}");
    assert_eq!(statement(&rail).await, paid, "the edit paid nobody");

    // An operator upgrade (a new image for the pods it builds): the finished Job is not patched
    // (its template is immutable), the batch says its Job is from an older template, and stays
    // Healthy.
    world.stop_operator(0);
    world.start_operator(&[NS], &[("DLOCK_OPERATOR_IMAGE", "dlock:e2e-upgraded")]);
    let job_image = |world: &World| {
        world.get_json(&["job", &format!("{BATCH}-executor"), "-n", NS])["spec"]["template"]["spec"]
            ["containers"][0]["image"]
            .clone()
    };
    let before_upgrade = job_image(&world);
    world.wait_until(
        "the upgraded operator notices the older Job template",
        Duration::from_secs(60),
        || {
            let object = world.get_json(&["payoutbatch", BATCH, "-n", NS]);
            object["status"]["conditions"]
                .as_array()
                .into_iter()
                .flatten()
                .any(|c| c["type"] == "JobTemplateCurrent" && c["status"] == "False")
        },
    );
    assert_eq!(job_image(&world), before_upgrade, "the Job was not patched");
    let object = world.get_json(&["payoutbatch", BATCH, "-n", NS]);
    let (status, message) = crate::world::argocd_health("PayoutBatch", &object);
    assert_eq!(status, "Healthy", "after the upgrade: {message}");

    // Delete and re-create the same file, as a cluster rebuilt from Git would: the new Job
    // runs `dlock run` again over the same payout ids, which are all POSTED.
    world.kubectl(&["delete", "payoutbatch", BATCH, "-n", NS, "--wait=true"]);
    world.kubectl(&[
        "wait",
        "--for=delete",
        &format!("job/{BATCH}-executor"),
        "-n",
        NS,
        "--timeout=120s",
    ]);
    apply_batch(&world);
    wait_job_done(&world, "the re-created batch's Job ends");
    let ran = world.kubelet().ran();
    assert_eq!(ran.len(), 2, "the re-created batch ran again: {ran:?}");
    assert_eq!(ran[1].exit_code, Some(0));
    let again = statement(&rail).await;
    assert_eq!(again, paid, "the rail's statement did not change");
    assert_eq!(states(&payment, &accounts).await, posted);
    eprintln!("scenario done in {} ms", world.elapsed_ms());
}

/// A PayoutBatch of `items` payouts, each as large as the schema allows (and the contract's
/// validator, which the operator applies before it writes the manifest).
fn largest_batch(name: &str, items: usize) -> String {
    use dlock_contract::payment::{ACCOUNT_ID_LEN_MAX, AMOUNT_MINOR_MAX, REFERENCE_LEN_MAX};
    let long = |prefix: &str, i: usize, len: usize| {
        let mut s = format!("{prefix}-{i:05}-");
        while s.len() < len {
            s.push('x');
        }
        s
    };
    batch_manifest(
        name,
        1,
        (0..items).map(|i| Item {
            key: long("k", i, dlock_contract::payout_batch::KEY_LEN_MAX),
            account: long("a", i, ACCOUNT_ID_LEN_MAX),
            amount_minor: AMOUNT_MINOR_MAX,
            beneficiary_ref: long("b", i, REFERENCE_LEN_MAX),
        }),
    )
}

/// The item limit really applies: the largest batch the schema admits goes through client-side
/// `kubectl apply` (whose last-applied annotation is capped at 256 KiB) and becomes a manifest
/// ConfigMap; one item more is refused by the API server itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_largest_payout_batch_the_schema_admits_applies_client_side_and_one_more_is_refused() {
    let ns = "big";
    let world = World::with_operator(ns, &[]).await;
    let crd = world.get_json(&["crd", "payoutbatches.dlock.io"]);
    let max = crd
        .pointer(
            "/spec/versions/0/schema/openAPIV3Schema/properties/spec/properties/payouts/maxItems",
        )
        .and_then(Value::as_u64)
        .unwrap_or_else(|| panic!("payouts has a maxItems"));
    let largest = largest_batch("largest", max as usize);
    world
        .cluster
        .kubectl_with_input(&["apply", "-n", ns, "-f", "-"], Some(&largest))
        .unwrap_or_else(|e| panic!("{max} of the largest items, client-side: {e:#}"));
    world.wait_kubectl(
        "the manifest ConfigMap",
        Duration::from_secs(60),
        &[
            "get",
            "configmap",
            "largest-manifest",
            "-n",
            ns,
            "-o",
            "name",
        ],
        |_| true,
    );
    let too_many = largest_batch("too-many", max as usize + 1);
    let refused = world
        .cluster
        .kubectl_with_input(&["apply", "-n", ns, "-f", "-"], Some(&too_many));
    let message = match refused {
        Ok(out) => panic!("{} items were accepted: {out}", max + 1),
        Err(e) => format!("{e:#}"),
    };
    assert!(message.contains("must have at most"), "{message}");
    eprintln!(
        "maxItems {max}: {} bytes of YAML accepted; scenario done in {} ms",
        largest.len(),
        world.elapsed_ms()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_batch_on_a_rail_that_redirects_is_degraded_naming_its_ambiguous_payouts_and_pays_nobody_twice()
 {
    // Every transfer is taken by the rail, then answered with `307` (a gateway that redirects):
    // the proxy follows no redirect, so no payout's outcome can be read.
    let (world, payment, rail, accounts) = payroll(&["--rail-redirect-rate", "1"]).await;
    apply_batch(&world);
    wait_job_done(&world, "the executor Job ends");

    // The rail took each transfer once: no redirect was followed, nothing was sent again.
    let (states, _) = all_paid_once(
        &payment,
        &rail,
        &accounts,
        PayoutState::RailAmbiguous,
        "every payout left the automated path",
    )
    .await;

    // The batch names its ambiguous payouts; Argo CD's health says Degraded with the same words.
    let object = world.wait_for(
        "the batch is Degraded",
        Duration::from_secs(60),
        || world.get_json(&["payoutbatch", BATCH, "-n", NS]),
        |object| condition(object, "Degraded").is_some_and(|c| c["status"] == "True"),
    );
    let degraded = condition(&object, "Degraded").cloned().unwrap_or_default();
    assert_eq!(degraded["reason"], "RailAmbiguous", "{degraded}");
    assert_eq!(
        object["status"]["ambiguousCount"], 4,
        "{}",
        object["status"]
    );
    let listed: Vec<&str> = object["status"]["ambiguous"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .collect();
    let mut expected: Vec<&str> = states.keys().map(String::as_str).collect();
    let mut got = listed.clone();
    expected.sort_unstable();
    got.sort_unstable();
    assert_eq!(
        got, expected,
        "status.ambiguous lists every ambiguous payout"
    );
    let (health, message) = crate::world::argocd_health("PayoutBatch", &object);
    assert_eq!(health, "Degraded", "{message}");
    for id in &listed {
        assert!(
            message.contains(id),
            "the health message names {id}: {message}"
        );
    }
    let events = world.get_json(&[
        "events",
        "-n",
        NS,
        "--field-selector",
        &format!("involvedObject.name={BATCH},reason=RailAmbiguous,type=Warning"),
    ]);
    assert!(
        events["items"].as_array().is_some_and(|i| !i.is_empty()),
        "a Warning Event: {events}"
    );
    eprintln!("scenario done in {} ms", world.elapsed_ms());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_executor_waits_for_a_rail_proxy_whose_read_timeout_is_above_the_default() {
    // The rail answers after 11 s; the proxy waits up to 14 s for it. An executor that waited
    // only the default (8 s read timeout + 2 s) would give up first and record ambiguity.
    let (world, payment, rail, accounts) = payroll(&[
        "--rail-latency-ms",
        "9500",
        "--rail-read-timeout-ms",
        "14000",
    ])
    .await;
    world.kubectl(&[
        "patch",
        "railproxy/rail-proxy",
        "-n",
        NS,
        "--type=merge",
        "-p",
        r#"{"spec":{"readTimeoutMs":14000}}"#,
    ]);
    let started = std::time::Instant::now();
    apply_batch(&world);
    wait_job_done(&world, "the executor Job ends");
    let took = started.elapsed();

    all_paid_once(
        &payment,
        &rail,
        &accounts,
        PayoutState::Posted,
        "every slow answer was waited for",
    )
    .await;
    // One cycle per payout, each one settled: no submit gave up on its answer (a cycle that
    // did not get its answer ends otherwise and the payout takes another cycle to be re-read).
    let ran = world.kubelet().ran();
    let log = std::fs::read_to_string(&ran[0].log).unwrap_or_default();
    assert!(
        log.contains("(4 cycles,") && log.contains("cycles           4 Settled\n"),
        "the executor's report: {log}"
    );
    // The timeout reached the executor through the manifest ConfigMap.
    let manifest = world.get_json(&["configmap", &format!("{BATCH}-manifest"), "-n", NS]);
    assert_eq!(
        manifest["data"]["rail-read-timeout-ms"], "14000",
        "{}",
        manifest["data"]
    );
    eprintln!(
        "4 payouts at 11 s each in {} ms; scenario done in {} ms",
        took.as_millis(),
        world.elapsed_ms()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn deleting_a_running_batch_abandons_what_never_reached_the_rail_and_pays_nobody_twice() {
    // A slow rail keeps the executor mid-batch: one payout per account at the rail, the other
    // still PENDING behind it.
    let (world, payment, rail, accounts) = payroll(&["--rail-latency-ms", "3000"]).await;
    apply_batch(&world);
    let mut seen = BTreeMap::new();
    let mid_batch = async {
        for _ in 0..600 {
            seen = states(&payment, &accounts).await;
            let at_rail = seen.values().any(|s| {
                matches!(
                    s,
                    PayoutState::Submitting | PayoutState::RailAcked | PayoutState::Posted
                )
            });
            let pending = seen.values().any(|s| *s == PayoutState::Pending);
            if seen.len() == 4 && at_rail && pending {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        false
    };
    assert!(
        mid_batch.await,
        "the batch never was mid-way: {seen:?}{}",
        world.diagnostics()
    );

    // kubectl delete waits for the finalizer: the executor drained, then the cancel.
    let deleted = std::time::Instant::now();
    if let Err(e) = world.try_kubectl(&[
        "delete",
        "payoutbatch",
        BATCH,
        "-n",
        NS,
        "--wait=true",
        "--timeout=120s",
    ]) {
        panic!(
            "{e:#}\noperator log:\n{}{}",
            world.operator_log(0),
            world.diagnostics()
        );
    }
    let took = deleted.elapsed();
    let after = states(&payment, &accounts).await;
    assert!(
        after
            .values()
            .all(|s| !matches!(s, PayoutState::Pending | PayoutState::Claimed)),
        "nothing is left to be claimed: {after:?}"
    );
    let abandoned: Vec<&String> = after
        .iter()
        .filter(|(_, s)| **s == PayoutState::Abandoned)
        .map(|(id, _)| id)
        .collect();
    assert!(!abandoned.is_empty(), "{after:?}");
    let paid = statement(&rail).await;
    for id in &abandoned {
        assert_eq!(
            paid.get(*id),
            None,
            "abandoned payout {id} is not on the statement"
        );
    }
    for (id, n) in &paid {
        assert_eq!(*n, 1, "payout {id} on the statement once");
    }
    let events = world.get_json(&[
        "events",
        "-n",
        NS,
        "--field-selector",
        &format!("involvedObject.name={BATCH},reason=PayoutsCancelled"),
    ]);
    let note = events["items"][0]["message"].as_str().unwrap_or_default();
    assert!(
        note.contains(&format!("{} payout(s)", abandoned.len())),
        "the Event counts the abandoned payouts: {events}"
    );
    // Re-applying the same file after the delete pays nothing that was abandoned.
    apply_batch(&world);
    wait_job_done(&world, "the re-applied batch's Job ends");
    let again = statement(&rail).await;
    for id in &abandoned {
        assert_eq!(again.get(*id), None, "abandoned payout {id} stays unpaid");
    }
    eprintln!(
        "mid-batch {seen:?}; after the delete ({} ms): {after:?}; scenario done in {} ms",
        took.as_millis(),
        world.elapsed_ms()
    );
}

/// Whoever may write a ConfigMap in the namespace writes into `dlock-telemetry` a setting the
/// executor would obey from its environment: `DLOCK_CREDENTIAL_FILE` (read before the Secret's
/// `DLOCK_CREDENTIAL`) and `DLOCK_WORKERS`. The pod reads only the telemetry keys, one by one:
/// the executor keeps its real credential and the batch is paid, each payout once. The same
/// ConfigMap's `DLOCK_LOG` does reach it (its log has debug lines): the positive control.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_telemetry_config_map_cannot_change_the_executors_credential() {
    let (world, payment, rail, accounts) = payroll(&[]).await;
    let hostile = "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: dlock-telemetry\ndata:\n  \
                   DLOCK_LOG: debug\n  DLOCK_CREDENTIAL_FILE: /nonexistent/attacker-token\n  \
                   DLOCK_WORKERS: \"1\"\n";
    world.apply(NS, hostile).unwrap_or_else(|e| panic!("{e:#}"));
    apply_batch(&world);
    wait_job_done(&world, "the executor Job ends");
    let ran = world.kubelet().ran();
    assert_eq!(ran.len(), 1, "one executor pod ran: {ran:?}");
    let log = std::fs::read_to_string(&ran[0].log).unwrap_or_default();
    assert_eq!(
        ran[0].exit_code,
        Some(0),
        "the executor kept its credential: {log}"
    );
    assert!(
        log.contains("DEBUG"),
        "DLOCK_LOG from the telemetry ConfigMap reached the executor: {log}"
    );
    assert!(!log.contains("attacker-token"), "{log}");
    all_posted_once(&payment, &rail, &accounts).await;
}
