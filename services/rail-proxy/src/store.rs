//! The rail proxy's paydb calls. Each paydb function answers an `outcome text`; it is read here,
//! once, into one enum per operation with the columns that outcome carries. A text this build
//! does not know is an error that names it, never a guess.

use chrono::{DateTime, Utc};
use dlock_contract::rail::SubmissionRequest;
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
    NotFound,
}

#[derive(Debug, sqlx::FromRow)]
struct LowerRow {
    outcome: String,
    previous_token: Option<i64>,
    highest_token: Option<i64>,
    recovery_id: Option<i64>,
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
            "not_found" => LowerOutcome::NotFound,
            other => return unknown("rail_lower_high_water", other),
        })
    }
}

/// Who raises or lowers a high-water mark and why, for its audit row.
pub use dlock_server::pg::Audit;

/// Admission (docs/contract.md#admission-order, steps 1–3), written once in `rail_admit`: the mark,
/// one attempt per payout, the intent row, committed before the forward. `canonical` is the request
/// as re-serialized; paydb keeps only its hash.
pub async fn admit(
    pool: &PgPool,
    body: &SubmissionRequest,
    token: i64,
    key: &str,
    submission_id: Uuid,
    canonical: &str,
) -> Result<Admission, StoreError> {
    let row: AdmitRow = sqlx::query_as(
        "SELECT outcome, highest_token, resource_type, state, submission_id, submission_outcome, \
                response_status, response_body \
         FROM rail_admit($1, $2, $3, $4, $5, $6, $7, $8, $9)",
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

/// docs/design.md#d-8 recovery: lowers a poisoned mark to `to`, recorded in `fence_recoveries`.
pub async fn lower_high_water(
    pool: &PgPool,
    account_id: &str,
    to: i64,
    audit: &Audit<'_>,
) -> Result<LowerOutcome, StoreError> {
    let sql = "SELECT outcome, previous_token, highest_token, recovery_id \
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
