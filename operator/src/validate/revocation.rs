//! Revocations, from a Lock's annotations or a LockRevocation: what they ask and where they go.

use dlock_contract::revoke::RevokeOrder;

use super::{Invalid, invalid, namespace_of};
use crate::crd::LockRevocation;
use crate::workload::{ServiceName, service_url};

/// Where a revocation goes and what it says.
#[derive(Clone, Debug, PartialEq)]
pub struct RevocationTarget {
    /// The contract's flow runs this order as it is, its operator and reason trimmed.
    pub order: RevokeOrder,
    pub lock_server_url: String,
    pub payment_resource_url: String,
    pub rail_proxy_url: String,
}

use dlock_contract::lock::REVOKE_REASON_LEN_MAX;
pub use dlock_contract::lock::REVOKE_REASON_LEN_MIN;
use dlock_contract::payment::OPERATOR_LEN_MAX;

/// The LockServer, PaymentResource and RailProxy objects present in a namespace, by name.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct NamespaceTargets {
    pub lock_servers: Vec<String>,
    pub payment_resources: Vec<String>,
    pub rail_proxies: Vec<String>,
}

/// Which enforcement point (or lock server) of a namespace a revocation goes to.
///
/// The rule: a name given explicitly (a LockRevocation's `spec.paymentResource`, `spec.railProxy`,
/// `spec.lockServer`; a Lock's `spec.lockServer`) is used as given. Otherwise the namespace must
/// hold exactly one object of the kind, and that one is used: with none there is nothing to
/// fence, and with several the operator cannot know which holds the account, so the revocation is
/// refused before anything is sent (name the target in a LockRevocation). Fixed service names are
/// never assumed: a fence pushed to a service that does not exist leaves the real one open.
pub fn fence_target(
    kind: &str,
    field: &str,
    named: Option<&str>,
    present: &[String],
) -> Result<ServiceName, Invalid> {
    let checked = |name: &str| ServiceName::new(name).map_err(|m| invalid(field, m));
    if let Some(name) = named.map(str::trim).filter(|n| !n.is_empty()) {
        // The operator's credential goes to this name: a Service name, of a dlock object that
        // exists here, never whatever the object says.
        let name = checked(name)?;
        if !present.iter().any(|p| p == name.as_str()) {
            return Err(invalid(
                field,
                format!(
                    "there is no {kind} named {name} in the namespace (present: {}); a \
                     revocation is sent only to the namespace's own {kind}",
                    if present.is_empty() {
                        "none".to_owned()
                    } else {
                        present.join(", ")
                    }
                ),
            ));
        }
        return Ok(name);
    }
    match present {
        [one] => checked(one),
        [] => Err(invalid(
            field,
            format!("no {kind} in the namespace; there is nothing to send the revocation to"),
        )),
        several => Err(invalid(
            field,
            format!(
                "{} {kind}s in the namespace ({}); name one in a LockRevocation",
                several.len(),
                several.join(", ")
            ),
        )),
    }
}

/// What a revocation asks for, before its targets are resolved.
#[derive(Clone, Debug, PartialEq)]
pub struct RevocationAsk<'a> {
    /// As the object says it: checked by [`check_ask`] with the object's own field names.
    pub order: RevokeOrder,
    /// Explicit names: lock server, payment resource, rail proxy.
    pub named: [Option<&'a str>; 3],
}

/// What a revocation must say, checked before any target is looked up.
pub fn check_ask(ask: &RevocationAsk<'_>) -> Result<(), Invalid> {
    let RevokeOrder {
        key,
        account_id,
        operator,
        reason,
        expected_token,
    } = &ask.order;
    let operator = operator.trim();
    if operator.is_empty() || operator.chars().count() > OPERATOR_LEN_MAX {
        return Err(invalid(
            "revokedBy",
            format!("must be 1 to {OPERATOR_LEN_MAX} characters"),
        ));
    }
    let reason_len = reason.trim().chars().count();
    if !(REVOKE_REASON_LEN_MIN..=REVOKE_REASON_LEN_MAX).contains(&reason_len) {
        return Err(invalid(
            "reason",
            format!(
                "must be {REVOKE_REASON_LEN_MIN} to {REVOKE_REASON_LEN_MAX} characters, got {reason_len}"
            ),
        ));
    }
    if account_id.is_empty() {
        return Err(invalid(
            "accountId",
            format!("{key:?} is not a payout lock key (payout:{{accountId}}); nothing to fence"),
        ));
    }
    if !dlock_contract::lock::key_is_valid(key) {
        return Err(invalid("key", "must be 1 to 128 of [a-zA-Z0-9:._-]"));
    }
    if !dlock_contract::payment::account_id_is_valid(account_id) {
        return Err(invalid(
            "accountId",
            dlock_contract::payment::ACCOUNT_ID_RULE,
        ));
    }
    if expected_token.is_some_and(|t| t <= 0) {
        return Err(invalid("expectedToken", "must be greater than 0"));
    }
    Ok(())
}

pub fn revocation_target(
    namespace: &str,
    ask: &RevocationAsk<'_>,
    present: &NamespaceTargets,
) -> Result<RevocationTarget, Invalid> {
    check_ask(ask)?;
    let [lock_server, payment_resource, rail_proxy] = ask.named;
    let lock_server = fence_target(
        "LockServer",
        "lockServer",
        lock_server,
        &present.lock_servers,
    )?;
    let payment_resource = fence_target(
        "PaymentResource",
        "paymentResource",
        payment_resource,
        &present.payment_resources,
    )?;
    let rail_proxy = fence_target("RailProxy", "railProxy", rail_proxy, &present.rail_proxies)?;
    Ok(RevocationTarget {
        order: RevokeOrder {
            operator: ask.order.operator.trim().to_owned(),
            reason: ask.order.reason.trim().to_owned(),
            ..ask.order.clone()
        },
        lock_server_url: service_url(&lock_server, namespace),
        payment_resource_url: service_url(&payment_resource, namespace),
        rail_proxy_url: service_url(&rail_proxy, namespace),
    })
}

/// The ask of a LockRevocation.
pub fn lock_revocation_ask(object: &LockRevocation) -> RevocationAsk<'_> {
    let spec = &object.spec;
    RevocationAsk {
        order: RevokeOrder {
            key: spec.key.clone(),
            account_id: spec.account_id.clone(),
            operator: spec.revoked_by.clone(),
            reason: spec.reason.clone(),
            expected_token: spec.expected_token,
        },
        named: [
            spec.lock_server.as_deref(),
            spec.payment_resource.as_deref(),
            spec.rail_proxy.as_deref(),
        ],
    }
}

pub fn lock_revocation(
    object: &LockRevocation,
    present: &NamespaceTargets,
) -> Result<RevocationTarget, Invalid> {
    revocation_target(
        &namespace_of(object)?,
        &lock_revocation_ask(object),
        present,
    )
}
