//! LockServer, PaymentResource and RailProxy: Deployments with their Services,
//! PodDisruptionBudgets and ConfigMaps (and, for the rail, the stub and its NetworkPolicy).

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::networking::v1::NetworkPolicy;
use kube::api::{Api, DeleteParams, ListParams};
use kube::runtime::controller::Action;
use kube::runtime::events::EventType;
use kube::{Resource, ResourceExt};

use super::status::{Conditions, Rollout, ready_of, rollout};
use super::{Context, Error, Result, apply, apply_status, is_paused, publish, reconciled};
use crate::build::{config_map, deployment, lock, network_policy, pdb, service};
use crate::crd::{LockServer, LockStatus, PaymentResource, RailProxy, WorkloadStatus};
use crate::validate;
use crate::workload::Workload;

/// How often a ready LockServer's held locks are mirrored into Lock objects.
pub const LOCK_MIRROR_INTERVAL: Duration = Duration::from_secs(15);

/// What one workload kind builds: its Deployments' workloads and, for the rail, the policy.
pub struct Prepared {
    pub workloads: Vec<Workload>,
    pub network_policy: Option<NetworkPolicy>,
}

/// What was applied, the only input of the status step.
pub struct Applied {
    pub deployments: Vec<Deployment>,
    pub url: String,
}

pub async fn reconcile_lock_server(object: Arc<LockServer>, ctx: Arc<Context>) -> Result<Action> {
    if is_paused(object.as_ref()) {
        ctx.metrics.count("LockServer", "paused");
        return Ok(Action::await_change());
    }
    let prepared = validate::lock_server(&object, &ctx.settings).map(|w| Prepared {
        workloads: vec![w],
        network_policy: None,
    });
    let ready =
        reconcile_workloads(object.as_ref(), object.status.as_ref(), prepared, &ctx).await?;
    if !ready {
        return Ok(Action::requeue(super::RESYNC));
    }
    mirror_locks(&object, &ctx).await;
    Ok(Action::requeue(LOCK_MIRROR_INTERVAL))
}

pub async fn reconcile_payment_resource(
    object: Arc<PaymentResource>,
    ctx: Arc<Context>,
) -> Result<Action> {
    if is_paused(object.as_ref()) {
        ctx.metrics.count("PaymentResource", "paused");
        return Ok(Action::await_change());
    }
    let prepared = validate::payment_resource(&object, &ctx.settings).map(|w| Prepared {
        workloads: vec![w],
        network_policy: None,
    });
    reconcile_workloads(object.as_ref(), object.status.as_ref(), prepared, &ctx).await?;
    Ok(Action::requeue(super::RESYNC))
}

pub async fn reconcile_rail_proxy(object: Arc<RailProxy>, ctx: Arc<Context>) -> Result<Action> {
    if is_paused(object.as_ref()) {
        ctx.metrics.count("RailProxy", "paused");
        return Ok(Action::await_change());
    }
    let prepared = validate::rail_proxy(&object, &ctx.settings).map(|rail| {
        let network_policy = rail
            .stub
            .as_ref()
            .map(|stub| network_policy::rail_network_policy(stub, &rail.proxy.instance));
        let mut workloads = vec![rail.proxy];
        workloads.extend(rail.stub);
        Prepared {
            workloads,
            network_policy,
        }
    });
    reconcile_workloads(object.as_ref(), object.status.as_ref(), prepared, &ctx).await?;
    Ok(Action::requeue(super::RESYNC))
}

/// The shared pipeline. Returns whether the object is Ready.
async fn reconcile_workloads<K>(
    object: &K,
    previous: Option<&WorkloadStatus>,
    prepared: Result<Prepared, validate::Invalid>,
    ctx: &Context,
) -> Result<bool>
where
    K: Resource<DynamicType = (), Scope = k8s_openapi::NamespaceResourceScope>
        + serde::de::DeserializeOwned
        + Clone
        + std::fmt::Debug,
{
    let kind = K::kind(&()).to_string();
    let previous_conditions = previous.map(|s| s.conditions.clone()).unwrap_or_default();
    let prepared = match prepared {
        Ok(prepared) => prepared,
        Err(invalid) => {
            let conditions = Conditions::degraded("InvalidSpec", invalid.to_string());
            let status = WorkloadStatus {
                observed_generation: object.meta().generation,
                conditions: conditions.render(
                    &previous_conditions,
                    object.meta().generation,
                    &ctx.now(),
                ),
                ..WorkloadStatus::default()
            };
            write_status(object, &previous_conditions, status, ctx).await?;
            return Err(Error::Invalid(invalid));
        }
    };
    let applied = apply_prepared(&ctx.client, prepared).await?;
    let status = workload_status(
        object.meta().generation,
        &previous_conditions,
        &applied,
        &ctx.now(),
    );
    let ready = status
        .conditions
        .first()
        .is_some_and(|c| c.status == "True");
    write_status(object, &previous_conditions, status, ctx).await?;
    reconciled(ctx, object);
    ctx.metrics.count(kind_label(&kind), "ok");
    Ok(ready)
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
        network_policy,
    } = prepared;
    let mut deployments = Vec::new();
    let url = workloads.first().map(Workload::url).unwrap_or_default();
    for workload in &workloads {
        apply(client, &config_map::config_map(workload)).await?;
        apply(client, &service::service(workload)).await?;
        deployments.push(apply(client, &deployment::deployment(workload)).await?);
        apply(client, &pdb::pdb(workload)).await?;
    }
    if let Some(policy) = network_policy {
        apply(client, &policy).await?;
    }
    Ok(Applied { deployments, url })
}

/// The status of a workload kind from its applied Deployments (pure).
pub fn workload_status(
    generation: Option<i64>,
    previous: &[crate::crd::Condition],
    applied: &Applied,
    now: &str,
) -> WorkloadStatus {
    let Applied { deployments, url } = applied;
    let rollouts: Vec<Rollout> = deployments.iter().map(rollout).collect();
    let (ready_total, desired_total) =
        deployments
            .iter()
            .zip(&rollouts)
            .fold((0, 0), |(ready, desired), (d, r)| {
                let want = d.spec.as_ref().and_then(|s| s.replicas).unwrap_or(1);
                let have = match r {
                    Rollout::Available { ready } | Rollout::RollingOut { ready, .. } => *ready,
                    Rollout::Stuck { .. } => 0,
                };
                (ready + have, desired + want)
            });
    let conditions = if let Some(Rollout::Stuck { message }) =
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
    };
    WorkloadStatus {
        observed_generation: generation,
        conditions: conditions.render(previous, generation, now),
        ready_replicas: Some(ready_total),
        summary: Some(format!("{ready_total}/{desired_total}")),
        url: Some(url.clone()),
    }
}

/// Writes the status, then publishes an Event if Ready changed (only on transitions).
async fn write_status<K>(
    object: &K,
    previous: &[crate::crd::Condition],
    status: WorkloadStatus,
    ctx: &Context,
) -> Result<()>
where
    K: Resource<DynamicType = (), Scope = k8s_openapi::NamespaceResourceScope>
        + serde::de::DeserializeOwned
        + Clone
        + std::fmt::Debug,
{
    apply_status(&ctx.client, object, &status).await?;
    let before = ready_of(previous);
    let after = ready_of(&status.conditions);
    if before != after
        && let Some(ready) = status.conditions.first()
    {
        let type_ = if status
            .conditions
            .iter()
            .any(|c| c.type_ == "Degraded" && c.status == "True")
        {
            EventType::Warning
        } else {
            EventType::Normal
        };
        let reason = if ready.status == "True" {
            "Ready"
        } else {
            ready.reason.as_str()
        };
        publish(ctx, object, type_, reason, ready.message.clone()).await;
    }
    Ok(())
}

/// Mirrors a ready LockServer's held locks into Lock objects and removes the Locks of released
/// keys. A lock server that does not answer leaves the mirror as it is (it is a view only).
pub async fn mirror_locks(object: &LockServer, ctx: &Context) {
    if let Err(error) = try_mirror_locks(object, ctx).await {
        tracing::warn!(event = "lock_mirror_failed", lock_server = %object.name_any(), error = %error);
    }
}

async fn try_mirror_locks(object: &LockServer, ctx: &Context) -> Result<()> {
    let namespace = object.namespace().unwrap_or_default();
    let name = object.name_any();
    let Some(owner) = object.controller_owner_ref(&()) else {
        return Ok(());
    };
    let url = crate::workload::service_url(&name, &namespace);
    let held = ctx.services.held_locks(&url).await?;
    let mut keep = std::collections::BTreeSet::new();
    for grant in &held {
        let mirrored = lock::mirrored_lock(&name, &namespace, grant, &owner);
        keep.insert(mirrored.name_any());
        let applied = apply(&ctx.client, &mirrored).await?;
        let previous = applied.status.clone().unwrap_or_default();
        let status = LockStatus {
            observed_generation: applied.metadata.generation,
            holder: Some(grant.owner_id.clone()),
            token: Some(grant.fencing_token),
            acquired_at: Some(grant.acquired_at.clone()),
            expires_at: Some(grant.expires_at.clone()),
            conditions: Conditions::ready("held").render(
                &previous.conditions,
                applied.metadata.generation,
                &ctx.now(),
            ),
            revocation: previous.revocation,
        };
        if applied.status.as_ref() != Some(&status) {
            apply_status(&ctx.client, &applied, &status).await?;
        }
    }
    let api: Api<crate::crd::Lock> = Api::namespaced(ctx.client.clone(), &namespace);
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
        if is_paused(stale) {
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
