use std::collections::BTreeMap;

use k8s_openapi::api::apps::v1::{
    Deployment, DeploymentSpec, DeploymentStrategy, RollingUpdateDeployment,
};
use k8s_openapi::api::core::v1::{
    Capabilities, Container, ContainerPort, EmptyDirVolumeSource, EnvVar, HTTPGetAction, Lifecycle,
    LifecycleHandler, PodSecurityContext, PodSpec, PodTemplateSpec, Probe, SecretVolumeSource,
    SecurityContext, SleepAction, Volume, VolumeMount,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use sha2::{Digest, Sha256};

use super::config_map::CONFIG_FILE;
use crate::workload::{
    FENCING_PROOF_KEYS_DIR, PORT, RAIL_TOKEN_DIR, SECRET_FILES_DIR, TLS_DIR, Workload,
};

/// The pod annotation that rolls the pods when their configuration changes.
pub const CONFIG_HASH_ANNOTATION: &str = "dlock.io/config-hash";
/// The non-root user of the `dlock` image.
pub const RUN_AS_USER: i64 = 65532;
/// Where the LockServer's `spec.backend.etcd.tlsSecret` is mounted.
pub const ETCD_TLS_DIR: &str = "/etc/dlock/etcd-tls";
/// Where the Secret of `spec.backend.etcd.auth.passwordSecret` is mounted.
pub const ETCD_AUTH_DIR: &str = "/etc/dlock/etcd-auth";

/// The first 16 hex digits of the configuration's SHA-256.
pub fn config_hash(config_toml: &str) -> String {
    let digest = Sha256::digest(config_toml.as_bytes());
    digest.iter().take(8).map(|b| format!("{b:02x}")).collect()
}

/// A probe of `path` on the `http` port; over HTTPS when the service serves TLS (the kubelet
/// does not check the certificate of a probe).
fn http_probe(path: &str, period_seconds: i32, failure_threshold: i32, tls: bool) -> Probe {
    Probe {
        http_get: Some(HTTPGetAction {
            path: Some(path.to_owned()),
            port: IntOrString::String("http".to_owned()),
            scheme: tls.then(|| "HTTPS".to_owned()),
            ..HTTPGetAction::default()
        }),
        period_seconds: Some(period_seconds),
        failure_threshold: Some(failure_threshold),
        ..Probe::default()
    }
}

/// The container security context of every container the operator builds: no privilege
/// escalation, a read-only root, not root, no capabilities.
pub fn restricted_security_context() -> SecurityContext {
    SecurityContext {
        allow_privilege_escalation: Some(false),
        read_only_root_filesystem: Some(true),
        run_as_non_root: Some(true),
        capabilities: Some(Capabilities {
            drop: Some(vec!["ALL".to_owned()]),
            ..Capabilities::default()
        }),
        ..SecurityContext::default()
    }
}

/// The pod security context of every pod the operator builds: a fixed non-root user and the
/// runtime's default seccomp profile; `fs_group` where the pod writes to its volumes.
pub fn pod_security_context(fs_group: bool) -> PodSecurityContext {
    PodSecurityContext {
        run_as_non_root: Some(true),
        run_as_user: Some(RUN_AS_USER),
        run_as_group: Some(RUN_AS_USER),
        fs_group: fs_group.then_some(RUN_AS_USER),
        seccomp_profile: crate::workload::runtime_default_seccomp(),
        ..PodSecurityContext::default()
    }
}

/// The Deployment of one dlock service.
///
/// - `maxUnavailable: 0`: a rollout adds a ready pod before it removes one.
/// - Readiness on `/readyz`, which answers only when the backend is reachable. Each service
///   applies its sqlx migrations at start, before it listens, so a new pod is never ready (and
///   never receives traffic) before the migrations are in: readiness gating is the migration gate,
///   with no separate init container or Job.
/// - Liveness on `/healthz` (process up), with room for a slow backend at start.
/// - The Cloud SQL Auth Proxy, when asked for, runs as a native sidecar (an init container with
///   `restartPolicy: Always`), so it is up before the service starts and stops after it.
pub fn deployment(workload: &Workload) -> Deployment {
    let selector = super::selector_labels(workload.component, &workload.instance);
    let mut pod_labels = super::pod_labels(workload.component, &workload.instance);
    pod_labels.extend(selector.clone());

    // Observability only: a service takes no security setting from its environment (its
    // secrets are files, `secret_files`), and refuses to start if it finds one there.
    let mut env: Vec<EnvVar> = vec![super::env("DLOCK_LOG_FORMAT", "json")];
    env.extend(super::telemetry_env());

    let (volume_mounts, volumes) = volumes(workload);
    let main = service_container(workload, env, volume_mounts);
    let init_containers = workload
        .cloud_sql
        .as_ref()
        .map(|cloud_sql| vec![cloud_sql_proxy(cloud_sql)]);

    Deployment {
        metadata: super::workload_meta(workload, workload.name.clone()),
        spec: Some(DeploymentSpec {
            replicas: Some(workload.replicas),
            selector: LabelSelector {
                match_labels: Some(selector),
                ..LabelSelector::default()
            },
            strategy: Some(DeploymentStrategy {
                type_: Some("RollingUpdate".to_owned()),
                rolling_update: Some(RollingUpdateDeployment {
                    max_unavailable: Some(IntOrString::Int(0)),
                    max_surge: Some(IntOrString::Int(1)),
                }),
            }),
            template: PodTemplateSpec {
                metadata: Some(ObjectMeta {
                    labels: Some(pod_labels),
                    annotations: Some(BTreeMap::from([(
                        CONFIG_HASH_ANNOTATION.to_owned(),
                        config_hash(&workload.config_toml),
                    )])),
                    ..ObjectMeta::default()
                }),
                spec: Some(PodSpec {
                    init_containers,
                    containers: vec![main],
                    volumes: Some(volumes),
                    termination_grace_period_seconds: Some(
                        workload.termination_grace_period_seconds,
                    ),
                    // The token is mounted only for the TokenReview calls of `auth.mode =
                    // "tokenreview"`; a pod without a service account needs none, nor does a
                    // rail proxy that has one only for its projected rail token.
                    automount_service_account_token: Some(
                        workload.service_account.is_some() && !workload.auth_disabled,
                    ),
                    service_account_name: workload.service_account.clone(),
                    image_pull_secrets: workload.pod.pull_secrets(),
                    security_context: Some(pod_security_context(true)),
                    ..PodSpec::default()
                }),
            },
            ..DeploymentSpec::default()
        }),
        ..Deployment::default()
    }
}

/// The service's mounts and volumes: its configuration, the data directory when it keeps one,
/// and the Secrets it reads as files.
fn volumes(workload: &Workload) -> (Vec<VolumeMount>, Vec<Volume>) {
    let (config_mount, config_volume) = super::config_volume("config", workload.name.clone());
    let mut volume_mounts = vec![config_mount];
    let mut volumes = vec![config_volume];
    if workload.data_volume {
        volume_mounts.push(VolumeMount {
            name: "data".to_owned(),
            mount_path: "/data".to_owned(),
            ..VolumeMount::default()
        });
        volumes.push(Volume {
            name: "data".to_owned(),
            empty_dir: Some(EmptyDirVolumeSource::default()),
            ..Volume::default()
        });
    }
    // The etcd TLS and password Secrets, as directories (never a subPath): kubelet updates
    // them when cert-manager renews the certificate or the password changes, and the lock
    // server re-reads the files every 10 s and reconnects with them.
    for (volume, dir, secret) in [
        ("etcd-tls", ETCD_TLS_DIR, &workload.etcd_tls_secret),
        ("etcd-auth", ETCD_AUTH_DIR, &workload.etcd_password_secret),
    ] {
        let Some(secret) = secret else { continue };
        let (mount, volume) = secret_directory(volume, dir, secret);
        volume_mounts.push(mount);
        volumes.push(volume);
    }

    // The database URL and the operator token, each a directory mount of its Secret (never
    // environment variables), named in the configuration by `<key>-file`.
    for file in &workload.secret_files {
        let dir = format!("{SECRET_FILES_DIR}/{}", file.volume);
        let (mount, volume) =
            secret_directory(&format!("secret-{}", file.volume), &dir, &file.secret.name);
        volume_mounts.push(mount);
        volumes.push(volume);
    }

    if let Some(secret) = &workload.fencing_proof_keys_secret {
        // A directory, never a subPath: kubelet updates a directory mount when the Secret
        // changes, and the service re-reads the file within 2 s (key rotation without a restart).
        let (mount, volume) =
            secret_directory("fencing-proof-keys", FENCING_PROOF_KEYS_DIR, secret);
        volume_mounts.push(mount);
        volumes.push(volume);
    }
    if let Some(secret) = &workload.tls_secret {
        // A directory too: the listener re-reads tls.crt and tls.key every 10 s, so a
        // certificate cert-manager renews is served without a restart.
        let (mount, volume) = secret_directory("tls", TLS_DIR, secret);
        volume_mounts.push(mount);
        volumes.push(volume);
    }
    if workload.rail_token {
        let (mount, volume) =
            super::projected_token("rail-token", RAIL_TOKEN_DIR, super::job::TOKEN_AUDIENCE);
        volume_mounts.push(mount);
        volumes.push(volume);
    }
    (volume_mounts, volumes)
}

/// A Secret mounted read-only as the directory `dir`.
fn secret_directory(name: &str, dir: &str, secret: &str) -> (VolumeMount, Volume) {
    let mount = super::read_only_mount(name, dir);
    let volume = Volume {
        name: name.to_owned(),
        secret: Some(SecretVolumeSource {
            secret_name: Some(secret.to_owned()),
            ..SecretVolumeSource::default()
        }),
        ..Volume::default()
    };
    (mount, volume)
}

/// The service's own container: `dlock serve <component>` on its configuration file.
fn service_container(
    workload: &Workload,
    env: Vec<EnvVar>,
    volume_mounts: Vec<VolumeMount>,
) -> Container {
    Container {
        name: workload.component.as_str().to_owned(),
        image: Some(workload.image.clone()),
        args: Some(vec![
            "serve".to_owned(),
            workload.component.as_str().to_owned(),
            "--config".to_owned(),
            format!("/config/{CONFIG_FILE}"),
        ]),
        env: Some(env),
        ports: Some(vec![ContainerPort {
            name: Some("http".to_owned()),
            container_port: PORT,
            protocol: Some("TCP".to_owned()),
            ..ContainerPort::default()
        }]),
        readiness_probe: Some(http_probe("/readyz", 5, 3, workload.tls_secret.is_some())),
        // Keep serving while the Service's endpoints drop this pod, then stop (SIGTERM).
        lifecycle: Some(Lifecycle {
            pre_stop: Some(LifecycleHandler {
                sleep: Some(SleepAction {
                    seconds: crate::workload::PRE_STOP_SLEEP_SECONDS,
                }),
                ..LifecycleHandler::default()
            }),
            ..Lifecycle::default()
        }),
        liveness_probe: Some(Probe {
            initial_delay_seconds: Some(10),
            ..http_probe("/healthz", 10, 6, workload.tls_secret.is_some())
        }),
        volume_mounts: Some(volume_mounts),
        resources: Some(workload.pod.resources.clone()),
        security_context: Some(restricted_security_context()),
        ..Container::default()
    }
}

/// The Cloud SQL Auth Proxy sidecar.
fn cloud_sql_proxy(cloud_sql: &crate::workload::ValidCloudSql) -> Container {
    Container {
        name: "cloud-sql-proxy".to_owned(),
        image: Some(cloud_sql.image.clone()),
        args: Some(vec![
            "--port=5432".to_owned(),
            "--structured-logs".to_owned(),
            "--health-check".to_owned(),
            "--http-address=0.0.0.0".to_owned(),
            cloud_sql.instance_connection_name.clone(),
        ]),
        restart_policy: Some("Always".to_owned()),
        resources: Some(crate::workload::small_resources()),
        startup_probe: Some(Probe {
            http_get: Some(HTTPGetAction {
                path: Some("/startup".to_owned()),
                port: IntOrString::Int(9090),
                ..HTTPGetAction::default()
            }),
            period_seconds: Some(1),
            failure_threshold: Some(60),
            ..Probe::default()
        }),
        security_context: Some(restricted_security_context()),
        ..Container::default()
    }
}
