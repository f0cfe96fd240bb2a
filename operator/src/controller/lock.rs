//! Lock (the revoke annotations) and LockRevocation (the same flow, declarative).

use std::sync::Arc;

use dlock_contract::revoke::RevokeOrder;
use kube::ResourceExt;
use kube::runtime::controller::Action;
use kube::runtime::events::EventType;

use super::revoke::{self, COMPLETE, OUTCOME_UNKNOWN, REFUSED};
use super::status::Conditions;
use super::{
    Context, Error, LOCK_REVOKE_MANAGER, Result, apply_status, apply_status_as, publish, reconciled,
};
use crate::crd::{
    Lock, LockRevocation, LockRevocationStatus, LockStatus, Reported, RevocationResult,
};
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
        // L8 may have ended the grant; the retry reads the key before anything else.
        OUTCOME_UNKNOWN => {
            Conditions::progressing("OutcomeUnknown", result.summary.clone().unwrap_or_default())
        }
        _ => Conditions::progressing("FencePending", result.summary.clone().unwrap_or_default()),
    }
}

fn event_of(result: &RevocationResult) -> (EventType, &'static str) {
    match result.outcome.as_str() {
        COMPLETE => (EventType::Normal, "Revoked"),
        REFUSED => (EventType::Warning, "RevocationRefused"),
        OUTCOME_UNKNOWN => (EventType::Warning, "RevocationOutcomeUnknown"),
        _ => (EventType::Warning, "RevocationIncomplete"),
    }
}

pub async fn reconcile_lock(object: Arc<Lock>, ctx: Arc<Context>) -> Result<Action> {
    let previous = object.status.clone().unwrap_or_default();
    let Some((reason, revoked_by)) = requested(&object) else {
        // A mirrored Lock nobody asked to revoke: Ready, once (the conditions are this
        // controller's fields, never the mirror's).
        if previous.reported.conditions.is_empty() {
            let ready = Conditions::ready("mirrored from its lock server; no revocation asked");
            apply_revoke_fields(&ctx, &object, &previous, ready, None).await?;
        }
        return Ok(Action::await_change());
    };
    let request = request_key(&reason, &revoked_by);
    if revoke::is_settled(previous.revocation.as_ref(), &request) {
        return Ok(Action::await_change());
    }
    let namespace = object.namespace().unwrap_or_default();
    // The annotations mean "fence out whoever holds this key now": the token is the key's live
    // grant, read from the lock server when the request is handled (see `live_holder`), never the
    // mirror's, which may be 15 s old.
    let ask = validate::RevocationAsk {
        order: RevokeOrder {
            key: object.spec.key.clone(),
            account_id: object.spec.account_id.clone(),
            operator: revoked_by,
            reason,
            expected_token: None,
        },
        named: [Some(object.spec.lock_server.as_str()), None, None],
    };
    let recorded = previous.revocation.as_ref();
    let result = match target_or_refuse(&ctx, &namespace, &ask, &request).await? {
        Err(refused) => refused,
        Ok(mut target) => match live_holder(&ctx, &target, &request, recorded).await? {
            Err(refused) => refused,
            Ok(token) => {
                target.order.expected_token = token;
                match revoke::run(ctx.services.as_ref(), &target, &request, recorded).await {
                    Ok(result) => result,
                    Err(unanswered) => {
                        // L8 may have ended the grant without its answer reaching us: the token
                        // is recorded, so the retry revokes that grant only, never a newer one.
                        if let Some(token) = token {
                            let pinned = revoke::pinned(&request, token, &unanswered);
                            let conditions = conditions_of(&pinned);
                            apply_revoke_fields(&ctx, &object, &previous, conditions, Some(pinned))
                                .await?;
                        }
                        return Err(unanswered.into());
                    }
                }
            }
        },
    };
    let conditions = conditions_of(&result);
    apply_revoke_fields(&ctx, &object, &previous, conditions, Some(result.clone())).await?;
    ctx.metrics
        .revocations
        .get_or_create(&crate::metrics::ReconcileLabels {
            kind: "Lock",
            outcome: outcome_label(&result.outcome),
        })
        .inc();
    finish(&ctx, object.as_ref(), &result, "Lock").await
}

/// The Lock status fields this controller owns (under [`LOCK_REVOKE_MANAGER`]), and only those:
/// `holder`, `token`, `acquiredAt` and `expiresAt` are the mirror's.
pub fn revoke_fields(
    generation: Option<i64>,
    conditions: Vec<crate::crd::Condition>,
    revocation: Option<RevocationResult>,
) -> LockStatus {
    LockStatus {
        reported: Reported::new(generation, conditions),
        revocation,
        ..LockStatus::default()
    }
}

/// Applies this controller's fields of the Lock's status: `conditions`, rendered against the
/// previous ones, and the revocation.
async fn apply_revoke_fields(
    ctx: &Context,
    object: &Lock,
    previous: &LockStatus,
    conditions: Conditions,
    revocation: Option<RevocationResult>,
) -> Result<()> {
    let generation = object.metadata.generation;
    let status = revoke_fields(
        generation,
        conditions.render(&previous.reported.conditions, generation, &ctx.now()),
        revocation,
    );
    apply_status_as(&ctx.client, object, &status, LOCK_REVOKE_MANAGER).await
}

/// Runs (or resumes) the revocation `ask` asks for against the namespace's services, or records
/// why it was not sent: a malformed ask, or no single target of a kind.
async fn revoke_or_refuse(
    ctx: &Context,
    namespace: &str,
    ask: &validate::RevocationAsk<'_>,
    request: &str,
    previous: Option<&RevocationResult>,
) -> Result<RevocationResult> {
    Ok(
        match target_or_refuse(ctx, namespace, ask, request).await? {
            Ok(target) => revoke::run(ctx.services.as_ref(), &target, request, previous).await?,
            Err(refused) => refused,
        },
    )
}

/// Where the revocation `ask` asks for goes, or the refusal to record: a malformed ask, or no
/// single target of a kind.
async fn target_or_refuse(
    ctx: &Context,
    namespace: &str,
    ask: &validate::RevocationAsk<'_>,
    request: &str,
) -> Result<std::result::Result<validate::RevocationTarget, RevocationResult>> {
    let target = match validate::check_ask(ask) {
        Ok(()) => {
            let (present, tls) = namespace_targets(ctx, namespace).await?;
            validate::revocation_target(namespace, ask, &present).map(|mut target| {
                tls.secure_revocation(&mut target);
                target
            })
        }
        Err(invalid) => Err(invalid),
    };
    Ok(target.map_err(|invalid| revoke::refused(request, format!("not sent: {invalid}"))))
}

/// The grant a Lock's revoke annotations end: the key's holder at the lock server when the
/// request is handled (L7), so a busy key whose mirror is a refresh behind still loses its live
/// holder. L8 carries its token as `expectedToken`, so a grant that changes between the read and
/// L8 is refused, never another ended unasked. A request already under way keeps its grant: the
/// token recorded when L8 went unanswered, or nothing at all once L8 has answered (the flow
/// resumes without it). A key nobody holds now is refused: there is nothing to fence out.
async fn live_holder(
    ctx: &Context,
    target: &validate::RevocationTarget,
    request: &str,
    recorded: Option<&RevocationResult>,
) -> Result<std::result::Result<Option<i64>, RevocationResult>> {
    if let Some(recorded) = recorded.filter(|r| r.request == request) {
        if recorded.revocation_id.is_some() {
            return Ok(Ok(None));
        }
        if let Some(token) = recorded.revoked_token {
            return Ok(Ok(Some(token)));
        }
    }
    let key = &target.order.key;
    let grant = match ctx.services.lock_grant(&target.lock_server_url, key).await {
        Ok(grant) => grant,
        Err(refused @ crate::services::ServiceError::Refused { .. }) => {
            return Ok(Err(revoke::refused(
                request,
                format!("not sent: reading who holds {key}: {refused}"),
            )));
        }
        Err(unavailable) => return Err(unavailable.into()),
    };
    Ok(match grant {
        Some(token) => Ok(Some(token)),
        None => Err(revoke::refused(
            request,
            format!(
                "not sent: nothing holds {key} at {} now; there is no holder to fence out",
                target.lock_server_url
            ),
        )),
    })
}

/// The names of the LockServers, PaymentResources and RailProxies in `namespace`: a target a
/// revocation names must be one of them, and one it does not name is the only one of its kind
/// (see [`validate::fence_target`] for the rule); and which of them serve TLS, so the revocation
/// calls them at `https://`.
async fn namespace_targets(
    ctx: &Context,
    namespace: &str,
) -> Result<(validate::NamespaceTargets, crate::services::NamespaceTls)> {
    let ([lock_servers, payment_resources, rail_proxies], tls) =
        super::payout_batch::namespace_services(ctx, namespace).await?;
    Ok((
        validate::NamespaceTargets {
            lock_servers,
            payment_resources,
            rail_proxies,
        },
        tls,
    ))
}

fn outcome_label(outcome: &str) -> &'static str {
    match outcome {
        COMPLETE => COMPLETE,
        REFUSED => REFUSED,
        OUTCOME_UNKNOWN => OUTCOME_UNKNOWN,
        _ => revoke::INCOMPLETE,
    }
}

/// Publishes the revocation's Event. An incomplete revocation, or one whose L8 has no known
/// outcome, is retried with back-off; the others wait for a new request.
async fn finish<K: kube::Resource<DynamicType = ()>>(
    ctx: &Context,
    object: &K,
    result: &RevocationResult,
    kind: &'static str,
) -> Result<Action> {
    let (type_, event_reason) = event_of(result);
    publish(
        ctx,
        object,
        type_,
        event_reason,
        result.summary.clone().unwrap_or_default(),
    )
    .await;
    if result.outcome == revoke::INCOMPLETE || result.outcome == OUTCOME_UNKNOWN {
        let service = if result.outcome == OUTCOME_UNKNOWN {
            "lock-server"
        } else {
            "fence"
        };
        return Err(Error::Service(crate::services::ServiceError::Unavailable {
            service,
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
    // The spec is immutable (CEL): the request is the spec's own words.
    let request = request_key(&object.spec.reason, &object.spec.revoked_by);
    let previous = object.status.clone().unwrap_or_default();
    if revoke::is_settled(previous.result.as_ref(), &request) {
        return Ok(Action::await_change());
    }
    let ask = validate::lock_revocation_ask(&object);
    let result = revoke_or_refuse(
        &ctx,
        &object.namespace().unwrap_or_default(),
        &ask,
        &request,
        previous.result.as_ref(),
    )
    .await?;
    let status = LockRevocationStatus {
        reported: Reported::new(
            object.metadata.generation,
            conditions_of(&result).render(
                &previous.reported.conditions,
                object.metadata.generation,
                &ctx.now(),
            ),
        ),
        result: Some(result.clone()),
    };
    apply_status(&ctx.client, object.as_ref(), &status).await?;
    finish(&ctx, object.as_ref(), &result, "LockRevocation").await
}
