//! Every builder's whole output, compared with an expected object (inline JSON for the small
//! ones, committed YAML snapshots for the rest).

use dlock_operator::build::{
    config_map, deployment, job, lock, network_policy, pdb, reconciler, service,
};
use dlock_operator::validate;
use serde_json::json;

use crate::fixtures::{self, assert_snapshot, settings};

fn owner(kind: &str, name: &str, uid: &str) -> serde_json::Value {
    json!({
        "apiVersion": "dlock.io/v1alpha1",
        "controller": true,
        "kind": kind,
        "name": name,
        "uid": uid,
    })
}

fn labels(component: &str, instance: &str) -> serde_json::Value {
    json!({
        "app.kubernetes.io/component": component,
        "app.kubernetes.io/instance": instance,
        "app.kubernetes.io/managed-by": "dlock-operator",
        "app.kubernetes.io/name": "dlock",
    })
}

/// The Service selects exactly the workload's pods by its immutable selector labels, or traffic
/// would reach another instance's pods.
#[test]
fn the_lock_server_service_selects_its_own_pods_on_the_http_port() {
    let workload = validate::lock_server(&fixtures::lock_server(), &settings()).unwrap();
    assert_eq!(
        serde_json::to_value(service::service(&workload)).unwrap(),
        json!({
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {
                "name": "lock-server",
                "namespace": "default",
                "labels": labels("lock-server", "lock-server"),
                "ownerReferences": [owner("LockServer", "lock-server", "uid-lock-server")],
            },
            "spec": {
                "selector": {
                    "app.kubernetes.io/component": "lock-server",
                    "app.kubernetes.io/instance": "lock-server",
                    "app.kubernetes.io/name": "dlock",
                },
                "ports": [{"name": "http", "port": 8080, "protocol": "TCP", "targetPort": "http"}],
            },
        })
    );
}

/// At most one pod is evicted at a time, or a node drain could take every replica at once.
#[test]
fn the_pod_disruption_budget_allows_one_eviction_at_a_time() {
    let workload = validate::payment_resource(&fixtures::payment_resource(), &settings()).unwrap();
    assert_eq!(
        serde_json::to_value(pdb::pdb(&workload)).unwrap(),
        json!({
            "apiVersion": "policy/v1",
            "kind": "PodDisruptionBudget",
            "metadata": {
                "name": "payment-resource",
                "namespace": "default",
                "labels": labels("payment-resource", "payment-resource"),
                "ownerReferences": [owner("PaymentResource", "payment-resource", "uid-payment-resource")],
            },
            "spec": {
                "maxUnavailable": 1,
                "selector": {"matchLabels": {
                    "app.kubernetes.io/component": "payment-resource",
                    "app.kubernetes.io/instance": "payment-resource",
                    "app.kubernetes.io/name": "dlock",
                }},
            },
        })
    );
}

/// The lock server's configuration names the backend and listens on the pod port; the lockdb URL
/// is not in it (it comes from the Secret through `DLOCK_LOCK_PG_URL`).
#[test]
fn the_lock_server_config_map_holds_the_toml_without_secrets() {
    let workload = validate::lock_server(&fixtures::lock_server(), &settings()).unwrap();
    assert_eq!(
        serde_json::to_value(config_map::config_map(&workload)).unwrap(),
        json!({
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {
                "name": "lock-server",
                "namespace": "default",
                "labels": labels("lock-server", "lock-server"),
                "ownerReferences": [owner("LockServer", "lock-server", "uid-lock-server")],
            },
            "data": {
                "config.toml": "\"server.listen\" = \"0.0.0.0:8080\"\n\"lock.backend\" = \"pg\"\n",
            },
        })
    );
}

#[test]
fn an_etcd_lock_server_config_lists_the_endpoints() {
    let mut object = fixtures::lock_server();
    object.spec.backend = fixtures::etcd_backend();
    let workload = validate::lock_server(&object, &settings()).unwrap();
    assert_eq!(
        workload.config_toml,
        "\"server.listen\" = \"0.0.0.0:8080\"\n\"lock.backend\" = \"etcd\"\n\"lock.etcd.endpoints\" = [\"https://etcd-0.etcd:2379\"]\n"
    );
    assert!(workload.secret_env.is_empty());
    assert_snapshot(
        "lock-server-etcd-deployment",
        &deployment::deployment(&workload),
    );
}

/// maxUnavailable 0, readiness on /readyz (which gates on the backend and, since each service
/// migrates before it listens, on the migrations), the lockdb URL from its Secret.
#[test]
fn the_lock_server_deployment_rolls_without_losing_capacity() {
    let workload = validate::lock_server(&fixtures::lock_server(), &settings()).unwrap();
    assert_snapshot("lock-server-deployment", &deployment::deployment(&workload));
}

/// The Cloud SQL Auth Proxy runs as a native sidecar, started before the service.
#[test]
fn the_payment_resource_deployment_has_the_cloud_sql_sidecar_and_its_secrets() {
    let workload = validate::payment_resource(&fixtures::payment_resource(), &settings()).unwrap();
    assert_snapshot(
        "payment-resource-deployment",
        &deployment::deployment(&workload),
    );
    assert_snapshot(
        "payment-resource-config-map",
        &config_map::config_map(&workload),
    );
}

/// The proxy's pods get the read timeout plus ten seconds to stop, or a rollout could cut a
/// forward in flight and leave its outcome unknown.
#[test]
fn the_rail_proxy_deployment_outlasts_the_rail_read_timeout() {
    let rail = validate::rail_proxy(&fixtures::rail_proxy(), &settings()).unwrap();
    assert_eq!(rail.proxy.termination_grace_period_seconds, 18);
    assert_snapshot(
        "rail-proxy-deployment",
        &deployment::deployment(&rail.proxy),
    );
    assert_snapshot(
        "rail-proxy-config-map",
        &config_map::config_map(&rail.proxy),
    );
    let stub = rail.stub.expect("the stub is asked for");
    assert_snapshot("rail-stub-deployment", &deployment::deployment(&stub));
    assert_snapshot("rail-stub-config-map", &config_map::config_map(&stub));
}

/// Only the rail proxy's pods may reach the stub: any other caller would bypass the proxy's
/// durable high-water mark.
#[test]
fn only_the_rail_proxy_reaches_the_rail_stub() {
    let rail = validate::rail_proxy(&fixtures::rail_proxy(), &settings()).unwrap();
    let stub = rail.stub.expect("the stub is asked for");
    assert_eq!(
        serde_json::to_value(network_policy::rail_network_policy(
            &stub,
            &rail.proxy.instance
        ))
        .unwrap(),
        json!({
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": {
                "name": "rail-proxy-stub",
                "namespace": "default",
                "labels": labels("rail-stub", "rail-proxy"),
                "ownerReferences": [owner("RailProxy", "rail-proxy", "uid-rail-proxy")],
            },
            "spec": {
                "podSelector": {"matchLabels": {
                    "app.kubernetes.io/component": "rail-stub",
                    "app.kubernetes.io/instance": "rail-proxy",
                    "app.kubernetes.io/name": "dlock",
                }},
                "policyTypes": ["Ingress"],
                "ingress": [{
                    "from": [{"podSelector": {"matchLabels": {
                        "app.kubernetes.io/component": "rail-proxy",
                        "app.kubernetes.io/instance": "rail-proxy",
                        "app.kubernetes.io/name": "dlock",
                    }}}],
                    "ports": [{"port": "http", "protocol": "TCP"}],
                }],
            },
        })
    );
}

/// The executor reads the batch from a ConfigMap built from the spec, in exactly the format
/// `dlock run -f` takes (DESIGN §11): the same file runs locally and in the cluster.
#[test]
fn the_payout_batch_manifest_is_the_dlock_run_format() {
    let batch = validate::payout_batch(&fixtures::payout_batch(), &settings()).unwrap();
    let manifest = job::manifest_config_map(&batch);
    assert_snapshot("payout-batch-manifest", &manifest);
    let text = &manifest.data.as_ref().unwrap()["payoutbatch.yaml"];
    let parsed: serde_json::Value = serde_yaml_ng::from_str(text).unwrap();
    assert_eq!(
        parsed,
        json!({
            "apiVersion": "dlock.io/v1alpha1",
            "kind": "PayoutBatch",
            "metadata": {"name": "payroll-2026-12", "namespace": "default"},
            "spec": {"workers": 8, "payouts": [
                {"key": "emp-0001", "accountId": "acct-17", "amountMinor": 125000, "currency": "EUR", "beneficiaryRef": "ben-emp-0001"},
                {"key": "emp-0002", "accountId": "acct-18", "amountMinor": 98000, "currency": "EUR", "beneficiaryRef": "ben-emp-0002"},
            ]},
        })
    );
}

/// The Job's name and arguments come from the batch name and spec only (never a uid or a clock),
/// so a re-synced or re-created batch names the same Job and the same payouts.
#[test]
fn the_executor_job_runs_dlock_run_with_the_workers() {
    let batch = validate::payout_batch(&fixtures::payout_batch(), &settings()).unwrap();
    assert_snapshot("payout-batch-job", &job::executor_job(&batch));
    let mut recreated = fixtures::payout_batch();
    recreated.metadata.uid = Some("another-uid".to_owned());
    let again = validate::payout_batch(&recreated, &settings()).unwrap();
    assert_eq!(
        serde_json::to_value(job::executor_job(&again).spec).unwrap(),
        serde_json::to_value(job::executor_job(&batch).spec).unwrap()
    );
}

#[test]
fn a_batch_with_a_repeated_key_is_refused_before_anything_is_built() {
    let mut object = fixtures::payout_batch();
    object.spec.payouts[1].key = "emp-0001".to_owned();
    let error = validate::payout_batch(&object, &settings()).unwrap_err();
    assert_eq!(error.field, "spec.payouts[1].key");
}

#[test]
fn a_mirrored_lock_is_named_from_its_key_and_owned_by_its_lock_server() {
    let server = fixtures::lock_server();
    let owner = kube::Resource::controller_owner_ref(&server, &()).unwrap();
    let held = lock::HeldLock {
        key: "payout:acct-17".to_owned(),
        owner_id: "executor-7".to_owned(),
        fencing_token: 42,
        acquired_at: "2026-12-02T16:59:00Z".to_owned(),
        expires_at: "2026-12-02T17:00:10Z".to_owned(),
    };
    let name = lock::lock_name("lock-server", &held.key);
    assert!(name.starts_with("payout-acct-17-"), "{name}");
    assert_eq!(
        serde_json::to_value(lock::mirrored_lock("lock-server", "default", &held, &owner)).unwrap(),
        json!({
            "apiVersion": "dlock.io/v1alpha1",
            "kind": "Lock",
            "metadata": {
                "name": name,
                "namespace": "default",
                "labels": {
                    "app.kubernetes.io/managed-by": "dlock-operator",
                    "app.kubernetes.io/name": "dlock",
                    "dlock.io/lock-server": "lock-server",
                },
                "ownerReferences": [owner_json()],
            },
            "spec": {"key": "payout:acct-17", "lockServer": "lock-server", "accountId": "acct-17"},
        })
    );
}

fn owner_json() -> serde_json::Value {
    owner("LockServer", "lock-server", "uid-lock-server")
}

/// The reconciler reads paydb from its Secret and the rail's statement from the proxy's stub;
/// scheduled runs never overlap (`Forbid`), and a run that found something is not retried.
#[test]
fn the_reconciler_runs_once_as_a_job_or_on_a_schedule_as_a_cron_job() {
    let once = validate::reconciliation(&fixtures::reconciliation(None), &settings()).unwrap();
    assert_snapshot("reconciliation-job", &reconciler::reconciler_job(&once));
    let hourly =
        validate::reconciliation(&fixtures::reconciliation(Some("0 * * * *")), &settings())
            .unwrap();
    assert_snapshot(
        "reconciliation-cron-job",
        &reconciler::reconciler_cron_job(&hourly, "0 * * * *"),
    );
    let error = validate::reconciliation(&fixtures::reconciliation(Some("hourly")), &settings())
        .unwrap_err();
    assert_eq!(error.field, "spec.schedule");
}
