//! The samples under `examples/` are valid custom resources, pass the CEL rules, and the
//! PayoutBatch sample is the very file `dlock run -f` takes.

use std::path::Path;

use dlock_operator::crd::{
    LockRevocation, LockServer, PaymentResource, PayoutBatch, RailProxy, Reconciliation,
};
use kube::CustomResourceExt;
use serde_json::Value;

fn documents(file: &str) -> Vec<Value> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../examples")
        .join(file);
    let text = std::fs::read_to_string(&path).unwrap();
    serde_yaml_ng::Deserializer::from_str(&text)
        .map(|d| serde::Deserialize::deserialize(d).unwrap())
        .collect()
}

fn check<K: CustomResourceExt + serde::de::DeserializeOwned>(document: &Value) {
    let mut object = document.clone();
    object["metadata"]["namespace"] = "default".into();
    serde_json::from_value::<K>(object.clone()).unwrap();
    let schema = serde_json::to_value(
        K::crd().spec.versions[0]
            .schema
            .clone()
            .unwrap()
            .open_api_v3_schema
            .unwrap(),
    )
    .unwrap();
    kube_cel::validate(&schema, &object, None).unwrap();
}

#[test]
fn every_sample_is_a_valid_custom_resource() {
    let mut seen = 0;
    for file in [
        "stack.yaml",
        "payoutbatch.yaml",
        "lockserver-etcd-cloudsql.yaml",
        "lockrevocation.yaml",
        "reconciliation.yaml",
    ] {
        for document in documents(file) {
            match document["kind"].as_str().unwrap() {
                "Secret" | "ServiceAccount" => continue,
                "LockServer" => check::<LockServer>(&document),
                "PaymentResource" => check::<PaymentResource>(&document),
                "RailProxy" => check::<RailProxy>(&document),
                "PayoutBatch" => check::<PayoutBatch>(&document),
                "LockRevocation" => check::<LockRevocation>(&document),
                "Reconciliation" => check::<Reconciliation>(&document),
                other => panic!("{file}: unexpected kind {other}"),
            }
            seen += 1;
        }
    }
    assert_eq!(seen, 8);
}

/// One manifest, two runners: the sample `kubectl apply -f` takes is the file `dlock run -f`
/// parses, and the manifest the operator hands its executor Job names the same payouts.
#[test]
fn the_payout_batch_sample_runs_unchanged_under_dlock_run() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/payoutbatch.yaml");
    let text = std::fs::read_to_string(path).unwrap();
    let local = dlock_executor::manifest::parse(&text).unwrap();

    let mut object: PayoutBatch = serde_yaml_ng::from_str(&text).unwrap();
    object.metadata.namespace = Some("default".to_owned());
    object.metadata.uid = Some("uid".to_owned());
    let batch = dlock_operator::validate::payout_batch(
        &object,
        &crate::fixtures::settings(),
        &Default::default(),
    )
    .unwrap();
    let in_cluster = dlock_executor::manifest::parse(&batch.manifest_yaml).unwrap();
    let ids = |b: &dlock_executor::PayoutBatch| {
        b.plan()
            .into_iter()
            .map(|p| (p.payout_id, p.idempotency_key))
            .collect::<Vec<_>>()
    };
    assert_eq!(ids(&local), ids(&in_cluster));
    assert_eq!(in_cluster.spec.workers, 8);
}
