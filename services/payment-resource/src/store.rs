//! paydb through sqlx (runtime queries). Every money-moving write is one call of a function of
//! `migrations/paydb`, inside the transaction that also holds the request's idempotency record,
//! so the effect and the stored answer commit together or not at all.

use chrono::{DateTime, Utc};
use dlock_contract::payment::{
    Account, AccountKind, Direction, LedgerEntry, Payout, PayoutState, PayoutSummary,
    SubmissionSummary,
};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{FromRow, PgConnection, PgPool, Postgres, Transaction};
use uuid::Uuid;

use crate::config::PgSettings;

pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("../../migrations/paydb");

/// The most expired idempotency records one sweep statement deletes.
pub const SWEEP_BATCH_MAX: i32 = 1_000;

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum StoreError {
    /// paydb cannot take writes here: unreachable, a standby, shutting down. Nothing changed.
    #[error("paydb is not available for writes: {0}")]
    NotLeader(String),
    /// An identical request holds the idempotency record and did not finish within the wait.
    #[error("an identical request is still in progress")]
    InProgress,
    #[error("paydb failure: {0}")]
    Backend(String),
}

pub type StoreResult<T> = Result<T, StoreError>;

/// Maps a database failure to what the caller may conclude from it (D-4).
pub fn map_sqlx(error: sqlx::Error) -> StoreError {
    match &error {
        sqlx::Error::PoolTimedOut | sqlx::Error::PoolClosed | sqlx::Error::Io(_) => {
            StoreError::NotLeader(format!("paydb is unreachable: {error}"))
        }
        sqlx::Error::Database(db) => match db.code().as_deref() {
            // lock_not_available: the bounded wait on an in-progress idempotency record.
            Some("55P03") => StoreError::InProgress,
            Some("25006") => StoreError::NotLeader("paydb is a read-only replica".into()),
            Some("57P01") | Some("57P02") | Some("57P03") => {
                StoreError::NotLeader(format!("paydb is not accepting writes: {error}"))
            }
            _ => StoreError::Backend(error.to_string()),
        },
        _ => StoreError::Backend(error.to_string()),
    }
}

fn missing(what: &str) -> StoreError {
    StoreError::Backend(format!("paydb returned no {what}"))
}

pub type Tx = Transaction<'static, Postgres>;

/// The scope and contents of one idempotent write (D-7).
#[derive(Debug, Clone)]
pub struct Scope {
    /// Method and concrete path.
    pub route: String,
    pub key: String,
    /// 0 for writes that carry no token.
    pub token: i64,
    pub owner_id: String,
    pub payload_hash: [u8; 32],
    pub retention_ms: i64,
}

impl Scope {
    /// Binds `pay_idempotency_begin`'s seven parameters ($1–$7, the scope and `wait_ms`), which
    /// every call that begins a protected write takes first.
    fn bind_begin<'q, O>(
        &'q self,
        query: sqlx::query::QueryAs<'q, Postgres, O, sqlx::postgres::PgArguments>,
        wait_ms: i32,
    ) -> sqlx::query::QueryAs<'q, Postgres, O, sqlx::postgres::PgArguments> {
        query
            .bind(&self.route)
            .bind(&self.key)
            .bind(self.token)
            .bind(&self.owner_id)
            .bind(&self.payload_hash[..])
            .bind(self.retention_ms)
            .bind(wait_ms)
    }
}

/// What the idempotency record says about a request.
pub enum Begin {
    /// No record: this request runs the effect in `Tx` and then calls [`PayStore::finish`].
    Fresh(Tx),
    /// The stored answer of the identical request, byte for byte.
    Replay { status: u16, body: Vec<u8> },
    /// Same key and token, different body.
    Conflict,
}

#[derive(Debug, FromRow)]
struct BeginRow {
    outcome: String,
    response_status: Option<i16>,
    response_body: Option<Vec<u8>>,
}

/// What a `*_once` call found: a fresh request with its effect's row (in the open
/// transaction, to be finished), or the idempotency record's verdict.
pub enum Once<T> {
    Fresh(Tx, T),
    Replay { status: u16, body: Vec<u8> },
    Conflict,
}

impl<T> Once<T> {
    fn from_begin(
        begun: BeginRow,
        tx: Tx,
        effect: impl FnOnce() -> StoreResult<T>,
    ) -> StoreResult<Self> {
        match begun.outcome.as_str() {
            "fresh" => Ok(Once::Fresh(tx, effect()?)),
            "conflict" => Ok(Once::Conflict),
            "replay" => Ok(Once::Replay {
                status: begun
                    .response_status
                    .ok_or_else(|| missing("response status"))? as u16,
                body: begun
                    .response_body
                    .ok_or_else(|| missing("response body"))?,
            }),
            other => Err(StoreError::Backend(format!("unexpected outcome {other}"))),
        }
    }
}

#[derive(Debug, FromRow)]
struct ClaimOnceRow {
    begin_outcome: String,
    response_status: Option<i16>,
    response_body: Option<Vec<u8>>,
    outcome: Option<String>,
    state: Option<String>,
    fence: Option<i64>,
    attempt_count: Option<i32>,
    claim_token: Option<i64>,
    account_id: Option<String>,
    available_minor: Option<i64>,
    amount_minor: Option<i64>,
}

#[derive(Debug, FromRow)]
struct PostOnceRow {
    begin_outcome: String,
    response_status: Option<i16>,
    response_body: Option<Vec<u8>>,
    outcome: Option<String>,
    state: Option<String>,
    fence: Option<i64>,
    account_id: Option<String>,
    balance_minor: Option<i64>,
    entries: Option<String>,
}

/// One entry of `pay_post_once`'s JSON array.
#[derive(Debug, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
struct EntryJson {
    entry_id: Uuid,
    account_id: String,
    direction: String,
    amount_minor: i64,
    fence: i64,
}

impl EntryJson {
    fn into_entry(self) -> LedgerEntry {
        LedgerEntry {
            entry_id: self.entry_id,
            account_id: self.account_id,
            direction: if self.direction == "DEBIT" {
                Direction::Debit
            } else {
                Direction::Credit
            },
            amount_minor: self.amount_minor,
            fence: self.fence,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CreateOutcome {
    Created,
    Exists,
    Conflict,
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

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CreatePayoutOutcome {
    Created,
    Exists,
    Conflict,
    AccountUnknown,
    CurrencyMismatch,
}

/// The row `pay_claim` returns.
#[derive(Debug, Clone, FromRow)]
pub struct ClaimRow {
    pub outcome: String,
    pub state: Option<String>,
    pub fence: Option<i64>,
    pub attempt_count: Option<i32>,
    pub claim_token: Option<i64>,
    pub account_id: Option<String>,
    pub available_minor: Option<i64>,
    pub amount_minor: Option<i64>,
}

/// The row `pay_post` returns.
#[derive(Debug, Clone, FromRow)]
pub struct PostRow {
    pub outcome: String,
    pub state: Option<String>,
    pub fence: Option<i64>,
    pub account_id: Option<String>,
    pub balance_minor: Option<i64>,
}

#[derive(Debug, Clone, FromRow)]
pub struct LowerRow {
    pub outcome: String,
    pub previous_fence: Option<i64>,
    pub fence: Option<i64>,
    pub recovery_id: Option<i64>,
}

/// Who lowers a fence and why, for the audit row.
#[derive(Debug, Clone, Copy)]
pub struct LowerAudit<'a> {
    pub operator: &'a str,
    pub identity: &'a str,
    pub owner_id: &'a str,
    pub reason: &'a str,
}

/// Who cancels a payout and why, for `payout_abandonments`.
#[derive(Debug, Clone, Copy)]
pub struct CancelAudit<'a> {
    pub operator: &'a str,
    pub identity: &'a str,
    pub owner_id: &'a str,
    pub reason: &'a str,
}

/// The row `pay_abandon` returns.
#[derive(Debug, Clone, FromRow)]
pub struct AbandonRow {
    pub outcome: String,
    pub state: Option<String>,
    pub fence: Option<i64>,
    pub attempt_count: Option<i32>,
    pub account_id: Option<String>,
}

#[derive(Debug, Clone, FromRow)]
pub struct FenceRow {
    pub outcome: String,
    pub previous_fence: Option<i64>,
    pub fence: Option<i64>,
}

#[derive(Debug, Clone, FromRow)]
pub struct ResolveRow {
    pub outcome: String,
    pub state: Option<String>,
    pub account_id: Option<String>,
    pub balance_minor: Option<i64>,
}

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

#[derive(Debug, FromRow)]
struct SubmissionRow {
    submission_id: Uuid,
    presented_token: i64,
    outcome: String,
    rail_reference: Option<String>,
    submitted_at: DateTime<Utc>,
    resolved_at: Option<DateTime<Utc>>,
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

// The balance is the row's plus, for a settlement account, its shards' (paydb 0007).
const ACCOUNT_SELECT: &str = "SELECT a.account_id, a.currency::text AS currency, a.kind, \
    (a.balance_minor + coalesce((SELECT sum(s.balance_minor) FROM account_balance_shards s \
                                 WHERE s.account_id = a.account_id), 0))::bigint \
        AS balance_minor, a.held_minor, a.fence, a.updated_at, \
    coalesce((SELECT sum(CASE WHEN e.direction = 'CREDIT' THEN e.amount_minor \
                              ELSE -e.amount_minor END) \
                FROM ledger_entries e WHERE e.account_id = a.account_id), 0)::bigint \
        AS ledger_sum_minor \
    FROM accounts a WHERE a.account_id = $1";

const PAYOUT_SELECT: &str = "SELECT payout_id, account_id, amount_minor, currency::text AS currency, \
    beneficiary_ref, state, attempt_count, claim_token, rail_reference, submission_id, created_at, \
    updated_at FROM payouts WHERE payout_id = $1";

#[derive(Clone)]
pub struct PayStore {
    pool: PgPool,
}

impl PayStore {
    /// Opens the pool; applies the paydb migrations first when asked, so a new replica never
    /// serves against an old schema.
    pub async fn connect(settings: &PgSettings) -> anyhow::Result<Self> {
        let options: PgConnectOptions = settings
            .url
            .parse()
            .map_err(|e| anyhow::anyhow!("payment.pg.url is not a PostgreSQL URL: {e}"))?;
        let pool = PgPoolOptions::new()
            .max_connections(settings.pool_max)
            .acquire_timeout(settings.acquire_timeout)
            .connect_lazy_with(options.application_name("dlock-payment-resource"));
        if settings.migrate {
            MIGRATOR.run(&pool).await.map_err(|e| {
                anyhow::anyhow!(
                    "applying the paydb migrations failed (is payment.pg.url the paydb primary?): {e}"
                )
            })?;
        }
        Ok(Self { pool })
    }

    pub fn from_pool(pool: PgPool) -> Self {
        Self { pool }
    }

    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// Opens the write's transaction and claims its idempotency record in it. A duplicate of a
    /// request in flight blocks here until that request commits (then replays its answer) or
    /// rolls back (then runs itself), for at most `wait_ms`.
    pub async fn begin(&self, scope: &Scope, wait_ms: i32) -> StoreResult<Begin> {
        let mut tx = self.pool.begin().await.map_err(map_sqlx)?;
        let row: BeginRow = scope
            .bind_begin(
                sqlx::query_as(
                    "SELECT outcome, response_status, response_body \
             FROM pay_idempotency_begin($1, $2, $3, $4, $5, $6, $7)",
                ),
                wait_ms,
            )
            .fetch_one(&mut *tx)
            .await
            .map_err(map_sqlx)?;
        match row.outcome.as_str() {
            "fresh" => Ok(Begin::Fresh(tx)),
            "conflict" => Ok(Begin::Conflict),
            "replay" => {
                let status = row
                    .response_status
                    .ok_or_else(|| missing("response status"))?;
                let body = row.response_body.ok_or_else(|| missing("response body"))?;
                Ok(Begin::Replay {
                    status: status as u16,
                    body,
                })
            }
            other => Err(StoreError::Backend(format!("unexpected outcome {other}"))),
        }
    }

    /// Opens a write's transaction for a `*_once` call, which claims the idempotency record and
    /// runs the effect in one round trip.
    pub async fn begin_tx(&self) -> StoreResult<Tx> {
        self.pool.begin().await.map_err(map_sqlx)
    }

    /// P2 in one call (`pay_claim_once`): the idempotency record and, when fresh, the claim.
    #[allow(clippy::too_many_arguments)]
    pub async fn claim_once(
        mut tx: Tx,
        scope: &Scope,
        wait_ms: i32,
        payout_id: Uuid,
        expected_state: PayoutState,
        max_attempts: i32,
    ) -> StoreResult<Once<ClaimRow>> {
        let row: ClaimOnceRow = scope
            .bind_begin(
                sqlx::query_as(
                    "SELECT begin_outcome, response_status, response_body, outcome, state, fence, \
                    attempt_count, claim_token, account_id, available_minor, amount_minor \
             FROM pay_claim_once($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)",
                ),
                wait_ms,
            )
            .bind(payout_id)
            .bind(expected_state.as_str())
            .bind(max_attempts)
            .fetch_one(&mut *tx)
            .await
            .map_err(map_sqlx)?;
        let begun = BeginRow {
            outcome: row.begin_outcome,
            response_status: row.response_status,
            response_body: row.response_body,
        };
        Once::from_begin(begun, tx, || {
            Ok(ClaimRow {
                outcome: row.outcome.ok_or_else(|| missing("claim outcome"))?,
                state: row.state,
                fence: row.fence,
                attempt_count: row.attempt_count,
                claim_token: row.claim_token,
                account_id: row.account_id,
                available_minor: row.available_minor,
                amount_minor: row.amount_minor,
            })
        })
    }

    /// P3 in one call (`pay_post_once`): the idempotency record and, when fresh, the post with
    /// its two entries (DEBIT first).
    pub async fn post_once(
        mut tx: Tx,
        scope: &Scope,
        wait_ms: i32,
        payout_id: Uuid,
        rail_reference: &str,
        submission_id: Uuid,
    ) -> StoreResult<Once<(PostRow, Vec<LedgerEntry>)>> {
        let row: PostOnceRow = scope
            .bind_begin(
                sqlx::query_as(
                    "SELECT begin_outcome, response_status, response_body, outcome, state, fence, \
                    account_id, balance_minor, entries \
             FROM pay_post_once($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)",
                ),
                wait_ms,
            )
            .bind(payout_id)
            .bind(rail_reference)
            .bind(submission_id)
            .fetch_one(&mut *tx)
            .await
            .map_err(map_sqlx)?;
        let begun = BeginRow {
            outcome: row.begin_outcome,
            response_status: row.response_status,
            response_body: row.response_body,
        };
        Once::from_begin(begun, tx, || {
            let entries: Vec<EntryJson> = match row.entries.as_deref() {
                Some(text) => serde_json::from_str(text)
                    .map_err(|e| StoreError::Backend(format!("posting entries: {e}")))?,
                None => Vec::new(),
            };
            Ok((
                PostRow {
                    outcome: row.outcome.ok_or_else(|| missing("post outcome"))?,
                    state: row.state,
                    fence: row.fence,
                    account_id: row.account_id,
                    balance_minor: row.balance_minor,
                },
                entries.into_iter().map(EntryJson::into_entry).collect(),
            ))
        })
    }

    /// Stores the answer with the effect and commits both.
    pub async fn finish(
        &self,
        mut tx: Tx,
        scope: &Scope,
        status: u16,
        body: &[u8],
    ) -> StoreResult<()> {
        let outcome = if status < 300 { "succeeded" } else { "failed" };
        sqlx::query(
            "UPDATE idempotency_records SET status = $4, response_status = $5, response_body = $6 \
             WHERE route = $1 AND idempotency_key = $2 AND fencing_token = $3 \
               AND status = 'in_progress'",
        )
        .bind(&scope.route)
        .bind(&scope.key)
        .bind(scope.token)
        .bind(outcome)
        .bind(status as i16)
        .bind(body)
        .execute(&mut *tx)
        .await
        .map_err(map_sqlx)?;
        tx.commit().await.map_err(map_sqlx)
    }

    pub async fn create_account(
        conn: &mut PgConnection,
        account_id: &str,
        currency: &str,
    ) -> StoreResult<CreateAccountOutcome> {
        let (outcome, existing): (String, String) = sqlx::query_as(
            "SELECT outcome, currency::text FROM pay_create_account($1, $2::char(3))",
        )
        .bind(account_id)
        .bind(currency)
        .fetch_one(conn)
        .await
        .map_err(map_sqlx)?;
        Ok(match outcome.as_str() {
            "created" => CreateAccountOutcome::Created,
            "exists" => CreateAccountOutcome::Exists,
            _ => CreateAccountOutcome::Conflict { currency: existing },
        })
    }

    pub async fn fund(
        conn: &mut PgConnection,
        account_id: &str,
        amount_minor: i64,
        reference: &str,
    ) -> StoreResult<FundOutcome> {
        let (outcome, balance): (String, Option<i64>) =
            sqlx::query_as("SELECT outcome, balance_minor FROM pay_fund($1, $2, $3)")
                .bind(account_id)
                .bind(amount_minor)
                .bind(reference)
                .fetch_one(conn)
                .await
                .map_err(map_sqlx)?;
        let balance = || balance.ok_or_else(|| missing("balance"));
        Ok(match outcome.as_str() {
            "funded" => FundOutcome::Funded {
                balance_minor: balance()?,
            },
            "exists" => FundOutcome::Exists {
                balance_minor: balance()?,
            },
            "conflict" => FundOutcome::Conflict,
            "not_customer" => FundOutcome::NotCustomer,
            _ => FundOutcome::NotFound,
        })
    }

    pub async fn create_payout(
        conn: &mut PgConnection,
        payout_id: Uuid,
        account_id: &str,
        amount_minor: i64,
        currency: &str,
        beneficiary_ref: &str,
    ) -> StoreResult<CreatePayoutOutcome> {
        let (outcome,): (String,) =
            sqlx::query_as("SELECT outcome FROM pay_create_payout($1, $2, $3, $4::char(3), $5)")
                .bind(payout_id)
                .bind(account_id)
                .bind(amount_minor)
                .bind(currency)
                .bind(beneficiary_ref)
                .fetch_one(conn)
                .await
                .map_err(map_sqlx)?;
        Ok(match outcome.as_str() {
            "created" => CreatePayoutOutcome::Created,
            "exists" => CreatePayoutOutcome::Exists,
            "conflict" => CreatePayoutOutcome::Conflict,
            "currency_mismatch" => CreatePayoutOutcome::CurrencyMismatch,
            _ => CreatePayoutOutcome::AccountUnknown,
        })
    }

    /// P2: `fence < token` then `fence = token`, the state check and the funds check, in one
    /// function under the payout's and the account's row locks. A payout already claimed
    /// `max_attempts` times is abandoned instead (outcome `abandoned`), by the same function.
    pub async fn claim(
        conn: &mut PgConnection,
        payout_id: Uuid,
        token: i64,
        expected_state: PayoutState,
        max_attempts: i32,
        owner_id: &str,
    ) -> StoreResult<ClaimRow> {
        sqlx::query_as(
            "SELECT outcome, state, fence, attempt_count, claim_token, account_id, \
                    available_minor, amount_minor FROM pay_claim_bounded($1, $2, $3, $4, $5)",
        )
        .bind(payout_id)
        .bind(token)
        .bind(expected_state.as_str())
        .bind(max_attempts)
        .bind(owner_id)
        .fetch_one(conn)
        .await
        .map_err(map_sqlx)
    }

    /// Cancels a PENDING or CLAIMED payout: ABANDONED under a fenced token (`fence < token`,
    /// the fence advances), recorded in `payout_abandonments`. The database refuses it once an
    /// attempt reached the rail proxy.
    pub async fn abandon(
        conn: &mut PgConnection,
        payout_id: Uuid,
        token: i64,
        expected_state: PayoutState,
        audit: &CancelAudit<'_>,
    ) -> StoreResult<AbandonRow> {
        sqlx::query_as(
            "SELECT outcome, state, fence, attempt_count, account_id \
             FROM pay_abandon($1, $2, $3, 'cancelled', $4, $5, $6, $7)",
        )
        .bind(payout_id)
        .bind(token)
        .bind(expected_state.as_str())
        .bind(audit.owner_id)
        .bind(audit.identity)
        .bind(audit.operator)
        .bind(audit.reason)
        .fetch_one(conn)
        .await
        .map_err(map_sqlx)
    }

    /// P3: `fence <= token`, RAIL_ACKED -> POSTED and the two ledger rows, in one function.
    pub async fn post(
        conn: &mut PgConnection,
        payout_id: Uuid,
        token: i64,
        rail_reference: &str,
        submission_id: Uuid,
    ) -> StoreResult<PostRow> {
        sqlx::query_as(
            "SELECT outcome, state, fence, account_id, balance_minor FROM pay_post($1, $2, $3, $4)",
        )
        .bind(payout_id)
        .bind(token)
        .bind(rail_reference)
        .bind(submission_id)
        .fetch_one(conn)
        .await
        .map_err(map_sqlx)
    }

    #[allow(clippy::too_many_arguments)]
    pub async fn advance_fence(
        conn: &mut PgConnection,
        account_id: &str,
        floor: i64,
        operator: &str,
        reason: &str,
        revocation_id: Uuid,
        owner_id: &str,
        identity: &str,
    ) -> StoreResult<FenceRow> {
        sqlx::query_as(
            "SELECT outcome, previous_fence, fence \
             FROM pay_advance_fence($1, $2, $3, $4, $5, $6, $7)",
        )
        .bind(account_id)
        .bind(floor)
        .bind(operator)
        .bind(reason)
        .bind(revocation_id)
        .bind(owner_id)
        .bind(identity)
        .fetch_one(conn)
        .await
        .map_err(map_sqlx)
    }

    #[allow(clippy::too_many_arguments)]
    pub async fn resolve(
        conn: &mut PgConnection,
        payout_id: Uuid,
        outcome: PayoutState,
        rail_reference: Option<&str>,
        operator: &str,
        evidence: &str,
        owner_id: &str,
        identity: &str,
    ) -> StoreResult<ResolveRow> {
        sqlx::query_as(
            "SELECT outcome, state, account_id, balance_minor \
             FROM pay_resolve($1, $2, $3, $4, $5, $6, $7)",
        )
        .bind(payout_id)
        .bind(outcome.as_str())
        .bind(rail_reference)
        .bind(operator)
        .bind(evidence)
        .bind(owner_id)
        .bind(identity)
        .fetch_one(conn)
        .await
        .map_err(map_sqlx)
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
            .map(|r| LedgerEntry {
                entry_id: r.entry_id,
                account_id: r.account_id,
                direction: if r.direction == "DEBIT" {
                    Direction::Debit
                } else {
                    Direction::Credit
                },
                amount_minor: r.amount_minor,
                fence: r.fence,
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
        let row: Option<PayoutRow> = sqlx::query_as(PAYOUT_SELECT)
            .bind(payout_id)
            .fetch_optional(&mut *conn)
            .await
            .map_err(map_sqlx)?;
        let Some(r) = row else {
            return Ok(None);
        };
        let submissions: Vec<SubmissionRow> = sqlx::query_as(
            "SELECT submission_id, presented_token, outcome, rail_reference, submitted_at, \
                    resolved_at FROM rail_submission WHERE payout_id = $1 \
             ORDER BY submitted_at, submission_id",
        )
        .bind(payout_id)
        .fetch_all(&mut *conn)
        .await
        .map_err(map_sqlx)?;
        Ok(Some(Payout {
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
            submissions: submissions
                .into_iter()
                .map(|s| SubmissionSummary {
                    submission_id: s.submission_id,
                    presented_token: s.presented_token,
                    outcome: s.outcome,
                    rail_reference: s.rail_reference,
                    submitted_at: s.submitted_at,
                    resolved_at: s.resolved_at,
                })
                .collect(),
        }))
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
    /// proven against is `payout:{accountId}`.
    pub async fn payout_account(&self, payout_id: Uuid) -> StoreResult<Option<String>> {
        sqlx::query_scalar("SELECT account_id FROM payouts WHERE payout_id = $1")
            .bind(payout_id)
            .fetch_optional(&self.pool)
            .await
            .map_err(map_sqlx)
    }

    /// D-8 recovery: lowers a poisoned account fence to `to`, recorded in `fence_recoveries`.
    pub async fn lower_fence(
        conn: &mut PgConnection,
        account_id: &str,
        to: i64,
        audit: &LowerAudit<'_>,
    ) -> StoreResult<LowerRow> {
        sqlx::query_as(
            "SELECT outcome, previous_fence, fence, recovery_id \
             FROM pay_lower_fence($1, $2, $3, $4, $5, $6)",
        )
        .bind(account_id)
        .bind(to)
        .bind(audit.operator)
        .bind(audit.identity)
        .bind(audit.owner_id)
        .bind(audit.reason)
        .fetch_one(conn)
        .await
        .map_err(map_sqlx)
    }

    pub async fn read_payout(&self, payout_id: Uuid) -> StoreResult<Option<Payout>> {
        let mut conn = self.pool.acquire().await.map_err(map_sqlx)?;
        Self::payout(&mut conn, payout_id).await
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

    /// Deletes expired idempotency records until none is left; returns how many went.
    pub async fn sweep(&self) -> StoreResult<u64> {
        let mut removed = 0u64;
        // Bounded: a backlog larger than this many batches is left for the next tick.
        for _ in 0..100 {
            let (n,): (i64,) = sqlx::query_as("SELECT pay_idempotency_sweep($1)")
                .bind(SWEEP_BATCH_MAX)
                .fetch_one(&self.pool)
                .await
                .map_err(map_sqlx)?;
            removed += n.max(0) as u64;
            if n < i64::from(SWEEP_BATCH_MAX) {
                break;
            }
        }
        Ok(removed)
    }
}
