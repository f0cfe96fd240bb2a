//! The custom resources' schemas carry the contract's rules, from the contract's own constants:
//! the API server refuses a PayoutBatch item (and a Lock or LockRevocation key or account) the
//! services would refuse, naming its field, and the two cannot drift apart.

use dlock_contract::lock::{KEY_LEN_MAX as LOCK_KEY_LEN_MAX, KEY_PATTERN};
use dlock_contract::payment::{
    ACCOUNT_ID_LEN_MAX, ACCOUNT_ID_PATTERN, AMOUNT_MINOR_MAX, CURRENCIES, REFERENCE_LEN_MAX,
    REFERENCE_PATTERN,
};
use dlock_contract::payout_batch::{KEY_LEN_MAX, key_bytes_rule};
use dlock_operator::crd::{Lock, LockRevocation, PayoutBatch};
use kube::CustomResourceExt;
use serde_json::{Value, json};

/// The schema of `spec` of the CRD's only version.
fn spec_schema(
    crd: &k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition,
) -> Value {
    let versions = serde_json::to_value(&crd.spec.versions).unwrap();
    versions[0]["schema"]["openAPIV3Schema"]["properties"]["spec"].clone()
}

/// `field`'s pattern, lengths and CEL rules, as one value to compare whole.
fn string_rules(field: &Value) -> Value {
    json!({
        "type": field["type"],
        "pattern": field["pattern"],
        "minLength": field["minLength"],
        "maxLength": field["maxLength"],
        "x-kubernetes-validations": field["x-kubernetes-validations"],
    })
}

/// Each `(field, pattern, max)` of `fields` is a string that only the contract's `pattern` and
/// length (1 to `max`) hold: no other rule.
fn assert_pattern_fields(fields: &Value, expected: &[(&str, &str, usize)]) {
    for &(field, pattern, max) in expected {
        assert_eq!(
            string_rules(&fields[field]),
            json!({"type": "string", "pattern": pattern, "minLength": 1, "maxLength": max,
                   "x-kubernetes-validations": null}),
            "{field}"
        );
    }
}

#[test]
fn every_payout_item_field_carries_the_contracts_rule() {
    let spec = spec_schema(&PayoutBatch::crd());
    let item = &spec["properties"]["payouts"]["items"]["properties"];
    assert_pattern_fields(
        item,
        &[
            ("accountId", ACCOUNT_ID_PATTERN, ACCOUNT_ID_LEN_MAX),
            ("beneficiaryRef", REFERENCE_PATTERN, REFERENCE_LEN_MAX),
        ],
    );
    assert_eq!(
        string_rules(&item["key"]),
        json!({"type": "string", "pattern": null, "minLength": 1, "maxLength": KEY_LEN_MAX,
        "x-kubernetes-validations": [{
            "rule": key_bytes_rule(),
            "message": format!("must be 1 to {KEY_LEN_MAX} bytes"),
        }]})
    );
    // The currency is exactly one of the active codes `check_currency` accepts: an enum, no
    // pattern beside it.
    assert_eq!(item["currency"]["enum"], json!(CURRENCIES.as_slice()));
    assert_eq!(item["currency"]["pattern"], Value::Null);
    assert_eq!(item["currency"]["type"], "string");
    // schemars writes the bounds as floats; 10^15 is exact in one.
    let amount = &item["amountMinor"];
    assert_eq!(amount["type"], "integer");
    assert_eq!(amount["minimum"].as_f64(), Some(1.0));
    assert_eq!(amount["maximum"].as_f64(), Some(AMOUNT_MINOR_MAX as f64));
    assert_eq!(AMOUNT_MINOR_MAX as f64 as i64, AMOUNT_MINOR_MAX);
    assert_eq!(
        spec["properties"]["payouts"]["items"]["required"],
        json!([
            "accountId",
            "amountMinor",
            "beneficiaryRef",
            "currency",
            "key"
        ])
    );
}

#[test]
fn a_lock_and_a_revocation_name_a_key_and_an_account_by_the_contracts_rules() {
    for spec in [
        spec_schema(&Lock::crd()),
        spec_schema(&LockRevocation::crd()),
    ] {
        assert_pattern_fields(
            &spec["properties"],
            &[
                ("key", KEY_PATTERN, LOCK_KEY_LEN_MAX),
                ("accountId", ACCOUNT_ID_PATTERN, ACCOUNT_ID_LEN_MAX),
            ],
        );
    }
}

/// The batch-wide rules: the name's length (payout ids derive from it) and the workers' and the
/// batch size's ranges are the contract's, and the API server evaluates the name rule on create.
#[test]
fn a_batchs_name_and_workers_carry_the_contracts_bounds() {
    use dlock_contract::payout_batch::{BATCH_MAX_MAX, NAME_LEN_MAX, WORKERS_MAX};
    let crd = PayoutBatch::crd();
    let spec = spec_schema(&crd);
    assert_eq!(spec["properties"]["workers"]["minimum"].as_f64(), Some(1.0));
    assert_eq!(
        spec["properties"]["workers"]["maximum"].as_f64(),
        Some(f64::from(WORKERS_MAX))
    );
    assert_eq!(
        spec["properties"]["batchMax"]["minimum"].as_f64(),
        Some(1.0)
    );
    assert_eq!(
        spec["properties"]["batchMax"]["maximum"].as_f64(),
        Some(f64::from(BATCH_MAX_MAX))
    );
    assert_eq!(BATCH_MAX_MAX as usize, dlock_contract::batch::MAX_ITEMS);
    let openapi =
        serde_json::to_value(&crd.spec.versions).unwrap()[0]["schema"]["openAPIV3Schema"].clone();
    let rules = &openapi["x-kubernetes-validations"];
    assert!(
        rules
            .as_array()
            .unwrap()
            .iter()
            .any(|r| r["rule"] == dlock_operator::crd::name_rule()),
        "{rules}"
    );
    assert_eq!(
        dlock_operator::crd::name_rule(),
        format!("size(self.metadata.name) <= {NAME_LEN_MAX}")
    );
    let object = |name: &str| {
        json!({
            "apiVersion": "dlock.io/v1alpha1", "kind": "PayoutBatch",
            "metadata": {"name": name, "namespace": "default"},
            "spec": {"payouts": [{"key": "p1", "accountId": "acct-17", "amountMinor": 1,
                                  "currency": "EUR", "beneficiaryRef": "ben-1"}]},
        })
    };
    kube_cel::validate(&openapi, &object(&"b".repeat(NAME_LEN_MAX)), None).unwrap();
    let refused = kube_cel::validate(&openapi, &object(&"b".repeat(NAME_LEN_MAX + 1)), None)
        .map_err(|e| format!("{e:?}"))
        .unwrap_err();
    assert!(
        refused.contains("metadata.name must be at most"),
        "{refused}"
    );
}

/// L8 counts a revocation's reason and operator once trimmed: so do the schema's CEL rules, on
/// top of the lengths, with the contract's bounds.
#[test]
fn a_revocations_reason_and_operator_are_counted_trimmed_as_l8_counts_them() {
    use dlock_contract::lock::{REVOKE_REASON_LEN_MAX, REVOKE_REASON_LEN_MIN};
    use dlock_contract::payment::OPERATOR_LEN_MAX;
    use dlock_operator::crd::trimmed_at_least;
    let spec = spec_schema(&LockRevocation::crd());
    let fields = &spec["properties"];
    assert_eq!(
        string_rules(&fields["reason"]),
        json!({"type": "string", "pattern": null, "minLength": REVOKE_REASON_LEN_MIN,
        "maxLength": REVOKE_REASON_LEN_MAX, "x-kubernetes-validations": [{
            "rule": trimmed_at_least(REVOKE_REASON_LEN_MIN),
            "message": format!(
                "must be {REVOKE_REASON_LEN_MIN} to {REVOKE_REASON_LEN_MAX} characters once trimmed"
            ),
        }]})
    );
    assert_eq!(
        string_rules(&fields["revokedBy"]),
        json!({"type": "string", "pattern": null, "minLength": 1,
        "maxLength": OPERATOR_LEN_MAX, "x-kubernetes-validations": [{
            "rule": trimmed_at_least(1),
            "message": format!("must be 1 to {OPERATOR_LEN_MAX} characters once trimmed"),
        }]})
    );
    assert_eq!(trimmed_at_least(8), "self.trim().size() >= 8");

    // The rules evaluated (offline, as the API server would): eight characters, one of them
    // not a space, are refused; eight once trimmed are admitted.
    let openapi = serde_json::to_value(&LockRevocation::crd().spec.versions).unwrap()[0]["schema"]
        ["openAPIV3Schema"]
        .clone();
    let object = |reason: &str, revoked_by: &str| {
        json!({
            "apiVersion": "dlock.io/v1alpha1", "kind": "LockRevocation",
            "metadata": {"name": "r1", "namespace": "default"},
            "spec": {"key": "payout:acct-17", "accountId": "acct-17", "reason": reason,
                     "revokedBy": revoked_by},
        })
    };
    kube_cel::validate(&openapi, &object("  eight ch  ", "oncall"), None).unwrap();
    for (reason, by, field) in [
        ("   x    ", "oncall", "spec.reason"),
        ("  eight ch  ", "   ", "spec.revokedBy"),
    ] {
        let refused = kube_cel::validate(&openapi, &object(reason, by), None)
            .map_err(|e| format!("{e:?}"))
            .unwrap_err();
        assert!(refused.contains(field), "{reason:?} {by:?}: {refused}");
    }
}

/// The CEL rule counts bytes as `validate` does: a key of 128 two-byte characters fits the
/// schema's `maxLength` (characters) but not the contract, so the rule is what refuses it.
#[test]
fn the_key_rule_counts_bytes_because_the_contract_does() {
    let mut batch = dlock_contract::payout_batch::PayoutBatch::new(
        "b",
        None,
        1,
        vec![dlock_contract::payout_batch::PayoutItem {
            key: "é".repeat(KEY_LEN_MAX),
            account_id: "acct-1".into(),
            amount_minor: 1,
            currency: "EUR".into(),
            beneficiary_ref: "ben-1".into(),
        }],
    );
    let problems = batch.validate();
    assert_eq!(problems.len(), 1, "{problems:?}");
    assert_eq!(problems[0].field, "spec.payouts[0].key");
    batch.spec.payouts[0].key = "é".repeat(KEY_LEN_MAX / 2);
    assert_eq!(batch.validate(), []);
}
