//! The first conversations with a real API server: what it accepts, what its CEL refuses, what
//! the operator makes of a stack and what the garbage collector takes away again.

use serde_json::Value;

use crate::world::{OPERATOR_NAMESPACE, World, condition, repo};

fn example(name: &str) -> String {
    let path = repo().join("examples").join(name);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// `metadata.generation` and `status.observedGeneration` of one object.
fn generations(object: &Value) -> (i64, i64) {
    (
        object["metadata"]["generation"].as_i64().unwrap_or(-1),
        object["status"]["observedGeneration"]
            .as_i64()
            .unwrap_or(-2),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_api_server_accepts_the_crds_the_chart_and_every_example_and_its_cel_refuses_a_backend_switch()
 {
    let world = World::start().await;

    // Every CRD is served, with its printer columns and short names.
    let crds = world.get_json(&["crd"]);
    let mut names: Vec<&str> = crds["items"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|c| c["metadata"]["name"].as_str())
        .collect();
    names.sort_unstable();
    assert_eq!(
        names,
        [
            "lockrevocations.dlock.io",
            "locks.dlock.io",
            "lockservers.dlock.io",
            "paymentresources.dlock.io",
            "payoutbatches.dlock.io",
            "railproxies.dlock.io",
            "reconciliations.dlock.io",
        ]
    );

    // The chart's operator Deployment is scheduled onto a fake node and becomes Available:
    // the scheduler, the Deployment and ReplicaSet controllers and KWOK all took part.
    world.kubectl(&[
        "wait",
        "--for=condition=Available",
        "deployment/dlock-operator",
        "-n",
        OPERATOR_NAMESPACE,
        "--timeout=120s",
    ]);
    let pods = world.get_json(&[
        "pods",
        "-n",
        OPERATOR_NAMESPACE,
        "-l",
        "app.kubernetes.io/component=operator",
    ]);
    let pods = pods["items"].as_array().cloned().unwrap_or_default();
    assert_eq!(pods.len(), 2, "replicaCount 2");
    for pod in &pods {
        assert!(pod["spec"]["nodeName"].as_str().is_some(), "scheduled");
        assert_eq!(pod["status"]["phase"], "Running");
    }

    // Every example applies as it is, each into a namespace of its own.
    let mut files: Vec<String> = std::fs::read_dir(repo().join("examples"))
        .unwrap_or_else(|e| panic!("{e}"))
        .filter_map(|e| Some(e.ok()?.file_name().to_string_lossy().into_owned()))
        .filter(|n| n.ends_with(".yaml"))
        .collect();
    files.sort();
    assert!(files.len() >= 5, "examples: {files:?}");
    for file in &files {
        let namespace = format!("ex-{}", file.trim_end_matches(".yaml")).replace('_', "-");
        world.namespace(&namespace);
        world
            .apply(&namespace, &example(file))
            .unwrap_or_else(|e| panic!("examples/{file} was refused: {e:#}"));
    }

    // The API server's own CEL rule keeps the backend: switching it live would split the
    // lock state in two.
    let stack = example("stack.yaml");
    let lock_server = stack
        .split("\n---\n")
        .find(|d| d.contains("kind: LockServer"))
        .unwrap_or_else(|| panic!("stack.yaml has no LockServer"));
    let switched = lock_server.replace("type: pg", "type: etcd").replace(
        "pg:\n      urlSecret: {name: lockdb, key: url}",
        "etcd:\n      endpoints: [\"http://etcd:2379\"]",
    );
    assert_ne!(switched, lock_server, "the switch edits the document");
    let message = match world.apply("ex-stack", &switched) {
        Ok(out) => panic!("a backend switch must be refused, kubectl said: {out}"),
        Err(refused) => format!("{refused:#}"),
    };
    assert!(
        message.contains("spec.backend is immutable"),
        "the rule's message reaches kubectl: {message}"
    );
    let kept = world.get_json(&["lockserver", "lock-server", "-n", "ex-stack"]);
    assert_eq!(kept["spec"]["backend"]["type"], "pg");
    eprintln!("scenario done in {} ms", world.elapsed_ms());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_stack_becomes_ready_workloads_and_deleting_a_resource_collects_what_it_owned() {
    let ns = "shop";
    let world = World::with_operator(ns, &[]).await;
    world
        .apply(ns, &crate::world::without_tls(&example("stack.yaml")))
        .unwrap_or_else(|e| panic!("{e:#}"));

    let kinds = [
        "lockserver/lock-server",
        "paymentresource/payment-resource",
        "railproxy/rail-proxy",
    ];
    for kind in kinds {
        world.wait_ready(kind, ns, "120s");
        let object = world.get_json(&[kind, "-n", ns]);
        let (generation, observed) = generations(&object);
        assert_eq!(observed, generation, "{kind}: observedGeneration");
        let ready = condition(&object, "Ready").unwrap_or_else(|| panic!("{kind}: no Ready"));
        assert_eq!(ready["observedGeneration"], generation, "{kind}: {ready}");
    }

    // What the operator made, as the API server and the controllers see it.
    world.kubectl(&[
        "wait",
        "--for=condition=Available",
        "deployment",
        "--all",
        "-n",
        ns,
        "--timeout=120s",
    ]);
    let deployments = world.get_json(&["deployments", "-n", ns]);
    let mut names: Vec<String> = deployments["items"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|d| {
            d["metadata"]["name"]
                .as_str()
                .unwrap_or_default()
                .to_owned()
        })
        .collect();
    names.sort();
    assert_eq!(
        names,
        [
            "lock-server",
            "payment-resource",
            "rail-proxy",
            "rail-proxy-stub"
        ]
    );
    for deployment in deployments["items"].as_array().into_iter().flatten() {
        let name = &deployment["metadata"]["name"];
        assert_eq!(
            deployment["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"], 0,
            "{name}"
        );
        assert_eq!(
            deployment["status"]["readyReplicas"], deployment["spec"]["replicas"],
            "{name}: every pod Ready"
        );
    }
    let pods = world.get_json(&["pods", "-n", ns]);
    for pod in pods["items"].as_array().into_iter().flatten() {
        let ready = condition(pod, "Ready").map(|c| c["status"].clone());
        assert_eq!(
            ready,
            Some(Value::from("True")),
            "{}",
            pod["metadata"]["name"]
        );
    }
    let owned = world.kubectl(&[
        "get",
        "service,poddisruptionbudget,networkpolicy,configmap",
        "-n",
        ns,
        "-o",
        "name",
    ]);
    for expected in [
        "service/lock-server",
        "service/payment-resource",
        "service/rail-proxy",
        "service/rail-proxy-stub",
        "poddisruptionbudget.policy/lock-server",
        "poddisruptionbudget.policy/payment-resource",
        "poddisruptionbudget.policy/rail-proxy",
        "networkpolicy.networking.k8s.io/rail-proxy-stub",
    ] {
        assert!(
            owned.lines().any(|l| l == expected),
            "{expected} in {owned}"
        );
    }

    // Deleting the LockServer: the garbage collector (kube-controller-manager) removes what it
    // owned, and nothing of the others.
    let before = world.kubectl(&[
        "get",
        "deployment/lock-server",
        "service/lock-server",
        "poddisruptionbudget/lock-server",
        "-n",
        ns,
        "-o",
        "name",
    ]);
    assert_eq!(before.lines().count(), 3, "present before: {before}");
    world.kubectl(&["delete", "lockserver/lock-server", "-n", ns, "--wait=true"]);
    world.kubectl(&[
        "wait",
        "--for=delete",
        "deployment/lock-server",
        "service/lock-server",
        "poddisruptionbudget/lock-server",
        "-n",
        ns,
        "--timeout=120s",
    ]);
    world.kubectl(&[
        "wait",
        "--for=delete",
        "pod",
        "-l",
        "app.kubernetes.io/component=lock-server",
        "-n",
        ns,
        "--timeout=120s",
    ]);
    let left = world.kubectl(&["get", "deployment", "-n", ns, "-o", "name"]);
    assert_eq!(
        left.lines().collect::<Vec<_>>(),
        [
            "deployment.apps/payment-resource",
            "deployment.apps/rail-proxy",
            "deployment.apps/rail-proxy-stub"
        ]
    );
    eprintln!("scenario done in {} ms", world.elapsed_ms());
}
