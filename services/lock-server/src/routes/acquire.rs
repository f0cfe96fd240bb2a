//! L4 acquire: one attempt, then (with waitMillis) a place in the key's FIFO queue.

use std::time::{Duration, Instant};

use axum::extract::State;
use dlock_contract::error::{ApiError, ErrorBody, ErrorCode, FieldError};
use dlock_contract::headers;
use dlock_contract::json::Json;
use dlock_contract::lock::*;
use dlock_server::extract::PathWrite;
use dlock_server::openapi::{Invalid, NotLeader, Unauthorized};
use uuid::Uuid;

use super::AppState;
use super::checks::{Checks, lock_ttl, path_key, present};
use super::errors::{contended, store_error};
use crate::metrics::AcquireOutcome;
use crate::openapi::SessionGone;
use crate::store::{Acquire, Attempt, Claim, QueueBounds, StoreError, WaiterTicket};

/// L4: acquire a lock, optionally waiting in the key's FIFO queue.
#[utoipa::path(post, path = "/v1/locks/{key}/acquire", request_body = AcquireRequest,
    params(("key" = String, Path, description = "1–128 of [a-zA-Z0-9:._-]"), ("X-Owner-Id" = String, Header)),
    responses((status = 200, body = LockGrant), Invalid, Unauthorized, SessionGone, NotLeader,
        (status = 409, description = "LOCK_CONTENDED", body = ErrorBody),
        (status = 429, description = "CONTENTION_EXCEEDED: the key's waiter queue is full, or this session already has its share of it (lock.waiters.max-per-session)", body = ErrorBody),
    ))]
pub(super) async fn acquire(
    State(state): State<AppState>,
    PathWrite((), key, headers, body): PathWrite<AcquireRequest>,
) -> Result<Json<LockGrant>, ApiError> {
    let started = Instant::now();
    let mut checks = Checks::default();
    checks.take(path_key(&key));
    let owner = checks.take(headers::owner_id(&headers));
    let ttl_ms = checks.take(lock_ttl(&state.config, body.ttl_millis));
    let wait_ms = checks.take(match body.wait_millis {
        None => Ok(0),
        Some(w) if (0..=WAIT_MS_MAX).contains(&w) => Ok(w),
        Some(w) => Err(FieldError::new(
            "waitMillis",
            format!("must be between 0 and {WAIT_MS_MAX} milliseconds, got {w}"),
        )),
    });
    checks.done()?;
    let (owner, ttl_ms, wait_ms) = (present(owner)?, present(ttl_ms)?, present(wait_ms)?);
    let outcome = acquire_waiting(&state, &key, body.session_id, &owner, ttl_ms, wait_ms).await;
    let label = match &outcome {
        Ok(_) => AcquireOutcome::granted,
        Err((label, _)) => *label,
    };
    state
        .metrics
        .observe_acquire(label, started.elapsed().as_secs_f64());
    match outcome {
        Ok(grant) => {
            tracing::debug!(event = "lock_granted", key = %key, owner_id = %owner, token = grant.fencing_token, "lock granted");
            Ok(Json(state.proven(grant)))
        }
        Err((_, error)) => Err(error),
    }
}

type AcquireFailure = (AcquireOutcome, ApiError);

fn claim<'a>(key: &'a str, session_id: Uuid, owner_id: &'a str) -> Claim<'a> {
    Claim {
        key,
        session_id,
        owner_id,
    }
}

fn attempt<'a>(
    key: &'a str,
    session_id: Uuid,
    owner_id: &'a str,
    ttl_ms: i64,
    ticket: Option<&'a WaiterTicket>,
) -> Attempt<'a> {
    Attempt {
        claim: claim(key, session_id, owner_id),
        ttl_ms,
        ticket,
    }
}

/// A store refusal during an acquire, with its metrics label; a full queue says when to retry.
fn failure(state: &AppState, key: &str, e: StoreError) -> AcquireFailure {
    let label = match e {
        StoreError::QueueFull { .. } | StoreError::SessionShareFull { .. } => {
            AcquireOutcome::queue_full
        }
        _ => AcquireOutcome::error,
    };
    let mut error = store_error(e, Some(key));
    if error.code == ErrorCode::ContentionExceeded {
        error = error.with_retry_after_ms(state.config.contention_retry_after_ms);
    }
    (label, error)
}

/// One attempt, then (when the caller may wait) a place in the key's FIFO queue and further
/// attempts until the lock is granted or the wait runs out.
async fn acquire_waiting(
    state: &AppState,
    key: &str,
    session_id: Uuid,
    owner: &str,
    ttl_ms: i64,
    wait_ms: i64,
) -> Result<LockGrant, AcquireFailure> {
    let first = state
        .store
        .try_acquire(&attempt(key, session_id, owner, ttl_ms, None))
        .await
        .map_err(|e| failure(state, key, e))?;
    match first {
        Acquire::Granted(grant) => return Ok(grant),
        Acquire::Contended(c) if wait_ms == 0 => {
            return Err((AcquireOutcome::contended, contended(key, c)));
        }
        Acquire::Contended(_) => {}
    }
    let deadline = Instant::now() + Duration::from_millis(wait_ms as u64);
    let ticket = join_queue(state, key, session_id, owner, wait_ms).await?;
    // From here the place is given up however the wait ends, including when this future is
    // dropped because the client hung up: a cancelled waiter must not stay at the head. (No
    // await between receiving the ticket and this line, so no cancellation in between.)
    let place = QueuePlace::new(state.clone(), ticket);
    let result = wait_for_grant(state, key, session_id, owner, ttl_ms, deadline, &place).await;
    match &result {
        // The grant removed the queue entry in the same transaction.
        Ok(_) => place.granted(),
        Err(_) => place.leave().await,
    }
    result
}

/// Takes a place in the key's queue, within the per-key and per-session bounds.
async fn join_queue(
    state: &AppState,
    key: &str,
    session_id: Uuid,
    owner: &str,
    wait_ms: i64,
) -> Result<WaiterTicket, AcquireFailure> {
    // The queue entry outlives the wait a little, so a replica that dies mid-wait leaves an
    // entry that lapses by itself.
    let bounds = QueueBounds {
        place_ms: wait_ms + 1_000,
        per_key: state.config.waiters_per_key_max,
        per_session: state.config.waiters_per_session_max,
    };
    // The enqueue runs on a task of its own: if this future is dropped while the enqueue is in
    // flight (the client hung up), the task still sees the outcome and gives the place up.
    let (sender, receiver) = tokio::sync::oneshot::channel();
    tokio::spawn({
        let (state, key, owner) = (state.clone(), key.to_owned(), owner.to_owned());
        async move {
            let queued = state
                .store
                .enqueue(claim(&key, session_id, &owner), bounds)
                .await;
            if let Err(Ok(ticket)) = sender.send(queued) {
                leave_queue(&state, &ticket).await;
            }
        }
    });
    let fail = |e| failure(state, key, e);
    receiver
        .await
        .map_err(|_| fail(StoreError::Backend("the enqueue task ended early".into())))?
        .map_err(fail)
}

/// Attempts again on every wake-up of the key's bucket, or every poll interval, until the
/// lock is granted or the deadline passes.
async fn wait_for_grant(
    state: &AppState,
    key: &str,
    session_id: Uuid,
    owner: &str,
    ttl_ms: i64,
    deadline: Instant,
    place: &QueuePlace,
) -> Result<LockGrant, AcquireFailure> {
    let poll = Duration::from_millis(state.config.waiter_poll_ms);
    loop {
        let notified = state.bucket(key).notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        match state
            .store
            .try_acquire(&attempt(
                key,
                session_id,
                owner,
                ttl_ms,
                Some(place.ticket()),
            ))
            .await
        {
            Ok(Acquire::Granted(grant)) => break Ok(grant),
            Ok(Acquire::Contended(c)) => {
                if Instant::now() >= deadline {
                    break Err((AcquireOutcome::timeout, contended(key, c)));
                }
            }
            Err(e) => break Err(failure(state, key, e)),
        }
        let now = Instant::now();
        let nap = poll.min(deadline.saturating_duration_since(now));
        tokio::select! {
            () = &mut notified => {},
            () = tokio::time::sleep(nap) => {},
        }
    }
}

/// A waiter's place in a key's queue, until the wait ends. Dropped while still held (the
/// handler was cancelled: the client disconnected, or the request deadline fired), it leaves the
/// queue on a task of its own, at once, and wakes the next in line; it does not linger at the
/// head until its deadline.
struct QueuePlace {
    state: AppState,
    ticket: WaiterTicket,
    /// Still in the queue: neither granted nor left.
    held: bool,
}

impl QueuePlace {
    fn new(state: AppState, ticket: WaiterTicket) -> Self {
        Self {
            state,
            ticket,
            held: true,
        }
    }

    fn ticket(&self) -> &WaiterTicket {
        &self.ticket
    }

    fn granted(mut self) {
        self.held = false;
    }

    async fn leave(mut self) {
        self.held = false;
        leave_queue(&self.state, &self.ticket).await;
    }
}

impl Drop for QueuePlace {
    fn drop(&mut self) {
        if !self.held {
            return;
        }
        let ticket = self.ticket.clone();
        tracing::info!(
            event = "waiter_cancelled",
            key = %ticket.key,
            "an acquire stopped waiting before its waitMillis (the client hung up or the request \
             deadline fired); its place in the queue is given up"
        );
        let state = self.state.clone();
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move { leave_queue(&state, &ticket).await });
        }
    }
}

async fn leave_queue(state: &AppState, ticket: &WaiterTicket) {
    if let Err(error) = state.store.dequeue(ticket).await {
        tracing::warn!(event = "dequeue_failed", key = %ticket.key, %error, "leaving the waiter queue failed; the entry lapses by itself");
    }
    // The next in line may now be at the head.
    state.wake(&ticket.key);
}
