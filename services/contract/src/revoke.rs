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
//! - L8 always carries a token: the order's `expectedToken`, or else the token of the key's
//!   holder read (L7) just before. An L8 whose outcome is unknown (`503 OUTCOME_UNKNOWN`, a
//!   `500`, no answer after the request went out) is never resent blindly and never reported as
//!   a failure: the key is read (L7). Still held under that token, nothing was revoked and L8 is
//!   sent again; that grant gone, the revocation took effect and the flow goes on to the fences
//!   with the lowest floor that fences the token out (token + 1), because the lock server's own
//!   floor never arrived; the read failing, the outcome stays unknown ([`Outcome::Unknown`]) and
//!   the next run settles it first ([`settle_and_run`]). docs/contract.md#outcome-unknown.
//! - Lock keys and account ids are checked against the contract's alphabets (`[a-zA-Z0-9:._-]`)
//!   before anything is sent: every character of them is a valid path character, so the clients
//!   put them into the path as they are, and nothing else ever reaches a URL.

use std::future::Future;
use std::pin::Pin;

use backon::BackoffBuilder;
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::client::{ClientError, LockClient};
use crate::error::ErrorCode;
use crate::lock::{LockInfo, REVOKE_REASON_LEN_MIN, Revocation, RevokeRequest, key_is_valid};
use crate::payment::{FenceRequest, FenceResponse, account_id_is_valid};
use crate::payment_client::PaymentClient;
use crate::rail::{HighWater, HighWaterRequest, RailClient};

/// One step's call.
pub type StepFuture<'a, T> = Pin<Box<dyn Future<Output = Result<T, ClientError>> + Send + 'a>>;

/// The calls of the flow. [`RevokeClients`] makes them for real; tests substitute fakes.
pub trait RevokeSteps: Send + Sync {
    /// L7 on the lock server: who holds the key now. It pins the grant L8 revokes when the order
    /// names no token, and settles an L8 whose outcome is unknown.
    fn read_lock<'a>(&'a self, key: &'a str) -> StepFuture<'a, LockInfo>;
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
    fn read_lock<'a>(&'a self, key: &'a str) -> StepFuture<'a, LockInfo> {
        Box::pin(self.lock.get(key))
    }

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
    /// L8's answer was lost, and the key read afterwards (L7) no longer shows the grant it was
    /// sent for: the revocation took effect. The fences get [`Settled::floor`].
    Settled(Settled),
    /// Not called: a recorded [`Progress`] was resumed.
    Resumed,
    /// Refused (a 4xx, or an order the contract would refuse, then without a status).
    Refused(StepError),
    /// Nothing was revoked: call again (L8 always names its grant, so that is always safe).
    Unavailable(StepError),
    /// L8 may have revoked the grant, and the read that would tell failed: neither resent nor
    /// given up. [`settle_and_run`] settles it by reading the key first.
    Unknown(Unsettled),
}

/// An L8 whose answer was lost, settled by reading the key: the grant it was sent for is gone.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Settled {
    /// The token L8 was sent for.
    pub revoked_token: i64,
    /// The token holding the key when it was read, if any: a holder after the revocation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub holder_token: Option<i64>,
    /// What came instead of L8's answer.
    pub lost: StepError,
}

impl Settled {
    /// The floor pushed to the fences: the lowest that fences the revoked token out (the account
    /// fence admits a post at `fence <= token`, the rail only `token > mark`). The lock server's
    /// own floor never arrived; it lies above the revoked token and below every later grant's
    /// token, so no later holder is fenced by this one.
    pub fn floor(&self) -> i64 {
        self.revoked_token.saturating_add(1)
    }
}

/// An L8 whose outcome is unknown: sent for `token`, no answer, and the key could not be read.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Unsettled {
    /// The token L8 was sent for.
    pub token: i64,
    /// What came instead of L8's answer.
    pub lost: StepError,
    /// Why the key could not be read.
    pub read: StepError,
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
    /// L8 may have revoked the grant and the key could not be read to tell: not a failure, not
    /// to be resent blindly. Run [`settle_and_run`] with [`RevokeReport::unsettled_token`], or
    /// read the key (L7): still held under that token, nothing was revoked.
    Unknown,
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
            LockStep::Unknown(_) => return Outcome::Unknown,
            LockStep::Revoked(_) | LockStep::Settled(_) | LockStep::Resumed => {}
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

    /// The token of an L8 whose outcome is unknown ([`Outcome::Unknown`]): what
    /// [`settle_and_run`] takes.
    pub fn unsettled_token(&self) -> Option<i64> {
        match &self.lock {
            LockStep::Unknown(u) => Some(u.token),
            _ => None,
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
            LockStep::Settled(s) => {
                let now = match s.holder_token {
                    Some(t) => format!("is held by token {t}, a grant after the revocation"),
                    None => "is not held".to_owned(),
                };
                let id = self
                    .progress
                    .as_ref()
                    .map(|p| p.revocation_id.to_string())
                    .unwrap_or_default();
                lines.push(format!(
                    "lock server: the answer to L8 for token {t} was lost ({lost}); read afterwards \
                     (L7), {key} {now}: the revocation took effect. Floor {floor}, the lowest that \
                     fences token {t} out (the lock server's own floor never arrived); revocation \
                     id {id} is this run's own",
                    t = s.revoked_token,
                    lost = s.lost,
                    key = self.key,
                    floor = s.floor(),
                ));
            }
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
            LockStep::Unknown(u) => lines.push(format!(
                "lock server: the answer to L8 for token {} was lost ({}), and reading the key \
                 failed ({}): whether that grant was revoked is unknown",
                u.token, u.lost, u.read
            )),
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
            Outcome::Incomplete | Outcome::Refused | Outcome::Unknown => self.summary(),
        });
        lines
    }

    /// One line for a status or an Event.
    pub fn summary(&self) -> String {
        let floor = self.progress.as_ref().map(|p| p.new_token_floor);
        match (self.outcome, floor) {
            (Outcome::Complete, Some(floor)) => {
                let token = self
                    .progress
                    .as_ref()
                    .and_then(|p| p.revoked_token)
                    .unwrap_or(0);
                let settled = if matches!(self.lock, LockStep::Settled(_)) {
                    " (L8's answer was lost; the key read afterwards showed the grant gone)"
                } else {
                    ""
                };
                format!("revoked token {token}, floor {floor} at both fences{settled}")
            }
            (_, None) => match &self.lock {
                LockStep::Refused(e) => format!("the lock server refused: {e}"),
                LockStep::Unavailable(e) => format!("the lock server did not answer: {e}"),
                LockStep::Unknown(u) => format!(
                    "outcome unknown: L8 for token {t} of {key} went unanswered ({lost}) and \
                     reading the key failed ({read}); read it (GET /v1/locks/{key}): still held \
                     by token {t}, nothing was revoked; not, it was, and both fences still need \
                     floor {floor}",
                    t = u.token,
                    key = self.key,
                    lost = u.lost,
                    read = u.read,
                    floor = u.token.saturating_add(1),
                ),
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

/// How many times one run sends L8 for one grant while its answer keeps being lost and the key
/// still shows that grant (nothing revoked yet).
pub const L8_SENDS_MAX: usize = 3;

/// Runs the flow: L8 (unless `resume` holds a recorded result), then each fence not yet done.
/// It never fails as a whole: every step's result is in the report.
///
/// L8 is sent for the grant the key shows (L7) just before, and only when that is the order's
/// `expectedToken` if it has one: a key held by another grant, or by none, is refused without
/// L8. An L8 whose outcome is unknown is settled by reading the key (see the module's notes).
pub async fn run<S: RevokeSteps + ?Sized>(
    steps: &S,
    order: &RevokeOrder,
    resume: Option<&Progress>,
) -> RevokeReport {
    if let Err(message) = order.check() {
        return not_sent(order, &message);
    }
    let started = match resume {
        Some(recorded) => Ok((LockStep::Resumed, recorded.clone())),
        None => revoke_at_lock_server(steps, order, None).await,
    };
    fence(steps, order, started).await
}

/// Resumes a run whose L8 for `token` has an unknown outcome ([`Outcome::Unknown`]): the key is
/// read first (L7). That grant still holding it, nothing was revoked and L8 is sent for it
/// again; gone, the revocation took effect and the flow goes on to the fences; the read failing,
/// the outcome is still unknown. Never an L8 for another grant.
pub async fn settle_and_run<S: RevokeSteps + ?Sized>(
    steps: &S,
    order: &RevokeOrder,
    token: i64,
) -> RevokeReport {
    let order = RevokeOrder {
        expected_token: Some(token),
        ..order.clone()
    };
    if let Err(message) = order.check() {
        return not_sent(&order, &message);
    }
    let lost = StepError {
        status: None,
        code: None,
        message: format!("an earlier run's L8 for token {token} went unanswered"),
    };
    let started = revoke_at_lock_server(steps, &order, Some((token, lost))).await;
    fence(steps, &order, started).await
}

/// The report of a flow that ended at the lock server.
fn lock_only(order: &RevokeOrder, lock: LockStep) -> RevokeReport {
    RevokeReport {
        key: order.key.clone(),
        account_id: order.account_id.clone(),
        outcome: RevokeReport::outcome_of(&lock, &FenceStep::Skipped, &FenceStep::Skipped),
        lock,
        progress: None,
        account_fence: FenceStep::Skipped,
        rail_high_water: FenceStep::Skipped,
    }
}

fn not_sent(order: &RevokeOrder, message: &str) -> RevokeReport {
    lock_only(
        order,
        LockStep::Refused(StepError {
            status: None,
            code: None,
            message: format!("not sent: {message}"),
        }),
    )
}

/// The token of the grant holding `key` now (L7), `None` when none does (a key never seen is
/// 404).
async fn holder<S: RevokeSteps + ?Sized>(steps: &S, key: &str) -> Result<Option<i64>, ClientError> {
    match steps.read_lock(key).await {
        Ok(info) if info.held => {
            info.fencing_token
                .map(Some)
                .ok_or_else(|| ClientError::Protocol {
                    url: String::new(),
                    message: format!("L7 says {key} is held but names no token"),
                })
        }
        Ok(_) => Ok(None),
        Err(e) if e.code() == Some(ErrorCode::NotFound) => Ok(None),
        Err(e) => Err(e),
    }
}

/// L8 for the grant the key shows, settled by reading the key when its answer is lost; the lock
/// step and the progress to fence from, or the lock step that ends the flow. `unsettled` is an
/// earlier L8 (token, what came instead of its answer) to settle before anything is sent.
async fn revoke_at_lock_server<S: RevokeSteps + ?Sized>(
    steps: &S,
    order: &RevokeOrder,
    unsettled: Option<(i64, StepError)>,
) -> Result<(LockStep, Progress), Box<LockStep>> {
    let key = &order.key;
    let (token, mut lost) = match unsettled {
        Some((token, lost)) => (token, Some(lost)),
        None => (pinned_grant(steps, order).await?, None),
    };
    let request = RevokeRequest {
        operator: order.operator.clone(),
        reason: order.reason.clone(),
        expected_token: Some(token),
    };
    let mut sends = 0;
    let mut backoff = crate::session::retry_policy(L8_SENDS_MAX).build();
    loop {
        if let Some(lost) = lost.take() {
            match holder(steps, key).await {
                Err(read) => {
                    return Err(Box::new(LockStep::Unknown(Unsettled {
                        token,
                        lost,
                        read: (&read).into(),
                    })));
                }
                // The grant is still there: L8 did not apply.
                Ok(Some(now)) if now == token => {
                    if sends >= L8_SENDS_MAX {
                        return Err(Box::new(LockStep::Unavailable(StepError {
                            message: format!(
                                "L8 for token {token} went unanswered {sends} times, and each \
                                 time {key} was still held under that token: nothing was \
                                 revoked, run again (last: {lost})"
                            ),
                            ..lost
                        })));
                    }
                    tracing::warn!(
                        event = "revoke_outcome_settled",
                        key = %key,
                        token,
                        error = %lost,
                        applied = false,
                        "an L8 whose answer was lost did not apply (the key still shows the grant); sending it again"
                    );
                    if let Some(wait) = backoff.next() {
                        tokio::time::sleep(wait).await;
                    }
                }
                Ok(now) => return settled(order, token, now, lost),
            }
        }
        sends += 1;
        match steps.revoke_lock(key, &request).await {
            Ok(revocation) => {
                let progress = Progress {
                    revocation_id: revocation.revocation_id,
                    new_token_floor: revocation.new_token_floor,
                    revoked_token: Some(revocation.revoked_token),
                    payment_fenced: false,
                    rail_fenced: false,
                };
                return Ok((LockStep::Revoked(revocation), progress));
            }
            // OUTCOME_UNKNOWN, a 500, no answer after the request went out, an answer outside
            // the contract: L8 may have applied. Settled by reading, never resent blindly.
            Err(error) if classify(&error) == Failure::Retryable && !error.retry_safe() => {
                lost = Some((&error).into())
            }
            Err(error) => {
                return Err(Box::new(match classify(&error) {
                    Failure::Refused => LockStep::Refused((&error).into()),
                    Failure::Retryable => LockStep::Unavailable((&error).into()),
                }));
            }
        }
    }
}

/// The grant L8 is sent for: the one holding the key now (L7), which must be the order's
/// `expectedToken` when it names one. A key held by another grant or by none is refused here, as
/// L8 would refuse it (`409 FENCED_OUT`, `404`): so every token L8 carries was a live grant's,
/// and a settled revocation's floor (token + 1) is never one a bogus token made up.
async fn pinned_grant<S: RevokeSteps + ?Sized>(
    steps: &S,
    order: &RevokeOrder,
) -> Result<i64, Box<LockStep>> {
    let key = &order.key;
    match (holder(steps, key).await, order.expected_token) {
        (Ok(Some(now)), None) => Ok(now),
        (Ok(Some(now)), Some(expected)) if now == expected => Ok(now),
        (Ok(Some(now)), Some(expected)) => Err(Box::new(LockStep::Refused(StepError {
            status: None,
            code: Some(ErrorCode::FencedOut),
            message: format!(
                "not sent: {key} is held by token {now}, not {expected} (L7): read the lock again \
                 before revoking"
            ),
        }))),
        (Ok(None), _) => Err(Box::new(LockStep::Refused(StepError {
            status: None,
            code: Some(ErrorCode::NotFound),
            message: format!("not sent: nothing holds {key} now (L7); there is no grant to revoke"),
        }))),
        (Err(error), _) => {
            let step = StepError {
                message: format!("not sent: reading who holds {key} (L7) failed: {error}"),
                ..(&error).into()
            };
            Err(Box::new(match classify(&error) {
                Failure::Refused => LockStep::Refused(step),
                Failure::Retryable => LockStep::Unavailable(step),
            }))
        }
    }
}

/// An L8 for `token` whose answer was lost, and the key read afterwards shows `now`, not that
/// grant. A revocation's floor lies above the revoked token and below every later grant's token,
/// so a holder at `token + 1` or below got the key without this revocation: that is refused (the
/// grant ended otherwise; the new holder's first write fences it out). Otherwise the revocation
/// took effect, and the fences get `token + 1` under a revocation id of this run's own.
fn settled(
    order: &RevokeOrder,
    token: i64,
    now: Option<i64>,
    lost: StepError,
) -> Result<(LockStep, Progress), Box<LockStep>> {
    let key = &order.key;
    if let Some(now) = now.filter(|now| *now <= token.saturating_add(1)) {
        return Err(Box::new(LockStep::Refused(StepError {
            status: None,
            code: None,
            message: format!(
                "the answer to L8 for token {token} was lost ({lost}) and {key} is held by token \
                 {now} now, which no revocation of {token} lets through: the grant ended without \
                 this revocation, and the holder's own first write fences {token} out"
            ),
        })));
    }
    tracing::warn!(
        event = "revoke_outcome_settled",
        key = %key,
        token,
        holder_token = now,
        error = %lost,
        applied = true,
        "an L8 whose answer was lost took effect (the key no longer shows the grant); fencing with the token after it"
    );
    let step = Settled {
        revoked_token: token,
        holder_token: now,
        lost,
    };
    let progress = Progress {
        revocation_id: Uuid::new_v4(),
        new_token_floor: step.floor(),
        revoked_token: Some(token),
        payment_fenced: false,
        rail_fenced: false,
    };
    Ok((LockStep::Settled(step), progress))
}

/// The fences not yet done, with the progress the lock server's step gave.
async fn fence<S: RevokeSteps + ?Sized>(
    steps: &S,
    order: &RevokeOrder,
    started: Result<(LockStep, Progress), Box<LockStep>>,
) -> RevokeReport {
    let (lock, mut progress) = match started {
        Ok(started) => started,
        Err(lock) => return lock_only(order, *lock),
    };
    // Both enforcement points get the same floor, operator, reason and revocation id.
    let fence = FenceRequest {
        floor: progress.new_token_floor,
        operator: order.operator.clone(),
        reason: order.reason.clone(),
        revocation_id: progress.revocation_id,
    };
    // Both writes repeat harmlessly: the fence's under the same idempotency key, the mark as a
    // maximum. A lost answer is Unavailable, and the resume sends the same write again.
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
