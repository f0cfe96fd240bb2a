//! The Jobs the operator runs: a PayoutBatch's executor and the reconciler.

use dlock_contract::payout_batch;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::ResourceExt;

use super::service_name;
use super::{
    Invalid, READ_TIMEOUT_MS_DEFAULT, Settings, invalid, namespace_of, owner_of,
    service_account_identity,
};
use crate::build::job::{
    ExecutorCredential, TOKEN_AUDIENCE, TokenSource, ValidatedBatch, executor_owner_id,
};
use crate::crd::PayoutBatch;
use crate::workload::{PodSettings, service_resources, service_url};

/// The service account of executor pods when `spec.executor.serviceAccountName` is absent.
pub const EXECUTOR_SERVICE_ACCOUNT_DEFAULT: &str = "default";

/// The executor's identity, owner id and token source (`spec.executor`).
pub fn executor_credential(
    spec: Option<&crate::crd::ExecutorSpec>,
    namespace: &str,
    batch: &str,
) -> Result<ExecutorCredential, Invalid> {
    let default = crate::crd::ExecutorSpec::default();
    let spec = spec.unwrap_or(&default);
    let service_account_name = spec
        .service_account_name
        .clone()
        .unwrap_or_else(|| EXECUTOR_SERVICE_ACCOUNT_DEFAULT.to_owned());
    let service_account_identity = service_account_identity(namespace, &service_account_name);
    let given = spec
        .identity
        .as_deref()
        .map(str::trim)
        .filter(|i| !i.is_empty());
    let (identity, token) = match (&spec.credential_secret, given) {
        (Some(secret), Some(identity)) => {
            (identity.to_owned(), TokenSource::Secret(secret.clone()))
        }
        (Some(_), None) => {
            return Err(invalid(
                "spec.executor.identity",
                "credentialSecret needs the identity its token authenticates as",
            ));
        }
        (None, Some(identity)) if identity != service_account_identity => {
            return Err(invalid(
                "spec.executor.identity",
                format!(
                    "without credentialSecret the executor authenticates with its service \
                     account's token, as {service_account_identity}; name a credentialSecret \
                     for {identity:?}"
                ),
            ));
        }
        (None, _) => (
            service_account_identity,
            TokenSource::ProjectedServiceAccountToken {
                audience: TOKEN_AUDIENCE.to_owned(),
            },
        ),
    };
    let owner_id = executor_owner_id(&identity, batch).ok_or_else(|| {
        invalid(
            "spec.executor.identity",
            format!(
                "{identity:?} is longer than the 64 characters of an owner id; use a shorter \
                 service account name or a credentialSecret with a shorter identity"
            ),
        )
    })?;
    Ok(ExecutorCredential {
        identity,
        owner_id,
        service_account_name,
        token,
    })
}

/// The first of a batch's problems, with the others named in its message (a condition holds one
/// field; a person should still see every problem at once).
fn batch_invalid(problems: &[dlock_contract::payout_batch::Problem]) -> Option<Invalid> {
    const NAMED_MAX: usize = 5;
    let (first, others) = problems.split_first()?;
    let mut message = first.message.clone();
    if !others.is_empty() {
        let named: Vec<String> = others
            .iter()
            .take(NAMED_MAX)
            .map(|p| p.to_string())
            .collect();
        let rest = if others.len() > NAMED_MAX {
            "; …"
        } else {
            ""
        };
        message.push_str(&format!(
            " (and {} more: {}{rest})",
            others.len(),
            named.join("; ")
        ));
    }
    Some(invalid(&first.field, message))
}

/// The batch as the executor's manifest (docs/design.md#payout-batch, the format `dlock run -f`
/// reads), checked by the contract's validator, the one `dlock run -f` applies.
pub fn payout_batch(object: &PayoutBatch, settings: &Settings) -> Result<ValidatedBatch, Invalid> {
    let spec = &object.spec;
    let name = object.name_any();
    let namespace = namespace_of(object)?;
    let workers = spec.workers.unwrap_or(payout_batch::WORKERS_DEFAULT as i32);
    let manifest = payout_batch::PayoutBatch::new(
        &name,
        Some(&namespace),
        // A negative count becomes 0, which the validator refuses as out of range.
        u32::try_from(workers).unwrap_or(0),
        spec.payouts.clone(),
    );
    if let Some(invalid) = batch_invalid(&manifest.validate()) {
        return Err(invalid);
    }
    let manifest_yaml = serde_yaml_ng::to_string(&manifest)
        .map_err(|e| invalid("spec", format!("cannot be written as a manifest: {e}")))?;
    let url = |field: &str, spec: &Option<String>, default: &str| {
        service_name(field, spec.as_deref().unwrap_or(default)).map(|n| service_url(&n, &namespace))
    };
    let lock_server_url = url("spec.lockServer", &spec.lock_server, "lock-server")?;
    let payment_resource_url = url(
        "spec.paymentResource",
        &spec.payment_resource,
        "payment-resource",
    )?;
    let rail_proxy_url = url("spec.railProxy", &spec.rail_proxy, "rail-proxy")?;
    let credential = executor_credential(spec.executor.as_ref(), &namespace, &name)?;
    Ok(ValidatedBatch {
        credential,
        pod: PodSettings::from_options(&spec.pod, service_resources()),
        image: settings.image_for("spec.image", spec.image.as_ref())?,
        workers,
        manifest_yaml,
        lock_server_url,
        payment_resource_url,
        rail_proxy_url,
        rail_proxy_name: spec
            .rail_proxy
            .clone()
            .unwrap_or_else(|| "rail-proxy".to_owned()),
        rail_read_timeout_ms: READ_TIMEOUT_MS_DEFAULT,
        owner: owner_of(object)?,
        namespace: namespace.clone(),
        name,
    })
}

/// A validated Reconciliation: what the reconciler Job runs against.
#[derive(Clone, Debug, PartialEq)]
pub struct ValidatedReconciliation {
    pub name: String,
    pub namespace: String,
    pub image: String,
    pub schedule: Option<String>,
    pub paydb: crate::crd::SecretKeyRef,
    pub rail_url: String,
    pub pod: PodSettings,
    pub owner: OwnerReference,
}

pub fn reconciliation(
    object: &crate::crd::Reconciliation,
    settings: &Settings,
) -> Result<ValidatedReconciliation, Invalid> {
    let spec = &object.spec;
    let namespace = namespace_of(object)?;
    if let Some(schedule) = &spec.schedule
        && schedule.split_whitespace().count() != 5
    {
        return Err(invalid(
            "spec.schedule",
            "must be a five-field cron schedule (minute hour day month weekday)",
        ));
    }
    let rail_proxy = service_name(
        "spec.railProxy",
        spec.rail_proxy.as_deref().unwrap_or("rail-proxy"),
    )?;
    let rail_url = match &spec.rail_url {
        Some(url) => url.clone(),
        None => service_url(
            &service_name("spec.railProxy", &format!("{rail_proxy}-stub"))?,
            &namespace,
        ),
    };
    Ok(ValidatedReconciliation {
        pod: PodSettings::from_options(&spec.pod, service_resources()),
        name: object.name_any(),
        image: settings.image_for("spec.image", spec.image.as_ref())?,
        schedule: spec.schedule.clone(),
        paydb: spec.database_url_secret.clone(),
        rail_url,
        owner: owner_of(object)?,
        namespace,
    })
}
