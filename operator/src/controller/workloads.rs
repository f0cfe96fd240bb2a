//! LockServer, PaymentResource and RailProxy: Deployments with their Services,
//! PodDisruptionBudgets and ConfigMaps (and, for the rail, the stub and its NetworkPolicy).

use std::sync::Arc;
use std::time::Duration;

use dlock_contract::lock::LockGrant;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{ConfigMap, Secret, Service};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use kube::runtime::controller::Action;
use kube::runtime::events::EventType;
use kube::{Resource, ResourceExt};

use super::status::{
    Conditions, DEGRADED, Observed, PROGRESSING, READY, Rollout, condition, rollout,
};
use super::{
    Context, Error, LOCK_MIRROR_MANAGER, Namespaced, Result, apply, apply_status, apply_status_as,
    is_paused, publish, publish_ready_change, reconciled, report_failure,
};
use crate::build::{
    config_map, deployment, lock, network_policy, pdb, proof_keys, service, service_account,
};
use crate::crd::{LockServer, LockStatus, PaymentResource, RailProxy, Reported, WorkloadStatus};
use crate::validate;
use crate::workload::{Component, Workload};

/// How often a ready LockServer's held locks are mirrored into Lock objects.
pub const LOCK_MIRROR_INTERVAL: Duration = Duration::from_secs(15);

/// What one workload kind builds: its Deployments' workloads and, for the rail, the policy.
pub struct Prepared {
    pub workloads: Vec<Workload>,
    /// The services' own ingress policy, then (for the rail) the stub's.
    pub network_policies: Vec<NetworkPolicy>,
    /// The namespace whose [`proof_keys::SECRET`] the workload mounts, because it names no
    /// `spec.fencingProofKeysSecret`: made before any Deployment when it is missing.
    pub generated_proof_keys: Option<String>,
}

/// The namespace of `object` when it names no `spec.fencingProofKeysSecret` (so it mounts the
/// operator's [`proof_keys::SECRET`]).
fn generated_proof_keys<K: Resource>(
    object: &K,
    spec: &crate::crd::ServiceSettings,
) -> Option<String> {
    spec.fencing_proof_keys_secret
        .is_none()
        .then(|| object.meta().namespace.clone().unwrap_or_default())
}

/// What was applied, the only input of the status step.
pub struct Applied {
    pub deployments: Vec<Deployment>,
    pub url: String,
    /// `spec.auth.mode: none`.
    pub auth_disabled: bool,
}

/// The condition that says a workload's service checks no caller (`spec.auth.mode: none`).
pub const AUTHENTICATION_DISABLED: &str = "AuthenticationDisabled";

/// What the `AuthenticationDisabled` condition and the Warning Event say.
pub const AUTHENTICATION_DISABLED_MESSAGE: &str = "spec.auth.mode is none: the service checks no \
credential, so any pod that reaches it may create, fund, claim, post, submit and revoke; remove \
spec.auth to check callers with TokenReview";

pub async fn reconcile_lock_server(object: Arc<LockServer>, ctx: Arc<Context>) -> Result<Action> {
    let prepared = validate::lock_server(&object, &ctx.settings).map(|w| Prepared {
        network_policies: vec![service_policy(&w, &ctx)],
        workloads: vec![w],
        generated_proof_keys: generated_proof_keys(object.as_ref(), &object.spec.service),
    });
    let (ready, status) =
        reconcile_workloads(object.as_ref(), object.status.as_ref(), prepared, &ctx).await?;
    if !ready {
        return Ok(Action::requeue(super::RESYNC));
    }
    mirror_locks(&object, status, &ctx).await;
    Ok(Action::requeue(LOCK_MIRROR_INTERVAL))
}

pub async fn reconcile_payment_resource(
    object: Arc<PaymentResource>,
    ctx: Arc<Context>,
) -> Result<Action> {
    let prepared = validate::payment_resource(&object, &ctx.settings).map(|w| Prepared {
        network_policies: vec![service_policy(&w, &ctx)],
        workloads: vec![w],
        generated_proof_keys: generated_proof_keys(object.as_ref(), &object.spec.service),
    });
    reconcile_workloads(object.as_ref(), object.status.as_ref(), prepared, &ctx).await?;
    Ok(Action::requeue(super::RESYNC))
}

pub async fn reconcile_rail_proxy(object: Arc<RailProxy>, ctx: Arc<Context>) -> Result<Action> {
    let prepared = validate::rail_proxy(&object, &ctx.settings).map(|rail| {
        let mut network_policies = vec![service_policy(&rail.proxy, &ctx)];
        network_policies.extend(
            rail.stub
                .as_ref()
                .map(|stub| network_policy::rail_network_policy(stub, &rail.proxy.instance)),
        );
        let mut workloads = vec![rail.proxy];
        workloads.extend(rail.stub);
        Prepared {
            workloads,
            network_policies,
            generated_proof_keys: generated_proof_keys(object.as_ref(), &object.spec.service),
        }
    });
    reconcile_workloads(object.as_ref(), object.status.as_ref(), prepared, &ctx).await?;
    // Best effort: the proxy is applied and its status written; what the removed stub left is
    // looked for again on the next resync.
    if object.spec.stub.is_none()
        && let Err(error) = remove_orphaned_stub(&object, &ctx).await
    {
        tracing::warn!(
            event = "rail_stub_not_removed",
            rail_proxy = %object.name_any(),
            error = %error,
            "the objects of a removed rail stub could not be deleted; the operator needs list \
             and delete on Deployments, Services, ConfigMaps, PodDisruptionBudgets and \
             NetworkPolicies"
        );
    }
    Ok(Action::requeue(super::RESYNC))
}

/// Deletes what a RailProxy's stub left behind once its spec has no `stub`: the stub's
/// Deployment, Service, ConfigMap, PodDisruptionBudget and NetworkPolicy, found by their labels
/// (component `rail-stub`, this RailProxy's instance, managed by the operator) and deleted only
/// when this RailProxy owns them. Returns how many went (logged at info when any did).
pub async fn remove_orphaned_stub(object: &RailProxy, ctx: &Context) -> Result<usize> {
    let namespace = object.namespace().unwrap_or_default();
    let selector = format!(
        "app.kubernetes.io/component={},{}={},app.kubernetes.io/managed-by={}",
        Component::RailStub.as_str(),
        crate::build::INSTANCE_LABEL,
        object.name_any(),
        crate::build::MANAGED_BY,
    );
    let owner = object.uid().unwrap_or_default();
    let client = &ctx.client;
    let mut removed = Vec::new();
    removed.extend(delete_owned::<Deployment>(client, &namespace, &selector, &owner).await?);
    removed.extend(delete_owned::<Service>(client, &namespace, &selector, &owner).await?);
    removed.extend(delete_owned::<ConfigMap>(client, &namespace, &selector, &owner).await?);
    removed
        .extend(delete_owned::<PodDisruptionBudget>(client, &namespace, &selector, &owner).await?);
    removed.extend(delete_owned::<NetworkPolicy>(client, &namespace, &selector, &owner).await?);
    if !removed.is_empty() {
        tracing::info!(event = "rail_stub_removed", rail_proxy = %object.name_any(), objects = %removed.join(", "));
    }
    Ok(removed.len())
}

/// Deletes the objects of kind `T` that match `selector` and are owned by `owner` (a uid);
/// returns `Kind/name` of each. An object already gone counts as deleted.
async fn delete_owned<T>(
    client: &kube::Client,
    namespace: &str,
    selector: &str,
    owner: &str,
) -> Result<Vec<String>>
where
    T: Namespaced,
{
    let api: Api<T> = Api::namespaced(client.clone(), namespace);
    let listed = api
        .list(&ListParams::default().labels(selector))
        .await
        .map_err(|source| Error::Read {
            what: "the objects of a removed rail stub",
            source,
        })?;
    let mut deleted = Vec::new();
    for item in listed.items {
        let owned = item
            .owner_references()
            .iter()
            .any(|reference| reference.uid == owner);
        if !owned {
            continue;
        }
        let name = item.name_any();
        match api.delete(&name, &DeleteParams::background()).await {
            Ok(_) => {}
            Err(kube::Error::Api(status)) if status.code == 404 => {}
            Err(source) => {
                return Err(Error::Apply {
                    kind: super::kind_name::<T>(),
                    name,
                    source,
                });
            }
        }
        deleted.push(format!("{}/{name}", T::kind(&())));
    }
    Ok(deleted)
}

fn service_policy(workload: &Workload, ctx: &Context) -> NetworkPolicy {
    network_policy::service_network_policy(workload, &ctx.settings.operator_namespace)
}

/// The shared pipeline. Returns whether the object is Ready, and the status it wrote.
async fn reconcile_workloads<K>(
    object: &K,
    previous: Option<&WorkloadStatus>,
    prepared: Result<Prepared, validate::Invalid>,
    ctx: &Context,
) -> Result<(bool, WorkloadStatus)>
where
    K: Resource<DynamicType = (), Scope = k8s_openapi::NamespaceResourceScope>
        + serde::de::DeserializeOwned
        + Clone
        + std::fmt::Debug,
{
    let kind = K::kind(&()).to_string();
    let previous_conditions = previous
        .map(|s| s.reported.conditions.clone())
        .unwrap_or_default();
    let prepared = match prepared {
        Ok(prepared) => prepared,
        Err(invalid) => {
            write_invalid_spec(object, &previous_conditions, &invalid, ctx).await?;
            return Err(Error::Invalid(invalid));
        }
    };
    let applied = match apply_prepared(&ctx.client, prepared).await {
        Ok(applied) => applied,
        Err(error) => {
            report_failure(ctx, object, &previous_conditions, &error).await;
            return Err(error);
        }
    };
    let auth_disabled = applied.auth_disabled;
    let status = workload_status(
        object.meta().generation,
        &previous_conditions,
        &applied,
        &ctx.now(),
    );
    let ready = status
        .reported
        .conditions
        .first()
        .is_some_and(|c| c.status == "True");
    write_status(object, &previous_conditions, status.clone(), ctx).await?;
    if auth_disabled {
        // Every time such a spec is applied, not only on a transition: nobody should miss it.
        warn_auth_disabled(object, ctx).await;
    }
    reconciled(ctx, object);
    ctx.metrics.count(kind_label(&kind), "ok");
    Ok((ready, status))
}

/// Writes Degraded with the reason InvalidSpec for a spec the operator refuses (the other
/// status fields cleared), with an Event when that changes Ready.
async fn write_invalid_spec<K: Namespaced>(
    object: &K,
    previous: &[crate::crd::Condition],
    invalid: &validate::Invalid,
    ctx: &Context,
) -> Result<()> {
    let conditions = Conditions::degraded("InvalidSpec", invalid.to_string());
    let status = WorkloadStatus {
        reported: Reported::new(
            object.meta().generation,
            conditions.render(previous, object.meta().generation, &ctx.now()),
        ),
        ..WorkloadStatus::default()
    };
    write_status(object, previous, status, ctx).await
}

/// The Warning Event of a workload whose service checks no caller.
async fn warn_auth_disabled<K: Namespaced>(object: &K, ctx: &Context) {
    publish(
        ctx,
        object,
        EventType::Warning,
        AUTHENTICATION_DISABLED,
        AUTHENTICATION_DISABLED_MESSAGE.to_owned(),
    )
    .await;
}

fn kind_label(kind: &str) -> &'static str {
    match kind {
        "LockServer" => "LockServer",
        "PaymentResource" => "PaymentResource",
        _ => "RailProxy",
    }
}

/// Applies every object in order: configuration first, so a new pod never starts on an old file.
async fn apply_prepared(client: &kube::Client, prepared: Prepared) -> Result<Applied> {
    let Prepared {
        workloads,
        network_policies,
        generated_proof_keys,
    } = prepared;
    let mut deployments = Vec::new();
    let url = workloads.first().map(Workload::url).unwrap_or_default();
    let auth_disabled = workloads.first().is_some_and(|w| w.auth_disabled);
    // The service account before any pod that runs as it.
    if let Some(workload) = workloads.iter().find(|w| w.service_account.is_some()) {
        apply(
            client,
            &service_account::service_account(&workload.namespace),
        )
        .await?;
    }
    // The proof keys before any Deployment that mounts them (a pod without them does not start).
    if let Some(namespace) = &generated_proof_keys {
        create_proof_keys(client, namespace).await?;
    }
    for workload in &workloads {
        apply(client, &config_map::config_map(workload)).await?;
        apply(client, &service::service(workload)).await?;
        deployments.push(apply(client, &deployment::deployment(workload)).await?);
        apply(client, &pdb::pdb(workload)).await?;
    }
    for policy in &network_policies {
        apply(client, policy).await?;
    }
    Ok(Applied {
        deployments,
        url,
        auth_disabled,
    })
}

/// Makes the namespace's [`proof_keys::SECRET`] with fresh keys unless it exists. Created, never
/// applied: an existing Secret is never read nor changed (its keys may have been rotated), so
/// `create` is all the operator may do with Secrets, and `AlreadyExists` is success.
async fn create_proof_keys(client: &kube::Client, namespace: &str) -> Result<()> {
    let secret = proof_keys::random_secret().map_err(|message| Error::ProofKeys {
        namespace: namespace.to_owned(),
        message,
    })?;
    let api: Api<Secret> = Api::namespaced(client.clone(), namespace);
    match api
        .create(
            &PostParams {
                field_manager: Some(crate::workload::FIELD_MANAGER.to_owned()),
                ..PostParams::default()
            },
            &proof_keys::proof_keys_secret(namespace, &secret),
        )
        .await
    {
        Ok(_) => {
            tracing::info!(
                event = "fencing_proof_keys_created",
                namespace,
                secret = proof_keys::SECRET,
                "made the namespace's fencing-proof keys (new random key material)"
            );
            Ok(())
        }
        Err(kube::Error::Api(status)) if status.is_already_exists() => Ok(()),
        Err(source) => Err(Error::ProofKeys {
            namespace: namespace.to_owned(),
            message: format!(
                "cannot create {} ({source}); the operator needs `create` on Secrets (the chart's \
                 ClusterRole), or name spec.fencingProofKeysSecret on every LockServer, \
                 PaymentResource and RailProxy of the namespace",
                proof_keys::SECRET
            ),
        }),
    }
}

/// The status of a workload kind from its applied Deployments (pure).
pub fn workload_status(
    generation: Option<i64>,
    previous: &[crate::crd::Condition],
    applied: &Applied,
    now: &str,
) -> WorkloadStatus {
    let Applied {
        deployments,
        url,
        auth_disabled,
    } = applied;
    let rollouts: Vec<Rollout> = deployments.iter().map(rollout).collect();
    let (ready_total, desired_total) = replicas(deployments, &rollouts);
    let conditions = rollout_conditions(&rollouts, ready_total, desired_total);
    // The three conditions, then any other kept as it was (the lock mirror's LocksMirrored).
    let mut rendered = conditions.render(previous, generation, now);
    rendered.extend(
        previous
            .iter()
            .filter(|c| {
                ![READY, PROGRESSING, DEGRADED, AUTHENTICATION_DISABLED].contains(&c.type_.as_str())
            })
            .cloned(),
    );
    rendered.extend(auth_condition(previous, *auth_disabled, generation, now));
    WorkloadStatus {
        reported: Reported::new(generation, rendered),
        ready_replicas: Some(ready_total),
        summary: Some(format!("{ready_total}/{desired_total}")),
        url: Some(url.clone()),
    }
}

/// The ready and the desired replicas over every Deployment (a stuck one counts none ready).
fn replicas(deployments: &[Deployment], rollouts: &[Rollout]) -> (i32, i32) {
    deployments
        .iter()
        .zip(rollouts)
        .fold((0, 0), |(ready, desired), (d, r)| {
            let want = d.spec.as_ref().and_then(|s| s.replicas).unwrap_or(1);
            let have = match r {
                Rollout::Available { ready } | Rollout::RollingOut { ready, .. } => *ready,
                Rollout::Stuck { .. } => 0,
            };
            (ready + have, desired + want)
        })
}

/// Degraded when a rollout is stuck, Ready when every one is available, else Progressing.
fn rollout_conditions(rollouts: &[Rollout], ready_total: i32, desired_total: i32) -> Conditions {
    if let Some(Rollout::Stuck { message }) =
        rollouts.iter().find(|r| matches!(r, Rollout::Stuck { .. }))
    {
        Conditions::degraded("RolloutStuck", message.clone())
    } else if rollouts
        .iter()
        .all(|r| matches!(r, Rollout::Available { .. }))
    {
        Conditions::ready(format!("{ready_total}/{desired_total} replicas ready"))
    } else {
        Conditions::progressing(
            "RollingOut",
            format!("{ready_total}/{desired_total} replicas ready"),
        )
    }
}

/// AuthenticationDisabled: True while spec.auth.mode is none; once set, it stays and flips to
/// False when authentication is back on.
fn auth_condition(
    previous: &[crate::crd::Condition],
    auth_disabled: bool,
    generation: Option<i64>,
    now: &str,
) -> Option<crate::crd::Condition> {
    let had = previous.iter().any(|c| c.type_ == AUTHENTICATION_DISABLED);
    if !(auth_disabled || had) {
        return None;
    }
    let observed = if auth_disabled {
        Observed::new(true, "AuthModeNone", AUTHENTICATION_DISABLED_MESSAGE)
    } else {
        Observed::new(
            false,
            "TokenReview",
            "callers are checked with TokenReview (audience dlock)",
        )
    };
    Some(condition(
        previous,
        AUTHENTICATION_DISABLED,
        &observed,
        generation,
        now,
    ))
}

/// Writes the status, then publishes an Event if Ready changed (only on transitions).
async fn write_status<K: Namespaced>(
    object: &K,
    previous: &[crate::crd::Condition],
    status: WorkloadStatus,
    ctx: &Context,
) -> Result<()> {
    apply_status(&ctx.client, object, &status).await?;
    publish_ready_change(ctx, object, previous, &status.reported.conditions).await;
    Ok(())
}

/// The LockServer condition that says whether the Lock mirror is complete.
pub const LOCKS_MIRRORED: &str = "LocksMirrored";

/// The LockServer's conditions with `LocksMirrored` set from the last list, or `None` when they
/// need no change. A complete list never adds the condition, only flips an existing one back.
pub fn mirror_conditions(
    previous: &[crate::crd::Condition],
    truncated: bool,
    listed: usize,
    generation: Option<i64>,
    now: &str,
) -> Option<Vec<crate::crd::Condition>> {
    let existing = previous.iter().find(|c| c.type_ == LOCKS_MIRRORED);
    let observed = if truncated {
        Observed::new(
            false,
            "Truncated",
            format!(
                "the lock server listed {listed} held locks and holds more; Locks of unlisted \
                 keys are kept, none is removed until a list is complete"
            ),
        )
    } else if existing.is_some() {
        Observed::new(
            true,
            "Complete",
            format!("all {listed} held locks mirrored"),
        )
    } else {
        return None;
    };
    let updated = condition(previous, LOCKS_MIRRORED, &observed, generation, now);
    if existing.is_some_and(|c| c.status == updated.status && c.message == updated.message) {
        return None;
    }
    let mut conditions: Vec<_> = previous
        .iter()
        .filter(|c| c.type_ != LOCKS_MIRRORED)
        .cloned()
        .collect();
    conditions.push(updated);
    Some(conditions)
}

/// The Lock status fields the mirror owns (under [`LOCK_MIRROR_MANAGER`]), and only those: the
/// Lock controller owns `observedGeneration`, `conditions` and `revocation`.
pub fn mirror_status(grant: &LockGrant) -> LockStatus {
    LockStatus {
        holder: Some(grant.owner_id.clone()),
        token: Some(grant.fencing_token),
        acquired_at: Some(dlock_contract::time::format(&grant.acquired_at)),
        expires_at: Some(dlock_contract::time::format(&grant.expires_at)),
        ..LockStatus::default()
    }
}

fn mirrored_fields(status: &LockStatus) -> LockStatus {
    LockStatus {
        holder: status.holder.clone(),
        token: status.token,
        acquired_at: status.acquired_at.clone(),
        expires_at: status.expires_at.clone(),
        ..LockStatus::default()
    }
}

/// Whether a Lock carries a revocation that has not reached both fences (or has not run yet).
/// A revoked lock is released at once, so its key leaves the held list before the fences are
/// pushed; deleting the Lock then would lose the recorded floor the retry needs. It goes once
/// the revocation is settled.
pub fn revocation_unfinished(lock: &crate::crd::Lock) -> bool {
    let Some((reason, revoked_by)) = super::lock::requested(lock) else {
        return false;
    };
    let request = super::lock::request_key(&reason, &revoked_by);
    !super::revoke::is_settled(
        lock.status.as_ref().and_then(|s| s.revocation.as_ref()),
        &request,
    )
}

/// Mirrors a ready LockServer's held locks into Lock objects and removes the Locks of released
/// keys. A lock server that does not answer leaves the mirror as it is (it is a view only). A
/// truncated list (more held locks than one list returns) removes nothing: a key that was not
/// listed may well be held; the LockServer's `LocksMirrored` condition says so.
pub async fn mirror_locks(object: &LockServer, status: WorkloadStatus, ctx: &Context) {
    if let Err(error) = try_mirror_locks(object, status, ctx).await {
        tracing::warn!(event = "lock_mirror_failed", lock_server = %object.name_any(), error = %error);
    }
}

async fn try_mirror_locks(
    object: &LockServer,
    status: WorkloadStatus,
    ctx: &Context,
) -> Result<()> {
    let namespace = object.namespace().unwrap_or_default();
    let name = object.name_any();
    let Some(owner) = object.controller_owner_ref(&()) else {
        return Ok(());
    };
    // A name that is not a Service name was refused by validation, which says so in the status.
    let Ok(service) = crate::workload::ServiceName::new(&name) else {
        return Ok(());
    };
    let tls = object.spec.service.tls.is_some();
    let url = crate::workload::service_url_with(&service, &namespace, tls);
    let list = ctx.services.held_locks(&url).await?;
    let held = &list.items;
    let mut keep = std::collections::BTreeSet::new();
    for grant in held {
        let mirrored = lock::mirrored_lock(&name, &namespace, grant, &owner);
        keep.insert(mirrored.name_any());
        let applied = apply(&ctx.client, &mirrored).await?;
        let status = mirror_status(grant);
        if applied.status.as_ref().map(mirrored_fields) != Some(status.clone()) {
            apply_status_as(&ctx.client, &applied, &status, LOCK_MIRROR_MANAGER).await?;
        }
    }
    record_mirror_condition(object, status, list.truncated, held.len(), ctx).await?;
    if list.truncated {
        tracing::warn!(event = "lock_mirror_truncated", lock_server = %name, listed = held.len());
        return Ok(());
    }
    remove_released_locks(ctx, &namespace, &name, &keep).await
}

/// Sets the LockServer's `LocksMirrored` condition from the last list when it changes, with a
/// Warning Event when the list was truncated.
async fn record_mirror_condition(
    object: &LockServer,
    status: WorkloadStatus,
    truncated: bool,
    listed: usize,
    ctx: &Context,
) -> Result<()> {
    let Some(conditions) = mirror_conditions(
        &status.reported.conditions,
        truncated,
        listed,
        object.metadata.generation,
        &ctx.now(),
    ) else {
        return Ok(());
    };
    apply_status(
        &ctx.client,
        object,
        &WorkloadStatus {
            reported: Reported {
                conditions,
                ..status.reported
            },
            ..status
        },
    )
    .await?;
    if truncated {
        publish(
            ctx,
            object,
            EventType::Warning,
            "LockMirrorTruncated",
            format!(
                "the lock server listed {listed} held locks and holds more; no Lock is removed \
                 until a list is complete"
            ),
        )
        .await;
    }
    Ok(())
}

/// Deletes the lock server's Locks whose keys are no longer held (`keep` names the held ones),
/// except paused Locks and Locks whose revocation is unfinished.
async fn remove_released_locks(
    ctx: &Context,
    namespace: &str,
    name: &str,
    keep: &std::collections::BTreeSet<String>,
) -> Result<()> {
    let api: Api<crate::crd::Lock> = Api::namespaced(ctx.client.clone(), namespace);
    let listed = api
        .list(&ListParams::default().labels(&format!("{}={name}", lock::LOCK_SERVER_LABEL)))
        .await
        .map_err(|source| Error::Read {
            what: "Locks",
            source,
        })?;
    for stale in listed
        .items
        .iter()
        .filter(|l| !keep.contains(&l.name_any()))
    {
        if is_paused(stale) || revocation_unfinished(stale) {
            continue;
        }
        api.delete(&stale.name_any(), &DeleteParams::default())
            .await
            .map_err(|source| Error::Apply {
                kind: "Lock",
                name: stale.name_any(),
                source,
            })?;
    }
    Ok(())
}

#[cfg(test)]
mod tests;
