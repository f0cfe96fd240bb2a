//! Every builder's whole output, compared with an expected object (inline JSON for the small
//! ones, committed YAML snapshots for the rest).

mod fencing_proofs;
mod jobs;
mod lock_mirror;
mod network;
mod pods;
mod services;
mod tls;

use dlock_operator::build::{
    config_map, deployment, job, lock, network_policy, pdb, proof_keys, reconciler, service,
    service_account,
};
use dlock_operator::validate;
use serde_json::json;

use crate::fixtures::{self, assert_snapshot, settings};

/// The object a builder made serialises to exactly `expected`.
#[track_caller]
fn assert_json(built: &impl serde::Serialize, expected: serde_json::Value) {
    assert_eq!(serde_json::to_value(built).unwrap(), expected);
}

fn owner(kind: &str, name: &str, uid: &str) -> serde_json::Value {
    json!({
        "apiVersion": "dlock.io/v1alpha1",
        "controller": true,
        "kind": kind,
        "name": name,
        "uid": uid,
    })
}

/// The labels of an object the operator makes: `dlock.io/instance`, never Argo CD's tracking
/// label `app.kubernetes.io/instance`.
fn labels(component: &str, instance: &str) -> serde_json::Value {
    json!({
        "app.kubernetes.io/component": component,
        "dlock.io/instance": instance,
        "app.kubernetes.io/managed-by": "dlock-operator",
        "app.kubernetes.io/name": "dlock",
    })
}

/// The metadata of an object named like the service custom resource (`kind`, `name`) it is made
/// for.
fn workload_meta(kind: &str, name: &str) -> serde_json::Value {
    object_meta(
        name,
        labels(name, name),
        owner(kind, name, &format!("uid-{name}")),
    )
}

/// The metadata of an object the operator makes for a custom resource in `default`.
fn object_meta(
    name: &str,
    labels: serde_json::Value,
    owner: serde_json::Value,
) -> serde_json::Value {
    json!({
        "name": name,
        "namespace": "default",
        "labels": labels,
        "ownerReferences": [owner],
    })
}

/// The immutable selector labels of a workload's pods.
fn selector(component: &str, instance: &str) -> serde_json::Value {
    json!({
        "app.kubernetes.io/component": component,
        "app.kubernetes.io/instance": instance,
        "app.kubernetes.io/name": "dlock",
    })
}
