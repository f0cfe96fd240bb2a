//! Running the operator: the paused annotation, and two replicas under leader election.

use std::time::{Duration, Instant};

use dlock_devstack::{Signal, wait_until};
use serde_json::Value;

use crate::world::{OPERATOR_NAMESPACE, World};

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

fn replicas(world: &World, ns: &str, deployment: &str) -> i64 {
    world
        .get_json(&["deployment", deployment, "-n", ns])
        .pointer("/spec/replicas")
        .and_then(Value::as_i64)
        .unwrap_or(-1)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_paused_lock_server_is_left_alone_until_the_annotation_goes() {
    let mut world = World::start().await;
    let ns = "paused";
    world.namespace(ns);
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
    wait_until(
        "the operator sees the pause",
        Duration::from_secs(60),
        || reconciles(port, "LockServer", "paused") >= 1,
    )
    .unwrap_or_else(|e| panic!("{e:#}{}", world.diagnostics()));
    let seen = reconciles(port, "LockServer", "paused");
    let before = world.get_json(&["lockserver", "lock-server", "-n", ns]);
    world.kubectl(&[
        "patch",
        "lockserver/lock-server",
        "-n",
        ns,
        "--type=merge",
        "-p",
        r#"{"spec":{"replicas":3}}"#,
    ]);
    // The operator reconciled the edit (one more paused reconcile) and changed nothing.
    wait_until(
        "the operator reconciles the edit",
        Duration::from_secs(60),
        || reconciles(port, "LockServer", "paused") > seen,
    )
    .unwrap_or_else(|e| panic!("{e:#}{}", world.diagnostics()));
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
    wait_until(
        "the edit is applied once unpaused",
        Duration::from_secs(60),
        || replicas(&world, ns, "lock-server") == 3,
    )
    .unwrap_or_else(|e| panic!("{e:#}{}", world.diagnostics()));
    eprintln!(
        "scenario done in {} ms",
        world.started.elapsed().as_millis()
    );
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
    let mut world = World::start().await;
    let ns = "ha";
    world.namespace(ns);
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
    world.kubectl(&[
        "patch",
        "lockserver/lock-server",
        "-n",
        ns,
        "--type=merge",
        "-p",
        r#"{"spec":{"replicas":3}}"#,
    ]);
    wait_until(
        "the standby holds the Lease",
        Duration::from_secs(60),
        || lease_holder(&world) == format!("dlock-operator-{standby_index}"),
    )
    .unwrap_or_else(|e| panic!("{e:#}{}", world.diagnostics()));
    let takeover = stopped.elapsed();
    wait_until(
        "the new leader applies the edit",
        Duration::from_secs(60),
        || replicas(&world, ns, "lock-server") == 3,
    )
    .unwrap_or_else(|e| panic!("{e:#}{}", world.diagnostics()));
    assert!(reconciles(standby_port, "LockServer", "ok") > 0);
    // The Lease was last renewed at most one renewal period (the lease's third, 5 s) before the
    // kill; the standby may take it once 15 s have passed since, at its next attempt.
    assert!(
        takeover <= Duration::from_secs(15 + 5 + 5),
        "takeover within the lease duration (15 s) plus a renewal period and an attempt: {takeover:?}"
    );
    eprintln!(
        "takeover after {} ms; scenario done in {} ms",
        takeover.as_millis(),
        world.started.elapsed().as_millis()
    );
}
