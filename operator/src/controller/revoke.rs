//! The forced revocation flow (docs/design.md#d-3), shared by the Lock annotations and
//! LockRevocation. The flow itself is the contract's ([`dlock_contract::revoke::run`], the one
//! `dlock revoke` runs): L8 at the lock server, then the new token floor to the payment resource's
//! account fence and the rail proxy's high-water mark.
//!
//! It runs once per request: a result already recorded for the same request is completed (only
//! the fences still missing are pushed again, with the recorded floor and revocation id), never
//! started again, so a retry never revokes a second, newer holder. A Lock's revocation carries
//! the token of the key's live grant, read from the lock server when the request is handled, as
//! L8's `expectedToken`, and records it when L8 goes unanswered ([`pinned`]), so a lost answer
//! retried never ends a newer holder either.
//!
//! An L8 whose outcome is unknown (`503 OUTCOME_UNKNOWN` or no answer, and the key could not be
//! read to settle it) is recorded as [`OUTCOME_UNKNOWN`] with the token it was sent for, never
//! as a failure, and retried with back-off; the retry reads the key first
//! ([`dlock_contract::revoke::settle_and_run`]) and completes the revocation that took effect, or
//! sends L8 for that grant again (docs/contract.md#outcome-unknown).

use dlock_contract::revoke::{LockStep, Outcome, Progress};

use crate::crd::RevocationResult;
use crate::services::{ServiceError, Services};
use crate::validate::RevocationTarget;

pub const COMPLETE: &str = "Complete";
pub const INCOMPLETE: &str = "Incomplete";
pub const REFUSED: &str = "Refused";
/// L8 for `revokedToken` may have ended the grant and the key could not be read to tell: retried
/// (reading first), never a failure.
pub const OUTCOME_UNKNOWN: &str = "OutcomeUnknown";

/// Whether `previous` already answers `request` for good.
pub fn is_settled(previous: Option<&RevocationResult>, request: &str) -> bool {
    previous
        .is_some_and(|p| p.request == request && (p.outcome == COMPLETE || p.outcome == REFUSED))
}

/// The recorded progress of the same request, to resume from.
pub fn recorded_progress(
    previous: Option<&RevocationResult>,
    request: &str,
) -> Result<Option<Progress>, String> {
    let Some(p) = previous.filter(|p| p.request == request) else {
        return Ok(None);
    };
    let Some(id) = &p.revocation_id else {
        return Ok(None);
    };
    let revocation_id = serde_json::from_value(serde_json::Value::String(id.clone()))
        .map_err(|_| format!("the recorded revocation id {id:?} is not a UUID"))?;
    let new_token_floor = p
        .new_token_floor
        .ok_or_else(|| format!("revocation {id} is recorded without its floor"))?;
    Ok(Some(Progress {
        revocation_id,
        new_token_floor,
        revoked_token: p.revoked_token,
        payment_fenced: p.payment_fenced,
        rail_fenced: p.rail_fenced,
    }))
}

/// A Lock revocation whose L8 went unanswered: the grant it was sent for (`revokedToken`), with
/// no revocation id yet. The retry sends L8 for that token again, and only for it.
pub fn pinned(request: &str, token: i64, unanswered: &ServiceError) -> RevocationResult {
    RevocationResult {
        request: request.to_owned(),
        outcome: INCOMPLETE.to_owned(),
        revoked_token: Some(token),
        summary: Some(format!(
            "revoking token {token}, the key's holder when the request was handled: {unanswered}; \
             retried for that grant only"
        )),
        ..RevocationResult::default()
    }
}

pub fn refused(request: &str, summary: String) -> RevocationResult {
    RevocationResult {
        request: request.to_owned(),
        outcome: REFUSED.to_owned(),
        summary: Some(summary),
        ..RevocationResult::default()
    }
}

/// The token of an earlier L8 of the same request with no known outcome: recorded as
/// [`OUTCOME_UNKNOWN`], or [`pinned`] by a Lock's revocation whose L8 went unanswered. The next
/// run settles it by reading the key before anything is sent again.
pub fn unsettled_token(previous: Option<&RevocationResult>, request: &str) -> Option<i64> {
    previous
        .filter(|p| p.request == request && p.revocation_id.is_none())
        .filter(|p| p.outcome == OUTCOME_UNKNOWN || p.outcome == INCOMPLETE)
        .and_then(|p| p.revoked_token)
}

/// An L8 for `token` whose outcome is unknown, as recorded.
pub fn outcome_unknown(request: &str, token: i64, summary: String) -> RevocationResult {
    RevocationResult {
        request: request.to_owned(),
        outcome: OUTCOME_UNKNOWN.to_owned(),
        revoked_token: Some(token),
        summary: Some(summary),
        ..RevocationResult::default()
    }
}

/// Runs (or resumes) the flow. `Err` only when the lock server gave no answer and nothing was
/// revoked: nothing is recorded then, and the controller retries with back-off.
pub async fn run(
    services: &dyn Services,
    target: &RevocationTarget,
    request: &str,
    previous: Option<&RevocationResult>,
) -> Result<RevocationResult, ServiceError> {
    let resume = match recorded_progress(previous, request) {
        Ok(resume) => resume,
        Err(message) => return Ok(refused(request, message)),
    };
    let steps = services.revoke_steps(target)?;
    let order = &target.order;
    let report = match (resume, unsettled_token(previous, request)) {
        (None, Some(token)) => {
            dlock_contract::revoke::settle_and_run(steps.as_ref(), order, token).await
        }
        (resume, _) => dlock_contract::revoke::run(steps.as_ref(), order, resume.as_ref()).await,
    };
    match &report.lock {
        LockStep::Unavailable(error) => {
            return Err(ServiceError::Unavailable {
                service: "lock-server",
                message: error.message.clone(),
            });
        }
        LockStep::Unknown(unsettled) => {
            return Ok(outcome_unknown(request, unsettled.token, report.summary()));
        }
        _ => {}
    }
    let summary = report.summary();
    let Some(progress) = report.progress else {
        return Ok(refused(request, summary));
    };
    let outcome = match report.outcome {
        Outcome::Complete => COMPLETE,
        Outcome::Incomplete => INCOMPLETE,
        Outcome::Refused => REFUSED,
        Outcome::Unknown => OUTCOME_UNKNOWN,
    };
    Ok(RevocationResult {
        request: request.to_owned(),
        outcome: outcome.to_owned(),
        revocation_id: Some(progress.revocation_id.to_string()),
        revoked_token: progress.revoked_token,
        new_token_floor: Some(progress.new_token_floor),
        payment_fenced: progress.payment_fenced,
        rail_fenced: progress.rail_fenced,
        summary: Some(summary),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn result(id: Option<&str>) -> RevocationResult {
        RevocationResult {
            request: "r".into(),
            outcome: INCOMPLETE.into(),
            revocation_id: id.map(str::to_owned),
            revoked_token: Some(41),
            new_token_floor: Some(42),
            payment_fenced: true,
            rail_fenced: false,
            summary: None,
        }
    }

    #[test]
    fn a_recorded_result_of_the_same_request_resumes() {
        let recorded = result(Some("7f9c0000-0000-4000-8000-000000000001"));
        let progress = recorded_progress(Some(&recorded), "r")
            .ok()
            .flatten()
            .map(|p| (p.new_token_floor, p.payment_fenced, p.rail_fenced));
        assert_eq!(progress, Some((42, true, false)));
        assert_eq!(recorded_progress(Some(&recorded), "other"), Ok(None));
        assert_eq!(recorded_progress(Some(&result(None)), "r"), Ok(None));
        assert!(recorded_progress(Some(&result(Some("nope"))), "r").is_err());
    }

    #[test]
    fn an_l8_without_a_known_outcome_is_settled_by_the_next_run() {
        let unknown = outcome_unknown("r", 41, "outcome unknown".into());
        assert_eq!(unsettled_token(Some(&unknown), "r"), Some(41));
        assert_eq!(unsettled_token(Some(&unknown), "other"), None);
        assert!(!is_settled(Some(&unknown), "r"), "retried, never final");
        // With a revocation id the lock server answered: resumed, not settled again.
        assert_eq!(unsettled_token(Some(&result(Some("x"))), "r"), None);
        let refused = refused("r", "no".into());
        assert_eq!(unsettled_token(Some(&refused), "r"), None);
    }
}
