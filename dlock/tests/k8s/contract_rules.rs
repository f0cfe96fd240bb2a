//! On the real API server: a PayoutBatch item, a Lock or a LockRevocation that the services would
//! refuse is refused at admission, by the schema the contract's constants generate, naming the
//! field; the user never learns of it later from `Degraded/InvalidSpec`.

use dlock_contract::headers::OWNER_ID_LEN_MAX;
use dlock_contract::payment::AMOUNT_MINOR_MAX;
use dlock_contract::payout_batch::{KEY_LEN_MAX, NAME_LEN_MAX};
use serde_json::{Value, json};

use crate::world::World;

/// A PayoutBatch of one good payout, with `field` of the item set to `value` when given.
fn batch(field: Option<(&str, Value)>) -> String {
    let mut item = json!({
        "key": "p1", "accountId": "acct-17", "amountMinor": 100, "currency": "EUR",
        "beneficiaryRef": "ben-1",
    });
    if let Some((field, value)) = field {
        item[field] = value;
    }
    json!({
        "apiVersion": "dlock.io/v1alpha1", "kind": "PayoutBatch",
        "metadata": {"name": "rules"},
        "spec": {"payouts": [item]},
    })
    .to_string()
}

/// A PayoutBatch of one good payout named `name`.
fn named_batch(name: &str) -> String {
    let mut batch: Value = serde_json::from_str(&batch(None)).unwrap_or_default();
    batch["metadata"]["name"] = json!(name);
    batch.to_string()
}

/// A LockRevocation with `field` of its spec set to `value` when given.
fn revocation(field: Option<(&str, Value)>) -> String {
    let mut spec = json!({
        "key": "payout:acct-17", "accountId": "acct-17", "reason": "holder wedged on the rail",
        "revokedBy": "alice",
    });
    if let Some((field, value)) = field {
        spec[field] = value;
    }
    json!({
        "apiVersion": "dlock.io/v1alpha1", "kind": "LockRevocation",
        "metadata": {"name": "rules"}, "spec": spec,
    })
    .to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_api_server_refuses_every_field_the_contract_refuses_naming_it() {
    let ns = "rules";
    let world = World::with_namespace(ns).await;
    let dry_run = ["apply", "--dry-run=server", "-n", ns, "-f", "-"];
    let refusal = |manifest: &str| match world.cluster.kubectl_with_input(&dry_run, Some(manifest))
    {
        Ok(out) => Err(out),
        Err(e) => Ok(format!("{e:#}")),
    };
    // Positive controls: a good batch and a good revocation are admitted, and so are the limits.
    for good in [
        batch(None),
        batch(Some(("amountMinor", json!(AMOUNT_MINOR_MAX)))),
        batch(Some(("key", json!("é".repeat(KEY_LEN_MAX / 2))))),
        batch(Some(("accountId", json!("a:b.c_d-E9".repeat(6))))),
        batch(Some(("beneficiaryRef", json!("!~".repeat(64))))),
        batch(Some(("currency", json!("ZWL")))),
        revocation(None),
        revocation(Some(("reason", json!("  eight ch  ")))),
        named_batch(&"b".repeat(NAME_LEN_MAX)),
    ] {
        if let Ok(message) = refusal(&good) {
            panic!("a good manifest was refused: {message}\n{good}");
        }
    }
    let bad_items = [
        ("accountId", json!("acct 17/../x!")),
        ("accountId", json!("a".repeat(65))),
        ("beneficiaryRef", json!("ben 1 with spaces")),
        ("beneficiaryRef", json!("bén-1")),
        ("currency", json!("ZZZ")),
        ("currency", json!("eur")),
        ("amountMinor", json!(0)),
        ("amountMinor", json!(AMOUNT_MINOR_MAX + 1)),
        // 128 characters, 256 bytes: within `maxLength`, beyond the contract's bytes.
        ("key", json!("é".repeat(KEY_LEN_MAX))),
    ];
    for (field, value) in bad_items {
        let message = refusal(&batch(Some((field, value.clone()))))
            .unwrap_or_else(|out| panic!("{field} = {value} was admitted: {out}"));
        let at = format!("spec.payouts[0].{field}");
        assert!(message.contains(&at), "{field} = {value}: {message}");
    }
    // A name the API server allows (a DNS subdomain) but longer than the contract's batch name.
    let long = "b".repeat(NAME_LEN_MAX + 1);
    let message = refusal(&named_batch(&long))
        .unwrap_or_else(|out| panic!("a {}-character name was admitted: {out}", long.len()));
    assert!(
        message.contains(&format!("metadata.name must be at most {NAME_LEN_MAX}")),
        "{message}"
    );
    for (field, value) in [
        ("key", json!("payout:acct 17")),
        ("accountId", json!("acct/17")),
        // Eight characters, one once trimmed, as L8 counts a reason.
        ("reason", json!("   x    ")),
        ("revokedBy", json!("  ")),
    ] {
        let message = refusal(&revocation(Some((field, value.clone()))))
            .unwrap_or_else(|out| panic!("{field} = {value} was admitted: {out}"));
        assert!(
            message.contains(&format!("spec.{field}")),
            "{field} = {value}: {message}"
        );
    }
    // The executor's identity becomes its X-Owner-Id: a header's alphabet, the owner id's length.
    let with_identity = |identity: &str| {
        let mut batch: Value = serde_json::from_str(&batch(None)).unwrap_or_default();
        batch["spec"]["executor"] = json!({
            "identity": identity,
            "credentialSecret": {"name": "executor-token", "key": "token"},
        });
        batch.to_string()
    };
    let longest = "e".repeat(OWNER_ID_LEN_MAX);
    for good in [
        "system:serviceaccount:rules:dlock-executor",
        longest.as_str(),
    ] {
        if let Ok(message) = refusal(&with_identity(good)) {
            panic!("the identity {good:?} was refused: {message}");
        }
    }
    let too_long = "e".repeat(OWNER_ID_LEN_MAX + 1);
    for bad in ["exécuteur", "tab\there", too_long.as_str()] {
        let message = refusal(&with_identity(bad))
            .unwrap_or_else(|out| panic!("the identity {bad:?} was admitted: {out}"));
        assert!(
            message.contains("spec.executor.identity"),
            "{bad:?}: {message}"
        );
    }
}
