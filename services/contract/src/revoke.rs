//! The forced revocation flow (docs/design.md#d-3), once for every caller (`dlock revoke`, the
//! operator's Lock annotations and LockRevocation): end the grant at the lock server (L8), then
//! push the new token floor to both enforcement points for the account behind the key — the payment
//! resource's account fence, then the rail proxy's high-water mark — so that every write with the
//! revoked token is FENCED_OUT at once, not only after the next holder writes.
//!
//! - L8 may carry an `expectedToken` guard: the server revokes only that grant (409 otherwise), so
//!   a retried or late revocation never ends a newer holder.
//! - A recorded [`Progress`] (revocation id, floor, which fences are done) resumes the flow without
//!   calling L8 again: only the missing fences are pushed, with the recorded floor and id.
//! - The fence write's `X-Idempotency-Key` is [`fence_idempotency_key`] of the revocation id, the
//!   same on every retry; the high-water advance is a max and repeats harmlessly.
//! - A 4xx (but 408 and 429) is a refusal: reported as such and not retried. A 5xx, a 408/429,
//!   no answer or an answer outside the contract is retryable.
//! - Lock keys and account ids are checked against the contract's alphabets (`[a-zA-Z0-9:._-]`)
//!   before anything is sent: every character of them is a valid path character, so the clients
//!   put them into the path as they are, and nothing else ever reaches a URL.

use std::future::Future;
use std::pin::Pin;

use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::client::{ClientError, LockClient};
use crate::error::ErrorCode;
use crate::lock::{REVOKE_REASON_LEN_MIN, Revocation, RevokeRequest, key_is_valid};
use crate::payment::{FenceRequest, FenceResponse, account_id_is_valid};
use crate::payment_client::PaymentClient;
use crate::rail::{HighWater, HighWaterRequest, RailClient};

/// One step's call.
pub type StepFuture<'a, T> = Pin<Box<dyn Future<Output = Result<T, ClientError>> + Send + 'a>>;

/// The three calls of the flow. [`RevokeClients`] makes them for real; tests substitute fakes.
pub trait RevokeSteps: Send + Sync {
    /// L8 on the lock server.
    fn revoke_lock<'a>(
        &'a self,
        key: &'a str,
        request: &'a RevokeRequest,
    ) -> StepFuture<'a, Revocation>;
    /// The payment resource's account fence.
    fn advance_fence<'a>(&'a self, call: FenceCall<'a>) -> StepFuture<'a, FenceResponse>;
    /// The rail proxy's high-water mark.
    fn advance_high_water<'a>(
        &'a self,
        account_id: &'a str,
        request: &'a HighWaterRequest,
    ) -> StepFuture<'a, HighWater>;
}

/// The account fence's call: the account, the write's `X-Idempotency-Key` and the body. Its
/// fields are named because the account and the key are both strings, which a caller could swap
/// without the compiler noticing.
#[derive(Debug, Clone, Copy)]
pub struct FenceCall<'a> {
    pub account_id: &'a str,
    pub idempotency_key: &'a str,
    pub request: &'a FenceRequest,
}

/// The contract clients, each carrying the caller's owner id and operator credential.
#[derive(Debug, Clone)]
pub struct RevokeClients {
    pub lock: LockClient,
    pub payment: PaymentClient,
    pub rail: RailClient,
}

impl RevokeSteps for RevokeClients {
    fn revoke_lock<'a>(
        &'a self,
        key: &'a str,
        request: &'a RevokeRequest,
    ) -> StepFuture<'a, Revocation> {
        Box::pin(self.lock.revoke(
            key,
            &request.operator,
            &request.reason,
            request.expected_token,
        ))
    }

    fn advance_fence<'a>(&'a self, call: FenceCall<'a>) -> StepFuture<'a, FenceResponse> {
        Box::pin(
            self.payment
                .advance_fence(call.account_id, call.idempotency_key, call.request),
        )
    }

    fn advance_high_water<'a>(
        &'a self,
        account_id: &'a str,
        request: &'a HighWaterRequest,
    ) -> StepFuture<'a, HighWater> {
        Box::pin(self.rail.advance_high_water(account_id, request))
    }
}

/// What to revoke, and who asks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RevokeOrder {
    pub key: String,
    /// The account whose enforcement points are fenced; the executor locks `payout:{accountId}`.
    pub account_id: String,
    pub operator: String,
    pub reason: String,
    /// L8's CAS guard: revoke only the grant with this token.
    pub expected_token: Option<i64>,
}

impl RevokeOrder {
    /// An order for a payout lock key (`payout:{accountId}`), its account taken from the key.
    pub fn for_key(
        key: &str,
        operator: &str,
        reason: &str,
        expected_token: Option<i64>,
    ) -> Result<Self, String> {
        let account_id = account_of_key(key).ok_or_else(|| {
            format!("{key} is not a payout lock key (payout:{{accountId}}); nothing to fence")
        })?;
        let order = Self {
            key: key.to_owned(),
            account_id: account_id.to_owned(),
            operator: operator.trim().to_owned(),
            reason: reason.trim().to_owned(),
            expected_token,
        };
        order.check()?;
        Ok(order)
    }

    /// What the contract would refuse anyway, refused before anything is sent.
    pub fn check(&self) -> Result<(), String> {
        if !key_is_valid(&self.key) {
            return Err(format!(
                "{:?} is not a lock key (1-128 of [a-zA-Z0-9:._-])",
                self.key
            ));
        }
        if !account_id_is_valid(&self.account_id) {
            return Err(format!(
                "{:?} is not an account id (1-64 of [a-zA-Z0-9:._-]); nothing to fence",
                self.account_id
            ));
        }
        if self.operator.trim().is_empty() {
            return Err("the operator is empty".into());
        }
        if self.reason.trim().chars().count() < REVOKE_REASON_LEN_MIN {
            return Err(format!(
                "the reason must be at least {REVOKE_REASON_LEN_MIN} characters"
            ));
        }
        if self.expected_token.is_some_and(|t| t <= 0) {
            return Err("the expected token must be greater than 0".into());
        }
        Ok(())
    }
}

/// `payout:{accountId}` → the account; any other key has none.
pub fn account_of_key(key: &str) -> Option<&str> {
    key.strip_prefix("payout:").filter(|a| !a.is_empty())
}

/// The fence write's `X-Idempotency-Key`: stable for one revocation, whoever retries it.
pub fn fence_idempotency_key(revocation_id: Uuid) -> String {
    format!("revoke-{revocation_id}")
}

/// What an earlier run recorded: enough to finish the flow without calling L8 again.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Progress {
    pub revocation_id: Uuid,
    pub new_token_floor: i64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub revoked_token: Option<i64>,
    pub payment_fenced: bool,
    pub rail_fenced: bool,
}

impl Progress {
    pub fn is_complete(&self) -> bool {
        self.payment_fenced && self.rail_fenced
    }
}

/// Whether a failed call may be repeated.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub enum Failure {
    /// The service decided against the request (a 4xx): repeating it changes nothing.
    Refused,
    /// A 5xx, a 408 or 429, no answer, or an answer outside the contract.
    Retryable,
}

pub fn classify(error: &ClientError) -> Failure {
    match error {
        ClientError::Api { status, body } if (400..500).contains(status) => {
            // A lock someone else still holds is a matter of time, not a refusal.
            let contended = matches!(
                body.code,
                ErrorCode::LockContended | ErrorCode::ContentionExceeded
            );
            if *status == 408 || *status == 429 || contended {
                Failure::Retryable
            } else {
                Failure::Refused
            }
        }
        _ => Failure::Retryable,
    }
}

/// A failed call, as reported.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct StepError {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<u16>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub code: Option<ErrorCode>,
    pub message: String,
}

impl From<&ClientError> for StepError {
    fn from(error: &ClientError) -> Self {
        Self {
            status: match error {
                ClientError::Api { status, .. } => Some(*status),
                _ => None,
            },
            code: error.code(),
            message: error.to_string(),
        }
    }
}

impl std::fmt::Display for StepError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

/// The lock server's step.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "result", rename_all = "camelCase")]
pub enum LockStep {
    Revoked(Revocation),
    /// Not called: a recorded [`Progress`] was resumed.
    Resumed,
    /// Refused (a 4xx, or an order the contract would refuse, then without a status).
    Refused(StepError),
    /// No decision: call again (with `expectedToken` that is always safe).
    Unavailable(StepError),
}

/// One enforcement point's step.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "result", rename_all = "camelCase")]
pub enum FenceStep<T> {
    Advanced(T),
    /// Recorded as done by an earlier run; not called again.
    AlreadyDone,
    /// Not attempted: the lock server gave no floor.
    Skipped,
    Refused(StepError),
    Unavailable(StepError),
}

impl<T> FenceStep<T> {
    pub fn is_done(&self) -> bool {
        matches!(self, FenceStep::Advanced(_) | FenceStep::AlreadyDone)
    }

    fn from_result(result: Result<T, ClientError>) -> Self {
        match result {
            Ok(done) => FenceStep::Advanced(done),
            Err(error) => match classify(&error) {
                Failure::Refused => FenceStep::Refused((&error).into()),
                Failure::Retryable => FenceStep::Unavailable((&error).into()),
            },
        }
    }

    fn error(&self) -> Option<&StepError> {
        match self {
            FenceStep::Refused(e) | FenceStep::Unavailable(e) => Some(e),
            _ => None,
        }
    }
}

/// The flow's verdict.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub enum Outcome {
    /// The floor is at both enforcement points.
    Complete,
    /// Something did not answer: run again with [`RevokeReport::progress`].
    Incomplete,
    /// A service refused (4xx): running the same order again would be refused again.
    Refused,
}

/// Every step's typed result.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct RevokeReport {
    pub key: String,
    pub account_id: String,
    pub outcome: Outcome,
    pub lock: LockStep,
    /// What to record (and resume from); `None` while the lock server has given no floor.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub progress: Option<Progress>,
    pub account_fence: FenceStep<FenceResponse>,
    pub rail_high_water: FenceStep<HighWater>,
}

impl RevokeReport {
    fn outcome_of(
        lock: &LockStep,
        account_fence: &FenceStep<FenceResponse>,
        rail_high_water: &FenceStep<HighWater>,
    ) -> Outcome {
        match lock {
            LockStep::Refused(_) => return Outcome::Refused,
            LockStep::Unavailable(_) => return Outcome::Incomplete,
            LockStep::Revoked(_) | LockStep::Resumed => {}
        }
        if matches!(account_fence, FenceStep::Refused(_))
            || matches!(rail_high_water, FenceStep::Refused(_))
        {
            Outcome::Refused
        } else if account_fence.is_done() && rail_high_water.is_done() {
            Outcome::Complete
        } else {
            Outcome::Incomplete
        }
    }

    /// One line per step, for a human.
    pub fn lines(&self) -> Vec<String> {
        let mut lines = Vec::new();
        let account = &self.account_id;
        match &self.lock {
            LockStep::Revoked(r) => lines.push(format!(
                "lock server: revoked token {} of {}; new token floor {} (revocation {})",
                r.revoked_token, r.revoked_owner_id, r.new_token_floor, r.revocation_id
            )),
            LockStep::Resumed => {
                if let Some(p) = &self.progress {
                    lines.push(format!(
                        "lock server: resumed revocation {} with floor {}",
                        p.revocation_id, p.new_token_floor
                    ));
                }
            }
            LockStep::Refused(e) => lines.push(format!("lock server refused: {e}")),
            LockStep::Unavailable(e) => lines.push(format!("lock server did not answer: {e}")),
        }
        match &self.account_fence {
            FenceStep::Advanced(f) => lines.push(format!(
                "payment resource: account {account} fence {} -> {}",
                f.previous_fence, f.fence
            )),
            FenceStep::AlreadyDone => lines.push(format!(
                "payment resource: account {account} already fenced"
            )),
            FenceStep::Skipped => {}
            FenceStep::Refused(e) => lines.push(format!("payment resource refused: {e}")),
            FenceStep::Unavailable(e) => {
                lines.push(format!("payment resource did not answer: {e}"))
            }
        }
        match &self.rail_high_water {
            FenceStep::Advanced(h) => lines.push(format!(
                "rail proxy: account {account} high-water {} -> {}",
                h.previous_token.unwrap_or_default(),
                h.highest_token
            )),
            FenceStep::AlreadyDone => lines.push(format!(
                "rail proxy: account {account} already at the floor"
            )),
            FenceStep::Skipped => {}
            FenceStep::Refused(e) => lines.push(format!("rail proxy refused: {e}")),
            FenceStep::Unavailable(e) => lines.push(format!("rail proxy did not answer: {e}")),
        }
        lines.push(match self.outcome {
            Outcome::Complete => "done: every write with the revoked token is now FENCED_OUT at \
                                  the account and at the rail"
                .to_owned(),
            Outcome::Incomplete | Outcome::Refused => self.summary(),
        });
        lines
    }

    /// One line for a status or an Event.
    pub fn summary(&self) -> String {
        let floor = self.progress.as_ref().map(|p| p.new_token_floor);
        match (self.outcome, floor) {
            (Outcome::Complete, Some(floor)) => format!(
                "revoked token {}, floor {floor} at both fences",
                self.progress
                    .as_ref()
                    .and_then(|p| p.revoked_token)
                    .unwrap_or(0)
            ),
            (_, None) => match &self.lock {
                LockStep::Refused(e) => format!("the lock server refused: {e}"),
                LockStep::Unavailable(e) => format!("the lock server did not answer: {e}"),
                _ => "no floor".to_owned(),
            },
            (outcome, Some(floor)) => {
                let problems: Vec<String> = [
                    self.account_fence
                        .error()
                        .map(|e| format!("payment resource: {e}")),
                    self.rail_high_water
                        .error()
                        .map(|e| format!("rail proxy: {e}")),
                ]
                .into_iter()
                .flatten()
                .collect();
                let verb = if outcome == Outcome::Refused {
                    "refused at a fence"
                } else {
                    "not yet at every fence"
                };
                format!("floor {floor} {verb}: {}", problems.join("; "))
            }
        }
    }
}

/// Runs the flow: L8 (unless `resume` holds a recorded result), then each fence not yet done.
/// It never fails as a whole: every step's result is in the report.
pub async fn run<S: RevokeSteps + ?Sized>(
    steps: &S,
    order: &RevokeOrder,
    resume: Option<&Progress>,
) -> RevokeReport {
    let report = |lock: LockStep| RevokeReport {
        key: order.key.clone(),
        account_id: order.account_id.clone(),
        outcome: RevokeReport::outcome_of(&lock, &FenceStep::Skipped, &FenceStep::Skipped),
        lock,
        progress: None,
        account_fence: FenceStep::Skipped,
        rail_high_water: FenceStep::Skipped,
    };
    if let Err(message) = order.check() {
        return report(LockStep::Refused(StepError {
            status: None,
            code: None,
            message: format!("not sent: {message}"),
        }));
    }
    let (lock, mut progress) = match resume {
        Some(recorded) => (LockStep::Resumed, recorded.clone()),
        None => {
            let request = RevokeRequest {
                operator: order.operator.clone(),
                reason: order.reason.clone(),
                expected_token: order.expected_token,
            };
            match steps.revoke_lock(&order.key, &request).await {
                Ok(revocation) => {
                    let progress = Progress {
                        revocation_id: revocation.revocation_id,
                        new_token_floor: revocation.new_token_floor,
                        revoked_token: Some(revocation.revoked_token),
                        payment_fenced: false,
                        rail_fenced: false,
                    };
                    (LockStep::Revoked(revocation), progress)
                }
                Err(error) => {
                    return report(match classify(&error) {
                        Failure::Refused => LockStep::Refused((&error).into()),
                        Failure::Retryable => LockStep::Unavailable((&error).into()),
                    });
                }
            }
        }
    };
    // Both enforcement points get the same floor, operator, reason and revocation id.
    let fence = FenceRequest {
        floor: progress.new_token_floor,
        operator: order.operator.clone(),
        reason: order.reason.clone(),
        revocation_id: progress.revocation_id,
    };
    let account_fence = if progress.payment_fenced {
        FenceStep::AlreadyDone
    } else {
        let key = fence_idempotency_key(progress.revocation_id);
        let call = FenceCall {
            account_id: &order.account_id,
            idempotency_key: &key,
            request: &fence,
        };
        FenceStep::from_result(steps.advance_fence(call).await)
    };
    progress.payment_fenced = account_fence.is_done();
    let rail_high_water = if progress.rail_fenced {
        FenceStep::AlreadyDone
    } else {
        let request = HighWaterRequest::from(fence);
        FenceStep::from_result(steps.advance_high_water(&order.account_id, &request).await)
    };
    progress.rail_fenced = rail_high_water.is_done();
    RevokeReport {
        key: order.key.clone(),
        account_id: order.account_id.clone(),
        outcome: RevokeReport::outcome_of(&lock, &account_fence, &rail_high_water),
        lock,
        progress: Some(progress),
        account_fence,
        rail_high_water,
    }
}

#[cfg(test)]
mod tests;
