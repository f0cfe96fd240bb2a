//! The Jobs the operator runs: a PayoutBatch's executor and the reconciler.

use dlock_contract::payout_batch;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::ResourceExt;

use super::service_name;
use super::{
    Invalid, READ_TIMEOUT_MS_DEFAULT, Settings, invalid, namespace_of, owner_of,
    service_account_identity,
};
use crate::build::job::{TOKEN_AUDIENCE, executor_owner_id};
use crate::crd::PayoutBatch;
use crate::workload::{PodSettings, service_resources, service_url};

/// The service account of executor pods when `spec.executor.serviceAccountName` is absent: the
/// namespace's executor account, which the operator makes (`build::service_account::executor`)
/// and every service it deploys maps to the executor role.
pub const EXECUTOR_SERVICE_ACCOUNT_DEFAULT: &str = "dlock-executor";

/// What the platform's PaymentResource lets a PayoutBatch pick for its executor besides the
/// defaults (docs/threat-model.md#deployments-made-by-the-operator): whoever may create a
/// PayoutBatch must not run it as another ServiceAccount (the operator's, a treasury's) nor mount
/// another Secret of the namespace as its credential.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ExecutorAllowance {
    /// `spec.executorServiceAccounts` of the PaymentResource.
    pub service_accounts: Vec<String>,
    /// `spec.executorCredentialSecrets` of the PaymentResource.
    pub credential_secrets: Vec<String>,
    /// The PaymentResource the lists come from, for the messages.
    pub payment_resource: String,
}

impl ExecutorAllowance {
    /// The lists of `object`, the PaymentResource named `name`; none when it does not exist.
    pub fn of(name: &str, object: Option<&crate::crd::PaymentResource>) -> Self {
        let spec = object.map(|o| &o.spec);
        Self {
            service_accounts: spec
                .and_then(|s| s.executor_service_accounts.clone())
                .unwrap_or_default(),
            credential_secrets: spec
                .and_then(|s| s.executor_credential_secrets.clone())
                .unwrap_or_default(),
            payment_resource: name.to_owned(),
        }
    }

    /// Exactly what `object` names: for the operator's own calls on a deleted batch, which use
    /// only the services' URLs, never the executor's credential.
    pub fn named_by(object: &PayoutBatch) -> Self {
        let executor = object.spec.executor.as_ref();
        Self {
            service_accounts: executor
                .and_then(|e| e.service_account_name.clone())
                .into_iter()
                .collect(),
            credential_secrets: executor
                .and_then(|e| e.credential_secret.as_ref())
                .map(|s| s.name.clone())
                .into_iter()
                .collect(),
            payment_resource: payment_resource_name(object).to_owned(),
        }
    }
}

/// The PaymentResource a batch names (`spec.paymentResource`, else `payment-resource`).
pub fn payment_resource_name(object: &PayoutBatch) -> &str {
    object
        .spec
        .payment_resource
        .as_deref()
        .unwrap_or("payment-resource")
}

/// A validated PayoutBatch: the executor's manifest and where the services are.
#[derive(Clone, Debug, PartialEq)]
pub struct ValidatedBatch {
    pub name: String,
    pub namespace: String,
    pub image: String,
    pub workers: i32,
    /// The manifest in the format `dlock run -f` reads (docs/design.md#payout-batch), built from
    /// the spec.
    pub manifest_yaml: String,
    pub lock_server_url: String,
    pub payment_resource_url: String,
    pub rail_proxy_url: String,
    /// The RailProxy the executor submits through (`spec.railProxy`, else `rail-proxy`).
    pub rail_proxy_name: String,
    /// That RailProxy's read timeout towards the rail: a submit waits this plus 2 s
    /// (docs/contract.md#s3-8), or it gives up while the proxy still waits and both sides record
    /// ambiguity. The controller reads it from the RailProxy; it travels in the manifest ConfigMap,
    /// not in the Job's immutable template.
    pub rail_read_timeout_ms: i64,
    /// How the executor authenticates to the services.
    pub credential: ExecutorCredential,
    /// The namespace's TLS Secret whose `ca.crt` the executor trusts, when a service it calls
    /// serves TLS (set by the controller from the services' objects).
    pub ca_secret: Option<String>,
    pub pod: crate::workload::PodSettings,
    pub owner: OwnerReference,
}

/// The executor's identity and where its bearer token comes from.
#[derive(Clone, Debug, PartialEq)]
pub struct ExecutorCredential {
    /// `DLOCK_IDENTITY`: the identity the token authenticates as.
    pub identity: String,
    /// `--owner-id`: `<identity>/<batch>`, bound to the identity (`auth.owner-binding`).
    pub owner_id: String,
    pub service_account_name: String,
    pub token: TokenSource,
}

#[derive(Clone, Debug, PartialEq)]
pub enum TokenSource {
    /// This Secret key as a file under [`crate::build::job::CREDENTIAL_SECRET_DIR`], named by
    /// `DLOCK_CREDENTIAL_FILE`.
    Secret(crate::crd::SecretKeyRef),
    /// A projected service-account token with this audience, as `DLOCK_CREDENTIAL_FILE`.
    ProjectedServiceAccountToken { audience: String },
}

/// The executor's identity, owner id and token source (`spec.executor`).
pub fn executor_credential(
    spec: Option<&crate::crd::ExecutorSpec>,
    namespace: &str,
    batch: &str,
    allowance: &ExecutorAllowance,
) -> Result<ExecutorCredential, Invalid> {
    let default = crate::crd::ExecutorSpec::default();
    let spec = spec.unwrap_or(&default);
    let service_account_name = spec
        .service_account_name
        .clone()
        .unwrap_or_else(|| EXECUTOR_SERVICE_ACCOUNT_DEFAULT.to_owned());
    if service_account_name != EXECUTOR_SERVICE_ACCOUNT_DEFAULT
        && !allowance.service_accounts.contains(&service_account_name)
    {
        return Err(invalid(
            "spec.executor.serviceAccountName",
            format!(
                "the executor may not run as {service_account_name:?}: leave the field out to \
                 run as {EXECUTOR_SERVICE_ACCOUNT_DEFAULT} (the operator makes it), or ask the \
                 platform team to list it in spec.executorServiceAccounts of the \
                 PaymentResource {:?}",
                allowance.payment_resource
            ),
        ));
    }
    if let Some(secret) = &spec.credential_secret
        && !allowance.credential_secrets.contains(&secret.name)
    {
        return Err(invalid(
            "spec.executor.credentialSecret",
            format!(
                "the Secret {:?} is not one the executor may mount: leave the field out to \
                 authenticate with the service account's token, or ask the platform team to \
                 list it in spec.executorCredentialSecrets of the PaymentResource {:?}",
                secret.name, allowance.payment_resource
            ),
        ));
    }
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
///
/// `allowance` is what the batch's PaymentResource lets it pick for its executor.
pub fn payout_batch(
    object: &PayoutBatch,
    settings: &Settings,
    allowance: &ExecutorAllowance,
) -> Result<ValidatedBatch, Invalid> {
    let spec = &object.spec;
    let name = object.name_any();
    let namespace = namespace_of(object)?;
    let workers = spec.workers.unwrap_or(payout_batch::WORKERS_DEFAULT as i32);
    let mut manifest = payout_batch::PayoutBatch::new(
        &name,
        Some(&namespace),
        // A negative count becomes 0, which the validator refuses as out of range.
        u32::try_from(workers).unwrap_or(0),
        spec.payouts.clone(),
    );
    // The batch size travels in the manifest, as the worker count does: `dlock run` uses
    // `spec.batchMax` when `--batch-max` is absent. A negative size becomes 0 and is refused.
    if let Some(batch_max) = spec.batch_max {
        manifest.spec.batch_max = u32::try_from(batch_max).unwrap_or(0);
    }
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
    let credential = executor_credential(spec.executor.as_ref(), &namespace, &name, allowance)?;
    Ok(ValidatedBatch {
        credential,
        ca_secret: None,
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
    /// The namespace's TLS Secret whose `ca.crt` the reconciler trusts, when the stub it reads
    /// serves TLS (set by the controller from the RailProxy).
    pub ca_secret: Option<String>,
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
        ca_secret: None,
        owner: owner_of(object)?,
        namespace,
    })
}
