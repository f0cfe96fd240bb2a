use std::collections::BTreeMap;

use k8s_openapi::api::batch::v1::{Job, JobSpec};
use k8s_openapi::api::core::v1::{
    Capabilities, ConfigMap, ConfigMapVolumeSource, Container, EnvVar, PodSecurityContext, PodSpec,
    PodTemplateSpec, SecurityContext, Volume, VolumeMount,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};

use super::deployment::RUN_AS_USER;

/// The manifest's file name inside `/config` of the executor pod.
pub const MANIFEST_FILE: &str = "payoutbatch.yaml";
/// Attempts of the executor pod. Re-running is safe: every payout id and idempotency key derives
/// from the batch name and item key, so a retried pod resumes the same payouts.
pub const EXECUTOR_BACKOFF_LIMIT: i32 = 6;

/// A validated PayoutBatch: the executor's manifest and where the services are.
#[derive(Clone, Debug, PartialEq)]
pub struct ValidatedBatch {
    pub name: String,
    pub namespace: String,
    pub image: String,
    pub workers: i32,
    /// The manifest in the format `dlock run -f` reads (DESIGN §11), built from the spec.
    pub manifest_yaml: String,
    pub lock_server_url: String,
    pub payment_resource_url: String,
    pub rail_proxy_url: String,
    pub owner: OwnerReference,
}

impl ValidatedBatch {
    pub fn manifest_name(&self) -> String {
        format!("{}-manifest", self.name)
    }
    pub fn job_name(&self) -> String {
        format!("{}-executor", self.name)
    }
}

/// The labels of a batch's objects. `app.kubernetes.io/component: executor`.
pub fn batch_labels(batch: &str) -> BTreeMap<String, String> {
    BTreeMap::from([
        ("app.kubernetes.io/name".to_owned(), "dlock".to_owned()),
        (
            "app.kubernetes.io/component".to_owned(),
            "executor".to_owned(),
        ),
        ("app.kubernetes.io/instance".to_owned(), batch.to_owned()),
        (
            "app.kubernetes.io/managed-by".to_owned(),
            super::MANAGED_BY.to_owned(),
        ),
    ])
}

/// The manifest ConfigMap: the Job reads the batch from here, never from the API server.
pub fn manifest_config_map(batch: &ValidatedBatch) -> ConfigMap {
    ConfigMap {
        metadata: super::owned_meta(
            batch.manifest_name(),
            &batch.namespace,
            batch_labels(&batch.name),
            &batch.owner,
        ),
        data: Some(BTreeMap::from([(
            MANIFEST_FILE.to_owned(),
            batch.manifest_yaml.clone(),
        )])),
        ..ConfigMap::default()
    }
}

/// The executor Job: `dlock run -f /config/payoutbatch.yaml --workers N` against the services.
pub fn executor_job(batch: &ValidatedBatch) -> Job {
    let env = [
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
    .chain(std::iter::once(EnvVar {
        name: "DLOCK_LOG_FORMAT".to_owned(),
        value: Some("json".to_owned()),
        ..EnvVar::default()
    }))
    .collect();
    Job {
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
            template: PodTemplateSpec {
                metadata: Some(ObjectMeta {
                    labels: Some(batch_labels(&batch.name)),
                    ..ObjectMeta::default()
                }),
                spec: Some(PodSpec {
                    restart_policy: Some("Never".to_owned()),
                    automount_service_account_token: Some(false),
                    containers: vec![Container {
                        name: "executor".to_owned(),
                        image: Some(batch.image.clone()),
                        args: Some(vec![
                            "run".to_owned(),
                            "-f".to_owned(),
                            format!("/config/{MANIFEST_FILE}"),
                            "--workers".to_owned(),
                            batch.workers.to_string(),
                            "--owner-id".to_owned(),
                            format!("{}/{}", batch.namespace, batch.job_name()),
                        ]),
                        env: Some(env),
                        volume_mounts: Some(vec![VolumeMount {
                            name: "manifest".to_owned(),
                            mount_path: "/config".to_owned(),
                            read_only: Some(true),
                            ..VolumeMount::default()
                        }]),
                        security_context: Some(SecurityContext {
                            allow_privilege_escalation: Some(false),
                            read_only_root_filesystem: Some(true),
                            run_as_non_root: Some(true),
                            capabilities: Some(Capabilities {
                                drop: Some(vec!["ALL".to_owned()]),
                                ..Capabilities::default()
                            }),
                            ..SecurityContext::default()
                        }),
                        ..Container::default()
                    }],
                    volumes: Some(vec![Volume {
                        name: "manifest".to_owned(),
                        config_map: Some(ConfigMapVolumeSource {
                            name: batch.manifest_name(),
                            ..ConfigMapVolumeSource::default()
                        }),
                        ..Volume::default()
                    }]),
                    security_context: Some(PodSecurityContext {
                        run_as_non_root: Some(true),
                        run_as_user: Some(RUN_AS_USER),
                        run_as_group: Some(RUN_AS_USER),
                        ..PodSecurityContext::default()
                    }),
                    ..PodSpec::default()
                }),
            },
            ..JobSpec::default()
        }),
        ..Job::default()
    }
}
