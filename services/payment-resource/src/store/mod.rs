//! paydb through sqlx (runtime queries). Every money-moving write is one call of a function of
//! `migrations/paydb`, inside the transaction that also holds the request's idempotency record,
//! so the effect and the stored answer commit together or not at all.

mod batch;
mod fundings;
mod idempotency;
mod outcome;
mod treasury;
mod writes;

use std::num::NonZeroUsize;
use std::sync::{Arc, Mutex};

use chrono::{DateTime, Utc};
use dlock_contract::payment::{
    Account, AccountKind, LedgerEntry, Payout, PayoutState, PayoutSummary, SubmissionSummary,
};
use dlock_server::pg::PgSettings;
use lru::LruCache;
use sqlx::{FromRow, PgConnection, PgPool, Postgres, Transaction};
use uuid::Uuid;

pub use batch::{Answer, ClaimItem, CreateItem, GroupCommit, Item, PostItem, Runner, queue_gauge};
pub use idempotency::{Begin, Once, Scope};
pub use outcome::{
    AbandonOutcome, AdvanceOutcome, ClaimOutcome, Contradiction, ContradictionKind,
    CreateAccountOutcome, CreatePayoutOutcome, FenceMove, FundOutcome, LowerOutcome, PostOutcome,
    Refusal, ResolveOutcome,
};
pub use treasury::{ApproveOutcome, FundAsOutcome, FundingRow, LimitsOutcome, PendingRow};
pub use writes::Audit;

pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("../../migrations/paydb");

/// The most expired idempotency records one sweep statement deletes.
pub const SWEEP_BATCH_MAX: i32 = 1_000;

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum StoreError {
    /// paydb cannot take writes here: unreachable, a standby, shutting down. Nothing changed.
    #[error("paydb is not available for writes: {0}")]
    NotLeader(String),
    /// paydb's epoch guard refused the write (SQLSTATE DL012): it is on a new timeline after a
    /// failover that may have lost writes, and takes none until an operator runs
    /// `dlock recover paydb-epoch` (docs/design.md#d-12). Nothing changed; the text is the
    /// database's reason and hint.
    #[error("paydb refuses writes until dlock recover paydb-epoch: {0}")]
    RecoveryRequired(String),
    /// An identical request holds the idempotency record and did not finish within the wait.
    #[error("an identical request is still in progress")]
    InProgress,
    #[error("paydb failure: {0}")]
    Backend(String),
    /// An account limit refused the write (`account_limits_*`,
    /// migrations/paydb/0038_baseline_guards.sql): the whole transaction rolled back. `details`
    /// is the database's JSON DETAIL.
    #[error("{message}")]
    LimitExceeded {
        message: String,
        details: Option<serde_json::Value>,
    },
}

pub type StoreResult<T> = Result<T, StoreError>;

/// Maps a database failure to what the caller may conclude from it (docs/design.md#d-4).
pub fn map_sqlx(error: sqlx::Error) -> StoreError {
    if let sqlx::Error::Database(db) = &error
        && db.code().as_deref() == Some("55P03")
    {
        // lock_not_available: the bounded wait on an in-progress idempotency record.
        return StoreError::InProgress;
    }
    if let sqlx::Error::Database(db) = &error
        && db.code().as_deref() == Some("23514")
        && db
            .constraint()
            .is_some_and(|name| name.starts_with("account_limits_"))
    {
        let details = db
            .try_downcast_ref::<sqlx::postgres::PgDatabaseError>()
            .and_then(|pg| pg.detail())
            .and_then(|text| serde_json::from_str(text).ok());
        return StoreError::LimitExceeded {
            message: db.message().to_owned(),
            details,
        };
    }
    let epoch_changed = matches!(&error, sqlx::Error::Database(db)
        if db.code().as_deref() == Some(dlock_server::pg::EPOCH_CHANGED));
    match dlock_server::pg::unavailable(&error, "paydb") {
        // Not NOT_LEADER: no other replica and no retry soon will do better; an operator must act.
        Some(why) if epoch_changed => StoreError::RecoveryRequired(why),
        Some(why) => StoreError::NotLeader(why),
        None => StoreError::Backend(error.to_string()),
    }
}

fn missing(what: &str) -> StoreError {
    StoreError::Backend(format!("paydb returned no {what}"))
}

/// An `outcome` text a paydb function answered that this build does not know.
fn unknown(function: &str, outcome: &str) -> StoreError {
    StoreError::Backend(format!(
        "{function} answered the outcome {outcome:?}, which this build does not know"
    ))
}

pub type Tx = Transaction<'static, Postgres>;

#[derive(Debug, FromRow)]
struct AccountRow {
    account_id: String,
    currency: String,
    kind: String,
    balance_minor: i64,
    held_minor: i64,
    fence: i64,
    ledger_sum_minor: i64,
    updated_at: DateTime<Utc>,
}

#[derive(Debug, FromRow)]
struct PayoutRow {
    payout_id: Uuid,
    account_id: String,
    amount_minor: i64,
    currency: String,
    beneficiary_ref: String,
    state: String,
    attempt_count: i32,
    claim_token: Option<i64>,
    rail_reference: Option<String>,
    submission_id: Option<Uuid>,
    created_at: DateTime<Utc>,
    updated_at: DateTime<Utc>,
}

/// One row of [`PAYOUT_SELECT`]: the payout, and one of its attempts at the rail (all `None` for
/// a payout that has none).
#[derive(Debug, FromRow)]
struct PayoutSubmissionRow {
    #[sqlx(flatten)]
    payout: PayoutRow,
    sub_submission_id: Option<Uuid>,
    sub_presented_token: Option<i64>,
    sub_outcome: Option<String>,
    sub_rail_reference: Option<String>,
    sub_submitted_at: Option<DateTime<Utc>>,
    sub_resolved_at: Option<DateTime<Utc>>,
}

impl PayoutSubmissionRow {
    /// The payout, and the attempt when the row has one.
    fn split(self) -> (PayoutRow, Option<SubmissionSummary>) {
        let submission = match (
            self.sub_submission_id,
            self.sub_presented_token,
            self.sub_outcome,
            self.sub_submitted_at,
        ) {
            (Some(submission_id), Some(presented_token), Some(outcome), Some(submitted_at)) => {
                Some(SubmissionSummary {
                    submission_id,
                    presented_token,
                    outcome,
                    rail_reference: self.sub_rail_reference,
                    submitted_at,
                    resolved_at: self.sub_resolved_at,
                })
            }
            _ => None,
        };
        (self.payout, submission)
    }
}

#[derive(Debug, FromRow)]
struct EntryRow {
    entry_id: Uuid,
    account_id: String,
    direction: String,
    amount_minor: i64,
    fence: i64,
}

#[derive(Debug, FromRow)]
struct SummaryRow {
    payout_id: Uuid,
    account_id: String,
    amount_minor: i64,
    currency: String,
    state: String,
    attempt_count: i32,
    created_at: DateTime<Utc>,
}

pub fn parse_state(text: &str) -> StoreResult<PayoutState> {
    PayoutState::parse(text).ok_or_else(|| StoreError::Backend(format!("unknown state {text}")))
}

// The balance is the row's plus, for a settlement account, the sum of its
// `account_balance_shards` rows.
const ACCOUNT_SELECT: &str = "SELECT a.account_id, a.currency::text AS currency, a.kind, \
    (a.balance_minor + coalesce((SELECT sum(s.balance_minor) FROM account_balance_shards s \
                                 WHERE s.account_id = a.account_id), 0))::bigint \
        AS balance_minor, a.held_minor, a.fence, a.updated_at, \
    coalesce((SELECT sum(CASE WHEN e.direction = 'CREDIT' THEN e.amount_minor \
                              ELSE -e.amount_minor END) \
                FROM ledger_entries e WHERE e.account_id = a.account_id), 0)::bigint \
        AS ledger_sum_minor \
    FROM accounts a WHERE a.account_id = $1";

/// P4 of any number of payouts in one statement, so one snapshot: each payout, once per attempt
/// at the rail (once with NULL attempt columns when it has none), attempts in the order they were
/// presented.
const PAYOUT_SELECT: &str = "SELECT p.payout_id, p.account_id, p.amount_minor, \
    p.currency::text AS currency, p.beneficiary_ref, p.state, p.attempt_count, p.claim_token, \
    p.rail_reference, p.submission_id, p.created_at, p.updated_at, \
    s.submission_id AS sub_submission_id, s.presented_token AS sub_presented_token, \
    s.outcome AS sub_outcome, s.rail_reference AS sub_rail_reference, \
    s.submitted_at AS sub_submitted_at, s.resolved_at AS sub_resolved_at \
    FROM payouts p LEFT JOIN rail_submission s ON s.payout_id = p.payout_id \
    WHERE p.payout_id = ANY ($1) ORDER BY p.payout_id, s.submitted_at, s.submission_id";

#[derive(Clone)]
pub struct PayStore {
    pool: PgPool,
    /// The account of each payout seen here (registered, or looked up for a proof): a payout's
    /// account never changes and a payout is never deleted (migrations/paydb/0038_baseline_guards.sql),
    /// so an entry never goes stale. At most [`ACCOUNTS_OF_MAX`], least recently used out first.
    accounts_of: Arc<Mutex<LruCache<Uuid, String>>>,
}

/// How many payouts' accounts [`PayStore`] keeps: about 100 bytes each, so a few megabytes.
const ACCOUNTS_OF_MAX: NonZeroUsize = NonZeroUsize::new(65_536).expect("not zero");

impl PayStore {
    /// Opens the pool; applies the paydb migrations first when asked, so a new replica never
    /// serves against an old schema.
    pub async fn connect(settings: &PgSettings) -> anyhow::Result<Self> {
        let pool = settings
            .connect("dlock-payment-resource", &MIGRATOR, "paydb")
            .await?;
        Ok(Self::from_pool(pool))
    }

    pub fn from_pool(pool: PgPool) -> Self {
        Self {
            pool,
            accounts_of: Arc::new(Mutex::new(LruCache::new(ACCOUNTS_OF_MAX))),
        }
    }

    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// The entries of one posting (`fund:{reference}` or `payout:{id}`), DEBIT first or CREDIT
    /// first as asked.
    pub async fn entries(
        conn: &mut PgConnection,
        posting: &str,
        debit_first: bool,
    ) -> StoreResult<Vec<LedgerEntry>> {
        // 'DEBIT' sorts after 'CREDIT'.
        let sql = if debit_first {
            "SELECT entry_id, account_id, direction, amount_minor, fence FROM ledger_entries \
             WHERE reference = $1 ORDER BY direction DESC"
        } else {
            "SELECT entry_id, account_id, direction, amount_minor, fence FROM ledger_entries \
             WHERE reference = $1 ORDER BY direction ASC"
        };
        let rows: Vec<EntryRow> = sqlx::query_as(sql)
            .bind(posting)
            .fetch_all(conn)
            .await
            .map_err(map_sqlx)?;
        Ok(rows
            .into_iter()
            .map(|r| {
                outcome::entry(
                    r.entry_id,
                    r.account_id,
                    &r.direction,
                    r.amount_minor,
                    r.fence,
                )
            })
            .collect())
    }

    /// P5 (and the answer of account creation), with the ledger sum recomputed.
    pub async fn account(
        conn: &mut PgConnection,
        account_id: &str,
    ) -> StoreResult<Option<Account>> {
        let row: Option<AccountRow> = sqlx::query_as(ACCOUNT_SELECT)
            .bind(account_id)
            .fetch_optional(conn)
            .await
            .map_err(map_sqlx)?;
        Ok(row.map(|r| Account {
            account_id: r.account_id,
            currency: r.currency,
            kind: match r.kind.as_str() {
                "funding" => AccountKind::Funding,
                "settlement" => AccountKind::Settlement,
                _ => AccountKind::Customer,
            },
            balance_minor: r.balance_minor,
            held_minor: r.held_minor,
            available_minor: r.balance_minor - r.held_minor,
            fence: r.fence,
            ledger_sum_minor: r.ledger_sum_minor,
            updated_at: r.updated_at,
        }))
    }

    /// P4 (and the answer of payout creation): the payout and its rail submissions.
    pub async fn payout(conn: &mut PgConnection, payout_id: Uuid) -> StoreResult<Option<Payout>> {
        Ok(Self::payouts(conn, &[payout_id]).await?.into_iter().next())
    }

    /// P4 of each of `ids` that exists, in one statement (one snapshot), ordered by id.
    pub async fn payouts(conn: &mut PgConnection, ids: &[Uuid]) -> StoreResult<Vec<Payout>> {
        let rows: Vec<PayoutSubmissionRow> = sqlx::query_as(PAYOUT_SELECT)
            .bind(ids)
            .fetch_all(&mut *conn)
            .await
            .map_err(map_sqlx)?;
        let mut payouts: Vec<Payout> = Vec::new();
        for row in rows {
            let (r, submission) = row.split();
            if payouts.last().map(|p| p.payout_id) != Some(r.payout_id) {
                payouts.push(Payout {
                    payout_id: r.payout_id,
                    account_id: r.account_id,
                    amount_minor: r.amount_minor,
                    currency: r.currency,
                    beneficiary_ref: r.beneficiary_ref,
                    state: parse_state(&r.state)?,
                    attempt_count: r.attempt_count,
                    claim_token: r.claim_token,
                    rail_reference: r.rail_reference,
                    submission_id: r.submission_id,
                    created_at: r.created_at,
                    updated_at: r.updated_at,
                    submissions: Vec::new(),
                });
            }
            if let (Some(payout), Some(submission)) = (payouts.last_mut(), submission) {
                payout.submissions.push(submission);
            }
        }
        Ok(payouts)
    }

    /// P1: one page in creation order, after the cursor's position. Returns up to `limit + 1`
    /// rows so the caller can tell whether there is a next page.
    pub async fn list_payouts(
        &self,
        state: Option<PayoutState>,
        account_id: Option<&str>,
        limit: i64,
        after: Option<(DateTime<Utc>, Uuid)>,
    ) -> StoreResult<Vec<PayoutSummary>> {
        let rows: Vec<SummaryRow> = sqlx::query_as(
            "SELECT payout_id, account_id, amount_minor, currency::text AS currency, state, \
                    attempt_count, created_at FROM payouts \
             WHERE ($1::text IS NULL OR state = $1) AND ($2::text IS NULL OR account_id = $2) \
               AND ($3::timestamptz IS NULL OR (created_at, payout_id) > ($3, $4)) \
             ORDER BY created_at, payout_id LIMIT $5",
        )
        .bind(state.map(PayoutState::as_str))
        .bind(account_id)
        .bind(after.map(|a| a.0))
        .bind(after.map(|a| a.1))
        .bind(limit + 1)
        .fetch_all(&self.pool)
        .await
        .map_err(map_sqlx)?;
        rows.into_iter()
            .map(|r| {
                Ok(PayoutSummary {
                    payout_id: r.payout_id,
                    account_id: r.account_id,
                    amount_minor: r.amount_minor,
                    currency: r.currency,
                    state: parse_state(&r.state)?,
                    attempt_count: r.attempt_count,
                    created_at: r.created_at,
                })
            })
            .collect()
    }

    pub async fn read_account(&self, account_id: &str) -> StoreResult<Option<Account>> {
        let mut conn = self.pool.acquire().await.map_err(map_sqlx)?;
        Self::account(&mut conn, account_id).await
    }

    /// The account of a payout (immutable once registered): the lock key its writes are
    /// proven against is `payout:{accountId}`. Read from paydb once per payout, then kept; a
    /// payout that does not exist (yet) is not kept.
    pub async fn payout_account(&self, payout_id: Uuid) -> StoreResult<Option<String>> {
        if let Some(account_id) = self.accounts().get(&payout_id) {
            return Ok(Some(account_id.clone()));
        }
        let account_id: Option<String> =
            sqlx::query_scalar("SELECT account_id FROM payouts WHERE payout_id = $1")
                .bind(payout_id)
                .fetch_optional(&self.pool)
                .await
                .map_err(map_sqlx)?;
        if let Some(account_id) = &account_id {
            self.remember_account(payout_id, account_id.clone());
        }
        Ok(account_id)
    }

    /// Keeps `account_id` as the account of `payout_id`, which paydb holds (a registration
    /// of it was answered 201).
    pub fn remember_account(&self, payout_id: Uuid, account_id: String) {
        self.accounts().put(payout_id, account_id);
    }

    /// Forgets what is kept of `payout_id`'s account: it is read again from paydb next time.
    pub fn forget_account(&self, payout_id: Uuid) {
        self.accounts().pop(&payout_id);
    }

    fn accounts(&self) -> std::sync::MutexGuard<'_, LruCache<Uuid, String>> {
        self.accounts_of
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    pub async fn read_payout(&self, payout_id: Uuid) -> StoreResult<Option<Payout>> {
        let mut conn = self.pool.acquire().await.map_err(map_sqlx)?;
        Self::payout(&mut conn, payout_id).await
    }

    /// P4 of each of `ids` that exists, in one statement: the grouped reads of
    /// docs/design.md#group-commit.
    pub async fn read_payouts(&self, ids: &[Uuid]) -> StoreResult<Vec<Payout>> {
        let mut conn = self.pool.acquire().await.map_err(map_sqlx)?;
        Self::payouts(&mut conn, ids).await
    }

    /// Ready when paydb answers and takes writes (a primary, not in recovery).
    pub async fn ready(&self) -> StoreResult<()> {
        let (in_recovery,): (bool,) = sqlx::query_as("SELECT pg_is_in_recovery()")
            .fetch_one(&self.pool)
            .await
            .map_err(map_sqlx)?;
        if in_recovery {
            return Err(StoreError::NotLeader(
                "paydb is in recovery (a standby)".into(),
            ));
        }
        Ok(())
    }
}
