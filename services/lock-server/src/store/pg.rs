//! Backend `pg`: lockdb on PostgreSQL. Every operation is one call of a function of
//! `migrations/lockdb`, one transaction, judged by the database clock. Concurrent acquires (and,
//! apart, releases) may share one call and one transaction ([`super::pg_batch`],
//! `lock.pg.batch.max`); each still gets its own answer.

use std::sync::Arc;

use chrono::{DateTime, Utc};
use dlock_contract::lock::{Heartbeat, HeldLocks, LockGrant, LockInfo, Revocation, Session};
use dlock_server::pg::PgSettings;
use dlock_server::warm::{Warm, WarmConnection};
use sqlx::{Connection, FromRow, PgPool};
use uuid::Uuid;

use crate::metrics::BatchMetrics;

use super::pg_batch::{AcquireItem, Batches, ReleaseItem};
use super::{
    Acquire, Attempt, Claim, Contention, QueueBounds, Renewal, RevokeOrder, Revoked, StoreError,
    StoreResult, SweepRetention, WaiterTicket, held_page, lock_info,
};

pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("../../migrations/lockdb");

#[derive(Clone)]
pub struct PgStore {
    pool: PgPool,
    /// The writes' connections, the last used first (services/server/src/warm.rs).
    warm: Warm,
    /// The group commit of acquires and releases; none with `lock.pg.batch.max = 1` (and in the
    /// copy the batches themselves run on, which calls the per-row functions).
    batches: Option<Arc<Batches>>,
}

/// One row of `dlock_result`.
#[derive(Debug, FromRow)]
pub(super) struct ResultRow {
    outcome: Option<String>,
    fencing_token: Option<i64>,
    owner_id: Option<String>,
    session_id: Option<Uuid>,
    acquired_at: Option<DateTime<Utc>>,
    expires_at: Option<DateTime<Utc>>,
    waiter_count: Option<i64>,
    server_time: Option<DateTime<Utc>>,
}

/// Maps a database failure to what the caller may conclude from it (docs/design.md#d-4): an
/// unreachable primary or a replica in recovery is NOT_LEADER (nothing happened, retry elsewhere).
pub fn map_sqlx(error: sqlx::Error) -> StoreError {
    match dlock_server::pg::unavailable(&error, "lockdb") {
        Some(why) => StoreError::NotLeader(why),
        None => StoreError::Backend(error.to_string()),
    }
}

/// Maps a failure of a write that was sent on a connection that answered a ping just before: a
/// broken connection or a garbled answer now means the statement may have run and committed
/// without its answer reaching us, OUTCOME_UNKNOWN (docs/contract.md#outcome-unknown). An error
/// PostgreSQL itself answered (a read-only replica, a shutdown that aborted the statement, a
/// constraint) is an answer: the statement's transaction was rolled back, as before.
pub fn map_sent(error: sqlx::Error) -> StoreError {
    match error {
        sqlx::Error::Protocol(ref message) if dlock_server::pg::opening_failed(message) => {
            map_sqlx(error)
        }
        sqlx::Error::Io(_) | sqlx::Error::Protocol(_) | sqlx::Error::WorkerCrashed => {
            StoreError::OutcomeUnknown(format!(
                "lockdb's connection broke after the statement was sent: {error}"
            ))
        }
        other => map_sqlx(other),
    }
}

pub(super) fn missing(what: &str) -> StoreError {
    StoreError::Backend(format!("lockdb returned no {what}"))
}

/// The session outcomes every session-bound function may answer; anything else is a failure.
fn session_outcome(outcome: &str) -> StoreError {
    match outcome {
        "session_unknown" => StoreError::SessionUnknown,
        "session_expired" => StoreError::SessionExpired,
        other => StoreError::Backend(format!("unexpected outcome {other}")),
    }
}

/// One grant of the held list.
#[derive(Debug, FromRow)]
struct HeldRow {
    lock_key: String,
    owner_id: String,
    session_id: Uuid,
    fencing_token: i64,
    acquired_at: DateTime<Utc>,
    expires_at: DateTime<Utc>,
}

impl ResultRow {
    /// An acquire's answer (dlock_acquire, dlock_acquire_many).
    pub(super) fn acquired(&self, key: &str) -> StoreResult<Acquire> {
        match self.outcome()? {
            "granted" => Ok(Acquire::Granted(self.grant(key)?)),
            "contended" => Ok(Acquire::Contended(self.contention())),
            other => Err(session_outcome(other)),
        }
    }

    /// A release's answer (dlock_release, dlock_release_many).
    pub(super) fn released(&self) -> StoreResult<()> {
        match self.outcome()? {
            "released" => Ok(()),
            _ => Err(StoreError::LockLost {
                stored_token: self.fencing_token,
            }),
        }
    }

    fn outcome(&self) -> StoreResult<&str> {
        self.outcome.as_deref().ok_or_else(|| missing("outcome"))
    }

    fn grant(&self, key: &str) -> StoreResult<LockGrant> {
        Ok(LockGrant {
            key: key.to_owned(),
            owner_id: self.owner_id.clone().ok_or_else(|| missing("owner"))?,
            session_id: self.session_id.ok_or_else(|| missing("session"))?,
            fencing_token: self.fencing_token.ok_or_else(|| missing("token"))?,
            acquired_at: self.acquired_at.ok_or_else(|| missing("acquiredAt"))?,
            expires_at: self.expires_at.ok_or_else(|| missing("expiresAt"))?,
            fencing_proof: None,
        })
    }

    fn contention(&self) -> Contention {
        Contention {
            holder_owner_id: self.owner_id.clone(),
            expires_at: self.expires_at,
            waiter_count: self.waiter_count.unwrap_or(0),
        }
    }
}

/// Calls one lockdb function that returns a `dlock_result` row: on the pool (a read, or a write
/// whose repetition is harmless), or, `write`, on a connection from [`PgStore::connection`], where
/// a failure after the send is OUTCOME_UNKNOWN.
macro_rules! call {
    (write $store:expr, $function:literal $(, $arg:expr)* $(,)?) => {{
        let mut connection = $store.connection().await?;
        sqlx::query_as::<_, ResultRow>(concat!(
            "SELECT outcome, fencing_token, owner_id, session_id, acquired_at, expires_at, ",
            "waiter_count, server_time FROM ",
            $function
        ))
        $(.bind($arg))*
        .fetch_one(&mut *connection)
        .await
        .map_err(map_sent)
    }};
    ($pool:expr, $function:literal $(, $arg:expr)* $(,)?) => {
        sqlx::query_as::<_, ResultRow>(concat!(
            "SELECT outcome, fencing_token, owner_id, session_id, acquired_at, expires_at, ",
            "waiter_count, server_time FROM ",
            $function
        ))
        $(.bind($arg))*
        .fetch_one($pool)
        .await
        .map_err(map_sqlx)
    };
}

impl PgStore {
    /// Connects (applying the migrations); `batch_max` is `lock.pg.batch.max`.
    pub async fn connect(settings: &PgSettings, batch_max: usize) -> anyhow::Result<Self> {
        let pool = settings
            .connect("dlock-lock-server", &MIGRATOR, "lockdb")
            .await?;
        let unbatched = Self {
            warm: Warm::new(pool.clone()),
            pool,
            batches: None,
        };
        Ok(match batch_max {
            0 | 1 => unbatched,
            max => Self {
                pool: unbatched.pool.clone(),
                warm: unbatched.warm.clone(),
                batches: Some(Arc::new(Batches::new(max, unbatched))),
            },
        })
    }

    /// The group commit's metrics, when acquires and releases are grouped.
    pub fn batch_metrics(&self) -> Option<BatchMetrics> {
        self.batches.as_ref().map(|b| b.metrics.clone())
    }

    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// A connection for one write, which answered a ping just now (within the pool's acquire
    /// timeout). Until the write is sent, nothing can have changed: a pool that gives no
    /// connection or a connection that does not answer the ping is NOT_LEADER. A pooled
    /// connection cut while idle fails its ping and is replaced once, so a restarted primary
    /// costs no caller an OUTCOME_UNKNOWN: a failed ping also sends the other warm connections
    /// back to the pool, so the second try is the pool's. After the send, see [`map_sent`].
    pub(super) async fn connection(&self) -> StoreResult<WarmConnection> {
        let wait = self.pool.options().get_acquire_timeout();
        let mut failure = String::new();
        for _ in 0..2 {
            let mut connection = self.warm.acquire().await.map_err(map_sqlx)?;
            match tokio::time::timeout(wait, connection.ping()).await {
                Ok(Ok(())) => return Ok(connection),
                Ok(Err(e)) => failure = format!("lockdb is unreachable: {e}"),
                Err(_) => {
                    failure = format!(
                        "lockdb did not answer a ping within lock.pg.acquire-timeout-ms ({} ms)",
                        wait.as_millis()
                    )
                }
            }
            connection.discard();
        }
        Err(StoreError::NotLeader(failure))
    }

    pub async fn create_session(&self, owner_id: &str, ttl_ms: i64) -> StoreResult<Session> {
        let session_id = Uuid::new_v4();
        let (expires_at,): (DateTime<Utc>,) = sqlx::query_as(
            "INSERT INTO sessions (session_id, owner_id, ttl_ms, expires_at)
             VALUES ($1, $2, $3, clock_timestamp() + $3 * interval '1 millisecond')
             RETURNING expires_at",
        )
        .bind(session_id)
        .bind(owner_id)
        .bind(ttl_ms as i32)
        .fetch_one(&mut *self.connection().await?)
        .await
        .map_err(map_sent)?;
        Ok(Session {
            session_id,
            owner_id: owner_id.to_owned(),
            ttl_millis: ttl_ms,
            expires_at,
        })
    }

    pub async fn heartbeat(&self, session_id: Uuid, owner_id: &str) -> StoreResult<Heartbeat> {
        let row = call!(write self, "dlock_heartbeat($1, $2)", session_id, owner_id)?;
        if let outcome @ ("session_unknown" | "session_expired") = row.outcome()? {
            return Err(session_outcome(outcome));
        }
        Ok(Heartbeat {
            session_id,
            expires_at: row.expires_at.ok_or_else(|| missing("expiresAt"))?,
            server_time: row.server_time.ok_or_else(|| missing("serverTime"))?,
            held_lock_count: row.waiter_count.unwrap_or(0),
        })
    }

    pub async fn end_session(&self, session_id: Uuid, owner_id: &str) -> StoreResult<()> {
        let (outcome,): (String,) = sqlx::query_as("SELECT dlock_end_session($1, $2)")
            .bind(session_id)
            .bind(owner_id)
            .fetch_one(&mut *self.connection().await?)
            .await
            .map_err(map_sent)?;
        match outcome.as_str() {
            "session_unknown" | "session_expired" => Err(session_outcome(&outcome)),
            _ => Ok(()),
        }
    }

    /// L4, one attempt: in the next batch of acquires when they are grouped, else alone.
    pub async fn try_acquire(&self, attempt: &Attempt<'_>) -> StoreResult<Acquire> {
        let item = AcquireItem::of(attempt);
        match &self.batches {
            Some(batches) => batches.acquire(item).await,
            None => self.acquire_one(&item).await,
        }
    }

    /// One acquire alone: one call of `dlock_acquire`, one transaction.
    pub async fn acquire_one(&self, item: &AcquireItem) -> StoreResult<Acquire> {
        let row = call!(
            write self,
            "dlock_acquire($1, $2, $3, $4, $5)",
            &item.key,
            item.session_id,
            &item.owner_id,
            item.ttl_ms,
            item.waiter
        )?;
        row.acquired(&item.key)
    }

    pub async fn enqueue(
        &self,
        claim: Claim<'_>,
        bounds: QueueBounds,
    ) -> StoreResult<WaiterTicket> {
        let id = Uuid::new_v4();
        let row = call!(
            write self,
            "dlock_enqueue($1, $2, $3, $4, $5, $6, $7)",
            claim.key,
            claim.session_id,
            claim.owner_id,
            id,
            bounds.place_ms as i32,
            bounds.per_key as i32,
            bounds.per_session as i32
        )?;
        match row.outcome()? {
            "queued" => Ok(WaiterTicket {
                id,
                key: claim.key.to_owned(),
                lease: None,
            }),
            "queue_full" => Err(StoreError::QueueFull {
                waiter_count: row.waiter_count.unwrap_or(bounds.per_key),
            }),
            "session_share" => Err(StoreError::SessionShareFull {
                waiter_count: row.waiter_count.unwrap_or_default(),
                share: bounds.per_session,
            }),
            other => Err(session_outcome(other)),
        }
    }

    pub async fn dequeue(&self, ticket: &WaiterTicket) -> StoreResult<()> {
        sqlx::query("DELETE FROM lock_waiters WHERE waiter_id = $1")
            .bind(ticket.id)
            .execute(&self.pool)
            .await
            .map_err(map_sqlx)?;
        Ok(())
    }

    pub async fn renew(&self, renewal: &Renewal<'_>) -> StoreResult<LockGrant> {
        let claim = renewal.claim;
        let (key, session_id, owner_id) = (claim.key, claim.session_id, claim.owner_id);
        let ttl_ms = renewal.ttl_ms.map(|t| t as i32);
        let row = call!(
            write self,
            "dlock_renew($1, $2, $3, $4, $5)",
            key,
            session_id,
            owner_id,
            renewal.token,
            ttl_ms
        )?;
        match row.outcome()? {
            "renewed" => row.grant(key),
            "lock_lost" => Err(StoreError::LockLost {
                stored_token: row.fencing_token,
            }),
            other => Err(session_outcome(other)),
        }
    }

    /// L6: in the next batch of releases when they are grouped, else alone.
    pub async fn release(&self, key: &str, owner_id: &str, token: i64) -> StoreResult<()> {
        let item = ReleaseItem {
            key: key.to_owned(),
            owner_id: owner_id.to_owned(),
            token,
        };
        match &self.batches {
            Some(batches) => batches.release(item).await,
            None => self.release_one(&item).await,
        }
    }

    /// One release alone: one call of `dlock_release`, one transaction.
    pub async fn release_one(&self, item: &ReleaseItem) -> StoreResult<()> {
        let row = call!(
            write self,
            "dlock_release($1, $2, $3)",
            &item.key,
            item.token,
            &item.owner_id
        )?;
        row.released()
    }

    pub async fn lock_info(&self, key: &str) -> StoreResult<Option<LockInfo>> {
        let seen: Option<(i32,)> =
            sqlx::query_as("SELECT 1 FROM lock_keys_seen WHERE lock_key = $1")
                .bind(key)
                .fetch_optional(&self.pool)
                .await
                .map_err(map_sqlx)?;
        if seen.is_none() {
            return Ok(None);
        }
        let row = call!(
            &self.pool,
            "dlock_holder($1, 'info', clock_timestamp())",
            key
        )?;
        let holder = match row.fencing_token {
            Some(_) => Some(row.grant(key)?),
            None => None,
        };
        Ok(Some(lock_info(key, holder, row.waiter_count.unwrap_or(0))))
    }

    pub async fn held(&self, limit: i64) -> StoreResult<HeldLocks> {
        let rows: Vec<HeldRow> = sqlx::query_as(
            "SELECT l.lock_key, l.owner_id, l.session_id, l.fencing_token, l.acquired_at,
                    l.expires_at
             FROM locks l JOIN sessions s ON s.session_id = l.session_id
             WHERE l.expires_at > clock_timestamp() AND s.expires_at > clock_timestamp()
             ORDER BY l.lock_key LIMIT $1",
        )
        .bind(limit + 1)
        .fetch_all(&self.pool)
        .await
        .map_err(map_sqlx)?;
        let items = rows
            .into_iter()
            .map(|row| LockGrant {
                key: row.lock_key,
                owner_id: row.owner_id,
                session_id: row.session_id,
                fencing_token: row.fencing_token,
                acquired_at: row.acquired_at,
                expires_at: row.expires_at,
                fencing_proof: None,
            })
            .collect();
        Ok(held_page(items, limit))
    }

    pub async fn revoke(&self, order: &RevokeOrder<'_>) -> StoreResult<Revocation> {
        let revocation_id = Uuid::new_v4();
        let row = call!(
            write self,
            "dlock_revoke($1, $2, $3, $4, $5, $6)",
            order.key,
            order.expected_token,
            order.operator,
            order.reason,
            revocation_id,
            order.caller
        )?;
        match row.outcome()? {
            "revoked" => Ok(order.revocation(Revoked {
                token: row.fencing_token.ok_or_else(|| missing("token"))?,
                owner_id: row.owner_id.clone().ok_or_else(|| missing("owner"))?,
                new_token_floor: row.waiter_count.ok_or_else(|| missing("floor"))?,
                revocation_id,
                revoked_at: row.server_time.ok_or_else(|| missing("time"))?,
            })),
            "not_held" => Err(StoreError::NotHeld),
            "fenced_out" => Err(order.fenced_out(
                row.fencing_token.unwrap_or_default(),
                row.owner_id.unwrap_or_default(),
            )),
            other => Err(StoreError::Backend(format!("unexpected outcome {other}"))),
        }
    }

    /// Ready when the database answers and takes writes (it is a primary, not in recovery).
    pub async fn ready(&self) -> StoreResult<()> {
        let standby = dlock_server::pg::standby(&self.pool, "lockdb").await;
        match standby.map_err(map_sqlx)? {
            Some(why) => Err(StoreError::NotLeader(why)),
            None => Ok(()),
        }
    }

    pub async fn sweep(&self, retention: &SweepRetention) -> StoreResult<u64> {
        let (removed,): (i64,) = sqlx::query_as("SELECT dlock_sweep($1, $2)")
            .bind(retention.expired_sessions_ms)
            .bind(retention.keys_seen_ms)
            .fetch_one(&self.pool)
            .await
            .map_err(map_sqlx)?;
        Ok(removed.max(0) as u64)
    }
}
