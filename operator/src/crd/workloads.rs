//! LockServer, PaymentResource and RailProxy: the long-running services.

use k8s_openapi::api::core::v1::ResourceRequirements;
use kube::KubeSchema;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::{CloudSql, PodOptions, SecretKeyRef, ServiceAuth, WorkloadStatus};

dlock_kind! {
    kind: "LockServer", status: "WorkloadStatus", shortname: "ls",
    columns: [
        Ready,
        ("Replicas", "string", ".status.summary"),
        ("Backend", "string", ".spec.backend.type"),
    ],
    /// The lock server: sessions, leases and fencing tokens on PostgreSQL or etcd.
    pub struct LockServerSpec {
        /// Immutable: switching stores live would split the lock state in two.
        #[x_kube(validation = Rule::new("self == oldSelf").message("spec.backend is immutable: switching lock stores live would split the lock state in two; create a new LockServer instead"))]
        pub backend: LockBackend,
        // Image, replicas, pods, authentication and proof keys: what every service has.
        #[serde(flatten)]
        pub service: ServiceSettings,
    }
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
}

// ---------------------------------------------------------------------------------------------
// PaymentResource

dlock_kind! {
    kind: "PaymentResource", status: "WorkloadStatus", shortname: "payres",
    columns: [Ready, ("Replicas", "string", ".status.summary")],
    /// The payment resource: payouts, accounts and the ledger against paydb.
    pub struct PaymentResourceSpec {
        /// The paydb URL.
        pub database_url_secret: SecretKeyRef,
        /// The credential of operator-only calls (fence advance, resolution).
        pub operator_token_secret: Option<SecretKeyRef>,
        // Image, replicas, pods, authentication and proof keys: what every service has.
        #[serde(flatten)]
        pub service: ServiceSettings,
    }
}

// ---------------------------------------------------------------------------------------------
// RailProxy

dlock_kind! {
    kind: "RailProxy", status: "WorkloadStatus", shortname: "rp",
    columns: [Ready, ("Replicas", "string", ".status.summary")],
    /// The rail proxy, the only caller of the rail, and optionally the rail stub behind it.
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
