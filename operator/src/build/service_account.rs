use k8s_openapi::api::core::v1::ServiceAccount;

use crate::workload::SERVICE_ACCOUNT;

/// The services' service account of a namespace ([`SERVICE_ACCOUNT`]). Every LockServer,
/// PaymentResource and RailProxy of the namespace shares it, so it has no owner reference: one
/// owner would take it away from the others when deleted. It holds no permission of its own; the
/// chart's ClusterRoleBinding gives it `system:auth-delegator` (TokenReview).
pub fn service_account(namespace: &str) -> ServiceAccount {
    labelled(SERVICE_ACCOUNT, "service", namespace)
}

/// The executors' service account of a namespace
/// ([`crate::validate::EXECUTOR_SERVICE_ACCOUNT_DEFAULT`]), which a PayoutBatch's Job runs as
/// unless its PaymentResource allows another. Every batch of the namespace shares it, so it has
/// no owner reference either, and no permission: the services map it to the executor role
/// (`auth.tokenreview.service-accounts`), nothing in Kubernetes grants it anything.
pub fn executor(namespace: &str) -> ServiceAccount {
    labelled(
        crate::validate::EXECUTOR_SERVICE_ACCOUNT_DEFAULT,
        "executor",
        namespace,
    )
}

fn labelled(name: &str, component: &str, namespace: &str) -> ServiceAccount {
    ServiceAccount {
        metadata: super::namespace_meta(name, namespace, component),
        ..ServiceAccount::default()
    }
}
