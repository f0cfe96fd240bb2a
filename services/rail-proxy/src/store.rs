//! The rail proxy's paydb calls. Each paydb function answers an `outcome text`; it is read here,
//! once, into one enum per operation with the columns that outcome carries. A text this build
//! does not know is an error that names it, never a guess.

use chrono::{DateTime, Utc};
use dlock_contract::rail::SubmissionRequest;
use dlock_server::group_commit::by_item;
use sqlx::PgPool;
use uuid::Uuid;

/// What a paydb call failed with: the database, or an answer this build cannot read.
#[derive(Debug)]
pub enum StoreError {
    Db(sqlx::Error),
    Unknown {
        function: &'static str,
        outcome: String,
    },
    /// A batch's statement failed as a whole (nothing of it was written), or one item of it
    /// raised and was rolled back alone: what PostgreSQL said, with its SQLSTATE when it gave one.
    Failed {
        state: Option<String>,
        message: String,
    },
}

impl StoreError {
    /// The SQLSTATE PostgreSQL refused the write with, if it did.
    pub fn sqlstate(&self) -> Option<String> {
        match self {
            Self::Db(sqlx::Error::Database(refused)) => refused.code().map(|c| c.into_owned()),
            Self::Failed { state, .. } => state.clone(),
            _ => None,
        }
    }
}

impl From<sqlx::Error> for StoreError {
    fn from(error: sqlx::Error) -> Self {
        Self::Db(error)
    }
}

impl std::fmt::Display for StoreError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Db(error) => error.fmt(f),
            Self::Unknown { function, outcome } => write!(
                f,
                "{function} answered the outcome {outcome:?}, which this build does not know"
            ),
            Self::Failed { state, message } => match state {
                Some(state) => write!(f, "{message} (SQLSTATE {state})"),
                None => f.write_str(message),
            },
        }
    }
}

impl std::error::Error for StoreError {}

fn unknown<T>(function: &'static str, outcome: &str) -> Result<T, StoreError> {
    Err(StoreError::Unknown {
        function,
        outcome: outcome.to_owned(),
    })
}

/// The state of one attempt (`rail_submission.outcome`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Attempt {
    /// The intent is recorded and the forward has not been answered yet.
    Unresolved,
    Acked,
    Rejected,
    Timeout,
    Fenced,
}

impl Attempt {
    pub fn parse(text: &str) -> Result<Self, StoreError> {
        match text {
            "unresolved" => Ok(Self::Unresolved),
            "ACKED" => Ok(Self::Acked),
            "REJECTED" => Ok(Self::Rejected),
            "TIMEOUT" => Ok(Self::Timeout),
            "FENCED" => Ok(Self::Fenced),
            other => unknown("rail_submission", other),
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Unresolved => "unresolved",
            Self::Acked => "ACKED",
            Self::Rejected => "REJECTED",
            Self::Timeout => "TIMEOUT",
            Self::Fenced => "FENCED",
        }
    }
}

/// A stored answer: status and the exact bytes first sent.
pub type StoredAnswer = Option<(i16, Vec<u8>)>;

/// What `rail_admit` decided. Only [`Admission::Admitted`] may be forwarded.
#[derive(Debug)]
pub enum Admission {
    /// The intent row is committed: forward once.
    Admitted,
    /// The identical request was admitted before: its first attempt and any stored answer.
    Replay {
        submission_id: Option<Uuid>,
        attempt: Option<String>,
        answer: StoredAnswer,
    },
    /// The key and token came before with another body.
    Conflict {
        submission_id: Option<Uuid>,
    },
    PayoutUnknown,
    /// The account, amount, currency or beneficiary are not the payout's: the fields that
    /// differ, by their names in the request (`amountMinor`, `beneficiaryRef`, …).
    Mismatch {
        fields: Vec<String>,
    },
    /// The token is below the high-water mark or the account's fence.
    Fenced {
        resource: String,
        highest: i64,
    },
    /// The payout has an attempt already.
    Duplicate {
        submission_id: Option<Uuid>,
        attempt: Option<String>,
        state: Option<String>,
    },
    NotClaimable {
        state: Option<String>,
    },
}

#[derive(Debug, sqlx::FromRow)]
struct AdmitRow {
    outcome: String,
    highest_token: Option<i64>,
    resource_type: Option<String>,
    state: Option<String>,
    submission_id: Option<Uuid>,
    submission_outcome: Option<String>,
    response_status: Option<i16>,
    response_body: Option<Vec<u8>>,
}

impl AdmitRow {
    fn into_admission(self) -> Result<Admission, StoreError> {
        Ok(match self.outcome.as_str() {
            "admitted" => Admission::Admitted,
            "replay" => Admission::Replay {
                submission_id: self.submission_id,
                attempt: self.submission_outcome,
                answer: self.response_status.zip(self.response_body),
            },
            "conflict" => Admission::Conflict {
                submission_id: self.submission_id,
            },
            "payout_unknown" => Admission::PayoutUnknown,
            "mismatch" => Admission::Mismatch {
                fields: self
                    .resource_type
                    .unwrap_or_default()
                    .split(',')
                    .filter(|f| !f.is_empty())
                    .map(str::to_owned)
                    .collect(),
            },
            "fenced" => Admission::Fenced {
                resource: self.resource_type.unwrap_or_else(|| "rail".into()),
                highest: self.highest_token.unwrap_or_default(),
            },
            "duplicate" => Admission::Duplicate {
                submission_id: self.submission_id,
                attempt: self.submission_outcome,
                state: self.state,
            },
            "not_claimable" => Admission::NotClaimable { state: self.state },
            other => return unknown("rail_admit", other),
        })
    }
}

/// An attempt as recorded: its outcome and what an ACKED answer is built from.
#[derive(Debug)]
pub struct Recorded {
    pub attempt: Attempt,
    pub payout_id: Uuid,
    pub rail_reference: Option<String>,
    pub submitted_at: DateTime<Utc>,
    pub resolved_at: Option<DateTime<Utc>>,
}

#[derive(Debug, sqlx::FromRow)]
struct RecordRow {
    outcome: String,
    payout_id: Uuid,
    rail_reference: Option<String>,
    submitted_at: DateTime<Utc>,
    resolved_at: Option<DateTime<Utc>>,
}

impl RecordRow {
    fn into_recorded(self) -> Result<Recorded, StoreError> {
        Ok(Recorded {
            attempt: Attempt::parse(&self.outcome)?,
            payout_id: self.payout_id,
            rail_reference: self.rail_reference,
            submitted_at: self.submitted_at,
            resolved_at: self.resolved_at,
        })
    }
}

/// What a docs/design.md#d-8 high-water lowering did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LowerOutcome {
    /// Lowered to the operator's token and recorded in `fence_recoveries`.
    Lowered {
        previous: i64,
        highest: i64,
        recovery_id: Option<i64>,
    },
    /// Already at or below the token.
    Unchanged {
        previous: i64,
        highest: i64,
    },
    /// The token is below `seen`, the highest token the proxy admitted a proven submission with
    /// (`rail_high_water.max_seen_token`): nothing changed, nothing recorded.
    BelowSeen {
        highest: i64,
        seen: i64,
    },
    NotFound,
}

#[derive(Debug, sqlx::FromRow)]
struct LowerRow {
    outcome: String,
    previous_token: Option<i64>,
    highest_token: Option<i64>,
    recovery_id: Option<i64>,
    seen_token: Option<i64>,
}

impl LowerRow {
    fn into_outcome(self) -> Result<LowerOutcome, StoreError> {
        let previous = self.previous_token.unwrap_or_default();
        let highest = self.highest_token.unwrap_or_default();
        Ok(match self.outcome.as_str() {
            "lowered" => LowerOutcome::Lowered {
                previous,
                highest,
                recovery_id: self.recovery_id,
            },
            "unchanged" => LowerOutcome::Unchanged { previous, highest },
            "below_seen" => LowerOutcome::BelowSeen {
                highest,
                seen: self.seen_token.unwrap_or_default(),
            },
            "not_found" => LowerOutcome::NotFound,
            other => return unknown("rail_lower_high_water", other),
        })
    }
}

/// Who raises or lowers a high-water mark and why, for its audit row.
pub use dlock_server::pg::Audit;

/// Admission (docs/contract.md#admission-order, steps 1–3), written once in `rail_admit`: the mark,
/// one attempt per payout, the intent row, committed before the forward. `canonical` is the request
/// as re-serialized; paydb keeps only its hash. `proven`: the token's proof was verified; an
/// admitted proven token raises the mark's floor (`max_seen_token`), which a lowering never
/// goes under.
pub async fn admit(
    pool: &PgPool,
    body: &SubmissionRequest,
    token: i64,
    key: &str,
    submission_id: Uuid,
    canonical: &str,
    proven: bool,
) -> Result<Admission, StoreError> {
    let row: AdmitRow = sqlx::query_as(
        "SELECT outcome, highest_token, resource_type, state, submission_id, submission_outcome, \
                response_status, response_body \
         FROM rail_admit($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)",
    )
    .bind(body.payout_id)
    .bind(&body.account_id)
    .bind(body.amount_minor)
    .bind(&body.currency)
    .bind(&body.beneficiary_ref)
    .bind(token)
    .bind(key)
    .bind(submission_id)
    .bind(canonical)
    .bind(proven)
    .fetch_one(pool)
    .await?;
    row.into_admission()
}

/// Records what the rail answered (`ACKED`, `REJECTED` or `TIMEOUT`), once; an attempt
/// resolved before (by the sweeper) keeps its outcome and is answered as it is.
pub async fn record(
    pool: &PgPool,
    submission_id: Uuid,
    attempt: Attempt,
    reference: Option<&str>,
) -> Result<Recorded, StoreError> {
    let row: RecordRow = sqlx::query_as(
        "SELECT outcome, payout_id, rail_reference, submitted_at, resolved_at FROM rail_record($1, $2, $3)",
    )
    .bind(submission_id)
    .bind(attempt.as_str())
    .bind(reference)
    .fetch_one(pool)
    .await?;
    row.into_recorded()
}

/// An attempt as recorded, read again (for the identical retry).
pub async fn recorded(pool: &PgPool, submission_id: Uuid) -> Result<Recorded, StoreError> {
    let row: RecordRow = sqlx::query_as(
        "SELECT outcome, payout_id, rail_reference, submitted_at, resolved_at \
         FROM rail_submission WHERE submission_id = $1",
    )
    .bind(submission_id)
    .fetch_one(pool)
    .await?;
    row.into_recorded()
}

/// Keeps the answer sent for an attempt, for the identical retry.
pub async fn store_answer(
    pool: &PgPool,
    submission_id: Uuid,
    attempt: Attempt,
    status: u16,
    body: &[u8],
) -> Result<(), StoreError> {
    let _: (bool,) = sqlx::query_as("SELECT rail_store_answer($1, $2, $3, $4)")
        .bind(submission_id)
        .bind(attempt.as_str())
        .bind(status as i16)
        .bind(body)
        .fetch_one(pool)
        .await?;
    Ok(())
}

/// An attempt's outcome and its stored answer, if any yet.
pub async fn attempt_answer(
    pool: &PgPool,
    submission_id: Uuid,
) -> Result<(Attempt, StoredAnswer), StoreError> {
    let (outcome, status, body): (String, Option<i16>, Option<Vec<u8>>) = sqlx::query_as(
        "SELECT outcome, response_status, response_body FROM rail_submission \
         WHERE submission_id = $1",
    )
    .bind(submission_id)
    .fetch_one(pool)
    .await?;
    Ok((Attempt::parse(&outcome)?, status.zip(body)))
}

pub async fn account_exists(pool: &PgPool, account_id: &str) -> Result<bool, StoreError> {
    let exists: Option<(i32,)> = sqlx::query_as("SELECT 1 FROM accounts WHERE account_id = $1")
        .bind(account_id)
        .fetch_optional(pool)
        .await?;
    Ok(exists.is_some())
}

/// Raises an account's mark to `floor` (never lowers it); the mark before and after.
pub async fn advance_high_water(
    pool: &PgPool,
    account_id: &str,
    floor: i64,
    revocation_id: Option<Uuid>,
    audit: &Audit<'_>,
) -> Result<(i64, i64), StoreError> {
    Ok(sqlx::query_as(
        "SELECT previous_token, new_token \
         FROM rail_advance_high_water($1, $2, $3, $4, $5, $6, $7)",
    )
    .bind(account_id)
    .bind(floor)
    .bind(audit.operator)
    .bind(audit.owner_id)
    .bind(audit.reason)
    .bind(revocation_id)
    .bind(audit.identity)
    .fetch_one(pool)
    .await?)
}

/// docs/design.md#d-8 recovery: lowers a poisoned mark to `to`, recorded in `fence_recoveries`;
/// never under the highest proven token admitted
/// (migrations/paydb/0040_baseline_idempotency_and_rail.sql).
pub async fn lower_high_water(
    pool: &PgPool,
    account_id: &str,
    to: i64,
    audit: &Audit<'_>,
) -> Result<LowerOutcome, StoreError> {
    let sql = "SELECT outcome, previous_token, highest_token, recovery_id, seen_token \
               FROM rail_lower_high_water($1, $2, $3, $4, $5, $6)";
    let row: LowerRow = audit.lowering(sql, account_id, to).fetch_one(pool).await?;
    row.into_outcome()
}

/// An account's mark; 0 when none is stored.
pub async fn high_water(pool: &PgPool, account_id: &str) -> Result<i64, StoreError> {
    let row: Option<(i64,)> =
        sqlx::query_as("SELECT highest_token FROM rail_high_water WHERE account_id = $1")
            .bind(account_id)
            .fetch_optional(pool)
            .await?;
    Ok(row.map(|r| r.0).unwrap_or(0))
}

/// One submission of an admission batch: `rail_admit`'s arguments.
#[derive(Debug)]
pub struct AdmitItem {
    pub body: SubmissionRequest,
    pub token: i64,
    pub key: String,
    pub submission_id: Uuid,
    pub canonical: String,
}

impl AdmitItem {
    /// The keys that keep two items out of one batch: its payout and its account.
    pub fn keys(&self) -> Vec<String> {
        vec![
            format!("payout:{}", self.body.payout_id),
            format!("account:{}", self.body.account_id),
        ]
    }
}

#[derive(Debug, sqlx::FromRow)]
struct AdmitManyRow {
    item: i32,
    #[sqlx(flatten)]
    admit: AdmitRow,
    error_state: Option<String>,
    error_message: Option<String>,
}

/// Admission of a batch (docs/design.md#group-commit) in one statement, so one transaction and
/// one commit (`rail_admit_many`, migrations/paydb/0040_baseline_idempotency_and_rail.sql): each
/// item decided by `rail_admit` in its own subtransaction, in item order. The outer error is the
/// whole batch's: nothing of it was written. An inner error is one item's, rolled back alone.
pub async fn admit_many(
    pool: &PgPool,
    items: &[AdmitItem],
    proven: bool,
) -> Result<Vec<Result<Admission, StoreError>>, StoreError> {
    let payouts: Vec<Uuid> = items.iter().map(|i| i.body.payout_id).collect();
    let accounts: Vec<&str> = items.iter().map(|i| i.body.account_id.as_str()).collect();
    let amounts: Vec<i64> = items.iter().map(|i| i.body.amount_minor).collect();
    let currencies: Vec<&str> = items.iter().map(|i| i.body.currency.as_str()).collect();
    let beneficiaries: Vec<&str> = items
        .iter()
        .map(|i| i.body.beneficiary_ref.as_str())
        .collect();
    let tokens: Vec<i64> = items.iter().map(|i| i.token).collect();
    let keys: Vec<&str> = items.iter().map(|i| i.key.as_str()).collect();
    let submissions: Vec<Uuid> = items.iter().map(|i| i.submission_id).collect();
    let requests: Vec<&str> = items.iter().map(|i| i.canonical.as_str()).collect();
    let rows: Vec<AdmitManyRow> = sqlx::query_as(
        "SELECT item, outcome, highest_token, resource_type, state, submission_id, \
                submission_outcome, response_status, response_body, error_state, error_message \
         FROM rail_admit_many($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)",
    )
    .bind(&payouts)
    .bind(&accounts)
    .bind(&amounts)
    .bind(&currencies)
    .bind(&beneficiaries)
    .bind(&tokens)
    .bind(&keys)
    .bind(&submissions)
    .bind(&requests)
    .bind(proven)
    .fetch_all(pool)
    .await?;
    let answers = rows.into_iter().map(|row| {
        let answer = if row.admit.outcome == "error" {
            Err(StoreError::Failed {
                state: row.error_state,
                message: row
                    .error_message
                    .unwrap_or_else(|| "rail_admit raised without a message".into()),
            })
        } else {
            row.admit.into_admission()
        };
        (row.item, answer)
    });
    in_order("rail_admit_many", items.len(), answers)
}

/// One answer of a record batch: `rail_record`'s arguments.
#[derive(Debug)]
pub struct RecordItem {
    pub submission_id: Uuid,
    pub attempt: Attempt,
    pub reference: Option<String>,
}

impl RecordItem {
    /// The key that keeps two items out of one batch: the attempt.
    pub fn keys(&self) -> Vec<String> {
        vec![self.submission_id.to_string()]
    }
}

#[derive(Debug, sqlx::FromRow)]
struct RecordManyRow {
    item: i32,
    outcome: String,
    payout_id: Option<Uuid>,
    rail_reference: Option<String>,
    submitted_at: Option<DateTime<Utc>>,
    resolved_at: Option<DateTime<Utc>>,
    error_state: Option<String>,
    error_message: Option<String>,
}

impl RecordManyRow {
    fn into_recorded(self) -> Result<Recorded, StoreError> {
        if self.outcome == "error" {
            return Err(StoreError::Failed {
                state: self.error_state,
                message: self
                    .error_message
                    .unwrap_or_else(|| "rail_record raised without a message".into()),
            });
        }
        let (Some(payout_id), Some(submitted_at)) = (self.payout_id, self.submitted_at) else {
            return unknown("rail_record_many", "an attempt without its payout");
        };
        RecordRow {
            outcome: self.outcome,
            payout_id,
            rail_reference: self.rail_reference,
            submitted_at,
            resolved_at: self.resolved_at,
        }
        .into_recorded()
    }
}

/// The answers of a record batch (docs/design.md#group-commit) in one statement, so one
/// transaction and one commit (`rail_record_many`,
/// migrations/paydb/0040_baseline_idempotency_and_rail.sql): each item recorded by `rail_record`
/// in its own subtransaction, in item order. The outer error is the whole batch's; an inner error
/// is one item's, rolled back alone.
pub async fn record_many(
    pool: &PgPool,
    items: &[RecordItem],
) -> Result<Vec<Result<Recorded, StoreError>>, StoreError> {
    let submissions: Vec<Uuid> = items.iter().map(|i| i.submission_id).collect();
    let outcomes: Vec<&str> = items.iter().map(|i| i.attempt.as_str()).collect();
    let references: Vec<Option<&str>> = items.iter().map(|i| i.reference.as_deref()).collect();
    let rows: Vec<RecordManyRow> = sqlx::query_as(
        "SELECT item, outcome, payout_id, rail_reference, submitted_at, resolved_at, \
                error_state, error_message \
         FROM rail_record_many($1, $2, $3)",
    )
    .bind(&submissions)
    .bind(&outcomes)
    .bind(&references)
    .fetch_all(pool)
    .await?;
    let answers = rows.into_iter().map(|row| (row.item, row.into_recorded()));
    in_order("rail_record_many", items.len(), answers)
}

/// The answers of `n` items in item order, from the rows of the batch's `function` that name
/// their item (from 1); an item it gave no answer for gets an error of its own.
fn in_order<T>(
    function: &'static str,
    n: usize,
    answers: impl IntoIterator<Item = (i32, Result<T, StoreError>)>,
) -> Result<Vec<Result<T, StoreError>>, StoreError> {
    let slots = by_item(n, answers).map_err(|item| StoreError::Unknown {
        function,
        outcome: format!("an answer for item {item}"),
    })?;
    Ok(slots
        .into_iter()
        .map(|answer| {
            answer.unwrap_or_else(|| unknown(function, "no answer for an item of the batch"))
        })
        .collect())
}
