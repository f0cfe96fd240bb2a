//! The Reconciliation controller: a schedule becomes a CronJob, a removed schedule deletes it, and
//! a run's findings reach status.

use super::*;

/// A scheduled Reconciliation becomes a CronJob, then a Ready status and an Event.
#[tokio::test]
async fn a_scheduled_reconciliation_gets_a_cron_job_and_a_ready_status() {
    let (_, ctx, mut api) = world(FakeServices::default());
    let object = fixtures::reconciliation(Some("0 * * * *"));
    let reconcile = spawn_reconcile(reconcile_reconciliation, object.clone(), ctx);
    // The namespace's services, listed for their spec.tls (none here: the stub's URL stays
    // http://).
    answer_fence_targets(&mut api).await;
    let call = api
        .expect_apply("/apis/batch/v1/namespaces/default/cronjobs/hourly-reconcile")
        .await;
    assert_eq!(call.body["spec"]["concurrencyPolicy"], "Forbid");
    call.echo();
    let call = api.expect(Method::GET, &format!("{NS}/pods")).await;
    call.reply(200, &pod_list(vec![]));
    let call = api
        .expect_apply(&format!("{DLOCK}/reconciliations/hourly/status"))
        .await;
    assert_eq!(call.body["status"]["conditions"][0]["status"], "True");
    assert_eq!(call.body["status"]["lastRunJob"], "hourly-reconcile");
    call.answer(&object);
    api.event("Ready", None).await;
    reconcile.await.unwrap().unwrap();
    api.done().await;
}

fn pod_list(items: Vec<Value>) -> Value {
    json!({"apiVersion": "v1", "kind": "PodList", "metadata": {}, "items": items})
}

/// A finished reconciler pod whose termination message is `message`.
fn reconciler_pod(name: &str, job: &str, exit_code: i32, finished: &str, message: &str) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": "default", "labels": {"job-name": job}},
        "status": {"phase": if exit_code == 0 { "Succeeded" } else { "Failed" },
            "containerStatuses": [{
                "name": "reconciler", "image": "dlock:test", "imageID": "", "ready": false,
                "restartCount": 0,
                "state": {"terminated": {"exitCode": exit_code, "finishedAt": finished,
                                         "message": message}},
            }]},
    })
}

/// Removing the schedule deletes the CronJob (no schedule keeps running in the background), runs
/// the reconciler once, and puts the findings the reconciler left as its termination message
/// into status: a critical one is Degraded. The run's findings are counted by class in the
/// operator's metrics.
#[tokio::test]
async fn a_removed_schedule_deletes_the_cron_job_and_the_findings_reach_status() {
    let (ctx, mut api) = context(Arc::new(FakeServices::default()));
    let object = fixtures::reconciliation(None);
    let reconcile = spawn_reconcile(reconcile_reconciliation, object.clone(), ctx.clone());
    answer_fence_targets(&mut api).await;
    let call = api
        .expect(
            Method::DELETE,
            "/apis/batch/v1/namespaces/default/cronjobs/hourly-reconcile",
        )
        .await;
    assert_eq!(call.body["propagationPolicy"], "Background");
    call.reply(200, &success());
    api.event("ScheduleRemoved", None).await;
    let job_path = "/apis/batch/v1/namespaces/default/jobs/hourly-reconcile";
    let call = api.expect(Method::GET, job_path).await;
    call.reply(404, &not_found());
    let call = api.expect_apply(job_path).await;
    let container = &call.body["spec"]["template"]["spec"]["containers"][0];
    assert_eq!(
        container["terminationMessagePolicy"],
        "FallbackToLogsOnError"
    );
    assert!(
        container["env"]
            .as_array()
            .unwrap()
            .contains(&json!({"name": "DLOCK_TERMINATION_LOG", "value": "/dev/termination-log"}))
    );
    let mut job = call.body.clone();
    job["status"] = json!({"conditions": [{"type": "Failed", "status": "True",
                                           "message": "BackoffLimitExceeded"}]});
    call.reply(200, &job);
    let call = api.expect(Method::GET, &format!("{NS}/pods")).await;
    assert!(
        call.query
            .contains("app.kubernetes.io%2Fcomponent%3Dreconciler")
            && call.query.contains("dlock.io%2Finstance%3Dhourly"),
        "{}",
        call.query
    );
    let report = json!({"critical": 1, "warning": 0, "info": 2, "accountsChecked": 40,
        "payoutsChecked": 1000, "ambiguousFoundOnRail": 11, "ambiguousNotOnRail": 42,
        "doublePayments": 1, "transfersWithoutPayout": 3, "postedNotOnRail": 2,
        "releasedPaidOnRail": 1, "omitted": 1,
        "findings": ["critical double_payment payout-9: paid twice on the rail",
                     "info ambiguous_not_on_rail payout-3: not on the statement"]});
    call.reply(
        200,
        &pod_list(vec![
            reconciler_pod("old", "hourly-reconcile", 0, "2026-12-01T00:00:00Z", "{}"),
            reconciler_pod(
                "latest",
                "hourly-reconcile",
                2,
                "2026-12-02T17:00:00Z",
                &report.to_string(),
            ),
        ]),
    );
    let call = api
        .expect_apply(&format!("{DLOCK}/reconciliations/hourly/status"))
        .await;
    let status = &call.body["status"];
    assert_eq!(
        status["findings"],
        json!([
            "critical double_payment payout-9: paid twice on the rail",
            "info ambiguous_not_on_rail payout-3: not on the statement",
            "… 1 more (run `dlock reconcile` for all)",
        ])
    );
    let summary = "1 critical, 0 warning, 2 info; ambiguous payouts: 11 found on the rail, 42 \
                   not found; double payments: 1; transfers without a payout: 3; transfers \
                   differing from their payout: 0; posted payouts not on the rail: 2; released \
                   payouts paid on the rail: 1";
    assert_eq!(status["summary"], summary);
    assert_eq!(
        status["conditions"][2],
        condition("Degraded", "True", "CriticalFindings", summary)
    );
    assert_eq!(status["lastRunJob"], "hourly-reconcile");
    call.answer(&object);
    api.event("CriticalFindings", Some("Warning")).await;
    reconcile.await.unwrap().unwrap();
    api.done().await;
    let metrics = ctx.metrics.encode();
    for (class, count) in [
        ("rail_transfer_without_payout", 3),
        ("rail_transfer_differs_from_payout", 0),
        ("posted_payout_not_on_rail", 2),
        ("released_payout_paid_on_rail", 1),
        ("double_payment_on_rail", 1),
    ] {
        let sample =
            format!("dlock_operator_reconciliation_findings_total{{class=\"{class}\"}} {count}");
        assert!(
            metrics.lines().any(|l| l == sample),
            "{sample} in\n{metrics}"
        );
    }
}
