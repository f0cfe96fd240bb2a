//! The validated form of a workload kind (LockServer, PaymentResource, RailProxy and its stub):
//! the only input of the builders in `build/`. The raw custom resource is used only for the owner
//! reference.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{LocalObjectReference, ResourceRequirements, SeccompProfile};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;

use crate::crd::{PodOptions, SecretKeyRef};

/// Every dlock service listens here inside its pod.
pub const PORT: i32 = 8080;
/// The operator's field manager for every server-side apply.
pub const FIELD_MANAGER: &str = "dlock-operator";
/// The annotation that stops a controller from changing an object.
pub const PAUSED_ANNOTATION: &str = "dlock.io/reconcile";
pub const PAUSED_VALUE: &str = "paused";
/// The Cloud SQL Auth Proxy image when `spec.cloudSql.image` is absent.
pub const CLOUD_SQL_PROXY_IMAGE: &str = "gcr.io/cloud-sql-connectors/cloud-sql-proxy:2.14.3";
/// The service account of the services' pods, one per namespace, made by the operator. Their
/// TokenReview calls need `system:auth-delegator`, which the chart binds to this name in the
/// namespaces it lists (`serviceAuth.namespaces`): a ClusterRoleBinding is cluster-scoped, so the
/// operator does not make one.
pub const SERVICE_ACCOUNT: &str = "dlock-service";
/// Where a workload's fencing-token proof keys Secret is mounted.
pub const FENCING_PROOF_KEYS_DIR: &str = "/etc/dlock/fencing-proof-keys";
/// Where a service's `spec.tls.secretName` is mounted (a directory, never a subPath, so a
/// certificate cert-manager renews reaches the pod): `tls.crt` and `tls.key` serve its listener
/// (`server.tls.cert-file`, `key-file`), `ca.crt` is the CA its own calls trust.
pub const TLS_DIR: &str = "/etc/dlock/tls";
/// Where a pod that only calls TLS services (an executor's, a reconciler's) gets the `ca.crt`
/// of the namespace's TLS Secret, and nothing else of it: never the services' private key.
pub const CA_DIR: &str = "/etc/dlock/ca";
/// The CA bundle's file in [`TLS_DIR`] and [`CA_DIR`] (cert-manager's key).
pub const CA_FILE: &str = "ca.crt";
/// Where the rail proxy's pod gets a projected token of its ServiceAccount, audience `dlock`,
/// which it presents to the operator's rail stub (`rail.proxy.rail-credential-file`).
pub const RAIL_TOKEN_DIR: &str = "/var/run/secrets/dlock/rail";
/// What a Kubernetes object name of one DNS label is (RFC 1123): the name of a TLS Secret.
pub const DNS_LABEL_PATTERN: &str = "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$";
/// The longest DNS label.
pub const DNS_LABEL_LEN_MAX: usize = 63;
/// Termination grace of the services that hold no forward in flight.
pub const TERMINATION_GRACE_SECONDS_DEFAULT: i64 = 30;
/// How much longer than the rail read timeout a rail-proxy pod may take to stop (the preStop
/// sleep included).
pub const TERMINATION_GRACE_ABOVE_READ_TIMEOUT_SECONDS: i64 = 10 + PRE_STOP_SLEEP_SECONDS;
/// How long a service pod keeps serving after it is told to stop, before its process gets
/// SIGTERM (the kubelet's native `preStop` sleep): the time the endpoints controller and every
/// node's kube-proxy take to stop sending it new connections. Without it the process closes its
/// listener while Services still route to it, and callers see refused and reset connections
/// during every rollout (seen on a real node: the payment resource's roll answered a funding
/// call with no answer at all).
pub const PRE_STOP_SLEEP_SECONDS: i64 = 5;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Component {
    LockServer,
    PaymentResource,
    RailProxy,
    RailStub,
}

impl Component {
    /// The `app.kubernetes.io/component` label and the `dlock serve` argument.
    pub fn as_str(self) -> &'static str {
        match self {
            Component::LockServer => "lock-server",
            Component::PaymentResource => "payment-resource",
            Component::RailProxy => "rail-proxy",
            Component::RailStub => "rail-stub",
        }
    }
}

/// Where the Secrets of [`SecretFile`]s are mounted, one directory each.
pub const SECRET_FILES_DIR: &str = "/etc/dlock/secrets";

/// A secret configuration value (a database URL, an operator token) as a file: the Secret is
/// mounted read-only at `<SECRET_FILES_DIR>/<volume>` and the configuration names the key's file
/// through `<key>-file`. Never an environment variable: a service takes no security setting from
/// its environment (services/server/src/config.rs).
#[derive(Clone, Debug, PartialEq)]
pub struct SecretFile {
    /// The configuration key whose value the file holds (`payment.pg.url`).
    pub key: String,
    /// The volume's name, and its directory under [`SECRET_FILES_DIR`].
    pub volume: String,
    pub secret: SecretKeyRef,
}

impl SecretFile {
    /// The file in the container: the Secret's key in the volume's directory.
    pub fn path(&self) -> String {
        format!("{SECRET_FILES_DIR}/{}/{}", self.volume, self.secret.key)
    }

    /// `"<key>-file" = "<path>"` lines for `files`, appended to a service's configuration (flat
    /// keys, as the contract's `to_toml` writes them).
    pub fn config_lines(files: &[SecretFile]) -> String {
        files
            .iter()
            .map(|file| {
                let key = toml::Value::String(format!("{}-file", file.key));
                let path = toml::Value::String(file.path());
                format!("{key} = {path}\n")
            })
            .collect()
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct ValidCloudSql {
    pub instance_connection_name: String,
    pub image: String,
}

/// One Deployment with its Service, PodDisruptionBudget and ConfigMap.
#[derive(Clone, Debug, PartialEq)]
pub struct Workload {
    /// The name of every object built for it.
    pub name: String,
    pub namespace: String,
    pub component: Component,
    /// The custom resource's name (`app.kubernetes.io/instance`).
    pub instance: String,
    pub image: String,
    pub replicas: i32,
    /// The service's TOML configuration (no secrets: those are in `secret_files`, which it
    /// names).
    pub config_toml: String,
    pub secret_files: Vec<SecretFile>,
    pub termination_grace_period_seconds: i64,
    pub cloud_sql: Option<ValidCloudSql>,
    /// An `emptyDir` mounted at `/data` (the rail stub's statement).
    pub data_volume: bool,
    /// A Secret mounted at `/etc/dlock/etcd-tls`.
    pub etcd_tls_secret: Option<String>,
    /// The etcd user's password Secret, mounted at `/etc/dlock/etcd-auth`.
    pub etcd_password_secret: Option<String>,
    /// The pod's service account, with its API token mounted unless `auth_disabled` (TokenReview
    /// needs it; a rail proxy with `auth.mode: none` runs as it only for its projected rail
    /// token); `None`: the namespace's default account and no token.
    pub service_account: Option<String>,
    /// The fencing-token proof keys' Secret, mounted (as a directory, so a rotation reaches the
    /// pod) at [`FENCING_PROOF_KEYS_DIR`].
    pub fencing_proof_keys_secret: Option<String>,
    /// `spec.auth.mode: none`: the service checks no caller (the status says so, every time).
    pub auth_disabled: bool,
    /// `spec.tls.secretName`: mounted at [`TLS_DIR`]; the service serves HTTPS and its URL is
    /// `https://`.
    pub tls_secret: Option<String>,
    /// A projected token of the pod's ServiceAccount, audience `dlock`, at [`RAIL_TOKEN_DIR`]:
    /// the rail proxy's credential towards the operator's rail stub.
    pub rail_token: bool,
    pub pod: PodSettings,
    pub owner: OwnerReference,
}

impl Workload {
    /// The in-cluster URL of the workload's Service. Its name was checked as a [`ServiceName`]
    /// when the workload was validated.
    pub fn url(&self) -> String {
        service_url_with(
            &ServiceName(self.name.clone()),
            &self.namespace,
            self.tls_secret.is_some(),
        )
    }
}

/// Whether `name` is a DNS label (a Secret's name that is also a volume's): 1 to 63 of
/// lower-case letters, digits and `-`, starting and ending with a letter or digit.
pub fn is_dns_label(name: &str) -> bool {
    let bytes = name.as_bytes();
    !bytes.is_empty()
        && bytes.len() <= DNS_LABEL_LEN_MAX
        && bytes
            .iter()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || *b == b'-')
        && !name.starts_with('-')
        && !name.ends_with('-')
}

/// What a Service name is (an RFC 1035 label, as Kubernetes requires of a Service), and so what
/// every reference to a dlock service in a custom resource must be: `spec.lockServer`,
/// `spec.paymentResource`, `spec.railProxy`. The CRDs carry the same pattern and length.
pub const SERVICE_NAME_PATTERN: &str = "^[a-z]([-a-z0-9]*[a-z0-9])?$";
/// The longest Service name (an RFC 1035 label).
pub const SERVICE_NAME_LEN_MAX: usize = 63;

/// The name of a dlock Service, checked. The operator sends its own credential to the URL a
/// name becomes ([`service_url`]), so a name is only ever a Service name of the object's own
/// namespace: nothing in it can name another host, port or path (`evil.example:80/?` is refused).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServiceName(String);

impl ServiceName {
    /// `name` when it is a Service name; otherwise what is wrong with it.
    pub fn new(name: &str) -> Result<Self, String> {
        let bytes = name.as_bytes();
        let valid = !bytes.is_empty()
            && bytes.len() <= SERVICE_NAME_LEN_MAX
            && bytes[0].is_ascii_lowercase()
            && bytes
                .iter()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || *b == b'-')
            && !name.ends_with('-');
        if valid {
            Ok(Self(name.to_owned()))
        } else {
            Err(format!(
                "{name:?} is not a Service name: 1 to {SERVICE_NAME_LEN_MAX} of lower-case letters, \
                 digits and '-', starting with a letter and ending with a letter or digit (the name \
                 of a dlock object in this namespace, never a host or URL)"
            ))
        }
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Display for ServiceName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// The in-cluster URL of a dlock Service of `namespace` (a namespace name, which Kubernetes
/// already restricts to a DNS label), plain HTTP; [`service_url_with`] for one that may serve
/// TLS.
pub fn service_url(name: &ServiceName, namespace: &str) -> String {
    service_url_with(name, namespace, false)
}

/// The in-cluster URL of a dlock Service: `https://` when its object has `spec.tls`. Its
/// certificate must name `<name>.<namespace>.svc` (docs/kubernetes.md#tls-between-pods).
pub fn service_url_with(name: &ServiceName, namespace: &str, tls: bool) -> String {
    let scheme = if tls { "https" } else { "http" };
    format!("{scheme}://{name}.{namespace}.svc:{PORT}")
}

/// A TOML basic string, quoted and escaped.
pub fn toml_string(value: &str) -> String {
    toml::Value::String(value.to_owned()).to_string()
}

/// What every pod the operator builds takes from its custom resource.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PodSettings {
    /// The main container's requests and limits.
    pub resources: ResourceRequirements,
    pub image_pull_secrets: Vec<LocalObjectReference>,
}

impl PodSettings {
    /// The spec's resources (as given) or `default`, and its pull secrets.
    pub fn from_spec(
        resources: Option<&ResourceRequirements>,
        image_pull_secrets: Option<&Vec<LocalObjectReference>>,
        default: ResourceRequirements,
    ) -> Self {
        Self {
            resources: resources.cloned().unwrap_or(default),
            image_pull_secrets: image_pull_secrets.cloned().unwrap_or_default(),
        }
    }

    /// What a spec's [`PodOptions`] say, with `default` resources when it names none.
    pub fn from_options(options: &PodOptions, default: ResourceRequirements) -> Self {
        Self::from_spec(
            options.resources.as_ref(),
            options.image_pull_secrets.as_ref(),
            default,
        )
    }

    /// `imagePullSecrets` of the pod spec: absent when there are none.
    pub fn pull_secrets(&self) -> Option<Vec<LocalObjectReference>> {
        (!self.image_pull_secrets.is_empty()).then(|| self.image_pull_secrets.clone())
    }
}

/// Requests of `cpu` and `memory`, and a memory limit. No CPU limit by default: a throttled
/// lock server or executor misses its renewals and heartbeats, which costs leases; a spec that
/// wants one sets `resources` itself.
pub fn resources(cpu: &str, memory: &str, memory_limit: &str) -> ResourceRequirements {
    ResourceRequirements {
        requests: Some(BTreeMap::from([
            ("cpu".to_owned(), Quantity(cpu.to_owned())),
            ("memory".to_owned(), Quantity(memory.to_owned())),
        ])),
        limits: Some(BTreeMap::from([(
            "memory".to_owned(),
            Quantity(memory_limit.to_owned()),
        )])),
        ..ResourceRequirements::default()
    }
}

/// The defaults of the services (lock server, payment resource, rail proxy), the executor and
/// the reconciler.
pub fn service_resources() -> ResourceRequirements {
    resources("100m", "128Mi", "512Mi")
}

/// The rail stub's and the Cloud SQL Auth Proxy's defaults.
pub fn small_resources() -> ResourceRequirements {
    resources("50m", "64Mi", "256Mi")
}

/// `seccompProfile: {type: RuntimeDefault}` of every pod the operator builds.
pub fn runtime_default_seccomp() -> Option<SeccompProfile> {
    Some(SeccompProfile {
        type_: "RuntimeDefault".to_owned(),
        ..SeccompProfile::default()
    })
}
