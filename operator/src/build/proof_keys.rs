//! The namespace's fencing-token proof keys (docs/design.md#d-8) when no workload names its own:
//! one Secret, [`SECRET`], made once by the operator and mounted into the lock server (which
//! signs with it), the payment resource and the rail proxy (which verify with it). The three
//! must hold the same keys, so it is one Secret per namespace, never one per object.
//!
//! - Created, never applied or patched: once it exists the operator leaves it alone, so a key
//!   rotation (the platform's: add a line, roll, swap, roll, remove) is never undone.
//! - No owner reference: shared by every LockServer, PaymentResource and RailProxy of the
//!   namespace, it must outlive any one of them (like the `dlock-service` account). It goes with
//!   the namespace, or when deleted by hand (the next reconcile makes a fresh one).

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::Secret;

/// The Secret the operator makes when a workload names no `spec.fencingProofKeysSecret`.
pub const SECRET: &str = "dlock-fencing-proof-keys";
/// Its key, mounted as the file `fencing.proof-keys-file` names.
pub const KEY: &str = "keys";
/// The id of the key the operator generates (the proof's `<key-id>.` prefix).
pub const KEY_ID: &str = "generated-1";
/// Bytes of CSPRNG output in the generated secret (64 hex digits; the services want at least
/// 32 characters).
pub const SECRET_BYTES: usize = 32;

/// 64 hex digits from the operating system's CSPRNG, or why there are none.
pub fn random_secret() -> Result<String, String> {
    use rand::TryRngCore as _;
    let mut bytes = [0u8; SECRET_BYTES];
    rand::rngs::OsRng
        .try_fill_bytes(&mut bytes)
        .map_err(|e| format!("the operating system's random source failed: {e}"))?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

/// The keys file: one `<key-id> <secret>` line, which signs.
pub fn keys_file(secret: &str) -> String {
    format!(
        "# made by the dlock operator: <key-id> <secret>, the first line signs, every line \
         verifies\n{KEY_ID} {secret}\n"
    )
}

/// The namespace's proof-keys Secret holding `secret` (see [`random_secret`]).
pub fn proof_keys_secret(namespace: &str, secret: &str) -> Secret {
    Secret {
        metadata: super::namespace_meta(SECRET, namespace, "fencing-proof-keys"),
        type_: Some("Opaque".to_owned()),
        string_data: Some(BTreeMap::from([(KEY.to_owned(), keys_file(secret))])),
        ..Secret::default()
    }
}
