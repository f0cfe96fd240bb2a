//! Reconciliation: the reconciler as a Job (once) or a CronJob (on a schedule).

use std::sync::Arc;

use k8s_openapi::api::batch::v1::CronJob;
use kube::runtime::controller::Action;
use kube::runtime::events::EventType;

use super::payout_batch::{JobPhase, job_phase};
use super::status::{Conditions, ready_of};
use super::{Context, Error, Result, apply, apply_status, is_paused, publish, reconciled};
use crate::build::reconciler;
use crate::crd::{Reconciliation, ReconciliationStatus};
use crate::validate;

pub async fn reconcile_reconciliation(
    object: Arc<Reconciliation>,
    ctx: Arc<Context>,
) -> Result<Action> {
    if is_paused(object.as_ref()) {
        ctx.metrics.count("Reconciliation", "paused");
        return Ok(Action::await_change());
    }
    let previous = object.status.clone().unwrap_or_default();
    let generation = object.metadata.generation;
    let (conditions, last_run_job, outcome) = match validate::reconciliation(&object, &ctx.settings)
    {
        Err(invalid) => (
            Conditions::degraded("InvalidSpec", invalid.to_string()),
            previous.last_run_job.clone(),
            Err(Error::Invalid(invalid)),
        ),
        Ok(valid) => {
            let name = reconciler::object_name(&valid);
            match &valid.schedule {
                Some(schedule) => {
                    let cron: CronJob = apply(
                        &ctx.client,
                        &reconciler::reconciler_cron_job(&valid, schedule),
                    )
                    .await?;
                    let last = cron
                        .status
                        .as_ref()
                        .and_then(|s| s.last_successful_time.as_ref())
                        .map(|t| format!("last success {}", t.0));
                    (
                        Conditions::ready(format!(
                            "scheduled {schedule}; {}",
                            last.unwrap_or_else(|| "no run yet".to_owned())
                        )),
                        Some(name),
                        Ok(Action::requeue(super::RESYNC)),
                    )
                }
                None => {
                    let job = apply(&ctx.client, &reconciler::reconciler_job(&valid)).await?;
                    let conditions = match job_phase(&job) {
                        JobPhase::Succeeded => {
                            Conditions::ready("the reconciler found nothing to report")
                        }
                        JobPhase::Running { .. } => {
                            Conditions::progressing("Running", "the reconciler is running")
                        }
                        JobPhase::Failed { message } => Conditions::degraded(
                            "Findings",
                            format!(
                                "the reconciler reported findings or failed (see the Job's log): {message}"
                            ),
                        ),
                    };
                    let running = matches!(job_phase(&job), JobPhase::Running { .. });
                    let action = if running {
                        Action::requeue(super::payout_batch::RUNNING_RESYNC)
                    } else {
                        Action::await_change()
                    };
                    (conditions, Some(name), Ok(action))
                }
            }
        }
    };
    let rendered = conditions.render(&previous.conditions, generation, &ctx.now());
    let summary = rendered.first().map(|c| c.message.clone());
    let status = ReconciliationStatus {
        observed_generation: generation,
        conditions: rendered,
        last_run_job,
        findings: previous.findings.clone(),
        summary,
    };
    apply_status(&ctx.client, object.as_ref(), &status).await?;
    if ready_of(&previous.conditions) != ready_of(&status.conditions)
        && let Some(ready) = status.conditions.first()
    {
        let degraded = status
            .conditions
            .iter()
            .any(|c| c.type_ == "Degraded" && c.status == "True");
        let type_ = if degraded {
            EventType::Warning
        } else {
            EventType::Normal
        };
        let reason = if ready.status == "True" {
            "Ready"
        } else {
            ready.reason.as_str()
        };
        publish(&ctx, object.as_ref(), type_, reason, ready.message.clone()).await;
    }
    if outcome.is_ok() {
        reconciled(&ctx, object.as_ref());
        ctx.metrics.count("Reconciliation", "ok");
    }
    outcome
}
