//! The Jobs the operator runs: a PayoutBatch's manifest and executor Job (a batch the executor
//! would refuse is refused before anything is built), and the reconciler's Job or CronJob.

use super::*;

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
