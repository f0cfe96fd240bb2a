//! Group commit of the `pg` store's acquires and releases (docs/design.md#group-commit): the
//! acquires (or the releases) that queue while the previous lockdb transaction of their kind runs
//! go into the next one together, through the set-based functions of
//! migrations/lockdb/0016_baseline.sql.
//!
//! No timer: a request that finds nothing running starts a transaction at once, alone, on the
//! per-row function (`dlock_acquire`, `dlock_release`), so a lone request goes exactly the way it
//! went before and batches form only under load. A batch takes up to `lock.pg.batch.max` waiting
//! requests, at most one per key (a second request on a key waits one round), in arrival order:
//! the queue is dlock_server::group_commit (services/contract/src/group_commit.rs).
//! No answer leaves before its batch's statement has committed. When the statement fails:
//!
//! - lockdb unavailable (unreachable, a replica, shutting down, the backend terminated), or any
//!   other error PostgreSQL answered: the statement's transaction was rolled back, nothing of the
//!   batch was written. Unavailable: every item is `503 NOT_LEADER`, retry-safe. Any other error
//!   (a deadlock PostgreSQL broke, an item the function refused): every item runs again alone on
//!   the per-row function, so one item never fails its neighbours;
//! - the connection broke after the statement was sent: it may have committed, so every item is
//!   OUTCOME_UNKNOWN, as a request alone would be (docs/contract.md#outcome-unknown).

use std::sync::Arc;

use dlock_server::group_commit::{GroupCommit, Observer};
use sqlx::FromRow;
use uuid::Uuid;

use super::pg::{PgStore, ResultRow, map_sent, missing};
use super::{Acquire, Attempt, StoreError, StoreResult};
use crate::metrics::{BatchKind, BatchMetrics};

/// One acquire of a batch: `dlock_acquire`'s arguments.
#[derive(Debug, Clone)]
pub struct AcquireItem {
    pub key: String,
    pub session_id: Uuid,
    pub owner_id: String,
    pub ttl_ms: i32,
    /// The claim's place in the key's queue, once it has one.
    pub waiter: Option<Uuid>,
}

impl AcquireItem {
    pub fn of(attempt: &Attempt<'_>) -> Self {
        Self {
            key: attempt.claim.key.to_owned(),
            session_id: attempt.claim.session_id,
            owner_id: attempt.claim.owner_id.to_owned(),
            ttl_ms: attempt.ttl_ms as i32,
            waiter: attempt.ticket.map(|t| t.id),
        }
    }
}

/// One release of a batch: `dlock_release`'s arguments.
#[derive(Debug, Clone)]
pub struct ReleaseItem {
    pub key: String,
    pub owner_id: String,
    pub token: i64,
}

/// At most one request per lock key in a batch.
fn key_of_acquire(item: &AcquireItem) -> Vec<String> {
    vec![item.key.clone()]
}

fn key_of_release(item: &ReleaseItem) -> Vec<String> {
    vec![item.key.clone()]
}

/// A queue's length and its batches' sizes, as `lock_batch_queued` and `lock_batch_size`.
struct Observed(BatchMetrics, BatchKind);

impl Observer for Observed {
    fn queued(&self, waiting: usize) {
        self.0.queued(self.1, waiting);
    }

    fn batch(&self, size: usize) {
        self.0.batch(self.1, size);
    }
}

/// The group commits of one `pg` store. A batch runs on a store that does not batch (the
/// per-row functions for one item).
pub struct Batches {
    acquires: GroupCommit<PgStore, AcquireItem, StoreResult<Acquire>>,
    releases: GroupCommit<PgStore, ReleaseItem, StoreResult<()>>,
    store: PgStore,
    pub(super) metrics: BatchMetrics,
}

/// The answer when a batch's task died without answering (a bug): its statement may have run.
fn lost() -> StoreError {
    StoreError::OutcomeUnknown(
        "the lockdb transaction this request was grouped in stopped without an answer".into(),
    )
}

impl Batches {
    /// `store` is the one the batches run on: it must not batch itself.
    pub(super) fn new(max: usize, store: PgStore) -> Self {
        let metrics = BatchMetrics::default();
        let observed = |kind| Arc::new(Observed(metrics.clone(), kind));
        Self {
            acquires: GroupCommit::new(
                max,
                key_of_acquire,
                |store, items| Box::pin(async move { acquire_batch(store, items).await }),
                observed(BatchKind::acquire),
            ),
            releases: GroupCommit::new(
                max,
                key_of_release,
                |store, items| Box::pin(async move { release_batch(store, items).await }),
                observed(BatchKind::release),
            ),
            store,
            metrics,
        }
    }

    pub(super) async fn acquire(&self, item: AcquireItem) -> StoreResult<Acquire> {
        self.acquires
            .submit(self.store.clone(), item)
            .await
            .unwrap_or_else(|| Err(lost()))
    }

    pub(super) async fn release(&self, item: ReleaseItem) -> StoreResult<()> {
        self.releases
            .submit(self.store.clone(), item)
            .await
            .unwrap_or_else(|| Err(lost()))
    }
}

/// One row of `dlock_acquire_many` or `dlock_release_many`: an item's number (from 1) and its
/// `dlock_result`.
#[derive(Debug, FromRow)]
struct ItemRow {
    item: i32,
    #[sqlx(flatten)]
    result: ResultRow,
}

/// How a batch's statement failed.
enum Failed {
    /// Every item gets this answer (NOT_LEADER, OUTCOME_UNKNOWN, or a fault after the commit).
    Whole(StoreError),
    /// PostgreSQL answered an error: nothing was written; every item runs again alone.
    OneByOne(String),
}

impl Failed {
    /// Every item's answer when the batch's statement failed: the statement's error for each
    /// (`Whole`), or each item run again alone by `one` (`OneByOne`).
    async fn answers<'a, I, T, F>(
        self,
        kind: BatchKind,
        items: &'a [I],
        one: impl Fn(&'a I) -> F,
    ) -> Vec<StoreResult<T>>
    where
        F: std::future::Future<Output = StoreResult<T>>,
    {
        match self {
            Failed::Whole(error) => {
                batch_failed(kind, items.len(), &error);
                items.iter().map(|_| Err(error.clone())).collect()
            }
            Failed::OneByOne(reason) => {
                one_by_one(kind, items.len(), &reason);
                futures::future::join_all(items.iter().map(one)).await
            }
        }
    }
}

/// The rows of `n` items in item order, from rows that name their item.
fn in_order(n: usize, rows: Vec<ItemRow>) -> StoreResult<Vec<ResultRow>> {
    let slots =
        dlock_server::group_commit::by_item(n, rows.into_iter().map(|r| (r.item, r.result)))
            .map_err(|item| StoreError::Backend(format!("lockdb answered item {item}")))?;
    slots
        .into_iter()
        .map(|r| r.ok_or_else(|| missing("answer for an item of the batch")))
        .collect()
}

/// Runs one `*_many` statement on a connection that answered a ping (as a request alone).
async fn many<'q>(
    store: &PgStore,
    n: usize,
    query: sqlx::query::QueryAs<'q, sqlx::Postgres, ItemRow, sqlx::postgres::PgArguments>,
) -> Result<Vec<ResultRow>, Failed> {
    let mut connection = store.connection().await.map_err(Failed::Whole)?;
    let rows = match query.fetch_all(&mut *connection).await {
        Ok(rows) => rows,
        Err(sqlx::Error::Database(error)) => {
            let error = sqlx::Error::Database(error);
            return Err(match map_sent(error) {
                unavailable @ StoreError::NotLeader(_) => Failed::Whole(unavailable),
                other => Failed::OneByOne(other.to_string()),
            });
        }
        Err(error) => return Err(Failed::Whole(map_sent(error))),
    };
    in_order(n, rows).map_err(Failed::Whole)
}

/// A `*_many` function's rows, in the columns of [`ItemRow`].
macro_rules! many_sql {
    ($function:literal) => {
        concat!(
            "SELECT item, outcome, fencing_token, owner_id, session_id, acquired_at, ",
            "expires_at, waiter_count, server_time FROM ",
            $function
        )
    };
}

async fn acquire_batch(store: PgStore, items: Vec<AcquireItem>) -> Vec<StoreResult<Acquire>> {
    if let [item] = items.as_slice() {
        return vec![store.acquire_one(item).await];
    }
    let keys: Vec<&str> = items.iter().map(|i| i.key.as_str()).collect();
    let sessions: Vec<Uuid> = items.iter().map(|i| i.session_id).collect();
    let owners: Vec<&str> = items.iter().map(|i| i.owner_id.as_str()).collect();
    let ttls: Vec<i32> = items.iter().map(|i| i.ttl_ms).collect();
    let waiters: Vec<Option<Uuid>> = items.iter().map(|i| i.waiter).collect();
    let sql = many_sql!("dlock_acquire_many($1, $2, $3, $4, $5)");
    let query = sqlx::query_as::<_, ItemRow>(sql)
        .bind(&keys)
        .bind(&sessions)
        .bind(&owners)
        .bind(&ttls)
        .bind(&waiters);
    match many(&store, items.len(), query).await {
        Ok(rows) => items
            .iter()
            .zip(rows)
            .map(|(item, row)| row.acquired(&item.key))
            .collect(),
        Err(failed) => {
            let store = &store;
            failed
                .answers(BatchKind::acquire, &items, |item| store.acquire_one(item))
                .await
        }
    }
}

async fn release_batch(store: PgStore, items: Vec<ReleaseItem>) -> Vec<StoreResult<()>> {
    if let [item] = items.as_slice() {
        return vec![store.release_one(item).await];
    }
    let keys: Vec<&str> = items.iter().map(|i| i.key.as_str()).collect();
    let tokens: Vec<i64> = items.iter().map(|i| i.token).collect();
    let owners: Vec<&str> = items.iter().map(|i| i.owner_id.as_str()).collect();
    let sql = many_sql!("dlock_release_many($1, $2, $3)");
    let query = sqlx::query_as::<_, ItemRow>(sql)
        .bind(&keys)
        .bind(&tokens)
        .bind(&owners);
    match many(&store, items.len(), query).await {
        Ok(rows) => rows.iter().map(ResultRow::released).collect(),
        Err(failed) => {
            let store = &store;
            failed
                .answers(BatchKind::release, &items, |item| store.release_one(item))
                .await
        }
    }
}

fn batch_failed(kind: BatchKind, size: usize, error: &StoreError) {
    tracing::warn!(
        event = "lock_batch_failed",
        kind = ?kind,
        size,
        %error,
        "a grouped lockdb transaction failed; every request in it gets this answer (NOT_LEADER: \
         nothing was written, retry)"
    );
}

fn one_by_one(kind: BatchKind, size: usize, reason: &str) {
    tracing::warn!(
        event = "lock_batch_one_by_one",
        kind = ?kind,
        size,
        %reason,
        "lockdb refused a grouped transaction and wrote nothing; its requests run again one by one"
    );
}
