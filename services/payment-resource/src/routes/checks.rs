//! What every handler checks before anything is written: the field rules (one answer names
//! every field at fault), the headers of a write, and who the caller is.

use axum::http::HeaderMap;
use dlock_contract::error::{ApiError, FieldError};
use dlock_contract::headers;
use dlock_contract::payment::{
    self, OPERATOR_LEN_MAX, PayoutState, REASON_LEN_MAX, REASON_LEN_MIN,
};
pub(super) use dlock_server::checks::{Checks, present};
use uuid::Uuid;

pub(super) fn check_account_id(checks: &mut Checks, field: &str, id: &str) {
    checks.take(payment::check_account_id(field, id));
}

pub(super) fn check_amount(checks: &mut Checks, amount: i64) {
    checks.take(payment::check_amount(amount));
}

pub(super) fn check_currency(checks: &mut Checks, currency: &str) {
    checks.take(payment::check_currency(currency));
}

pub(super) fn check_reference(checks: &mut Checks, field: &str, text: &str) {
    checks.take(payment::check_reference(field, text));
}

pub(super) fn check_text(checks: &mut Checks, field: &str, text: &str, min: usize, max: usize) {
    let chars = text.trim().chars().count();
    checks.check(
        (min..=max).contains(&chars) && !text.chars().any(char::is_control),
        field,
        format!("must be {min} to {max} characters without control characters, got {chars}"),
    );
}

/// The typed-in operator and reason of an operator write (a fence advance, a cancel).
pub(super) fn check_operator_reason(checks: &mut Checks, operator: &str, reason: &str) {
    check_text(checks, "operator", operator, 1, OPERATOR_LEN_MAX);
    check_text(checks, "reason", reason, REASON_LEN_MIN, REASON_LEN_MAX);
}

/// A claim or a cancel expects its payout PENDING or CLAIMED; `reason` says why to the caller.
pub(super) fn check_expected_state(checks: &mut Checks, expected: PayoutState, reason: &str) {
    checks.check(
        matches!(expected, PayoutState::Pending | PayoutState::Claimed),
        "expectedState",
        reason,
    );
}

pub(super) fn path_payout(checks: &mut Checks, text: &str) -> Option<Uuid> {
    checks.take(Uuid::parse_str(text).map_err(|_| FieldError::new("payoutId", "must be a UUID")))
}

/// The headers every write carries.
pub(super) struct WriteHeaders {
    pub(super) owner_id: String,
    pub(super) key: String,
}

pub(super) fn write_headers(checks: &mut Checks, headers: &HeaderMap) -> Option<WriteHeaders> {
    let owner_id = checks.take(headers::owner_id(headers));
    let key = checks.take(headers::idempotency_key(headers));
    Some(WriteHeaders {
        owner_id: owner_id?,
        key: key?,
    })
}

/// The checks of a write: its headers, then what `body` checks. Nothing is written unless all
/// pass; the answer names every field at fault.
pub(super) fn checked_write(
    headers: &HeaderMap,
    body: impl FnOnce(&mut Checks),
) -> Result<WriteHeaders, ApiError> {
    let mut checks = Checks::default();
    let write = write_headers(&mut checks, headers);
    body(&mut checks);
    checks.done()?;
    present(write)
}

/// [`checked_write`] for a write on the payout of the path.
pub(super) fn checked_payout_write(
    headers: &HeaderMap,
    path: &str,
    body: impl FnOnce(&mut Checks),
) -> Result<(WriteHeaders, Uuid), ApiError> {
    let mut payout_id = None;
    let write = checked_write(headers, |checks| {
        payout_id = path_payout(checks, path);
        body(checks);
    })?;
    Ok((write, present(payout_id)?))
}
