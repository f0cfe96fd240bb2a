//! Every builder's whole output, compared with an expected object (inline JSON for the small
//! ones, committed YAML snapshots for the rest).

use dlock_operator::build::{
    config_map, deployment, job, lock, network_policy, pdb, proof_keys, reconciler, service,
    service_account,
};
use dlock_operator::validate;
use serde_json::json;

use crate::fixtures::{self, assert_snapshot, settings};

/// The object a builder made serialises to exactly `expected`.
#[track_caller]
fn assert_json(built: &impl serde::Serialize, expected: serde_json::Value) {
    assert_eq!(serde_json::to_value(built).unwrap(), expected);
}

fn owner(kind: &str, name: &str, uid: &str) -> serde_json::Value {
    json!({
        "apiVersion": "dlock.io/v1alpha1",
        "controller": true,
        "kind": kind,
        "name": name,
        "uid": uid,
    })
}

/// The labels of an object the operator makes: `dlock.io/instance`, never Argo CD's tracking
/// label `app.kubernetes.io/instance`.
fn labels(component: &str, instance: &str) -> serde_json::Value {
    json!({
        "app.kubernetes.io/component": component,
        "dlock.io/instance": instance,
        "app.kubernetes.io/managed-by": "dlock-operator",
        "app.kubernetes.io/name": "dlock",
    })
}

/// The metadata of an object named like the service custom resource (`kind`, `name`) it is made
/// for.
fn workload_meta(kind: &str, name: &str) -> serde_json::Value {
    object_meta(
        name,
        labels(name, name),
        owner(kind, name, &format!("uid-{name}")),
    )
}

/// The metadata of an object the operator makes for a custom resource in `default`.
fn object_meta(
    name: &str,
    labels: serde_json::Value,
    owner: serde_json::Value,
) -> serde_json::Value {
    json!({
        "name": name,
        "namespace": "default",
        "labels": labels,
        "ownerReferences": [owner],
    })
}

/// The immutable selector labels of a workload's pods.
fn selector(component: &str, instance: &str) -> serde_json::Value {
    json!({
        "app.kubernetes.io/component": component,
        "app.kubernetes.io/instance": instance,
        "app.kubernetes.io/name": "dlock",
    })
}

/// The Service selects exactly the workload's pods by its immutable selector labels, or traffic
/// would reach another instance's pods.
#[test]
fn the_lock_server_service_selects_its_own_pods_on_the_http_port() {
    let workload = validate::lock_server(&fixtures::lock_server(), &settings()).unwrap();
    assert_json(
        &service::service(&workload),
        json!({
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": workload_meta("LockServer", "lock-server"),
            "spec": {
                "selector": selector("lock-server", "lock-server"),
                "ports": [{"name": "http", "port": 8080, "protocol": "TCP", "targetPort": "http"}],
            },
        }),
    );
}

/// At most one pod is evicted at a time, or a node drain could take every replica at once.
#[test]
fn the_pod_disruption_budget_allows_one_eviction_at_a_time() {
    let workload = validate::payment_resource(&fixtures::payment_resource(), &settings()).unwrap();
    assert_json(
        &pdb::pdb(&workload),
        json!({
            "apiVersion": "policy/v1",
            "kind": "PodDisruptionBudget",
            "metadata": workload_meta("PaymentResource", "payment-resource"),
            "spec": {
                "maxUnavailable": 1,
                "selector": {"matchLabels": selector("payment-resource", "payment-resource")},
            },
        }),
    );
}

/// The lock server's configuration names the backend and listens on the pod port; the lockdb URL
/// is not in it (it comes from the Secret through `DLOCK_LOCK_PG_URL`). Authentication is on:
/// TokenReview with the audience `dlock`, and the operator's service account as the only operator
/// identity.
#[test]
fn the_lock_server_config_map_holds_the_toml_without_secrets() {
    let workload = validate::lock_server(&fixtures::lock_server(), &settings()).unwrap();
    assert_json(
        &config_map::config_map(&workload),
        json!({
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": workload_meta("LockServer", "lock-server"),
            "data": {
                "config.toml": "\"server.listen\" = \"0.0.0.0:8080\"\n\"lock.backend\" = \"pg\"\n\"auth.mode\" = \"tokenreview\"\n\"auth.tokenreview.audiences\" = [\"dlock\"]\n\"auth.operator-identities\" = [\"system:serviceaccount:dlock-system:dlock-operator\"]\n\"fencing.proof-keys-file\" = \"/etc/dlock/fencing-proof-keys/keys\"\n",
            },
        }),
    );
}

#[test]
fn an_etcd_lock_server_config_lists_the_endpoints() {
    let mut object = fixtures::lock_server();
    object.spec.backend = fixtures::etcd_backend();
    let workload = validate::lock_server(&object, &settings()).unwrap();
    assert_eq!(
        workload.config_toml,
        "\"server.listen\" = \"0.0.0.0:8080\"\n\"lock.backend\" = \"etcd\"\n\"lock.etcd.endpoints\" = [\"https://etcd-0.etcd:2379\"]\n\"lock.etcd.ca-file\" = \"/etc/dlock/etcd-tls/ca.crt\"\n\"lock.etcd.cert-file\" = \"/etc/dlock/etcd-tls/tls.crt\"\n\"lock.etcd.key-file\" = \"/etc/dlock/etcd-tls/tls.key\"\n\"lock.etcd.username\" = \"dlock\"\n\"lock.etcd.password-file\" = \"/etc/dlock/etcd-auth/password\"\n\"auth.mode\" = \"tokenreview\"\n\"auth.tokenreview.audiences\" = [\"dlock\"]\n\"auth.operator-identities\" = [\"system:serviceaccount:dlock-system:dlock-operator\"]\n\"fencing.proof-keys-file\" = \"/etc/dlock/fencing-proof-keys/keys\"\n"
    );
    assert!(workload.secret_env.is_empty());
    assert_snapshot(
        "lock-server-etcd-deployment",
        &deployment::deployment(&workload),
    );
}

/// `spec.backend.etcd.tlsSecret` (the `kubernetes.io/tls` layout: `ca.crt`, `tls.crt`,
/// `tls.key`) and `spec.backend.etcd.auth` reach the lock server: both Secrets mounted read-only
/// as directories (a renewed certificate or a changed password reaches the pod) and named by the
/// `lock.etcd.*` file keys; no password in the ConfigMap or the environment. TLS without
/// `https://` endpoints (or the reverse), a bad user name or a key that could leave the mount is
/// refused by validation (the controller's Degraded `InvalidSpec`), before a pod crash-loops.
#[test]
fn the_etcd_tls_secret_and_password_are_mounted_and_named_by_the_lock_etcd_keys() {
    let mut object = fixtures::lock_server();
    object.spec.backend = fixtures::etcd_backend();
    let workload = validate::lock_server(&object, &settings()).unwrap();
    let config: toml::Table = workload.config_toml.parse().unwrap();
    for (key, value) in [
        ("lock.etcd.ca-file", "/etc/dlock/etcd-tls/ca.crt"),
        ("lock.etcd.cert-file", "/etc/dlock/etcd-tls/tls.crt"),
        ("lock.etcd.key-file", "/etc/dlock/etcd-tls/tls.key"),
        ("lock.etcd.username", "dlock"),
        ("lock.etcd.password-file", "/etc/dlock/etcd-auth/password"),
    ] {
        assert_eq!(config[key].as_str(), Some(value), "{key}");
    }
    let pod = serde_json::to_value(deployment::deployment(&workload)).unwrap()["spec"]["template"]
        ["spec"]
        .clone();
    let container = &pod["containers"][0];
    let mounts = container["volumeMounts"].as_array().unwrap();
    let volumes = pod["volumes"].as_array().unwrap();
    for (volume, dir, secret) in [
        ("etcd-tls", "/etc/dlock/etcd-tls", "etcd-client-tls"),
        ("etcd-auth", "/etc/dlock/etcd-auth", "etcd-dlock-user"),
    ] {
        assert!(
            mounts.contains(&json!({"name": volume, "mountPath": dir, "readOnly": true})),
            "{mounts:?}"
        );
        assert!(
            volumes.contains(&json!({"name": volume, "secret": {"secretName": secret}})),
            "{volumes:?}"
        );
    }
    assert!(
        !container["env"].to_string().contains("etcd-dlock-user"),
        "the password is a file, not an environment variable"
    );

    // Without TLS and auth: plain endpoints, no keys, no mounts.
    let mut plain = object.clone();
    plain.spec.backend.etcd = Some(dlock_operator::crd::EtcdBackend {
        endpoints: vec!["http://etcd:2379".to_owned()],
        tls_secret: None,
        auth: None,
    });
    let workload = validate::lock_server(&plain, &settings()).unwrap();
    assert!(
        !workload.config_toml.contains("lock.etcd.ca-file")
            && !workload.config_toml.contains("password-file")
            && !workload.config_toml.contains("username"),
        "{}",
        workload.config_toml
    );
    let pod = serde_json::to_value(deployment::deployment(&workload)).unwrap();
    assert!(!pod.to_string().contains("etcd-"), "{pod}");

    let refused = |edit: &dyn Fn(&mut dlock_operator::crd::EtcdBackend)| {
        let mut object = object.clone();
        edit(object.spec.backend.etcd.as_mut().unwrap());
        validate::lock_server(&object, &settings()).unwrap_err()
    };
    let error = refused(&|etcd| etcd.endpoints.push("http://etcd-1.etcd:2379".to_owned()));
    assert_eq!(error.field, "spec.backend.etcd.endpoints[1]");
    assert!(error.message.contains("must be https://"), "{error}");
    let error = refused(&|etcd| etcd.tls_secret = None);
    assert_eq!(error.field, "spec.backend.etcd.endpoints[0]");
    assert!(error.message.contains("tlsSecret"), "{error}");
    let error = refused(&|etcd| etcd.auth.as_mut().unwrap().username = "dl ock".to_owned());
    assert_eq!(error.field, "spec.backend.etcd.auth.username");
    let error = refused(&|etcd| etcd.auth.as_mut().unwrap().password_secret.key = "../x".into());
    assert_eq!(error.field, "spec.backend.etcd.auth.passwordSecret.key");
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

/// The proxy's pods get the preStop sleep, the read timeout and ten seconds more to stop, or a
/// rollout could cut a forward in flight and leave its outcome unknown.
#[test]
fn the_rail_proxy_deployment_outlasts_the_rail_read_timeout() {
    let rail = validate::rail_proxy(&fixtures::rail_proxy(), &settings()).unwrap();
    assert_eq!(rail.proxy.termination_grace_period_seconds, 5 + 8 + 10);
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
/// durable high-water mark. The reconciler's pods may too, to read the statement.
#[test]
fn only_the_rail_proxy_and_the_reconciler_reach_the_rail_stub() {
    let rail = validate::rail_proxy(&fixtures::rail_proxy(), &settings()).unwrap();
    let stub = rail.stub.expect("the stub is asked for");
    assert_json(
        &network_policy::rail_network_policy(&stub, &rail.proxy.instance),
        json!({
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": object_meta("rail-proxy-stub", labels("rail-stub", "rail-proxy"), owner("RailProxy", "rail-proxy", "uid-rail-proxy")),
            "spec": {
                "podSelector": {"matchLabels": selector("rail-stub", "rail-proxy")},
                "policyTypes": ["Ingress"],
                "ingress": [{
                    "from": [
                        {"podSelector": {"matchLabels": selector("rail-proxy", "rail-proxy")}},
                        // The reconciler reads the rail statement.
                        {"podSelector": {"matchLabels": {
                            "app.kubernetes.io/component": "reconciler",
                            "app.kubernetes.io/name": "dlock",
                        }}},
                    ],
                    "ports": [{"port": "http", "protocol": "TCP"}],
                }],
            },
        }),
    );
}

/// The executor reads the batch from a ConfigMap built from the spec, in exactly the format
/// `dlock run -f` takes (docs/design.md#payout-batch): the same file runs locally and in the
/// cluster.
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
fn the_executor_job_runs_dlock_run_on_the_manifest() {
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

/// The executor authenticates: a Secret's token as `DLOCK_CREDENTIAL` with the identity it names,
/// or (no Secret) a projected service-account token with audience `dlock` as the file
/// `DLOCK_CREDENTIAL_FILE` names, as the service account's TokenReview identity. Its owner id is
/// `<identity>/<batch>`, which the services' owner binding accepts.
#[test]
fn the_executor_job_carries_its_credential_and_identity() {
    let mut object = fixtures::payout_batch();
    object.spec.executor = Some(dlock_operator::crd::ExecutorSpec {
        identity: Some("executor".to_owned()),
        credential_secret: Some(dlock_operator::crd::SecretKeyRef {
            name: "executor-credential".to_owned(),
            key: "token".to_owned(),
        }),
        service_account_name: None,
    });
    let batch = validate::payout_batch(&object, &settings()).unwrap();
    let job = serde_json::to_value(job::executor_job(&batch)).unwrap();
    let pod = &job["spec"]["template"]["spec"];
    let container = &pod["containers"][0];
    let env = |name: &str| {
        container["env"]
            .as_array()
            .unwrap()
            .iter()
            .find(|e| e["name"] == name)
            .cloned()
    };
    assert_eq!(
        env("DLOCK_IDENTITY"),
        Some(json!({"name": "DLOCK_IDENTITY", "value": "executor"}))
    );
    assert_eq!(
        env("DLOCK_CREDENTIAL"),
        Some(
            json!({"name": "DLOCK_CREDENTIAL", "valueFrom": {"secretKeyRef": {
            "name": "executor-credential", "key": "token", "optional": false}}})
        )
    );
    assert_eq!(env("DLOCK_CREDENTIAL_FILE"), None);
    let args = container["args"].as_array().unwrap();
    let owner = args.iter().position(|a| a == "--owner-id").unwrap();
    assert_eq!(args[owner + 1], "executor/payroll-2026-12");
    assert_eq!(
        pod["volumes"].as_array().unwrap().len(),
        1,
        "no token volume"
    );
    assert_eq!(pod["serviceAccountName"], "default");

    // No Secret: the service account's projected token, as its TokenReview identity.
    object.spec.executor = Some(dlock_operator::crd::ExecutorSpec {
        service_account_name: Some("payroll-runner".to_owned()),
        ..Default::default()
    });
    let batch = validate::payout_batch(&object, &settings()).unwrap();
    let job = serde_json::to_value(job::executor_job(&batch)).unwrap();
    let pod = &job["spec"]["template"]["spec"];
    assert_eq!(pod["serviceAccountName"], "payroll-runner");
    assert_eq!(pod["automountServiceAccountToken"], false);
    assert_eq!(
        pod["volumes"][1],
        json!({"name": "credential", "projected": {"sources": [{"serviceAccountToken": {
            "audience": "dlock", "expirationSeconds": 3600, "path": "token"}}]}})
    );
    let env = pod["containers"][0]["env"].as_array().unwrap();
    assert!(env.contains(&json!({"name": "DLOCK_IDENTITY",
        "value": "system:serviceaccount:default:payroll-runner"})));
    assert!(env.contains(&json!({"name": "DLOCK_CREDENTIAL_FILE",
        "value": "/var/run/secrets/dlock/executor/token"})));
    let args = pod["containers"][0]["args"].as_array().unwrap();
    assert!(args.contains(&json!(
        "system:serviceaccount:default:payroll-runner/payroll-2026-12"
    )));

    // A Secret without the identity it authenticates as, or an identity the service account's
    // token cannot prove, is refused.
    object.spec.executor = Some(dlock_operator::crd::ExecutorSpec {
        credential_secret: Some(dlock_operator::crd::SecretKeyRef {
            name: "executor-credential".to_owned(),
            key: "token".to_owned(),
        }),
        ..Default::default()
    });
    let error = validate::payout_batch(&object, &settings()).unwrap_err();
    assert_eq!(error.field, "spec.executor.identity");
    object.spec.executor = Some(dlock_operator::crd::ExecutorSpec {
        identity: Some("executor".to_owned()),
        ..Default::default()
    });
    let error = validate::payout_batch(&object, &settings()).unwrap_err();
    assert_eq!(error.field, "spec.executor.identity");
}

#[test]
fn a_batch_with_a_repeated_key_is_refused_before_anything_is_built() {
    let mut object = fixtures::payout_batch();
    object.spec.payouts[1].key = "emp-0001".to_owned();
    let error = validate::payout_batch(&object, &settings()).unwrap_err();
    assert_eq!(error.field, "spec.payouts[1].key");
}

/// The operator checks a batch with the contract's validator, the one `dlock run -f` applies:
/// what the executor would refuse is refused before a Job exists, every problem named.
#[test]
fn a_batch_the_executor_would_refuse_is_refused_with_every_problem_named() {
    let mut object = fixtures::payout_batch();
    object.spec.payouts[0].account_id = "acct/17".to_owned();
    object.spec.payouts[1].currency = "XXX".to_owned();
    let error = validate::payout_batch(&object, &settings()).unwrap_err();
    assert_eq!(error.field, "spec.payouts[0].accountId");
    assert!(
        error
            .message
            .contains(dlock_contract::payment::ACCOUNT_ID_RULE),
        "{error}"
    );
    assert!(
        error
            .message
            .contains("and 1 more: spec.payouts[1].currency: \"XXX\" is not"),
        "{error}"
    );
    let valid = validate::payout_batch(&fixtures::payout_batch(), &settings())
        .unwrap_or_else(|e| panic!("{e}"));
    let mut manifest =
        dlock_executor::manifest::parse(&valid.manifest_yaml).unwrap_or_else(|e| panic!("{e:#}"));
    manifest.spec.payouts = object.spec.payouts.clone();
    let text = serde_yaml_ng::to_string(&manifest).unwrap_or_else(|e| panic!("{e}"));
    let refused = dlock_executor::manifest::parse(&text)
        .err()
        .map(|e| format!("{e:#}"));
    assert!(
        refused
            .as_deref()
            .is_some_and(|e| e.contains("spec.payouts[0].accountId")),
        "dlock run -f refuses the same items: {refused:?}"
    );
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
    assert_json(
        &lock::mirrored_lock("lock-server", "default", &held, &owner),
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
        }),
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

/// Every pod the operator builds runs with the runtime's default seccomp profile and with
/// requests and limits (the spec's when given, the operator's defaults otherwise), and pulls with
/// the spec's `imagePullSecrets`.
#[test]
fn every_pod_has_seccomp_resources_and_the_specs_pull_secrets() {
    let rail = validate::rail_proxy(&fixtures::rail_proxy(), &settings()).unwrap();
    let payment = validate::payment_resource(&fixtures::payment_resource(), &settings()).unwrap();
    let lock_server = validate::lock_server(&fixtures::lock_server(), &settings()).unwrap();
    let batch = validate::payout_batch(&fixtures::payout_batch(), &settings()).unwrap();
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
    let rail = validate::rail_proxy(&fixtures::rail_proxy(), &settings()).unwrap();
    let stub = rail.stub.clone().unwrap();
    let batch = validate::payout_batch(&fixtures::payout_batch(), &settings()).unwrap();
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
/// rail stub checks no caller and mounts no token.
#[test]
fn the_services_run_as_the_namespaces_service_account_with_a_token_for_token_review() {
    let lock_server = validate::lock_server(&fixtures::lock_server(), &settings()).unwrap();
    let payment = validate::payment_resource(&fixtures::payment_resource(), &settings()).unwrap();
    let rail = validate::rail_proxy(&fixtures::rail_proxy(), &settings()).unwrap();
    for workload in [&lock_server, &payment, &rail.proxy] {
        let pod = deployment::deployment(workload)
            .spec
            .unwrap()
            .template
            .spec
            .unwrap();
        assert_eq!(pod.service_account_name.as_deref(), Some("dlock-service"));
        assert_eq!(pod.automount_service_account_token, Some(true));
        assert!(
            workload.config_toml.contains(
                "\"auth.mode\" = \"tokenreview\"\n\"auth.tokenreview.audiences\" = [\"dlock\"]\n\"auth.operator-identities\" = [\"system:serviceaccount:dlock-system:dlock-operator\"]\n"
            ),
            "{}",
            workload.config_toml
        );
    }
    let stub = rail.stub.unwrap();
    let pod = deployment::deployment(&stub)
        .spec
        .unwrap()
        .template
        .spec
        .unwrap();
    assert_eq!(pod.service_account_name, None);
    assert_eq!(pod.automount_service_account_token, Some(false));
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

/// `spec.fencingProofKeysSecret` (docs/design.md#d-8): the lock server, the payment resource and
/// the rail proxy mount the same Secret read-only as a directory (never a subPath, so a rotated key
/// reaches the pod) and `fencing.proof-keys-file` names the key's file in it. A key that could
/// leave the directory is refused.
#[test]
fn the_fencing_proof_keys_secret_is_mounted_as_a_directory_and_named_in_the_config() {
    let keys = fixtures::secret("fencing-proof-keys", "keys");
    let mut lock_server = fixtures::lock_server();
    lock_server.spec.service.fencing_proof_keys_secret = Some(keys.clone());
    let mut payment = fixtures::payment_resource();
    payment.spec.service.fencing_proof_keys_secret = Some(keys.clone());
    let mut rail = fixtures::rail_proxy();
    rail.spec.service.fencing_proof_keys_secret = Some(keys.clone());
    let rail = validate::rail_proxy(&rail, &settings()).unwrap();
    for workload in [
        validate::lock_server(&lock_server, &settings()).unwrap(),
        validate::payment_resource(&payment, &settings()).unwrap(),
        rail.proxy,
    ] {
        assert!(
            workload.config_toml.ends_with(
                "\"fencing.proof-keys-file\" = \"/etc/dlock/fencing-proof-keys/keys\"\n"
            ),
            "{}",
            workload.config_toml
        );
        let pod = serde_json::to_value(deployment::deployment(&workload)).unwrap()["spec"]
            ["template"]["spec"]
            .clone();
        let mounts = pod["containers"][0]["volumeMounts"].as_array().unwrap();
        assert!(
            mounts.contains(&json!({
                "name": "fencing-proof-keys",
                "mountPath": "/etc/dlock/fencing-proof-keys",
                "readOnly": true,
            })),
            "{mounts:?}"
        );
        assert!(
            pod["volumes"].as_array().unwrap().contains(&json!({
                "name": "fencing-proof-keys",
                "secret": {"secretName": "fencing-proof-keys"},
            })),
            "{}",
            pod["volumes"]
        );
    }
    let stub = rail.stub.unwrap();
    assert!(
        !stub.config_toml.contains("fencing"),
        "the stub checks no proof"
    );
    for key in ["..", "a/b", ""] {
        lock_server.spec.service.fencing_proof_keys_secret = Some(fixtures::secret("keys", key));
        let error = validate::lock_server(&lock_server, &settings()).unwrap_err();
        assert_eq!(error.field, "spec.fencingProofKeysSecret.key", "{key:?}");
    }
}

/// Safe by default (docs/threat-model.md#safe-defaults): a LockServer, PaymentResource or
/// RailProxy that names no `spec.fencingProofKeysSecret` still proves its fencing tokens. All
/// three mount the one Secret the operator makes for the namespace (`dlock-fencing-proof-keys`)
/// as a read-only directory, exactly as a named Secret is mounted, and `fencing.proof-keys-file`
/// names its key; the stub checks no proof and mounts nothing.
#[test]
fn without_a_named_secret_all_three_mount_the_namespaces_generated_proof_keys() {
    let rail = validate::rail_proxy(&fixtures::rail_proxy(), &settings()).unwrap();
    for workload in [
        validate::lock_server(&fixtures::lock_server(), &settings()).unwrap(),
        validate::payment_resource(&fixtures::payment_resource(), &settings()).unwrap(),
        rail.proxy,
    ] {
        assert_eq!(
            workload.fencing_proof_keys_secret.as_deref(),
            Some(proof_keys::SECRET),
            "{:?}",
            workload.component
        );
        assert!(
            workload.config_toml.ends_with(
                "\"fencing.proof-keys-file\" = \"/etc/dlock/fencing-proof-keys/keys\"\n"
            ),
            "{}",
            workload.config_toml
        );
        let pod = serde_json::to_value(deployment::deployment(&workload)).unwrap()["spec"]
            ["template"]["spec"]
            .clone();
        assert!(
            pod["containers"][0]["volumeMounts"]
                .as_array()
                .unwrap()
                .contains(&json!({
                    "name": "fencing-proof-keys",
                    "mountPath": "/etc/dlock/fencing-proof-keys",
                    "readOnly": true,
                })),
            "{pod}"
        );
        assert!(
            pod["volumes"].as_array().unwrap().contains(&json!({
                "name": "fencing-proof-keys",
                "secret": {"secretName": "dlock-fencing-proof-keys"},
            })),
            "{}",
            pod["volumes"]
        );
    }
    let stub = rail.stub.unwrap();
    assert!(
        !stub.config_toml.contains("fencing"),
        "the stub checks no proof"
    );
    assert_eq!(stub.fencing_proof_keys_secret, None);
}

/// The Secret the operator makes: no owner (every service of the namespace shares it), the key
/// the services mount, and a keys file the services accept, whose one line holds 64 hex digits
/// from the CSPRNG, fresh for every Secret.
#[test]
fn the_generated_proof_keys_secret_holds_a_keys_file_the_services_accept() {
    let secret = proof_keys::random_secret().unwrap();
    assert_eq!(secret.len(), 64, "{secret}");
    assert!(secret.bytes().all(|b| b.is_ascii_hexdigit()), "{secret}");
    assert_ne!(
        secret,
        proof_keys::random_secret().unwrap(),
        "fresh every time"
    );
    let built = serde_json::to_value(proof_keys::proof_keys_secret("team-a", &secret)).unwrap();
    assert_eq!(
        built,
        json!({
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {
                "name": "dlock-fencing-proof-keys",
                "namespace": "team-a",
                "labels": {
                    "app.kubernetes.io/name": "dlock",
                    "app.kubernetes.io/component": "fencing-proof-keys",
                    "app.kubernetes.io/managed-by": "dlock-operator",
                },
            },
            "type": "Opaque",
            "stringData": {"keys": proof_keys::keys_file(&secret)},
        })
    );
    let keys = dlock_server::proof::ProofKeys::from_text(&proof_keys::keys_file(&secret)).unwrap();
    assert_eq!(keys.key_ids(), vec!["generated-1".to_owned()]);
    let proof = keys.sign("payout:acct-17", 42).unwrap();
    assert_eq!(keys.verify("payout:acct-17", 42, &proof), Ok(()));
}

/// Only the executor and reconciler pods of the namespace and the operator's pods (in the
/// operator's namespace, by `kubernetes.io/metadata.name`) reach a service's port.
#[test]
fn only_executors_reconcilers_and_the_operator_reach_a_services_port() {
    let workload = validate::payment_resource(&fixtures::payment_resource(), &settings()).unwrap();
    let pods = |component: &str| {
        json!({"matchLabels": {
            "app.kubernetes.io/component": component,
            "app.kubernetes.io/name": "dlock",
        }})
    };
    assert_json(
        &network_policy::service_network_policy(&workload, "dlock-system"),
        json!({
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": workload_meta("PaymentResource", "payment-resource"),
            "spec": {
                "podSelector": {"matchLabels": selector("payment-resource", "payment-resource")},
                "policyTypes": ["Ingress"],
                "ingress": [{
                    "from": [
                        {"podSelector": pods("executor")},
                        {"podSelector": pods("reconciler")},
                        {
                            "namespaceSelector": {"matchLabels": {
                                "kubernetes.io/metadata.name": "dlock-system",
                            }},
                            "podSelector": pods("operator"),
                        },
                    ],
                    "ports": [{"port": "http", "protocol": "TCP"}],
                }],
            },
        }),
    );
}
