//! The PayoutBatch controller: the finalizer, the manifest and the executor Job, a running batch
//! left alone, and a deleted batch drained before its finalizer goes.

use super::*;

/// A new batch first gets the finalizer, then its manifest ConfigMap and executor Job, then
/// `accepted: true` in status (from which on its payouts are immutable) and an Event.
#[tokio::test]
async fn a_new_payout_batch_gets_a_finalizer_then_its_manifest_and_executor_job() {
    let (_, ctx, mut api) = world(FakeServices::default());
    let batch = fixtures::payout_batch();
    let reconcile = tokio::spawn(controller::payout_batch::reconcile_payout_batch(
        Arc::new(batch.clone()),
        ctx.clone(),
    ));
    let call = api.expect_json_patch(BATCH).await;
    assert!(
        call.body.to_string().contains("dlock.io/executor-drained"),
        "{}",
        call.body
    );
    let mut with_finalizer = batch.clone();
    with_finalizer.metadata.finalizers = Some(vec!["dlock.io/executor-drained".to_owned()]);
    call.answer(&with_finalizer);
    reconcile.await.unwrap().unwrap();

    let reconcile = tokio::spawn(controller::payout_batch::reconcile_payout_batch(
        Arc::new(with_finalizer),
        ctx.clone(),
    ));
    let mut proxy = serde_json::to_value(fixtures::rail_proxy()).unwrap();
    proxy["spec"]["readTimeoutMs"] = json!(12_000);
    expect_manifest(&mut api, Some(proxy), "12000").await.echo();
    let call = api.expect(Method::GET, JOB).await;
    call.reply(404, &not_found());
    let call = api.expect_apply(JOB).await;
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
    let mut batch = fixtures::payout_batch();
    batch.metadata.finalizers = Some(vec!["dlock.io/executor-drained".to_owned()]);
    let validated = dlock_operator::validate::payout_batch(&batch, &fixtures::settings()).unwrap();
    let mut running =
        serde_json::to_value(dlock_operator::build::job::executor_job(&validated)).unwrap();
    running["status"] = json!({"active": 1});
    let mut changed = batch.clone();
    changed.spec.workers = Some(3);
    changed.spec.image = Some(fixtures::ALLOWED_IMAGE.to_owned());
    changed.metadata.generation = Some(2);
    let reconcile = tokio::spawn(controller::payout_batch::reconcile_payout_batch(
        Arc::new(changed),
        ctx,
    ));
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
    let validated =
        dlock_operator::validate::payout_batch(&workers_only, &fixtures::settings()).unwrap();
    assert_eq!(
        dlock_operator::build::job::executor_job(&validated),
        serde_json::from_value(json!({
            "apiVersion": "batch/v1", "kind": "Job",
            "metadata": running["metadata"], "spec": running["spec"],
        }))
        .unwrap()
    );
}

/// Deleting a batch: the executor Job goes in the foreground first (its pods hold lock sessions
/// and claims outside Kubernetes), then the payouts that never reached the rail are cancelled
/// (ABANDONED), then the finalizer is removed.
#[tokio::test]
async fn deleting_a_payout_batch_drains_its_executor_before_the_finalizer_goes() {
    let (services, ctx, mut api) = world(FakeServices::default());
    let mut batch = fixtures::payout_batch();
    batch.metadata.finalizers = Some(vec!["dlock.io/executor-drained".to_owned()]);
    batch.metadata.deletion_timestamp = serde_json::from_value(json!(NOW)).unwrap();
    let reconcile = tokio::spawn(controller::payout_batch::reconcile_payout_batch(
        Arc::new(batch.clone()),
        ctx,
    ));
    let job_path = "/apis/batch/v1/namespaces/default/jobs/payroll-2026-12-executor";
    let call = api.expect(Method::DELETE, job_path).await;
    assert_eq!(call.body["propagationPolicy"], "Foreground");
    call.reply(200, &success());
    let call = api.expect(Method::GET, job_path).await;
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
