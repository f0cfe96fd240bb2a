//! dlock's pods on a real node (real_node.rs): the chart installed with helm as the README says,
//! the example stack and batch applied with kubectl, every pod run by the kubelet in containerd
//! under Pod Security Admission `restricted`, and the payouts paid once, counted at the rail.

use std::collections::BTreeMap;
use std::process::Command;

use std::time::Duration;

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use serde_json::Value;

use crate::real_node::RealCluster;
use crate::world::{EXE, OPERATOR_NAMESPACE, repo};

const NS: &str = "default";
const BATCH: &str = "payroll-2026-12";
const TREASURY: &str = "system:serviceaccount:default:treasury";

pub fn example(name: &str) -> String {
    repo().join("examples").join(name).display().to_string()
}

/// `helm install` as the README gives it, the example stack applied into a namespace where
/// Pod Security Admission enforces `restricted`, PostgreSQL behind `postgres:5432`, and the
/// three services Ready. The example turns TLS between the pods on: the services' CA goes to the
/// operator as the chart's `serviceTLS.caConfigMap`, and their Secret `dlock-tls` is made once
/// the operator has made the Services (tls_pods.rs).
pub fn install(cluster: &RealCluster) {
    cluster.kubectl(&["create", "namespace", OPERATOR_NAMESPACE]);
    let ca = crate::tls_pods::make_ca(cluster);
    for ns in [OPERATOR_NAMESPACE, NS] {
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
        // The batch's executor Job pays what the operator registered (docs/contract.md#roles).
        "--set",
        &format!("serviceAuth.roles={{{NS}/dlock-executor=executor}}"),
        "--set",
        &format!("serviceTLS.caConfigMap={}", crate::tls_pods::CA_CONFIG_MAP),
        "--wait",
        "--timeout",
        "180s",
    ]);
    cluster.postgres_service(NS);
    cluster.kubectl(&["apply", "-n", NS, "-f", &example("stack.yaml")]);
    crate::tls_pods::issue_secret(cluster, &ca, NS);
    for object in [
        "lockserver/lock-server",
        "paymentresource/payment-resource",
        "railproxy/rail-proxy",
    ] {
        wait_ready(cluster, object, 180);
    }
    for service in [
        "lock-server",
        "payment-resource",
        "rail-proxy",
        "rail-proxy-stub",
    ] {
        crate::tls_pods::wait_https_ready(cluster, NS, service);
    }
}

/// `dlock accounts fund -f FILE` as the treasury, with a projected token of its ServiceAccount,
/// against the payment resource's Service address.
/// `kubectl wait` until `object` in [`NS`] is Ready, `timeout_s` at the most.
fn wait_ready(cluster: &RealCluster, object: &str, timeout_s: u32) {
    cluster.kubectl(&[
        "wait",
        "-n",
        NS,
        "--for=condition=Ready",
        object,
        &format!("--timeout={timeout_s}s"),
    ]);
}

/// Waits up to `timeout_s` for batch `name` to be Ready: every payout POSTED here, where the stub
/// fails nothing. A payout RAIL_AMBIGUOUS never gets there (it waits for a reconciliation), so
/// the wait stops at once with what the rail proxy and the stub logged about it, rather than
/// at the timeout with nothing said.
fn wait_paid(cluster: &RealCluster, name: &str, timeout_s: u64) {
    let deadline = std::time::Instant::now() + Duration::from_secs(timeout_s);
    loop {
        let batch = cluster.get_json(&["payoutbatch", name, "-n", NS]);
        let status = &batch["status"];
        let ready = status["conditions"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|c| c["type"] == "Ready" && c["status"] == "True");
        if ready {
            return;
        }
        let ambiguous: Vec<&str> = status["ambiguous"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(Value::as_str)
            .collect();
        assert!(
            ambiguous.is_empty(),
            "batch {name}: payouts went RAIL_AMBIGUOUS: {ambiguous:?}; status {status}{}{}",
            rail_logs(cluster, &ambiguous),
            cluster.diagnostics()
        );
        assert!(
            std::time::Instant::now() < deadline,
            "batch {name} was not Ready within {timeout_s} s: {status}{}",
            cluster.diagnostics()
        );
        std::thread::sleep(Duration::from_secs(1));
    }
}

/// The rail proxy's and the stub's log lines that name one of `payouts` or are warnings or
/// errors, with their pod: what a forward left unanswered left behind.
fn rail_logs(cluster: &RealCluster, payouts: &[&str]) -> String {
    let mut text = String::new();
    for component in ["rail-proxy", "rail-stub"] {
        let selector = format!("app.kubernetes.io/component={component}");
        let logs = cluster
            .try_kubectl(&["logs", "-n", NS, "-l", &selector, "--prefix", "--tail=5000"])
            .unwrap_or_else(|e| e);
        text += &format!("\n--- {component}: warnings, errors and the payouts' lines ---\n");
        let relevant = logs.lines().filter(|l| {
            l.contains("\"level\":\"WARN\"")
                || l.contains("\"level\":\"ERROR\"")
                || payouts.iter().any(|p| l.contains(p))
        });
        for line in relevant.take(60) {
            text += line;
            text += "\n";
        }
    }
    text
}

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
    let url = crate::tls_pods::https_url(cluster, NS, "payment-resource");
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
        .env("DLOCK_CA_FILE", crate::tls_pods::ca_file(cluster))
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
    let url = crate::tls_pods::https_url(cluster, NS, "rail-proxy-stub");
    let (status, body) = crate::tls_pods::curl(cluster, &[&format!("{url}/statement")]);
    assert_eq!(status, 200, "GET {url}/statement failed: {body}");
    let statement: Value =
        serde_json::from_str(&body).unwrap_or_else(|e| panic!("the statement: {e}"));
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
    // The example's stub drops 1% of transfers on purpose (RAIL_AMBIGUOUS, left for a
    // reconciliation, which the chaos suite covers); here every payout must end POSTED.
    quiet_stub(&cluster);

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
            let (pid, state) = task_of(&tasks, status, name);
            assert_eq!(state, "RUNNING", "{name}: {status}");
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
            // The root filesystem is mounted read-only in the container: every file a
            // service writes lives on a declared volume.
            let mountinfo = std::fs::read_to_string(format!("/proc/{pid}/mountinfo"))
                .unwrap_or_else(|e| panic!("{name}: /proc/{pid}/mountinfo: {e}"));
            let root = mountinfo
                .lines()
                .find(|l| l.split_whitespace().nth(4) == Some("/"))
                .unwrap_or_else(|| panic!("{name}: no / in its mountinfo"));
            let options = root.split_whitespace().nth(5).unwrap_or_default();
            assert!(
                options.split(',').any(|o| o == "ro"),
                "{name}: / is mounted {options}"
            );
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
    wait_paid(&cluster, BATCH, 300);
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
    // Fencing tokens are proven by default: the operator made the namespace's proof keys, and
    // no service runs without them.
    cluster.kubectl(&["get", "secret", "dlock-fencing-proof-keys", "-n", NS]);
    for service in ["lock-server", "payment-resource", "rail-proxy"] {
        let logs = cluster.kubectl(&["logs", "-n", NS, &format!("deploy/{service}")]);
        assert!(
            !logs.contains("fencing_tokens_unproven"),
            "{service}: {logs}"
        );
        assert!(logs.contains("_started"), "{service}: {logs}");
    }
    cluster.kubectl(&["get", "locks", "-n", NS]);
}

/// Accounts the rolling load pays from.
const ROLL_ACCOUNTS: usize = 50;
/// Payouts per batch (the CRD's limit): one batch is applied before each roll.
const ROLL_BATCH: usize = 500;

/// A PayoutBatch of [`ROLL_BATCH`] payouts over [`ROLL_ACCOUNTS`] accounts, its executor on its
/// ServiceAccount's token, written to the cluster's directory; the file's path.
fn rolling_batch(cluster: &RealCluster, name: &str) -> String {
    let mut yaml = format!(
        "apiVersion: dlock.io/v1alpha1\nkind: PayoutBatch\nmetadata:\n  name: {name}\n\
         spec:\n  workers: 4\n  executor:\n    serviceAccountName: dlock-executor\n  payouts:\n"
    );
    for i in 0..ROLL_BATCH {
        yaml += &format!(
            "  - {{key: p-{i:04}, accountId: acct-roll-{:02}, amountMinor: {}, currency: EUR, \
             beneficiaryRef: ben-{i:04}}}\n",
            i % ROLL_ACCOUNTS,
            100 + i
        );
    }
    let path = cluster.dir.path().join(format!("{name}.yaml"));
    std::fs::write(&path, yaml).unwrap_or_else(|e| panic!("{e}"));
    path.display().to_string()
}

/// Terminal payouts of paydb (POSTED, FAILED, RAIL_AMBIGUOUS, ABANDONED).
fn terminal(cluster: &RealCluster) -> usize {
    payout_states(cluster)
        .iter()
        .filter(|(state, _)| {
            ["POSTED", "FAILED", "RAIL_AMBIGUOUS", "ABANDONED"].contains(&state.as_str())
        })
        .map(|(_, n)| n)
        .sum()
}

/// A change of the pod template of each object (`spec.resources`: its pods' memory request), which the operator
/// turns into a rolling update of its Deployment.
fn roll(cluster: &RealCluster, objects: &[&str], memory: &str) {
    let patch = format!(
        "{{\"spec\":{{\"resources\":{{\"requests\":{{\"cpu\":\"100m\",\"memory\":\"{memory}\"}},\
         \"limits\":{{\"memory\":\"512Mi\"}}}}}}}}"
    );
    for object in objects {
        cluster.kubectl(&["patch", "-n", NS, object, "--type", "merge", "-p", &patch]);
    }
}

/// Funds and applies a batch of [`ROLL_BATCH`] payouts and waits for it to be Ready; how long
/// that took from the apply.
fn run_batch(cluster: &RealCluster, name: &str) -> Duration {
    let file = rolling_batch(cluster, name);
    fund(cluster, &file);
    let applied = std::time::Instant::now();
    cluster.kubectl(&["apply", "--server-side", "-n", NS, "-f", &file]);
    wait_paid(cluster, name, 600);
    applied.elapsed()
}

/// The PID and state (RUNNING, STOPPED, …) of the container a pod's container status names,
/// from `ctr tasks ls`: the runtime's own view, not the pod's phase.
fn task_of(tasks: &str, status: &Value, pod: &str) -> (i32, String) {
    let id = status["containerID"]
        .as_str()
        .and_then(|id| id.strip_prefix("containerd://"))
        .unwrap_or_else(|| panic!("{pod}: no containerd container: {status}"));
    let fields: Vec<&str> = tasks
        .lines()
        .find(|l| l.starts_with(id))
        .unwrap_or_else(|| panic!("{pod}: container {id} is no task of containerd:\n{tasks}"))
        .split_whitespace()
        .collect();
    let pid = fields.get(1).and_then(|p| p.parse().ok());
    let pid = pid.unwrap_or_else(|| panic!("{pod}: no PID in {fields:?}"));
    (pid, fields.get(2).copied().unwrap_or_default().to_owned())
}

/// The PID and restart count of the first container of `pod`.
fn container_pid(cluster: &RealCluster, pod: &str) -> (i32, i64) {
    let object = cluster.get_json(&["pod", pod, "-n", NS]);
    let status = &object["status"]["containerStatuses"][0];
    let (pid, _) = task_of(&cluster.ctr(&["tasks", "ls"]), status, pod);
    (pid, status["restartCount"].as_i64().unwrap_or(0))
}

/// The first pod of a Deployment's label `app.kubernetes.io/instance`.
fn first_pod(cluster: &RealCluster, instance: &str) -> String {
    cluster
        .kubectl(&[
            "get",
            "pods",
            "-n",
            NS,
            "-l",
            &format!("app.kubernetes.io/instance={instance}"),
            "-o",
            "jsonpath={.items[0].metadata.name}",
        ])
        .trim()
        .to_owned()
}

/// The example's stub without failures of its own (it drops a held connection for 1% of
/// transfers, which is RAIL_AMBIGUOUS by design), so that every ambiguous payout is the
/// scenario's doing. Its duplicate-ack trap stays: a clientRef presented twice is paid twice.
pub fn quiet_stub(cluster: &RealCluster) {
    let before = cluster.kubectl(&[
        "get",
        "pods",
        "-n",
        NS,
        "-l",
        "app.kubernetes.io/component=rail-stub",
        "-o",
        "name",
    ]);
    let generation = |patched: &str| patched.trim().parse::<i64>().unwrap_or(0);
    let was = generation(&cluster.kubectl(&[
        "get",
        "-n",
        NS,
        "railproxy/rail-proxy",
        "-o",
        "jsonpath={.metadata.generation}",
    ]));
    let now = generation(&cluster.kubectl(&[
        "patch",
        "-n",
        NS,
        "railproxy/rail-proxy",
        "--type",
        "merge",
        "-p",
        r#"{"spec":{"stub":{"failureRate":0}}}"#,
        "-o",
        "jsonpath={.metadata.generation}",
    ]));
    // A patch that changed nothing (the stub was quiet already) rolls nothing.
    if now != was {
        roll_done(cluster, now, &before);
    }
    crate::tls_pods::wait_https_ready(cluster, NS, "rail-proxy-stub");
}

/// The stub's roll after the patch that made generation `now` of the RailProxy, done: the operator
/// has read the patched spec (so applied the stub's new Deployment), the Deployment has rolled
/// (`rollout status` alone may still see the old Deployment, complete, and return before the
/// operator edits it), and every pod of the old stub (`old_pods`, `pod/<name>` lines) is gone,
/// not only replaced: callers list every pod as running.
fn roll_done(cluster: &RealCluster, now: i64, old_pods: &str) {
    cluster.kubectl(&[
        "wait",
        "-n",
        NS,
        "railproxy/rail-proxy",
        &format!("--for=jsonpath={{.status.observedGeneration}}={now}"),
        "--timeout=120s",
    ]);
    wait_ready(cluster, "railproxy/rail-proxy", 180);
    cluster.kubectl(&[
        "rollout",
        "status",
        "-n",
        NS,
        "deployment/rail-proxy-stub",
        "--timeout=120s",
    ]);
    for pod in old_pods.lines().filter(|l| !l.trim().is_empty()) {
        if let Err(e) =
            cluster.try_kubectl(&["wait", "-n", NS, "--for=delete", pod, "--timeout=120s"])
        {
            assert!(
                e.contains("NotFound") || e.contains("not found"),
                "{pod} stayed: {e}{}",
                cluster.diagnostics()
            );
        }
    }
}

/// Waits until 20 more payouts are terminal than when called: batch `name` is under way.
fn under_way(cluster: &RealCluster, name: &str) {
    let before = terminal(cluster);
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    while terminal(cluster) < before + 20 {
        assert!(
            std::time::Instant::now() < deadline,
            "batch {name} made no progress{}",
            cluster.diagnostics()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

#[test]
fn a_service_container_killed_mid_batch_is_restarted_by_the_kubelet_and_nothing_is_paid_twice() {
    let cluster = RealCluster::start();
    install(&cluster);
    quiet_stub(&cluster);

    let mut figures = Vec::new();
    for (i, instance) in ["payment-resource", "lock-server"].into_iter().enumerate() {
        let name = format!("killed-{i}");
        let file = rolling_batch(&cluster, &name);
        fund(&cluster, &file);
        cluster.kubectl(&["apply", "--server-side", "-n", NS, "-f", &file]);
        under_way(&cluster, &name);
        // kill -9 of the service's process, as the OOM killer or a crash would: no SIGTERM,
        // no drain. The kubelet restarts the container in the same pod.
        let pod = first_pod(&cluster, instance);
        let (pid, restarts) = container_pid(&cluster, &pod);
        let killed = std::time::Instant::now();
        kill(Pid::from_raw(pid), Signal::SIGKILL).unwrap_or_else(|e| panic!("kill -9 {pid}: {e}"));
        let deadline = killed + Duration::from_secs(120);
        loop {
            let object = cluster.get_json(&["pod", &pod, "-n", NS]);
            let status = &object["status"]["containerStatuses"][0];
            if status["restartCount"].as_i64().unwrap_or(0) > restarts && status["ready"] == true {
                break;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "{pod} was not restarted{}",
                cluster.diagnostics()
            );
            std::thread::sleep(Duration::from_millis(200));
        }
        figures.push(format!(
            "{instance}: pod {pod} killed, restarted and Ready again in {:.1} s",
            killed.elapsed().as_secs_f64()
        ));
        wait_paid(&cluster, &name, 600);
    }
    let states = payout_states(&cluster);
    let paid = statement(&cluster);
    let twice: Vec<_> = paid.iter().filter(|(_, n)| **n > 1).collect();
    eprintln!(
        "kill -9 mid-batch:\n  {}\n  states {states:?}\n  transfers {} (paid twice: {})",
        figures.join("\n  "),
        paid.len(),
        twice.len()
    );
    assert!(twice.is_empty(), "paid twice: {twice:?}");
    assert_eq!(
        states,
        BTreeMap::from([("POSTED".to_owned(), 2 * ROLL_BATCH)])
    );
    assert_eq!(paid.len(), 2 * ROLL_BATCH);
}

#[test]
fn every_service_rolls_under_running_batches_without_a_payout_stranded_or_paid_twice() {
    let cluster = RealCluster::start();
    install(&cluster);
    // Every ambiguous payout below would be a roll's.
    quiet_stub(&cluster);
    // The baseline: one batch of 500 with nothing rolling, from apply to Ready.
    let baseline = run_batch(&cluster, "baseline");
    // The executors log each hop refused or cut (debug), through the telemetry ConfigMap.
    cluster.kubectl(&[
        "create",
        "configmap",
        "dlock-telemetry",
        "-n",
        NS,
        "--from-literal=DLOCK_LOG=info,dlock_executor=debug",
    ]);
    let started = std::time::Instant::now();

    // Five rolls, each under a fresh batch of 500: the lock server, the payment resource, the
    // rail proxy, all three at once, then the operator.
    let steps: [(&str, &[&str], &[&str]); 5] = [
        ("lock server", &["lockserver/lock-server"], &["lock-server"]),
        (
            "payment resource",
            &["paymentresource/payment-resource"],
            &["payment-resource"],
        ),
        ("rail proxy", &["railproxy/rail-proxy"], &["rail-proxy"]),
        (
            "all three at once",
            &[
                "lockserver/lock-server",
                "paymentresource/payment-resource",
                "railproxy/rail-proxy",
            ],
            &["lock-server", "payment-resource", "rail-proxy"],
        ),
        ("the operator", &[], &[]),
    ];
    // `kubectl get locks` while the batches run: the holders the Lock mirror shows.
    let watching = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
    let holders = {
        let watching = watching.clone();
        let mut get_locks = cluster.kubectl_command(&[
            "get",
            "locks",
            "-n",
            NS,
            "-o",
            "jsonpath={.items[*].status.holder}",
        ]);
        std::thread::spawn(move || {
            let mut seen = std::collections::BTreeSet::new();
            while watching.load(std::sync::atomic::Ordering::SeqCst) {
                if let Ok(out) = get_locks.output() {
                    for holder in String::from_utf8_lossy(&out.stdout).split_whitespace() {
                        seen.insert(holder.to_owned());
                    }
                }
                std::thread::sleep(Duration::from_secs(1));
            }
            seen
        })
    };
    let mut figures = Vec::new();
    for (i, (what, objects, deployments)) in steps.iter().enumerate() {
        let name = format!("rolling-{i}");
        let file = rolling_batch(&cluster, &name);
        fund(&cluster, &file);
        cluster.kubectl(&["apply", "--server-side", "-n", NS, "-f", &file]);
        // The batch is under way before the roll starts.
        under_way(&cluster, &name);
        let at_start = terminal(&cluster);
        let roll_started = std::time::Instant::now();
        if objects.is_empty() {
            cluster.kubectl(&[
                "rollout",
                "restart",
                "-n",
                OPERATOR_NAMESPACE,
                "deployment/dlock-operator",
            ]);
            cluster.kubectl(&[
                "rollout",
                "status",
                "-n",
                OPERATOR_NAMESPACE,
                "deployment/dlock-operator",
                "--timeout=300s",
            ]);
        } else {
            roll(&cluster, objects, &format!("{}Mi", 120 + i));
            for deployment in *deployments {
                // The operator edits the Deployment; wait for the new template, then the roll.
                cluster.kubectl(&[
                    "wait", "-n", NS, &format!("deployment/{deployment}"),
                    &format!("--for=jsonpath={{.spec.template.spec.containers[0].resources.requests.memory}}={}Mi", 120 + i),
                    "--timeout=120s",
                ]);
                cluster.kubectl(&[
                    "rollout",
                    "status",
                    "-n",
                    NS,
                    &format!("deployment/{deployment}"),
                    "--timeout=300s",
                ]);
            }
        }
        let during = terminal(&cluster) - at_start;
        figures.push(format!(
            "{what:<18} rolled in {:>5.1} s, {during:>4} payouts finished meanwhile",
            roll_started.elapsed().as_secs_f64()
        ));
    }
    for i in 0..steps.len() {
        wait_paid(&cluster, &format!("rolling-{i}"), 600);
    }
    let wall = started.elapsed();
    watching.store(false, std::sync::atomic::Ordering::SeqCst);
    let holders = holders.join().unwrap_or_default();
    // Each holder is a worker of one of the running batches (`<identity>/<batch>`).
    assert!(
        holders.iter().any(|h| h.contains("/rolling-")),
        "kubectl get locks never showed a worker of the batches as holder: {holders:?}"
    );

    // The figures: every payout terminal, none ambiguous, none paid twice.
    let states = payout_states(&cluster);
    let paid = statement(&cluster);
    let twice: Vec<_> = paid.iter().filter(|(_, n)| **n > 1).collect();
    let mut cycles = Vec::new();
    let mut refusals = BTreeMap::new();
    for i in 0..steps.len() {
        let logs = cluster
            .try_kubectl(&["logs", "-n", NS, &format!("job/rolling-{i}-executor")])
            .unwrap_or_default();
        if let Some(line) = logs.lines().find(|l| l.trim_start().starts_with("cycles")) {
            cycles.push(format!("rolling-{i}: {}", line.trim()));
        }
        // Each refused or cut hop (`step_failed`, at debug level through the telemetry
        // ConfigMap's DLOCK_LOG): which hop, and the error's code or kind.
        for line in logs.lines().filter(|l| l.contains("\"step_failed\"")) {
            let event: Value = serde_json::from_str(line).unwrap_or_default();
            let hop = event["hop"].as_str().unwrap_or("?").to_owned();
            let error = event["error"].as_str().unwrap_or_default();
            let kind = error
                .split(|c: char| !(c.is_ascii_uppercase() || c == '_'))
                .find(|w| w.len() >= 4)
                .map(str::to_owned)
                .unwrap_or_else(|| error.split(':').next().unwrap_or_default().to_owned());
            *refusals.entry(format!("{hop}: {kind}")).or_insert(0usize) += 1;
        }
    }
    let unrolled = baseline.as_secs_f64() * steps.len() as f64;
    eprintln!(
        "rolling under load: {} payouts in {:.1} s, {} holders seen in kubectl get locks (a batch of {ROLL_BATCH} alone: {:.1} s; \
         {:+.1} s against {} of them one after another)\n  {}\n  states {states:?}\n  \
         hops refused or cut, retried in a later cycle: {refusals:?}\n  \
         transfers {} (paid twice: {})\n  {}",
        steps.len() * ROLL_BATCH,
        wall.as_secs_f64(),
        holders.len(),
        baseline.as_secs_f64(),
        wall.as_secs_f64() - unrolled,
        steps.len(),
        figures.join("\n  "),
        paid.len(),
        twice.len(),
        cycles.join("\n  ")
    );
    assert!(twice.is_empty(), "paid twice: {twice:?}");
    assert_eq!(
        states.get("RAIL_AMBIGUOUS"),
        None,
        "a roll left payouts RAIL_AMBIGUOUS: {states:?}"
    );
    let total: usize = states.values().sum();
    assert_eq!(total, (steps.len() + 1) * ROLL_BATCH, "{states:?}");
    assert_eq!(
        states.get("POSTED").copied().unwrap_or(0) + states.get("FAILED").copied().unwrap_or(0),
        total,
        "a payout stranded: {states:?}"
    );
    // Each POSTED payout is on the statement once; a FAILED one (the stub refuses 2%) is not.
    assert_eq!(
        paid.len(),
        states.get("POSTED").copied().unwrap_or(0),
        "{states:?}"
    );
}
