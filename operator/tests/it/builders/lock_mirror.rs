//! A lock the lock server holds, mirrored as a Lock object.

use super::*;

#[test]
fn a_mirrored_lock_is_named_from_its_key_and_owned_by_its_lock_server() {
    let server = fixtures::lock_server();
    let owner = kube::Resource::controller_owner_ref(&server, &()).unwrap();
    let held = fixtures::held_lock();
    let name = lock::lock_name("lock-server", &held.key);
    assert!(name.starts_with("payout-acct-17-"), "{name}");
    assert_json(
        &lock::mirrored_lock("lock-server", "default", &held, &owner),
        json!({
            "apiVersion": "dlock.io/v1alpha1",
            "kind": "Lock",
            "metadata": {
                "name": name,
                "namespace": "default",
                "labels": {
                    "app.kubernetes.io/managed-by": "dlock-operator",
                    "app.kubernetes.io/name": "dlock",
                    "dlock.io/lock-server": "lock-server",
                },
                "ownerReferences": [owner_json()],
            },
            "spec": {"key": "payout:acct-17", "lockServer": "lock-server", "accountId": "acct-17"},
        }),
    );
}

fn owner_json() -> serde_json::Value {
    owner("LockServer", "lock-server", "uid-lock-server")
}
