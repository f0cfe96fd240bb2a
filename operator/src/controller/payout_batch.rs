//! PayoutBatch: the manifest ConfigMap and the executor Job, with a finalizer.
//!
//! The finalizer exists because the batch's state lives outside Kubernetes: the executor pod
//! holds lock-server sessions and claims payouts in paydb. Before the batch object goes, the
//! operator deletes the executor Job in the foreground and waits until its pods are gone, so no
//! executor keeps working for a batch that no longer exists. The payouts themselves stay in paydb:
//! they are money history, and a batch re-created under the same name names the same payouts
//! (ids from the batch name and item keys), which paydb refuses to create twice.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use dlock_contract::payment::PayoutState;
use k8s_openapi::api::batch::v1::Job;
use kube::ResourceExt;
use kube::api::{Api, DeleteParams, PropagationPolicy};
use kube::runtime::controller::Action;
use kube::runtime::events::EventType;
use kube::runtime::finalizer::{Event as Finalizer, finalizer};

use super::status::{Conditions, Observed, condition, ready_of};
use super::{Context, Error, Result, apply, apply_status, publish, reconciled, report_failure};
use crate::build::job;
use crate::crd::{Condition, PaymentResource, PayoutBatch, PayoutBatchStatus, RailProxy, Reported};
use crate::validate;
use crate::validate::ValidatedBatch;

pub const FINALIZER: &str = "dlock.io/executor-drained";
/// The largest batch whose payouts' states the operator reads on each resync (one request per
/// payout); larger batches report the executor's progress only.
pub const COUNTED_PAYOUTS_MAX: usize = 1_000;
/// The payouts' state that is listed by id in status for an operator to resolve, as the
/// status counts spell it.
pub const AMBIGUOUS: &str = PayoutState::RailAmbiguous.as_str();
/// How the status counts a payout paydb does not know yet.
pub const UNREGISTERED: &str = "UNREGISTERED";

/// Payouts per state, and the ambiguous payouts' ids (pure).
pub fn tally(
    payout_ids: &[String],
    states: &[Option<PayoutState>],
) -> (std::collections::BTreeMap<String, i64>, Vec<String>) {
    let mut counts = std::collections::BTreeMap::new();
    let mut ambiguous = Vec::new();
    for (id, state) in payout_ids.iter().zip(states) {
        if *state == Some(PayoutState::RailAmbiguous) {
            ambiguous.push(id.clone());
        }
        let name = state.map_or(UNREGISTERED, PayoutState::as_str);
        *counts.entry(name.to_owned()).or_insert(0) += 1;
    }
    (counts, ambiguous)
}

/// How often a running batch's status is refreshed.
pub const RUNNING_RESYNC: Duration = Duration::from_secs(10);

pub async fn reconcile_payout_batch(object: Arc<PayoutBatch>, ctx: Arc<Context>) -> Result<Action> {
    let namespace = object.namespace().unwrap_or_default();
    let api: Api<PayoutBatch> = Api::namespaced(ctx.client.clone(), &namespace);
    if object.metadata.deletion_timestamp.is_some()
        && object.finalizers().iter().any(|f| f == FINALIZER)
        && drain(&object, &ctx).await? == Drain::Draining
    {
        // Waiting is the normal course of a deletion, not a failure: look again shortly.
        return Ok(Action::requeue(DRAIN_POLL));
    }
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

/// What one reconcile of a PayoutBatch observed; [`batch_status`] makes its status of it.
pub struct BatchObserved<'a> {
    pub object: &'a PayoutBatch,
    /// The executor Job's name.
    pub job_name: String,
    /// The applied Job's phase.
    pub phase: JobPhase,
    /// Whether the Job's pod template is the one the operator would build now.
    pub template: Observed,
    /// The payouts' states from the payment resource (per state, and the ambiguous ids), or
    /// `None` when they were not read (a batch over [`COUNTED_PAYOUTS_MAX`], or the payment
    /// resource did not answer): then the previous counts stay.
    pub payouts: Option<(BTreeMap<String, i64>, Vec<String>)>,
    /// RFC 3339 now, for the conditions' transition times.
    pub now: &'a str,
}

/// The batch's status (pure): the Job's phase as Ready/Progressing/Degraded, Degraded instead
/// while payouts are RAIL_AMBIGUOUS (and the executor has not failed), [`JOB_TEMPLATE_CURRENT`],
/// and the payouts' counts, summary and ambiguous ids.
pub fn batch_status(observed: &BatchObserved) -> PayoutBatchStatus {
    let object = observed.object;
    let previous = object.status.clone().unwrap_or_default();
    let generation = object.metadata.generation;
    let payouts = object.spec.payouts.len();
    let (counts, ambiguous, summary) = match &observed.payouts {
        Some((counts, ambiguous)) => (
            counts.clone(),
            ambiguous.clone(),
            Some(summarize(counts, payouts)),
        ),
        None => (previous.counts.clone(), previous.ambiguous.clone(), None),
    };
    let failed = matches!(observed.phase, JobPhase::Failed { .. });
    let (mut conditions, phase_summary) = match &observed.phase {
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
            Conditions::degraded("ExecutorFailed", message.clone()),
            format!("{payouts} stopped"),
        ),
    };
    // Ambiguous payouts left the automated path: the batch is Degraded and names them until a
    // reconciliation classifies them (Progressing while the executor still works on the rest).
    if !ambiguous.is_empty() && !failed {
        let running = matches!(observed.phase, JobPhase::Running { .. });
        conditions = Conditions::degraded(RAIL_AMBIGUOUS, ambiguous_message(&ambiguous));
        if running {
            conditions.progressing = Observed::new(
                true,
                "Executing",
                "the executor is still working on the other payouts",
            );
        }
    }
    let mut rendered = conditions.render(&previous.reported.conditions, generation, observed.now);
    rendered.push(condition(
        &previous.reported.conditions,
        JOB_TEMPLATE_CURRENT,
        &observed.template,
        generation,
        observed.now,
    ));
    PayoutBatchStatus {
        reported: Reported::new(generation, rendered),
        accepted: Some(true),
        job_name: Some(observed.job_name.clone()),
        summary: Some(summary.unwrap_or(phase_summary)),
        counts,
        ambiguous_count: Some(ambiguous.len() as i64),
        ambiguous,
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
fn summarize(counts: &BTreeMap<String, i64>, total: usize) -> String {
    let posted_name = PayoutState::Posted.as_str();
    let posted = counts.get(posted_name).copied().unwrap_or(0);
    let mut text = format!("{posted}/{total} {posted_name}");
    for (state, count) in counts.iter().filter(|(s, _)| s.as_str() != posted_name) {
        text.push_str(&format!(", {count} {state}"));
    }
    text
}

async fn apply_batch(object: Arc<PayoutBatch>, ctx: Arc<Context>) -> Result<Action> {
    let previous = object.status.clone().unwrap_or_default();
    let allowance = executor_allowance(&ctx, &object).await?;
    let mut batch = match validate::payout_batch(&object, &ctx.settings, &allowance) {
        Ok(batch) => batch,
        Err(invalid) => {
            write_invalid_spec(&object, &ctx, &previous, &invalid).await?;
            return Err(Error::Invalid(invalid));
        }
    };
    namespace_tls(&ctx, &batch.namespace)
        .await?
        .secure_batch(&mut batch);
    let built = job::executor_job(&batch);
    let applied_job = match apply_executor(&ctx, &mut batch, &built).await {
        Ok(job) => job,
        Err(error) => {
            report_failure(&ctx, object.as_ref(), &previous.reported.conditions, &error).await;
            return Err(error);
        }
    };
    let template = template_condition(&applied_job, &built);
    let outdated = template_went_outdated(&previous.reported.conditions, &template);
    let payouts = if object.spec.payouts.len() <= COUNTED_PAYOUTS_MAX {
        count_payouts(&object, &batch, &ctx).await
    } else {
        None
    };
    let phase = job_phase(&applied_job);
    let now = ctx.now();
    let status = batch_status(&BatchObserved {
        object: &object,
        job_name: batch.job_name(),
        phase: phase.clone(),
        template,
        payouts,
        now: &now,
    });
    let running = matches!(phase, JobPhase::Running { .. });
    let ambiguous_left = !status.ambiguous.is_empty() && !matches!(phase, JobPhase::Failed { .. });
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
        reported: Reported::new(
            object.metadata.generation,
            conditions.render(
                &previous.reported.conditions,
                object.metadata.generation,
                &ctx.now(),
            ),
        ),
        ..previous.clone()
    };
    apply_status(&ctx.client, object, &status).await?;
    if ready_of(&previous.reported.conditions) != ready_of(&status.reported.conditions) {
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

/// The message of the Event to publish when the Job's template went out of date with this
/// reconcile (it was current, or not recorded), from the previous conditions (pure).
fn template_went_outdated(previous: &[Condition], template: &Observed) -> Option<String> {
    let was_current = previous
        .iter()
        .find(|c| c.type_ == JOB_TEMPLATE_CURRENT)
        .is_none_or(|c| c.status == "True");
    (was_current && !template.status).then(|| template.message.clone())
}

/// The payouts' states from the payment resource: per state, and the ambiguous ids. `None`
/// when the payment resource does not answer (logged; the status keeps the previous counts).
async fn count_payouts(
    object: &PayoutBatch,
    batch: &ValidatedBatch,
    ctx: &Context,
) -> Option<(BTreeMap<String, i64>, Vec<String>)> {
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
        Ok(states) => Some(tally(&ids, &states)),
        Err(error) => {
            tracing::warn!(event = "payout_states_unavailable", batch = %batch.name, error = %error);
            None
        }
    }
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
    if ready_of(&previous.reported.conditions) != ready_of(&status.reported.conditions)
        && let Some(ready) = status.reported.conditions.first()
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
            // The service account before the pod that runs as it.
            if batch.credential.service_account_name == validate::EXECUTOR_SERVICE_ACCOUNT_DEFAULT {
                apply(
                    &ctx.client,
                    &crate::build::service_account::executor(&batch.namespace),
                )
                .await?;
            }
            apply(&ctx.client, built).await
        }
    }
}

/// What the batch's PaymentResource lets it pick for its executor; only the defaults when that
/// PaymentResource does not exist (yet).
async fn executor_allowance(
    ctx: &Context,
    object: &PayoutBatch,
) -> Result<validate::ExecutorAllowance> {
    let name = validate::payment_resource_name(object);
    let namespace = object.namespace().unwrap_or_default();
    let resources: Api<PaymentResource> = Api::namespaced(ctx.client.clone(), &namespace);
    let resource = resources
        .get_opt(name)
        .await
        .map_err(|source| Error::Read {
            what: "the batch's PaymentResource",
            source,
        })?;
    Ok(validate::ExecutorAllowance::of(name, resource.as_ref()))
}

/// Which of the namespace's dlock Services serve TLS, from their objects' `spec.tls`.
pub(crate) async fn namespace_tls(
    ctx: &Context,
    namespace: &str,
) -> Result<crate::services::NamespaceTls> {
    Ok(namespace_services(ctx, namespace).await?.1)
}

/// The names of the namespace's LockServers, PaymentResources and RailProxies, and their TLS.
pub(crate) async fn namespace_services(
    ctx: &Context,
    namespace: &str,
) -> Result<([Vec<String>; 3], crate::services::NamespaceTls)> {
    crate::services::NamespaceTls::read(&ctx.client, namespace)
        .await
        .map_err(|source| Error::Read {
            what: "the namespace's LockServers, PaymentResources and RailProxies",
            source,
        })
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

/// How often a deleted batch looks again whether its executor Job is gone.
pub const DRAIN_POLL: Duration = Duration::from_secs(5);

/// Where the executor of a deleted batch is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Drain {
    /// The Job and its pods are gone: the finalizer's cleanup may run.
    Gone,
    /// The Job is being deleted in the foreground and still has pods.
    Draining,
}

/// Deletes the executor Job of a deleted batch in the foreground (its pods go first), once:
/// the deletion is an info line, an Event and the `draining` count; each later look while the
/// pods go is a debug line.
async fn drain(object: &PayoutBatch, ctx: &Context) -> Result<Drain> {
    let namespace = object.namespace().unwrap_or_default();
    let jobs: Api<Job> = Api::namespaced(ctx.client.clone(), &namespace);
    let name = format!("{}-executor", object.name_any());
    let job = jobs.get_opt(&name).await.map_err(|source| Error::Read {
        what: "the executor Job",
        source,
    })?;
    let Some(job) = job else {
        return Ok(Drain::Gone);
    };
    if job.metadata.deletion_timestamp.is_some() {
        tracing::debug!(event = "executor_draining", batch = %object.name_any(), job = %name);
        return Ok(Drain::Draining);
    }
    let params = DeleteParams {
        propagation_policy: Some(PropagationPolicy::Foreground),
        ..DeleteParams::default()
    };
    match jobs.delete(&name, &params).await {
        Ok(_) => {}
        Err(kube::Error::Api(status)) if status.code == 404 => return Ok(Drain::Gone),
        Err(source) => {
            return Err(Error::Apply {
                kind: "Job",
                name,
                source,
            });
        }
    }
    tracing::info!(event = "executor_drain_started", batch = %object.name_any(), job = %name);
    ctx.metrics.count("PayoutBatch", "draining");
    publish(
        ctx,
        object,
        EventType::Normal,
        "ExecutorDraining",
        format!(
            "the batch was deleted: the executor Job {name} is deleted with its pods first; \
             then the payouts that never reached the rail are cancelled"
        ),
    )
    .await;
    Ok(Drain::Draining)
}

/// The finalizer's cleanup, once [`drain`] found the executor Job gone: the Event, then the
/// unfinished payouts cancelled.
async fn drain_executor(object: Arc<PayoutBatch>, ctx: Arc<Context>) -> Result<Action> {
    let name = format!("{}-executor", object.name_any());
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
    // The operator's own calls use only the services' URLs, never the executor's credential.
    let allowance = validate::ExecutorAllowance::named_by(object);
    let mut batch = match validate::payout_batch(object, &ctx.settings, &allowance) {
        Ok(batch) => batch,
        // A spec the operator never accepted started no executor and registered nothing.
        Err(_) => return Ok(()),
    };
    namespace_tls(ctx, &batch.namespace)
        .await?
        .secure_batch(&mut batch);
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

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    const NOW: &str = "2026-01-01T00:00:00Z";

    fn batch(items: usize, status: Option<PayoutBatchStatus>) -> PayoutBatch {
        let payouts: Vec<serde_json::Value> = (0..items)
            .map(|i| {
                serde_json::json!({"key": format!("k{i}"), "accountId": "acct-1",
                    "amountMinor": 100, "currency": "EUR", "beneficiaryRef": format!("ref-{i}")})
            })
            .collect();
        let mut object: PayoutBatch = serde_json::from_value(serde_json::json!({
            "apiVersion": "dlock.io/v1alpha1", "kind": "PayoutBatch",
            "metadata": {"name": "b1", "namespace": "ns", "generation": 2},
            "spec": {"payouts": payouts},
        }))
        .unwrap();
        object.status = status;
        object
    }

    fn observe<'a>(
        object: &'a PayoutBatch,
        phase: JobPhase,
        payouts: Option<(BTreeMap<String, i64>, Vec<String>)>,
    ) -> BatchObserved<'a> {
        BatchObserved {
            object,
            job_name: "b1-executor".to_owned(),
            phase,
            template: Observed::new(true, "Current", ""),
            payouts,
            now: NOW,
        }
    }

    fn of<'a>(status: &'a PayoutBatchStatus, type_: &str) -> &'a Condition {
        status
            .reported
            .find(type_)
            .unwrap_or_else(|| panic!("no {type_} condition"))
    }

    fn counted(
        states: &[(&str, i64)],
        ambiguous: &[&str],
    ) -> Option<(BTreeMap<String, i64>, Vec<String>)> {
        Some((
            states.iter().map(|(s, n)| (s.to_string(), *n)).collect(),
            ambiguous.iter().map(|s| s.to_string()).collect(),
        ))
    }

    /// The status of a new batch whose Job is in `phase` and whose payouts paydb counts per state
    /// (`states`, every payout of the batch), naming the ambiguous ones.
    fn counted_status(
        phase: JobPhase,
        states: &[(&str, i64)],
        ambiguous: &[&str],
    ) -> PayoutBatchStatus {
        let items = states.iter().map(|(_, n)| *n).sum::<i64>();
        let object = batch(usize::try_from(items).unwrap(), None);
        batch_status(&observe(&object, phase, counted(states, ambiguous)))
    }

    #[test]
    fn a_running_job_is_progressing_and_counts_what_paydb_says() {
        let status = counted_status(
            JobPhase::Running { active: 2 },
            &[("POSTED", 1), ("CLAIMED", 2)],
            &[],
        );
        assert_eq!(of(&status, "Ready").status, "False");
        assert_eq!(of(&status, "Progressing").status, "True");
        assert_eq!(of(&status, "Progressing").reason, "Executing");
        assert_eq!(of(&status, JOB_TEMPLATE_CURRENT).status, "True");
        assert_eq!(status.summary.as_deref(), Some("1/3 POSTED, 2 CLAIMED"));
        assert_eq!(status.accepted, Some(true));
        assert_eq!(status.job_name.as_deref(), Some("b1-executor"));
        assert_eq!(status.reported.observed_generation, Some(2));
        assert_eq!(status.ambiguous_count, Some(0));
    }

    #[test]
    fn a_finished_job_is_ready() {
        let status = counted_status(JobPhase::Succeeded, &[("POSTED", 2)], &[]);
        assert_eq!(of(&status, "Ready").status, "True");
        assert_eq!(of(&status, "Degraded").status, "False");
        assert_eq!(status.summary.as_deref(), Some("2/2 POSTED"));
    }

    #[test]
    fn ambiguous_payouts_degrade_the_batch_and_are_named_while_the_executor_runs_on() {
        let status = counted_status(
            JobPhase::Running { active: 1 },
            &[("POSTED", 2), (AMBIGUOUS, 1)],
            &["p-3"],
        );
        assert_eq!(of(&status, "Degraded").status, "True");
        assert_eq!(of(&status, "Degraded").reason, RAIL_AMBIGUOUS);
        assert!(of(&status, "Ready").message.contains("p-3"));
        assert_eq!(of(&status, "Progressing").status, "True");
        assert_eq!(status.ambiguous, vec!["p-3".to_owned()]);
        assert_eq!(status.ambiguous_count, Some(1));
        // The template condition is kept next to the ambiguous batch's three.
        assert_eq!(status.reported.conditions.len(), 4);
    }

    #[test]
    fn a_failed_executor_says_so_even_with_ambiguous_payouts() {
        let status = counted_status(
            JobPhase::Failed {
                message: "BackoffLimitExceeded".to_owned(),
            },
            &[(AMBIGUOUS, 1), ("PENDING", 1)],
            &["p-1"],
        );
        assert_eq!(of(&status, "Degraded").reason, "ExecutorFailed");
        assert_eq!(of(&status, "Ready").message, "BackoffLimitExceeded");
        assert_eq!(status.ambiguous_count, Some(1));
    }

    #[test]
    fn unread_payouts_keep_the_previous_counts_and_fenced_out() {
        let previous = PayoutBatchStatus {
            counts: [(AMBIGUOUS.to_owned(), 1)].into(),
            ambiguous: vec!["p-9".to_owned()],
            fenced_out: Some(4),
            ..PayoutBatchStatus::default()
        };
        let object = batch(5, Some(previous));
        let status = batch_status(&observe(&object, JobPhase::Running { active: 1 }, None));
        assert_eq!(status.counts.get(AMBIGUOUS), Some(&1));
        assert_eq!(status.ambiguous, vec!["p-9".to_owned()]);
        assert_eq!(status.fenced_out, Some(4));
        assert_eq!(status.summary.as_deref(), Some("5 running"));
        assert_eq!(of(&status, "Degraded").reason, RAIL_AMBIGUOUS);
    }

    #[test]
    fn an_outdated_template_is_a_condition_and_one_event() {
        let object = batch(1, None);
        let mut observed = observe(&object, JobPhase::Succeeded, counted(&[("POSTED", 1)], &[]));
        observed.template = Observed::new(false, "Outdated", "the Job is older");
        let status = batch_status(&observed);
        assert_eq!(of(&status, JOB_TEMPLATE_CURRENT).status, "False");
        assert_eq!(
            template_went_outdated(&[], &observed.template).as_deref(),
            Some("the Job is older")
        );
        // Already reported: no second Event.
        assert_eq!(
            template_went_outdated(&status.reported.conditions, &observed.template),
            None
        );
    }

    #[test]
    fn a_transition_time_moves_only_when_the_status_changes() {
        let object = batch(1, None);
        let first = batch_status(&observe(&object, JobPhase::Running { active: 1 }, None));
        let object = batch(1, Some(first));
        let mut again = observe(&object, JobPhase::Running { active: 1 }, None);
        again.now = "2026-01-01T00:05:00Z";
        let second = batch_status(&again);
        assert_eq!(
            of(&second, "Progressing").last_transition_time.as_deref(),
            Some(NOW)
        );
        let mut done = observe(&object, JobPhase::Succeeded, None);
        done.now = "2026-01-01T00:05:00Z";
        let third = batch_status(&done);
        assert_eq!(
            of(&third, "Ready").last_transition_time.as_deref(),
            Some("2026-01-01T00:05:00Z")
        );
    }
}
