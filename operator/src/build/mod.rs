//! Pure builders, one per Kubernetes kind. Each takes validated input only and returns the whole
//! object the operator applies; tests compare the whole object with an expected one.

pub mod config_map;
pub mod deployment;
pub mod job;
pub mod lock;
pub mod network_policy;
pub mod pdb;
pub mod proof_keys;
pub mod reconciler;
pub mod service;
pub mod service_account;

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    ConfigMapVolumeSource, EnvVar, EnvVarSource, PodSpec, PodTemplateSpec, Volume, VolumeMount,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};

use crate::workload::{Component, PodSettings, Workload};

pub const MANAGED_BY: &str = "dlock-operator";

/// The ConfigMap every dlock pod the operator makes reads its telemetry settings from, when it
/// exists in the namespace. Optional, so a namespace without it runs without export.
pub const TELEMETRY_CONFIG_MAP: &str = "dlock-telemetry";

/// The keys of [`TELEMETRY_CONFIG_MAP`] a pod takes, each as the environment variable of that
/// name: where spans go and how they are labelled and sampled, and the log filter. Nothing else:
/// the ConfigMap is read key by key, never whole (`envFrom`), so whoever can write a ConfigMap in
/// the namespace cannot set `DLOCK_AUTH_MODE`, empty the proof keys or point a service at
/// another rail or API server through it.
pub const TELEMETRY_KEYS: [&str; 12] = [
    "OTEL_SDK_DISABLED",
    "OTEL_SERVICE_NAME",
    "OTEL_RESOURCE_ATTRIBUTES",
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    "OTEL_EXPORTER_OTLP_PROTOCOL",
    "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
    "OTEL_EXPORTER_OTLP_HEADERS",
    "OTEL_EXPORTER_OTLP_TIMEOUT",
    "OTEL_TRACES_SAMPLER",
    "OTEL_TRACES_SAMPLER_ARG",
    "DLOCK_LOG",
];

/// The pod template of a Job's run-once pod (the executor's, the reconciler's): `spec` with the
/// labels, no restart, the pod's pull Secrets and the non-root pod security context. The API
/// token stays out: these pods call the dlock services and databases only.
pub fn run_once_template(
    labels: BTreeMap<String, String>,
    pod: &PodSettings,
    spec: PodSpec,
) -> PodTemplateSpec {
    PodTemplateSpec {
        metadata: Some(ObjectMeta {
            labels: Some(labels),
            ..ObjectMeta::default()
        }),
        spec: Some(PodSpec {
            restart_policy: Some("Never".to_owned()),
            automount_service_account_token: Some(false),
            image_pull_secrets: pod.pull_secrets(),
            security_context: Some(deployment::pod_security_context(false)),
            ..spec
        }),
    }
}

/// `env` entries of every dlock container for its telemetry: each of [`TELEMETRY_KEYS`] from the
/// namespace's [`TELEMETRY_CONFIG_MAP`], when the ConfigMap and the key exist.
pub fn telemetry_env() -> Vec<EnvVar> {
    use k8s_openapi::api::core::v1::ConfigMapKeySelector;
    TELEMETRY_KEYS
        .iter()
        .map(|key| EnvVar {
            name: (*key).to_owned(),
            value_from: Some(EnvVarSource {
                config_map_key_ref: Some(ConfigMapKeySelector {
                    name: TELEMETRY_CONFIG_MAP.to_owned(),
                    key: (*key).to_owned(),
                    optional: Some(true),
                }),
                ..EnvVarSource::default()
            }),
            ..EnvVar::default()
        })
        .collect()
}

/// An environment variable with a literal value.
pub fn env(name: &str, value: impl Into<String>) -> EnvVar {
    EnvVar {
        name: name.to_owned(),
        value: Some(value.into()),
        ..EnvVar::default()
    }
}

/// What a run-once pod (an executor's, a reconciler's) needs to call `https://` services: the
/// `ca.crt` of the namespace's TLS Secret `secret`, and no other key of it (never the services'
/// private key), mounted as a directory at [`crate::workload::CA_DIR`] (so a renewed CA reaches
/// it), and `DLOCK_CA_FILE` naming the file, which the clients of `dlock run` and `dlock
/// reconcile` trust instead of the system's roots.
pub fn ca_trust(secret: &str) -> (VolumeMount, Volume, EnvVar) {
    use crate::workload::{CA_DIR, CA_FILE};
    use k8s_openapi::api::core::v1::{KeyToPath, SecretVolumeSource};
    (
        read_only_mount("ca", CA_DIR),
        Volume {
            name: "ca".to_owned(),
            secret: Some(SecretVolumeSource {
                secret_name: Some(secret.to_owned()),
                items: Some(vec![KeyToPath {
                    key: CA_FILE.to_owned(),
                    path: CA_FILE.to_owned(),
                    ..KeyToPath::default()
                }]),
                ..SecretVolumeSource::default()
            }),
            ..Volume::default()
        },
        env("DLOCK_CA_FILE", format!("{CA_DIR}/{CA_FILE}")),
    )
}

/// The read-only mount of the volume `name` at `dir`.
pub fn read_only_mount(name: &str, dir: &str) -> VolumeMount {
    VolumeMount {
        name: name.to_owned(),
        mount_path: dir.to_owned(),
        read_only: Some(true),
        ..VolumeMount::default()
    }
}

/// A projected token of the pod's ServiceAccount with `audience`, at `dir/token`: kubelet
/// rotates it at 80 % of its lifetime, and its reader re-reads the file.
pub fn projected_token(name: &str, dir: &str, audience: &str) -> (VolumeMount, Volume) {
    use k8s_openapi::api::core::v1::{
        ProjectedVolumeSource, ServiceAccountTokenProjection, VolumeProjection,
    };
    let volume = Volume {
        name: name.to_owned(),
        projected: Some(ProjectedVolumeSource {
            sources: Some(vec![VolumeProjection {
                service_account_token: Some(ServiceAccountTokenProjection {
                    audience: Some(audience.to_owned()),
                    expiration_seconds: Some(job::TOKEN_EXPIRATION_SECONDS),
                    path: "token".to_owned(),
                }),
                ..VolumeProjection::default()
            }]),
            ..ProjectedVolumeSource::default()
        }),
        ..Volume::default()
    };
    (read_only_mount(name, dir), volume)
}

/// A ConfigMap mounted read-only at `/config`, under the volume name `volume`.
pub fn config_volume(volume: &str, config_map: String) -> (VolumeMount, Volume) {
    (
        read_only_mount(volume, "/config"),
        Volume {
            name: volume.to_owned(),
            config_map: Some(ConfigMapVolumeSource {
                name: config_map,
                ..ConfigMapVolumeSource::default()
            }),
            ..Volume::default()
        },
    )
}

/// The labels that select a workload's pods. Never change them: a Deployment's selector is
/// immutable, so a new label here would need every Deployment deleted and re-created.
pub fn selector_labels(component: Component, instance: &str) -> BTreeMap<String, String> {
    BTreeMap::from([
        ("app.kubernetes.io/name".to_owned(), "dlock".to_owned()),
        (
            "app.kubernetes.io/component".to_owned(),
            component.as_str().to_owned(),
        ),
        ("app.kubernetes.io/instance".to_owned(), instance.to_owned()),
    ])
}

/// The label naming the custom resource an object was made for. `app.kubernetes.io/instance` is
/// Argo CD's default tracking label: on the operator's objects it would let an Application whose
/// name equals the custom resource's claim them as its own, report them OutOfSync and prune
/// them. The objects the operator makes carry this label instead.
pub const INSTANCE_LABEL: &str = "dlock.io/instance";

/// The labels of a workload's pods: the selector labels plus `managed-by`. Only pods (owned by
/// ReplicaSets, never tracked by Argo CD) carry `app.kubernetes.io/instance`, because the
/// Deployments' immutable selectors were made with it.
pub fn pod_labels(component: Component, instance: &str) -> BTreeMap<String, String> {
    let mut labels = selector_labels(component, instance);
    labels.insert(
        "app.kubernetes.io/managed-by".to_owned(),
        MANAGED_BY.to_owned(),
    );
    labels
}

/// The labels of the objects the operator makes (metadata, never a selector): name, component,
/// `managed-by` and [`INSTANCE_LABEL`], never `app.kubernetes.io/instance`.
pub fn labels(component: Component, instance: &str) -> BTreeMap<String, String> {
    owned_labels(component.as_str(), instance)
}

/// [`labels`] for any component name (the executor and the reconciler too).
pub fn owned_labels(component: &str, instance: &str) -> BTreeMap<String, String> {
    let mut labels = namespace_labels(component);
    labels.insert(INSTANCE_LABEL.to_owned(), instance.to_owned());
    labels
}

/// The labels of an object the operator makes for the namespace rather than for one custom
/// resource (a ServiceAccount, the proof-keys Secret): name, component and `managed-by`.
pub fn namespace_labels(component: &str) -> BTreeMap<String, String> {
    BTreeMap::from([
        ("app.kubernetes.io/name".to_owned(), "dlock".to_owned()),
        (
            "app.kubernetes.io/component".to_owned(),
            component.to_owned(),
        ),
        (
            "app.kubernetes.io/managed-by".to_owned(),
            MANAGED_BY.to_owned(),
        ),
    ])
}

/// The metadata of an object of the namespace (see [`namespace_labels`]).
pub fn namespace_meta(name: &str, namespace: &str, component: &str) -> ObjectMeta {
    ObjectMeta {
        name: Some(name.to_owned()),
        namespace: Some(namespace.to_owned()),
        labels: Some(namespace_labels(component)),
        ..ObjectMeta::default()
    }
}

/// The metadata of an object built for a workload: its name, labels and owner reference.
pub fn workload_meta(workload: &Workload, name: String) -> ObjectMeta {
    owned_meta(
        name,
        &workload.namespace,
        labels(workload.component, &workload.instance),
        &workload.owner,
    )
}

pub fn owned_meta(
    name: String,
    namespace: &str,
    labels: BTreeMap<String, String>,
    owner: &OwnerReference,
) -> ObjectMeta {
    ObjectMeta {
        name: Some(name),
        namespace: Some(namespace.to_owned()),
        labels: Some(labels),
        owner_references: Some(vec![owner.clone()]),
        ..ObjectMeta::default()
    }
}
