//! The PayoutBatch controller: the finalizer, the manifest and the executor Job, a running batch
//! left alone, and a deleted batch drained before its finalizer goes.

use dlock_operator::crd::PayoutBatch;
use kube::runtime::controller::Action;

use super::*;

/// The fixture batch with the finalizer the operator puts on it first.
fn finalized_batch() -> PayoutBatch {
    let mut batch = fixtures::payout_batch();
    batch.metadata.finalizers = Some(vec!["dlock.io/executor-drained".to_owned()]);
    batch
}

/// [`finalized_batch`], deleted: its deletion waits for the finalizer.
fn deleted_batch() -> PayoutBatch {
    let mut batch = finalized_batch();
    batch.metadata.deletion_timestamp = serde_json::from_value(json!(NOW)).unwrap();
    batch
}

/// A new batch first gets the finalizer, then its manifest ConfigMap and executor Job, then
/// `accepted: true` in status (from which on its payouts are immutable) and an Event.
#[tokio::test]
async fn a_new_payout_batch_gets_a_finalizer_then_its_manifest_and_executor_job() {
    let (_, ctx, mut api) = world(FakeServices::default());
    let batch = fixtures::payout_batch();
    let reconcile = spawn_reconcile(reconcile_payout_batch, batch.clone(), ctx.clone());
    let call = api.expect_json_patch(BATCH).await;
    assert!(
        call.body.to_string().contains("dlock.io/executor-drained"),
        "{}",
        call.body
    );
    let with_finalizer = finalized_batch();
    call.answer(&with_finalizer);
    reconcile.await.unwrap().unwrap();

    let reconcile = spawn_reconcile(reconcile_payout_batch, with_finalizer, ctx.clone());
    let mut proxy = serde_json::to_value(fixtures::rail_proxy()).unwrap();
    proxy["spec"]["readTimeoutMs"] = json!(12_000);
    expect_manifest(&mut api, Some(proxy), "12000").await.echo();
    let call = api.expect(Method::GET, JOB).await;
    call.reply(404, &not_found());
    // The namespace's executor ServiceAccount before the Job that runs as it.
    let call = api
        .expect_apply(&format!("{NS}/serviceaccounts/dlock-executor"))
        .await;
    assert_eq!(
        call.body["metadata"]["labels"]["app.kubernetes.io/component"],
        "executor"
    );
    call.echo();
    let call = api.expect_apply(JOB).await;
    assert_eq!(
        call.body["spec"]["template"]["spec"]["serviceAccountName"],
        "dlock-executor"
    );
    // The worker count is the manifest's: a Job's pod template is immutable.
    let args = call.body["spec"]["template"]["spec"]["containers"][0]["args"].clone();
    assert!(!args.to_string().contains("--workers"), "{args}");
    let mut job = call.body.clone();
    job["status"] = json!({"active": 1});
    call.reply(200, &job);
    let call = api
        .expect_apply(&format!("{DLOCK}/payoutbatches/payroll-2026-12/status"))
        .await;
    assert_eq!(call.body["status"]["accepted"], true);
    assert_eq!(call.body["status"]["jobName"], "payroll-2026-12-executor");
    // Counts per state from paydb, and the ambiguous payouts by id (the executor's uuid5 ids).
    let second = dlock_executor::manifest::payout_id("payroll-2026-12", "emp-0002").to_string();
    assert_eq!(
        call.body["status"]["counts"],
        json!({"POSTED": 1, "RAIL_AMBIGUOUS": 1})
    );
    assert_eq!(call.body["status"]["ambiguous"], json!([second]));
    assert_eq!(call.body["status"]["ambiguousCount"], 1);
    assert_eq!(
        call.body["status"]["summary"],
        "1/2 POSTED, 1 RAIL_AMBIGUOUS"
    );
    // Still executing, and Degraded already: the ambiguous payout waits for a reconciliation,
    // named in the condition Argo CD shows.
    assert_eq!(call.body["status"]["conditions"][1]["status"], "True");
    let degraded = &call.body["status"]["conditions"][2];
    assert_eq!(
        (&degraded["type"], &degraded["status"], &degraded["reason"]),
        (&json!("Degraded"), &json!("True"), &json!("RailAmbiguous"))
    );
    assert!(
        degraded["message"].as_str().unwrap().contains(&second),
        "{degraded}"
    );
    assert_eq!(
        call.body["status"]["conditions"][3],
        json!({"type": "JobTemplateCurrent", "status": "True", "reason": "Current",
               "message": "", "lastTransitionTime": NOW, "observedGeneration": 1})
    );
    call.reply(
        200,
        &serde_json::to_value(fixtures::payout_batch()).unwrap(),
    );
    api.event("RailAmbiguous", Some("Warning")).await;
    reconcile.await.unwrap().unwrap();
    api.done().await;
}

const BATCH: &str = "/apis/dlock.io/v1alpha1/namespaces/default/payoutbatches/payroll-2026-12";
const JOB: &str = "/apis/batch/v1/namespaces/default/jobs/payroll-2026-12-executor";

/// The batch's RailProxy (`proxy`, or none by that name) says how long a submit may wait, and
/// the manifest ConfigMap carries that to the executor (`read_timeout_ms`). Returns the
/// manifest's apply, unanswered.
async fn expect_manifest(
    api: &mut ApiServerVerifier,
    proxy: Option<Value>,
    read_timeout_ms: &str,
) -> Call {
    // The batch's PaymentResource, for what it lets the executor run as and mount (here it
    // lists nothing: the defaults).
    api.expect(
        Method::GET,
        &format!("{DLOCK}/paymentresources/payment-resource"),
    )
    .await
    .reply(
        200,
        &serde_json::to_value(fixtures::payment_resource()).unwrap(),
    );
    // The namespace's services, listed for their spec.tls (none here: the URLs stay http://).
    answer_fence_targets(api).await;
    let call = api
        .expect(Method::GET, &format!("{DLOCK}/railproxies/rail-proxy"))
        .await;
    match proxy {
        Some(proxy) => call.reply(200, &proxy),
        None => call.reply(404, &not_found()),
    }
    let call = api
        .expect_apply(&format!("{NS}/configmaps/payroll-2026-12-manifest"))
        .await;
    assert_eq!(
        call.body["data"]["rail-read-timeout-ms"], read_timeout_ms,
        "{}",
        call.body
    );
    call
}

/// A Job's pod template is immutable: a running batch whose workers change, or an operator
/// upgrade that changes the image, sends no Job patch (which would be refused with 422). The
/// manifest ConfigMap carries the new worker count; the outdated template is recorded in a
/// condition and an Event.
#[tokio::test]
async fn a_running_batch_keeps_its_job_when_workers_or_the_image_change() {
    let (_, ctx, mut api) = world(FakeServices::default());
    let batch = finalized_batch();
    let validated =
        dlock_operator::validate::payout_batch(&batch, &fixtures::settings(), &Default::default())
            .unwrap();
    let mut running =
        serde_json::to_value(dlock_operator::build::job::executor_job(&validated)).unwrap();
    running["status"] = json!({"active": 1});
    let mut changed = batch.clone();
    changed.spec.workers = Some(3);
    changed.spec.image = Some(fixtures::ALLOWED_IMAGE.to_owned());
    changed.metadata.generation = Some(2);
    let reconcile = spawn_reconcile(reconcile_payout_batch, changed, ctx);
    // No RailProxy by that name: the executor waits the default read timeout.
    let call = expect_manifest(&mut api, None, "8000").await;
    assert!(
        call.body["data"]["payoutbatch.yaml"]
            .as_str()
            .unwrap()
            .contains("workers: 3"),
        "{}",
        call.body
    );
    call.echo();
    let call = api.expect(Method::GET, JOB).await;
    call.reply(200, &running);
    // No Job patch: the next call is the status.
    let call = api
        .expect_apply(&format!("{DLOCK}/payoutbatches/payroll-2026-12/status"))
        .await;
    let current = &call.body["status"]["conditions"][3];
    assert_eq!(current["type"], "JobTemplateCurrent");
    assert_eq!(current["status"], "False");
    assert_eq!(current["reason"], "Outdated");
    assert_eq!(call.body["status"]["conditions"][1]["status"], "True");
    call.reply(
        200,
        &serde_json::to_value(fixtures::payout_batch()).unwrap(),
    );
    api.event("JobTemplateOutdated", None).await;
    api.event("RailAmbiguous", Some("Warning")).await;
    reconcile.await.unwrap().unwrap();
    api.done().await;

    // Only the worker count changed: the template is the same, so it is current.
    let mut workers_only = batch.clone();
    workers_only.spec.workers = Some(3);
    let validated = dlock_operator::validate::payout_batch(
        &workers_only,
        &fixtures::settings(),
        &Default::default(),
    )
    .unwrap();
    assert_eq!(
        dlock_operator::build::job::executor_job(&validated),
        serde_json::from_value(json!({
            "apiVersion": "batch/v1", "kind": "Job",
            "metadata": running["metadata"], "spec": running["spec"],
        }))
        .unwrap()
    );
}

/// Deleting a batch whose executor Job is gone (the next test has a Job still there): the payouts
/// that never reached the rail are cancelled (ABANDONED), then the finalizer is removed.
#[tokio::test]
async fn deleting_a_payout_batch_drains_its_executor_before_the_finalizer_goes() {
    let (services, ctx, mut api) = world(FakeServices::default());
    let mut batch = deleted_batch();
    let reconcile = spawn_reconcile(reconcile_payout_batch, batch.clone(), ctx);
    let call = api.expect(Method::GET, JOB).await;
    call.reply(404, &not_found());
    let call = api.expect(Method::POST, EVENTS).await;
    assert_eq!(call.body["reason"], "ExecutorDrained");
    // Only after the executor is gone: the cancel of every payout of the batch, under the
    // namespace's services.
    assert!(
        !services
            .calls()
            .iter()
            .any(|(c, _)| c.starts_with("CANCEL")),
        "nothing cancelled while the executor may run"
    );
    call.echo();
    answer_fence_targets(&mut api).await;
    let call = api.expect(Method::POST, EVENTS).await;
    assert_eq!(call.body["reason"], "PayoutsCancelled");
    let cancels: Vec<_> = services
        .calls()
        .into_iter()
        .filter(|(c, _)| c.starts_with("CANCEL"))
        .collect();
    assert_eq!(cancels.len(), 1, "{cancels:?}");
    assert_eq!(
        cancels[0].0,
        "CANCEL http://lock-server.default.svc:8080 http://payment-resource.default.svc:8080"
    );
    let first = dlock_executor::manifest::payout_id("payroll-2026-12", "emp-0001");
    assert_eq!(cancels[0].1["payouts"][0], format!("{first} acct-17"));
    assert_eq!(
        cancels[0].1["reason"],
        "the PayoutBatch default/payroll-2026-12 was deleted"
    );
    call.echo();
    let call = api.expect_json_patch(BATCH).await;
    assert!(call.body.to_string().contains("remove"), "{}", call.body);
    batch.metadata.finalizers = None;
    call.answer(&batch);
    reconcile.await.unwrap().unwrap();
    api.done().await;
}

/// Deleting a batch whose executor Job runs: the Job is deleted in the foreground (its pods hold
/// lock sessions and claims outside Kubernetes) with one Event, and the reconcile asks to be
/// requeued, not an error; a later look while its pods go changes and reports nothing. The
/// finalizer stays until the previous test's case, the Job gone.
#[tokio::test]
async fn a_draining_executor_is_requeued_not_an_error() {
    let (services, ctx, mut api) = world(FakeServices::default());
    let batch = deleted_batch();
    let job = json!({"apiVersion": "batch/v1", "kind": "Job",
        "metadata": {"name": "payroll-2026-12-executor", "namespace": "default"}});
    let reconcile = spawn_reconcile(reconcile_payout_batch, batch.clone(), ctx.clone());
    api.expect(Method::GET, JOB).await.reply(200, &job);
    let call = api.expect(Method::DELETE, JOB).await;
    assert_eq!(call.body["propagationPolicy"], "Foreground");
    call.reply(200, &success());
    let call = api.expect(Method::POST, EVENTS).await;
    assert_eq!(call.body["reason"], "ExecutorDraining");
    call.echo();
    assert_eq!(
        reconcile.await.unwrap().unwrap(),
        Action::requeue(controller::payout_batch::DRAIN_POLL)
    );
    // The Job is terminating now: no second delete, no Event, still a requeue.
    let mut terminating = job.clone();
    terminating["metadata"]["deletionTimestamp"] = json!(NOW);
    let reconcile = spawn_reconcile(reconcile_payout_batch, batch, ctx);
    api.expect(Method::GET, JOB).await.reply(200, &terminating);
    assert_eq!(
        reconcile.await.unwrap().unwrap(),
        Action::requeue(controller::payout_batch::DRAIN_POLL)
    );
    assert!(services.calls().is_empty(), "{:?}", services.calls());
    api.done().await;
}

/// The batch's PaymentResource, read from the API server, decides who the executor may run as:
/// against one that lists nothing, `serviceAccountName: payroll-runner` is Degraded/InvalidSpec
/// naming the field, with no Job and no registration; once the PaymentResource lists it, the
/// Job runs as `payroll-runner` and the operator makes no `dlock-executor` for it.
#[tokio::test]
async fn a_batch_runs_as_another_service_account_only_when_its_payment_resource_lists_it() {
    let (services, ctx, mut api) = world(FakeServices::default());
    let mut batch = finalized_batch();
    batch.spec.executor = Some(dlock_operator::crd::ExecutorSpec {
        service_account_name: Some("payroll-runner".to_owned()),
        ..Default::default()
    });
    let resource_path = format!("{DLOCK}/paymentresources/payment-resource");

    let reconcile = spawn_reconcile(reconcile_payout_batch, batch.clone(), ctx.clone());
    api.expect(Method::GET, &resource_path).await.reply(
        200,
        &serde_json::to_value(fixtures::payment_resource()).unwrap(),
    );
    let call = api
        .expect_apply(&format!("{DLOCK}/payoutbatches/payroll-2026-12/status"))
        .await;
    let (reason, message) = call.degraded();
    assert_eq!(reason, "InvalidSpec", "{message}");
    assert!(
        message.starts_with("spec.executor.serviceAccountName: "),
        "{message}"
    );
    call.answer(&batch);
    api.event("InvalidSpec", Some("Warning")).await;
    let error = reconcile.await.unwrap().unwrap_err();
    assert!(error.is_permanent(), "{error}");
    assert!(
        services.calls().is_empty(),
        "nothing registered: {:?}",
        services.calls()
    );
    // No Job was asked for: the next call is the next reconcile's.

    let mut listing = fixtures::payment_resource();
    listing.spec.executor_service_accounts = Some(vec!["payroll-runner".to_owned()]);
    let reconcile = spawn_reconcile(reconcile_payout_batch, batch, ctx.clone());
    api.expect(Method::GET, &resource_path)
        .await
        .reply(200, &serde_json::to_value(listing).unwrap());
    answer_fence_targets(&mut api).await;
    api.expect(Method::GET, &format!("{DLOCK}/railproxies/rail-proxy"))
        .await
        .reply(404, &not_found());
    api.expect_apply(&format!("{NS}/configmaps/payroll-2026-12-manifest"))
        .await
        .echo();
    api.expect(Method::GET, JOB).await.reply(404, &not_found());
    let call = api.expect_apply(JOB).await;
    assert_eq!(
        call.body["spec"]["template"]["spec"]["serviceAccountName"],
        "payroll-runner"
    );
    reconcile.abort();
}
