//! PayoutBatch: the manifest ConfigMap and the executor Job, with a finalizer.
//!
//! The finalizer exists because the batch's state lives outside Kubernetes: the executor pod
//! holds lock-server sessions and claims payouts in paydb. Before the batch object goes, the
//! operator deletes the executor Job in the foreground and waits until its pods are gone, so no
//! executor keeps working for a batch that no longer exists. The payouts themselves stay in paydb:
//! they are money history, and a batch re-created under the same name names the same payouts
//! (ids from the batch name and item keys), which paydb refuses to create twice.

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::batch::v1::Job;
use kube::ResourceExt;
use kube::api::{Api, DeleteParams, PropagationPolicy};
use kube::runtime::controller::Action;
use kube::runtime::events::EventType;
use kube::runtime::finalizer::{Event as Finalizer, finalizer};

use super::status::{Conditions, Observed, condition, ready_of};
use super::{Context, Error, Result, apply, apply_status, publish, reconciled, report_failure};
use crate::build::job::{self, ValidatedBatch};
use crate::crd::{Condition, PayoutBatch, PayoutBatchStatus, RailProxy};
use crate::validate;

pub const FINALIZER: &str = "dlock.io/executor-drained";
/// The largest batch whose payouts' states the operator reads on each resync (one request per
/// payout); larger batches report the executor's progress only.
pub const COUNTED_PAYOUTS_MAX: usize = 1_000;
/// The payouts' states that are listed by id in status for an operator to resolve.
pub const AMBIGUOUS: &str = "RAIL_AMBIGUOUS";

/// Payouts per state, and the ambiguous payouts' ids (pure).
pub fn tally(
    payout_ids: &[String],
    states: &[crate::services::PayoutState],
) -> (std::collections::BTreeMap<String, i64>, Vec<String>) {
    let mut counts = std::collections::BTreeMap::new();
    let mut ambiguous = Vec::new();
    for (id, state) in payout_ids.iter().zip(states) {
        let state = state.clone().unwrap_or_else(|| "UNREGISTERED".to_owned());
        if state == AMBIGUOUS {
            ambiguous.push(id.clone());
        }
        *counts.entry(state).or_insert(0) += 1;
    }
    (counts, ambiguous)
}

/// How often a running batch's status is refreshed.
pub const RUNNING_RESYNC: Duration = Duration::from_secs(10);

pub async fn reconcile_payout_batch(object: Arc<PayoutBatch>, ctx: Arc<Context>) -> Result<Action> {
    let namespace = object.namespace().unwrap_or_default();
    let api: Api<PayoutBatch> = Api::namespaced(ctx.client.clone(), &namespace);
    let ctx2 = ctx.clone();
    finalizer(&api, FINALIZER, object, |event| async move {
        match event {
            Finalizer::Apply(batch) => apply_batch(batch, ctx2).await,
            Finalizer::Cleanup(batch) => drain_executor(batch, ctx2).await,
        }
    })
    .await
    .map_err(|e| match e {
        kube::runtime::finalizer::Error::ApplyFailed(e)
        | kube::runtime::finalizer::Error::CleanupFailed(e) => e,
        other => Error::Finalizer(other.to_string()),
    })
}

/// The phase of an applied executor Job.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum JobPhase {
    Running { active: i32 },
    Succeeded,
    Failed { message: String },
}

pub fn job_phase(job: &Job) -> JobPhase {
    let Some(status) = &job.status else {
        return JobPhase::Running { active: 0 };
    };
    for condition in status.conditions.iter().flatten() {
        if condition.status != "True" {
            continue;
        }
        match condition.type_.as_str() {
            "Complete" => return JobPhase::Succeeded,
            "Failed" => {
                return JobPhase::Failed {
                    message: condition.message.clone().unwrap_or_default(),
                };
            }
            _ => {}
        }
    }
    JobPhase::Running {
        active: status.active.unwrap_or(0),
    }
}

/// The batch's status from its applied Job (pure).
pub fn batch_status(
    object: &PayoutBatch,
    batch: &ValidatedBatch,
    applied_job: &Job,
    now: &str,
) -> PayoutBatchStatus {
    let previous = object.status.clone().unwrap_or_default();
    let generation = object.metadata.generation;
    let payouts = object.spec.payouts.len();
    let (conditions, summary) = match job_phase(applied_job) {
        JobPhase::Succeeded => (
            Conditions::ready(format!("the executor finished all {payouts} payouts")),
            format!("{payouts} done"),
        ),
        JobPhase::Running { active } => (
            Conditions::progressing(
                "Executing",
                format!("{active} executor pod(s) working on {payouts} payouts"),
            ),
            format!("{payouts} running"),
        ),
        JobPhase::Failed { message } => (
            Conditions::degraded("ExecutorFailed", message),
            format!("{payouts} stopped"),
        ),
    };
    PayoutBatchStatus {
        observed_generation: generation,
        conditions: conditions.render(&previous.conditions, generation, now),
        accepted: Some(true),
        job_name: Some(batch.job_name()),
        summary: Some(summary),
        counts: previous.counts,
        ambiguous_count: Some(previous.ambiguous.len() as i64),
        ambiguous: previous.ambiguous,
        fenced_out: previous.fenced_out,
    }
}

/// The condition that says whether the executor Job's pod template is the one the operator
/// would build now. A Job's template is immutable, so an existing Job is never patched: after a
/// change of the image or an operator upgrade it runs on as it was created.
pub const JOB_TEMPLATE_CURRENT: &str = "JobTemplateCurrent";

/// [`JOB_TEMPLATE_CURRENT`] for an existing Job and the Job that would be built now (pure).
pub fn template_condition(existing: &Job, built: &Job) -> Observed {
    let recorded = existing
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(job::TEMPLATE_HASH_ANNOTATION));
    let now = job::template_hash(built);
    if recorded == Some(&now) {
        Observed::new(true, "Current", "")
    } else {
        Observed::new(
            false,
            "Outdated",
            format!(
                "the executor Job {} was created from another pod template (an earlier image or \
                 operator version); a Job's template is immutable, so it runs on unchanged. Delete \
                 the Job to have it re-created (payouts are idempotent)",
                existing.metadata.name.as_deref().unwrap_or_default()
            ),
        )
    }
}

/// `"3/4 POSTED, 1 RAIL_AMBIGUOUS"`: the terminal count first, for `kubectl get`.
fn summarize(counts: &std::collections::BTreeMap<String, i64>, total: usize) -> String {
    let posted = counts.get("POSTED").copied().unwrap_or(0);
    let mut text = format!("{posted}/{total} POSTED");
    for (state, count) in counts.iter().filter(|(s, _)| s.as_str() != "POSTED") {
        text.push_str(&format!(", {count} {state}"));
    }
    text
}

async fn apply_batch(object: Arc<PayoutBatch>, ctx: Arc<Context>) -> Result<Action> {
    let previous = object.status.clone().unwrap_or_default();
    let mut batch = match validate::payout_batch(&object, &ctx.settings) {
        Ok(batch) => batch,
        Err(invalid) => {
            write_invalid_spec(&object, &ctx, &previous, &invalid).await?;
            return Err(Error::Invalid(invalid));
        }
    };
    let built = job::executor_job(&batch);
    let applied_job = match apply_executor(&ctx, &mut batch, &built).await {
        Ok(job) => job,
        Err(error) => {
            report_failure(&ctx, object.as_ref(), &previous.conditions, &error).await;
            return Err(error);
        }
    };
    let mut status = batch_status(&object, &batch, &applied_job, &ctx.now());
    let outdated = add_template_condition(
        &mut status,
        &previous.conditions,
        &object,
        &ctx,
        &applied_job,
        &built,
    );
    if object.spec.payouts.len() <= COUNTED_PAYOUTS_MAX {
        count_payouts(&object, &batch, &ctx, &mut status).await;
    }
    let phase = job_phase(&applied_job);
    let running = matches!(phase, JobPhase::Running { .. });
    // Ambiguous payouts left the automated path: the batch is Degraded and names them until a
    // reconciliation classifies them (the batch is looked at again every resync for that).
    let ambiguous_left = !status.ambiguous.is_empty() && !matches!(phase, JobPhase::Failed { .. });
    if ambiguous_left {
        degrade_for_ambiguous(&mut status, &previous.conditions, &object, &ctx, running);
    }
    apply_status(&ctx.client, object.as_ref(), &status).await?;
    if let Some(message) = outdated {
        publish(
            &ctx,
            object.as_ref(),
            EventType::Normal,
            "JobTemplateOutdated",
            message,
        )
        .await;
    }
    publish_ready_event(&ctx, &object, &previous, &status, &phase, ambiguous_left).await;
    reconciled(&ctx, object.as_ref());
    ctx.metrics.count("PayoutBatch", "ok");
    Ok(if running {
        Action::requeue(RUNNING_RESYNC)
    } else if ambiguous_left {
        Action::requeue(super::RESYNC)
    } else {
        Action::await_change()
    })
}

/// Writes Degraded with the reason InvalidSpec for a spec the operator refuses, and a Warning
/// Event when that changes Ready.
async fn write_invalid_spec(
    object: &PayoutBatch,
    ctx: &Context,
    previous: &PayoutBatchStatus,
    invalid: &validate::Invalid,
) -> Result<()> {
    let conditions = Conditions::degraded("InvalidSpec", invalid.to_string());
    let status = PayoutBatchStatus {
        observed_generation: object.metadata.generation,
        conditions: conditions.render(&previous.conditions, object.metadata.generation, &ctx.now()),
        ..previous.clone()
    };
    apply_status(&ctx.client, object, &status).await?;
    if ready_of(&previous.conditions) != ready_of(&status.conditions) {
        publish(
            ctx,
            object,
            EventType::Warning,
            "InvalidSpec",
            invalid.to_string(),
        )
        .await;
    }
    Ok(())
}

/// Adds [`JOB_TEMPLATE_CURRENT`] to `status`. Returns the message of the Event to publish when
/// the Job's template went out of date with this reconcile (it was current, or not recorded).
fn add_template_condition(
    status: &mut PayoutBatchStatus,
    previous: &[Condition],
    object: &PayoutBatch,
    ctx: &Context,
    applied_job: &Job,
    built: &Job,
) -> Option<String> {
    let template_current = template_condition(applied_job, built);
    let was_current = previous
        .iter()
        .find(|c| c.type_ == JOB_TEMPLATE_CURRENT)
        .is_none_or(|c| c.status == "True");
    status.conditions.push(condition(
        previous,
        JOB_TEMPLATE_CURRENT,
        &template_current,
        object.metadata.generation,
        &ctx.now(),
    ));
    (was_current && !template_current.status).then_some(template_current.message)
}

/// Puts the payouts' states from the payment resource into `status`: the counts, the summary
/// and the ambiguous ids. A payment resource that does not answer leaves them as they were.
async fn count_payouts(
    object: &PayoutBatch,
    batch: &ValidatedBatch,
    ctx: &Context,
    status: &mut PayoutBatchStatus,
) {
    // The same ids the executor derives: uuid5 of the batch name and the item key.
    let ids: Vec<String> = object
        .spec
        .payouts
        .iter()
        .map(|p| dlock_contract::payout_batch::payout_id(&batch.name, &p.key).to_string())
        .collect();
    match ctx
        .services
        .payout_states(&batch.payment_resource_url, &ids)
        .await
    {
        Ok(states) => {
            let (counts, ambiguous) = tally(&ids, &states);
            status.ambiguous_count = Some(ambiguous.len() as i64);
            status.summary = Some(summarize(&counts, object.spec.payouts.len()));
            status.counts = counts;
            status.ambiguous = ambiguous;
        }
        Err(error) => {
            tracing::warn!(event = "payout_states_unavailable", batch = %batch.name, error = %error);
        }
    }
}

/// Replaces the Job's conditions in `status` with Degraded for the RAIL_AMBIGUOUS payouts
/// (Progressing while the executor still runs), keeping [`JOB_TEMPLATE_CURRENT`].
fn degrade_for_ambiguous(
    status: &mut PayoutBatchStatus,
    previous: &[Condition],
    object: &PayoutBatch,
    ctx: &Context,
    running: bool,
) {
    let mut observed = Conditions::degraded(RAIL_AMBIGUOUS, ambiguous_message(&status.ambiguous));
    if running {
        observed.progressing = Observed::new(
            true,
            "Executing",
            "the executor is still working on the other payouts",
        );
    }
    let mut conditions = observed.render(previous, object.metadata.generation, &ctx.now());
    conditions.extend(
        status
            .conditions
            .iter()
            .filter(|c| c.type_ == JOB_TEMPLATE_CURRENT)
            .cloned(),
    );
    status.conditions = conditions;
}

/// Publishes an Event when Ready changed: a Warning while payouts are ambiguous or the executor
/// failed, else the Job's phase.
async fn publish_ready_event(
    ctx: &Context,
    object: &PayoutBatch,
    previous: &PayoutBatchStatus,
    status: &PayoutBatchStatus,
    phase: &JobPhase,
    ambiguous_left: bool,
) {
    if ready_of(&previous.conditions) != ready_of(&status.conditions)
        && let Some(ready) = status.conditions.first()
    {
        let (type_, reason) = match phase {
            _ if ambiguous_left => (EventType::Warning, RAIL_AMBIGUOUS),
            JobPhase::Succeeded => (EventType::Normal, "Completed"),
            JobPhase::Running { .. } => (EventType::Normal, "Executing"),
            JobPhase::Failed { .. } => (EventType::Warning, "ExecutorFailed"),
        };
        publish(ctx, object, type_, reason, ready.message.clone()).await;
    }
}

/// The reason of a batch Degraded by RAIL_AMBIGUOUS payouts.
pub const RAIL_AMBIGUOUS: &str = "RailAmbiguous";
/// How many ambiguous payout ids the condition names (all of them are in `status.ambiguous`).
const AMBIGUOUS_NAMED: usize = 5;

/// What a batch with RAIL_AMBIGUOUS payouts says, naming the first few (pure).
pub fn ambiguous_message(ambiguous: &[String]) -> String {
    let mut named = ambiguous
        .iter()
        .take(AMBIGUOUS_NAMED)
        .cloned()
        .collect::<Vec<_>>()
        .join(", ");
    if ambiguous.len() > AMBIGUOUS_NAMED {
        named.push_str(&format!(" and {} more", ambiguous.len() - AMBIGUOUS_NAMED));
    }
    format!(
        "{} payout(s) are RAIL_AMBIGUOUS (the rail may or may not have paid them) and wait for a \
         reconciliation to classify them: run `dlock reconcile` or apply a Reconciliation; \
         status.ambiguous lists them all: {named}",
        ambiguous.len()
    )
}

/// Applies the manifest ConfigMap and creates the executor Job when it is absent, after
/// registering the batch's payouts with the operator's own credential (the registrar role; the
/// Job runs `dlock run --no-register` as an executor, docs/contract.md#roles). A Job's pod
/// template is immutable, so an existing Job is returned as it is, never patched.
async fn apply_executor(ctx: &Context, batch: &mut ValidatedBatch, built: &Job) -> Result<Job> {
    batch.rail_read_timeout_ms = rail_read_timeout_ms(ctx, batch).await?;
    apply(&ctx.client, &job::manifest_config_map(batch)).await?;
    let jobs: Api<Job> = Api::namespaced(ctx.client.clone(), &batch.namespace);
    let existing = jobs
        .get_opt(&batch.job_name())
        .await
        .map_err(|source| Error::Read {
            what: "the executor Job",
            source,
        })?;
    match existing {
        Some(job) => Ok(job),
        None => {
            ctx.services
                .register_batch(&batch.payment_resource_url, &batch.manifest_yaml)
                .await?;
            apply(&ctx.client, built).await
        }
    }
}

/// The read timeout of the batch's RailProxy, or the default when the RailProxy is not in the
/// namespace (a proxy the operator does not manage is expected to keep the default).
async fn rail_read_timeout_ms(ctx: &Context, batch: &ValidatedBatch) -> Result<i64> {
    let proxies: Api<RailProxy> = Api::namespaced(ctx.client.clone(), &batch.namespace);
    let proxy = proxies
        .get_opt(&batch.rail_proxy_name)
        .await
        .map_err(|source| Error::Read {
            what: "the batch's RailProxy",
            source,
        })?;
    Ok(proxy
        .and_then(|p| p.spec.read_timeout_ms)
        .unwrap_or(validate::READ_TIMEOUT_MS_DEFAULT))
}

async fn drain_executor(object: Arc<PayoutBatch>, ctx: Arc<Context>) -> Result<Action> {
    let namespace = object.namespace().unwrap_or_default();
    let jobs: Api<Job> = Api::namespaced(ctx.client.clone(), &namespace);
    let name = format!("{}-executor", object.name_any());
    let params = DeleteParams {
        propagation_policy: Some(PropagationPolicy::Foreground),
        ..DeleteParams::default()
    };
    match jobs.delete(&name, &params).await {
        Ok(_) => {}
        Err(kube::Error::Api(status)) if status.code == 404 => {}
        Err(source) => {
            return Err(Error::Apply {
                kind: "Job",
                name,
                source,
            });
        }
    }
    // Foreground deletion keeps the Job until its pods are gone; wait for that.
    match jobs.get_opt(&name).await {
        Ok(None) => {}
        Ok(Some(_)) => {
            return Err(Error::Finalizer(format!(
                "waiting for the executor Job {name} and its pods to go"
            )));
        }
        Err(source) => {
            return Err(Error::Read {
                what: "the executor Job",
                source,
            });
        }
    }
    publish(
        &ctx,
        object.as_ref(),
        EventType::Normal,
        "ExecutorDrained",
        format!("the executor Job {name} is gone"),
    )
    .await;
    cancel_unfinished(&object, &ctx).await?;
    Ok(Action::await_change())
}

/// docs/contract.md#payout-states: a deleted batch's payouts that never reached the rail (PENDING
/// or CLAIMED) are cancelled, ABANDONED, so nothing pays them later. Those at the rail or ambiguous
/// stay as they are for reconciliation. Runs after the executor is gone, before the finalizer goes;
/// a failure keeps the finalizer and is retried.
async fn cancel_unfinished(object: &PayoutBatch, ctx: &Context) -> Result<()> {
    let batch = match validate::payout_batch(object, &ctx.settings) {
        Ok(batch) => batch,
        // A spec the operator never accepted started no executor and registered nothing.
        Err(_) => return Ok(()),
    };
    let payouts: Vec<(uuid::Uuid, String)> = object
        .spec
        .payouts
        .iter()
        .map(|p| {
            (
                dlock_contract::payout_batch::payout_id(&batch.name, &p.key),
                p.account_id.clone(),
            )
        })
        .collect();
    let reason = format!(
        "the PayoutBatch {}/{} was deleted",
        batch.namespace, batch.name
    );
    let cancelled = ctx
        .services
        .cancel_unfinished(crate::services::Cancel {
            lock_server_url: &batch.lock_server_url,
            payment_resource_url: &batch.payment_resource_url,
            payouts: &payouts,
            reason: &reason,
        })
        .await?;
    let left: Vec<String> = cancelled
        .left
        .iter()
        .filter(|(_, s)| !s.is_terminal())
        .map(|(id, s)| format!("{id} ({})", s.as_str()))
        .collect();
    let mut note = format!(
        "{} payout(s) that never reached the rail are ABANDONED",
        cancelled.abandoned.len()
    );
    if !left.is_empty() {
        note.push_str(&format!(
            "; {} reached the rail and wait for the executor or a reconciliation: {}",
            left.len(),
            left.join(", ")
        ));
    }
    let type_ = if left.is_empty() {
        EventType::Normal
    } else {
        EventType::Warning
    };
    tracing::info!(event = "batch_payouts_cancelled", batch = %batch.name, abandoned = cancelled.abandoned.len(), left = left.len());
    publish(ctx, object, type_, "PayoutsCancelled", note).await;
    Ok(())
}
