//! Bodies of the lock-server surface (docs/contract.md#s3-3), shared by the server and its client.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

/// Session and lock TTLs the contract allows, in milliseconds.
pub const TTL_MS_MIN: i64 = 1_000;
pub const TTL_MS_MAX: i64 = 60_000;
/// The longest server-side wait an acquire may ask for.
pub const WAIT_MS_MAX: i64 = 30_000;
/// The longest lock key.
pub const KEY_LEN_MAX: usize = 128;
/// The shortest and the longest revocation reason (L8), in characters once trimmed.
pub const REVOKE_REASON_LEN_MIN: usize = 8;
pub const REVOKE_REASON_LEN_MAX: usize = 1024;

/// The alphabet of a lock key and of an account id: `[a-zA-Z0-9:._-]`, every character a valid
/// path character. A key's length is 1 to [`KEY_LEN_MAX`]. [`key_is_valid`] matches it, and the
/// custom resources' schemas carry it.
pub const KEY_PATTERN: &str = "^[a-zA-Z0-9:._-]*$";

/// Whether every character of `text` is of [`KEY_PATTERN`]'s alphabet.
pub(crate) fn matches_key_alphabet(text: &str) -> bool {
    static ALPHABET: std::sync::LazyLock<Option<regex::Regex>> =
        std::sync::LazyLock::new(|| regex::Regex::new(KEY_PATTERN).ok());
    ALPHABET.as_ref().is_some_and(|re| re.is_match(text))
}

/// Whether `key` is a lock key the contract allows: 1–128 of `[a-zA-Z0-9:._-]`.
pub fn key_is_valid(key: &str) -> bool {
    (1..=KEY_LEN_MAX).contains(&key.len()) && matches_key_alphabet(key)
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct CreateSessionRequest {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttl_millis: Option<i64>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct Session {
    pub session_id: Uuid,
    pub owner_id: String,
    pub ttl_millis: i64,
    #[serde(with = "crate::time::millis")]
    pub expires_at: DateTime<Utc>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct Heartbeat {
    pub session_id: Uuid,
    #[serde(with = "crate::time::millis")]
    pub expires_at: DateTime<Utc>,
    #[serde(with = "crate::time::millis")]
    pub server_time: DateTime<Utc>,
    pub held_lock_count: i64,
}

#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct AcquireRequest {
    pub session_id: Uuid,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttl_millis: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub wait_millis: Option<i64>,
}

#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RenewRequest {
    pub session_id: Uuid,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttl_millis: Option<i64>,
}

#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ReleaseRequest {
    pub session_id: Uuid,
}

/// A granted lock (L4, L5).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct LockGrant {
    pub key: String,
    pub owner_id: String,
    pub session_id: Uuid,
    pub fencing_token: i64,
    #[serde(with = "crate::time::millis")]
    pub acquired_at: DateTime<Utc>,
    #[serde(with = "crate::time::millis")]
    pub expires_at: DateTime<Utc>,
    /// The lock server's proof of this grant (docs/design.md#d-8): send it as `X-Fencing-Proof`
    /// beside `X-Fencing-Token`. Present on the acquire (L4) and renew (L5) answers when the server
    /// has proof keys; never in the held-locks list or L7, which anyone who may read can see.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fencing_proof: Option<String>,
}

/// The advisory view of one key (L7). Never a basis for a correctness decision.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct LockInfo {
    pub key: String,
    pub held: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session_id: Option<Uuid>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fencing_token: Option<i64>,
    #[serde(
        default,
        with = "crate::time::millis_option",
        skip_serializing_if = "Option::is_none"
    )]
    pub acquired_at: Option<DateTime<Utc>>,
    #[serde(
        default,
        with = "crate::time::millis_option",
        skip_serializing_if = "Option::is_none"
    )]
    pub expires_at: Option<DateTime<Utc>>,
    pub waiter_count: i64,
}

/// The held-locks list (`GET /v1/locks`), for the operator's Lock view.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct HeldLocks {
    pub items: Vec<LockGrant>,
    /// Whether more held locks exist than the `limit` returned.
    pub truncated: bool,
}

#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RevokeRequest {
    pub operator: String,
    pub reason: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expected_token: Option<i64>,
}

/// The result of a forced revocation (L8): the grant ended and the token advanced.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct Revocation {
    pub key: String,
    pub revoked_token: i64,
    pub revoked_owner_id: String,
    /// A token greater than every token issued before the revocation. Push it to the
    /// enforcement points (docs/design.md#d-3) so the evicted holder's in-flight writes are fenced
    /// out.
    pub new_token_floor: i64,
    pub revocation_id: Uuid,
    pub operator: String,
    pub reason: String,
    #[serde(with = "crate::time::millis")]
    pub revoked_at: DateTime<Utc>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_alphabet_and_length() {
        assert!(key_is_valid("payout:acct-17"));
        assert!(key_is_valid("a.b_c-D:9"));
        assert!(key_is_valid(&"k".repeat(128)));
        assert!(!key_is_valid(&"k".repeat(129)));
        assert!(!key_is_valid(""));
        assert!(!key_is_valid("a/b"));
        assert!(!key_is_valid("a b"));
        assert!(!key_is_valid("ключ"));
    }
}
