//! dlock's pods on a real node (real_node.rs): the chart installed with helm as the README says,
//! the example stack and batch applied with kubectl, every pod run by the kubelet in containerd
//! under Pod Security Admission `restricted`, and the payouts paid once, counted at the rail.

use std::collections::BTreeMap;
use std::process::Command;

use serde_json::Value;

use crate::real_node::RealCluster;
use crate::world::{EXE, OPERATOR_NAMESPACE, repo};

const NS: &str = "default";
const BATCH: &str = "payroll-2026-12";
const TREASURY: &str = "system:serviceaccount:default:treasury";

fn example(name: &str) -> String {
    repo().join("examples").join(name).display().to_string()
}

/// `helm install` as the README gives it, the example stack applied into a namespace where
/// Pod Security Admission enforces `restricted`, PostgreSQL behind `postgres:5432`, and the
/// three services Ready.
pub fn install(cluster: &RealCluster) {
    for ns in [OPERATOR_NAMESPACE, NS] {
        if ns != NS {
            cluster.kubectl(&["create", "namespace", ns]);
        }
        cluster.kubectl(&[
            "label",
            "namespace",
            ns,
            "pod-security.kubernetes.io/enforce=restricted",
            "--overwrite",
        ]);
    }
    let chart = repo().join("charts/dlock").display().to_string();
    cluster.helm(&[
        "install",
        "dlock",
        &chart,
        "-n",
        OPERATOR_NAMESPACE,
        "--set",
        &format!("serviceAuth.namespaces={{{NS}}}"),
        "--wait",
        "--timeout",
        "180s",
    ]);
    cluster.postgres_service(NS);
    cluster.kubectl(&["apply", "-n", NS, "-f", &example("stack.yaml")]);
    for object in [
        "lockserver/lock-server",
        "paymentresource/payment-resource",
        "railproxy/rail-proxy",
    ] {
        cluster.kubectl(&[
            "wait",
            "-n",
            NS,
            "--for=condition=Ready",
            object,
            "--timeout=180s",
        ]);
    }
    for service in [
        "lock-server",
        "payment-resource",
        "rail-proxy",
        "rail-proxy-stub",
    ] {
        cluster.wait_service_ready(NS, service);
    }
}

/// `dlock accounts fund -f FILE` as the treasury, with a projected token of its ServiceAccount,
/// against the payment resource's Service address.
pub fn fund(cluster: &RealCluster, file: &str) {
    let token = cluster.kubectl(&[
        "create",
        "token",
        "treasury",
        "-n",
        NS,
        "--audience",
        "dlock",
    ]);
    let url = cluster.service_url(NS, "payment-resource");
    let out = Command::new(EXE)
        .args([
            "accounts",
            "fund",
            "-f",
            file,
            "--payment-resource",
            &url,
            "--identity",
            TREASURY,
        ])
        .env("DLOCK_TREASURY_CREDENTIAL", token.trim())
        .output()
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(
        out.status.success(),
        "dlock accounts fund: {}{}",
        String::from_utf8_lossy(&out.stderr),
        cluster.diagnostics()
    );
}

/// The rail's statement (the stub's own record of every transfer it took): transfers per
/// clientRef (the payout id).
pub fn statement(cluster: &RealCluster) -> BTreeMap<String, usize> {
    let url = cluster.service_url(NS, "rail-proxy-stub");
    let body = Command::new("curl")
        .args(["-sf", &format!("{url}/statement")])
        .output()
        .unwrap_or_else(|e| panic!("curl: {e}"));
    assert!(body.status.success(), "GET {url}/statement failed");
    let statement: Value =
        serde_json::from_slice(&body.stdout).unwrap_or_else(|e| panic!("the statement: {e}"));
    let mut per_payout = BTreeMap::new();
    for transfer in statement["transfers"].as_array().into_iter().flatten() {
        let client_ref = transfer["clientRef"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        *per_payout.entry(client_ref).or_insert(0) += 1;
    }
    per_payout
}

/// Payouts by state, from paydb.
pub fn payout_states(cluster: &RealCluster) -> BTreeMap<String, usize> {
    let rows = cluster.psql(
        "paydb",
        "SELECT state || ' ' || count(*) FROM payouts GROUP BY state ORDER BY state",
    );
    rows.lines()
        .filter_map(|l| l.trim().split_once(' '))
        .map(|(state, n)| (state.to_owned(), n.parse().unwrap_or(0)))
        .collect()
}

#[test]
fn the_chart_installs_as_the_readme_says_and_the_example_batch_is_paid_once_by_real_pods() {
    let cluster = RealCluster::start();
    install(&cluster);

    // Every dlock pod is on the real node and its containers run in containerd: the runtime's
    // own tasks, not the pod's phase (which a fake node could report), and each process runs
    // as 65532 with no new privileges and a seccomp filter.
    let pods = cluster.get_json(&["pods", "-A"]);
    let tasks = cluster.ctr(&["tasks", "ls"]);
    let mut running = 0;
    for pod in pods["items"].as_array().into_iter().flatten() {
        let name = pod["metadata"]["name"].as_str().unwrap_or_default();
        assert_eq!(pod["spec"]["nodeName"], "dlock-node", "{name}");
        for status in pod["status"]["containerStatuses"]
            .as_array()
            .into_iter()
            .flatten()
        {
            let id = status["containerID"]
                .as_str()
                .and_then(|id| id.strip_prefix("containerd://"))
                .unwrap_or_else(|| panic!("{name}: no containerd container: {status}"));
            let task = tasks
                .lines()
                .find(|l| l.starts_with(id))
                .unwrap_or_else(|| {
                    panic!("{name}: container {id} is no task of containerd:\n{tasks}")
                });
            let fields: Vec<&str> = task.split_whitespace().collect();
            assert_eq!(fields.get(2), Some(&"RUNNING"), "{name}: {task}");
            let pid = fields.get(1).copied().unwrap_or_default();
            let proc_status = std::fs::read_to_string(format!("/proc/{pid}/status"))
                .unwrap_or_else(|e| panic!("{name}: /proc/{pid}/status: {e}"));
            for (key, want) in [("Uid", "65532"), ("NoNewPrivs", "1"), ("Seccomp", "2")] {
                let line = proc_status
                    .lines()
                    .find(|l| l.starts_with(&format!("{key}:")))
                    .unwrap_or_default();
                assert!(
                    line.split_whitespace().nth(1) == Some(want),
                    "{name}: {line:?}, want {key} {want}"
                );
            }
            running += 1;
        }
    }
    // The operator (2), the lock server (2), the payment resource (2), the proxy (2), the stub.
    assert!(running >= 9, "{running} running containers:\n{tasks}");

    // The payouts: the treasury funds the accounts, the batch is applied as the README says.
    fund(&cluster, &example("payoutbatch.yaml"));
    let before = statement(&cluster);
    assert!(
        before.is_empty(),
        "the rail took transfers already: {before:?}"
    );
    cluster.kubectl(&["apply", "-n", NS, "-f", &example("payoutbatch.yaml")]);
    cluster.kubectl(&[
        "wait",
        "-n",
        NS,
        "--for=condition=Ready",
        &format!("payoutbatch/{BATCH}"),
        "--timeout=300s",
    ]);
    let batch = cluster.get_json(&["payoutbatch", BATCH, "-n", NS]);
    assert_eq!(
        batch["status"]["counts"],
        serde_json::json!({"POSTED": 4}),
        "{batch}"
    );
    // The executor's pod ran to completion on the real node.
    let executor = cluster.get_json(&[
        "pods",
        "-n",
        NS,
        "-l",
        &format!("job-name={BATCH}-executor"),
    ]);
    let executor = &executor["items"][0];
    assert_eq!(executor["spec"]["nodeName"], "dlock-node", "{executor}");
    assert_eq!(
        executor["status"]["containerStatuses"][0]["state"]["terminated"]["exitCode"], 0,
        "{executor}"
    );
    // Paid once each, at the rail.
    let paid = statement(&cluster);
    assert_eq!(paid.len(), 4, "{paid:?}");
    assert!(
        paid.values().all(|n| *n == 1),
        "a payout paid twice: {paid:?}"
    );
    assert_eq!(
        payout_states(&cluster),
        BTreeMap::from([("POSTED".to_owned(), 4)])
    );

    // What the cluster's own tools see: the kubelet serves the services' logs, and the Lock
    // mirror lists the keys.
    let logs = cluster.kubectl(&["logs", "-n", NS, "deploy/payment-resource"]);
    assert!(logs.contains("payment_resource_started"), "{logs}");
    cluster.kubectl(&["get", "locks", "-n", NS]);
}
