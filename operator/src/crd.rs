//! The custom resources of `dlock.io/v1alpha1` (DESIGN §8).
//!
//! Every kind is namespaced, has a status subresource with `conditions` and
//! `observedGeneration`, a short name and printer columns. No field has a schema default: an
//! API-server-defaulted field would show in Argo CD as drift, so defaults are resolved by the
//! operator's validate step instead.

// `printcolumn(name = …, type_ = …)` repeats argument names across columns, which clippy's
// duplicated-attributes lint mistakes for repeated attributes.
#![allow(clippy::duplicated_attributes)]

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{LocalObjectReference, ResourceRequirements};
use kube::{CustomResource, CustomResourceExt, KubeSchema};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// One payout of a batch: the contract's type, so the CRD, the operator's manifest and
/// `dlock run -f` read the same item.
pub use dlock_contract::payout_batch::PayoutItem;

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
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct CloudSql {
    /// `project:region:instance`.
    #[schemars(regex(pattern = r"^[^:]+:[^:]+:[^:]+$"))]
    pub instance_connection_name: String,
    /// The proxy image; the operator's default when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<String>,
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
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ServiceAuth {
    /// `tokenreview` when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<AuthMode>,
}

/// One status condition (`Ready`, `Progressing`, `Degraded`).
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
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_transition_time: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
}

/// The status every workload kind (LockServer, PaymentResource, RailProxy) reports.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct WorkloadStatus {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
    /// Ready replicas of the main Deployment.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ready_replicas: Option<i32>,
    /// `ready/desired`, for `kubectl get`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub summary: Option<String>,
    /// The in-cluster URL of the Service.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub url: Option<String>,
}

// ---------------------------------------------------------------------------------------------
// LockServer

/// The lock server: sessions, leases and fencing tokens on PostgreSQL or etcd.
#[derive(CustomResource, KubeSchema, Clone, Debug, PartialEq, Serialize, Deserialize)]
#[kube(
    group = "dlock.io",
    version = "v1alpha1",
    kind = "LockServer",
    namespaced,
    status = "WorkloadStatus",
    shortname = "ls",
    category = "dlock",
    printcolumn(
        name = "Ready",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"Ready\")].status"
    ),
    printcolumn(name = "Replicas", type_ = "string", json_path = ".status.summary"),
    printcolumn(name = "Backend", type_ = "string", json_path = ".spec.backend.type"),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(rename_all = "camelCase")]
pub struct LockServerSpec {
    /// Immutable: switching stores live would split the lock state in two.
    #[x_kube(validation = Rule::new("self == oldSelf").message("spec.backend is immutable: switching lock stores live would split the lock state in two; create a new LockServer instead"))]
    pub backend: LockBackend,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 16))]
    pub replicas: Option<i32>,
    /// The `dlock` image; the operator's own image when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cloud_sql: Option<CloudSql>,
    /// Requests and limits of the main container; the operator's defaults when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resources: Option<ResourceRequirements>,
    /// Secrets for pulling the image (`[{name: regcred}]`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image_pull_secrets: Option<Vec<LocalObjectReference>>,
    /// Callers' authentication; TokenReview when absent. `mode: none` must be written out.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub auth: Option<ServiceAuth>,
    /// The fencing-token proof keys (DESIGN D-8): a Secret key of `<key-id> <secret>` lines,
    /// mounted as a directory and named by `fencing.proof-keys-file`. The LockServer,
    /// PaymentResource and RailProxy of a namespace must name the same Secret.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fencing_proof_keys_secret: Option<SecretKeyRef>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum BackendType {
    Pg,
    Etcd,
}

#[derive(KubeSchema, Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("self.type == 'pg' ? has(self.pg) && !has(self.etcd) : has(self.etcd) && !has(self.pg)").message("set exactly the section that spec.backend.type names"))]
pub struct LockBackend {
    #[serde(rename = "type")]
    pub type_: BackendType,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pg: Option<PgBackend>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub etcd: Option<EtcdBackend>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PgBackend {
    /// The lockdb URL (`postgres://…`).
    pub url_secret: SecretKeyRef,
}

/// etcd is referenced, never deployed.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct EtcdBackend {
    /// Every member; all `https://` with `tlsSecret`, none without it.
    #[schemars(length(min = 1, max = 16))]
    pub endpoints: Vec<String>,
    /// TLS to etcd with a client certificate: a Secret in the `kubernetes.io/tls` layout that
    /// cert-manager writes, `ca.crt` (the CA of etcd's serving certificate), `tls.crt` and
    /// `tls.key` (the lock server's client certificate and key). Mounted read-only at
    /// `/etc/dlock/etcd-tls` and named by `lock.etcd.ca-file`, `cert-file` and `key-file`; a
    /// renewed certificate is picked up without a restart.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls_secret: Option<String>,
    /// etcd's own authentication (`lock.etcd.username`, `lock.etcd.password-file`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub auth: Option<EtcdAuth>,
}

/// An etcd user whose role grants `readwrite` on the lock server's prefix only.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct EtcdAuth {
    #[schemars(length(min = 1, max = 128))]
    pub username: String,
    /// The key holding the user's password; mounted read-only at `/etc/dlock/etcd-auth` and
    /// named by `lock.etcd.password-file` (a changed password is picked up without a restart).
    pub password_secret: SecretKeyRef,
}

// ---------------------------------------------------------------------------------------------
// PaymentResource

/// The payment resource: payouts, accounts and the ledger against paydb.
#[derive(CustomResource, Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "dlock.io",
    version = "v1alpha1",
    kind = "PaymentResource",
    namespaced,
    status = "WorkloadStatus",
    shortname = "payres",
    category = "dlock",
    printcolumn(
        name = "Ready",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"Ready\")].status"
    ),
    printcolumn(name = "Replicas", type_ = "string", json_path = ".status.summary"),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(rename_all = "camelCase")]
pub struct PaymentResourceSpec {
    /// The paydb URL.
    pub database_url_secret: SecretKeyRef,
    /// The credential of operator-only calls (fence advance, resolution).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub operator_token_secret: Option<SecretKeyRef>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 16))]
    pub replicas: Option<i32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cloud_sql: Option<CloudSql>,
    /// Requests and limits of the main container; the operator's defaults when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resources: Option<ResourceRequirements>,
    /// Secrets for pulling the image (`[{name: regcred}]`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image_pull_secrets: Option<Vec<LocalObjectReference>>,
    /// Callers' authentication; TokenReview when absent. `mode: none` must be written out.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub auth: Option<ServiceAuth>,
    /// The fencing-token proof keys (DESIGN D-8): a Secret key of `<key-id> <secret>` lines,
    /// mounted as a directory and named by `fencing.proof-keys-file`. The LockServer,
    /// PaymentResource and RailProxy of a namespace must name the same Secret.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fencing_proof_keys_secret: Option<SecretKeyRef>,
}

// ---------------------------------------------------------------------------------------------
// RailProxy

/// The rail proxy, the only caller of the rail, and optionally the rail stub behind it.
#[derive(CustomResource, KubeSchema, Clone, Debug, PartialEq, Serialize, Deserialize)]
#[kube(
    group = "dlock.io",
    version = "v1alpha1",
    kind = "RailProxy",
    namespaced,
    status = "WorkloadStatus",
    shortname = "rp",
    category = "dlock",
    printcolumn(
        name = "Ready",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"Ready\")].status"
    ),
    printcolumn(name = "Replicas", type_ = "string", json_path = ".status.summary"),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[x_kube(validation = Rule::new("has(self.railUrl) != has(self.stub)").message("set exactly one of spec.railUrl (a real rail) and spec.stub (the rail stub)"))]
#[serde(rename_all = "camelCase")]
pub struct RailProxySpec {
    /// paydb, where the high-water marks and the intents live.
    pub database_url_secret: SecretKeyRef,
    /// The rail's URL; absent when `stub` is set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rail_url: Option<String>,
    /// `rail.proxy.read-timeout-ms`; the pods' termination grace is set above it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 100, max = 120000))]
    pub read_timeout_ms: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub operator_token_secret: Option<SecretKeyRef>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 16))]
    pub replicas: Option<i32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cloud_sql: Option<CloudSql>,
    /// Requests and limits of the main container; the operator's defaults when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resources: Option<ResourceRequirements>,
    /// Secrets for pulling the image (`[{name: regcred}]`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image_pull_secrets: Option<Vec<LocalObjectReference>>,
    /// Callers' authentication; TokenReview when absent. `mode: none` must be written out.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub auth: Option<ServiceAuth>,
    /// The fencing-token proof keys (DESIGN D-8): a Secret key of `<key-id> <secret>` lines,
    /// mounted as a directory and named by `fencing.proof-keys-file`. The LockServer,
    /// PaymentResource and RailProxy of a namespace must name the same Secret.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fencing_proof_keys_secret: Option<SecretKeyRef>,
    /// Deploys the rail stub and points the proxy at it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stub: Option<RailStubSpec>,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RailStubSpec {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0, max = 600000))]
    pub latency_ms: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0.0, max = 1.0))]
    pub failure_rate: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0.0, max = 1.0))]
    pub duplicate_ack_rate: Option<f64>,
    /// Requests and limits of the stub's container; the operator's defaults when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resources: Option<ResourceRequirements>,
}

// ---------------------------------------------------------------------------------------------
// PayoutBatch

/// A batch of payouts, run by executor Job(s). Its payout ids and idempotency keys come from the
/// batch name and each item's key, so re-applying or re-creating it never pays twice.
#[derive(CustomResource, Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "dlock.io",
    version = "v1alpha1",
    kind = "PayoutBatch",
    namespaced,
    status = "PayoutBatchStatus",
    shortname = "pb",
    category = "dlock",
    validation = Rule::new("!has(oldSelf.status) || !has(oldSelf.status.accepted) || !oldSelf.status.accepted || self.spec.payouts == oldSelf.spec.payouts").message("spec.payouts cannot change once the batch is accepted; create a new batch"),
    printcolumn(name = "Ready", type_ = "string", json_path = ".status.conditions[?(@.type==\"Ready\")].status"),
    printcolumn(name = "Payouts", type_ = "string", json_path = ".status.summary"),
    printcolumn(name = "Ambiguous", type_ = "integer", json_path = ".status.ambiguousCount"),
    printcolumn(name = "Age", type_ = "date", json_path = ".metadata.creationTimestamp")
)]
#[serde(rename_all = "camelCase")]
pub struct PayoutBatchSpec {
    /// Concurrent workers of the executor.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 256))]
    pub workers: Option<i32>,
    /// At most 500, a limit that holds for any valid item: the largest item (three 128-character
    /// strings and an int64) is about 475 bytes of JSON, so 500 of them stay under the 256 KiB
    /// that client-side `kubectl apply` may keep in its last-applied annotation, and the
    /// manifest ConfigMap stays far under its 1 MiB. Larger runs are several batches.
    #[schemars(length(min = 1, max = 500))]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["key"]))]
    pub payouts: Vec<PayoutItem>,
    /// The LockServer, PaymentResource and RailProxy to use; each defaults to the only one of its
    /// kind in the namespace's conventional name (`lock-server`, `payment-resource`, `rail-proxy`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lock_server: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub payment_resource: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rail_proxy: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<String>,
    /// How the executor authenticates to the services. Absent: a projected service-account
    /// token of the `default` service account (audience `dlock`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub executor: Option<ExecutorSpec>,
    /// Requests and limits of the main container; the operator's defaults when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resources: Option<ResourceRequirements>,
    /// Secrets for pulling the image (`[{name: regcred}]`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image_pull_secrets: Option<Vec<LocalObjectReference>>,
}

/// The executor's credential. `dlock run -f` ignores this section.
#[derive(KubeSchema, Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("!has(self.credentialSecret) || has(self.identity)").message("spec.executor.credentialSecret needs spec.executor.identity, the identity its token authenticates as"))]
pub struct ExecutorSpec {
    /// The identity the credential authenticates as; the workers' `X-Owner-Id` is
    /// `<identity>/<batch>`. Without `credentialSecret` it is the service account's
    /// (`system:serviceaccount:<namespace>:<serviceAccountName>`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 64))]
    pub identity: Option<String>,
    /// A Secret key holding the bearer token (services with `auth.mode = "tokens"`). Absent: a
    /// projected service-account token with audience `dlock` (`auth.mode = "tokenreview"`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub credential_secret: Option<SecretKeyRef>,
    /// The executor pod's service account (default `default`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253))]
    pub service_account_name: Option<String>,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PayoutBatchStatus {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
    /// Set once the executor Job exists; from then on `spec.payouts` is immutable.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub accepted: Option<bool>,
    /// Payouts per state, from paydb.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub counts: BTreeMap<String, i64>,
    /// Payout ids in RAIL_AMBIGUOUS, for an operator to resolve.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ambiguous: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ambiguous_count: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fenced_out: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub job_name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub summary: Option<String>,
}

// ---------------------------------------------------------------------------------------------
// Lock

/// A held lock, mirrored read-only from a lock server for `kubectl get locks`.
/// `kubectl annotate lock NAME dlock.io/revoke-reason=… dlock.io/revoked-by=…` force-revokes it.
#[derive(CustomResource, Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
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
    printcolumn(
        name = "Ready",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"Ready\")].status",
        priority = 1
    ),
    printcolumn(
        name = "Revocation",
        type_ = "string",
        json_path = ".status.revocation.summary",
        priority = 1
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(rename_all = "camelCase")]
pub struct LockSpec {
    /// The lock key on the lock server.
    pub key: String,
    /// The LockServer that holds it.
    pub lock_server: String,
    /// The account whose enforcement points a revocation fences (DESIGN D-3).
    pub account_id: String,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct LockStatus {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub holder: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub acquired_at: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expires_at: Option<String>,
    /// The last revocation, keyed by the annotation value that asked for it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub revocation: Option<RevocationResult>,
}

/// What a revocation did (D-3): the grant ended, the floor and whether it reached both fences.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RevocationResult {
    /// `reason|revokedBy`: the request this result answers; the flow runs once per value.
    pub request: String,
    /// `Complete` (both fences reached), `Incomplete` (retried) or `Refused` (waits for a new
    /// request).
    pub outcome: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub revocation_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub revoked_token: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub new_token_floor: Option<i64>,
    pub payment_fenced: bool,
    pub rail_fenced: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub summary: Option<String>,
}

// ---------------------------------------------------------------------------------------------
// LockRevocation

/// A forced revocation as a declarative resource, for GitOps. The spec is immutable.
#[derive(CustomResource, Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "dlock.io",
    version = "v1alpha1",
    kind = "LockRevocation",
    namespaced,
    status = "LockRevocationStatus",
    shortname = "lrev",
    category = "dlock",
    validation = Rule::new("!has(oldSelf.spec) || self.spec == oldSelf.spec").message("a LockRevocation is immutable; create a new one"),
    printcolumn(name = "Ready", type_ = "string", json_path = ".status.conditions[?(@.type==\"Ready\")].status"),
    printcolumn(name = "Key", type_ = "string", json_path = ".spec.key"),
    printcolumn(name = "Floor", type_ = "integer", json_path = ".status.result.newTokenFloor"),
    printcolumn(name = "Summary", type_ = "string", json_path = ".status.result.summary"),
    printcolumn(name = "Age", type_ = "date", json_path = ".metadata.creationTimestamp")
)]
#[serde(rename_all = "camelCase")]
pub struct LockRevocationSpec {
    pub key: String,
    pub account_id: String,
    #[schemars(length(min = 8, max = 1024))]
    pub reason: String,
    #[schemars(length(min = 1, max = 128))]
    pub revoked_by: String,
    /// Revoke only the grant with this fencing token (L8's `expectedToken`); the lock server
    /// refuses when another grant holds the key.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub expected_token: Option<i64>,
    /// The LockServer; defaults to the only one in the namespace.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lock_server: Option<String>,
    /// The PaymentResource whose account fence is advanced; defaults to the only one in the
    /// namespace (with none or several the revocation is refused).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub payment_resource: Option<String>,
    /// The RailProxy whose high-water mark is advanced; defaults to the only one in the
    /// namespace (with none or several the revocation is refused).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rail_proxy: Option<String>,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct LockRevocationStatus {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result: Option<RevocationResult>,
}

// ---------------------------------------------------------------------------------------------
// Reconciliation

/// Runs the reconciler (paydb, ledger and rail statement compared) once, or on a schedule.
#[derive(CustomResource, Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
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
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rail_url: Option<String>,
    /// A cron schedule; absent runs once.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub schedule: Option<String>,
    /// The RailProxy whose stub is the rail when `railUrl` is absent (default `rail-proxy`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rail_proxy: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<String>,
    /// Requests and limits of the main container; the operator's defaults when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resources: Option<ResourceRequirements>,
    /// Secrets for pulling the image (`[{name: regcred}]`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image_pull_secrets: Option<Vec<LocalObjectReference>>,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ReconciliationStatus {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_run_job: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub findings: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub summary: Option<String>,
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
