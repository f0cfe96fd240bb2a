//! The treasury's writes beyond opening: a funding, applied or waiting for a second treasury
//! identity (migrations/paydb/0039_baseline_payment_writes.sql), and an account's limits. Each is
//! one call of a paydb function in the request's transaction, read once into an outcome enum.

use sqlx::PgConnection;
use uuid::Uuid;

use super::{FundOutcome, PayStore, StoreError, StoreResult, map_sqlx, unknown};

/// What `pay_set_limits` answered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LimitsOutcome {
    Set {
        max_payout_minor: Option<i64>,
        daily_outflow_minor: Option<i64>,
        set_by: String,
    },
    NotFound,
    NotCustomer,
}

/// A funding that waits for (or got) a second treasury identity's approval, as `pay_fund_as`
/// answered it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PendingRow {
    pub funding_id: Uuid,
    pub requested_by: String,
    pub approved_by: Option<String>,
    /// What the requester funded on the account alone in the 24 hours before, when this
    /// funding was recorded now; `None` when it was found recorded before.
    pub window_minor: Option<i64>,
}

/// What `pay_fund_as` answered: a treasury identity's funding applied (or refused) as `pay_fund`
/// answers, or recorded for a second approval because it, with what the same identity funded
/// on the account alone in the last 24 hours, passes `auth.treasury.dual-approval-above`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FundAsOutcome {
    Fund(FundOutcome),
    Pending(PendingRow),
}

/// A pending funding as `pay_approve_funding` read it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FundingRow {
    pub account_id: String,
    pub amount_minor: i64,
    pub reference: String,
    pub requested_by: String,
}

/// What `pay_approve_funding` answered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ApproveOutcome {
    Approved {
        funding: FundingRow,
        approved_by: String,
        balance_minor: i64,
    },
    NotFound,
    /// The approver is the identity that asked for the funding.
    SameIdentity {
        funding: FundingRow,
    },
    AlreadyApproved {
        funding: FundingRow,
        approved_by: String,
    },
}

type ApproveRow = (
    String,
    Option<String>,
    Option<i64>,
    Option<String>,
    Option<String>,
    Option<String>,
    Option<i64>,
);

fn missing(what: &str) -> StoreError {
    StoreError::Backend(format!("paydb returned no {what}"))
}

impl PayStore {
    pub async fn set_limits(
        conn: &mut PgConnection,
        account_id: &str,
        max_payout_minor: Option<i64>,
        daily_outflow_minor: Option<i64>,
        identity: &str,
    ) -> StoreResult<LimitsOutcome> {
        let (outcome, max, daily, set_by): (String, Option<i64>, Option<i64>, Option<String>) =
            sqlx::query_as(
                "SELECT outcome, max_payout_minor, daily_outflow_minor, set_by \
                 FROM pay_set_limits($1, $2, $3, $4)",
            )
            .bind(account_id)
            .bind(max_payout_minor)
            .bind(daily_outflow_minor)
            .bind(identity)
            .fetch_one(conn)
            .await
            .map_err(map_sqlx)?;
        Ok(match outcome.as_str() {
            "set" => LimitsOutcome::Set {
                max_payout_minor: max,
                daily_outflow_minor: daily,
                set_by: set_by.ok_or_else(|| missing("set_by"))?,
            },
            "not_found" => LimitsOutcome::NotFound,
            "not_customer" => LimitsOutcome::NotCustomer,
            other => return Err(unknown("pay_set_limits", other)),
        })
    }

    /// A treasury identity's funding (migrations/paydb/0039_baseline_payment_writes.sql):
    /// paydb decides under the account row lock whether it applies now or waits for a second
    /// treasury identity. `threshold`: `auth.treasury.dual-approval-above` (`None`: it applies).
    pub async fn fund_as(
        conn: &mut PgConnection,
        account_id: &str,
        amount_minor: i64,
        reference: &str,
        identity: &str,
        threshold: Option<i64>,
    ) -> StoreResult<FundAsOutcome> {
        type FundAsRow = (
            String,
            Option<i64>,
            Option<Uuid>,
            Option<String>,
            Option<String>,
            Option<i64>,
        );
        let (outcome, balance, funding_id, requested_by, approved_by, window_minor): FundAsRow =
            sqlx::query_as(
                "SELECT outcome, balance_minor, funding_id, requested_by, approved_by, \
                        window_minor FROM pay_fund_as($1, $2, $3, $4, $5, $6)",
            )
            .bind(Uuid::new_v4())
            .bind(account_id)
            .bind(amount_minor)
            .bind(reference)
            .bind(identity)
            .bind(threshold)
            .fetch_one(conn)
            .await
            .map_err(map_sqlx)?;
        if outcome != "pending" {
            return FundOutcome::parse(&outcome, balance).map(FundAsOutcome::Fund);
        }
        Ok(FundAsOutcome::Pending(PendingRow {
            funding_id: funding_id.ok_or_else(|| missing("funding_id"))?,
            requested_by: requested_by.ok_or_else(|| missing("requested_by"))?,
            approved_by,
            window_minor,
        }))
    }

    pub async fn approve_funding(
        conn: &mut PgConnection,
        funding_id: Uuid,
        identity: &str,
    ) -> StoreResult<ApproveOutcome> {
        let (outcome, account_id, amount, reference, requested_by, approved_by, balance): ApproveRow =
            sqlx::query_as(
                "SELECT outcome, account_id, amount_minor, reference, requested_by, approved_by, \
                        balance_minor FROM pay_approve_funding($1, $2)",
            )
            .bind(funding_id)
            .bind(identity)
            .fetch_one(conn)
            .await
            .map_err(map_sqlx)?;
        if outcome == "not_found" {
            return Ok(ApproveOutcome::NotFound);
        }
        let funding = FundingRow {
            account_id: account_id.ok_or_else(|| missing("account_id"))?,
            amount_minor: amount.ok_or_else(|| missing("amount_minor"))?,
            reference: reference.ok_or_else(|| missing("reference"))?,
            requested_by: requested_by.ok_or_else(|| missing("requested_by"))?,
        };
        Ok(match outcome.as_str() {
            "approved" => ApproveOutcome::Approved {
                funding,
                approved_by: approved_by.ok_or_else(|| missing("approved_by"))?,
                balance_minor: balance.ok_or_else(|| missing("balance_minor"))?,
            },
            "same_identity" => ApproveOutcome::SameIdentity { funding },
            "already_approved" => ApproveOutcome::AlreadyApproved {
                funding,
                approved_by: approved_by.ok_or_else(|| missing("approved_by"))?,
            },
            other => return Err(unknown("pay_approve_funding", other)),
        })
    }
}
