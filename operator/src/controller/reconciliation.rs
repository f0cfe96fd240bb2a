//! Reconciliation: the reconciler as a Job (once) or a CronJob (on a schedule).

use std::sync::Arc;

use k8s_openapi::api::batch::v1::{CronJob, Job};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DeleteParams, ListParams, PropagationPolicy};
use kube::runtime::controller::Action;
use kube::runtime::events::EventType;

use super::payout_batch::{JobPhase, job_phase};
use super::status::Conditions;
use super::{
    Context, Error, Result, apply, apply_status, publish, publish_ready_change, reconciled,
    report_failure,
};
use crate::build::reconciler;
use crate::crd::{Reconciliation, ReconciliationStatus, Reported};
use crate::validate::{self, ValidatedReconciliation};

/// The summary `dlock reconcile` leaves as its termination message (`DLOCK_TERMINATION_LOG`),
/// the contract's one type for the writer and this reader.
pub use dlock_contract::reconcile::ReconcileSummary as ReconcileReport;

/// What the latest finished reconciler pod reported.
#[derive(Clone, Debug, PartialEq)]
pub struct LastRun {
    pub job: Option<String>,
    /// The pod that ran it: one per run, even for a Job name used again (a Reconciliation
    /// deleted and applied anew).
    pub pod: Option<String>,
    pub exit_code: i32,
    /// The parsed summary; `None` when the message is not one (the log tail of a failed run).
    pub report: Option<ReconcileReport>,
    pub message: String,
}

/// The latest finished reconciler pod's termination message (pure). Pods still running, or
/// without a terminated reconciler container, are skipped.
pub fn last_run(pods: &[Pod]) -> Option<LastRun> {
    pods.iter()
        .filter_map(|pod| {
            let status = pod.status.as_ref()?.container_statuses.as_ref()?;
            let terminated = status
                .iter()
                .find(|c| c.name == "reconciler")?
                .state
                .as_ref()?
                .terminated
                .as_ref()?;
            let job = pod.metadata.labels.as_ref().and_then(|l| {
                l.get("batch.kubernetes.io/job-name")
                    .or_else(|| l.get("job-name"))
                    .cloned()
            });
            let message = terminated.message.clone().unwrap_or_default();
            let report = serde_json::from_str::<ReconcileReport>(message.trim()).ok();
            Some((
                terminated.finished_at.as_ref().map(|t| t.0),
                LastRun {
                    job,
                    pod: pod.metadata.name.clone(),
                    exit_code: terminated.exit_code,
                    report,
                    message,
                },
            ))
        })
        .max_by_key(|(finished, _)| *finished)
        .map(|(_, run)| run)
}

/// The conditions a finished run calls for: critical findings (exit 2) are Degraded.
fn run_conditions(run: &LastRun, ready_prefix: &str) -> Conditions {
    match (&run.report, run.exit_code) {
        (Some(report), _) if report.critical > 0 => {
            Conditions::degraded("CriticalFindings", report.summary())
        }
        (Some(report), 0) => Conditions::ready(format!("{ready_prefix}{}", report.summary())),
        (Some(report), code) => Conditions::degraded(
            "ReconcilerFailed",
            format!("the reconciler exited {code}: {}", report.summary()),
        ),
        (None, 0) => Conditions::ready(format!("{ready_prefix}the reconciler left no summary")),
        (None, code) => {
            let tail: String = run
                .message
                .lines()
                .last()
                .unwrap_or_default()
                .chars()
                .take(512)
                .collect();
            Conditions::degraded(
                "ReconcilerFailed",
                format!("the reconciler exited {code}: {tail}"),
            )
        }
    }
}

pub async fn reconcile_reconciliation(
    object: Arc<Reconciliation>,
    ctx: Arc<Context>,
) -> Result<Action> {
    let previous = object.status.clone().unwrap_or_default();
    let generation = object.metadata.generation;
    let mut findings = previous.findings.clone();
    let mut summary = None;
    let (conditions, last_run_job, outcome) = match validate::reconciliation(&object, &ctx.settings)
    {
        Err(invalid) => (
            Conditions::degraded("InvalidSpec", invalid.to_string()),
            previous.last_run_job.clone(),
            Err(Error::Invalid(invalid)),
        ),
        Ok(mut valid) => {
            super::payout_batch::namespace_tls(&ctx, &valid.namespace)
                .await?
                .secure_reconciliation(&mut valid);
            match run_reconciler(&ctx, object.as_ref(), &valid, &mut findings, &mut summary).await {
                Ok(done) => done,
                Err(error) => {
                    report_failure(&ctx, object.as_ref(), &previous.reported.conditions, &error)
                        .await;
                    return Err(error);
                }
            }
        }
    };
    let rendered = conditions.render(&previous.reported.conditions, generation, &ctx.now());
    let summary = summary.or_else(|| rendered.first().map(|c| c.message.clone()));
    let status = ReconciliationStatus {
        reported: Reported::new(generation, rendered),
        last_run_job,
        findings,
        summary,
    };
    apply_status(&ctx.client, object.as_ref(), &status).await?;
    publish_ready_change(
        &ctx,
        object.as_ref(),
        &previous.reported.conditions,
        &status.reported.conditions,
    )
    .await;
    if outcome.is_ok() {
        reconciled(&ctx, object.as_ref());
        ctx.metrics.count("Reconciliation", "ok");
    }
    outcome
}

/// What the reconciler's last run calls for: the conditions, the Job to show and what the
/// controller does next.
type RunState = (Conditions, Option<String>, Result<Action>);

/// Applies the reconciler's CronJob or Job and reads its last run: the conditions, the Job to
/// show and what the controller does next.
async fn run_reconciler(
    ctx: &Context,
    object: &Reconciliation,
    valid: &ValidatedReconciliation,
    findings: &mut Vec<String>,
    summary: &mut Option<String>,
) -> Result<RunState> {
    let name = reconciler::object_name(valid);
    match &valid.schedule {
        Some(schedule) => run_scheduled(ctx, valid, schedule, name, (findings, summary)).await,
        None => {
            // A schedule that was removed leaves no CronJob behind.
            delete_cron_job(ctx, object, &valid.namespace, &name).await?;
            run_once(ctx, valid, name, (findings, summary)).await
        }
    }
}

/// Where a run's findings and summary go in status.
type Record<'a> = (&'a mut Vec<String>, &'a mut Option<String>);

/// Applies the reconciler's CronJob; Ready with the schedule and the last success, and the
/// last run's findings.
async fn run_scheduled(
    ctx: &Context,
    valid: &ValidatedReconciliation,
    schedule: &str,
    name: String,
    (findings, summary): Record<'_>,
) -> Result<RunState> {
    let cron: CronJob = apply(
        &ctx.client,
        &reconciler::reconciler_cron_job(valid, schedule),
    )
    .await?;
    let last = cron
        .status
        .as_ref()
        .and_then(|s| s.last_successful_time.as_ref())
        .map(|t| format!("last success {}", t.0));
    let prefix = format!(
        "scheduled {schedule}; {}; ",
        last.unwrap_or_else(|| "no run yet".to_owned())
    );
    let run = last_run(&reconciler_pods(ctx, valid).await?);
    let conditions = match &run {
        Some(run) => {
            record(run, findings, summary);
            count_findings(ctx, valid, run);
            run_conditions(run, &prefix)
        }
        None => Conditions::ready(prefix.trim_end_matches("; ").to_owned()),
    };
    let job = run.and_then(|r| r.job).or(Some(name));
    Ok((conditions, job, Ok(Action::requeue(super::RESYNC))))
}

/// Creates the reconciler's Job once and reads how its run went; looked at again while it runs.
async fn run_once(
    ctx: &Context,
    valid: &ValidatedReconciliation,
    name: String,
    (findings, summary): Record<'_>,
) -> Result<RunState> {
    // A Job's pod template is immutable: create it once, never patch it.
    let jobs: Api<Job> = Api::namespaced(ctx.client.clone(), &valid.namespace);
    let job = match jobs.get_opt(&name).await.map_err(|source| Error::Read {
        what: "the reconciler Job",
        source,
    })? {
        Some(job) => job,
        None => apply(&ctx.client, &reconciler::reconciler_job(valid)).await?,
    };
    let running = matches!(job_phase(&job), JobPhase::Running { .. });
    let conditions = if running {
        Conditions::progressing("Running", "the reconciler is running")
    } else {
        match last_run(&reconciler_pods(ctx, valid).await?) {
            Some(run) => {
                record(&run, findings, summary);
                count_findings(ctx, valid, &run);
                run_conditions(&run, "")
            }
            None => match job_phase(&job) {
                JobPhase::Failed { message } => Conditions::degraded(
                    "ReconcilerFailed",
                    format!("the reconciler failed (see the Job's log): {message}"),
                ),
                _ => Conditions::ready("the reconciler finished"),
            },
        }
    };
    let action = if running {
        Action::requeue(super::payout_batch::RUNNING_RESYNC)
    } else {
        Action::await_change()
    };
    Ok((conditions, Some(name), Ok(action)))
}

/// Puts a run's findings and summary into status.
fn record(run: &LastRun, findings: &mut Vec<String>, summary: &mut Option<String>) {
    if let Some(report) = &run.report {
        *findings = report.findings.clone();
        if report.omitted > 0 {
            findings.push(format!(
                "… {} more (run `dlock reconcile` for all)",
                report.omitted
            ));
        }
        *summary = Some(report.summary());
    }
}

/// Counts a finished run's findings by class in the operator's metrics, once per run (the
/// alerts of `charts/dlock/files/dlock-alerts.yaml` page on them).
fn count_findings(ctx: &Context, valid: &ValidatedReconciliation, run: &LastRun) {
    if let Some(report) = &run.report {
        let object = format!("{}/{}", valid.namespace, valid.name);
        let pod = run
            .pod
            .as_deref()
            .or(run.job.as_deref())
            .unwrap_or_default();
        ctx.metrics.count_findings(&object, pod, report);
    }
}

/// The reconciler's pods of this Reconciliation (one-off and scheduled runs alike).
async fn reconciler_pods(ctx: &Context, valid: &ValidatedReconciliation) -> Result<Vec<Pod>> {
    let api: Api<Pod> = Api::namespaced(ctx.client.clone(), &valid.namespace);
    let selector = reconciler::reconciler_selector(&valid.name)
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(",");
    let pods = api
        .list(&ListParams::default().labels(&selector))
        .await
        .map_err(|source| Error::Read {
            what: "the reconciler's pods",
            source,
        })?;
    Ok(pods.items)
}

async fn delete_cron_job(
    ctx: &Context,
    object: &Reconciliation,
    namespace: &str,
    name: &str,
) -> Result<()> {
    let api: Api<CronJob> = Api::namespaced(ctx.client.clone(), namespace);
    let params = DeleteParams {
        propagation_policy: Some(PropagationPolicy::Background),
        ..DeleteParams::default()
    };
    match api.delete(name, &params).await {
        Ok(_) => {
            publish(
                ctx,
                object,
                EventType::Normal,
                "ScheduleRemoved",
                format!("the schedule was removed: the CronJob {name} is deleted"),
            )
            .await;
            Ok(())
        }
        Err(kube::Error::Api(status)) if status.code == 404 => Ok(()),
        Err(source) => Err(Error::Apply {
            kind: "CronJob",
            name: name.to_owned(),
            source,
        }),
    }
}
