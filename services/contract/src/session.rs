//! A lock-server session kept alive, and the locks held under it, in the shape of etcd's
//! `concurrency` package: a [`LockSession`] owns a heartbeat task and says when its liveness is
//! lost; [`LockSession::acquire`] gives a [`HeldLock`] carrying the fencing token, its proof and
//! the local deadline after which no protected write may start (docs/contract.md#client-deadline,
//! docs/design.md#executor).
//!
//! Everything here follows what the lock server *granted*, never what was asked for: the server
//! clamps TTLs down (`lock.ttl-max`, `lock.session.ttl-max`), and a heartbeat period or a deadline
//! computed from the requested TTL would outlive the real lease. Times are on this process's
//! monotonic clock, counted from *sending* the request that set them, so they never err late.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use backon::{BackoffBuilder, ExponentialBuilder, Retryable};
use tokio::sync::{RwLock, watch};
use uuid::Uuid;

use crate::client::{ClientError, LockClient};
use crate::error::ErrorCode;
use crate::lock::{LockGrant, Session};

/// Jittered exponential backoff, 50 ms to 1 s (docs/contract.md#s3-8), for calls that are
/// retry-safe.
pub fn retry_policy(times: usize) -> ExponentialBuilder {
    ExponentialBuilder::default()
        .with_min_delay(Duration::from_millis(50))
        .with_max_delay(Duration::from_secs(1))
        .with_jitter()
        .with_max_times(times)
}

/// The session as last granted: its id, its TTL and when it lapses on this process's clock.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Liveness {
    pub id: Uuid,
    pub ttl_ms: i64,
    pub expires: Instant,
}

impl Liveness {
    fn opened(session: &Session, sent: Instant) -> Self {
        let ttl_ms = session.ttl_millis.max(0);
        Self {
            id: session.session_id,
            ttl_ms,
            expires: sent + Duration::from_millis(ttl_ms.unsigned_abs()),
        }
    }
}

struct Inner {
    lock: LockClient,
    /// The TTL asked for when a session is (re-)opened.
    requested_ttl_ms: i64,
    current: RwLock<Liveness>,
    /// Counts the sessions lost so far; a receiver sees each loss.
    lost: watch::Sender<u64>,
    /// The (key, token) of every [`HeldLock`] handed out and not yet released: what tells an
    /// acquire whose outcome is unknown from a lock another worker of this session holds.
    held: Held,
}

/// The grants a session's locks carry, shared with each [`HeldLock`].
type Held = Arc<Mutex<HashSet<(String, i64)>>>;

fn held_set(held: &Held) -> std::sync::MutexGuard<'_, HashSet<(String, i64)>> {
    held.lock().unwrap_or_else(|e| e.into_inner())
}

/// A lock-server session kept alive by heartbeats every third of the granted TTL (two tries
/// within that third, docs/contract.md#s3-8). When the server says the session lapsed, its locks
/// are gone: [`LockSession::lost`] fires, the lapse is immediate for every [`HeldLock`] under it,
/// and a new session is opened for later acquires. Dropping it stops the heartbeats;
/// [`LockSession::close`] also ends the session at the server.
pub struct LockSession {
    inner: Arc<Inner>,
    keeper: tokio::task::JoinHandle<()>,
}

impl Drop for LockSession {
    fn drop(&mut self) {
        self.keeper.abort();
    }
}

impl LockSession {
    /// Opens a session (retrying what is retry-safe, 5 times) and starts its heartbeats.
    pub async fn open(lock: LockClient, ttl_ms: i64) -> Result<Self, ClientError> {
        let (session, sent) = create(&lock, ttl_ms).await?;
        let inner = Arc::new(Inner {
            lock,
            requested_ttl_ms: ttl_ms,
            current: RwLock::new(Liveness::opened(&session, sent)),
            lost: watch::Sender::new(0),
            held: Held::default(),
        });
        let keeper = tokio::spawn(keep_alive(inner.clone()));
        Ok(Self { inner, keeper })
    }

    /// The session as last granted.
    pub async fn liveness(&self) -> Liveness {
        *self.inner.current.read().await
    }

    pub async fn id(&self) -> Uuid {
        self.inner.current.read().await.id
    }

    /// Changes each time a session is lost (its value counts the losses).
    pub fn lost(&self) -> watch::Receiver<u64> {
        self.inner.lost.subscribe()
    }

    /// Acquires `key` under this session through `lock` (the caller's client, e.g. one in a
    /// trace), retrying what is retry-safe 5 times. The deadline counts from sending the acquire
    /// that succeeded and keeps `1 − safety_margin` of the granted lease.
    ///
    /// An acquire whose outcome is unknown (`503 OUTCOME_UNKNOWN`, no answer) is never resent
    /// blindly: the key is read (L7) first. Held by this session under a token no lock of this
    /// session carries, it is that acquire's grant, whose proof never arrived: it is released
    /// (a compare-and-delete on its token, which can end no other grant) and the acquire sent
    /// again. Not held by this session, nothing of it stands and the acquire is sent again. When
    /// the key cannot be read, the unknown outcome is the answer
    /// (docs/contract.md#outcome-unknown).
    pub async fn acquire(
        &self,
        lock: &LockClient,
        key: &str,
        ttl_ms: i64,
        wait_ms: Option<i64>,
        safety_margin: f64,
    ) -> Result<HeldLock, ClientError> {
        let session = self.id().await;
        let mut backoff = retry_policy(5).build();
        loop {
            let sent = Instant::now();
            let error = match lock.acquire(key, session, Some(ttl_ms), wait_ms).await {
                Ok(grant) => {
                    held_set(&self.inner.held).insert((key.to_owned(), grant.fencing_token));
                    let deadline =
                        local_deadline(sent, &grant, self.liveness().await, safety_margin);
                    return Ok(HeldLock {
                        grant,
                        deadline,
                        held: self.inner.held.clone(),
                    });
                }
                Err(e) => e,
            };
            if error.outcome_unknown() {
                self.settle_acquire(lock, key, session, &error).await?;
            } else if !error.retry_safe() {
                return Err(error);
            }
            match backoff.next() {
                Some(wait) => tokio::time::sleep(wait).await,
                None => return Err(error),
            }
        }
    }

    /// After an acquire of `key` whose outcome is unknown: ends the grant it may have made (see
    /// [`LockSession::acquire`]); `Err(error)` when the key cannot be read or that grant cannot
    /// be ended.
    async fn settle_acquire(
        &self,
        lock: &LockClient,
        key: &str,
        session: Uuid,
        error: &ClientError,
    ) -> Result<(), ClientError> {
        let Ok(holding) = lock.held_by(key, session).await else {
            return Err(error.clone());
        };
        let Some(token) = holding else {
            return Ok(());
        };
        if held_set(&self.inner.held).contains(&(key.to_owned(), token)) {
            // Another worker of this session holds it: the acquire made nothing.
            return Ok(());
        }
        tracing::warn!(
            event = "acquire_outcome_settled",
            key,
            token,
            error = %error,
            "an acquire whose answer never came did take the lock; ending that grant (its proof never arrived) and acquiring again"
        );
        match lock.release(key, session, token).await {
            Ok(()) => Ok(()),
            Err(e) if e.code() == Some(ErrorCode::LockLost) => Ok(()),
            Err(_) => Err(error.clone()),
        }
    }

    /// Stops the heartbeats and ends the session at the server (its locks are released).
    pub async fn close(self) -> Result<(), ClientError> {
        self.keeper.abort();
        let id = self.id().await;
        match self.inner.lock.end_session(id).await {
            // Sent once more: it ends the session, or says the first one did.
            Err(e) if e.outcome_unknown() => match self.inner.lock.end_session(id).await {
                Err(again)
                    if matches!(
                        again.code(),
                        Some(ErrorCode::SessionUnknown | ErrorCode::SessionExpired)
                    ) =>
                {
                    Ok(())
                }
                other => other,
            },
            other => other,
        }
    }
}

/// A lock held under a [`LockSession`]: the grant (token, proof) and the local deadline.
#[derive(Debug, Clone)]
pub struct HeldLock {
    pub grant: LockGrant,
    /// No protected write may start at or after this instant.
    pub deadline: Instant,
    /// The session's record of its locks, which a release leaves.
    held: Held,
}

impl HeldLock {
    pub fn token(&self) -> i64 {
        self.grant.fencing_token
    }

    /// The lock server's proof of the token (docs/design.md#d-8), when it has proof keys.
    pub fn proof(&self) -> Option<&str> {
        self.grant.fencing_proof.as_deref()
    }

    pub fn past_deadline(&self) -> bool {
        Instant::now() >= self.deadline
    }

    /// Releases the lock; if that fails the lease lapses by itself. A release whose outcome is
    /// unknown is settled by reading the key (L7): still held under this token, it is sent once
    /// more (a compare-and-delete on the token, which can end no other grant); not, it is done.
    pub async fn release(&self, lock: &LockClient) -> Result<(), ClientError> {
        let (key, session, token) = (
            &self.grant.key,
            self.grant.session_id,
            self.grant.fencing_token,
        );
        let result = match lock.release(key, session, token).await {
            Err(e) if e.outcome_unknown() => match lock.get(key).await {
                Ok(info) if info.held && info.fencing_token == Some(token) => {
                    lock.release(key, session, token).await
                }
                Ok(_) => Ok(()),
                Err(_) => Err(e),
            },
            other => other,
        };
        held_set(&self.held).remove(&(key.clone(), token));
        result
    }
}

/// The local deadline of a grant: TTL × (1 − margin) counted from `sent`. The TTL is what the
/// server granted (`expiresAt − acquiredAt`, both on the server's clock, so no clock offset
/// enters), and the lease is cut at the session's expiry when that comes first. A grant on a
/// session other than the current one (lost while acquiring) has no time at all.
pub fn local_deadline(sent: Instant, grant: &LockGrant, session: Liveness, margin: f64) -> Instant {
    let granted_ms = (grant.expires_at - grant.acquired_at)
        .num_milliseconds()
        .max(0);
    let mut lease_end = sent + Duration::from_millis(granted_ms.unsigned_abs());
    if session.id == grant.session_id {
        lease_end = lease_end.min(session.expires);
    } else {
        lease_end = sent;
    }
    let keep = (1.0 - margin).clamp(0.0, 1.0);
    sent + lease_end.saturating_duration_since(sent).mul_f64(keep)
}

async fn create(lock: &LockClient, ttl_ms: i64) -> Result<(Session, Instant), ClientError> {
    let sent = std::sync::Mutex::new(Instant::now());
    let session = (|| {
        *sent.lock().unwrap_or_else(|e| e.into_inner()) = Instant::now();
        lock.create_session(Some(ttl_ms))
    })
    .retry(retry_policy(5))
    // A session whose opening has an unknown outcome holds nothing and lapses by its TTL: opening
    // another is safe.
    .when(|e: &ClientError| e.retry_safe() || e.code() == Some(ErrorCode::OutcomeUnknown))
    .await?;
    let sent = *sent.lock().unwrap_or_else(|e| e.into_inner());
    Ok((session, sent))
}

async fn keep_alive(inner: Arc<Inner>) {
    loop {
        let session = *inner.current.read().await;
        let every = Duration::from_millis((session.ttl_ms / 3).max(100).unsigned_abs());
        tokio::time::sleep(every).await;
        let id = session.id;
        let mut sent = Instant::now();
        let mut beat = inner.lock.heartbeat(id).await;
        if matches!(&beat, Err(e) if e.code().is_none()) {
            tokio::time::sleep(every / 4).await;
            sent = Instant::now();
            beat = inner.lock.heartbeat(id).await;
        }
        match beat {
            Ok(beat) => {
                // The server's own expiry, as a span from its own clock: no clock offset.
                let left = (beat.expires_at - beat.server_time)
                    .num_milliseconds()
                    .clamp(0, session.ttl_ms);
                let mut current = inner.current.write().await;
                if current.id == id {
                    current.expires = sent + Duration::from_millis(left.unsigned_abs());
                }
            }
            Err(e)
                if matches!(
                    e.code(),
                    Some(ErrorCode::SessionExpired | ErrorCode::SessionUnknown)
                ) =>
            {
                tracing::warn!(event = "session_lost", session_id = %id, error = %e, "the session lapsed; its locks are gone, opening a new one");
                {
                    // Its locks are gone: no holder may count on it any more.
                    let mut current = inner.current.write().await;
                    if current.id == id {
                        current.expires = Instant::now();
                    }
                }
                inner.lost.send_modify(|n| *n += 1);
                match create(&inner.lock, inner.requested_ttl_ms).await {
                    Ok((session, sent)) => {
                        *inner.current.write().await = Liveness::opened(&session, sent);
                    }
                    Err(e) => {
                        tracing::warn!(event = "session_reopen_failed", error = %e, "no new session yet; the next heartbeat tries again");
                    }
                }
            }
            Err(e) => {
                tracing::debug!(event = "heartbeat_failed", session_id = %id, error = %e, "no verdict on the heartbeat; the next one tries again");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::{TimeZone, Utc};

    fn grant(session: Uuid, ttl_ms: i64) -> LockGrant {
        let at = Utc.timestamp_millis_opt(1_700_000_000_000).unwrap();
        LockGrant {
            key: "payout:a".into(),
            owner_id: "o".into(),
            session_id: session,
            fencing_token: 7,
            acquired_at: at,
            expires_at: at + chrono::Duration::milliseconds(ttl_ms),
            fencing_proof: None,
        }
    }

    #[test]
    fn the_deadline_keeps_the_granted_share_and_ends_with_the_session() {
        let sent = Instant::now();
        let id = Uuid::new_v4();
        let long = Liveness {
            id,
            ttl_ms: 60_000,
            expires: sent + Duration::from_secs(60),
        };
        // The granted 10 s, not whatever was asked for, less 30 %.
        let d = local_deadline(sent, &grant(id, 10_000), long, 0.30);
        assert_eq!(d - sent, Duration::from_millis(7_000));
        // A session lapsing in 4 s cuts the lease there.
        let short = Liveness {
            expires: sent + Duration::from_secs(4),
            ..long
        };
        let d = local_deadline(sent, &grant(id, 10_000), short, 0.30);
        assert_eq!(d - sent, Duration::from_millis(2_800));
        // A grant on a session that is no longer current has no time at all.
        let d = local_deadline(sent, &grant(Uuid::new_v4(), 10_000), long, 0.30);
        assert_eq!(d, sent);
        // Nonsense margins and an expiry before the acquire never panic or extend the lease.
        assert_eq!(local_deadline(sent, &grant(id, -5), long, 0.30), sent);
        assert_eq!(
            local_deadline(sent, &grant(id, 10_000), long, -1.0) - sent,
            Duration::from_secs(10)
        );
    }
}
