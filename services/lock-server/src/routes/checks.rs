//! Field checks shared by the handlers: path parameters, TTLs, strict query strings.

use axum::extract::Query;
use axum::extract::rejection::QueryRejection;
use dlock_contract::error::{ApiError, FieldError};
use dlock_contract::lock::*;
pub(super) use dlock_server::checks::{Checks, present};
use uuid::Uuid;

use crate::config::LockServerConfig;

pub(super) fn path_key(key: &str) -> Result<(), FieldError> {
    if key_is_valid(key) {
        Ok(())
    } else {
        Err(FieldError::new(
            "key",
            format!("must be 1 to {KEY_LEN_MAX} characters of [a-zA-Z0-9:._-]"),
        ))
    }
}

pub(super) fn path_session(text: &str) -> Result<Uuid, FieldError> {
    Uuid::parse_str(text).map_err(|_| FieldError::new("sessionId", "must be a UUID"))
}

/// `ttlMillis` of a grant (L4, L5): `lock.default.ttl` when absent, at most `lock.ttl-max`.
pub(super) fn lock_ttl(c: &LockServerConfig, asked: Option<i64>) -> Result<i64, FieldError> {
    ttl(asked, c.lock_ttl_default_ms, c.lock_ttl_max_ms)
}

/// `ttlMillis` of a session (L1): `lock.session.ttl` when absent, at most `lock.session.ttl-max`.
pub(super) fn session_ttl(c: &LockServerConfig, asked: Option<i64>) -> Result<i64, FieldError> {
    ttl(asked, c.session_ttl_default_ms, c.session_ttl_max_ms)
}

/// A TTL from a request: outside the contract's range is an error; inside it, clamped down to
/// the server's maximum.
fn ttl(requested: Option<i64>, default: i64, max: i64) -> Result<i64, FieldError> {
    match requested {
        None => Ok(default),
        Some(t) if (TTL_MS_MIN..=TTL_MS_MAX).contains(&t) => Ok(t.min(max)),
        Some(t) => Err(FieldError::new(
            "ttlMillis",
            format!("must be between {TTL_MS_MIN} and {TTL_MS_MAX} milliseconds, got {t}"),
        )),
    }
}

/// A strict query string: an unknown parameter is refused like an unknown body field, and every
/// refusal is the contract's envelope naming the parameter.
pub(super) fn strict_query<T: serde::de::DeserializeOwned>(
    query: Result<Query<T>, QueryRejection>,
) -> Result<T, ApiError> {
    query.map(|Query(q)| q).map_err(|rejection| {
        let message = rejection.body_text();
        let field = message.split('`').nth(1).unwrap_or("query").to_owned();
        ApiError::field(field, message)
    })
}
