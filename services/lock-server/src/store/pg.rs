//! Backend `pg`: lockdb on PostgreSQL. Every operation is one call of a function of
//! `migrations/lockdb`, one transaction, judged by the database clock.

use chrono::{DateTime, Utc};
use dlock_contract::lock::{Heartbeat, HeldLocks, LockGrant, LockInfo, Revocation, Session};
use dlock_server::pg::PgSettings;
use sqlx::{FromRow, PgPool};
use uuid::Uuid;

use super::{
    Acquire, Contention, QueueBounds, StoreError, StoreResult, SweepRetention, WaiterTicket,
};

pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("../../migrations/lockdb");

#[derive(Clone)]
pub struct PgStore {
    pool: PgPool,
}

/// key, owner, session, token, acquired, expires.
type HeldRow = (String, String, Uuid, i64, DateTime<Utc>, DateTime<Utc>);

/// One row of `dlock_result`.
#[derive(Debug, FromRow)]
struct ResultRow {
    outcome: Option<String>,
    fencing_token: Option<i64>,
    owner_id: Option<String>,
    session_id: Option<Uuid>,
    acquired_at: Option<DateTime<Utc>>,
    expires_at: Option<DateTime<Utc>>,
    waiter_count: Option<i64>,
    server_time: Option<DateTime<Utc>>,
}

/// Maps a database failure to what the caller may conclude from it (D-4): an unreachable
/// primary or a replica in recovery is NOT_LEADER (nothing happened, retry elsewhere).
pub fn map_sqlx(error: sqlx::Error) -> StoreError {
    match dlock_server::pg::unavailable(&error, "lockdb") {
        Some(why) => StoreError::NotLeader(why),
        None => StoreError::Backend(error.to_string()),
    }
}

fn missing(what: &str) -> StoreError {
    StoreError::Backend(format!("lockdb returned no {what}"))
}

fn session_outcome(outcome: &str) -> Option<StoreError> {
    match outcome {
        "session_unknown" => Some(StoreError::SessionUnknown),
        "session_expired" => Some(StoreError::SessionExpired),
        _ => None,
    }
}

impl ResultRow {
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

/// Calls one lockdb function that returns a `dlock_result` row.
macro_rules! call {
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
    pub async fn connect(settings: &PgSettings) -> anyhow::Result<Self> {
        let pool = settings
            .connect("dlock-lock-server", &MIGRATOR, "lockdb")
            .await
            .map_err(anyhow::Error::msg)?;
        Ok(Self { pool })
    }

    pub fn from_pool(pool: PgPool) -> Self {
        Self { pool }
    }

    pub fn pool(&self) -> &PgPool {
        &self.pool
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
        .fetch_one(&self.pool)
        .await
        .map_err(map_sqlx)?;
        Ok(Session {
            session_id,
            owner_id: owner_id.to_owned(),
            ttl_millis: ttl_ms,
            expires_at,
        })
    }

    pub async fn heartbeat(&self, session_id: Uuid, owner_id: &str) -> StoreResult<Heartbeat> {
        let row = call!(&self.pool, "dlock_heartbeat($1, $2)", session_id, owner_id)?;
        if let Some(error) = session_outcome(row.outcome()?) {
            return Err(error);
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
            .fetch_one(&self.pool)
            .await
            .map_err(map_sqlx)?;
        match session_outcome(&outcome) {
            Some(error) => Err(error),
            None => Ok(()),
        }
    }

    pub async fn try_acquire(
        &self,
        key: &str,
        session_id: Uuid,
        owner_id: &str,
        ttl_ms: i64,
        ticket: Option<&WaiterTicket>,
    ) -> StoreResult<Acquire> {
        let waiter = ticket.map(|t| t.id);
        let row = call!(
            &self.pool,
            "dlock_acquire($1, $2, $3, $4, $5)",
            key,
            session_id,
            owner_id,
            ttl_ms as i32,
            waiter
        )?;
        match row.outcome()? {
            "granted" => Ok(Acquire::Granted(row.grant(key)?)),
            "contended" => Ok(Acquire::Contended(row.contention())),
            other => Err(session_outcome(other)
                .unwrap_or_else(|| StoreError::Backend(format!("unexpected outcome {other}")))),
        }
    }

    pub async fn enqueue(
        &self,
        key: &str,
        session_id: Uuid,
        owner_id: &str,
        deadline_ms: i64,
        bounds: QueueBounds,
    ) -> StoreResult<WaiterTicket> {
        let id = Uuid::new_v4();
        let row = call!(
            &self.pool,
            "dlock_enqueue($1, $2, $3, $4, $5, $6, $7)",
            key,
            session_id,
            owner_id,
            id,
            deadline_ms as i32,
            bounds.per_key as i32,
            bounds.per_session as i32
        )?;
        match row.outcome()? {
            "queued" => Ok(WaiterTicket {
                id,
                key: key.to_owned(),
                lease: None,
            }),
            "queue_full" => Err(StoreError::QueueFull {
                waiter_count: row.waiter_count.unwrap_or(bounds.per_key),
            }),
            "session_share" => Err(StoreError::SessionShareFull {
                waiter_count: row.waiter_count.unwrap_or_default(),
                share: bounds.per_session,
            }),
            other => Err(session_outcome(other)
                .unwrap_or_else(|| StoreError::Backend(format!("unexpected outcome {other}")))),
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

    pub async fn renew(
        &self,
        key: &str,
        session_id: Uuid,
        owner_id: &str,
        token: i64,
        ttl_ms: Option<i64>,
    ) -> StoreResult<LockGrant> {
        let row = call!(
            &self.pool,
            "dlock_renew($1, $2, $3, $4, $5)",
            key,
            session_id,
            owner_id,
            token,
            ttl_ms.map(|t| t as i32)
        )?;
        match row.outcome()? {
            "renewed" => row.grant(key),
            "lock_lost" => Err(StoreError::LockLost {
                stored_token: row.fencing_token,
            }),
            other => Err(session_outcome(other)
                .unwrap_or_else(|| StoreError::Backend(format!("unexpected outcome {other}")))),
        }
    }

    pub async fn release(&self, key: &str, owner_id: &str, token: i64) -> StoreResult<()> {
        let row = call!(
            &self.pool,
            "dlock_release($1, $2, $3)",
            key,
            token,
            owner_id
        )?;
        match row.outcome()? {
            "released" => Ok(()),
            _ => Err(StoreError::LockLost {
                stored_token: row.fencing_token,
            }),
        }
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
        Ok(Some(LockInfo {
            key: key.to_owned(),
            held: row.fencing_token.is_some(),
            owner_id: row.owner_id,
            session_id: row.session_id,
            fencing_token: row.fencing_token,
            acquired_at: row.acquired_at,
            expires_at: row.expires_at,
            waiter_count: row.waiter_count.unwrap_or(0),
        }))
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
        let truncated = rows.len() as i64 > limit;
        let items = rows
            .into_iter()
            .take(limit as usize)
            .map(
                |(key, owner_id, session_id, fencing_token, acquired_at, expires_at)| LockGrant {
                    key,
                    owner_id,
                    session_id,
                    fencing_token,
                    acquired_at,
                    expires_at,
                    // Never in a list: the proof is for the holder alone (DESIGN D-8).
                    fencing_proof: None,
                },
            )
            .collect();
        Ok(HeldLocks { items, truncated })
    }

    pub async fn revoke(
        &self,
        key: &str,
        expected_token: Option<i64>,
        operator: &str,
        reason: &str,
        caller: Option<&str>,
    ) -> StoreResult<Revocation> {
        let revocation_id = Uuid::new_v4();
        let row = call!(
            &self.pool,
            "dlock_revoke($1, $2, $3, $4, $5, $6)",
            key,
            expected_token,
            operator,
            reason,
            revocation_id,
            caller
        )?;
        match row.outcome()? {
            "revoked" => Ok(Revocation {
                key: key.to_owned(),
                revoked_token: row.fencing_token.ok_or_else(|| missing("token"))?,
                revoked_owner_id: row.owner_id.clone().ok_or_else(|| missing("owner"))?,
                new_token_floor: row.waiter_count.ok_or_else(|| missing("floor"))?,
                revocation_id,
                operator: operator.to_owned(),
                reason: reason.to_owned(),
                revoked_at: row.server_time.ok_or_else(|| missing("time"))?,
            }),
            "not_held" => Err(StoreError::NotHeld),
            "fenced_out" => Err(StoreError::FencedOut {
                expected: expected_token.unwrap_or_default(),
                stored: row.fencing_token.unwrap_or_default(),
                owner_id: row.owner_id.unwrap_or_default(),
            }),
            other => Err(StoreError::Backend(format!("unexpected outcome {other}"))),
        }
    }

    /// Ready when the database answers and takes writes (it is a primary, not in recovery).
    pub async fn ready(&self) -> StoreResult<()> {
        let (in_recovery,): (bool,) = sqlx::query_as("SELECT pg_is_in_recovery()")
            .fetch_one(&self.pool)
            .await
            .map_err(map_sqlx)?;
        if in_recovery {
            return Err(StoreError::NotLeader(
                "lockdb is in recovery (a standby)".into(),
            ));
        }
        Ok(())
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
