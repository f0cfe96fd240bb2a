//! Group commit (docs/design.md#group-commit): the claims (or the posts) that queue while the
//! previous transaction of their kind runs go into the next one together, through the set-based
//! functions of migrations/paydb/0040_baseline_idempotency_and_rail.sql. The queue is
//! [`GroupCommit`] (dlock_server::group_commit, services/contract/src/group_commit.rs), keyed by
//! payout; [`PayStore::claim_many`], [`PayStore::post_many`] and [`PayStore::finish_many`] are
//! the batch's three statements (the calls, the answers, the commit). Registrations are grouped
//! the same way ([`PayStore::create_many`], migrations/paydb/0040_baseline_idempotency_and_rail.sql).

use std::sync::Arc;

use dlock_contract::payment::{LedgerEntry, Payout, PayoutState};
pub use dlock_server::group_commit::{GroupCommit, Observer, Runner};
use sqlx::FromRow;
use uuid::Uuid;

use super::idempotency::{Scope, posted};
use super::outcome::{ClaimOutcome, ClaimRow, CreatePayoutOutcome, PostOutcome, PostRow};
use super::{PayStore, StoreError, StoreResult, Tx, map_sqlx, missing, unknown};

/// A queue's observer that is told its length (`payment_batch_queued`); each batch's size is
/// observed by the batch itself, as it runs.
pub fn queue_gauge(queued: impl Fn(usize) + Send + Sync + 'static) -> Arc<dyn Observer> {
    struct Gauge<F>(F);
    impl<F: Fn(usize) + Send + Sync> Observer for Gauge<F> {
        fn queued(&self, waiting: usize) {
            (self.0)(waiting)
        }
        fn batch(&self, _: usize) {}
    }
    Arc::new(Gauge(queued))
}

/// One item's verdict in a batch's transaction.
pub enum Item<T> {
    /// Its record is fresh and its effect ran: the answer is to be stored with
    /// [`PayStore::finish_many`].
    Fresh(T),
    /// The stored answer of the identical request.
    Replay { status: u16, body: Vec<u8> },
    /// Same key and token, another body.
    Conflict,
    /// The payout does not exist; nothing was kept, its record included.
    NotFound,
    /// It raised and was rolled back alone (`InProgress` for the bounded wait on a duplicate's
    /// record): it runs again on the single path.
    Failed(StoreError),
}

/// A claim of a batch: its scope and the claim's arguments.
pub struct ClaimItem<'a> {
    pub scope: &'a Scope,
    pub payout_id: Uuid,
    pub expected_state: PayoutState,
}

/// A post of a batch.
pub struct PostItem<'a> {
    pub scope: &'a Scope,
    pub payout_id: Uuid,
    pub rail_reference: &'a str,
    pub submission_id: Uuid,
}

/// A registration of a batch: its scope and the payout to register.
pub struct CreateItem<'a> {
    pub scope: &'a Scope,
    pub payout_id: Uuid,
    pub account_id: &'a str,
    pub amount_minor: i64,
    pub currency: &'a str,
    pub beneficiary_ref: &'a str,
}

/// An answer to store: the item's scope, status and body.
pub struct Answer<'a> {
    pub scope: &'a Scope,
    pub status: u16,
    pub body: &'a [u8],
}

#[derive(Debug, FromRow)]
struct ManyHead {
    item: i32,
    begin_outcome: String,
    response_status: Option<i16>,
    response_body: Option<Vec<u8>>,
    error_state: Option<String>,
    error_message: Option<String>,
}

impl ManyHead {
    /// The row's item and its verdict; `effect` reads a fresh item's outcome.
    fn verdict<T>(self, effect: impl FnOnce() -> StoreResult<T>) -> (i32, StoreResult<Item<T>>) {
        (self.item, self.item_verdict(effect))
    }

    fn item_verdict<T>(self, effect: impl FnOnce() -> StoreResult<T>) -> StoreResult<Item<T>> {
        Ok(match self.begin_outcome.as_str() {
            "fresh" => Item::Fresh(effect()?),
            "replay" => Item::Replay {
                status: self
                    .response_status
                    .ok_or_else(|| missing("response status"))? as u16,
                body: self.response_body.ok_or_else(|| missing("response body"))?,
            },
            "conflict" => Item::Conflict,
            "not_found" => Item::NotFound,
            "error" => Item::Failed(match self.error_state.as_deref() {
                Some("55P03") => StoreError::InProgress,
                state => StoreError::Backend(format!(
                    "{} (SQLSTATE {})",
                    self.error_message.unwrap_or_default(),
                    state.unwrap_or("?")
                )),
            }),
            other => return Err(unknown("pay_*_many", other)),
        })
    }
}

#[derive(Debug, FromRow)]
struct ClaimManyRow {
    #[sqlx(flatten)]
    head: ManyHead,
    #[sqlx(flatten)]
    claim: ClaimRow,
}

#[derive(Debug, FromRow)]
struct CreateManyRow {
    #[sqlx(flatten)]
    head: ManyHead,
    outcome: Option<String>,
}

#[derive(Debug, FromRow)]
struct PostManyRow {
    #[sqlx(flatten)]
    head: ManyHead,
    #[sqlx(flatten)]
    post: PostRow,
    entries: Option<String>,
}

/// A `*_many` statement being bound, its rows read as `R`.
type ManyQuery<'q, R> = sqlx::query::QueryAs<'q, sqlx::Postgres, R, sqlx::postgres::PgArguments>;

/// The scopes' columns as arrays, in item order.
struct Scopes {
    routes: Vec<String>,
    keys: Vec<String>,
    tokens: Vec<i64>,
    owners: Vec<String>,
    hashes: Vec<Vec<u8>>,
    retention: Vec<i64>,
}

impl Scopes {
    fn of<'a>(scopes: impl Iterator<Item = &'a Scope>) -> Self {
        let mut s = Self {
            routes: Vec::new(),
            keys: Vec::new(),
            tokens: Vec::new(),
            owners: Vec::new(),
            hashes: Vec::new(),
            retention: Vec::new(),
        };
        for scope in scopes {
            s.routes.push(scope.route.clone());
            s.keys.push(scope.key.clone());
            s.tokens.push(scope.token);
            s.owners.push(scope.owner_id.clone());
            s.hashes.push(scope.payload_hash.to_vec());
            s.retention.push(scope.retention_ms);
        }
        s
    }

    /// Binds the scopes' six arrays and the in-progress wait, the first seven parameters of a
    /// `*_many` function.
    fn bind<'q, O>(self, query: ManyQuery<'q, O>, wait_ms: i32) -> ManyQuery<'q, O> {
        query
            .bind(self.routes)
            .bind(self.keys)
            .bind(self.tokens)
            .bind(self.owners)
            .bind(self.hashes)
            .bind(self.retention)
            .bind(wait_ms)
    }
}

/// The verdicts of `n` items from rows that name their item (1-based), in item order.
fn in_order<T>(
    n: usize,
    rows: impl IntoIterator<Item = (i32, StoreResult<Item<T>>)>,
) -> StoreResult<Vec<Item<T>>> {
    let slots = dlock_server::group_commit::by_item(n, rows)
        .map_err(|item| StoreError::Backend(format!("pay_*_many answered item {item}")))?;
    slots
        .into_iter()
        .map(|v| v.unwrap_or_else(|| Err(missing("answer for an item of the batch"))))
        .collect()
}

impl PayStore {
    /// Runs a batch's `*_many` statement `sql` in a transaction of its own, left open for
    /// [`PayStore::finish_many`]: its first eight parameters are the items' scopes, the
    /// in-progress wait ([`Scopes::bind`]) and the items' payouts (`heads`, each item's scope and
    /// payout); `columns` binds the items' own after them. The statement's rows; an error here is
    /// the whole batch's: nothing was written.
    async fn fetch_many<'q, R>(
        &self,
        sql: &'static str,
        heads: impl Iterator<Item = (&'q Scope, Uuid)>,
        wait_ms: i32,
        columns: impl FnOnce(ManyQuery<'q, R>) -> ManyQuery<'q, R>,
    ) -> StoreResult<(Tx, Vec<R>)>
    where
        R: Send + Unpin + for<'r> FromRow<'r, sqlx::postgres::PgRow>,
    {
        let (scopes, payouts): (Vec<&Scope>, Vec<Uuid>) = heads.unzip();
        let query = Scopes::of(scopes.into_iter()).bind(sqlx::query_as(sql), wait_ms);
        let query = columns(query.bind(payouts));
        let mut tx = self.begin_tx().await?;
        let rows = query.fetch_all(&mut *tx).await.map_err(map_sqlx)?;
        Ok((tx, rows))
    }

    /// The claims of a batch in one transaction and one call (`pay_claim_many`): each item's
    /// verdict, in item order, with the transaction still open for [`PayStore::finish_many`].
    /// An error here is the whole batch's: nothing was written.
    pub async fn claim_many(
        &self,
        items: &[ClaimItem<'_>],
        wait_ms: i32,
        max_attempts: i32,
        proven: bool,
    ) -> StoreResult<(Tx, Vec<Item<ClaimOutcome>>)> {
        let expected: Vec<&str> = items.iter().map(|i| i.expected_state.as_str()).collect();
        let sql = "SELECT item, begin_outcome, response_status, response_body, outcome, state, fence, \
            attempt_count, claim_token, account_id, available_minor, amount_minor, \
            error_state, error_message \
            FROM pay_claim_many($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11)";
        let (tx, rows) = self
            .fetch_many::<ClaimManyRow>(
                sql,
                items.iter().map(|i| (i.scope, i.payout_id)),
                wait_ms,
                |query| query.bind(&expected).bind(max_attempts).bind(proven),
            )
            .await?;
        let verdicts = rows
            .into_iter()
            .map(|r| r.head.verdict(|| r.claim.into_outcome("pay_claim_many")));
        Ok((tx, in_order(items.len(), verdicts)?))
    }

    /// The posts of a batch (`pay_post_many`), as [`PayStore::claim_many`]; a posted item
    /// carries its two entries, DEBIT first.
    pub async fn post_many(
        &self,
        items: &[PostItem<'_>],
        wait_ms: i32,
        proven: bool,
    ) -> StoreResult<(Tx, Vec<Item<(PostOutcome, Vec<LedgerEntry>)>>)> {
        let references: Vec<&str> = items.iter().map(|i| i.rail_reference).collect();
        let submissions: Vec<Uuid> = items.iter().map(|i| i.submission_id).collect();
        let sql = "SELECT item, begin_outcome, response_status, response_body, outcome, state, fence, \
            account_id, balance_minor, entries, error_state, error_message \
            FROM pay_post_many($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11)";
        let (tx, rows) = self
            .fetch_many::<PostManyRow>(
                sql,
                items.iter().map(|i| (i.scope, i.payout_id)),
                wait_ms,
                |query| query.bind(&references).bind(&submissions).bind(proven),
            )
            .await?;
        let verdicts = rows.into_iter().map(|r| {
            r.head
                .verdict(|| posted(r.post, r.entries.as_deref(), "pay_post_many"))
        });
        Ok((tx, in_order(items.len(), verdicts)?))
    }

    /// The registrations of a batch (`pay_create_many`), as [`PayStore::claim_many`]: a fresh
    /// item carries what `pay_create_payout` did and, when the payout exists, the payout as the
    /// transaction sees it (read for all items in one statement).
    pub async fn create_many(
        &self,
        items: &[CreateItem<'_>],
        wait_ms: i32,
    ) -> StoreResult<(Tx, Vec<Item<(CreatePayoutOutcome, Option<Payout>)>>)> {
        let payouts: Vec<Uuid> = items.iter().map(|i| i.payout_id).collect();
        let accounts: Vec<&str> = items.iter().map(|i| i.account_id).collect();
        let amounts: Vec<i64> = items.iter().map(|i| i.amount_minor).collect();
        let currencies: Vec<&str> = items.iter().map(|i| i.currency).collect();
        let beneficiaries: Vec<&str> = items.iter().map(|i| i.beneficiary_ref).collect();
        let sql = "SELECT item, begin_outcome, response_status, response_body, outcome, \
            error_state, error_message \
            FROM pay_create_many($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12)";
        let (mut tx, rows) = self
            .fetch_many::<CreateManyRow>(
                sql,
                items.iter().map(|i| (i.scope, i.payout_id)),
                wait_ms,
                |query| {
                    query
                        .bind(&accounts)
                        .bind(&amounts)
                        .bind(&currencies)
                        .bind(&beneficiaries)
                },
            )
            .await?;
        let read = Self::payouts(&mut tx, &payouts).await?;
        let verdicts = rows.into_iter().map(|r| {
            let payout_id = usize::try_from(r.head.item - 1)
                .ok()
                .and_then(|i| payouts.get(i));
            let payout = read
                .iter()
                .find(|p| Some(&p.payout_id) == payout_id)
                .cloned();
            let outcome = r.outcome;
            r.head.verdict(|| {
                let outcome = outcome.ok_or_else(|| missing("pay_create_many outcome"))?;
                Ok((CreatePayoutOutcome::parse(&outcome)?, payout))
            })
        });
        Ok((tx, in_order(items.len(), verdicts)?))
    }

    /// Stores the answers of a batch's fresh items in one statement and commits the batch.
    /// An error here is the whole batch's: nothing was written.
    pub async fn finish_many(&self, mut tx: Tx, answers: &[Answer<'_>]) -> StoreResult<()> {
        if !answers.is_empty() {
            let s = Scopes::of(answers.iter().map(|a| a.scope));
            let statuses: Vec<i16> = answers.iter().map(|a| a.status as i16).collect();
            let bodies: Vec<&[u8]> = answers.iter().map(|a| a.body).collect();
            let stored: i32 =
                sqlx::query_scalar("SELECT pay_idempotency_finish_many($1, $2, $3, $4, $5)")
                    .bind(&s.routes)
                    .bind(&s.keys)
                    .bind(&s.tokens)
                    .bind(&statuses)
                    .bind(&bodies)
                    .fetch_one(&mut *tx)
                    .await
                    .map_err(map_sqlx)?;
            if stored as usize != answers.len() {
                return Err(StoreError::Backend(format!(
                    "stored {stored} of the batch's {} answers; the batch is rolled back",
                    answers.len()
                )));
            }
        }
        tx.commit().await.map_err(map_sqlx)
    }
}
