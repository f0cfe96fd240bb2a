//! LockServer, PaymentResource and RailProxy: the long-running services.

use k8s_openapi::api::core::v1::ResourceRequirements;
use kube::{CustomResource, KubeSchema};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::{CloudSql, PodOptions, SecretKeyRef, ServiceAuth, WorkloadStatus};

/// The lock server: sessions, leases and fencing tokens on PostgreSQL or etcd.
#[serde_with::skip_serializing_none]
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
    // Image, replicas, pods, authentication and proof keys: what every service has.
    #[serde(flatten)]
    pub service: ServiceSettings,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum BackendType {
    Pg,
    Etcd,
}

#[serde_with::skip_serializing_none]
#[derive(KubeSchema, Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("self.type == 'pg' ? has(self.pg) && !has(self.etcd) : has(self.etcd) && !has(self.pg)").message("set exactly the section that spec.backend.type names"))]
pub struct LockBackend {
    #[serde(rename = "type")]
    pub type_: BackendType,
    pub pg: Option<PgBackend>,
    pub etcd: Option<EtcdBackend>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PgBackend {
    /// The lockdb URL (`postgres://…`).
    pub url_secret: SecretKeyRef,
}

/// etcd is referenced, never deployed.
#[serde_with::skip_serializing_none]
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
    pub tls_secret: Option<String>,
    /// etcd's own authentication (`lock.etcd.username`, `lock.etcd.password-file`).
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

/// What every service's spec has (flattened into it): replicas, the pod's settings, callers'
/// authentication and the fencing-token proof keys.
#[serde_with::skip_serializing_none]
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ServiceSettings {
    #[schemars(range(min = 1, max = 16))]
    pub replicas: Option<i32>,
    pub cloud_sql: Option<CloudSql>,
    /// The `dlock` image; the operator's own image when absent.
    pub image: Option<String>,
    // The main container's resources and the image pull Secrets.
    #[serde(flatten)]
    pub pod: PodOptions,
    /// Callers' authentication; TokenReview when absent. `mode: none` must be written out.
    pub auth: Option<ServiceAuth>,
    /// The fencing-token proof keys (docs/design.md#d-8): a Secret key of `<key-id> <secret>`
    /// lines, mounted as a directory and named by `fencing.proof-keys-file`. The LockServer,
    /// PaymentResource and RailProxy of a namespace must name the same Secret.
    pub fencing_proof_keys_secret: Option<SecretKeyRef>,
    /// TLS on the service's listener; plain HTTP when absent.
    pub tls: Option<ServiceTls>,
}

/// TLS between the pods (docs/kubernetes.md#tls-between-pods): the service serves HTTPS and the
/// operator, the other services and the Jobs call it at `https://<name>.<namespace>.svc:8080`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ServiceTls {
    /// A Secret of this namespace in the `kubernetes.io/tls` layout that cert-manager writes:
    /// `tls.crt` (a certificate for `<name>.<namespace>.svc`; a RailProxy's also for
    /// `<name>-stub.<namespace>.svc`, which serves with it), `tls.key` and `ca.crt` (the CA that
    /// signed the namespace's service certificates, which its callers trust). Mounted read-only
    /// as a directory at `/etc/dlock/tls` and named by `server.tls.cert-file` and `key-file`; a
    /// renewed certificate is picked up without a restart.
    #[schemars(pattern(crate::workload::DNS_LABEL_PATTERN), length(min = 1, max = crate::workload::DNS_LABEL_LEN_MAX))]
    pub secret_name: String,
}

// ---------------------------------------------------------------------------------------------
// PaymentResource

/// The payment resource: payouts, accounts and the ledger against paydb.
#[serde_with::skip_serializing_none]
#[derive(CustomResource, KubeSchema, Clone, Debug, PartialEq, Serialize, Deserialize)]
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
    pub operator_token_secret: Option<SecretKeyRef>,
    /// The treasury's controls on funding (docs/contract.md#dual-approval).
    pub treasury: Option<TreasurySpec>,
    /// ServiceAccounts of this namespace a PayoutBatch naming this PaymentResource may run its
    /// executor as (`spec.executor.serviceAccountName`) besides `dlock-executor`, the one the
    /// operator makes. Absent: only `dlock-executor` (docs/threat-model.md#deployments-made-by-the-operator).
    #[schemars(length(max = 8), inner(pattern(crate::workload::SERVICE_NAME_PATTERN), length(min = 1, max = crate::workload::SERVICE_NAME_LEN_MAX)))]
    pub executor_service_accounts: Option<Vec<String>>,
    /// Secrets of this namespace a PayoutBatch naming this PaymentResource may mount as its
    /// executor's credential (`spec.executor.credentialSecret.name`). Absent: none, the executor
    /// authenticates with its ServiceAccount's projected token.
    #[schemars(length(max = 8), inner(length(min = 1, max = 253)))]
    pub executor_credential_secrets: Option<Vec<String>>,
    // Image, replicas, pods, authentication and proof keys: what every service has.
    #[serde(flatten)]
    pub service: ServiceSettings,
}

/// A PaymentResource's treasury settings.
#[serde_with::skip_serializing_none]
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct TreasurySpec {
    /// `auth.treasury.dual-approval-above`, in minor units: a funding above it is recorded and
    /// applied only when a second, different treasury identity approves it
    /// (docs/contract.md#dual-approval). Absent: every funding applies at once.
    #[schemars(range(min = 1, max = 1_000_000_000_000_000_i64))]
    pub dual_approval_above: Option<i64>,
}

// ---------------------------------------------------------------------------------------------
// RailProxy

/// The rail proxy, the only caller of the rail, and optionally the rail stub behind it.
#[serde_with::skip_serializing_none]
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
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("has(self.railUrl) != has(self.stub)").message("set exactly one of spec.railUrl (a real rail) and spec.stub (the rail stub)"))]
pub struct RailProxySpec {
    /// paydb, where the high-water marks and the intents live.
    pub database_url_secret: SecretKeyRef,
    /// The rail's URL; absent when `stub` is set.
    pub rail_url: Option<String>,
    /// `rail.proxy.read-timeout-ms`; the pods' termination grace is set above it.
    #[schemars(range(min = 100, max = 120000))]
    pub read_timeout_ms: Option<i64>,
    pub operator_token_secret: Option<SecretKeyRef>,
    // Image, replicas, pods, authentication and proof keys: what every service has.
    #[serde(flatten)]
    pub service: ServiceSettings,
    /// Deploys the rail stub and points the proxy at it.
    pub stub: Option<RailStubSpec>,
}

#[serde_with::skip_serializing_none]
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RailStubSpec {
    #[schemars(range(min = 0, max = 600000))]
    pub latency_ms: Option<i64>,
    #[schemars(range(min = 0.0, max = 1.0))]
    pub failure_rate: Option<f64>,
    #[schemars(range(min = 0.0, max = 1.0))]
    pub duplicate_ack_rate: Option<f64>,
    /// Requests and limits of the stub's container; the operator's defaults when absent.
    pub resources: Option<ResourceRequirements>,
}
