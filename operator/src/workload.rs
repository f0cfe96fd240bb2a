//! The validated form of a workload kind (LockServer, PaymentResource, RailProxy and its stub):
//! the only input of the builders in `build/`. The raw custom resource is used only for the owner
//! reference.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;

use crate::crd::SecretKeyRef;

/// Every dlock service listens here inside its pod.
pub const PORT: i32 = 8080;
/// The operator's field manager for every server-side apply.
pub const FIELD_MANAGER: &str = "dlock-operator";
/// The annotation that stops a controller from changing an object.
pub const PAUSED_ANNOTATION: &str = "dlock.io/reconcile";
pub const PAUSED_VALUE: &str = "paused";
/// The Cloud SQL Auth Proxy image when `spec.cloudSql.image` is absent.
pub const CLOUD_SQL_PROXY_IMAGE: &str = "gcr.io/cloud-sql-connectors/cloud-sql-proxy:2.14.3";
/// Termination grace of the services that hold no forward in flight.
pub const TERMINATION_GRACE_SECONDS_DEFAULT: i64 = 30;
/// How much longer than the rail read timeout a rail-proxy pod may take to stop.
pub const TERMINATION_GRACE_ABOVE_READ_TIMEOUT_SECONDS: i64 = 10;

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

/// A Secret key exposed to the container as an environment variable (a config-key override).
#[derive(Clone, Debug, PartialEq)]
pub struct SecretEnv {
    pub name: String,
    pub secret: SecretKeyRef,
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
    /// The service's TOML configuration (no secrets: those come from `secret_env`).
    pub config_toml: String,
    pub secret_env: Vec<SecretEnv>,
    pub termination_grace_period_seconds: i64,
    pub cloud_sql: Option<ValidCloudSql>,
    /// An `emptyDir` mounted at `/data` (the rail stub's statement).
    pub data_volume: bool,
    /// A Secret mounted at `/etc/dlock/etcd-tls`.
    pub etcd_tls_secret: Option<String>,
    pub owner: OwnerReference,
}

impl Workload {
    pub fn url(&self) -> String {
        service_url(&self.name, &self.namespace)
    }
}

/// The in-cluster URL of a dlock Service.
pub fn service_url(name: &str, namespace: &str) -> String {
    format!("http://{name}.{namespace}.svc:{PORT}")
}

/// A TOML basic string, quoted and escaped.
pub fn toml_string(value: &str) -> String {
    toml::Value::String(value.to_owned()).to_string()
}
