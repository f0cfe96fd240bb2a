//! Fencing-token proofs (docs/design.md#d-8): the lock server signs every grant, and the
//! enforcement points (payment resource, rail proxy) refuse a token it did not sign. This is the
//! wire side: the header, the lock key, the recovery bodies; signing and checking is
//! `dlock_server::proof`.
//!
//! Without a proof an authenticated caller could present `X-Fencing-Token: 9223372036854775807`;
//! the fences only rise, so every real holder of that account would be FENCED_OUT for good. The
//! proof is an HMAC-SHA256 with a secret shared by the three services, over the lock key and the
//! token, and travels beside the token as `X-Fencing-Proof: <key-id>.<64 hex digits>`.
//!
//! What the MAC covers, and why not the session: the verifier knows the lock key (from the
//! payout's account) and the token, and nothing else. Tokens come from one global sequence (pg)
//! or the global etcd revision, so (key, token) already names exactly one grant; a session id in
//! the MAC would only have to be sent along in one more header, and the verifier could not check
//! it against anything (it reads no lock state on the write path), so it would add no refusal a
//! forger could not pass. The key is in the MAC so that a grant on `payout:A` proves nothing on
//! `payout:B`: the only thing a real grant lets its holder do is what the lock server allowed.
//!
//! Keys: `fencing.proof-keys-file` names a file of `<key-id> <secret>` lines. The first line
//! signs, every line verifies, so a key is rotated by adding the new key second, rolling every
//! service, swapping the two lines, rolling again, and removing the old line. The file is re-read
//! when it changes (a mounted Secret is updated in place), like `auth.tokens-file`.

use http::HeaderMap;

use crate::error::{ApiError, ErrorCode};
use crate::headers;

/// The configuration key of the keys file.
pub const KEYS_FILE_KEY: &str = "fencing.proof-keys-file";

/// The lock key whose grants protect an account's payouts (`payout:{accountId}`).
pub fn payout_lock_key(account_id: &str) -> String {
    format!("payout:{account_id}")
}

/// The body of a recovery (`POST /v1/accounts/{id}/fence/lower`,
/// `POST /v1/rail/high-water/{accountId}/lower`): operator only, with the operator's own fresh
/// grant on `payout:{accountId}` as `X-Fencing-Token` and `X-Fencing-Proof`. The mark is lowered
/// to that token.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct FenceLowerRequest {
    /// The person who decided the recovery (1 to 128 characters).
    pub operator: String,
    /// Why (8 to 4096 characters): the incident, how the account was poisoned.
    pub reason: String,
}

/// What a recovery did.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct FenceLowered {
    pub account_id: String,
    /// `account` (the payment resource's fence) or `rail` (the proxy's high-water mark).
    pub resource: String,
    pub previous_token: i64,
    /// The mark now: the presented token if it was lowered, else unchanged.
    pub token: i64,
    /// False when the mark was already at or below the presented token: nothing was changed
    /// and nothing recorded.
    pub lowered: bool,
    /// The audit row (`fence_recoveries`), when lowered.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub recovery_id: Option<i64>,
}

/// Checks a recovery body; the reasons name the fields at fault.
pub fn check_lower_request(body: &FenceLowerRequest) -> Vec<crate::error::FieldError> {
    let mut fields = Vec::new();
    let operator = body.operator.trim().chars().count();
    if !(1..=128).contains(&operator) || body.operator.chars().any(char::is_control) {
        fields.push(crate::error::FieldError::new(
            "operator",
            "must be 1 to 128 characters without control characters",
        ));
    }
    let reason = body.reason.trim().chars().count();
    if !(8..=4096).contains(&reason) || body.reason.chars().any(char::is_control) {
        fields.push(crate::error::FieldError::new(
            "reason",
            format!("must be 8 to 4096 characters without control characters, got {reason}"),
        ));
    }
    fields
}
/// The request's `X-Fencing-Proof`, if sent; repeated or not visible ASCII is INVALID_TOKEN.
pub fn presented(request: &HeaderMap) -> Result<Option<String>, ApiError> {
    let mut values = request.get_all(headers::FENCING_PROOF).iter();
    let Some(value) = values.next() else {
        return Ok(None);
    };
    if values.next().is_some() {
        return Err(ApiError::new(
            ErrorCode::InvalidToken,
            "X-Fencing-Proof is given more than once",
        ));
    }
    let text = value.to_str().map_err(|_| {
        ApiError::new(
            ErrorCode::InvalidToken,
            "X-Fencing-Proof must be visible ASCII",
        )
    })?;
    Ok(Some(text.to_owned()))
}
