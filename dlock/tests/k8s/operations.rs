//! Running the operator: the paused annotation, and two replicas under leader election.

use std::time::{Duration, Instant};

use dlock_devstack::{Signal, wait_until};
use serde_json::Value;

use crate::world::{OPERATOR_NAMESPACE, World, condition};

/// `dlock_operator_reconcile_total{kind=…,outcome=…}` of the operator listening on `port`.
fn reconciles(port: u16, kind: &str, outcome: &str) -> u64 {
    use std::io::{Read as _, Write as _};
    let Ok(mut stream) = std::net::TcpStream::connect(("127.0.0.1", port)) else {
        return 0;
    };
    let _ = stream.set_read_timeout(Some(Duration::from_secs(5)));
    let mut text = String::new();
    if write!(stream, "GET /metrics HTTP/1.0\r\nHost: operator\r\n\r\n").is_err()
        || stream.read_to_string(&mut text).is_err()
    {
        return 0;
    }
    let wanted = [format!("kind=\"{kind}\""), format!("outcome=\"{outcome}\"")];
    text.lines()
        .filter(|l| l.starts_with("dlock_operator_reconcile_total{"))
        .filter(|l| wanted.iter().all(|w| l.contains(w.as_str())))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .map(|v| v as u64)
        .sum()
}

/// `kubectl patch` of the LockServer's `spec.replicas` in `ns`.
fn scale_lock_server(world: &World, ns: &str, replicas: u32) {
    world.kubectl(&[
        "patch",
        "lockserver/lock-server",
        "-n",
        ns,
        "--type=merge",
        "-p",
        &format!(r#"{{"spec":{{"replicas":{replicas}}}}}"#),
    ]);
}

fn replicas(world: &World, ns: &str, deployment: &str) -> i64 {
    world
        .get_json(&["deployment", deployment, "-n", ns])
        .pointer("/spec/replicas")
        .and_then(Value::as_i64)
        .unwrap_or(-1)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_paused_lock_server_is_left_alone_until_the_annotation_goes() {
    let ns = "paused";
    let mut world = World::with_namespace(ns).await;
    let (_, port) = world.start_operator(&[ns], &[]);
    world.apply_stack_ready(ns);
    assert_eq!(replicas(&world, ns, "lock-server"), 2);

    world.kubectl(&[
        "annotate",
        "lockserver/lock-server",
        "-n",
        ns,
        "dlock.io/reconcile=paused",
    ]);
    world.wait_until(
        "the operator sees the pause",
        Duration::from_secs(60),
        || reconciles(port, "LockServer", "paused") >= 1,
    );
    let seen = reconciles(port, "LockServer", "paused");
    let before = world.get_json(&["lockserver", "lock-server", "-n", ns]);
    scale_lock_server(&world, ns, 3);
    // The operator reconciled the edit (one more paused reconcile) and changed nothing.
    world.wait_until(
        "the operator reconciles the edit",
        Duration::from_secs(60),
        || reconciles(port, "LockServer", "paused") > seen,
    );
    assert_eq!(replicas(&world, ns, "lock-server"), 2, "paused: untouched");
    let during = world.get_json(&["lockserver", "lock-server", "-n", ns]);
    assert_eq!(
        during["status"]["observedGeneration"], before["status"]["observedGeneration"],
        "paused: status untouched"
    );

    // The positive control: without the annotation the same edit is made.
    world.kubectl(&[
        "annotate",
        "lockserver/lock-server",
        "-n",
        ns,
        "dlock.io/reconcile-",
    ]);
    world.wait_until(
        "the edit is applied once unpaused",
        Duration::from_secs(60),
        || replicas(&world, ns, "lock-server") == 3,
    );
    eprintln!("scenario done in {} ms", world.elapsed_ms());
}

fn lease_holder(world: &World) -> String {
    world
        .try_kubectl(&[
            "get",
            "lease",
            "dlock-operator",
            "-n",
            OPERATOR_NAMESPACE,
            "-o",
            "jsonpath={.spec.holderIdentity}",
        ])
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn of_two_operator_replicas_only_the_leader_writes_and_the_standby_takes_over() {
    let ns = "ha";
    let mut world = World::with_namespace(ns).await;
    let replicas_ports = [
        world.start_operator(&[ns], &[]),
        world.start_operator(&[ns], &[]),
    ];
    world.apply_stack_ready(ns);
    let holder = lease_holder(&world);
    let leader = replicas_ports
        .iter()
        .position(|(i, _)| holder == format!("dlock-operator-{i}"))
        .unwrap_or_else(|| panic!("the Lease names one of the replicas: {holder:?}"));
    let standby = 1 - leader;
    let (leader_index, leader_port) = replicas_ports[leader];
    let (standby_index, standby_port) = replicas_ports[standby];
    assert!(
        reconciles(leader_port, "LockServer", "ok") > 0,
        "the leader reconciled"
    );
    assert_eq!(
        reconciles(standby_port, "LockServer", "ok"),
        0,
        "the standby wrote nothing"
    );

    // The leader dies without a word (SIGKILL: no lease release); the standby takes over within
    // the lease's 15 s and applies an edit made meanwhile.
    let stopped = Instant::now();
    world
        .operator_signal(leader_index, Signal::SIGKILL)
        .unwrap_or_else(|e| panic!("{e:#}"));
    scale_lock_server(&world, ns, 3);
    world.wait_until(
        "the standby holds the Lease",
        Duration::from_secs(60),
        || lease_holder(&world) == format!("dlock-operator-{standby_index}"),
    );
    let takeover = stopped.elapsed();
    world.wait_until(
        "the new leader applies the edit",
        Duration::from_secs(60),
        || replicas(&world, ns, "lock-server") == 3,
    );
    wait_until(
        "the new leader's reconcile ends ok",
        Duration::from_secs(30),
        || reconciles(standby_port, "LockServer", "ok") > 0,
    )
    .unwrap_or_else(|e| {
        panic!(
            "{e:#}\nthe new leader's log:\n{}{}",
            world.operator_log(standby_index),
            world.diagnostics()
        )
    });
    // The Lease was last renewed at most one renewal period (the lease's third, 5 s) before the
    // kill; the standby may take it once 15 s have passed since, at its next attempt.
    assert!(
        takeover <= Duration::from_secs(15 + 5 + 5),
        "takeover within the lease duration (15 s) plus a renewal period and an attempt: {takeover:?}"
    );
    eprintln!(
        "takeover after {} ms; scenario done in {} ms",
        takeover.as_millis(),
        world.elapsed_ms()
    );
}

/// Warning Events with `reason` about `kind/name`, as `kubectl get events` shows them.
fn warning_events(world: &World, ns: &str, name: &str, reason: &str) -> Vec<Value> {
    let selector = format!("involvedObject.name={name},reason={reason},type=Warning");
    world.get_json(&["events", "-n", ns, "--field-selector", &selector])["items"]
        .as_array()
        .cloned()
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_apply_the_api_server_refuses_is_a_condition_and_an_event_and_clears_by_itself() {
    let ns = "quota";
    let mut world = World::with_namespace(ns).await;
    // The namespace admits no Deployment: the API server's quota admission refuses the
    // operator's apply of each service's Deployment.
    world
        .apply(
            ns,
            "apiVersion: v1\nkind: ResourceQuota\nmetadata:\n  name: no-deployments\nspec:\n  hard:\n    count/deployments.apps: \"0\"\n",
        )
        .unwrap_or_else(|e| panic!("{e:#}"));
    world.start_operator(&[ns], &[]);
    world.apply_stack(ns);

    let refused = world.wait_for(
        "the LockServer reports the refused apply",
        Duration::from_secs(90),
        || world.get_json(&["lockserver", "lock-server", "-n", ns]),
        |refused| condition(refused, "Ready").is_some_and(|c| c["reason"] == "ApplyFailed"),
    );
    let ready = condition(&refused, "Ready").cloned().unwrap_or_default();
    let degraded = condition(&refused, "Degraded").cloned().unwrap_or_default();
    assert_eq!(ready["status"], "False", "{ready}");
    assert_eq!(degraded["status"], "True", "{degraded}");
    assert_eq!(degraded["reason"], "ApplyFailed", "{degraded}");
    let message = ready["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("Deployment") && message.contains("quota"),
        "the condition names what was refused and why: {message}"
    );
    // The same failure as a Warning Event, where `kubectl describe` and `kubectl get events`
    // look.
    let mut events = Vec::new();
    world.wait_until("the Warning Event", Duration::from_secs(30), || {
        events = warning_events(&world, ns, "lock-server", "ApplyFailed");
        !events.is_empty()
    });
    let note = events[0]["message"].as_str().unwrap_or_default();
    assert!(note.contains("quota"), "{}", events[0]);
    assert!(
        world.get_json(&["deployments", "-n", ns])["items"]
            .as_array()
            .is_some_and(Vec::is_empty),
        "nothing was created past the refusal"
    );

    // The quota goes; the back-off retries by itself (no edit of the object) and the same
    // conditions report the service Ready.
    let lifted = Instant::now();
    world.kubectl(&["delete", "resourcequota", "no-deployments", "-n", ns]);
    world.wait_ready("lockserver/lock-server", ns, "180s");
    let recovered = world.get_json(&["lockserver", "lock-server", "-n", ns]);
    let degraded = condition(&recovered, "Degraded")
        .cloned()
        .unwrap_or_default();
    assert_eq!(degraded["status"], "False", "{degraded}");
    // The failure manager wrote only conditions: the rest of the status is the operator's.
    assert!(
        recovered["status"]["url"].is_string(),
        "{}",
        recovered["status"]
    );
    eprintln!(
        "Ready {} ms after the quota went; scenario done in {} ms",
        lifted.elapsed().as_millis(),
        world.elapsed_ms()
    );
}
