//! What every pod the operator builds has: the runtime's seccomp profile, requests and limits,
//! the spec's pull secrets, no Argo CD tracking label, and the service account whose token its
//! TokenReview calls need.

use super::*;

/// Every pod the operator builds runs with the runtime's default seccomp profile and with
/// requests and limits (the spec's when given, the operator's defaults otherwise), and pulls with
/// the spec's `imagePullSecrets`.
#[test]
fn every_pod_has_seccomp_resources_and_the_specs_pull_secrets() {
    let rail = validated_rail_proxy();
    let payment = validated_payment_resource();
    let lock_server = validated_lock_server();
    let batch = validate_batch(&fixtures::payout_batch()).unwrap();
    let once = validate::reconciliation(&fixtures::reconciliation(None), &settings()).unwrap();
    let mut pods: Vec<(String, serde_json::Value)> = Vec::new();
    for workload in [
        &lock_server,
        &payment,
        &rail.proxy,
        rail.stub.as_ref().unwrap(),
    ] {
        let d = serde_json::to_value(deployment::deployment(workload)).unwrap();
        pods.push((workload.name.clone(), d["spec"]["template"]["spec"].clone()));
    }
    let job = serde_json::to_value(job::executor_job(&batch)).unwrap();
    pods.push(("executor".into(), job["spec"]["template"]["spec"].clone()));
    let job = serde_json::to_value(reconciler::reconciler_job(&once)).unwrap();
    pods.push(("reconciler".into(), job["spec"]["template"]["spec"].clone()));
    let cron = serde_json::to_value(reconciler::reconciler_cron_job(&once, "0 * * * *")).unwrap();
    pods.push((
        "reconciler-cron".into(),
        cron["spec"]["jobTemplate"]["spec"]["template"]["spec"].clone(),
    ));
    for (name, pod) in &pods {
        assert_eq!(
            pod["securityContext"]["seccompProfile"],
            json!({"type": "RuntimeDefault"}),
            "{name}"
        );
        let resources = &pod["containers"][0]["resources"];
        assert!(
            resources["requests"]["cpu"].is_string()
                && resources["requests"]["memory"].is_string()
                && resources["limits"]["memory"].is_string(),
            "{name}: {resources}"
        );
        let pull = &pod["imagePullSecrets"];
        if name == "payment-resource" {
            assert_eq!(pull, &json!([{"name": "regcred"}]), "{name}");
            assert_eq!(resources["limits"], json!({"cpu": "1", "memory": "1Gi"}));
        } else {
            assert!(pull.is_null(), "{name}: {pull}");
            assert_eq!(
                resources["limits"].as_object().unwrap().len(),
                1,
                "{name}: a memory limit, no CPU limit by default"
            );
        }
    }
}

/// Argo CD tracks objects by `app.kubernetes.io/instance`: no object the operator makes carries
/// it (an Application named like the custom resource would claim and prune it). Only a
/// Deployment's pods do, because its immutable selector was made with it.
#[test]
fn no_object_the_operator_makes_carries_argo_cds_tracking_label() {
    let rail = validated_rail_proxy();
    let stub = rail.stub.clone().unwrap();
    let batch = validate_batch(&fixtures::payout_batch()).unwrap();
    let once = validate::reconciliation(&fixtures::reconciliation(None), &settings()).unwrap();
    let objects = [
        serde_json::to_value(deployment::deployment(&rail.proxy)).unwrap(),
        serde_json::to_value(service::service(&rail.proxy)).unwrap(),
        serde_json::to_value(config_map::config_map(&rail.proxy)).unwrap(),
        serde_json::to_value(pdb::pdb(&rail.proxy)).unwrap(),
        serde_json::to_value(network_policy::rail_network_policy(&stub, "rail-proxy")).unwrap(),
        serde_json::to_value(job::executor_job(&batch)).unwrap(),
        serde_json::to_value(job::manifest_config_map(&batch)).unwrap(),
        serde_json::to_value(reconciler::reconciler_job(&once)).unwrap(),
        serde_json::to_value(reconciler::reconciler_cron_job(&once, "0 * * * *")).unwrap(),
    ];
    for object in &objects {
        let labels = &object["metadata"]["labels"];
        assert!(
            labels["app.kubernetes.io/instance"].is_null()
                && labels["dlock.io/instance"].is_string(),
            "{}: {labels}",
            object["kind"]
        );
    }
    // Job pods are selected by the Job's own uid: they drop it too.
    assert!(
        objects[5]["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/instance"]
            .is_null()
    );
}

/// Every service runs as the namespace's `dlock-service` account with its token mounted, which
/// its TokenReview calls need; the account has no owner (the namespace's services share it). The
/// rail stub runs as it too: it checks every caller with TokenReview.
#[test]
fn the_services_run_as_the_namespaces_service_account_with_a_token_for_token_review() {
    let lock_server = validated_lock_server();
    let payment = validated_payment_resource();
    let rail = validated_rail_proxy();
    let stub = rail.stub.as_ref().unwrap();
    for workload in [&lock_server, &payment, &rail.proxy, stub] {
        let pod = deployment::deployment(workload)
            .spec
            .unwrap()
            .template
            .spec
            .unwrap();
        assert_eq!(pod.service_account_name.as_deref(), Some("dlock-service"));
        assert_eq!(pod.automount_service_account_token, Some(true));
    }
    for workload in [&lock_server, &payment, &rail.proxy] {
        assert!(
            workload.config_toml.contains(
                "\"auth.mode\" = \"tokenreview\"\n\"auth.tokenreview.audiences\" = [\"dlock\"]\n\"auth.operator-identities\" = [\"system:serviceaccount:dlock-system:dlock-operator\"]\n"
            ),
            "{}",
            workload.config_toml
        );
    }
    assert_json(
        &service_account::service_account("payments"),
        json!({
            "apiVersion": "v1",
            "kind": "ServiceAccount",
            "metadata": {
                "name": "dlock-service",
                "namespace": "payments",
                "labels": {
                    "app.kubernetes.io/component": "service",
                    "app.kubernetes.io/managed-by": "dlock-operator",
                    "app.kubernetes.io/name": "dlock",
                },
            },
        }),
    );
}
