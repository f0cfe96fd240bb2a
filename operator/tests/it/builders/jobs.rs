//! The Jobs the operator runs: a PayoutBatch's manifest and executor Job (a batch the executor
//! would refuse is refused before anything is built), and the reconciler's Job or CronJob.

use super::*;

/// The executor reads the batch from a ConfigMap built from the spec, in exactly the format
/// `dlock run -f` takes (docs/design.md#payout-batch): the same file runs locally and in the
/// cluster.
#[test]
fn the_payout_batch_manifest_is_the_dlock_run_format() {
    let batch = validate_batch(&fixtures::payout_batch()).unwrap();
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
            "spec": {"workers": 8, "batchMax": 32, "payouts": [
                {"key": "emp-0001", "accountId": "acct-17", "amountMinor": 125000, "currency": "EUR", "beneficiaryRef": "ben-emp-0001"},
                {"key": "emp-0002", "accountId": "acct-18", "amountMinor": 98000, "currency": "EUR", "beneficiaryRef": "ben-emp-0002"},
            ]},
        })
    );
}

/// `spec.batchMax` reaches the run the way `spec.workers` does: in the manifest, which `dlock
/// run` reads the batch size from when `--batch-max` is absent (the Job never passes it). A size
/// outside 1 to 64 is refused naming the field, before anything is built.
#[test]
fn the_batch_size_travels_in_the_manifest() {
    let mut object = fixtures::payout_batch();
    object.spec.batch_max = Some(16);
    let batch = validate_batch(&object).unwrap();
    let manifest = job::manifest_config_map(&batch);
    let run = dlock_executor::manifest::parse(&manifest.data.as_ref().unwrap()["payoutbatch.yaml"])
        .unwrap();
    assert_eq!(run.spec.batch_max, 16);
    // Neither a flag nor the variable overrides it (each beside one the Job does set).
    let job = serde_json::to_value(job::executor_job(&batch)).unwrap();
    let container = &job["spec"]["template"]["spec"]["containers"][0];
    let args = container["args"].as_array().unwrap();
    assert!(args.contains(&json!("--no-register")), "{args:?}");
    assert!(!args.contains(&json!("--batch-max")), "{args:?}");
    let env: Vec<&serde_json::Value> = container["env"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| &e["name"])
        .collect();
    assert!(env.contains(&&json!("DLOCK_LOCK_SERVER")), "{env:?}");
    assert!(!env.contains(&&json!("DLOCK_BATCH_MAX")), "{env:?}");
    for outside in [0, -1, 65] {
        object.spec.batch_max = Some(outside);
        assert_eq!(refused_field(&object), "spec.batchMax", "{outside}");
    }
}

/// The Job's name and arguments come from the batch name and spec only (never a uid or a clock),
/// so a re-synced or re-created batch names the same Job and the same payouts.
#[test]
fn the_executor_job_runs_dlock_run_on_the_manifest() {
    let batch = validate_batch(&fixtures::payout_batch()).unwrap();
    assert_snapshot("payout-batch-job", &job::executor_job(&batch));
    let mut recreated = fixtures::payout_batch();
    recreated.metadata.uid = Some("another-uid".to_owned());
    let again = validate_batch(&recreated).unwrap();
    assert_eq!(
        serde_json::to_value(job::executor_job(&again).spec).unwrap(),
        serde_json::to_value(job::executor_job(&batch).spec).unwrap()
    );
}

/// The executor authenticates: a Secret's token, mounted read-only as a file that
/// `DLOCK_CREDENTIAL_FILE` names, with the identity it names, or (no Secret) a projected
/// service-account token with audience `dlock` as the file `DLOCK_CREDENTIAL_FILE` names, as the
/// service account's TokenReview identity. Its owner id is `<identity>/<batch>`, which the
/// services' owner binding accepts.
#[test]
fn the_executor_job_carries_its_credential_and_identity() {
    let mut object = fixtures::payout_batch();
    object.spec.executor = Some(fixtures::executor_with_credential());
    let batch =
        validate::payout_batch(&object, &settings(), &fixtures::executor_allowance()).unwrap();
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
    assert_eq!(env("DLOCK_CREDENTIAL"), None, "the token is no variable");
    assert_eq!(
        env("DLOCK_CREDENTIAL_FILE"),
        Some(json!({"name": "DLOCK_CREDENTIAL_FILE",
            "value": "/etc/dlock/secrets/credential/token"}))
    );
    let args = container["args"].as_array().unwrap();
    let owner = args.iter().position(|a| a == "--owner-id").unwrap();
    assert_eq!(args[owner + 1], "executor/payroll-2026-12");
    assert_eq!(
        pod["volumes"][1],
        json!({"name": "credential", "secret": {"secretName": "executor-credential",
            "items": [{"key": "token", "path": "token"}], "optional": false}}),
        "only the Secret's key, as a file"
    );
    assert_eq!(pod["volumes"].as_array().unwrap().len(), 2);
    assert_eq!(
        container["volumeMounts"][1],
        json!({"name": "credential", "mountPath": "/etc/dlock/secrets/credential",
            "readOnly": true})
    );
    assert_eq!(pod["serviceAccountName"], "dlock-executor");

    // No Secret: the service account's projected token, as its TokenReview identity.
    object.spec.executor = Some(dlock_operator::crd::ExecutorSpec {
        service_account_name: Some("payroll-runner".to_owned()),
        ..Default::default()
    });
    let batch =
        validate::payout_batch(&object, &settings(), &fixtures::executor_allowance()).unwrap();
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
        credential_secret: Some(fixtures::executor_credential()),
        ..Default::default()
    });
    let error =
        validate::payout_batch(&object, &settings(), &fixtures::executor_allowance()).unwrap_err();
    assert_eq!(error.field, "spec.executor.identity");
    object.spec.executor = Some(dlock_operator::crd::ExecutorSpec {
        identity: Some("executor".to_owned()),
        ..Default::default()
    });
    assert_eq!(refused_field(&object), "spec.executor.identity");
}

#[test]
fn a_batch_with_a_repeated_key_is_refused_before_anything_is_built() {
    let mut object = fixtures::payout_batch();
    object.spec.payouts[1].key = "emp-0001".to_owned();
    assert_eq!(refused_field(&object), "spec.payouts[1].key");
}

/// The operator checks a batch with the contract's validator, the one `dlock run -f` applies:
/// what the executor would refuse is refused before a Job exists, every problem named.
#[test]
fn a_batch_the_executor_would_refuse_is_refused_with_every_problem_named() {
    let mut object = fixtures::payout_batch();
    object.spec.payouts[0].account_id = "acct/17".to_owned();
    object.spec.payouts[1].currency = "XXX".to_owned();
    let error = validate_batch(&object).unwrap_err();
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
    let valid = validate_batch(&fixtures::payout_batch()).unwrap_or_else(|e| panic!("{e}"));
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

/// Every place a secret could sit in a built object's JSON: an environment variable from a
/// Secret (`valueFrom.secretKeyRef`) or a whole Secret or ConfigMap as the environment
/// (`envFrom`). The paths where one was found.
fn secret_env_paths(value: &serde_json::Value, at: &str, found: &mut Vec<String>) {
    match value {
        serde_json::Value::Object(map) => {
            for (key, inner) in map {
                let here = format!("{at}.{key}");
                if key == "secretKeyRef" || key == "envFrom" {
                    found.push(here.clone());
                }
                secret_env_paths(inner, &here, found);
            }
        }
        serde_json::Value::Array(items) => {
            for (i, inner) in items.iter().enumerate() {
                secret_env_paths(inner, &format!("{at}[{i}]"), found);
            }
        }
        _ => {}
    }
}

/// No secret reaches a Job's or CronJob's environment: the executor's credential (from its
/// Secret or projected) and the reconciler's paydb URL are read-only files under
/// `/etc/dlock/secrets/…` (or the projected token's directory) that `DLOCK_CREDENTIAL_FILE` and
/// `DLOCK_PAYDB_FILE` name, so `kubectl describe`, `/proc/<pid>/environ` and a crash dump show a
/// path, never the value.
#[test]
fn no_job_or_cron_job_carries_a_secret_in_its_environment() {
    let mut with_secret = fixtures::payout_batch();
    with_secret.spec.executor = Some(fixtures::executor_with_credential());
    let once = validate::reconciliation(&fixtures::reconciliation(None), &settings()).unwrap();
    let hourly =
        validate::reconciliation(&fixtures::reconciliation(Some("0 * * * *")), &settings())
            .unwrap();
    let built = [
        (
            "executor with a credential Secret",
            serde_json::to_value(job::executor_job(
                &validate::payout_batch(&with_secret, &settings(), &fixtures::executor_allowance())
                    .unwrap(),
            ))
            .unwrap(),
        ),
        (
            "executor with a projected token",
            serde_json::to_value(job::executor_job(
                &validate_batch(&fixtures::payout_batch()).unwrap(),
            ))
            .unwrap(),
        ),
        (
            "reconciler Job",
            serde_json::to_value(reconciler::reconciler_job(&once)).unwrap(),
        ),
        (
            "reconciler CronJob",
            serde_json::to_value(reconciler::reconciler_cron_job(&hourly, "0 * * * *")).unwrap(),
        ),
    ];
    for (what, object) in &built {
        let mut found = Vec::new();
        secret_env_paths(object, "", &mut found);
        assert!(
            found.is_empty(),
            "{what} has a secret in its environment: {found:?}"
        );
    }
    // The reconciler's paydb URL: its Secret's key mounted read-only, named by DLOCK_PAYDB_FILE.
    for (what, pod) in [
        ("Job", &built[2].1["spec"]["template"]["spec"]),
        (
            "CronJob",
            &built[3].1["spec"]["jobTemplate"]["spec"]["template"]["spec"],
        ),
    ] {
        let container = &pod["containers"][0];
        let env = container["env"].as_array().unwrap();
        assert!(
            env.contains(&json!({"name": "DLOCK_PAYDB_FILE",
                "value": "/etc/dlock/secrets/paydb/url"})),
            "{what}: {env:?}"
        );
        assert!(!env.iter().any(|e| e["name"] == "DLOCK_PAYDB"), "{what}");
        assert_eq!(
            pod["volumes"],
            json!([{"name": "paydb", "secret": {"secretName": "paydb",
                "items": [{"key": "url", "path": "url"}], "optional": false}}]),
            "{what}"
        );
        assert_eq!(
            container["volumeMounts"],
            json!([{"name": "paydb", "mountPath": "/etc/dlock/secrets/paydb", "readOnly": true}]),
            "{what}"
        );
    }
}

/// docs/threat-model.md#deployments-made-by-the-operator: whoever may create a PayoutBatch does
/// not pick its Job's ServiceAccount. Absent, the executor runs as the namespace's
/// `dlock-executor`; another name (here the services' own `dlock-service`, and the operator's) is
/// refused naming the field unless the batch's PaymentResource lists it.
#[test]
fn the_executor_runs_as_dlock_executor_and_another_service_account_only_when_the_platform_lists_it()
{
    let batch = validate_batch(&fixtures::payout_batch()).unwrap();
    assert_eq!(batch.credential.service_account_name, "dlock-executor");
    assert_eq!(
        batch.credential.identity,
        "system:serviceaccount:default:dlock-executor"
    );
    let job = serde_json::to_value(job::executor_job(&batch)).unwrap();
    assert_eq!(
        job["spec"]["template"]["spec"]["serviceAccountName"],
        "dlock-executor"
    );

    for chosen in ["dlock-service", "dlock-operator", "default"] {
        let mut object = fixtures::payout_batch();
        object.spec.executor = Some(dlock_operator::crd::ExecutorSpec {
            service_account_name: Some(chosen.to_owned()),
            ..Default::default()
        });
        for allowance in [Default::default(), fixtures::executor_allowance()] {
            let error = validate::payout_batch(&object, &settings(), &allowance).unwrap_err();
            assert_eq!(error.field, "spec.executor.serviceAccountName", "{chosen}");
            assert!(
                error.message.contains(&format!("{chosen:?}"))
                    && error.message.contains("spec.executorServiceAccounts"),
                "{error}"
            );
        }
    }
    // Positive control: the same name, listed by the PaymentResource, is accepted; naming the
    // default is always accepted.
    let mut object = fixtures::payout_batch();
    object.spec.executor = Some(dlock_operator::crd::ExecutorSpec {
        service_account_name: Some("dlock-service".to_owned()),
        ..Default::default()
    });
    let mut allowance = fixtures::executor_allowance();
    allowance.service_accounts.push("dlock-service".to_owned());
    let batch = validate::payout_batch(&object, &settings(), &allowance).unwrap();
    assert_eq!(batch.credential.service_account_name, "dlock-service");
    object.spec.executor = Some(dlock_operator::crd::ExecutorSpec {
        service_account_name: Some("dlock-executor".to_owned()),
        ..Default::default()
    });
    validate_batch(&object).unwrap();
}

/// A PayoutBatch mounts as its executor's credential only a Secret its PaymentResource lists in
/// `spec.executorCredentialSecrets`; any other Secret of the namespace is refused naming the
/// field.
#[test]
fn the_executor_mounts_only_a_credential_secret_the_platform_lists() {
    let mut object = fixtures::payout_batch();
    object.spec.executor = Some(dlock_operator::crd::ExecutorSpec {
        identity: Some("executor".to_owned()),
        credential_secret: Some(dlock_operator::crd::SecretKeyRef {
            name: "paydb".to_owned(),
            key: "url".to_owned(),
        }),
        service_account_name: None,
    });
    for allowance in [Default::default(), fixtures::executor_allowance()] {
        let error = validate::payout_batch(&object, &settings(), &allowance).unwrap_err();
        assert_eq!(error.field, "spec.executor.credentialSecret");
        assert!(
            error.message.contains("\"paydb\"")
                && error.message.contains("spec.executorCredentialSecrets"),
            "{error}"
        );
    }
    // Positive control: the listed Secret is mounted.
    object.spec.executor.as_mut().unwrap().credential_secret =
        Some(fixtures::executor_credential());
    let batch =
        validate::payout_batch(&object, &settings(), &fixtures::executor_allowance()).unwrap();
    assert_eq!(
        batch.credential.token,
        validate::TokenSource::Secret(fixtures::executor_credential())
    );
}

/// The lists come from the PaymentResource the batch names; a missing PaymentResource allows
/// only the defaults.
#[test]
fn the_executor_allowance_is_the_payment_resources_lists() {
    let mut resource = fixtures::payment_resource();
    resource.spec.executor_service_accounts = Some(vec!["payroll-runner".to_owned()]);
    resource.spec.executor_credential_secrets = Some(vec!["executor-credential".to_owned()]);
    assert_eq!(
        validate::ExecutorAllowance::of("payment-resource", Some(&resource)),
        fixtures::executor_allowance()
    );
    assert_eq!(
        validate::ExecutorAllowance::of("payment-resource", None),
        validate::ExecutorAllowance {
            payment_resource: "payment-resource".to_owned(),
            ..Default::default()
        }
    );
}

/// The operator makes `dlock-executor` like `dlock-service`: labelled, in the batch's namespace,
/// owned by no one object (every batch of the namespace runs as it), with no token Secret.
#[test]
fn the_executor_service_account_is_labelled_and_unowned() {
    let account =
        serde_json::to_value(dlock_operator::build::service_account::executor("payments")).unwrap();
    assert_eq!(
        account,
        json!({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "dlock-executor", "namespace": "payments", "labels": {
            "app.kubernetes.io/name": "dlock",
            "app.kubernetes.io/component": "executor",
            "app.kubernetes.io/managed-by": "dlock-operator"}}})
    );
}
