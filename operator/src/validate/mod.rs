//! Validate: each raw custom resource becomes a validated value with resolved defaults, the only
//! input of the builders. An error here is permanent: the controller records it in a condition and
//! waits for the spec to change.
//!
//! By concern: [`workloads`] (LockServer, PaymentResource, RailProxy), [`jobs`] (PayoutBatch,
//! Reconciliation) and [`revocation`] (Lock, LockRevocation).

use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::Resource;

use crate::build::job::TOKEN_AUDIENCE;
use crate::crd::AuthMode;
use dlock_contract::service_config;

mod jobs;
mod revocation;
mod workloads;

pub use jobs::{
    EXECUTOR_SERVICE_ACCOUNT_DEFAULT, ExecutorAllowance, ExecutorCredential, TokenSource,
    ValidatedBatch, ValidatedReconciliation, executor_credential, payment_resource_name,
    payout_batch, reconciliation,
};
pub use revocation::{
    NamespaceTargets, REVOKE_REASON_LEN_MIN, RevocationAsk, RevocationTarget, check_ask,
    fence_target, lock_revocation, lock_revocation_ask, revocation_target,
};
pub use workloads::{ValidatedRail, lock_server, payment_resource, rail_proxy};

/// The rail proxy's read timeout when the spec names none (the service's own default).
pub const READ_TIMEOUT_MS_DEFAULT: i64 = 8_000;
pub const REPLICAS_DEFAULT: i32 = 2;

/// What the operator knows that the spec does not say.
#[derive(Clone, Debug, PartialEq)]
pub struct Settings {
    /// The `dlock` image every pod runs when the spec names none.
    pub image: String,
    /// The operator's own identity at the services (`system:serviceaccount:<ns>:<sa>`), written
    /// into their `auth.operator-identities` so its revocations are allowed.
    pub operator_identity: String,
    /// The operator's own namespace: the services' NetworkPolicies let its pods in.
    pub operator_namespace: String,
    /// The images a custom resource may name besides [`Settings::image`] (the chart's
    /// `allowedImages`): the platform decides what runs with the services' Secrets, not whoever
    /// may create a PayoutBatch.
    pub allowed_images: Vec<String>,
    /// The ServiceAccount allow-list every service gets as `auth.tokenreview.service-accounts`
    /// (the chart's `serviceAuth.roles`, `<namespace>/<name>=<role>[+<role>…]`): which
    /// ServiceAccounts are executors, registrars, treasurers or readers (docs/contract.md#roles).
    /// A ServiceAccount named nowhere is refused by the services.
    pub service_account_roles: Vec<String>,
}

impl Settings {
    /// The image a pod runs: `named` (the spec's `field`) when the platform allows it, the
    /// operator's own image when the spec names none.
    pub fn image_for(&self, field: &str, named: Option<&String>) -> Result<String, Invalid> {
        match named {
            None => Ok(self.image.clone()),
            Some(image) if *image == self.image || self.allowed_images.contains(image) => {
                Ok(image.clone())
            }
            Some(image) => Err(invalid(
                field,
                format!(
                    "the image {image:?} is not one this operator runs: leave {field} out to run \
                     the operator's own image ({}), or ask the platform team to add it to the \
                     chart's allowedImages (the operator's --allowed-image){}",
                    self.image,
                    if self.allowed_images.is_empty() {
                        String::new()
                    } else {
                        format!("; allowed now: {}", self.allowed_images.join(", "))
                    }
                ),
            )),
        }
    }
}

/// The identity a service account's projected token authenticates as under TokenReview.
pub fn service_account_identity(namespace: &str, service_account: &str) -> String {
    format!("system:serviceaccount:{namespace}:{service_account}")
}

/// The `auth.*` part of a service's configuration: TokenReview with the audience `dlock` (the
/// executor's and the operator's projected tokens), and the operator as the only operator
/// identity.
///
/// `treasury` are the identities of the treasury role (`spec.auth.treasuryServiceAccounts`, as
/// TokenReview names them); none when empty: the services' default treasury identity is no
/// ServiceAccount's, so under TokenReview nobody may fund until the platform names one.
///
/// The allow-list is the chart's `serviceAuth.roles` plus the namespace's `dlock-executor` as an
/// executor: the ServiceAccount a PayoutBatch's Job runs as by default.
///
/// `spec.auth.mode: none` writes `auth.mode = "none"` and nothing else.
pub fn auth_config(
    settings: &Settings,
    auth: AuthMode,
    treasury: Vec<String>,
    namespace: &str,
) -> service_config::Auth {
    let mut service_accounts = settings.service_account_roles.clone();
    service_accounts.push(format!(
        "{namespace}/{EXECUTOR_SERVICE_ACCOUNT_DEFAULT}=executor"
    ));
    match auth {
        AuthMode::None => service_config::Auth::none(),
        AuthMode::TokenReview => service_config::Auth {
            mode: service_config::AuthMode::TokenReview,
            tokens_file: None,
            tokenreview_audiences: vec![TOKEN_AUDIENCE.to_owned()],
            operator_identities: vec![settings.operator_identity.clone()],
            treasury_identities: treasury,
            service_accounts,
        },
    }
}

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{field}: {message}")]
pub struct Invalid {
    pub field: String,
    pub message: String,
}

/// `name`, given in `field`, as a checked Service name.
fn service_name(field: &str, name: &str) -> Result<crate::workload::ServiceName, Invalid> {
    crate::workload::ServiceName::new(name).map_err(|m| invalid(field, m))
}

fn invalid(field: &str, message: impl Into<String>) -> Invalid {
    Invalid {
        field: field.to_owned(),
        message: message.into(),
    }
}

fn namespace_of<K: Resource>(object: &K) -> Result<String, Invalid> {
    object
        .meta()
        .namespace
        .clone()
        .ok_or_else(|| invalid("metadata.namespace", "the object has no namespace"))
}

fn owner_of<K: Resource<DynamicType = ()>>(object: &K) -> Result<OwnerReference, Invalid> {
    object
        .controller_owner_ref(&())
        .ok_or_else(|| invalid("metadata", "the object has no name or uid yet"))
}

#[cfg(test)]
mod tests;
