//! The custom resources of `dlock.io/v1alpha1` (docs/design.md#kubernetes).
//!
//! Every kind is namespaced, has a status subresource with `conditions` and
//! `observedGeneration` (a [`Reported`] flattened into each kind's status), a short name and
//! printer columns. No field has a schema default: an API-server-defaulted field would show in
//! Argo CD as drift, so defaults are resolved by the operator's validate step instead.
//!
//! One file per kind (the three services share [`workloads`]); the types every kind uses are here.

// `printcolumn(name = …, type_ = …)` repeats argument names across columns, which clippy's
// duplicated-attributes lint mistakes for repeated attributes.
#![allow(clippy::duplicated_attributes)]

use k8s_openapi::api::core::v1::{LocalObjectReference, ResourceRequirements};
use kube::CustomResourceExt;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// One payout of a batch: the contract's type, so the CRD, the operator's manifest and
/// `dlock run -f` read the same item.
pub use dlock_contract::payout_batch::PayoutItem;

mod lock;
mod payout_batch;
mod reconciliation;
mod workloads;

pub use lock::{
    Lock, LockRevocation, LockRevocationSpec, LockRevocationStatus, LockSpec, LockStatus,
    RevocationResult, trimmed_at_least,
};
pub use payout_batch::{ExecutorSpec, PayoutBatch, PayoutBatchSpec, PayoutBatchStatus, name_rule};
pub use reconciliation::{Reconciliation, ReconciliationSpec, ReconciliationStatus};
pub use workloads::{
    BackendType, EtcdAuth, EtcdBackend, LockBackend, LockServer, LockServerSpec, PaymentResource,
    PaymentResourceSpec, PgBackend, RailProxy, RailProxySpec, RailStubSpec, ServiceSettings,
    TreasurySpec,
};

pub const GROUP: &str = "dlock.io";
pub const VERSION: &str = "v1alpha1";

/// A reference to one key of a Secret in the object's namespace.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SecretKeyRef {
    pub name: String,
    pub key: String,
}

/// The optional Cloud SQL Auth Proxy sidecar: the database URL in the Secret then points at
/// `127.0.0.1:5432`.
#[serde_with::skip_serializing_none]
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct CloudSql {
    /// `project:region:instance`.
    #[schemars(regex(pattern = r"^[^:]+:[^:]+:[^:]+$"))]
    pub instance_connection_name: String,
    /// The proxy image; the operator's default when absent.
    pub image: Option<String>,
}

/// What a pod-running spec says about its pods (flattened into it): the main container's
/// requests and limits, and the image pull Secrets.
#[serde_with::skip_serializing_none]
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PodOptions {
    /// Requests and limits of the main container; the operator's defaults when absent.
    pub resources: Option<ResourceRequirements>,
    /// Secrets for pulling the image (`[{name: regcred}]`).
    pub image_pull_secrets: Option<Vec<LocalObjectReference>>,
}

/// How a service checks its callers (`auth.mode`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum AuthMode {
    /// Projected service-account tokens (audience `dlock`), checked with TokenReview.
    #[default]
    #[serde(rename = "tokenreview")]
    TokenReview,
    /// No check: any pod that reaches the service may create, fund, claim, post, submit and
    /// revoke. The operator raises `AuthenticationDisabled=True` and a Warning Event.
    #[serde(rename = "none")]
    None,
}

/// `spec.auth`: authentication is on unless turned off here, explicitly.
#[serde_with::skip_serializing_none]
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ServiceAuth {
    /// `tokenreview` when absent.
    pub mode: Option<AuthMode>,
    /// ServiceAccounts of this namespace whose projected tokens may open and fund accounts at a
    /// PaymentResource (the treasury role: creating money). None when absent: under TokenReview
    /// every caller is a ServiceAccount, and no executor, operator or other tenant may fund.
    #[schemars(length(max = 8), inner(pattern(crate::workload::SERVICE_NAME_PATTERN), length(min = 1, max = crate::workload::SERVICE_NAME_LEN_MAX)))]
    pub treasury_service_accounts: Option<Vec<String>>,
}

/// One status condition (`Ready`, `Progressing`, `Degraded`).
#[serde_with::skip_serializing_none]
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Condition {
    #[serde(rename = "type")]
    pub type_: String,
    /// `True`, `False` or `Unknown`.
    pub status: String,
    pub reason: String,
    #[serde(default)]
    pub message: String,
    /// RFC 3339; changes only when `status` changes.
    pub last_transition_time: Option<String>,
    pub observed_generation: Option<i64>,
}

// What every kind's status reports, flattened into it: the generation the status describes and
// the conditions (`Ready`, `Progressing`, `Degraded` and any of the kind's own). A comment, not a
// doc comment: schemars would make a doc the description of every status without one of its own.
#[serde_with::skip_serializing_none]
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Reported {
    pub observed_generation: Option<i64>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
}

impl Reported {
    pub fn new(observed_generation: Option<i64>, conditions: Vec<Condition>) -> Self {
        Self {
            observed_generation,
            conditions,
        }
    }

    /// The condition of this type, if there is one.
    pub fn find(&self, type_: &str) -> Option<&Condition> {
        self.conditions.iter().find(|c| c.type_ == type_)
    }
}

/// The status every workload kind (LockServer, PaymentResource, RailProxy) reports.
#[serde_with::skip_serializing_none]
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct WorkloadStatus {
    // `observedGeneration` and `conditions`, what every kind reports.
    #[serde(flatten)]
    pub reported: Reported,
    /// Ready replicas of the main Deployment.
    pub ready_replicas: Option<i32>,
    /// `ready/desired`, for `kubectl get`.
    pub summary: Option<String>,
    /// The in-cluster URL of the Service.
    pub url: Option<String>,
}

/// Every CRD with the file name `dlock crdgen` writes it under.
pub fn all() -> Vec<(
    &'static str,
    k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition,
)> {
    vec![
        ("lockservers", LockServer::crd()),
        ("paymentresources", PaymentResource::crd()),
        ("railproxies", RailProxy::crd()),
        ("payoutbatches", PayoutBatch::crd()),
        ("locks", Lock::crd()),
        ("lockrevocations", LockRevocation::crd()),
        ("reconciliations", Reconciliation::crd()),
    ]
}

/// Writes `<dir>/<plural>.yaml` for every CRD.
pub fn write_all(dir: &std::path::Path) -> anyhow::Result<Vec<std::path::PathBuf>> {
    use anyhow::Context as _;
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let mut written = Vec::new();
    for (plural, crd) in all() {
        let path = dir.join(format!("{plural}.yaml"));
        let text = format!(
            "# Generated by `dlock crdgen`; do not edit.\n{}",
            serde_yaml_ng::to_string(&crd)?
        );
        std::fs::write(&path, text).with_context(|| format!("writing {}", path.display()))?;
        written.push(path);
    }
    Ok(written)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `observedGeneration` and `conditions` stay top-level status fields: a status reads and
    /// writes as it did before they were one flattened [`Reported`], and a status without them
    /// (the Lock mirror's apply) still leaves them out, so it never claims them.
    #[test]
    fn a_status_reads_and_writes_its_generation_and_conditions_at_the_top_level() {
        let json = serde_json::json!({
            "observedGeneration": 3,
            "conditions": [{"type": "Ready", "status": "True", "reason": "Available", "message": ""}],
            "holder": "executor/w1",
        });
        let status: LockStatus =
            serde_json::from_value(json.clone()).unwrap_or_else(|e| panic!("read: {e}"));
        assert_eq!(status.reported.observed_generation, Some(3));
        assert_eq!(
            status.reported.find("Ready").map(|c| c.reason.as_str()),
            Some("Available")
        );
        assert_eq!(status.reported.find("Degraded"), None);
        assert_eq!(status.holder.as_deref(), Some("executor/w1"));
        let written = serde_json::to_value(&status).unwrap_or_else(|e| panic!("write: {e}"));
        assert_eq!(written, json);
        let mirror = LockStatus {
            holder: Some("executor/w1".to_owned()),
            ..LockStatus::default()
        };
        assert_eq!(
            serde_json::to_value(&mirror).unwrap_or_else(|e| panic!("write: {e}")),
            serde_json::json!({"holder": "executor/w1"})
        );
    }
}
