//! Reconciliation on the real control plane: a one-off run's reconciler Job reads the real paydb
//! and the rail's statement and its findings reach the object's status; a schedule becomes a
//! CronJob, and removing the schedule leaves no CronJob behind.

use std::time::Duration;

use dlock_devstack::wait_until;
use serde_json::Value;

use crate::world::World;

const NS: &str = "audit";

/// The status of the Reconciliation `name` in `namespace`, read with `kubectl` (`kubectl get …
/// -o json`); Null while there is none to read.
pub fn reconciliation_status<E>(
    kubectl: impl Fn(&[&str]) -> Result<String, E>,
    name: &str,
    namespace: &str,
) -> Value {
    kubectl(&["get", "reconciliation", name, "-n", namespace, "-o", "json"])
        .ok()
        .and_then(|t| serde_json::from_str::<Value>(&t).ok())
        .map(|o| o["status"].clone())
        .unwrap_or(Value::Null)
}

/// A Reconciliation's `status` whose summary, the reconciler's own, counts no double payment.
#[track_caller]
pub fn assert_no_double_payment(status: &Value) {
    assert!(
        status["summary"]
            .as_str()
            .is_some_and(|s| s.contains("double payments: 0")),
        "the reconciler's own summary: {status}"
    );
}

fn reconciliation(name: &str, schedule: Option<&str>) -> String {
    let mut yaml = format!(
        "apiVersion: dlock.io/v1alpha1\nkind: Reconciliation\nmetadata:\n  name: {name}\nspec:\n  \
         databaseUrlSecret: {{name: paydb, key: url}}\n  railProxy: rail-proxy\n"
    );
    if let Some(schedule) = schedule {
        yaml.push_str(&format!("  schedule: \"{schedule}\"\n"));
    }
    yaml
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_reconciliation_reports_its_findings_in_status_and_a_removed_schedule_leaves_no_cron_job()
{
    let mut world = World::with_operator(NS, &[]).await;
    world.start_kubelet(&[NS]);
    let paydb = world.services().url("paydb");
    world.apply_stack(NS);
    // The real paydb in place of the sample's URL.
    let secret = format!(
        "apiVersion: v1\nkind: Secret\nmetadata:\n  name: paydb\nstringData:\n  url: {paydb}\n"
    );
    world.apply(NS, &secret).unwrap_or_else(|e| panic!("{e:#}"));

    // Once: the reconciler Job runs `dlock reconcile` for real; its summary reaches status.
    world
        .apply(NS, &reconciliation("once", None))
        .unwrap_or_else(|e| panic!("{e:#}"));
    let mut status = Value::Null;
    wait_until("the findings in status", Duration::from_secs(240), || {
        status = reconciliation_status(|args| world.try_kubectl(args), "once", NS);
        let ready = status["conditions"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|c| c["type"] == "Ready" && c["status"] == "True");
        ready
            && world
                .kubelet()
                .ran()
                .iter()
                .any(|r| r.args.first().map(String::as_str) == Some("reconcile"))
    })
    .unwrap_or_else(|e| {
        panic!(
            "{e:#}: {status}\nran: {:?}{}",
            world.kubelet().ran(),
            world.diagnostics()
        )
    });
    let ran = world.kubelet().ran();
    assert!(
        ran.iter()
            .any(|r| r.args.first().map(String::as_str) == Some("reconcile")
                && r.exit_code == Some(0)),
        "the reconciler ran and found nothing critical: {ran:?}"
    );
    eprintln!("reconciliation status: {status}");
    assert_no_double_payment(&status);
    let object = world.get_json(&["reconciliation", "once", "-n", NS]);
    let (health, message) = crate::world::argocd_health("Reconciliation", &object);
    assert_eq!(health, "Healthy", "{message}");

    // On a schedule: a CronJob; the schedule removed: no CronJob.
    world
        .apply(NS, &reconciliation("hourly", Some("0 * * * *")))
        .unwrap_or_else(|e| panic!("{e:#}"));
    wait_until("the CronJob", Duration::from_secs(60), || {
        world
            .try_kubectl(&["get", "cronjob", "-n", NS, "-o", "name"])
            .is_ok_and(|t| !t.trim().is_empty())
    })
    .unwrap_or_else(|e| panic!("{e:#}{}", world.diagnostics()));
    let cron = world.kubectl(&["get", "cronjob", "-n", NS, "-o", "name"]);
    world
        .apply(NS, &reconciliation("hourly", None))
        .unwrap_or_else(|e| panic!("{e:#}"));
    wait_until("the CronJob is gone", Duration::from_secs(60), || {
        world
            .try_kubectl(&["get", "cronjob", "-n", NS, "-o", "name"])
            .is_ok_and(|t| t.trim().is_empty())
    })
    .unwrap_or_else(|e| panic!("{e:#}: was {cron}{}", world.diagnostics()));
    eprintln!("scenario done in {} ms", world.elapsed_ms());
}
