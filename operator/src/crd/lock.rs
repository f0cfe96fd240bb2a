//! Lock (the read-only mirror of a held lock) and LockRevocation (a revocation for GitOps).

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

dlock_kind! {
    kind: "Lock", status: "LockStatus", shortname: "lk",
    columns: [
        ("Key", "string", ".spec.key"),
        ("Holder", "string", ".status.holder"),
        ("Token", "integer", ".status.token"),
        // `type: date` renders an age, which kubectl prints as `<invalid>` for every future time:
        // the expiry is shown as the RFC 3339 timestamp it is.
        ("Expires", "string", ".status.expiresAt"),
        Ready(priority = 1),
        ("Revocation", "string", ".status.revocation.summary", priority = 1),
    ],
    /// A held lock, mirrored read-only from a lock server for `kubectl get locks`.
    /// `kubectl annotate lock NAME dlock.io/revoke-reason=… dlock.io/revoked-by=…` force-revokes
    /// whoever holds the key when the operator handles it (its live grant at the lock server, not
    /// the token mirrored here).
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
}

kind_status! {
    pub struct LockStatus {
        pub holder: Option<String>,
        pub token: Option<i64>,
        pub acquired_at: Option<String>,
        pub expires_at: Option<String>,
        /// The last revocation, keyed by the annotation value that asked for it.
        pub revocation: Option<RevocationResult>,
    }
}

/// What a revocation did (docs/design.md#d-3): the grant ended, the floor and whether it reached
/// both fences.
#[serde_with::skip_serializing_none]
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RevocationResult {
    /// `reason|revokedBy`: the request this result answers; the flow runs once per value.
    pub request: String,
    /// `Complete` (both fences reached), `Incomplete` (retried) or `Refused` (waits for a new
    /// request).
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

dlock_kind! {
    kind: "LockRevocation", status: "LockRevocationStatus", shortname: "lrev",
    validation: [
        Rule::new("!has(oldSelf.spec) || self.spec == oldSelf.spec")
            .message("a LockRevocation is immutable; create a new one")
    ],
    columns: [
        Ready,
        ("Key", "string", ".spec.key"),
        ("Floor", "integer", ".status.result.newTokenFloor"),
        ("Summary", "string", ".status.result.summary"),
    ],
    /// A forced revocation as a declarative resource, for GitOps. The spec is immutable.
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
}

/// The CEL rule of a text that must keep `min` characters once trimmed, as L8 counts them
/// (`str::trim` and CEL's `trim()` both drop Unicode white space).
pub fn trimmed_at_least(min: usize) -> String {
    format!("self.trim().size() >= {min}")
}

kind_status! {
    pub struct LockRevocationStatus {
        pub result: Option<RevocationResult>,
    }
}
