use std::collections::BTreeMap;

use k8s_openapi::api::batch::v1::{CronJob, CronJobSpec, Job, JobSpec, JobTemplateSpec};
use k8s_openapi::api::core::v1::{Container, PodSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

use super::deployment::restricted_security_context;
use crate::validate::ValidatedReconciliation;

/// The reconciler's objects' and pods' labels. `app.kubernetes.io/component: reconciler`; the
/// Reconciliation is named by `dlock.io/instance`, never `app.kubernetes.io/instance` (Argo CD's
/// tracking label).
pub fn reconciler_labels(instance: &str) -> BTreeMap<String, String> {
    super::owned_labels("reconciler", instance)
}

/// Where the reconciler's paydb URL Secret (`spec.databaseUrlSecret`) is mounted.
pub const PAYDB_SECRET_DIR: &str = "/etc/dlock/secrets/paydb";

/// Where `dlock reconcile` writes its findings summary: the container's termination message.
pub const TERMINATION_LOG: &str = "/dev/termination-log";

/// The labels that select one Reconciliation's reconciler pods (every run, once or scheduled).
pub fn reconciler_selector(instance: &str) -> BTreeMap<String, String> {
    let mut labels = reconciler_labels(instance);
    labels.remove("app.kubernetes.io/managed-by");
    labels
}

pub fn object_name(reconciliation: &ValidatedReconciliation) -> String {
    format!("{}-reconcile", reconciliation.name)
}

/// The reconciler's Job spec: `dlock reconcile --json`, which reports and never repairs, and
/// leaves a JSON summary of its findings as the container's termination message. One
/// attempt: a report that found something is an answer, not a failure to retry.
fn job_spec(reconciliation: &ValidatedReconciliation) -> JobSpec {
    let (paydb_mount, paydb_volume, paydb_file) =
        super::job::secret_key_file("paydb", PAYDB_SECRET_DIR, &reconciliation.paydb);
    // An `https://` stub is trusted through the `ca.crt` of the namespace's TLS Secret.
    let ca = reconciliation.ca_secret.as_deref().map(super::ca_trust);
    JobSpec {
        backoff_limit: Some(0),
        template: super::run_once_template(
            reconciler_labels(&reconciliation.name),
            &reconciliation.pod,
            PodSpec {
                containers: vec![Container {
                    name: "reconciler".to_owned(),
                    image: Some(reconciliation.image.clone()),
                    args: Some(vec!["reconcile".to_owned(), "--json".to_owned()]),
                    env: Some(
                        [
                            vec![
                                // paydb's URL (its password in it) as a file, never a variable.
                                super::env("DLOCK_PAYDB_FILE", paydb_file.clone()),
                                super::env("DLOCK_RAIL", reconciliation.rail_url.clone()),
                                // The compact findings summary the operator reads into status.
                                super::env("DLOCK_TERMINATION_LOG", TERMINATION_LOG),
                            ],
                            super::telemetry_env(),
                            ca.iter().map(|(_, _, env)| env.clone()).collect(),
                        ]
                        .concat(),
                    ),
                    termination_message_path: Some(TERMINATION_LOG.to_owned()),
                    termination_message_policy: Some("FallbackToLogsOnError".to_owned()),
                    volume_mounts: Some(
                        [paydb_mount]
                            .into_iter()
                            .chain(ca.as_ref().map(|(mount, _, _)| mount.clone()))
                            .collect(),
                    ),
                    resources: Some(reconciliation.pod.resources.clone()),
                    security_context: Some(restricted_security_context()),
                    ..Container::default()
                }],
                volumes: Some(
                    [paydb_volume]
                        .into_iter()
                        .chain(ca.map(|(_, volume, _)| volume))
                        .collect(),
                ),
                ..PodSpec::default()
            },
        ),
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
