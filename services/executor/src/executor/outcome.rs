//! How a payout cycle ends: the outcomes, and which refusal of which step leads to which.

use dlock_contract::ErrorCode;
use dlock_contract::client::ClientError;

/// How one payout cycle ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum CycleOutcome {
    /// The payout is terminal or quarantined; nothing more to do.
    Settled,
    /// Its lock is held by another worker; come back later.
    Contended,
    /// Another holder's submission is in flight, or the answer was lost; re-read later.
    Pending,
    /// A newer holder exists: the critical section was aborted.
    FencedOut,
    /// The local deadline passed before a protected write.
    DeadlinePassed,
    /// A hop failed without a verdict; the cycle was abandoned and is retried later.
    Unavailable,
    /// The rail's outcome is unknown: the payout is quarantined (RAIL_AMBIGUOUS) and settled
    /// as far as automation goes.
    Ambiguous,
    /// paydb refused the write with RECOVERY_REQUIRED: it may have lost writes in a failover and
    /// takes none until an operator runs `dlock recover paydb-epoch` (docs/design.md#d-12).
    /// Nothing was written; retried after a growing back-off, never in a tight loop.
    RecoveryRequired,
}

impl CycleOutcome {
    /// The `outcome` label of `payout_execute_total`.
    pub fn label(self) -> &'static str {
        match self {
            CycleOutcome::Settled => "settled",
            CycleOutcome::Contended => "contended",
            CycleOutcome::Pending => "pending",
            CycleOutcome::FencedOut => "fenced_out",
            CycleOutcome::DeadlinePassed => "deadline_passed",
            CycleOutcome::Unavailable => "unavailable",
            CycleOutcome::Ambiguous => "ambiguous",
            CycleOutcome::RecoveryRequired => "recovery_required",
        }
    }
}

/// The steps of a cycle whose refusals decide how it ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Step {
    Acquire,
    Claim,
    Submit,
    Post,
}

impl Step {
    pub(super) fn name(self) -> &'static str {
        match self {
            Step::Acquire => "acquire",
            Step::Claim => "claim",
            Step::Submit => "submit",
            Step::Post => "post",
        }
    }
}

/// How a cycle ends when `step` is answered with `e`: a pure function of the two.
pub(super) fn outcome_of(step: Step, e: &ClientError) -> CycleOutcome {
    use ErrorCode as C;
    match (step, e.code()) {
        // paydb waits for an operator: no step of any cycle can write until then.
        (_, Some(C::RecoveryRequired)) => CycleOutcome::RecoveryRequired,
        (Step::Acquire, Some(C::LockContended | C::ContentionExceeded)) => CycleOutcome::Contended,
        (Step::Acquire, _) => CycleOutcome::Unavailable,
        (_, Some(C::FencedOut)) => CycleOutcome::FencedOut,
        (Step::Claim, Some(C::InsufficientFunds)) => CycleOutcome::Settled,
        (Step::Claim | Step::Post, Some(C::PayoutNotClaimable)) => CycleOutcome::Pending,
        // The rail's outcome is unknown: the payout is quarantined (RAIL_AMBIGUOUS).
        (Step::Submit, Some(C::RailAmbiguous)) => CycleOutcome::Ambiguous,
        // The rail declined (422): the payout is FAILED.
        (Step::Submit, Some(C::ValidationFailed))
            if matches!(e, ClientError::Api { status: 422, .. }) =>
        {
            CycleOutcome::Settled
        }
        (Step::Submit, Some(C::DuplicateSubmission)) => CycleOutcome::Pending,
        // RAIL_UNAVAILABLE, NOT_LEADER, no answer: a later cycle re-reads and tries again.
        _ => CycleOutcome::Unavailable,
    }
}
