//! Reconciliation: the reconciler run once, or on a schedule.

use kube::{CustomResource, KubeSchema};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::{PodOptions, Reported, SecretKeyRef};

/// Runs the reconciler (paydb, ledger and rail statement compared) once, or on a schedule.
#[serde_with::skip_serializing_none]
#[derive(CustomResource, KubeSchema, Clone, Debug, PartialEq, Serialize, Deserialize)]
#[kube(
    group = "dlock.io",
    version = "v1alpha1",
    kind = "Reconciliation",
    namespaced,
    status = "ReconciliationStatus",
    shortname = "recon",
    category = "dlock",
    printcolumn(
        name = "Ready",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"Ready\")].status"
    ),
    printcolumn(name = "Schedule", type_ = "string", json_path = ".spec.schedule"),
    printcolumn(name = "Findings", type_ = "string", json_path = ".status.summary"),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(rename_all = "camelCase")]
pub struct ReconciliationSpec {
    /// paydb (the payouts, the ledger and the rail proxy's intents).
    pub database_url_secret: SecretKeyRef,
    /// The rail whose statement is compared; defaults to the stub of `railProxy`.
    pub rail_url: Option<String>,
    /// A cron schedule; absent runs once.
    pub schedule: Option<String>,
    /// The RailProxy whose stub is the rail when `railUrl` is absent (default `rail-proxy`).
    #[schemars(pattern(crate::workload::SERVICE_NAME_PATTERN), length(min = 1, max = crate::workload::SERVICE_NAME_LEN_MAX))]
    pub rail_proxy: Option<String>,
    pub image: Option<String>,
    // The main container's resources and the image pull Secrets.
    #[serde(flatten)]
    pub pod: PodOptions,
}

#[serde_with::skip_serializing_none]
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ReconciliationStatus {
    // `observedGeneration` and `conditions`, what every kind reports.
    #[serde(flatten)]
    pub reported: Reported,
    pub last_run_job: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub findings: Vec<String>,
    pub summary: Option<String>,
}
