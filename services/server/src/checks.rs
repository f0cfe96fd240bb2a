//! Field checks in a handler: collect every field at fault, then answer once with
//! `VALIDATION_FAILED` naming them all.

use dlock_contract::error::{ApiError, FieldError};

/// Collects field errors so one answer names every field at fault.
#[derive(Default)]
pub struct Checks(pub Vec<FieldError>);

impl Checks {
    /// The value, or `None` with its error collected.
    pub fn take<T>(&mut self, result: Result<T, FieldError>) -> Option<T> {
        match result {
            Ok(v) => Some(v),
            Err(e) => {
                self.0.push(e);
                None
            }
        }
    }

    /// Collects `reason` against `field` unless `ok`.
    pub fn check(&mut self, ok: bool, field: &str, reason: impl Into<String>) {
        if !ok {
            self.0.push(FieldError::new(field, reason));
        }
    }

    /// `Ok` when nothing was collected, else the one `VALIDATION_FAILED` answer.
    pub fn done(self) -> Result<(), ApiError> {
        if self.0.is_empty() {
            Ok(())
        } else {
            Err(ApiError::validation(self.0))
        }
    }
}

/// Unwraps values that [`Checks::done`] has proved present.
pub fn present<T>(value: Option<T>) -> Result<T, ApiError> {
    value.ok_or_else(|| ApiError::internal("a checked value was missing"))
}
