use std::collections::BTreeMap;

use k8s_openapi::api::batch::v1::{CronJob, CronJobSpec, Job, JobSpec, JobTemplateSpec};
use k8s_openapi::api::core::v1::{
    Capabilities, Container, EnvVar, EnvVarSource, PodSecurityContext, PodSpec, PodTemplateSpec,
    SecretKeySelector, SecurityContext,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

use super::deployment::RUN_AS_USER;
use crate::validate::ValidatedReconciliation;

/// The reconciler's objects' labels. `app.kubernetes.io/component: reconciler`.
pub fn reconciler_labels(instance: &str) -> BTreeMap<String, String> {
    BTreeMap::from([
        ("app.kubernetes.io/name".to_owned(), "dlock".to_owned()),
        (
            "app.kubernetes.io/component".to_owned(),
            "reconciler".to_owned(),
        ),
        ("app.kubernetes.io/instance".to_owned(), instance.to_owned()),
        (
            "app.kubernetes.io/managed-by".to_owned(),
            super::MANAGED_BY.to_owned(),
        ),
    ])
}

pub fn object_name(reconciliation: &ValidatedReconciliation) -> String {
    format!("{}-reconcile", reconciliation.name)
}

/// The reconciler's Job spec: `dlock reconcile --json`, which reports and never repairs. One
/// attempt: a report that found something is an answer, not a failure to retry.
fn job_spec(reconciliation: &ValidatedReconciliation) -> JobSpec {
    JobSpec {
        backoff_limit: Some(0),
        template: PodTemplateSpec {
            metadata: Some(ObjectMeta {
                labels: Some(reconciler_labels(&reconciliation.name)),
                ..ObjectMeta::default()
            }),
            spec: Some(PodSpec {
                restart_policy: Some("Never".to_owned()),
                automount_service_account_token: Some(false),
                containers: vec![Container {
                    name: "reconciler".to_owned(),
                    image: Some(reconciliation.image.clone()),
                    args: Some(vec!["reconcile".to_owned(), "--json".to_owned()]),
                    env: Some(vec![
                        EnvVar {
                            name: "DLOCK_PAYDB".to_owned(),
                            value_from: Some(EnvVarSource {
                                secret_key_ref: Some(SecretKeySelector {
                                    name: reconciliation.paydb.name.clone(),
                                    key: reconciliation.paydb.key.clone(),
                                    optional: Some(false),
                                }),
                                ..EnvVarSource::default()
                            }),
                            ..EnvVar::default()
                        },
                        EnvVar {
                            name: "DLOCK_RAIL".to_owned(),
                            value: Some(reconciliation.rail_url.clone()),
                            ..EnvVar::default()
                        },
                    ]),
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
    }
}

/// A one-off run (no schedule).
pub fn reconciler_job(reconciliation: &ValidatedReconciliation) -> Job {
    Job {
        metadata: super::owned_meta(
            object_name(reconciliation),
            &reconciliation.namespace,
            reconciler_labels(&reconciliation.name),
            &reconciliation.owner,
        ),
        spec: Some(job_spec(reconciliation)),
        ..Job::default()
    }
}

/// A scheduled run. `Forbid`: two reconcilers at once would only report the same thing twice.
pub fn reconciler_cron_job(reconciliation: &ValidatedReconciliation, schedule: &str) -> CronJob {
    CronJob {
        metadata: super::owned_meta(
            object_name(reconciliation),
            &reconciliation.namespace,
            reconciler_labels(&reconciliation.name),
            &reconciliation.owner,
        ),
        spec: Some(CronJobSpec {
            schedule: schedule.to_owned(),
            concurrency_policy: Some("Forbid".to_owned()),
            successful_jobs_history_limit: Some(3),
            failed_jobs_history_limit: Some(3),
            job_template: JobTemplateSpec {
                metadata: Some(ObjectMeta {
                    labels: Some(reconciler_labels(&reconciliation.name)),
                    ..ObjectMeta::default()
                }),
                spec: Some(job_spec(reconciliation)),
            },
            ..CronJobSpec::default()
        }),
        ..CronJob::default()
    }
}
