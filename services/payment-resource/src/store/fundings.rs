//! The fundings that waited (or wait) for a second treasury identity, as `GET /v1/fundings`
//! lists them (docs/contract.md#list-fundings): a plain read of `pending_fundings`
//! (migrations/paydb/0037_baseline_tables.sql) with each account's currency. It writes nothing.

use chrono::{DateTime, Utc};
use dlock_contract::payment::{FundingSummary, FundingsFilter};
use sqlx::FromRow;
use uuid::Uuid;

use super::{PayStore, StoreResult, map_sqlx};

/// `PENDING_APPROVAL`: recorded, not applied.
const PENDING_APPROVAL: &str = "PENDING_APPROVAL";
/// `APPROVED`: a second treasury identity approved it, and it was applied.
const APPROVED: &str = "APPROVED";

#[derive(Debug, FromRow)]
struct FundingListRow {
    funding_id: Uuid,
    account_id: String,
    amount_minor: i64,
    currency: String,
    reference: String,
    requested_by: String,
    requested_at: DateTime<Utc>,
    approved_by: Option<String>,
    approved_at: Option<DateTime<Utc>>,
}

impl PayStore {
    /// The fundings `filter` selects, newest request first: up to `limit + 1` rows, the extra
    /// one only telling that there are more.
    pub async fn list_fundings(
        &self,
        filter: FundingsFilter,
        limit: i64,
    ) -> StoreResult<Vec<FundingSummary>> {
        let approved: Option<bool> = match filter {
            FundingsFilter::Pending => Some(false),
            FundingsFilter::Applied => Some(true),
            FundingsFilter::All => None,
        };
        let rows: Vec<FundingListRow> = sqlx::query_as(
            "SELECT f.funding_id, f.account_id, f.amount_minor, a.currency::text AS currency, \
                    f.reference, f.requested_by, f.requested_at, f.approved_by, f.approved_at \
             FROM pending_fundings f JOIN accounts a ON a.account_id = f.account_id \
             WHERE ($1::boolean IS NULL OR (f.approved_by IS NOT NULL) = $1) \
             ORDER BY f.requested_at DESC, f.funding_id DESC LIMIT $2",
        )
        .bind(approved)
        .bind(limit + 1)
        .fetch_all(self.pool())
        .await
        .map_err(map_sqlx)?;
        Ok(rows
            .into_iter()
            .map(|r| FundingSummary {
                funding_id: r.funding_id,
                account_id: r.account_id,
                amount_minor: r.amount_minor,
                currency: r.currency,
                reference: r.reference,
                requested_by: r.requested_by,
                requested_at: r.requested_at,
                status: if r.approved_by.is_some() {
                    APPROVED
                } else {
                    PENDING_APPROVAL
                }
                .to_owned(),
                approved_by: r.approved_by,
                approved_at: r.approved_at,
            })
            .collect())
    }
}
