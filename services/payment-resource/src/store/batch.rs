//! Group commit (docs/design.md#group-commit): the claims (or the posts) that queue while the
//! previous transaction of their kind runs go into the next one together, through the set-based
//! functions of migrations/paydb/0016_set_based_claim_post.sql. [`GroupCommit`] is the queue;
//! [`PayStore::claim_many`], [`PayStore::post_many`] and [`PayStore::finish_many`] are the
//! batch's three statements (the calls, the answers, the commit).

use std::collections::{HashSet, VecDeque};
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};

use dlock_contract::payment::{LedgerEntry, PayoutState};
use sqlx::FromRow;
use tokio::sync::oneshot;
use uuid::Uuid;

use super::idempotency::{Scope, posted};
use super::outcome::{ClaimOutcome, ClaimRow, PostOutcome, PostRow};
use super::{PayStore, StoreError, StoreResult, Tx, map_sqlx, missing, unknown};

/// What a batch does with its items: `run` answers each, in order.
pub type Runner<C, I, O> = fn(C, Vec<I>) -> Pin<Box<dyn Future<Output = Vec<O>> + Send + 'static>>;

/// A queue of requests of one kind and the one batch of them that runs at a time. No timer: a
/// request that finds nothing running starts a batch at once, so a lone request goes straight
/// through, and the batch size follows the load. A batch takes up to `max` waiting items, at
/// most one per payout (the others wait one round), in arrival order.
pub struct GroupCommit<C, I, O> {
    queue: Arc<Mutex<Queue<I, O>>>,
    max: usize,
    run: Runner<C, I, O>,
    key: fn(&I) -> Uuid,
    /// Told the queue's length after every change (a gauge).
    queued: Arc<dyn Fn(usize) + Send + Sync>,
}

impl<C, I, O> Clone for GroupCommit<C, I, O> {
    fn clone(&self) -> Self {
        Self {
            queue: self.queue.clone(),
            max: self.max,
            run: self.run,
            key: self.key,
            queued: self.queued.clone(),
        }
    }
}

struct Queue<I, O> {
    running: bool,
    waiting: VecDeque<(I, oneshot::Sender<O>)>,
}

impl<C, I, O> GroupCommit<C, I, O>
where
    C: Clone + Send + 'static,
    I: Send + 'static,
    O: Send + 'static,
{
    pub fn new(
        max: usize,
        key: fn(&I) -> Uuid,
        run: Runner<C, I, O>,
        queued: Arc<dyn Fn(usize) + Send + Sync>,
    ) -> Self {
        Self {
            queue: Arc::new(Mutex::new(Queue {
                running: false,
                waiting: VecDeque::new(),
            })),
            max: max.max(1),
            run,
            key,
            queued,
        }
    }

    /// Queues `item` and waits for its answer, which comes after its batch committed (or
    /// failed). `None` when its batch's task died without answering (a bug, answered 503).
    pub async fn submit(&self, context: C, item: I) -> Option<O> {
        let (tx, rx) = oneshot::channel();
        let start = match self.queue.lock() {
            Ok(mut queue) => {
                queue.waiting.push_back((item, tx));
                (self.queued)(queue.waiting.len());
                !std::mem::replace(&mut queue.running, true)
            }
            Err(_) => return None,
        };
        if start {
            tokio::spawn(self.clone().drive(context));
        }
        rx.await.ok()
    }

    /// Runs batches until the queue is empty.
    async fn drive(self, context: C) {
        loop {
            let (items, answers) = match self.take() {
                Some(batch) => batch,
                None => return,
            };
            // Its own task: a panic in a batch answers its items `None` and the queue goes on.
            let batch = tokio::spawn((self.run)(context.clone(), items));
            if let Ok(outs) = batch.await {
                for (answer, out) in answers.into_iter().zip(outs) {
                    let _ = answer.send(out);
                }
            }
        }
    }

    /// The next batch, or `None` (and the queue marked idle) when nothing waits.
    #[allow(clippy::type_complexity)]
    fn take(&self) -> Option<(Vec<I>, Vec<oneshot::Sender<O>>)> {
        let Ok(mut queue) = self.queue.lock() else {
            return None;
        };
        if queue.waiting.is_empty() {
            queue.running = false;
            return None;
        }
        let mut keys = HashSet::new();
        let (mut items, mut answers, mut later) = (Vec::new(), Vec::new(), VecDeque::new());
        while let Some((item, answer)) = queue.waiting.pop_front() {
            if items.len() < self.max && keys.insert((self.key)(&item)) {
                items.push(item);
                answers.push(answer);
            } else {
                later.push_back((item, answer));
            }
        }
        queue.waiting = later;
        (self.queued)(queue.waiting.len());
        Some((items, answers))
    }
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
    fn verdict<T>(self, effect: impl FnOnce() -> StoreResult<T>) -> StoreResult<Item<T>> {
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
struct PostManyRow {
    #[sqlx(flatten)]
    head: ManyHead,
    #[sqlx(flatten)]
    post: PostRow,
    entries: Option<String>,
}

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
}

/// The verdicts of `n` items from rows that name their item (1-based), in item order.
fn in_order<T>(n: usize, rows: Vec<(i32, StoreResult<Item<T>>)>) -> StoreResult<Vec<Item<T>>> {
    let mut out: Vec<Option<Item<T>>> = (0..n).map(|_| None).collect();
    for (item, verdict) in rows {
        let slot = usize::try_from(item - 1)
            .ok()
            .and_then(|i| out.get_mut(i))
            .ok_or_else(|| StoreError::Backend(format!("pay_*_many answered item {item}")))?;
        *slot = Some(verdict?);
    }
    out.into_iter()
        .map(|v| v.ok_or_else(|| missing("answer for an item of the batch")))
        .collect()
}

impl PayStore {
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
        let mut tx = self.begin_tx().await?;
        let s = Scopes::of(items.iter().map(|i| i.scope));
        let payouts: Vec<Uuid> = items.iter().map(|i| i.payout_id).collect();
        let expected: Vec<&str> = items.iter().map(|i| i.expected_state.as_str()).collect();
        let rows: Vec<ClaimManyRow> = sqlx::query_as(
            "SELECT item, begin_outcome, response_status, response_body, outcome, state, fence, \
                    attempt_count, claim_token, account_id, available_minor, amount_minor, \
                    error_state, error_message \
             FROM pay_claim_many($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11)",
        )
        .bind(&s.routes)
        .bind(&s.keys)
        .bind(&s.tokens)
        .bind(&s.owners)
        .bind(&s.hashes)
        .bind(&s.retention)
        .bind(wait_ms)
        .bind(&payouts)
        .bind(&expected)
        .bind(max_attempts)
        .bind(proven)
        .fetch_all(&mut *tx)
        .await
        .map_err(map_sqlx)?;
        let rows = rows
            .into_iter()
            .map(|r| {
                let item = r.head.item;
                let claim = r.claim;
                (
                    item,
                    r.head.verdict(|| claim.into_outcome("pay_claim_many")),
                )
            })
            .collect();
        Ok((tx, in_order(items.len(), rows)?))
    }

    /// The posts of a batch (`pay_post_many`), as [`PayStore::claim_many`]; a posted item
    /// carries its two entries, DEBIT first.
    pub async fn post_many(
        &self,
        items: &[PostItem<'_>],
        wait_ms: i32,
        proven: bool,
    ) -> StoreResult<(Tx, Vec<Item<(PostOutcome, Vec<LedgerEntry>)>>)> {
        let mut tx = self.begin_tx().await?;
        let s = Scopes::of(items.iter().map(|i| i.scope));
        let payouts: Vec<Uuid> = items.iter().map(|i| i.payout_id).collect();
        let references: Vec<&str> = items.iter().map(|i| i.rail_reference).collect();
        let submissions: Vec<Uuid> = items.iter().map(|i| i.submission_id).collect();
        let rows: Vec<PostManyRow> = sqlx::query_as(
            "SELECT item, begin_outcome, response_status, response_body, outcome, state, fence, \
                    account_id, balance_minor, entries, error_state, error_message \
             FROM pay_post_many($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11)",
        )
        .bind(&s.routes)
        .bind(&s.keys)
        .bind(&s.tokens)
        .bind(&s.owners)
        .bind(&s.hashes)
        .bind(&s.retention)
        .bind(wait_ms)
        .bind(&payouts)
        .bind(&references)
        .bind(&submissions)
        .bind(proven)
        .fetch_all(&mut *tx)
        .await
        .map_err(map_sqlx)?;
        let rows = rows
            .into_iter()
            .map(|r| {
                let item = r.head.item;
                let (post, entries) = (r.post, r.entries);
                let verdict = r
                    .head
                    .verdict(|| posted(post, entries.as_deref(), "pay_post_many"));
                (item, verdict)
            })
            .collect();
        Ok((tx, in_order(items.len(), rows)?))
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

#[cfg(test)]
mod tests {
    use super::*;

    type Test = GroupCommit<(), (Uuid, u32), u32>;

    fn echo(_: (), items: Vec<(Uuid, u32)>) -> Pin<Box<dyn Future<Output = Vec<u32>> + Send>> {
        Box::pin(async move { items.into_iter().map(|(_, n)| n).collect() })
    }

    fn queue(max: usize) -> Test {
        GroupCommit::new(max, |item| item.0, echo, Arc::new(|_| {}))
    }

    /// Queues items without starting a batch, as if one were running.
    fn push(q: &Test, items: &[(Uuid, u32)]) -> Vec<oneshot::Receiver<u32>> {
        let mut queue = q.queue.lock().unwrap_or_else(|e| e.into_inner());
        queue.running = true;
        items
            .iter()
            .map(|item| {
                let (tx, rx) = oneshot::channel();
                queue.waiting.push_back((*item, tx));
                rx
            })
            .collect()
    }

    fn taken(q: &Test) -> Vec<u32> {
        q.take()
            .map(|(items, _)| items.into_iter().map(|(_, n)| n).collect())
            .unwrap_or_default()
    }

    #[test]
    fn a_batch_takes_at_most_max_and_one_per_payout_in_arrival_order() {
        let (a, b, c) = (Uuid::new_v4(), Uuid::new_v4(), Uuid::new_v4());
        let q = queue(2);
        let _answers = push(&q, &[(a, 1), (a, 2), (b, 3), (c, 4), (a, 5)]);
        // 2 waits (a is taken); 4 waits (max 2).
        assert_eq!(taken(&q), vec![1, 3]);
        assert_eq!(taken(&q), vec![2, 4]);
        assert_eq!(taken(&q), vec![5]);
        // Empty: the queue is idle again, so the next request starts a batch at once.
        assert!(q.take().is_none());
        assert!(!q.queue.lock().unwrap_or_else(|e| e.into_inner()).running);
    }

    #[tokio::test]
    async fn a_lone_request_is_answered_without_waiting_for_more() {
        let q = queue(32);
        let id = Uuid::new_v4();
        assert_eq!(q.submit((), (id, 7)).await, Some(7));
        // And again: whether or not the first batch's task has gone idle yet, it is answered.
        assert_eq!(q.submit((), (id, 8)).await, Some(8));
    }
}
