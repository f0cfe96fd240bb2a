//! P1's paging: the list query, checked as every input is, and the cursor codec. A cursor is
//! opaque to callers and names the last row of the page before.

use axum::extract::rejection::QueryRejection;
use chrono::{DateTime, Utc};
use dlock_contract::error::{ApiError, FieldError};
use dlock_contract::payment::{
    LIST_LIMIT_DEFAULT, LIST_LIMIT_MAX, PayoutPage, PayoutState, PayoutSummary,
};
use serde::Deserialize;
use uuid::Uuid;

use super::checks::{Checks, check_account_id, present};

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub(super) struct ListQuery {
    state: Option<String>,
    account_id: Option<String>,
    limit: Option<String>,
    cursor: Option<String>,
}

/// A checked [`ListQuery`]: what the store is asked for.
pub(super) struct Page {
    pub(super) state: Option<PayoutState>,
    pub(super) account_id: Option<String>,
    pub(super) limit: i64,
    pub(super) after: Option<(DateTime<Utc>, Uuid)>,
}

pub(super) fn query_error(rejection: QueryRejection) -> ApiError {
    let text = rejection.body_text();
    let field = text.split('`').nth(1).unwrap_or("query").to_owned();
    let reason = text
        .strip_prefix("Failed to deserialize query string: ")
        .unwrap_or(&text)
        .to_owned();
    ApiError::field(field, reason)
}

impl ListQuery {
    /// Every field checked; one answer names every field at fault.
    pub(super) fn check(self) -> Result<Page, ApiError> {
        let mut checks = Checks::default();
        let state = match &self.state {
            None => None,
            Some(text) => checks
                .take(PayoutState::parse(text).map(Some).ok_or_else(|| {
                    FieldError::new(
                        "state",
                        "must be one of the eight payout states (PENDING, CLAIMED, ...)",
                    )
                }))
                .flatten(),
        };
        if let Some(id) = &self.account_id {
            check_account_id(&mut checks, "accountId", id);
        }
        let limit = list_limit(&mut checks, self.limit.as_deref());
        let after = match &self.cursor {
            None => None,
            Some(text) => checks
                .take(decode_cursor(text).map(Some).ok_or_else(|| {
                    FieldError::new("cursor", "is not a cursor this service issued")
                }))
                .flatten(),
        };
        checks.done()?;
        Ok(Page {
            state,
            account_id: self.account_id,
            limit: present(limit)?,
            after,
        })
    }
}

impl Page {
    /// The answer from the store's rows: up to `limit + 1` of them, the extra one only telling
    /// that there is a next page.
    pub(super) fn answer(&self, mut items: Vec<PayoutSummary>) -> PayoutPage {
        let next_cursor = if items.len() as i64 > self.limit {
            items.truncate(self.limit as usize);
            items
                .last()
                .map(|p| encode_cursor(p.created_at, p.payout_id))
        } else {
            None
        };
        PayoutPage { items, next_cursor }
    }
}

/// Cursors are opaque to callers: hex of `v1:{created_at µs}:{payout_id}`.
fn encode_cursor(created_at: DateTime<Utc>, payout_id: Uuid) -> String {
    format!("v1:{}:{payout_id}", created_at.timestamp_micros())
        .bytes()
        .map(|b| format!("{b:02x}"))
        .collect()
}

fn decode_cursor(cursor: &str) -> Option<(DateTime<Utc>, Uuid)> {
    if !cursor.len().is_multiple_of(2) || cursor.len() > 256 {
        return None;
    }
    let bytes: Option<Vec<u8>> = (0..cursor.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(cursor.get(i..i + 2)?, 16).ok())
        .collect();
    let text = String::from_utf8(bytes?).ok()?;
    let mut parts = text.split(':');
    if parts.next()? != "v1" {
        return None;
    }
    let micros = parts.next()?.parse::<i64>().ok()?;
    let payout_id = Uuid::parse_str(parts.next()?).ok()?;
    if parts.next().is_some() {
        return None;
    }
    Some((DateTime::from_timestamp_micros(micros)?, payout_id))
}

/// A list's `limit` query parameter: [`LIST_LIMIT_DEFAULT`] when absent, else an integer from 1
/// to [`LIST_LIMIT_MAX`] (`None`, and a field error in `checks`, when it is not).
pub(super) fn list_limit(checks: &mut Checks, limit: Option<&str>) -> Option<i64> {
    let Some(text) = limit else {
        return Some(LIST_LIMIT_DEFAULT);
    };
    checks.take(
        text.parse::<i64>()
            .ok()
            .filter(|n| (1..=LIST_LIMIT_MAX).contains(n))
            .ok_or_else(|| {
                FieldError::new(
                    "limit",
                    format!("must be an integer from 1 to {LIST_LIMIT_MAX}"),
                )
            }),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cursors_round_trip_and_garbage_is_refused() {
        let t = DateTime::from_timestamp_micros(1_764_692_400_123_456).unwrap_or_default();
        let id = Uuid::new_v4();
        assert_eq!(decode_cursor(&encode_cursor(t, id)), Some((t, id)));
        for bad in ["", "zz", "abc", "7631", &"00".repeat(200)] {
            assert_eq!(decode_cursor(bad), None, "{bad}");
        }
    }
}
