//! The idempotency record of a write (docs/design.md#d-7): claimed at the start of the write's
//! transaction, answered at its end, so the effect and the stored answer commit together or not
//! at all. The `*_once` calls claim the record and run the effect in one round trip
//! (`pay_claim_once`, `pay_post_once`).

use dlock_contract::payment::{LedgerEntry, PayoutState};
use sqlx::{FromRow, Postgres};
use uuid::Uuid;

use super::outcome::{ClaimOutcome, ClaimRow, PostOutcome, PostRow, entry};
use super::{PayStore, StoreError, StoreResult, Tx, map_sqlx, missing, unknown};

/// The scope and contents of one idempotent write (docs/design.md#d-7).
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

/// What a `*_once` call found: a fresh request with its effect's outcome (in the open
/// transaction, to be finished), or the idempotency record's verdict.
pub enum Once<T> {
    Fresh(Tx, T),
    Replay { status: u16, body: Vec<u8> },
    Conflict,
}

/// The columns of `pay_idempotency_begin`, which every `*_once` function returns first.
#[derive(Debug, FromRow)]
struct BeginRow {
    begin_outcome: String,
    response_status: Option<i16>,
    response_body: Option<Vec<u8>>,
}

impl BeginRow {
    /// The record's verdict; `effect` reads the effect's columns only when the request is fresh.
    fn once<T>(self, tx: Tx, effect: impl FnOnce() -> StoreResult<T>) -> StoreResult<Once<T>> {
        match self.begin_outcome.as_str() {
            "fresh" => Ok(Once::Fresh(tx, effect()?)),
            "conflict" => Ok(Once::Conflict),
            "replay" => Ok(Once::Replay {
                status: self
                    .response_status
                    .ok_or_else(|| missing("response status"))? as u16,
                body: self.response_body.ok_or_else(|| missing("response body"))?,
            }),
            other => Err(unknown("pay_idempotency_begin", other)),
        }
    }
}

#[derive(Debug, FromRow)]
struct ClaimOnceRow {
    #[sqlx(flatten)]
    begin: BeginRow,
    #[sqlx(flatten)]
    claim: ClaimRow,
}

#[derive(Debug, FromRow)]
struct PostOnceRow {
    #[sqlx(flatten)]
    begin: BeginRow,
    #[sqlx(flatten)]
    post: PostRow,
    entries: Option<String>,
}

/// One entry of `pay_post_once`'s JSON array.
#[derive(Debug, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub(super) struct EntryJson {
    pub(super) entry_id: Uuid,
    pub(super) account_id: String,
    pub(super) direction: String,
    pub(super) amount_minor: i64,
    pub(super) fence: i64,
}

/// A post's outcome and its ledger entries, from the row `function` (`pay_post_once` or
/// `pay_post_many`) answered: its outcome columns and its entries as a JSON array.
pub(super) fn posted(
    post: PostRow,
    entries: Option<&str>,
    function: &str,
) -> StoreResult<(PostOutcome, Vec<LedgerEntry>)> {
    let entries: Vec<EntryJson> = match entries {
        Some(text) => serde_json::from_str(text)
            .map_err(|e| StoreError::Backend(format!("posting entries: {e}")))?,
        None => Vec::new(),
    };
    Ok((
        post.into_outcome(function)?,
        entries
            .into_iter()
            .map(|e| {
                entry(
                    e.entry_id,
                    e.account_id,
                    &e.direction,
                    e.amount_minor,
                    e.fence,
                )
            })
            .collect(),
    ))
}

impl PayStore {
    /// Opens the write's transaction and claims its idempotency record in it. A duplicate of a
    /// request in flight blocks here until that request commits (then replays its answer) or
    /// rolls back (then runs itself), for at most `wait_ms`.
    pub async fn begin(&self, scope: &Scope, wait_ms: i32) -> StoreResult<Begin> {
        let mut tx = self.pool.begin().await.map_err(map_sqlx)?;
        let row: BeginRow = scope
            .bind_begin(
                sqlx::query_as(
                    "SELECT outcome AS begin_outcome, response_status, response_body \
             FROM pay_idempotency_begin($1, $2, $3, $4, $5, $6, $7)",
                ),
                wait_ms,
            )
            .fetch_one(&mut *tx)
            .await
            .map_err(map_sqlx)?;
        Ok(match row.once(tx, || Ok(()))? {
            Once::Fresh(tx, ()) => Begin::Fresh(tx),
            Once::Replay { status, body } => Begin::Replay { status, body },
            Once::Conflict => Begin::Conflict,
        })
    }

    /// Opens a write's transaction for a `*_once` call, which claims the idempotency record and
    /// runs the effect in one round trip.
    pub async fn begin_tx(&self) -> StoreResult<Tx> {
        self.pool.begin().await.map_err(map_sqlx)
    }

    /// P2 in one call (`pay_claim_once`): the idempotency record and, when fresh, the claim;
    /// `proven` when the token's proof was verified (it then counts in `max_seen_token`).
    pub async fn claim_once(
        mut tx: Tx,
        scope: &Scope,
        wait_ms: i32,
        payout_id: Uuid,
        expected_state: PayoutState,
        max_attempts: i32,
        proven: bool,
    ) -> StoreResult<Once<ClaimOutcome>> {
        let row: ClaimOnceRow = scope
            .bind_begin(
                sqlx::query_as(
                    "SELECT begin_outcome, response_status, response_body, outcome, state, fence, \
                    attempt_count, claim_token, account_id, available_minor, amount_minor \
             FROM pay_claim_once($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11)",
                ),
                wait_ms,
            )
            .bind(payout_id)
            .bind(expected_state.as_str())
            .bind(max_attempts)
            .bind(proven)
            .fetch_one(&mut *tx)
            .await
            .map_err(map_sqlx)?;
        row.begin
            .once(tx, || row.claim.into_outcome("pay_claim_once"))
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
        proven: bool,
    ) -> StoreResult<Once<(PostOutcome, Vec<LedgerEntry>)>> {
        let row: PostOnceRow = scope
            .bind_begin(
                sqlx::query_as(
                    "SELECT begin_outcome, response_status, response_body, outcome, state, fence, \
                    account_id, balance_minor, entries \
             FROM pay_post_once($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11)",
                ),
                wait_ms,
            )
            .bind(payout_id)
            .bind(rail_reference)
            .bind(submission_id)
            .bind(proven)
            .fetch_one(&mut *tx)
            .await
            .map_err(map_sqlx)?;
        row.begin.once(tx, || {
            posted(row.post, row.entries.as_deref(), "pay_post_once")
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

    /// Deletes expired idempotency records until none is left; returns how many went.
    pub async fn sweep(&self) -> StoreResult<u64> {
        let mut removed = 0u64;
        // Bounded: a backlog larger than this many batches is left for the next tick.
        for _ in 0..100 {
            let (n,): (i64,) = sqlx::query_as("SELECT pay_idempotency_sweep($1)")
                .bind(super::SWEEP_BATCH_MAX)
                .fetch_one(&self.pool)
                .await
                .map_err(map_sqlx)?;
            removed += n.max(0) as u64;
            if n < i64::from(super::SWEEP_BATCH_MAX) {
                break;
            }
        }
        Ok(removed)
    }
}
