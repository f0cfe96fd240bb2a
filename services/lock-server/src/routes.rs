//! The HTTP surface L1–L8, the held-locks list and the health endpoints.

use std::hash::{Hash, Hasher};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Bytes;
use axum::extract::rejection::QueryRejection;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use dlock_contract::auth::Caller;
use dlock_contract::error::{ApiError, ErrorCode, FieldError};
use dlock_contract::headers;
use dlock_contract::http::{METRICS_CONTENT_TYPE, json_response};
use dlock_contract::json::{Json, parse_body};
use dlock_contract::lock::*;
use serde::Deserialize;
use serde_json::json;
use tokio::sync::Notify;
use uuid::Uuid;

use crate::config::LockServerConfig;
use crate::metrics::{AcquireOutcome, Backend, Metrics};
use crate::store::{Acquire, Contention, QueueBounds, Store, StoreError, WaiterTicket};

/// Wake-ups for waiters on this replica; waiters on other replicas find out by polling.
/// Keys share buckets, so a wake-up may be spurious; the waiter just tries again.
const WAKE_BUCKETS: usize = 64;

#[derive(Clone)]
pub struct AppState {
    pub store: Store,
    pub config: Arc<LockServerConfig>,
    pub metrics: Arc<Metrics>,
    wake: Arc<Vec<Notify>>,
}

impl AppState {
    pub fn new(store: Store, config: Arc<LockServerConfig>) -> Self {
        let backend = match store {
            Store::Pg(_) => Backend::pg,
            Store::Etcd(_) => Backend::etcd,
        };
        Self {
            store,
            config,
            metrics: Metrics::new(backend),
            wake: Arc::new((0..WAKE_BUCKETS).map(|_| Notify::new()).collect()),
        }
    }

    fn bucket(&self, key: &str) -> &Notify {
        let mut hasher = std::collections::hash_map::DefaultHasher::new();
        key.hash(&mut hasher);
        &self.wake[(hasher.finish() as usize) % WAKE_BUCKETS]
    }

    fn wake(&self, key: &str) {
        self.bucket(key).notify_waiters();
    }

    /// The grant as it is answered (L4, L5): with the proof of (key, token) when this server
    /// has proof keys. This is the only place a proof is made; lists and L7 never carry one.
    fn proven(&self, mut grant: LockGrant) -> LockGrant {
        grant.fencing_proof = self
            .config
            .proof_keys
            .as_ref()
            .and_then(|keys| keys.sign(&grant.key, grant.fencing_token));
        grant
    }
}

pub fn app(state: AppState) -> Router {
    let limits = state.config.http;
    let routes = Router::new()
        .route("/v1/sessions", post(create_session))
        .route("/v1/sessions/{session_id}/heartbeat", post(heartbeat))
        .route(
            "/v1/sessions/{session_id}",
            axum::routing::delete(end_session),
        )
        .route("/v1/locks", get(held_locks))
        .route("/v1/locks/{key}/acquire", post(acquire))
        .route("/v1/locks/{key}/renew", post(renew))
        .route("/v1/locks/{key}/revoke", post(revoke))
        .route("/v1/locks/{key}", get(lock_info).delete(release))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .route(
            dlock_contract::openapi::PATH,
            get(|| async { dlock_contract::openapi::response(&crate::openapi::document()) }),
        )
        .with_state(state.clone());
    let routes = state.config.auth.protect(routes);
    dlock_contract::http::finish(routes, limits)
}

/// Maps a store outcome to the contract's envelope.
fn store_error(error: StoreError, key: Option<&str>) -> ApiError {
    match error {
        StoreError::SessionUnknown => ApiError::new(
            ErrorCode::SessionUnknown,
            "no such session for this owner; open a new session (its locks, if any, are gone)",
        ),
        StoreError::SessionExpired => ApiError::new(
            ErrorCode::SessionExpired,
            "the session's heartbeat lapsed and its locks were released; open a new session, re-acquire and re-read state",
        ),
        StoreError::LockLost { stored_token } => ApiError::new(
            ErrorCode::LockLost,
            "the grant has expired or was taken over; re-acquire, re-read state and use the new token",
        )
        .with_details(json!({ "key": key, "storedToken": stored_token })),
        StoreError::NotHeld => ApiError::not_found(format!(
            "{} is not held; there is nothing to revoke",
            key.unwrap_or("the key")
        )),
        StoreError::FencedOut {
            expected,
            stored,
            owner_id,
        } => ApiError::fenced_out(
            "expectedToken is not the live grant's token; read the lock again before revoking",
            &dlock_contract::error::FencedOutDetails {
                presented_token: expected,
                highest_token: stored,
                resource_type: None,
                resource_id: key.unwrap_or_default().to_owned(),
                owner_id,
            },
        ),
        StoreError::QueueFull { waiter_count } => ApiError::new(
            ErrorCode::ContentionExceeded,
            "the key's waiter queue is full; back off for retryAfterMillis before trying again",
        )
        .with_details(json!({ "key": key, "waiterCount": waiter_count })),
        StoreError::SessionShareFull {
            waiter_count,
            share,
        } => ApiError::new(
            ErrorCode::ContentionExceeded,
            format!(
                "this session already waits for the key ({share} place(s) of its queue per \
                 session); wait for that acquire to end, or back off for retryAfterMillis"
            ),
        )
        .with_details(json!({
            "key": key,
            "waiterCount": waiter_count,
            "sessionWaitersMax": share,
        })),
        StoreError::NotLeader(reason) => {
            tracing::warn!(event = "backend_not_leader", %reason, "backend refused a write");
            ApiError::new(
                ErrorCode::NotLeader,
                "this replica's backend cannot take writes right now; nothing was changed, retry",
            )
        }
        StoreError::Backend(reason) => ApiError::internal(reason),
    }
}

fn path_key(key: &str) -> Result<(), FieldError> {
    if key_is_valid(key) {
        Ok(())
    } else {
        Err(FieldError::new(
            "key",
            format!("must be 1 to {KEY_LEN_MAX} characters of [a-zA-Z0-9:._-]"),
        ))
    }
}

fn path_session(text: &str) -> Result<Uuid, FieldError> {
    Uuid::parse_str(text).map_err(|_| FieldError::new("sessionId", "must be a UUID"))
}

/// A TTL from a request: outside the contract's range is an error; inside it, clamped down to
/// the server's maximum.
fn ttl(field: &str, requested: Option<i64>, default: i64, max: i64) -> Result<i64, FieldError> {
    match requested {
        None => Ok(default),
        Some(t) if (TTL_MS_MIN..=TTL_MS_MAX).contains(&t) => Ok(t.min(max)),
        Some(t) => Err(FieldError::new(
            field,
            format!("must be between {TTL_MS_MIN} and {TTL_MS_MAX} milliseconds, got {t}"),
        )),
    }
}

/// Collects field errors so one answer names every field at fault.
#[derive(Default)]
struct Checks(Vec<FieldError>);

impl Checks {
    fn take<T>(&mut self, result: Result<T, FieldError>) -> Option<T> {
        match result {
            Ok(v) => Some(v),
            Err(e) => {
                self.0.push(e);
                None
            }
        }
    }

    fn done(self) -> Result<(), ApiError> {
        if self.0.is_empty() {
            Ok(())
        } else {
            Err(ApiError::validation(self.0))
        }
    }
}

/// Unwraps values that [`Checks::done`] has proved present.
fn present<T>(value: Option<T>) -> Result<T, ApiError> {
    value.ok_or_else(|| ApiError::internal("a checked value was missing"))
}

async fn create_session(
    State(state): State<AppState>,
    caller: Caller,
    headers: HeaderMap,
    Json(body): Json<CreateSessionRequest>,
) -> Result<Response, ApiError> {
    let mut checks = Checks::default();
    let header_owner = checks.take(headers::owner_id_optional(&headers)).flatten();
    if let Some(owner) = &body.owner_id {
        checks.take(headers::check_owner_id("ownerId", owner));
    }
    let owner = match (header_owner, body.owner_id.clone()) {
        (Some(h), Some(b)) if h != b => {
            checks
                .0
                .push(FieldError::new("ownerId", "differs from X-Owner-Id"));
            None
        }
        (h, b) => h.or(b),
    };
    if owner.is_none() && checks.0.is_empty() {
        checks.0.push(FieldError::new(
            "ownerId",
            "is required (in the body or as X-Owner-Id)",
        ));
    }
    let config = &state.config;
    let ttl_ms = checks.take(ttl(
        "ttlMillis",
        body.ttl_millis,
        config.session_ttl_default_ms,
        config.session_ttl_max_ms,
    ));
    checks.done()?;
    let (owner, ttl_ms) = (present(owner)?, present(ttl_ms)?);
    // The auth layer binds X-Owner-Id to the credential, but it cannot see the body: an ownerId
    // there, without the header, is bound here by the same rule.
    owner_bound(&state.config, &caller, &owner)?;
    let session = state
        .store
        .create_session(&owner, ttl_ms)
        .await
        .map_err(|e| store_error(e, None))?;
    tracing::info!(event = "session_opened", session_id = %session.session_id, owner_id = %owner, ttl_ms, "session opened");
    Ok(json_response(StatusCode::CREATED, &session))
}

/// `auth.owner-binding` for an owner id the auth layer did not see (L1's body `ownerId`): an
/// authenticated caller that is not an operator may name only its identity or
/// `<identity>/<worker>`, else `403 FORBIDDEN` and nothing is created.
fn owner_bound(config: &LockServerConfig, caller: &Caller, owner: &str) -> Result<(), ApiError> {
    let Some(identity) = caller.identity() else {
        return Ok(());
    };
    if !config.owner_binding || identity.operator {
        return Ok(());
    }
    let name = identity.name.as_str();
    let bound = owner == name
        || owner
            .strip_prefix(name)
            .is_some_and(|rest| rest.starts_with('/'));
    if bound {
        return Ok(());
    }
    tracing::warn!(
        event = "owner_binding_refused",
        identity = name,
        owner_id = owner,
        "a session was refused: its ownerId does not belong to the authenticated identity"
    );
    Err(ApiError::new(
        ErrorCode::Forbidden,
        format!(
            "ownerId `{owner}` does not belong to the authenticated identity `{name}`: use \
             `{name}` or `{name}/<worker>`; nothing was changed"
        ),
    ))
}

async fn heartbeat(
    State(state): State<AppState>,
    Path(session_id): Path<String>,
    headers: HeaderMap,
) -> Result<Json<Heartbeat>, ApiError> {
    let mut checks = Checks::default();
    let session_id = checks.take(path_session(&session_id));
    let owner = checks.take(headers::owner_id(&headers));
    checks.done()?;
    let beat = state
        .store
        .heartbeat(present(session_id)?, &present(owner)?)
        .await
        .map_err(|e| store_error(e, None))?;
    Ok(Json(beat))
}

async fn end_session(
    State(state): State<AppState>,
    Path(session_id): Path<String>,
    headers: HeaderMap,
) -> Result<StatusCode, ApiError> {
    let mut checks = Checks::default();
    let session_id = checks.take(path_session(&session_id));
    let owner = checks.take(headers::owner_id(&headers));
    checks.done()?;
    let session_id = present(session_id)?;
    state
        .store
        .end_session(session_id, &present(owner)?)
        .await
        .map_err(|e| store_error(e, None))?;
    // The session's locks are gone; waiters anywhere may take them. Wake this replica's.
    for bucket in state.wake.iter() {
        bucket.notify_waiters();
    }
    tracing::info!(event = "session_ended", %session_id, "session ended; its locks were released");
    Ok(StatusCode::NO_CONTENT)
}

fn contended(key: &str, c: Contention) -> ApiError {
    let retry_after = c
        .expires_at
        .map(|t| (t - chrono::Utc::now()).num_milliseconds())
        .unwrap_or(0)
        .clamp(1, 1_000) as u64;
    ApiError::new(
        ErrorCode::LockContended,
        "the lock is held by another grant; retry after a bounded, jittered backoff",
    )
    .with_retry_after_ms(retry_after)
    .with_details(json!({
        "key": key,
        "holderOwnerId": c.holder_owner_id,
        "expiresAt": c.expires_at.map(|t| dlock_contract::time::format(&t)),
        "waiterCount": c.waiter_count,
    }))
}

async fn acquire(
    State(state): State<AppState>,
    Path(key): Path<String>,
    headers: HeaderMap,
    Json(body): Json<AcquireRequest>,
) -> Result<Json<LockGrant>, ApiError> {
    let started = Instant::now();
    let mut checks = Checks::default();
    checks.take(path_key(&key));
    let owner = checks.take(headers::owner_id(&headers));
    let config = &state.config;
    let ttl_ms = checks.take(ttl(
        "ttlMillis",
        body.ttl_millis,
        config.lock_ttl_default_ms,
        config.lock_ttl_max_ms,
    ));
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
    let store = &state.store;
    let fail = |e: StoreError| {
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
    };
    let first = store
        .try_acquire(key, session_id, owner, ttl_ms, None)
        .await
        .map_err(fail)?;
    match first {
        Acquire::Granted(grant) => return Ok(grant),
        Acquire::Contended(c) if wait_ms == 0 => {
            return Err((AcquireOutcome::contended, contended(key, c)));
        }
        Acquire::Contended(_) => {}
    }
    let deadline = Instant::now() + Duration::from_millis(wait_ms as u64);
    // The queue entry outlives the wait a little, so a replica that dies mid-wait leaves an
    // entry that lapses by itself.
    let bounds = QueueBounds {
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
                .enqueue(&key, session_id, &owner, wait_ms + 1_000, bounds)
                .await;
            if let Err(Ok(ticket)) = sender.send(queued) {
                leave_queue(&state, &ticket).await;
            }
        }
    });
    let ticket = receiver
        .await
        .map_err(|_| fail(StoreError::Backend("the enqueue task ended early".into())))?
        .map_err(fail)?;
    // From here the place is given up however the wait ends, including when this future is
    // dropped because the client hung up: a cancelled waiter must not stay at the head. (No
    // await between receiving the ticket and this line, so no cancellation in between.)
    let place = QueuePlace::new(state.clone(), ticket);
    let poll = Duration::from_millis(state.config.waiter_poll_ms);
    let result = loop {
        let notified = state.bucket(key).notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        match store
            .try_acquire(key, session_id, owner, ttl_ms, Some(place.ticket()))
            .await
        {
            Ok(Acquire::Granted(grant)) => break Ok(grant),
            Ok(Acquire::Contended(c)) => {
                if Instant::now() >= deadline {
                    break Err((AcquireOutcome::timeout, contended(key, c)));
                }
            }
            Err(e) => break Err(fail(e)),
        }
        let now = Instant::now();
        let nap = poll.min(deadline.saturating_duration_since(now));
        tokio::select! {
            () = &mut notified => {},
            () = tokio::time::sleep(nap) => {},
        }
    };
    match &result {
        // The grant removed the queue entry in the same transaction.
        Ok(_) => place.granted(),
        Err(_) => place.leave().await,
    }
    result
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

async fn renew(
    State(state): State<AppState>,
    Path(key): Path<String>,
    headers: HeaderMap,
    Json(body): Json<RenewRequest>,
) -> Result<Json<LockGrant>, ApiError> {
    let token = headers::fencing_token(&headers)?;
    let mut checks = Checks::default();
    checks.take(path_key(&key));
    let owner = checks.take(headers::owner_id(&headers));
    let ttl_ms = match body.ttl_millis {
        None => None,
        requested => checks.take(ttl(
            "ttlMillis",
            requested,
            state.config.lock_ttl_default_ms,
            state.config.lock_ttl_max_ms,
        )),
    };
    checks.done()?;
    // Bound to the grant's owner (the caller's X-Owner-Id, which the auth layer binds to its
    // credential): a non-owner is LOCK_LOST, C3's code for a caller that is not the holder.
    let grant = state
        .store
        .renew(&key, body.session_id, &present(owner)?, token, ttl_ms)
        .await
        .map_err(|e| store_error(e, Some(&key)))?;
    Ok(Json(state.proven(grant)))
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct ReleaseQuery {
    session_id: Option<String>,
}

async fn release(
    State(state): State<AppState>,
    Path(key): Path<String>,
    query: Result<Query<ReleaseQuery>, QueryRejection>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<StatusCode, ApiError> {
    let token = headers::fencing_token(&headers)?;
    let mut checks = Checks::default();
    checks.take(path_key(&key));
    let owner = checks.take(headers::owner_id(&headers));
    // sessionId comes in the body or, for clients that send no body with DELETE, the query.
    // It is attribution only: the delete compares (key, token) and nothing else.
    let session_id = if body.iter().any(|b| !b.is_ascii_whitespace()) {
        Some(parse_body::<ReleaseRequest>(&body)?.session_id)
    } else {
        let query = strict_query(query)?;
        match query.session_id {
            Some(text) => checks.take(path_session(&text)),
            None => {
                checks
                    .0
                    .push(FieldError::new("sessionId", "is required (body or query)"));
                None
            }
        }
    };
    checks.done()?;
    let owner = present(owner)?;
    let session_id = present(session_id)?;
    // The delete compares (key, token) as the contract says; the caller's owner id, bound to its
    // credential, must also be the grant's: a token is public (L7), so without this any
    // identity could end another's grant. A non-owner hears LOCK_LOST, as any non-holder does.
    match state.store.release(&key, &owner, token).await {
        Ok(()) => {
            state.wake(&key);
            tracing::debug!(event = "lock_released", key = %key, token, owner_id = %owner, %session_id, "lock released");
            Ok(StatusCode::NO_CONTENT)
        }
        Err(error) => {
            if matches!(error, StoreError::LockLost { .. }) {
                tracing::info!(event = "release_lock_lost", key = %key, token, owner_id = %owner, %session_id, "release of a grant that had already lapsed or been taken over");
            }
            Err(store_error(error, Some(&key)))
        }
    }
}

/// A strict query string: an unknown parameter is refused like an unknown body field, and every
/// refusal is the contract's envelope naming the parameter.
fn strict_query<T: serde::de::DeserializeOwned>(
    query: Result<Query<T>, QueryRejection>,
) -> Result<T, ApiError> {
    query.map(|Query(q)| q).map_err(|rejection| {
        let message = rejection.body_text();
        let field = message.split('`').nth(1).unwrap_or("query").to_owned();
        ApiError::field(field, message)
    })
}

async fn lock_info(
    State(state): State<AppState>,
    Path(key): Path<String>,
) -> Result<Json<LockInfo>, ApiError> {
    path_key(&key).map_err(|e| ApiError::validation(vec![e]))?;
    match state
        .store
        .lock_info(&key)
        .await
        .map_err(|e| store_error(e, Some(&key)))?
    {
        Some(info) => Ok(Json(info)),
        None => Err(ApiError::not_found(format!(
            "{key} has never been locked here"
        ))),
    }
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct HeldQuery {
    limit: Option<String>,
}

/// The most held locks one list returns.
pub const HELD_LIMIT_MAX: i64 = 1_000;

async fn held_locks(
    State(state): State<AppState>,
    query: Result<Query<HeldQuery>, QueryRejection>,
) -> Result<Json<HeldLocks>, ApiError> {
    let query = strict_query(query)?;
    let limit = match query.limit {
        None => 500,
        Some(text) => match text.parse::<i64>() {
            Ok(n) if (1..=HELD_LIMIT_MAX).contains(&n) => n,
            _ => {
                return Err(ApiError::field(
                    "limit",
                    format!("must be an integer between 1 and {HELD_LIMIT_MAX}"),
                ));
            }
        },
    };
    let held = state
        .store
        .held(limit)
        .await
        .map_err(|e| store_error(e, None))?;
    Ok(Json(held))
}

async fn revoke(
    State(state): State<AppState>,
    caller: Caller,
    Path(key): Path<String>,
    headers: HeaderMap,
    Json(body): Json<RevokeRequest>,
) -> Result<Json<Revocation>, ApiError> {
    caller.require_operator("L8 revoke")?;
    let mut checks = Checks::default();
    checks.take(path_key(&key));
    checks.take(headers::owner_id(&headers));
    let operator = body.operator.trim();
    if operator.is_empty() || operator.chars().count() > 128 {
        checks
            .0
            .push(FieldError::new("operator", "must be 1 to 128 characters"));
    }
    let reason_len = body.reason.trim().chars().count();
    if !(REVOKE_REASON_LEN_MIN..=1024).contains(&reason_len) {
        checks.0.push(FieldError::new(
            "reason",
            format!("must be {REVOKE_REASON_LEN_MIN} to 1024 characters, got {reason_len}"),
        ));
    }
    if let Some(t) = body.expected_token
        && t <= 0
    {
        checks
            .0
            .push(FieldError::new("expectedToken", "must be greater than 0"));
    }
    checks.done()?;
    // `operator` is what the caller wrote; the identity its credential proved is stored beside
    // it (none when auth.mode is none).
    let revoked_by = caller.identity().map(|identity| identity.name.as_str());
    let revocation = state
        .store
        .revoke(
            &key,
            body.expected_token,
            operator,
            body.reason.trim(),
            revoked_by,
        )
        .await
        .map_err(|e| store_error(e, Some(&key)))?;
    state.metrics.revoked();
    state.wake(&key);
    tracing::warn!(
        event = "lock_revoked",
        key = %key,
        revoked_token = revocation.revoked_token,
        revoked_owner_id = %revocation.revoked_owner_id,
        new_token_floor = revocation.new_token_floor,
        revocation_id = %revocation.revocation_id,
        operator = %revocation.operator,
        revoked_by = revoked_by.unwrap_or("-"),
        reason = %revocation.reason,
        "lock force-revoked; push newTokenFloor to the enforcement points"
    );
    Ok(Json(revocation))
}

async fn healthz() -> Json<serde_json::Value> {
    Json(json!({ "status": "ok" }))
}

async fn readyz(State(state): State<AppState>) -> Response {
    match state.store.ready().await {
        Ok(()) => json_response(
            StatusCode::OK,
            &json!({ "status": "ready", "backend": state.store.backend_name() }),
        ),
        Err(error) => {
            tracing::warn!(event = "not_ready", %error, "backend check failed");
            ApiError::new(
                ErrorCode::NotLeader,
                "the backend is not ready for writes; this replica should not receive traffic",
            )
            .into_response()
        }
    }
}

async fn metrics(State(state): State<AppState>) -> Response {
    (
        [(header::CONTENT_TYPE, METRICS_CONTENT_TYPE)],
        state.metrics.encode(),
    )
        .into_response()
}
