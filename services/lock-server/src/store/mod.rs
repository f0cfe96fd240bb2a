//! The two lock stores. They answer identically (docs/design.md#lock-backends); only how they keep
//! the state differs.

pub mod etcd;
pub mod etcd_conn;
pub mod pg;
pub mod pg_batch;

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
    /// The write was sent to the backend and no answer came back (a timeout, a connection cut
    /// after the send): it may or may not have taken effect (docs/contract.md#outcome-unknown).
    /// Never NOT_LEADER, which promises that nothing was changed.
    #[error("the backend's answer to a write never came: {0}")]
    OutcomeUnknown(String),
    /// etcd's revision is below the high-water of the tokens already answered: etcd was
    /// restored to an older revision (docs/design.md#d-12-etcd). Nothing was granted; grants
    /// resume once etcd's revision passes `high_water`.
    #[error(
        "etcd's revision {revision} went back below the tokens already issued (up to {high_water})"
    )]
    RevisionBehind { revision: i64, high_water: i64 },
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

/// How many places a key's waiter queue has, how many of them one session may take, and how
/// long a place lasts.
#[derive(Debug, Clone, Copy)]
pub struct QueueBounds {
    /// The wait plus a margin: a replica that dies mid-wait leaves a place that lapses by itself.
    pub place_ms: i64,
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

/// A session's claim on a key: who asks for an acquire, a place in the queue, or a renew.
#[derive(Debug, Clone, Copy)]
pub struct Claim<'a> {
    pub key: &'a str,
    pub session_id: Uuid,
    pub owner_id: &'a str,
}

/// One acquire attempt: `ticket` is the claim's place in the queue, once it has one.
#[derive(Debug, Clone, Copy)]
pub struct Attempt<'a> {
    pub claim: Claim<'a>,
    pub ttl_ms: i64,
    pub ticket: Option<&'a WaiterTicket>,
}

/// L5: extend the grant (key, token) held by the claim; no TTL keeps the grant's own.
#[derive(Debug, Clone, Copy)]
pub struct Renewal<'a> {
    pub claim: Claim<'a>,
    pub token: i64,
    pub ttl_ms: Option<i64>,
}

/// An L8 order: end the grant on `key` (the one with `expected_token`, when given).
#[derive(Debug, Clone, Copy)]
pub struct RevokeOrder<'a> {
    pub key: &'a str,
    pub expected_token: Option<i64>,
    pub operator: &'a str,
    pub reason: &'a str,
    /// The identity the auth layer authenticated; none with `auth.mode = none`.
    pub caller: Option<&'a str>,
}

/// What ended a grant, as both backends record it.
#[derive(Debug, Clone)]
pub struct Revoked {
    pub token: i64,
    pub owner_id: String,
    pub new_token_floor: i64,
    pub revocation_id: Uuid,
    pub revoked_at: DateTime<Utc>,
}

impl RevokeOrder<'_> {
    /// FENCED_OUT when the order names another grant than the live one (`stored`).
    pub fn fenced_out(&self, stored: i64, owner_id: String) -> StoreError {
        StoreError::FencedOut {
            expected: self.expected_token.unwrap_or_default(),
            stored,
            owner_id,
        }
    }

    /// Passes when the order names no token or the live grant's.
    pub fn check_token(&self, stored: i64, owner_id: &str) -> StoreResult<()> {
        match self.expected_token {
            Some(expected) if expected != stored => Err(self.fenced_out(stored, owner_id.into())),
            _ => Ok(()),
        }
    }

    /// The L8 answer for a grant this order ended.
    pub fn revocation(&self, revoked: Revoked) -> Revocation {
        Revocation {
            key: self.key.to_owned(),
            revoked_token: revoked.token,
            revoked_owner_id: revoked.owner_id,
            new_token_floor: revoked.new_token_floor,
            revocation_id: revoked.revocation_id,
            operator: self.operator.to_owned(),
            reason: self.reason.to_owned(),
            revoked_at: revoked.revoked_at,
        }
    }
}

/// The L7 answer: `holder` is the live grant, if any. The proof is never part of it.
pub fn lock_info(key: &str, holder: Option<LockGrant>, waiter_count: i64) -> LockInfo {
    LockInfo {
        key: key.to_owned(),
        held: holder.is_some(),
        owner_id: holder.as_ref().map(|g| g.owner_id.clone()),
        session_id: holder.as_ref().map(|g| g.session_id),
        fencing_token: holder.as_ref().map(|g| g.fencing_token),
        acquired_at: holder.as_ref().map(|g| g.acquired_at),
        expires_at: holder.map(|g| g.expires_at),
        waiter_count,
    }
}

/// The held-locks list: at most `limit` grants, and whether there were more. Never with a proof:
/// the proof is for the holder alone (docs/design.md#d-8).
pub fn held_page(mut items: Vec<LockGrant>, limit: i64) -> HeldLocks {
    let truncated = items.len() as i64 > limit;
    items.truncate(limit as usize);
    for grant in &mut items {
        grant.fencing_proof = None;
    }
    HeldLocks { items, truncated }
}

#[derive(Clone)]
pub enum Store {
    Pg(pg::PgStore),
    Etcd(Box<etcd::EtcdStore>),
}

/// The operations of both backends, each answered by the one configured.
macro_rules! dispatch {
    ($($(#[$doc:meta])* fn $name:ident($($arg:ident: $ty:ty),*) -> $out:ty;)*) => {
        impl Store {
            $(
                $(#[$doc])*
                pub async fn $name(&self, $($arg: $ty),*) -> StoreResult<$out> {
                    match self {
                        Store::Pg(store) => store.$name($($arg),*).await,
                        Store::Etcd(store) => store.$name($($arg),*).await,
                    }
                }
            )*
        }
    };
}

dispatch! {
    fn create_session(owner_id: &str, ttl_ms: i64) -> Session;
    fn heartbeat(session_id: Uuid, owner_id: &str) -> Heartbeat;
    fn end_session(session_id: Uuid, owner_id: &str) -> ();
    fn try_acquire(attempt: &Attempt<'_>) -> Acquire;
    fn enqueue(claim: Claim<'_>, bounds: QueueBounds) -> WaiterTicket;
    fn dequeue(ticket: &WaiterTicket) -> ();
    fn renew(renewal: &Renewal<'_>) -> LockGrant;
    /// L6: compare-and-delete on (key, token), by the grant's owner only.
    fn release(key: &str, owner_id: &str, token: i64) -> ();
    fn lock_info(key: &str) -> Option<LockInfo>;
    fn held(limit: i64) -> HeldLocks;
    fn revoke(order: &RevokeOrder<'_>) -> Revocation;
    fn ready() -> ();
    /// Physical clean-up; correctness never waits for it.
    fn sweep(retention: &SweepRetention) -> u64;
}

impl Store {
    /// The `pg` store's group commit metrics (docs/design.md#group-commit), when it groups.
    pub fn batch_metrics(&self) -> Option<crate::metrics::BatchMetrics> {
        match self {
            Store::Pg(store) => store.batch_metrics(),
            Store::Etcd(_) => None,
        }
    }

    /// The `etcd` store's refusals while etcd is behind its high-water
    /// (docs/design.md#d-12-etcd), when it keeps one.
    pub fn etcd_metrics(&self) -> Option<crate::metrics::EtcdMetrics> {
        match self {
            Store::Pg(_) => None,
            Store::Etcd(store) => store.etcd_metrics(),
        }
    }

    pub fn backend_name(&self) -> &'static str {
        match self {
            Store::Pg(_) => "pg",
            Store::Etcd(_) => "etcd",
        }
    }
}
