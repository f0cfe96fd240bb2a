//! PayoutBatch: a batch of payouts, run by executor Job(s).

use std::collections::BTreeMap;

use kube::{CustomResource, KubeSchema};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::{PayoutItem, PodOptions, Reported, SecretKeyRef};

/// A batch of payouts, run by executor Job(s). Its payout ids and idempotency keys come from the
/// batch name and each item's key, so re-applying or re-creating it never pays twice.
#[serde_with::skip_serializing_none]
#[derive(CustomResource, KubeSchema, Clone, Debug, PartialEq, Serialize, Deserialize)]
#[kube(
    group = "dlock.io",
    version = "v1alpha1",
    kind = "PayoutBatch",
    namespaced,
    status = "PayoutBatchStatus",
    shortname = "pb",
    category = "dlock",
    validation = Rule::new("!has(oldSelf.status) || !has(oldSelf.status.accepted) || !oldSelf.status.accepted || self.spec.payouts == oldSelf.spec.payouts")
        .message("spec.payouts cannot change once the batch is accepted; create a new batch"),
    // The contract's batch name (payout ids derive from it): a DNS name, as every name is
    // here, of at most NAME_LEN_MAX characters.
    validation = Rule::new(name_rule()).message(Message::Message(format!(
        "metadata.name must be at most {} characters: payout ids derive from it",
        dlock_contract::payout_batch::NAME_LEN_MAX
    ))),
    printcolumn(name = "Ready", type_ = "string", json_path = ".status.conditions[?(@.type==\"Ready\")].status"),
    printcolumn(name = "Payouts", type_ = "string", json_path = ".status.summary"),
    printcolumn(name = "Ambiguous", type_ = "integer", json_path = ".status.ambiguousCount"),
    printcolumn(name = "Age", type_ = "date", json_path = ".metadata.creationTimestamp")
)]
#[serde(rename_all = "camelCase")]
pub struct PayoutBatchSpec {
    /// Concurrent workers of the executor.
    #[schemars(range(min = 1, max = dlock_contract::payout_batch::WORKERS_MAX))]
    pub workers: Option<i32>,
    /// The executor sends each step's concurrent calls (acquire, claim, submit, post, release)
    /// as batch requests of up to this many items, 32 when absent; 1 sends one request per payout
    /// per step.
    #[schemars(range(min = 1, max = dlock_contract::payout_batch::BATCH_MAX_MAX))]
    pub batch_max: Option<i32>,
    /// At most 500, a limit that holds for any valid item: the largest item (two 128-character
    /// strings, a 64-character account id and a 16-digit amount) is about 415 bytes of JSON, so
    /// 500 of them stay under the 256 KiB that client-side `kubectl apply` may keep in its
    /// last-applied annotation, and the manifest ConfigMap stays far under its 1 MiB. Larger runs
    /// are several batches.
    #[schemars(length(min = 1, max = 500))]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["key"]))]
    pub payouts: Vec<PayoutItem>,
    /// The LockServer, PaymentResource and RailProxy to use; each defaults to the only one of its
    /// kind in the namespace's conventional name (`lock-server`, `payment-resource`, `rail-proxy`).
    #[schemars(pattern(crate::workload::SERVICE_NAME_PATTERN), length(min = 1, max = crate::workload::SERVICE_NAME_LEN_MAX))]
    pub lock_server: Option<String>,
    #[schemars(pattern(crate::workload::SERVICE_NAME_PATTERN), length(min = 1, max = crate::workload::SERVICE_NAME_LEN_MAX))]
    pub payment_resource: Option<String>,
    #[schemars(pattern(crate::workload::SERVICE_NAME_PATTERN), length(min = 1, max = crate::workload::SERVICE_NAME_LEN_MAX))]
    pub rail_proxy: Option<String>,
    pub image: Option<String>,
    /// How the executor authenticates to the services. Absent: a projected service-account
    /// token of the `default` service account (audience `dlock`).
    pub executor: Option<ExecutorSpec>,
    // The main container's resources and the image pull Secrets.
    #[serde(flatten)]
    pub pod: PodOptions,
}

/// The CEL rule of a batch name's length, the contract's [`dlock_contract::payout_batch::NAME_LEN_MAX`]
/// (the API server already holds a name to a DNS subdomain, whose alphabet is the contract's).
pub fn name_rule() -> String {
    format!(
        "size(self.metadata.name) <= {}",
        dlock_contract::payout_batch::NAME_LEN_MAX
    )
}

/// The executor's credential. `dlock run -f` ignores this section.
#[serde_with::skip_serializing_none]
#[derive(KubeSchema, Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("!has(self.credentialSecret) || has(self.identity)").message("spec.executor.credentialSecret needs spec.executor.identity, the identity its token authenticates as"))]
pub struct ExecutorSpec {
    /// The identity the credential authenticates as; the workers' `X-Owner-Id` is
    /// `<identity>/<batch>`. Without `credentialSecret` it is the service account's
    /// (`system:serviceaccount:<namespace>:<serviceAccountName>`).
    #[schemars(
        pattern(dlock_contract::headers::OWNER_ID_PATTERN),
        length(min = 1, max = dlock_contract::headers::OWNER_ID_LEN_MAX)
    )]
    pub identity: Option<String>,
    /// A Secret key holding the bearer token (services with `auth.mode = "tokens"`), one the
    /// PaymentResource lists in `spec.executorCredentialSecrets`. Absent: a projected
    /// service-account token with audience `dlock` (`auth.mode = "tokenreview"`).
    pub credential_secret: Option<SecretKeyRef>,
    /// The executor pod's service account: `dlock-executor` (made by the operator) when absent;
    /// any other only when the PaymentResource lists it in `spec.executorServiceAccounts`.
    #[schemars(length(min = 1, max = 253))]
    pub service_account_name: Option<String>,
}

#[serde_with::skip_serializing_none]
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PayoutBatchStatus {
    // `observedGeneration` and `conditions`, what every kind reports.
    #[serde(flatten)]
    pub reported: Reported,
    /// Set once the executor Job exists; from then on `spec.payouts` is immutable.
    pub accepted: Option<bool>,
    /// Payouts per state, from paydb.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub counts: BTreeMap<String, i64>,
    /// Payout ids in RAIL_AMBIGUOUS, for an operator to resolve.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ambiguous: Vec<String>,
    pub ambiguous_count: Option<i64>,
    pub fenced_out: Option<i64>,
    pub job_name: Option<String>,
    pub summary: Option<String>,
}
