//! The two lock stores. They answer identically (FR-09); only how they keep the state differs.

pub mod etcd;
pub mod etcd_conn;
pub mod pg;

use chrono::{DateTime, Utc};
use dlock_contract::lock::{Heartbeat, HeldLocks, LockGrant, LockInfo, Revocation, Session};
use uuid::Uuid;

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum StoreError {
    #[error("no such session")]
    SessionUnknown,
    #[error("the session expired")]
    SessionExpired,
    #[error("the grant is no longer live")]
    LockLost { stored_token: Option<i64> },
    #[error("the key is not held")]
    NotHeld,
    #[error("expected token {expected} but the live grant has {stored}")]
    FencedOut {
        expected: i64,
        stored: i64,
        owner_id: String,
    },
    #[error("the waiter queue is full")]
    QueueFull { waiter_count: i64 },
    /// The session already has its share of the key's waiter queue
    /// (`lock.waiters.max-per-session`).
    #[error("the session already waits for this key")]
    SessionShareFull { waiter_count: i64, share: i64 },
    /// The backend cannot take writes here: a PostgreSQL replica in recovery or unreachable, an
    /// etcd cluster without a leader or quorum. Nothing was changed.
    #[error("the backend is not available for writes: {0}")]
    NotLeader(String),
    #[error("backend failure: {0}")]
    Backend(String),
}

pub type StoreResult<T> = Result<T, StoreError>;

/// Who holds a contended key, for the 409 body.
#[derive(Debug, Clone, PartialEq)]
pub struct Contention {
    pub holder_owner_id: Option<String>,
    pub expires_at: Option<DateTime<Utc>>,
    pub waiter_count: i64,
}

#[derive(Debug, Clone, PartialEq)]
pub enum Acquire {
    Granted(LockGrant),
    Contended(Contention),
}

/// How many places a key's waiter queue has, and how many of them one session may take.
#[derive(Debug, Clone, Copy)]
pub struct QueueBounds {
    /// `lock.waiters.max-per-key`.
    pub per_key: i64,
    /// `lock.waiters.max-per-session`: a session's share of one key's queue.
    pub per_session: i64,
}

/// What a sweep may remove.
#[derive(Debug, Clone, Copy)]
pub struct SweepRetention {
    /// `lock.session.expired-retention`: expired sessions older than this go.
    pub expired_sessions_ms: i64,
    /// `lock.keys-seen.retention`: a key not granted for this long, held by nobody and waited
    /// for by nobody, is forgotten (L7 answers 404 for it again). Tokens are unaffected: they
    /// come from one global sequence (pg) or the global revision (etcd), never from this record.
    pub keys_seen_ms: i64,
}

/// A place in a key's FIFO queue.
#[derive(Debug, Clone)]
pub struct WaiterTicket {
    pub id: Uuid,
    pub key: String,
    /// etcd: the lease the waiter key lives on.
    pub lease: Option<i64>,
}

#[derive(Clone)]
pub enum Store {
    Pg(pg::PgStore),
    Etcd(Box<etcd::EtcdStore>),
}

macro_rules! dispatch {
    ($self:ident, $store:ident => $call:expr) => {
        match $self {
            Store::Pg($store) => $call,
            Store::Etcd($store) => $call,
        }
    };
}

impl Store {
    pub fn backend_name(&self) -> &'static str {
        match self {
            Store::Pg(_) => "pg",
            Store::Etcd(_) => "etcd",
        }
    }

    pub async fn create_session(&self, owner_id: &str, ttl_ms: i64) -> StoreResult<Session> {
        dispatch!(self, s => s.create_session(owner_id, ttl_ms).await)
    }

    pub async fn heartbeat(&self, session_id: Uuid, owner_id: &str) -> StoreResult<Heartbeat> {
        dispatch!(self, s => s.heartbeat(session_id, owner_id).await)
    }

    pub async fn end_session(&self, session_id: Uuid, owner_id: &str) -> StoreResult<()> {
        dispatch!(self, s => s.end_session(session_id, owner_id).await)
    }

    pub async fn try_acquire(
        &self,
        key: &str,
        session_id: Uuid,
        owner_id: &str,
        ttl_ms: i64,
        ticket: Option<&WaiterTicket>,
    ) -> StoreResult<Acquire> {
        dispatch!(self, s => s.try_acquire(key, session_id, owner_id, ttl_ms, ticket).await)
    }

    pub async fn enqueue(
        &self,
        key: &str,
        session_id: Uuid,
        owner_id: &str,
        deadline_ms: i64,
        bounds: QueueBounds,
    ) -> StoreResult<WaiterTicket> {
        dispatch!(self, s => s.enqueue(key, session_id, owner_id, deadline_ms, bounds).await)
    }

    pub async fn dequeue(&self, ticket: &WaiterTicket) -> StoreResult<()> {
        dispatch!(self, s => s.dequeue(ticket).await)
    }

    pub async fn renew(
        &self,
        key: &str,
        session_id: Uuid,
        owner_id: &str,
        token: i64,
        ttl_ms: Option<i64>,
    ) -> StoreResult<LockGrant> {
        dispatch!(self, s => s.renew(key, session_id, owner_id, token, ttl_ms).await)
    }

    /// L6: compare-and-delete on (key, token), by the grant's owner only.
    pub async fn release(&self, key: &str, owner_id: &str, token: i64) -> StoreResult<()> {
        dispatch!(self, s => s.release(key, owner_id, token).await)
    }

    pub async fn lock_info(&self, key: &str) -> StoreResult<Option<LockInfo>> {
        dispatch!(self, s => s.lock_info(key).await)
    }

    pub async fn held(&self, limit: i64) -> StoreResult<HeldLocks> {
        dispatch!(self, s => s.held(limit).await)
    }

    pub async fn revoke(
        &self,
        key: &str,
        expected_token: Option<i64>,
        operator: &str,
        reason: &str,
        caller: Option<&str>,
    ) -> StoreResult<Revocation> {
        dispatch!(self, s => s.revoke(key, expected_token, operator, reason, caller).await)
    }

    pub async fn ready(&self) -> StoreResult<()> {
        dispatch!(self, s => s.ready().await)
    }

    /// Physical clean-up; correctness never waits for it.
    pub async fn sweep(&self, retention: &SweepRetention) -> StoreResult<u64> {
        dispatch!(self, s => s.sweep(retention).await)
    }
}
