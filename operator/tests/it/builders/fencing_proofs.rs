//! Fencing-proof keys (docs/design.md#fencing-proofs): the Secret the spec names or the one the
//! operator makes for the namespace, mounted as a directory by the three services that check
//! proofs.

use super::*;

/// The workload names the keys file in its config, and its pod mounts Secret `secret` read-only
/// as the directory of that file.
fn assert_proof_keys_mounted(workload: &dlock_operator::workload::Workload, secret: &str) {
    assert!(
        workload
            .config_toml
            .contains("\"fencing.proof-keys-file\" = \"/etc/dlock/fencing-proof-keys/keys\"\n"),
        "{}",
        workload.config_toml
    );
    let pod =
        serde_json::to_value(deployment::deployment(workload)).unwrap()["spec"]["template"]["spec"]
            .clone();
    let mounts = pod["containers"][0]["volumeMounts"].as_array().unwrap();
    assert!(
        mounts.contains(&json!({
            "name": "fencing-proof-keys",
            "mountPath": "/etc/dlock/fencing-proof-keys",
            "readOnly": true,
        })),
        "{mounts:?}"
    );
    assert!(
        pod["volumes"].as_array().unwrap().contains(&json!({
            "name": "fencing-proof-keys",
            "secret": {"secretName": secret},
        })),
        "{}",
        pod["volumes"]
    );
}

/// `spec.fencingProofKeysSecret` (docs/design.md#d-8): the lock server, the payment resource and
/// the rail proxy mount the same Secret read-only as a directory (never a subPath, so a rotated key
/// reaches the pod) and `fencing.proof-keys-file` names the key's file in it. A key that could
/// leave the directory is refused.
#[test]
fn the_fencing_proof_keys_secret_is_mounted_as_a_directory_and_named_in_the_config() {
    let keys = fixtures::secret("fencing-proof-keys", "keys");
    let mut lock_server = fixtures::lock_server();
    lock_server.spec.service.fencing_proof_keys_secret = Some(keys.clone());
    let mut payment = fixtures::payment_resource();
    payment.spec.service.fencing_proof_keys_secret = Some(keys.clone());
    let mut rail = fixtures::rail_proxy();
    rail.spec.service.fencing_proof_keys_secret = Some(keys.clone());
    let rail = validate::rail_proxy(&rail, &settings()).unwrap();
    for workload in [
        validate::lock_server(&lock_server, &settings()).unwrap(),
        validate::payment_resource(&payment, &settings()).unwrap(),
        rail.proxy,
    ] {
        assert_proof_keys_mounted(&workload, "fencing-proof-keys");
    }
    let stub = rail.stub.unwrap();
    assert!(
        !stub.config_toml.contains("fencing"),
        "the stub checks no proof"
    );
    for key in ["..", "a/b", ""] {
        lock_server.spec.service.fencing_proof_keys_secret = Some(fixtures::secret("keys", key));
        let error = validate::lock_server(&lock_server, &settings()).unwrap_err();
        assert_eq!(error.field, "spec.fencingProofKeysSecret.key", "{key:?}");
    }
}

/// Safe by default (docs/threat-model.md#safe-defaults): a LockServer, PaymentResource or
/// RailProxy that names no `spec.fencingProofKeysSecret` still proves its fencing tokens. All
/// three mount the one Secret the operator makes for the namespace (`dlock-fencing-proof-keys`)
/// as a read-only directory, exactly as a named Secret is mounted, and `fencing.proof-keys-file`
/// names its key; the stub checks no proof and mounts nothing.
#[test]
fn without_a_named_secret_all_three_mount_the_namespaces_generated_proof_keys() {
    let rail = validated_rail_proxy();
    for workload in [
        validated_lock_server(),
        validated_payment_resource(),
        rail.proxy,
    ] {
        assert_eq!(
            workload.fencing_proof_keys_secret.as_deref(),
            Some(proof_keys::SECRET),
            "{:?}",
            workload.component
        );
        assert_proof_keys_mounted(&workload, proof_keys::SECRET);
    }
    let stub = rail.stub.unwrap();
    assert!(
        !stub.config_toml.contains("fencing"),
        "the stub checks no proof"
    );
    assert_eq!(stub.fencing_proof_keys_secret, None);
}

/// The Secret the operator makes: no owner (every service of the namespace shares it), the key
/// the services mount, and a keys file the services accept, whose one line holds 64 hex digits
/// from the CSPRNG, fresh for every Secret.
#[test]
fn the_generated_proof_keys_secret_holds_a_keys_file_the_services_accept() {
    let secret = proof_keys::random_secret().unwrap();
    assert_eq!(secret.len(), 64, "{secret}");
    assert!(secret.bytes().all(|b| b.is_ascii_hexdigit()), "{secret}");
    assert_ne!(
        secret,
        proof_keys::random_secret().unwrap(),
        "fresh every time"
    );
    let built = serde_json::to_value(proof_keys::proof_keys_secret("team-a", &secret)).unwrap();
    assert_eq!(
        built,
        json!({
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {
                "name": "dlock-fencing-proof-keys",
                "namespace": "team-a",
                "labels": {
                    "app.kubernetes.io/name": "dlock",
                    "app.kubernetes.io/component": "fencing-proof-keys",
                    "app.kubernetes.io/managed-by": "dlock-operator",
                },
            },
            "type": "Opaque",
            "stringData": {"keys": proof_keys::keys_file(&secret)},
        })
    );
    let keys = dlock_server::proof::ProofKeys::from_text(&proof_keys::keys_file(&secret)).unwrap();
    assert_eq!(keys.key_ids(), vec!["generated-1".to_owned()]);
    let proof = keys.sign("payout:acct-17", 42).unwrap();
    assert_eq!(keys.verify("payout:acct-17", 42, &proof), Ok(()));
}
