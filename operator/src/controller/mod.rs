//! The controllers: one reconcile pipeline per kind, validate → build → apply → status.
//!
//! Call sites show which steps need the API: `validate` and `build` are pure; `apply` and the
//! status write take the client.

pub mod lock;
pub mod payout_batch;
pub mod reconciliation;
pub mod revoke;
pub mod status;
pub mod workloads;

use std::collections::HashMap;
use std::fmt::Debug;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use k8s_openapi::NamespaceResourceScope;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::controller::Action;
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::{Client, Resource, ResourceExt};
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::crd::Condition;
use crate::metrics::Metrics;
use crate::services::{ServiceError, Services};
use crate::validate::{Invalid, Settings};
use crate::workload::{FIELD_MANAGER, PAUSED_ANNOTATION, PAUSED_VALUE};

/// The reporter of every Event the operator publishes.
pub const REPORTER: &str = "dlock-operator";
/// The first retry of a transient error; doubles per consecutive failure.
pub const BACKOFF_FIRST: Duration = Duration::from_secs(5);
pub const BACKOFF_MAX: Duration = Duration::from_secs(300);
/// How often a healthy object is looked at again even without a watch event.
pub const RESYNC: Duration = Duration::from_secs(300);

/// What every reconcile shares.
pub struct Context {
    pub client: Client,
    pub recorder: Recorder,
    pub services: Arc<dyn Services>,
    pub settings: Settings,
    pub metrics: Arc<Metrics>,
    /// RFC 3339 now; tests pin it.
    pub clock: Box<dyn Fn() -> String + Send + Sync>,
    /// Consecutive failures per object, for the back-off of transient errors.
    failures: Mutex<HashMap<String, u32>>,
}

impl Context {
    pub fn new(
        client: Client,
        services: Arc<dyn Services>,
        settings: Settings,
        metrics: Arc<Metrics>,
        clock: Box<dyn Fn() -> String + Send + Sync>,
    ) -> Self {
        let recorder = Recorder::new(
            client.clone(),
            Reporter {
                controller: REPORTER.to_owned(),
                instance: std::env::var("POD_NAME").ok(),
            },
        );
        Self {
            client,
            recorder,
            services,
            settings,
            metrics,
            clock,
            failures: Mutex::new(HashMap::new()),
        }
    }

    pub fn now(&self) -> String {
        (self.clock)()
    }

    fn failed(&self, key: &str) -> u32 {
        let mut failures = self.failures.lock().unwrap_or_else(|e| e.into_inner());
        let count = failures.entry(key.to_owned()).or_insert(0);
        *count = count.saturating_add(1);
        *count
    }

    fn succeeded(&self, key: &str) {
        let mut failures = self.failures.lock().unwrap_or_else(|e| e.into_inner());
        failures.remove(key);
    }
}

/// The real clock.
pub fn system_clock() -> Box<dyn Fn() -> String + Send + Sync> {
    Box::new(|| chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Secs, true))
}

/// One variant per step, so an error says where it happened.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("the object could not be read: {0}")]
    Malformed(String),
    #[error("invalid spec: {0}")]
    Invalid(#[from] Invalid),
    #[error("applying {kind} {name}: {source}")]
    Apply {
        kind: &'static str,
        name: String,
        source: kube::Error,
    },
    #[error("writing status: {0}")]
    Status(kube::Error),
    #[error("reading {what}: {source}")]
    Read {
        what: &'static str,
        source: kube::Error,
    },
    #[error("{0}")]
    Service(#[from] ServiceError),
    #[error("finalizer: {0}")]
    Finalizer(String),
    #[error("the fencing-proof keys Secret of namespace {namespace}: {message}")]
    ProofKeys { namespace: String, message: String },
}

impl Error {
    /// Permanent errors wait for the object to change; the rest back off and retry.
    pub fn is_permanent(&self) -> bool {
        matches!(
            self,
            Error::Malformed(_) | Error::Invalid(_) | Error::Service(ServiceError::Refused { .. })
        )
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// The error policy of every controller.
pub fn error_policy<K: Resource>(object: Arc<K>, error: &Error, ctx: Arc<Context>) -> Action {
    let key = object_key(object.as_ref());
    if error.is_permanent() {
        tracing::warn!(event = "reconcile_failed_permanently", object = %key, error = %error);
        return Action::await_change();
    }
    let failures = ctx.failed(&key);
    let delay = BACKOFF_FIRST
        .saturating_mul(2u32.saturating_pow(failures.saturating_sub(1).min(16)))
        .min(BACKOFF_MAX);
    tracing::warn!(event = "reconcile_failed", object = %key, error = %error, retry_in_s = delay.as_secs());
    Action::requeue(delay)
}

pub fn object_key<K: Resource>(object: &K) -> String {
    format!(
        "{}/{}",
        object.meta().namespace.as_deref().unwrap_or(""),
        object.meta().name.as_deref().unwrap_or("")
    )
}

/// Call after a successful reconcile: resets the object's back-off.
pub fn reconciled<K: Resource>(ctx: &Context, object: &K) {
    ctx.succeeded(&object_key(object));
}

/// What a reconcile of a paused object does: nothing, counted as `paused` under `kind`, until
/// the object changes. `None` when the object is not paused.
pub fn paused<K: Resource>(object: &K, ctx: &Context, kind: &'static str) -> Option<Action> {
    is_paused(object).then(|| {
        ctx.metrics.count(kind, "paused");
        Action::await_change()
    })
}

/// Whether `dlock.io/reconcile: paused` is set: then the controller changes nothing.
pub fn is_paused<K: Resource>(object: &K) -> bool {
    object
        .meta()
        .annotations
        .as_ref()
        .and_then(|a| a.get(PAUSED_ANNOTATION))
        .is_some_and(|v| v == PAUSED_VALUE)
}

pub fn apply_params() -> PatchParams {
    PatchParams::apply(FIELD_MANAGER).force()
}

/// Server-side apply of a namespaced object under the operator's field manager.
pub async fn apply<T>(client: &Client, object: &T) -> Result<T>
where
    T: Resource<DynamicType = (), Scope = NamespaceResourceScope>
        + Serialize
        + DeserializeOwned
        + Clone
        + Debug,
{
    let name = object.name_any();
    let namespace = object.meta().namespace.clone().unwrap_or_default();
    let api: Api<T> = Api::namespaced(client.clone(), &namespace);
    api.patch(&name, &apply_params(), &Patch::Apply(object))
        .await
        .map_err(|source| Error::Apply {
            kind: kind_name::<T>(),
            name,
            source,
        })
}

fn kind_name<T: Resource<DynamicType = ()>>() -> &'static str {
    // Kinds are static strings in k8s-openapi and in the derived custom resources.
    match T::kind(&()).as_ref() {
        "ConfigMap" => "ConfigMap",
        "Service" => "Service",
        "Deployment" => "Deployment",
        "PodDisruptionBudget" => "PodDisruptionBudget",
        "NetworkPolicy" => "NetworkPolicy",
        "Job" => "Job",
        "Lock" => "Lock",
        "ServiceAccount" => "ServiceAccount",
        _ => "object",
    }
}

/// The field manager of the Lock mirror's status fields (`holder`, `token`, `acquiredAt`,
/// `expiresAt`). Lock status is written by two controllers from cached copies, so each applies
/// only its own fields under its own manager and neither erases the other's.
pub const LOCK_MIRROR_MANAGER: &str = "dlock-operator-lock-mirror";
/// The field manager of the Lock controller's status fields (`observedGeneration`, `conditions`,
/// `revocation`).
pub const LOCK_REVOKE_MANAGER: &str = "dlock-operator-lock-revoke";

/// A namespaced object the controllers read and write the status of.
pub trait Namespaced:
    Resource<DynamicType = (), Scope = NamespaceResourceScope> + DeserializeOwned + Clone + Debug
{
}

impl<K> Namespaced for K where
    K: Resource<DynamicType = (), Scope = NamespaceResourceScope>
        + DeserializeOwned
        + Clone
        + Debug
{
}

/// Server-side apply of `status` on the status subresource.
pub async fn apply_status<K: Namespaced, S: Serialize>(
    client: &Client,
    object: &K,
    status: &S,
) -> Result<()> {
    apply_status_as(client, object, status, FIELD_MANAGER).await
}

/// Server-side apply of `status` under `manager`: the fields it sends are the fields it owns.
pub async fn apply_status_as<K: Namespaced, S: Serialize>(
    client: &Client,
    object: &K,
    status: &S,
    manager: &str,
) -> Result<()> {
    let namespace = object.meta().namespace.clone().unwrap_or_default();
    let api: Api<K> = Api::namespaced(client.clone(), &namespace);
    let patch = serde_json::json!({
        "apiVersion": K::api_version(&()),
        "kind": K::kind(&()),
        "status": status,
    });
    let params = PatchParams::apply(manager).force();
    api.patch_status(&object.name_any(), &params, &Patch::Apply(&patch))
        .await
        .map_err(Error::Status)?;
    Ok(())
}

/// The field manager of the conditions written when a reconcile fails. It sends only
/// `conditions`, so every other status field stays with its owner, and the next successful
/// reconcile takes the conditions back (its apply is forced).
pub const FAILURE_MANAGER: &str = "dlock-operator-failure";

/// The Ready/Degraded reason that names a failed step, for `kubectl describe` and Argo CD.
pub fn failure_reason(error: &Error) -> &'static str {
    match error {
        Error::Apply { .. } => "ApplyFailed",
        Error::Read { .. } => "ReadFailed",
        // paydb refuses writes until an operator runs `dlock recover paydb-epoch`
        // (docs/runbook.md): a reason of its own, as retrying alone will not clear it.
        Error::Service(ServiceError::Unavailable { message, .. })
            if message.contains(dlock_contract::ErrorCode::RecoveryRequired.as_str()) =>
        {
            "RecoveryRequired"
        }
        Error::Service(_) => "ServiceUnavailable",
        Error::Status(_) => "StatusWriteFailed",
        Error::Finalizer(_) => "FinalizerFailed",
        Error::ProofKeys { .. } => "ProofKeysFailed",
        Error::Malformed(_) | Error::Invalid(_) => "InvalidSpec",
    }
}

/// Makes an error that stopped a reconcile visible where people look, not only in the
/// operator's log: `Ready=False` and `Degraded=True` with the failed step as the reason and the
/// API server's answer as the message, and a Warning Event (repeats become one Event series).
/// Conditions of other types are kept as they were. Best effort: when the API server refuses
/// this too, the failure is logged and the back-off retries the reconcile.
pub async fn report_failure<K: Namespaced>(
    ctx: &Context,
    object: &K,
    previous: &[Condition],
    error: &Error,
) {
    let reason = failure_reason(error);
    let message = format!(
        "{error}; the operator retries with back-off (first after {} s)",
        BACKOFF_FIRST.as_secs()
    );
    let generation = object.meta().generation;
    let mut conditions = status::Conditions::degraded(reason, message.clone()).render(
        previous,
        generation,
        &ctx.now(),
    );
    conditions.extend(
        previous
            .iter()
            .filter(|c| {
                ![status::READY, status::PROGRESSING, status::DEGRADED].contains(&c.type_.as_str())
            })
            .cloned(),
    );
    let status = serde_json::json!({ "conditions": conditions });
    if let Err(write) = apply_status_as(&ctx.client, object, &status, FAILURE_MANAGER).await {
        tracing::warn!(event = "failure_condition_not_written", object = %object_key(object), error = %write);
    }
    publish(ctx, object, EventType::Warning, reason, message).await;
}

/// Publishes an Event about `object`. A failed Event is logged, never fails the reconcile.
pub async fn publish<K: Resource<DynamicType = ()>>(
    ctx: &Context,
    object: &K,
    type_: EventType,
    reason: &str,
    note: String,
) {
    let event = Event {
        type_,
        reason: reason.to_owned(),
        note: Some(note),
        action: "Reconcile".to_owned(),
        secondary: None,
    };
    if let Err(error) = ctx.recorder.publish(&event, &object.object_ref(&())).await {
        tracing::warn!(event = "event_publish_failed", error = %error);
    }
}

/// Publishes an Event when Ready changed between `previous` and `conditions` (only on
/// transitions): `Ready` when it became True, else the Ready condition's reason; a Warning while
/// Degraded is True.
pub async fn publish_ready_change<K: Resource<DynamicType = ()>>(
    ctx: &Context,
    object: &K,
    previous: &[Condition],
    conditions: &[Condition],
) {
    if status::ready_of(previous) != status::ready_of(conditions)
        && let Some(ready) = conditions.first()
    {
        let degraded = conditions
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
        publish(ctx, object, type_, reason, ready.message.clone()).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paydb_waiting_for_its_recovery_is_a_reason_of_its_own() {
        let refused = dlock_contract::client::ClientError::Api {
            status: 503,
            body: dlock_contract::error::ApiError::new(
                dlock_contract::ErrorCode::RecoveryRequired,
                "run dlock recover paydb-epoch",
            )
            .body(),
        };
        let error = Error::Service(ServiceError::from_client("payment-resource", &refused));
        assert_eq!(failure_reason(&error), "RecoveryRequired");
        assert!(!error.is_permanent(), "retried with back-off");
        assert!(
            error.to_string().contains("dlock recover paydb-epoch"),
            "{error}"
        );
        let down = Error::Service(ServiceError::Unavailable {
            service: "payment-resource",
            message: "503 NOT_LEADER: paydb cannot take writes right now".into(),
        });
        assert_eq!(failure_reason(&down), "ServiceUnavailable");
    }
}
