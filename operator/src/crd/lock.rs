//! Lock (the read-only mirror of a held lock) and LockRevocation (a revocation for GitOps).

use kube::{CustomResource, KubeSchema};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::Reported;

/// A held lock, mirrored read-only from a lock server for `kubectl get locks`.
/// `kubectl annotate lock NAME dlock.io/revoke-reason=… dlock.io/revoked-by=…` force-revokes
/// whoever holds the key when the operator handles it (its live grant at the lock server, not
/// the token mirrored here).
#[serde_with::skip_serializing_none]
#[derive(CustomResource, KubeSchema, Clone, Debug, PartialEq, Serialize, Deserialize)]
#[kube(
    group = "dlock.io",
    version = "v1alpha1",
    kind = "Lock",
    namespaced,
    status = "LockStatus",
    shortname = "lk",
    category = "dlock",
    printcolumn(name = "Key", type_ = "string", json_path = ".spec.key"),
    printcolumn(name = "Holder", type_ = "string", json_path = ".status.holder"),
    printcolumn(name = "Token", type_ = "integer", json_path = ".status.token"),
    // `type: date` renders an age, which kubectl prints as `<invalid>` for every future time:
    // the expiry is shown as the RFC 3339 timestamp it is.
    printcolumn(name = "Expires", type_ = "string", json_path = ".status.expiresAt"),
    printcolumn(name = "Ready", type_ = "string", json_path = ".status.conditions[?(@.type==\"Ready\")].status", priority = 1),
    printcolumn(name = "Revocation", type_ = "string", json_path = ".status.revocation.summary", priority = 1),
    printcolumn(name = "Age", type_ = "date", json_path = ".metadata.creationTimestamp")
)]
#[serde(rename_all = "camelCase")]
pub struct LockSpec {
    /// The lock key on the lock server.
    #[schemars(pattern(dlock_contract::lock::KEY_PATTERN), length(min = 1, max = dlock_contract::lock::KEY_LEN_MAX))]
    pub key: String,
    /// The LockServer that holds it.
    #[schemars(pattern(crate::workload::SERVICE_NAME_PATTERN), length(min = 1, max = crate::workload::SERVICE_NAME_LEN_MAX))]
    pub lock_server: String,
    /// The account whose enforcement points a revocation fences (docs/design.md#d-3).
    #[schemars(pattern(dlock_contract::payment::ACCOUNT_ID_PATTERN), length(min = 1, max = dlock_contract::payment::ACCOUNT_ID_LEN_MAX))]
    pub account_id: String,
}

#[serde_with::skip_serializing_none]
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct LockStatus {
    // `observedGeneration` and `conditions`, what every kind reports.
    #[serde(flatten)]
    pub reported: Reported,
    pub holder: Option<String>,
    pub token: Option<i64>,
    pub acquired_at: Option<String>,
    pub expires_at: Option<String>,
    /// The last revocation, keyed by the annotation value that asked for it.
    pub revocation: Option<RevocationResult>,
}

/// What a revocation did (docs/design.md#d-3): the grant ended, the floor and whether it reached
/// both fences.
#[serde_with::skip_serializing_none]
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RevocationResult {
    /// `reason|revokedBy`: the request this result answers; the flow runs once per value.
    pub request: String,
    /// `Complete` (both fences reached), `Incomplete` (retried), `OutcomeUnknown` (L8's answer
    /// was lost and the key could not be read; the next run reads it before anything else) or
    /// `Refused` (waits for a new request).
    pub outcome: String,
    pub revocation_id: Option<String>,
    pub revoked_token: Option<i64>,
    pub new_token_floor: Option<i64>,
    pub payment_fenced: bool,
    pub rail_fenced: bool,
    pub summary: Option<String>,
}

// ---------------------------------------------------------------------------------------------
// LockRevocation

/// A forced revocation as a declarative resource, for GitOps. The spec is immutable.
#[serde_with::skip_serializing_none]
#[derive(CustomResource, KubeSchema, Clone, Debug, PartialEq, Serialize, Deserialize)]
#[kube(
    group = "dlock.io",
    version = "v1alpha1",
    kind = "LockRevocation",
    namespaced,
    status = "LockRevocationStatus",
    shortname = "lrev",
    category = "dlock",
    validation = Rule::new("!has(oldSelf.spec) || self.spec == oldSelf.spec")
        .message("a LockRevocation is immutable; create a new one"),
    printcolumn(name = "Ready", type_ = "string", json_path = ".status.conditions[?(@.type==\"Ready\")].status"),
    printcolumn(name = "Key", type_ = "string", json_path = ".spec.key"),
    printcolumn(name = "Floor", type_ = "integer", json_path = ".status.result.newTokenFloor"),
    printcolumn(name = "Summary", type_ = "string", json_path = ".status.result.summary"),
    printcolumn(name = "Age", type_ = "date", json_path = ".metadata.creationTimestamp")
)]
#[serde(rename_all = "camelCase")]
pub struct LockRevocationSpec {
    /// The lock key to revoke (1 to 128 of `[a-zA-Z0-9:._-]`).
    #[schemars(pattern(dlock_contract::lock::KEY_PATTERN), length(min = 1, max = dlock_contract::lock::KEY_LEN_MAX))]
    pub key: String,
    /// The account whose account fence and rail mark are advanced (1 to 64 of
    /// `[a-zA-Z0-9:._-]`).
    #[schemars(pattern(dlock_contract::payment::ACCOUNT_ID_PATTERN), length(min = 1, max = dlock_contract::payment::ACCOUNT_ID_LEN_MAX))]
    pub account_id: String,
    /// Why: 8 to 1024 characters once surrounding spaces are trimmed (L8).
    #[schemars(length(min = dlock_contract::lock::REVOKE_REASON_LEN_MIN, max = dlock_contract::lock::REVOKE_REASON_LEN_MAX))]
    #[x_kube(validation = Rule::new(trimmed_at_least(dlock_contract::lock::REVOKE_REASON_LEN_MIN)).message(Message::Message(format!("must be {} to {} characters once trimmed", dlock_contract::lock::REVOKE_REASON_LEN_MIN, dlock_contract::lock::REVOKE_REASON_LEN_MAX))))]
    pub reason: String,
    /// Who decided: 1 to 128 characters once trimmed (L8's `operator`).
    #[schemars(length(min = 1, max = dlock_contract::payment::OPERATOR_LEN_MAX))]
    #[x_kube(validation = Rule::new(trimmed_at_least(1)).message(Message::Message(format!("must be 1 to {} characters once trimmed", dlock_contract::payment::OPERATOR_LEN_MAX))))]
    pub revoked_by: String,
    /// Revoke only the grant with this fencing token (L8's `expectedToken`); the lock server
    /// refuses when another grant holds the key.
    #[schemars(range(min = 1))]
    pub expected_token: Option<i64>,
    /// The LockServer; defaults to the only one in the namespace.
    #[schemars(pattern(crate::workload::SERVICE_NAME_PATTERN), length(min = 1, max = crate::workload::SERVICE_NAME_LEN_MAX))]
    pub lock_server: Option<String>,
    /// The PaymentResource whose account fence is advanced; defaults to the only one in the
    /// namespace (with none or several the revocation is refused).
    #[schemars(pattern(crate::workload::SERVICE_NAME_PATTERN), length(min = 1, max = crate::workload::SERVICE_NAME_LEN_MAX))]
    pub payment_resource: Option<String>,
    /// The RailProxy whose high-water mark is advanced; defaults to the only one in the
    /// namespace (with none or several the revocation is refused).
    #[schemars(pattern(crate::workload::SERVICE_NAME_PATTERN), length(min = 1, max = crate::workload::SERVICE_NAME_LEN_MAX))]
    pub rail_proxy: Option<String>,
}

/// The CEL rule of a text that must keep `min` characters once trimmed, as L8 counts them
/// (`str::trim` and CEL's `trim()` both drop Unicode white space).
pub fn trimmed_at_least(min: usize) -> String {
    format!("self.trim().size() >= {min}")
}

#[serde_with::skip_serializing_none]
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct LockRevocationStatus {
    // `observedGeneration` and `conditions`, what every kind reports.
    #[serde(flatten)]
    pub reported: Reported,
    pub result: Option<RevocationResult>,
}
