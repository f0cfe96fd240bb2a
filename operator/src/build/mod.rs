//! Pure builders, one per Kubernetes kind. Each takes validated input only and returns the whole
//! object the operator applies; tests compare the whole object with an expected one.

pub mod config_map;
pub mod deployment;
pub mod job;
pub mod lock;
pub mod network_policy;
pub mod pdb;
pub mod reconciler;
pub mod service;

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};

use crate::workload::{Component, Workload};

pub const MANAGED_BY: &str = "dlock-operator";

/// The labels that select a workload's pods. Never change them: a Deployment's selector is
/// immutable, so a new label here would need every Deployment deleted and re-created.
pub fn selector_labels(component: Component, instance: &str) -> BTreeMap<String, String> {
    BTreeMap::from([
        ("app.kubernetes.io/name".to_owned(), "dlock".to_owned()),
        (
            "app.kubernetes.io/component".to_owned(),
            component.as_str().to_owned(),
        ),
        ("app.kubernetes.io/instance".to_owned(), instance.to_owned()),
    ])
}

/// The selector labels plus `managed-by`.
pub fn labels(component: Component, instance: &str) -> BTreeMap<String, String> {
    let mut labels = selector_labels(component, instance);
    labels.insert(
        "app.kubernetes.io/managed-by".to_owned(),
        MANAGED_BY.to_owned(),
    );
    labels
}

/// The metadata of an object built for a workload: its name, labels and owner reference.
pub fn workload_meta(workload: &Workload, name: String) -> ObjectMeta {
    owned_meta(
        name,
        &workload.namespace,
        labels(workload.component, &workload.instance),
        &workload.owner,
    )
}

pub fn owned_meta(
    name: String,
    namespace: &str,
    labels: BTreeMap<String, String>,
    owner: &OwnerReference,
) -> ObjectMeta {
    ObjectMeta {
        name: Some(name),
        namespace: Some(namespace.to_owned()),
        labels: Some(labels),
        owner_references: Some(vec![owner.clone()]),
        ..ObjectMeta::default()
    }
}
