use std::collections::BTreeMap;

use k8s_openapi::api::batch::v1::{Job, JobSpec};
use k8s_openapi::api::core::v1::{
    ConfigMap, ConfigMapKeySelector, Container, ContainerPort, EnvVar, EnvVarSource, KeyToPath,
    PodSpec, SecretVolumeSource, Volume, VolumeMount,
};

use sha2::{Digest, Sha256};

use super::deployment::restricted_security_context;
use crate::validate::{TokenSource, ValidatedBatch};

/// The manifest's file name inside `/config` of the executor pod.
pub const MANIFEST_FILE: &str = "payoutbatch.yaml";
/// Attempts of the executor pod. Re-running is safe: every payout id and idempotency key derives
/// from the batch name and item key, so a retried pod resumes the same payouts.
pub const EXECUTOR_BACKOFF_LIMIT: i32 = 6;

/// The audience of the executor's projected service-account token: the services' default
/// `auth.tokenreview.audiences`.
pub const TOKEN_AUDIENCE: &str = "dlock";
/// Where the projected token is mounted.
pub const TOKEN_DIR: &str = "/var/run/secrets/dlock/executor";
/// Seconds a projected token lives; kubelet rotates it at 80 % and `dlock run` re-reads the file.
pub const TOKEN_EXPIRATION_SECONDS: i64 = 3600;
/// Where the executor's credential Secret (`spec.executor.credentialSecret`) is mounted.
pub const CREDENTIAL_SECRET_DIR: &str = "/etc/dlock/secrets/credential";

/// One key of a Secret as a read-only file: the Secret mounted as the directory `dir` with only
/// that key in it (a directory, never a subPath, so kubelet updates the file when the Secret
/// changes). Returns the mount, the volume and the file's path. A Job's secret is a file and
/// never an environment variable: whoever may read the pod's spec (`kubectl describe`), the
/// process's environment (`/proc/<pid>/environ`) or a crash dump would see a variable's value.
pub fn secret_key_file(
    volume: &str,
    dir: &str,
    secret: &crate::crd::SecretKeyRef,
) -> (VolumeMount, Volume, String) {
    let mount = super::read_only_mount(volume, dir);
    let volume = Volume {
        name: volume.to_owned(),
        secret: Some(SecretVolumeSource {
            secret_name: Some(secret.name.clone()),
            items: Some(vec![KeyToPath {
                key: secret.key.clone(),
                path: secret.key.clone(),
                mode: None,
            }]),
            optional: Some(false),
            ..SecretVolumeSource::default()
        }),
        ..Volume::default()
    };
    (mount, volume, format!("{dir}/{}", secret.key))
}

impl ValidatedBatch {
    pub fn manifest_name(&self) -> String {
        format!("{}-manifest", self.name)
    }
    pub fn job_name(&self) -> String {
        format!("{}-executor", self.name)
    }
}

/// The executor's `X-Owner-Id`: `<identity>/<batch>`, bounded to the contract's 64 characters
/// and always bound to the identity (the services accept the identity itself or
/// `<identity>/…`). A longer one keeps its first 55 characters and ends in `-` and 8 hex digits of
/// its SHA-256, so two long ids that share a prefix still differ and the same batch always gets
/// the same id; an identity too long to leave room for that is the owner id by itself. `None`
/// when the identity alone exceeds 64 characters.
pub fn executor_owner_id(identity: &str, batch: &str) -> Option<String> {
    let max = dlock_contract::headers::OWNER_ID_LEN_MAX;
    let full = format!("{identity}/{batch}");
    if full.chars().count() <= max {
        return Some(full);
    }
    let digest = Sha256::digest(full.as_bytes());
    let hash: String = digest.iter().take(4).map(|b| format!("{b:02x}")).collect();
    let keep = max - 1 - hash.len();
    if identity.chars().count() < keep {
        let prefix: String = full.chars().take(keep).collect();
        return Some(format!("{prefix}-{hash}"));
    }
    (identity.chars().count() <= max).then(|| identity.to_owned())
}

/// The labels of a batch's objects and its executor pods. `app.kubernetes.io/component:
/// executor`; the batch is named by `dlock.io/instance`, never `app.kubernetes.io/instance`
/// (Argo CD's tracking label).
/// Where an executor pod serves `/metrics` (`dlock run --metrics-listen`).
pub const EXECUTOR_METRICS_PORT: i32 = 9090;

pub fn batch_labels(batch: &str) -> BTreeMap<String, String> {
    super::owned_labels("executor", batch)
}

/// The manifest ConfigMap: the Job reads the batch from here, never from the API server.
/// The manifest ConfigMap's key that holds the rail read timeout, read by the executor as
/// `DLOCK_RAIL_READ_TIMEOUT_MS` when its pod starts.
pub const RAIL_READ_TIMEOUT_KEY: &str = "rail-read-timeout-ms";

pub fn manifest_config_map(batch: &ValidatedBatch) -> ConfigMap {
    ConfigMap {
        metadata: super::owned_meta(
            batch.manifest_name(),
            &batch.namespace,
            batch_labels(&batch.name),
            &batch.owner,
        ),
        data: Some(BTreeMap::from([
            (MANIFEST_FILE.to_owned(), batch.manifest_yaml.clone()),
            (
                RAIL_READ_TIMEOUT_KEY.to_owned(),
                batch.rail_read_timeout_ms.to_string(),
            ),
        ])),
        ..ConfigMap::default()
    }
}

/// `DLOCK_CREDENTIAL_FILE`: the file of the executor's token, from its Secret or projected.
fn credential_env(token: &TokenSource) -> EnvVar {
    let path = match token {
        TokenSource::Secret(secret) => format!("{CREDENTIAL_SECRET_DIR}/{}", secret.key),
        TokenSource::ProjectedServiceAccountToken { .. } => format!("{TOKEN_DIR}/token"),
    };
    super::env("DLOCK_CREDENTIAL_FILE", path)
}

/// The annotation on the executor Job with [`template_hash`] of the pod template it was created
/// with.
pub const TEMPLATE_HASH_ANNOTATION: &str = "dlock.io/template-hash";

/// A short SHA-256 of a Job's pod template, to tell whether an existing Job was built from the
/// same template as the one the operator would build now.
pub fn template_hash(job: &Job) -> String {
    let template = job
        .spec
        .as_ref()
        .map(|s| serde_json::to_vec(&s.template).unwrap_or_default())
        .unwrap_or_default();
    Sha256::digest(&template)
        .iter()
        .take(8)
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// The executor Job: `dlock run -f /config/payoutbatch.yaml` against the services.
///
/// A Job's pod template is immutable, so nothing that may change while a batch runs is in it:
/// the worker count and the batch size come from the manifest ConfigMap (`dlock run` uses
/// `spec.workers` and `spec.batchMax` when `--workers` and `--batch-max` are absent), and the
/// controller creates the Job once and never patches it.
pub fn executor_job(batch: &ValidatedBatch) -> Job {
    let (volume_mounts, volumes) = executor_volumes(batch);
    let mut job = Job {
        metadata: super::owned_meta(
            batch.job_name(),
            &batch.namespace,
            batch_labels(&batch.name),
            &batch.owner,
        ),
        spec: Some(JobSpec {
            backoff_limit: Some(EXECUTOR_BACKOFF_LIMIT),
            parallelism: Some(1),
            completions: Some(1),
            template: super::run_once_template(
                batch_labels(&batch.name),
                &batch.pod,
                PodSpec {
                    service_account_name: Some(batch.credential.service_account_name.clone()),
                    containers: vec![executor_container(batch, volume_mounts)],
                    volumes: Some(volumes),
                    ..PodSpec::default()
                },
            ),
            ..JobSpec::default()
        }),
        ..Job::default()
    };
    job.metadata.annotations = Some(BTreeMap::from([(
        TEMPLATE_HASH_ANNOTATION.to_owned(),
        template_hash(&job),
    )]));
    job
}

/// The executor's environment: the services' URLs, its identity and credential, and the rail's
/// read timeout from the manifest ConfigMap.
fn executor_env(batch: &ValidatedBatch) -> Vec<EnvVar> {
    [
        ("DLOCK_LOCK_SERVER", &batch.lock_server_url),
        ("DLOCK_PAYMENT_RESOURCE", &batch.payment_resource_url),
        ("DLOCK_RAIL_PROXY", &batch.rail_proxy_url),
    ]
    .into_iter()
    .map(|(name, value)| EnvVar {
        name: name.to_owned(),
        value: Some(value.clone()),
        ..EnvVar::default()
    })
    .chain([
        super::env("DLOCK_LOG_FORMAT", "json"),
        super::env("DLOCK_IDENTITY", batch.credential.identity.clone()),
    ])
    .chain(
        batch
            .ca_secret
            .as_deref()
            .map(|secret| super::ca_trust(secret).2),
    )
    .chain([
        credential_env(&batch.credential.token),
        EnvVar {
            name: "DLOCK_RAIL_READ_TIMEOUT_MS".to_owned(),
            value_from: Some(EnvVarSource {
                config_map_key_ref: Some(ConfigMapKeySelector {
                    name: batch.manifest_name(),
                    key: RAIL_READ_TIMEOUT_KEY.to_owned(),
                    optional: Some(true),
                }),
                ..EnvVarSource::default()
            }),
            ..EnvVar::default()
        },
    ])
    .collect()
}

/// The executor's mounts and volumes: the manifest and the credential (its Secret's key, or a
/// projected service-account token), each a file.
fn executor_volumes(batch: &ValidatedBatch) -> (Vec<VolumeMount>, Vec<Volume>) {
    let (manifest_mount, manifest_volume) = super::config_volume("manifest", batch.manifest_name());
    let mut volume_mounts = vec![manifest_mount];
    let mut volumes = vec![manifest_volume];
    if let Some(secret) = &batch.ca_secret {
        let (mount, volume, _) = super::ca_trust(secret);
        volume_mounts.push(mount);
        volumes.push(volume);
    }
    if let TokenSource::Secret(secret) = &batch.credential.token {
        let (mount, volume, _) = secret_key_file("credential", CREDENTIAL_SECRET_DIR, secret);
        volume_mounts.push(mount);
        volumes.push(volume);
    }
    if let TokenSource::ProjectedServiceAccountToken { audience } = &batch.credential.token {
        let (mount, volume) = super::projected_token("credential", TOKEN_DIR, audience);
        volume_mounts.push(mount);
        volumes.push(volume);
    }
    (volume_mounts, volumes)
}

/// The executor container: `dlock run -f` on the manifest, serving its metrics.
fn executor_container(batch: &ValidatedBatch, volume_mounts: Vec<VolumeMount>) -> Container {
    Container {
        name: "executor".to_owned(),
        image: Some(batch.image.clone()),
        args: Some(vec![
            "run".to_owned(),
            "-f".to_owned(),
            format!("/config/{MANIFEST_FILE}"),
            "--owner-id".to_owned(),
            batch.credential.owner_id.clone(),
            // The operator registered the payouts before it made this Job: the executor's
            // identity only runs them (docs/contract.md#roles).
            "--no-register".to_owned(),
            // The executor's own metrics (cycles by outcome, backlog age) for
            // the chart's PodMonitor, on the port named like the services'.
            "--metrics-listen".to_owned(),
            format!("0.0.0.0:{EXECUTOR_METRICS_PORT}"),
        ]),
        ports: Some(vec![ContainerPort {
            name: Some("http".to_owned()),
            container_port: EXECUTOR_METRICS_PORT,
            protocol: Some("TCP".to_owned()),
            ..ContainerPort::default()
        }]),
        env: Some([executor_env(batch), super::telemetry_env()].concat()),
        volume_mounts: Some(volume_mounts),
        resources: Some(batch.pod.resources.clone()),
        security_context: Some(restricted_security_context()),
        ..Container::default()
    }
}

#[cfg(test)]
mod tests {
    use super::executor_owner_id;

    fn id(identity: &str, batch: &str) -> String {
        executor_owner_id(identity, batch).unwrap_or_else(|| panic!("no owner id for {identity}"))
    }

    #[test]
    fn the_executor_owner_id_is_bound_to_its_identity_within_64_characters() {
        assert_eq!(
            id("executor", "payroll-2026-12"),
            "executor/payroll-2026-12"
        );
        let batch = "b".repeat(63);
        for identity in [
            "executor",
            "system:serviceaccount:payments-eu:default",
            &"i".repeat(54),
        ] {
            let long = id(identity, &batch);
            assert_eq!(long.chars().count(), 64, "{long}");
            assert!(long.starts_with(&format!("{identity}/")), "{long}");
            assert!(
                dlock_contract::headers::check_owner_id("ownerId", &long).is_ok(),
                "{long}"
            );
            assert_eq!(long, id(identity, &batch), "stable");
            assert_ne!(
                long,
                id(identity, &format!("{}c", "b".repeat(62))),
                "distinct"
            );
        }
        // Exactly 64 stays as it is.
        let exact = format!("{}/{}", "n".repeat(30), "x".repeat(33));
        assert_eq!(id(&"n".repeat(30), &"x".repeat(33)), exact);
        // No room for `<identity>/…`: the identity alone, which the services also accept.
        let sa = format!("system:serviceaccount:{}:default", "n".repeat(34));
        assert_eq!(id(&sa, "payroll"), sa);
        assert_eq!(executor_owner_id(&"i".repeat(65), "payroll"), None);
    }
}
