//! The operator confined to a list of namespaces (the chart's `watchNamespaces`, the operator's
//! `--watch-namespace`): the chart gives its ServiceAccount Roles in those namespaces only, no
//! ClusterRole, and the operator watches only there. On the real API server, with the operator
//! running under that RBAC: the stack in the watched namespace is reconciled; the same stack in
//! another namespace is left alone, and the operator's own token is refused there.

use std::process::Command;
use std::time::Duration;

use serde_json::Value;

use crate::shared::process::succeeded;
use crate::world::{OPERATOR_ACCOUNT, OPERATOR_NAMESPACE, World, render_chart};

const WATCHED: &str = "confined-a";
const OTHER: &str = "confined-b";

/// `kubectl auth can-i VERB RESOURCE -n NAMESPACE` (`--all-namespaces` for `*`) as the
/// operator's ServiceAccount (the admin impersonating it): true for "yes", false for "no";
/// anything else fails the test.
fn operator_can(world: &World, verb: &str, resource: &str, namespace: &str) -> bool {
    let scope = if namespace == "*" {
        vec!["--all-namespaces".to_owned()]
    } else {
        vec!["-n".to_owned(), namespace.to_owned()]
    };
    let output = Command::new(world.cluster.kubectl_path())
        .arg(format!(
            "--kubeconfig={}",
            world.cluster.kubeconfig().display()
        ))
        .args([
            "auth",
            "can-i",
            &format!("--as=system:serviceaccount:{OPERATOR_NAMESPACE}:{OPERATOR_ACCOUNT}"),
            verb,
            resource,
        ])
        .args(&scope)
        .output()
        .unwrap_or_else(|e| panic!("kubectl auth can-i: {e}"));
    match String::from_utf8_lossy(&output.stdout).trim() {
        "yes" => true,
        "no" => false,
        other => panic!(
            "kubectl auth can-i {verb} {resource} -n {namespace} answered {other:?}: {}",
            String::from_utf8_lossy(&output.stderr)
        ),
    }
}

/// The names of the `kind` objects in `namespace` the operator made (its managed-by label).
fn managed(world: &World, kind: &str, namespace: &str) -> Vec<String> {
    let list = world.get_json(&[
        kind,
        "-n",
        namespace,
        "-l",
        "app.kubernetes.io/managed-by=dlock-operator",
    ]);
    list["items"]
        .as_array()
        .map(|items| {
            items
                .iter()
                .filter_map(|o| o["metadata"]["name"].as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default()
}

/// The `status` of each custom resource of examples/stack.yaml in `namespace`.
fn statuses(world: &World, namespace: &str) -> Vec<(String, Value)> {
    [
        "lockserver/lock-server",
        "paymentresource/payment-resource",
        "railproxy/rail-proxy",
    ]
    .iter()
    .map(|object| {
        let read = world.get_json(&[object, "-n", namespace]);
        ((*object).to_owned(), read["status"].clone())
    })
    .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_operator_confined_to_one_namespace_reconciles_there_and_has_no_rights_elsewhere() {
    let mut world = World::start().await;
    world.namespace(WATCHED);
    world.namespace(OTHER);
    // The chart as installed with watchNamespaces=[WATCHED]. World::start applied the default
    // rendering; its ClusterRole and ClusterRoleBinding go, as `helm upgrade` would remove them.
    let confined = render_chart(&[&format!(r#"{{"watchNamespaces": ["{WATCHED}"]}}"#)]);
    assert!(
        !confined.lines().any(|l| l == "kind: ClusterRole"),
        "the confined chart renders a ClusterRole"
    );
    // kubectl applies one namespace at a time: the Role and RoleBinding in WATCHED, the rest
    // (the Deployment with the flag, the Lease's Role) in the release namespace.
    let in_watched = format!("  namespace: {WATCHED}");
    let (watched, release): (Vec<&str>, Vec<&str>) = confined
        .split("\n---\n")
        .partition(|document| document.lines().any(|l| l == in_watched));
    assert_eq!(
        watched.len(),
        2,
        "the confined chart's objects in {WATCHED}: {watched:?}"
    );
    for (namespace, documents) in [(WATCHED, watched), (OPERATOR_NAMESPACE, release)] {
        world
            .apply(namespace, &documents.join("\n---\n"))
            .unwrap_or_else(|e| panic!("the confined chart was refused in {namespace}: {e:#}"));
    }
    world.kubectl(&[
        "delete",
        "clusterrolebinding/dlock-operator",
        "clusterrole/dlock-operator",
    ]);

    // RBAC: what the chart's ServiceAccount may do, in the watched namespace and elsewhere.
    for (verb, resource) in [
        ("create", "deployments"),
        ("list", "lockservers.dlock.io"),
        ("patch", "lockservers.dlock.io/status"),
        ("create", "secrets"),
        ("create", "jobs"),
    ] {
        assert!(
            operator_can(&world, verb, resource, WATCHED),
            "the operator may not {verb} {resource} in {WATCHED}"
        );
        assert!(
            !operator_can(&world, verb, resource, OTHER),
            "the operator may {verb} {resource} in {OTHER}"
        );
    }
    assert!(
        !operator_can(&world, "list", "lockservers.dlock.io", "*"),
        "the operator may list LockServers cluster-wide"
    );
    // The attack itself, with the ServiceAccount's real token: a Deployment in the other
    // namespace is refused by the API server (and the same request in the watched one passes,
    // as a server-side dry run).
    let token = world.service_account_kubeconfig(
        OPERATOR_NAMESPACE,
        OPERATOR_ACCOUNT,
        "confined-operator.kubeconfig",
    );
    let create = |namespace: &str| {
        Command::new(world.cluster.kubectl_path())
            .arg(format!("--kubeconfig={}", token.display()))
            .args([
                "create",
                "deployment",
                "intruder",
                "--image=dlock:e2e",
                "--dry-run=server",
                "-n",
                namespace,
            ])
            .output()
            .unwrap_or_else(|e| panic!("kubectl create deployment: {e}"))
    };
    let allowed = create(WATCHED);
    succeeded(&allowed, &format!("a Deployment in {WATCHED} was refused"));
    let refused = create(OTHER);
    let message = String::from_utf8_lossy(&refused.stderr);
    assert!(
        !refused.status.success() && message.contains("forbidden"),
        "a Deployment in {OTHER} was not forbidden: {message}"
    );

    // The operator as a process with that token, confined to WATCHED; the same stack in both
    // namespaces, the unwatched one first.
    let (index, _) = world.start_operator(
        &[WATCHED, OTHER],
        &[("DLOCK_OPERATOR_WATCH_NAMESPACES", WATCHED)],
    );
    world.apply_stack(OTHER);
    // Positive control: the watched namespace's stack is reconciled, through namespaced watches
    // only (a cluster-wide list would be forbidden and nothing would be reconciled).
    world.apply_stack_ready(WATCHED);
    assert!(
        managed(&world, "deployments", WATCHED).contains(&"lock-server".to_owned()),
        "no lock-server Deployment in {WATCHED}"
    );
    for (object, status) in statuses(&world, WATCHED) {
        assert!(status.is_object(), "{object} in {WATCHED} has no status");
    }
    // Wait until the operator has reconciled all three kinds in WATCHED (each has a status with
    // conditions), so the unwatched namespace's objects, applied earlier, had the same chance.
    world.wait_until(
        "every kind reconciled in the watched namespace",
        Duration::from_secs(120),
        || {
            statuses(&world, WATCHED)
                .iter()
                .all(|(_, s)| s["conditions"].as_array().is_some_and(|c| !c.is_empty()))
        },
    );

    // The other namespace: nothing made (the kinds the watched namespace shows the operator
    // makes, and the rest it may make), no status written.
    for kind in [
        "deployments",
        "services",
        "networkpolicies",
        "serviceaccounts",
    ] {
        assert!(
            !managed(&world, kind, WATCHED).is_empty(),
            "positive control: no {kind} made in {WATCHED}"
        );
    }
    for kind in [
        "deployments",
        "services",
        "networkpolicies",
        "serviceaccounts",
        "configmaps",
        "secrets",
        "poddisruptionbudgets",
        "jobs",
        "locks.dlock.io",
    ] {
        assert_eq!(
            managed(&world, kind, OTHER),
            Vec::<String>::new(),
            "the operator made {kind} in {OTHER}"
        );
    }
    for (object, status) in statuses(&world, OTHER) {
        assert!(
            status.is_null(),
            "{object} in {OTHER} has a status: {status}"
        );
    }
    let events = |namespace: &str| -> Vec<String> {
        let list = world.get_json(&["events.events.k8s.io", "-n", namespace]);
        list["items"]
            .as_array()
            .map(|items| {
                items
                    .iter()
                    .filter(|e| e["reportingController"] == "dlock-operator")
                    .map(|e| format!("{} {}", e["reason"], e["regarding"]["name"]))
                    .collect()
            })
            .unwrap_or_default()
    };
    assert!(
        !events(WATCHED).is_empty(),
        "positive control: no Event of the operator in {WATCHED}"
    );
    assert_eq!(
        events(OTHER),
        Vec::<String>::new(),
        "the operator published Events in {OTHER}"
    );
    let log = world.operator_log(index);
    assert!(
        !log.contains(&format!("{OTHER}/")),
        "the operator's log names an object of {OTHER}:\n{log}"
    );
    eprintln!(
        "confined operator: {WATCHED} reconciled, {OTHER} untouched and forbidden, {} ms",
        world.elapsed_ms()
    );
}
