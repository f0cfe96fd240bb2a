//! What each paydb write function answered, one enum per operation. Every function returns an
//! `outcome text`; it is read here, once, with the columns that outcome carries. A text this
//! build does not know is an error that names it, never a guess.

use dlock_contract::payment::{Direction, LedgerEntry, PayoutState};
use sqlx::FromRow;
use uuid::Uuid;

use super::{StoreResult, missing, parse_state, unknown};

/// A ledger entry as paydb stores it (`direction` is `DEBIT` or `CREDIT`).
pub(super) fn entry(
    entry_id: Uuid,
    account_id: String,
    direction: &str,
    amount_minor: i64,
    fence: i64,
) -> LedgerEntry {
    LedgerEntry {
        entry_id,
        account_id,
        direction: if direction == "DEBIT" {
            Direction::Debit
        } else {
            Direction::Credit
        },
        amount_minor,
        fence,
    }
}

/// Why a write on a payout changed nothing: the same three answers for a claim, a post, a
/// cancel and a resolution.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    /// The account's fence is above the token (at or above it, for a claim or a cancel): a
    /// newer holder exists. `account_id` is the payout's account.
    FencedOut {
        account_id: String,
        fence: i64,
    },
    /// The payout is in another state than the write needs (`state`, as paydb has it).
    NotClaimable {
        state: Option<String>,
    },
    NotFound,
}

impl Refusal {
    /// The refusal `outcome` names, with the columns it carries; any other text is unknown.
    fn parse(
        function: &str,
        outcome: &str,
        state: Option<String>,
        account_id: String,
        fence: Option<i64>,
    ) -> StoreResult<Self> {
        Ok(match outcome {
            "fenced_out" => Self::FencedOut {
                account_id,
                fence: fence.unwrap_or_default(),
            },
            "not_claimable" => Self::NotClaimable { state },
            "not_found" => Self::NotFound,
            other => return Err(unknown(function, other)),
        })
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CreateAccountOutcome {
    Created,
    Exists,
    /// The id is taken by an account of this other currency (or a system account).
    Conflict {
        currency: String,
    },
}

impl CreateAccountOutcome {
    pub(super) fn parse(outcome: &str, existing: String) -> StoreResult<Self> {
        Ok(match outcome {
            "created" => Self::Created,
            "exists" => Self::Exists,
            "conflict" => Self::Conflict { currency: existing },
            other => return Err(unknown("pay_create_account", other)),
        })
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FundOutcome {
    Funded {
        balance_minor: i64,
    },
    /// The reference was funded before with the same account and amount.
    Exists {
        balance_minor: i64,
    },
    Conflict,
    NotFound,
    NotCustomer,
}

impl FundOutcome {
    pub(super) fn parse(outcome: &str, balance: Option<i64>) -> StoreResult<Self> {
        let balance = || balance.ok_or_else(|| missing("balance"));
        Ok(match outcome {
            "funded" => Self::Funded {
                balance_minor: balance()?,
            },
            "exists" => Self::Exists {
                balance_minor: balance()?,
            },
            "conflict" => Self::Conflict,
            "not_customer" => Self::NotCustomer,
            "not_found" => Self::NotFound,
            other => return Err(unknown("pay_fund", other)),
        })
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CreatePayoutOutcome {
    Created,
    Exists,
    Conflict,
    AccountUnknown,
    CurrencyMismatch,
}

impl CreatePayoutOutcome {
    pub(super) fn parse(outcome: &str) -> StoreResult<Self> {
        Ok(match outcome {
            "created" => Self::Created,
            "exists" => Self::Exists,
            "conflict" => Self::Conflict,
            "currency_mismatch" => Self::CurrencyMismatch,
            "account_unknown" => Self::AccountUnknown,
            other => return Err(unknown("pay_create_payout", other)),
        })
    }
}

/// What a claim (P2) did. `account_id` is the payout's account.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClaimOutcome {
    Claimed {
        account_id: String,
        claim_token: i64,
        fence: i64,
        attempt_count: i32,
    },
    /// Out of attempts: abandoned instead of claimed again.
    Abandoned {
        account_id: String,
        attempt_count: i32,
    },
    /// The payout is now FAILED.
    InsufficientFunds {
        account_id: String,
        available_minor: Option<i64>,
        amount_minor: Option<i64>,
    },
    Refused(Refusal),
}

/// The columns `pay_claim_bounded` (and `pay_claim_once` after its record's) returns.
#[derive(Debug, Clone, FromRow)]
pub(super) struct ClaimRow {
    outcome: Option<String>,
    state: Option<String>,
    fence: Option<i64>,
    attempt_count: Option<i32>,
    claim_token: Option<i64>,
    account_id: Option<String>,
    available_minor: Option<i64>,
    amount_minor: Option<i64>,
}

impl ClaimRow {
    pub(super) fn into_outcome(self, function: &str) -> StoreResult<ClaimOutcome> {
        let outcome = self.outcome.ok_or_else(|| missing("claim outcome"))?;
        let account_id = self.account_id.unwrap_or_default();
        Ok(match outcome.as_str() {
            "claimed" => ClaimOutcome::Claimed {
                claim_token: self.claim_token.ok_or_else(|| missing("claim token"))?,
                fence: self.fence.ok_or_else(|| missing("fence"))?,
                attempt_count: self.attempt_count.ok_or_else(|| missing("attempt count"))?,
                account_id,
            },
            "abandoned" => ClaimOutcome::Abandoned {
                account_id,
                attempt_count: self.attempt_count.unwrap_or_default(),
            },
            "insufficient_funds" => ClaimOutcome::InsufficientFunds {
                account_id,
                available_minor: self.available_minor,
                amount_minor: self.amount_minor,
            },
            other => ClaimOutcome::Refused(Refusal::parse(
                function, other, self.state, account_id, self.fence,
            )?),
        })
    }
}

/// What a post (P3) did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PostOutcome {
    Posted {
        balance_minor: i64,
    },
    /// The rail reference or the submission is not the one the rail acknowledged.
    ReferenceMismatch,
    Refused(Refusal),
}

/// The columns `pay_post` (and `pay_post_once` after its record's) returns.
#[derive(Debug, Clone, FromRow)]
pub(super) struct PostRow {
    outcome: Option<String>,
    state: Option<String>,
    fence: Option<i64>,
    account_id: Option<String>,
    balance_minor: Option<i64>,
}

impl PostRow {
    pub(super) fn into_outcome(self, function: &str) -> StoreResult<PostOutcome> {
        let outcome = self.outcome.ok_or_else(|| missing("post outcome"))?;
        Ok(match outcome.as_str() {
            "posted" => PostOutcome::Posted {
                balance_minor: self.balance_minor.ok_or_else(|| missing("balance"))?,
            },
            "reference_mismatch" => PostOutcome::ReferenceMismatch,
            other => PostOutcome::Refused(Refusal::parse(
                function,
                other,
                self.state,
                self.account_id.unwrap_or_default(),
                self.fence,
            )?),
        })
    }
}

/// What a cancel (`pay_abandon`) did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AbandonOutcome {
    Abandoned {
        account_id: String,
        fence: i64,
        attempt_count: i32,
    },
    Refused(Refusal),
}

#[derive(Debug, Clone, FromRow)]
pub(super) struct AbandonRow {
    outcome: String,
    state: Option<String>,
    fence: Option<i64>,
    attempt_count: Option<i32>,
    account_id: Option<String>,
}

impl AbandonRow {
    pub(super) fn into_outcome(self) -> StoreResult<AbandonOutcome> {
        let account_id = self.account_id.unwrap_or_default();
        Ok(match self.outcome.as_str() {
            "abandoned" => AbandonOutcome::Abandoned {
                account_id,
                fence: self.fence.ok_or_else(|| missing("fence"))?,
                attempt_count: self.attempt_count.ok_or_else(|| missing("attempt count"))?,
            },
            other => AbandonOutcome::Refused(Refusal::parse(
                "pay_abandon",
                other,
                self.state,
                account_id,
                self.fence,
            )?),
        })
    }
}

/// An account fence before and after a write that moves it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FenceMove {
    pub previous_fence: i64,
    pub fence: i64,
}

/// What a fence advance did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AdvanceOutcome {
    /// `fence` is `max(previous_fence, floor)`.
    Advanced(FenceMove),
    NotFound,
}

#[derive(Debug, Clone, FromRow)]
pub(super) struct FenceRow {
    outcome: String,
    previous_fence: Option<i64>,
    fence: Option<i64>,
}

impl FenceRow {
    fn fence_move(&self) -> StoreResult<FenceMove> {
        Ok(FenceMove {
            previous_fence: self
                .previous_fence
                .ok_or_else(|| missing("previous fence"))?,
            fence: self.fence.ok_or_else(|| missing("fence"))?,
        })
    }

    pub(super) fn into_advance(self) -> StoreResult<AdvanceOutcome> {
        Ok(match self.outcome.as_str() {
            "advanced" => AdvanceOutcome::Advanced(self.fence_move()?),
            "not_found" => AdvanceOutcome::NotFound,
            other => return Err(unknown("pay_advance_fence", other)),
        })
    }
}

/// What a docs/design.md#d-8 fence lowering did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LowerOutcome {
    /// Lowered to the operator's token and recorded in `fence_recoveries`.
    Lowered {
        fence: FenceMove,
        recovery_id: Option<i64>,
    },
    /// The fence was already at or below the token.
    Unchanged(FenceMove),
    /// The token is below `seen_token`, the highest token the account admitted with a proof
    /// (`accounts.max_seen_token`): lowering to it would readmit the holders in between. Nothing
    /// changed; the fence stays at `fence`.
    BelowSeen {
        fence: i64,
        seen_token: i64,
    },
    NotFound,
}

#[derive(Debug, Clone, FromRow)]
pub(super) struct LowerRow {
    #[sqlx(flatten)]
    fence: FenceRow,
    recovery_id: Option<i64>,
    seen_token: Option<i64>,
}

impl LowerRow {
    pub(super) fn into_outcome(self) -> StoreResult<LowerOutcome> {
        Ok(match self.fence.outcome.as_str() {
            "lowered" => LowerOutcome::Lowered {
                fence: self.fence.fence_move()?,
                recovery_id: self.recovery_id,
            },
            "unchanged" => LowerOutcome::Unchanged(self.fence.fence_move()?),
            "below_seen" => LowerOutcome::BelowSeen {
                fence: self.fence.fence_move()?.fence,
                seen_token: self.seen_token.ok_or_else(|| missing("seen token"))?,
            },
            "not_found" => LowerOutcome::NotFound,
            other => return Err(unknown("pay_lower_fence", other)),
        })
    }
}

/// What a resolution of a RAIL_AMBIGUOUS payout did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ResolveOutcome {
    Resolved {
        state: PayoutState,
        balance_minor: i64,
    },
    NotClaimable {
        state: Option<String>,
    },
    /// The resolution contradicts what the rail proxy recorded for the payout's attempt.
    Contradicted(Contradiction),
    NotFound,
}

/// What the rail proxy recorded for a payout's attempt that a resolution contradicts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Contradiction {
    pub kind: ContradictionKind,
    /// The attempt's outcome as recorded (its late answer when the rail answered after the
    /// attempt was timed out).
    pub recorded_outcome: Option<String>,
    /// The reference the rail acknowledged, when it did.
    pub recorded_reference: Option<String>,
    pub submission_id: Option<Uuid>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ContradictionKind {
    /// POSTED under another reference than the one the rail acknowledged.
    ReferenceMismatch,
    /// FAILED, but the rail acknowledged the transfer.
    RailAcked,
    /// POSTED, but the rail declined the transfer.
    RailRejected,
    /// POSTED under a reference the rail acknowledged for, or a resolution recorded for, another
    /// payout.
    ReferenceTaken,
    /// FAILED of an attempt nobody recorded, without the reconciler's finding that the statement
    /// lacks it after the settlement window.
    NoAbsentFinding,
    /// POSTED of an attempt nobody recorded, without the reconciler's finding of the transfer on
    /// the statement under that reference.
    NoPresentFinding,
}

#[derive(Debug, Clone, FromRow)]
pub(super) struct ResolveRow {
    outcome: String,
    state: Option<String>,
    balance_minor: Option<i64>,
    recorded_outcome: Option<String>,
    recorded_reference: Option<String>,
    submission_id: Option<Uuid>,
}

impl ResolveRow {
    pub(super) fn into_outcome(self) -> StoreResult<ResolveOutcome> {
        let kind = match self.outcome.as_str() {
            "reference_mismatch" => Some(ContradictionKind::ReferenceMismatch),
            "rail_acked" => Some(ContradictionKind::RailAcked),
            "rail_rejected" => Some(ContradictionKind::RailRejected),
            "reference_taken" => Some(ContradictionKind::ReferenceTaken),
            "no_absent_finding" => Some(ContradictionKind::NoAbsentFinding),
            "no_present_finding" => Some(ContradictionKind::NoPresentFinding),
            _ => None,
        };
        if let Some(kind) = kind {
            return Ok(ResolveOutcome::Contradicted(Contradiction {
                kind,
                recorded_outcome: self.recorded_outcome,
                recorded_reference: self.recorded_reference,
                submission_id: self.submission_id,
            }));
        }
        Ok(match self.outcome.as_str() {
            "resolved" => ResolveOutcome::Resolved {
                state: parse_state(self.state.as_deref().unwrap_or_default())?,
                balance_minor: self.balance_minor.ok_or_else(|| missing("balance"))?,
            },
            "not_claimable" => ResolveOutcome::NotClaimable { state: self.state },
            "not_found" => ResolveOutcome::NotFound,
            other => return Err(unknown("pay_resolve", other)),
        })
    }
}
