//! Lock (the revoke annotations) and LockRevocation (the same flow, declarative).

use std::sync::Arc;

use kube::ResourceExt;
use kube::runtime::controller::Action;
use kube::runtime::events::EventType;

use super::revoke::{self, COMPLETE, REFUSED};
use super::status::Conditions;
use super::{Context, Error, Result, apply_status, is_paused, publish, reconciled};
use crate::crd::{Lock, LockRevocation, LockRevocationStatus, LockStatus, RevocationResult};
use crate::validate;

pub const REVOKE_REASON_ANNOTATION: &str = "dlock.io/revoke-reason";
pub const REVOKED_BY_ANNOTATION: &str = "dlock.io/revoked-by";

/// The revocation the annotations ask for, as `(reason, revokedBy)`.
pub fn requested(lock: &Lock) -> Option<(String, String)> {
    let annotations = lock.metadata.annotations.as_ref()?;
    let reason = annotations.get(REVOKE_REASON_ANNOTATION)?;
    let by = annotations.get(REVOKED_BY_ANNOTATION)?;
    Some((reason.clone(), by.clone()))
}

/// The request key: the flow runs once per annotation value.
pub fn request_key(reason: &str, revoked_by: &str) -> String {
    format!("{revoked_by}: {reason}")
}

fn conditions_of(result: &RevocationResult) -> Conditions {
    match result.outcome.as_str() {
        COMPLETE => Conditions::ready(result.summary.clone().unwrap_or_default()),
        REFUSED => Conditions::degraded(
            "RevocationRefused",
            result.summary.clone().unwrap_or_default(),
        ),
        _ => Conditions::progressing("FencePending", result.summary.clone().unwrap_or_default()),
    }
}

fn event_of(result: &RevocationResult) -> (EventType, &'static str) {
    match result.outcome.as_str() {
        COMPLETE => (EventType::Normal, "Revoked"),
        REFUSED => (EventType::Warning, "RevocationRefused"),
        _ => (EventType::Warning, "RevocationIncomplete"),
    }
}

pub async fn reconcile_lock(object: Arc<Lock>, ctx: Arc<Context>) -> Result<Action> {
    if is_paused(object.as_ref()) {
        ctx.metrics.count("Lock", "paused");
        return Ok(Action::await_change());
    }
    let Some((reason, revoked_by)) = requested(&object) else {
        return Ok(Action::await_change());
    };
    let request = request_key(&reason, &revoked_by);
    let previous = object.status.clone().unwrap_or_default();
    if revoke::is_settled(previous.revocation.as_ref(), &request) {
        return Ok(Action::await_change());
    }
    let target = validate::revocation_target(
        &object.namespace().unwrap_or_default(),
        &object.spec.key,
        &object.spec.account_id,
        &revoked_by,
        &reason,
        [Some(object.spec.lock_server.as_str()), None, None],
    );
    let result = match target {
        Ok(target) => {
            revoke::run(
                ctx.services.as_ref(),
                &target,
                &request,
                previous.revocation.as_ref(),
            )
            .await?
        }
        Err(invalid) => RevocationResult {
            request: request.clone(),
            outcome: REFUSED.to_owned(),
            summary: Some(format!("not sent: {invalid}")),
            ..RevocationResult::default()
        },
    };
    let status = LockStatus {
        observed_generation: object.metadata.generation,
        conditions: conditions_of(&result).render(
            &previous.conditions,
            object.metadata.generation,
            &ctx.now(),
        ),
        revocation: Some(result.clone()),
        ..previous
    };
    apply_status(&ctx.client, object.as_ref(), &status).await?;
    let (type_, event_reason) = event_of(&result);
    publish(
        &ctx,
        object.as_ref(),
        type_,
        event_reason,
        result.summary.clone().unwrap_or_default(),
    )
    .await;
    ctx.metrics
        .revocations
        .get_or_create(&crate::metrics::ReconcileLabels {
            kind: "Lock",
            outcome: outcome_label(&result.outcome),
        })
        .inc();
    finish(&ctx, object.as_ref(), &result, "Lock")
}

fn outcome_label(outcome: &str) -> &'static str {
    match outcome {
        COMPLETE => COMPLETE,
        REFUSED => REFUSED,
        _ => revoke::INCOMPLETE,
    }
}

/// An incomplete revocation is retried with back-off; the others wait for a new request.
fn finish<K: kube::Resource>(
    ctx: &Context,
    object: &K,
    result: &RevocationResult,
    kind: &'static str,
) -> Result<Action> {
    if result.outcome == revoke::INCOMPLETE {
        return Err(Error::Service(crate::services::ServiceError::Unavailable {
            service: "fence",
            message: result.summary.clone().unwrap_or_default(),
        }));
    }
    reconciled(ctx, object);
    ctx.metrics.count(kind, "ok");
    Ok(Action::await_change())
}

pub async fn reconcile_lock_revocation(
    object: Arc<LockRevocation>,
    ctx: Arc<Context>,
) -> Result<Action> {
    if is_paused(object.as_ref()) {
        ctx.metrics.count("LockRevocation", "paused");
        return Ok(Action::await_change());
    }
    // The spec is immutable (CEL): the request is the spec's own words.
    let request = request_key(&object.spec.reason, &object.spec.revoked_by);
    let previous = object.status.clone().unwrap_or_default();
    if revoke::is_settled(previous.result.as_ref(), &request) {
        return Ok(Action::await_change());
    }
    let result = match validate::lock_revocation(&object) {
        Ok(target) => {
            revoke::run(
                ctx.services.as_ref(),
                &target,
                &request,
                previous.result.as_ref(),
            )
            .await?
        }
        Err(invalid) => RevocationResult {
            request: request.clone(),
            outcome: REFUSED.to_owned(),
            summary: Some(format!("not sent: {invalid}")),
            ..RevocationResult::default()
        },
    };
    let status = LockRevocationStatus {
        observed_generation: object.metadata.generation,
        conditions: conditions_of(&result).render(
            &previous.conditions,
            object.metadata.generation,
            &ctx.now(),
        ),
        result: Some(result.clone()),
    };
    apply_status(&ctx.client, object.as_ref(), &status).await?;
    let (type_, event_reason) = event_of(&result);
    publish(
        &ctx,
        object.as_ref(),
        type_,
        event_reason,
        result.summary.clone().unwrap_or_default(),
    )
    .await;
    finish(&ctx, object.as_ref(), &result, "LockRevocation")
}
