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

/// The fixtures' LockServer as the operator validates it.
fn validated_lock_server() -> dlock_operator::workload::Workload {
    validate::lock_server(&fixtures::lock_server(), &settings()).unwrap()
}

/// The fixtures' PaymentResource as the operator validates it.
fn validated_payment_resource() -> dlock_operator::workload::Workload {
    validate::payment_resource(&fixtures::payment_resource(), &settings()).unwrap()
}

/// The fixtures' RailProxy (with its stub) as the operator validates it.
fn validated_rail_proxy() -> validate::ValidatedRail {
    validate::rail_proxy(&fixtures::rail_proxy(), &settings()).unwrap()
}

/// `object` as the operator validates it for a PaymentResource that lets its executor pick no
/// service account or credential of its own.
fn validate_batch(
    object: &dlock_operator::crd::PayoutBatch,
) -> Result<validate::ValidatedBatch, validate::Invalid> {
    validate::payout_batch(object, &settings(), &Default::default())
}

/// The field [`validate_batch`] names when it refuses `object`.
#[track_caller]
fn refused_field(object: &dlock_operator::crd::PayoutBatch) -> String {
    validate_batch(object).unwrap_err().field
}

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

/// The whole object of the type (`apiVersion`, `kind`) the operator makes for a service custom
/// resource (`kind`, `name`), named like it: its type, its metadata and `fields`.
fn workload_object(
    (api_version, kind): (&str, &str),
    (owner_kind, name): (&str, &str),
    fields: serde_json::Value,
) -> serde_json::Value {
    let mut object = json!({
        "apiVersion": api_version,
        "kind": kind,
        "metadata": object_meta(
            name,
            labels(name, name),
            owner(owner_kind, name, &format!("uid-{name}")),
        ),
    });
    let (serde_json::Value::Object(object_fields), serde_json::Value::Object(fields)) =
        (&mut object, fields)
    else {
        panic!("an object's fields are a JSON object");
    };
    object_fields.extend(fields);
    object
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
