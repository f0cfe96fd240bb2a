//! On the real API server, with the operator under the chart's RBAC: a PayoutBatch does not pick
//! who its executor runs as nor which Secret it mounts (docs/threat-model.md#deployments-made-by-the-operator).
//! A batch naming `serviceAccountName: dlock-service` (the services' own account) and one naming
//! a Secret its PaymentResource does not list get no Job and `Degraded/InvalidSpec` naming the
//! field. Control: the default batch gets its Job, running as `dlock-executor`, which the
//! operator made.

use std::time::Duration;

use serde_json::Value;

use crate::world::{World, condition};

const PAYOUTS: &str = "  payouts:\n  - key: p1\n    accountId: acct-1\n    amountMinor: 100\n    \
                       currency: EUR\n    beneficiaryRef: ben-1\n";

/// A PayoutBatch `name` of one payout from acct-1, `spec` (YAML lines under `spec:`) before it.
pub(crate) fn batch(name: &str, spec: &str) -> String {
    format!(
        "apiVersion: dlock.io/v1alpha1\nkind: PayoutBatch\nmetadata:\n  name: {name}\nspec:\n\
         {spec}{PAYOUTS}"
    )
}

/// The Jobs in `ns`.
pub(crate) fn jobs(world: &World, ns: &str) -> Vec<Value> {
    world.get_json(&["jobs", "-n", ns])["items"]
        .as_array()
        .cloned()
        .unwrap_or_default()
}

/// A world in `ns`: the services, the account acct-1 the batches pay from (the operator
/// registers a batch's payouts before it makes the Job), and the operator watching `ns` with
/// `env`.
pub(crate) async fn batch_world(ns: &str, env: &[(&str, &str)]) -> World {
    let mut world = World::with_namespace(ns).await;
    world.start_services(&[]);
    crate::shared::accounts::open_account(
        &world.services().treasury_payments(),
        "acct-1",
        Some(1_000_000),
    )
    .await;
    world.start_operator(&[ns], env);
    world
}

/// Applies `yaml`, the batch `name`, and waits until it is Degraded/InvalidSpec; the condition's
/// message.
pub(crate) fn refused_batch(world: &World, ns: &str, name: &str, yaml: &str) -> String {
    world.apply(ns, yaml).unwrap_or_else(|e| panic!("{e:#}"));
    let object = world.wait_for(
        &format!("the batch {name} is Degraded"),
        Duration::from_secs(60),
        || world.get_json(&["payoutbatch", name, "-n", ns]),
        |b: &Value| condition(b, "Degraded").is_some_and(|c| c["status"] == "True"),
    );
    let degraded = condition(&object, "Degraded").cloned().unwrap_or_default();
    assert_eq!(degraded["reason"], "InvalidSpec", "{name}: {degraded}");
    degraded["message"].as_str().unwrap_or_default().to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_payout_batch_cannot_choose_its_executors_service_account_or_secret() {
    let ns = "executors";
    let world = batch_world(ns, &[]).await;

    let refused = [
        (
            "as-service",
            "  executor:\n    serviceAccountName: dlock-service\n",
            "spec.executor.serviceAccountName",
            "spec.executorServiceAccounts",
        ),
        (
            "foreign-secret",
            "  executor:\n    identity: executor\n    credentialSecret: {name: paydb, key: url}\n",
            "spec.executor.credentialSecret",
            "spec.executorCredentialSecrets",
        ),
    ];
    for (name, executor, field, list) in refused {
        let message = refused_batch(&world, ns, name, &batch(name, executor));
        assert!(
            message.contains(field) && message.contains(list),
            "{name}: the condition names the field and what to do: {message}"
        );
    }

    // Control: the default batch gets its Job, running as the operator's dlock-executor.
    world
        .apply(ns, &batch("own", ""))
        .unwrap_or_else(|e| panic!("{e:#}"));
    world.wait_until(
        "the Job of the default batch",
        Duration::from_secs(60),
        || {
            jobs(&world, ns)
                .iter()
                .any(|j| j["metadata"]["name"] == "own-executor")
        },
    );
    let made = jobs(&world, ns);
    let names: Vec<&str> = made
        .iter()
        .filter_map(|j| j["metadata"]["name"].as_str())
        .collect();
    assert_eq!(names, ["own-executor"], "only the default batch has a Job");
    assert_eq!(
        made[0]["spec"]["template"]["spec"]["serviceAccountName"],
        "dlock-executor"
    );
    let account = world.get_json(&["serviceaccount", "dlock-executor", "-n", ns]);
    assert_eq!(
        account["metadata"]["labels"]["app.kubernetes.io/component"], "executor",
        "{account}"
    );
}
