//! Reconciliation: the reconciler run once, or on a schedule.

use super::{PodOptions, SecretKeyRef};

dlock_kind! {
    kind: "Reconciliation", status: "ReconciliationStatus", shortname: "recon",
    columns: [
        Ready,
        ("Schedule", "string", ".spec.schedule"),
        ("Findings", "string", ".status.summary"),
    ],
    /// Runs the reconciler (paydb, ledger and rail statement compared) once, or on a schedule.
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
}

kind_status! {
    pub struct ReconciliationStatus {
        pub last_run_job: Option<String>,
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        pub findings: Vec<String>,
        pub summary: Option<String>,
    }
}
