//! Bodies of the payment-resource surface (docs/contract.md#s3-4 and docs/contract.md#extensions),
//! shared by the service and its typed client. Money is `i64` minor units with an ISO 4217
//! currency; no floats anywhere.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

/// The longest account id; the alphabet is the lock keys' (the executor locks `payout:{id}`).
pub const ACCOUNT_ID_LEN_MAX: usize = 64;
/// The longest beneficiary reference, funding reference, rail reference.
pub const REFERENCE_LEN_MAX: usize = 128;
/// The longest operator name.
pub const OPERATOR_LEN_MAX: usize = 128;
/// The longest reason or evidence text of an operator action.
pub const REASON_LEN_MAX: usize = 4096;
/// The shortest reason of a fence advance, as for a revocation (L8).
pub const REASON_LEN_MIN: usize = 8;
/// The largest amount one posting or payout may move: 10^15 minor units. Far beyond any payout,
/// and far enough below `i64::MAX` that no sum of balances can overflow.
pub const AMOUNT_MINOR_MAX: i64 = 1_000_000_000_000_000;
/// P1 page sizes.
pub const LIST_LIMIT_DEFAULT: i64 = 100;
pub const LIST_LIMIT_MAX: i64 = 500;
/// Account-id prefixes that belong to the system accounts of a currency.
pub const FUNDING_PREFIX: &str = "funding-";
pub const SETTLEMENT_PREFIX: &str = "rail-settlement-";

/// The active ISO 4217 codes the service accepts (the same list as paydb's `currencies`).
pub const CURRENCIES: [&str; 155] = [
    "AED", "AFN", "ALL", "AMD", "ANG", "AOA", "ARS", "AUD", "AWG", "AZN", "BAM", "BBD", "BDT",
    "BGN", "BHD", "BIF", "BMD", "BND", "BOB", "BRL", "BSD", "BTN", "BWP", "BYN", "BZD", "CAD",
    "CDF", "CHF", "CLP", "CNY", "COP", "CRC", "CUP", "CVE", "CZK", "DJF", "DKK", "DOP", "DZD",
    "EGP", "ERN", "ETB", "EUR", "FJD", "FKP", "GBP", "GEL", "GHS", "GIP", "GMD", "GNF", "GTQ",
    "GYD", "HKD", "HNL", "HTG", "HUF", "IDR", "ILS", "INR", "IQD", "IRR", "ISK", "JMD", "JOD",
    "JPY", "KES", "KGS", "KHR", "KMF", "KPW", "KRW", "KWD", "KYD", "KZT", "LAK", "LBP", "LKR",
    "LRD", "LSL", "LYD", "MAD", "MDL", "MGA", "MKD", "MMK", "MNT", "MOP", "MRU", "MUR", "MVR",
    "MWK", "MXN", "MYR", "MZN", "NAD", "NGN", "NIO", "NOK", "NPR", "NZD", "OMR", "PAB", "PEN",
    "PGK", "PHP", "PKR", "PLN", "PYG", "QAR", "RON", "RSD", "RUB", "RWF", "SAR", "SBD", "SCR",
    "SDG", "SEK", "SGD", "SHP", "SLE", "SOS", "SRD", "SSP", "STN", "SVC", "SYP", "SZL", "THB",
    "TJS", "TMT", "TND", "TOP", "TRY", "TTD", "TWD", "TZS", "UAH", "UGX", "USD", "UYU", "UZS",
    "VES", "VND", "VUV", "WST", "XAF", "XCD", "XOF", "XPF", "YER", "ZAR", "ZMW", "ZWL",
];

pub fn currency_is_valid(code: &str) -> bool {
    CURRENCIES.contains(&code)
}

/// What [`account_id_is_valid`] allows, as a validation message says it.
pub const ACCOUNT_ID_RULE: &str = "must be 1 to 64 of [a-zA-Z0-9:._-]";

/// The alphabet of an account id, the lock keys' ([`crate::lock::KEY_PATTERN`]); its length is
/// 1 to [`ACCOUNT_ID_LEN_MAX`]. [`account_id_is_valid`] matches it, and the PayoutBatch custom
/// resource's schema carries it, so the API server refuses what the services would.
pub const ACCOUNT_ID_PATTERN: &str = crate::lock::KEY_PATTERN;

/// The alphabet of an opaque reference: visible ASCII (`!` to `~`), no spaces; its length is 1 to
/// [`REFERENCE_LEN_MAX`]. [`reference_is_valid`] matches it, and the custom resources' schemas
/// carry it.
pub const REFERENCE_PATTERN: &str = "^[!-~]*$";

/// Whether `id` is an account id the contract allows: 1–64 of `[a-zA-Z0-9:._-]`.
pub fn account_id_is_valid(id: &str) -> bool {
    (1..=ACCOUNT_ID_LEN_MAX).contains(&id.len()) && crate::lock::matches_key_alphabet(id)
}

/// Whether `text` is an opaque reference: 1–128 visible ASCII characters, no spaces.
pub fn reference_is_valid(text: &str) -> bool {
    static ALPHABET: std::sync::LazyLock<Option<regex::Regex>> =
        std::sync::LazyLock::new(|| regex::Regex::new(REFERENCE_PATTERN).ok());
    (1..=REFERENCE_LEN_MAX).contains(&text.len())
        && ALPHABET.as_ref().is_some_and(|re| re.is_match(text))
}

/// An account id in `field`, by [`account_id_is_valid`]; the error says the rule.
pub fn check_account_id(field: &str, id: &str) -> Result<(), crate::error::FieldError> {
    account_id_is_valid(id).then_some(()).ok_or_else(|| {
        crate::error::FieldError::new(
            field,
            format!("must be 1 to {ACCOUNT_ID_LEN_MAX} characters of [a-zA-Z0-9:._-]"),
        )
    })
}

/// `amountMinor`: a whole number of minor units from 1 to [`AMOUNT_MINOR_MAX`].
pub fn check_amount(amount: i64) -> Result<(), crate::error::FieldError> {
    (1..=AMOUNT_MINOR_MAX)
        .contains(&amount)
        .then_some(())
        .ok_or_else(|| {
            crate::error::FieldError::new(
                "amountMinor",
                format!(
                    "must be an integer number of minor units from 1 to {AMOUNT_MINOR_MAX}, got {amount}"
                ),
            )
        })
}

/// `currency`: an active ISO 4217 code ([`CURRENCIES`]).
pub fn check_currency(currency: &str) -> Result<(), crate::error::FieldError> {
    currency_is_valid(currency).then_some(()).ok_or_else(|| {
        crate::error::FieldError::new(
            "currency",
            format!(
                "must be an active ISO 4217 code in upper case (EUR, USD, ...), got {currency:?}"
            ),
        )
    })
}

/// An opaque reference in `field` (a beneficiary, a funding or a rail reference), by
/// [`reference_is_valid`].
pub fn check_reference(field: &str, text: &str) -> Result<(), crate::error::FieldError> {
    reference_is_valid(text).then_some(()).ok_or_else(|| {
        crate::error::FieldError::new(
            field,
            format!("must be 1 to {REFERENCE_LEN_MAX} visible ASCII characters without spaces"),
        )
    })
}

/// The eight values of `payout.state`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum PayoutState {
    Pending,
    Claimed,
    Submitting,
    RailAcked,
    Posted,
    Failed,
    RailAmbiguous,
    Abandoned,
}

impl PayoutState {
    pub const ALL: [PayoutState; 8] = [
        PayoutState::Pending,
        PayoutState::Claimed,
        PayoutState::Submitting,
        PayoutState::RailAcked,
        PayoutState::Posted,
        PayoutState::Failed,
        PayoutState::RailAmbiguous,
        PayoutState::Abandoned,
    ];

    pub const fn as_str(self) -> &'static str {
        match self {
            PayoutState::Pending => "PENDING",
            PayoutState::Claimed => "CLAIMED",
            PayoutState::Submitting => "SUBMITTING",
            PayoutState::RailAcked => "RAIL_ACKED",
            PayoutState::Posted => "POSTED",
            PayoutState::Failed => "FAILED",
            PayoutState::RailAmbiguous => "RAIL_AMBIGUOUS",
            PayoutState::Abandoned => "ABANDONED",
        }
    }

    pub fn parse(text: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|s| s.as_str() == text)
    }

    /// Terminal states never change again.
    pub fn is_terminal(self) -> bool {
        matches!(
            self,
            PayoutState::Posted | PayoutState::Failed | PayoutState::Abandoned
        )
    }
}

impl std::fmt::Display for PayoutState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum Direction {
    Debit,
    Credit,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum AccountKind {
    Customer,
    Funding,
    Settlement,
}

#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct CreateAccountRequest {
    pub account_id: String,
    pub currency: String,
}

/// P5, and the answer of `POST /v1/accounts`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct Account {
    pub account_id: String,
    pub currency: String,
    pub kind: AccountKind,
    pub balance_minor: i64,
    /// The amounts of this account's payouts in CLAIMED, SUBMITTING, RAIL_ACKED, RAIL_AMBIGUOUS.
    pub held_minor: i64,
    /// `balanceMinor - heldMinor`: what a claim may still draw on.
    pub available_minor: i64,
    pub fence: i64,
    /// Recomputed from the ledger entries; equals `balanceMinor` (docs/contract.md#p5).
    pub ledger_sum_minor: i64,
    #[serde(with = "crate::time::millis")]
    pub updated_at: DateTime<Utc>,
}

#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct FundRequest {
    pub amount_minor: i64,
    pub reference: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct LedgerEntry {
    pub entry_id: Uuid,
    pub account_id: String,
    pub direction: Direction,
    pub amount_minor: i64,
    /// The fence the entry was written under (0 for funding, which is not a fenced write).
    pub fence: i64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct FundResponse {
    pub account_id: String,
    pub reference: String,
    pub entries: Vec<LedgerEntry>,
    pub balance_minor: i64,
}

/// `POST /v1/accounts/{accountId}/limits` (docs/contract.md#account-limits): the account's
/// limits as a whole; an absent or null field is no limit of that kind.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct AccountLimitsRequest {
    /// The largest amount of one payout, minor units (> 0).
    #[serde(default)]
    pub max_payout_minor: Option<i64>,
    /// The most the account's claims may take in one UTC day, minor units (> 0).
    #[serde(default)]
    pub daily_outflow_minor: Option<i64>,
}

/// The limits in force for an account, and the treasury identity that set them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct AccountLimits {
    pub account_id: String,
    pub max_payout_minor: Option<i64>,
    pub daily_outflow_minor: Option<i64>,
    pub set_by: String,
}

/// The `202` answer of a funding above the payment resource's
/// `auth.treasury.dual-approval-above` (docs/contract.md#dual-approval): recorded, not applied,
/// until a second treasury identity approves it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct PendingFunding {
    pub funding_id: Uuid,
    pub account_id: String,
    pub amount_minor: i64,
    pub reference: String,
    pub requested_by: String,
    /// `PENDING_APPROVAL`, or `APPROVED` when a retry finds it approved already.
    pub status: String,
}

/// What a fund request answers: applied (200), or above the payment resource's
/// `auth.treasury.dual-approval-above` recorded for a second treasury identity (202).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Funded {
    Applied(FundResponse),
    Pending(PendingFunding),
}

/// `POST /v1/fundings/{fundingId}/approve`: an empty object.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ApproveFundingRequest {}

/// The approved funding, applied: its entries and the account's balance after it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct ApprovedFunding {
    pub funding_id: Uuid,
    pub account_id: String,
    pub amount_minor: i64,
    pub reference: String,
    pub requested_by: String,
    pub approved_by: String,
    pub entries: Vec<LedgerEntry>,
    pub balance_minor: i64,
}

/// Which fundings `GET /v1/fundings` lists (docs/contract.md#list-fundings): those waiting for a
/// second treasury identity (`pending`, the default), those approved and applied (`applied`), or
/// both (`all`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum FundingsFilter {
    #[default]
    Pending,
    Applied,
    All,
}

impl FundingsFilter {
    pub const ALL: [FundingsFilter; 3] = [Self::Pending, Self::Applied, Self::All];

    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Pending => "pending",
            Self::Applied => "applied",
            Self::All => "all",
        }
    }

    pub fn parse(text: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|f| f.as_str() == text)
    }
}

/// One funding that needed a second treasury identity, as `GET /v1/fundings` lists it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct FundingSummary {
    pub funding_id: Uuid,
    pub account_id: String,
    pub amount_minor: i64,
    /// The account's currency.
    pub currency: String,
    pub reference: String,
    /// The treasury identity that asked for it.
    pub requested_by: String,
    pub requested_at: DateTime<Utc>,
    /// `PENDING_APPROVAL`, or `APPROVED` (approved and applied).
    pub status: String,
    pub approved_by: Option<String>,
    pub approved_at: Option<DateTime<Utc>>,
}

/// `GET /v1/fundings`: the fundings the filter selects, newest request first, at most `limit`
/// of them; `truncated` when there are more.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct FundingList {
    pub items: Vec<FundingSummary>,
    pub truncated: bool,
}

/// Declares a body that carries a payout's order: its id, the account it is paid from, the amount
/// in minor units with its currency, and the beneficiary. The payment resource registers a payout
/// from these five fields and the rail proxy submits the same five
/// ([`crate::rail::SubmissionRequest`]), so they are written once; each body stays a schema of its
/// own in its service's document (no doc comment: the schema would carry it as its description).
macro_rules! payout_order {
    ($name:ident) => {
        #[derive(
            Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize, utoipa::ToSchema,
        )]
        #[serde(rename_all = "camelCase", deny_unknown_fields)]
        pub struct $name {
            pub payout_id: uuid::Uuid,
            pub account_id: String,
            pub amount_minor: i64,
            pub currency: String,
            pub beneficiary_ref: String,
        }
    };
}
pub(crate) use payout_order;

// `POST /v1/payouts`: registers a payout, PENDING until a holder claims it.
payout_order!(CreatePayoutRequest);

/// One attempt at the rail, as the rail proxy recorded it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct SubmissionSummary {
    pub submission_id: Uuid,
    pub presented_token: i64,
    /// unresolved | ACKED | FENCED | TIMEOUT | REJECTED
    pub outcome: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rail_reference: Option<String>,
    #[serde(with = "crate::time::millis")]
    pub submitted_at: DateTime<Utc>,
    #[serde(
        default,
        with = "crate::time::millis_option",
        skip_serializing_if = "Option::is_none"
    )]
    pub resolved_at: Option<DateTime<Utc>>,
}

/// P4 (advisory), and the answer of `POST /v1/payouts`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct Payout {
    pub payout_id: Uuid,
    pub account_id: String,
    pub amount_minor: i64,
    pub currency: String,
    pub beneficiary_ref: String,
    pub state: PayoutState,
    pub attempt_count: i32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub claim_token: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rail_reference: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub submission_id: Option<Uuid>,
    #[serde(with = "crate::time::millis")]
    pub created_at: DateTime<Utc>,
    #[serde(with = "crate::time::millis")]
    pub updated_at: DateTime<Utc>,
    pub submissions: Vec<SubmissionSummary>,
}

/// One item of P1.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct PayoutSummary {
    pub payout_id: Uuid,
    pub account_id: String,
    pub amount_minor: i64,
    pub currency: String,
    pub state: PayoutState,
    pub attempt_count: i32,
    #[serde(with = "crate::time::millis")]
    pub created_at: DateTime<Utc>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct PayoutPage {
    pub items: Vec<PayoutSummary>,
    /// Opaque; pass it back as `cursor` for the next page. Absent on the last page.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next_cursor: Option<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ClaimRequest {
    /// PENDING, or CLAIMED for a recovery re-claim by a newer holder.
    pub expected_state: PayoutState,
}

/// P2.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct ClaimResponse {
    pub payout_id: Uuid,
    pub state: PayoutState,
    pub claim_token: i64,
    /// The account's fence after the claim.
    pub account_fence: i64,
    pub attempt_count: i32,
    pub idempotency_key: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub enum RailOutcome {
    #[serde(rename = "ACKED")]
    Acked,
}

#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PostRequest {
    pub rail_reference: String,
    pub submission_id: Uuid,
    pub rail_outcome: RailOutcome,
}

/// P3.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct PostResponse {
    pub payout_id: Uuid,
    pub state: PayoutState,
    /// The two balanced rows: DEBIT the customer, CREDIT the rail settlement account.
    pub entries: Vec<LedgerEntry>,
    /// The customer account's balance after the posting.
    pub balance_minor: i64,
}

/// docs/design.md#d-3: advance an account's fence to a revocation floor.
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct FenceRequest {
    pub floor: i64,
    pub operator: String,
    pub reason: String,
    pub revocation_id: Uuid,
}

/// The answer of a fence advance (docs/design.md#d-3): the account's fence before and after it,
/// and who made it, as the audit row records it (the typed-in operator and the authenticated
/// identity).
// The payment resource's document names the schema `FenceAdvanced`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
#[schema(as = FenceAdvanced)]
pub struct FenceResponse {
    pub account_id: String,
    pub previous_fence: i64,
    /// `max(previousFence, floor)`.
    pub fence: i64,
    pub revocation_id: Uuid,
    /// The body's operator, as typed.
    pub operator: String,
    /// What the caller's credential authenticated as; recorded beside the operator.
    pub identity: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum Resolution {
    Posted,
    Failed,
}

/// Out-of-band resolution of a RAIL_AMBIGUOUS payout.
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ResolveRequest {
    pub outcome: Resolution,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rail_reference: Option<String>,
    pub operator: String,
    pub evidence: String,
}

/// The answer of a resolution of a RAIL_AMBIGUOUS payout: its state, its ledger entries and
/// balance, and who resolved it.
// The payment resource's document names the schema `Resolved`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
#[schema(as = Resolved)]
pub struct ResolveResponse {
    pub payout_id: Uuid,
    pub state: PayoutState,
    /// Two rows when resolved POSTED, none when FAILED.
    pub entries: Vec<LedgerEntry>,
    pub balance_minor: i64,
    /// The body's operator, as typed.
    pub operator: String,
    /// What the caller's credential authenticated as; recorded beside the operator.
    pub identity: String,
}

/// Cancels a payout that never reached the rail: PENDING or CLAIMED → ABANDONED
/// (docs/contract.md#payout-states).
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct CancelRequest {
    /// PENDING, or CLAIMED for a payout whose holder is gone.
    pub expected_state: PayoutState,
    pub operator: String,
    /// 8 to 4096 characters: why nobody should pay it.
    pub reason: String,
}

#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct Cancelled {
    pub payout_id: Uuid,
    /// Always ABANDONED.
    pub state: PayoutState,
    /// The account's fence after the cancel (the cancel's token).
    pub account_fence: i64,
    pub attempt_count: i32,
    pub operator: String,
    pub identity: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn states_spell_as_on_the_wire() {
        for state in PayoutState::ALL {
            let wire = serde_json::to_value(state).unwrap_or_default();
            assert_eq!(wire, serde_json::Value::String(state.as_str().to_owned()));
            assert_eq!(PayoutState::parse(state.as_str()), Some(state));
        }
    }

    /// The server and its client share one type per answer; the answers of a fence advance and of
    /// a resolution spell as the payment resource's document says (`FenceAdvanced`, `Resolved`),
    /// who made them included, and read back as they were written.
    #[test]
    fn operator_answers_spell_as_documented() {
        let revocation_id = Uuid::from_u128(9);
        let fenced = FenceResponse {
            account_id: "acct-17".into(),
            previous_fence: 3,
            fence: 7,
            revocation_id,
            operator: "alice".into(),
            identity: "oncall".into(),
        };
        let wire = serde_json::json!({
            "accountId": "acct-17", "previousFence": 3, "fence": 7,
            "revocationId": revocation_id, "operator": "alice", "identity": "oncall",
        });
        assert_eq!(serde_json::to_value(&fenced).ok(), Some(wire.clone()));
        assert_eq!(
            serde_json::from_value::<FenceResponse>(wire).ok(),
            Some(fenced)
        );

        let resolved = ResolveResponse {
            payout_id: Uuid::from_u128(5),
            state: PayoutState::Failed,
            entries: Vec::new(),
            balance_minor: 100,
            operator: "alice".into(),
            identity: "oncall".into(),
        };
        let wire = serde_json::json!({
            "payoutId": Uuid::from_u128(5), "state": "FAILED", "entries": [],
            "balanceMinor": 100, "operator": "alice", "identity": "oncall",
        });
        assert_eq!(serde_json::to_value(&resolved).ok(), Some(wire.clone()));
        assert_eq!(
            serde_json::from_value::<ResolveResponse>(wire).ok(),
            Some(resolved)
        );

        use utoipa::ToSchema;
        assert_eq!(FenceResponse::name(), "FenceAdvanced");
        assert_eq!(ResolveResponse::name(), "Resolved");
    }

    /// The patterns are the rules: every byte string of up to two characters, and the limits,
    /// are judged as the byte-by-byte rules the checks had before they matched a pattern.
    #[test]
    fn the_patterns_allow_exactly_the_alphabets() {
        let old_account = |id: &str| {
            !id.is_empty()
                && id.len() <= ACCOUNT_ID_LEN_MAX
                && id
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || matches!(b, b':' | b'.' | b'_' | b'-'))
        };
        let old_reference = |text: &str| {
            !text.is_empty()
                && text.len() <= REFERENCE_LEN_MAX
                && text.bytes().all(|b| b.is_ascii_graphic())
        };
        let mut samples: Vec<String> = vec![
            String::new(),
            "acct-17".into(),
            "acct 17/../x!".into(),
            "ben 1 with spaces".into(),
            "a\n".into(),
            "\na".into(),
            "é".into(),
            "a".repeat(ACCOUNT_ID_LEN_MAX),
            "a".repeat(ACCOUNT_ID_LEN_MAX + 1),
            "b".repeat(REFERENCE_LEN_MAX),
            "b".repeat(REFERENCE_LEN_MAX + 1),
        ];
        let chars: Vec<char> = (0u8..=0x7f)
            .map(char::from)
            .chain(['é', '\u{a0}'])
            .collect();
        for a in &chars {
            samples.push(a.to_string());
            for b in &chars {
                samples.push(format!("{a}{b}"));
            }
        }
        for sample in &samples {
            assert_eq!(
                account_id_is_valid(sample),
                old_account(sample),
                "{sample:?}"
            );
            assert_eq!(
                reference_is_valid(sample),
                old_reference(sample),
                "{sample:?}"
            );
        }
        assert!(account_id_is_valid("acct-17") && reference_is_valid("ben-1"));
    }

    #[test]
    fn currencies_are_sorted_unique_iso_shapes() {
        assert!(CURRENCIES.windows(2).all(|w| w[0] < w[1]));
        assert!(
            CURRENCIES
                .iter()
                .all(|c| c.len() == 3 && c.bytes().all(|b| b.is_ascii_uppercase()))
        );
        assert!(
            currency_is_valid("EUR") && !currency_is_valid("EURO") && !currency_is_valid("eur")
        );
    }
}
