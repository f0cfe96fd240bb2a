use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use sha2::{Digest, Sha256};

use dlock_contract::lock::LockGrant;

use crate::crd::{Lock, LockSpec};

/// The label naming the LockServer a mirrored Lock comes from.
pub const LOCK_SERVER_LABEL: &str = "dlock.io/lock-server";

/// The Lock object's name: a DNS label made from the key, with a hash of the key so two keys
/// that sanitize alike never share an object.
pub fn lock_name(lock_server: &str, key: &str) -> String {
    let mut readable: String = key
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_lowercase()
            } else {
                '-'
            }
        })
        .collect();
    readable.truncate(40);
    let readable = readable.trim_matches('-');
    let digest = Sha256::digest(format!("{lock_server}/{key}").as_bytes());
    let hash: String = digest.iter().take(4).map(|b| format!("{b:02x}")).collect();
    if readable.is_empty() {
        format!("lock-{hash}")
    } else {
        format!("{readable}-{hash}")
    }
}

/// The account a lock key fences: the executor locks `payout:{accountId}`. Any other key has no
/// account (empty), and a revocation of it is refused before anything is sent.
pub fn account_of_key(key: &str) -> String {
    key.strip_prefix("payout:").unwrap_or_default().to_owned()
}

/// The mirrored Lock of one held lock (an item of the lock server's `GET /v1/locks`), owned by its
/// LockServer (so it goes with it).
pub fn mirrored_lock(
    lock_server: &str,
    namespace: &str,
    held: &LockGrant,
    owner: &OwnerReference,
) -> Lock {
    let mut lock = Lock::new(
        &lock_name(lock_server, &held.key),
        LockSpec {
            key: held.key.clone(),
            lock_server: lock_server.to_owned(),
            account_id: account_of_key(&held.key),
        },
    );
    lock.metadata.namespace = Some(namespace.to_owned());
    lock.metadata.labels = Some(BTreeMap::from([
        ("app.kubernetes.io/name".to_owned(), "dlock".to_owned()),
        (
            "app.kubernetes.io/managed-by".to_owned(),
            super::MANAGED_BY.to_owned(),
        ),
        (LOCK_SERVER_LABEL.to_owned(), lock_server.to_owned()),
    ]));
    lock.metadata.owner_references = Some(vec![owner.clone()]);
    lock
}
