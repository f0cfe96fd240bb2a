//! The generated CRDs: structural schemas, known formats, the printer columns people see, the
//! committed `crds/` current, and the CEL rules evaluated offline (kube-cel).

use dlock_operator::crd::{self, Lock, LockRevocation, LockServer, PayoutBatch, RailProxy};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceColumnDefinition;
use kube::CustomResourceExt;
use serde_json::{Value, json};

use crate::fixtures;

/// The formats the API server knows; any other is an error at CRD creation.
const KNOWN_FORMATS: &[&str] = &[
    "int32",
    "int64",
    "float",
    "double",
    "byte",
    "date",
    "date-time",
    "duration",
    "password",
    "uri",
    "email",
    "hostname",
    "ipv4",
    "ipv6",
    "cidr",
    "mac",
    "uuid",
];

fn check_structural(path: &str, schema: &Value, problems: &mut Vec<String>) {
    let Some(object) = schema.as_object() else {
        problems.push(format!("{path}: not an object"));
        return;
    };
    for forbidden in ["$ref", "definitions", "$defs", "oneOf"] {
        if object.contains_key(forbidden) {
            problems.push(format!("{path}: has {forbidden}"));
        }
    }
    let escapes = object.contains_key("x-kubernetes-int-or-string")
        || object.contains_key("x-kubernetes-preserve-unknown-fields");
    if !object.contains_key("type") && !escapes {
        problems.push(format!("{path}: no type"));
    }
    if let Some(format) = object.get("format").and_then(Value::as_str)
        && !KNOWN_FORMATS.contains(&format)
    {
        problems.push(format!("{path}: unknown format {format}"));
    }
    if let Some(properties) = object.get("properties").and_then(Value::as_object) {
        for (name, property) in properties {
            check_structural(&format!("{path}.{name}"), property, problems);
        }
    }
    if let Some(items) = object.get("items") {
        check_structural(&format!("{path}[]"), items, problems);
    }
    if let Some(additional) = object.get("additionalProperties")
        && additional.is_object()
    {
        check_structural(&format!("{path}{{}}"), additional, problems);
    }
}

fn schema_of(
    crd: &k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition,
) -> Value {
    serde_json::to_value(
        crd.spec.versions[0]
            .schema
            .as_ref()
            .and_then(|s| s.open_api_v3_schema.as_ref())
            .expect("a schema"),
    )
    .expect("serializes")
}

#[test]
fn every_crd_schema_is_structural_with_known_formats_only() {
    for (plural, crd) in crd::all() {
        let mut problems = Vec::new();
        check_structural(plural, &schema_of(&crd), &mut problems);
        assert!(problems.is_empty(), "{plural}: {problems:#?}");
        let version = &crd.spec.versions[0];
        assert_eq!(crd.spec.group, "dlock.io");
        assert_eq!(version.name, "v1alpha1");
        assert_eq!(crd.spec.scope, "Namespaced");
        assert!(
            version
                .subresources
                .as_ref()
                .and_then(|s| s.status.as_ref())
                .is_some(),
            "{plural}: no status subresource"
        );
        assert!(
            crd.spec
                .names
                .short_names
                .as_ref()
                .is_some_and(|s| !s.is_empty()),
            "{plural}: no short name"
        );
        let columns: Vec<String> = version
            .additional_printer_columns
            .iter()
            .flatten()
            .map(|c| c.name.to_uppercase())
            .collect();
        assert!(
            columns.contains(&"READY".to_owned()),
            "{plural}: no READY column"
        );
    }
}

/// The printer columns of the Lock CRD.
fn lock_columns() -> Vec<CustomResourceColumnDefinition> {
    Lock::crd().spec.versions[0]
        .additional_printer_columns
        .clone()
        .unwrap_or_default()
}

/// `kubectl get locks` shows KEY, HOLDER, TOKEN, EXPIRES, AGE (READY and the revocation only with
/// `-o wide`).
#[test]
fn kubectl_get_locks_shows_key_holder_token_expires_age() {
    let columns = lock_columns();
    let default: Vec<(String, String)> = columns
        .iter()
        .filter(|c| c.priority.unwrap_or(0) == 0)
        .map(|c| (c.name.to_uppercase(), c.json_path.clone()))
        .collect();
    assert_eq!(
        default,
        vec![
            ("KEY".to_owned(), ".spec.key".to_owned()),
            ("HOLDER".to_owned(), ".status.holder".to_owned()),
            ("TOKEN".to_owned(), ".status.token".to_owned()),
            ("EXPIRES".to_owned(), ".status.expiresAt".to_owned()),
            ("AGE".to_owned(), ".metadata.creationTimestamp".to_owned()),
        ]
    );
}

/// The committed `crds/` are what the types generate (CI runs `scripts/check-crds` too).
#[test]
fn the_committed_crds_are_current() {
    let dir = tempfile_dir();
    crd::write_all(&dir).unwrap();
    let committed = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../crds");
    for (plural, _) in crd::all() {
        let name = format!("{plural}.yaml");
        let generated = std::fs::read_to_string(dir.join(&name)).unwrap();
        let on_disk = std::fs::read_to_string(committed.join(&name)).unwrap_or_default();
        assert!(
            generated == on_disk,
            "crds/{name} is stale: run `cargo run -q -p dlock -- crdgen` and commit crds/"
        );
    }
    let _ = std::fs::remove_dir_all(dir);
}

fn tempfile_dir() -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("dlock-crds-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

fn cel<K: CustomResourceExt>(object: &Value, old: Option<&Value>) -> Result<(), String> {
    kube_cel::validate(&schema_of(&K::crd()), object, old).map_err(|e| format!("{e:?}"))
}

#[test]
fn the_lock_server_backend_cannot_be_switched_live() {
    let old = serde_json::to_value(fixtures::lock_server()).unwrap();
    let mut switched = fixtures::lock_server();
    switched.spec.backend = fixtures::etcd_backend();
    let new = serde_json::to_value(switched).unwrap();
    let error = cel::<LockServer>(&new, Some(&old)).unwrap_err();
    assert!(error.contains("spec.backend is immutable"), "{error}");
    let mut scaled = fixtures::lock_server();
    scaled.spec.service.replicas = Some(5);
    cel::<LockServer>(&serde_json::to_value(scaled).unwrap(), Some(&old)).unwrap();
    cel::<LockServer>(&new, None).unwrap();
}

#[test]
fn the_lock_backend_names_exactly_the_section_it_sets() {
    let mut both = serde_json::to_value(fixtures::lock_server()).unwrap();
    both["spec"]["backend"]["etcd"] = json!({"endpoints": ["http://etcd:2379"]});
    let error = cel::<LockServer>(&both, None).unwrap_err();
    assert!(error.contains("exactly the section"), "{error}");
}

#[test]
fn a_rail_proxy_names_either_a_rail_or_the_stub() {
    let mut both = serde_json::to_value(fixtures::rail_proxy()).unwrap();
    both["spec"]["railUrl"] = json!("https://rail.example");
    assert!(cel::<RailProxy>(&both, None).is_err());
    cel::<RailProxy>(&serde_json::to_value(fixtures::rail_proxy()).unwrap(), None).unwrap();
}

#[test]
fn an_accepted_batch_keeps_its_payouts() {
    let mut accepted = serde_json::to_value(fixtures::payout_batch()).unwrap();
    accepted["status"] = json!({"accepted": true});
    let mut changed = accepted.clone();
    changed["spec"]["payouts"][0]["amountMinor"] = json!(999_999);
    let error = cel::<PayoutBatch>(&changed, Some(&accepted)).unwrap_err();
    assert!(
        error.contains("cannot change once the batch is accepted"),
        "{error}"
    );
    // Workers may change: they do not change who is paid what.
    let mut more_workers = accepted.clone();
    more_workers["spec"]["workers"] = json!(16);
    cel::<PayoutBatch>(&more_workers, Some(&accepted)).unwrap();
    // Before acceptance the payouts may still be edited.
    let fresh = serde_json::to_value(fixtures::payout_batch()).unwrap();
    let mut edited = fresh.clone();
    edited["spec"]["payouts"][0]["amountMinor"] = json!(1);
    cel::<PayoutBatch>(&edited, Some(&fresh)).unwrap();
}

#[test]
fn a_lock_revocation_is_immutable() {
    let old = json!({
        "apiVersion": "dlock.io/v1alpha1", "kind": "LockRevocation",
        "metadata": {"name": "r1", "namespace": "default"},
        "spec": {"key": "payout:acct-17", "accountId": "acct-17", "reason": "worker wedged for 10 min", "revokedBy": "oncall"},
    });
    let mut new = old.clone();
    new["spec"]["reason"] = json!("a different reason entirely");
    assert!(cel::<LockRevocation>(&new, Some(&old)).is_err());
    cel::<LockRevocation>(&old, Some(&old)).unwrap();
}

/// A `type: date` column renders an age, and kubectl prints `<invalid>` for a time in the future:
/// every lock's expiry is in the future, so EXPIRES is the RFC 3339 timestamp as a string.
#[test]
fn the_expires_column_is_readable_for_a_future_time() {
    let columns = lock_columns();
    let expires = columns
        .iter()
        .find(|c| c.name.eq_ignore_ascii_case("expires"))
        .expect("an EXPIRES column");
    assert_eq!(expires.type_, "string");
    assert_eq!(expires.json_path, ".status.expiresAt");
}

/// Short names are global in a cluster's discovery: one that another popular CRD uses (Tekton's
/// `pr` for PipelineRun, `tr` for TaskRun; Argo's `wf`, `app`) makes `kubectl get` ambiguous.
#[test]
fn short_names_are_unique_and_avoid_well_known_ones() {
    let taken = [
        "pr", "tr", "wf", "app", "apps", "po", "svc", "cm", "deploy", "ds", "rs",
    ];
    let mut seen = std::collections::BTreeSet::new();
    for (plural, crd) in dlock_operator::crd::all() {
        for short in crd.spec.names.short_names.unwrap_or_default() {
            assert!(!taken.contains(&short.as_str()), "{plural}: {short}");
            assert!(seen.insert(short.clone()), "{plural}: {short} twice");
        }
    }
}
