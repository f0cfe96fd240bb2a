//! The lock server's OpenAPI document (docs/contract.md#s3-3), served at `GET /v1/openapi.json`.
//! Each operation below documents the handler of the same name in `routes/`, the batches the batch
//! route of their step (`dlock_server::batch`); `scripts/check-openapi` checks that the committed
//! `docs/openapi/lock-server.json` is this document.

#![allow(dead_code)]

use dlock_contract::batch::{AcquireItem, BatchAnswer, BatchRequest, ReleaseItem};
use dlock_contract::error::ErrorBody;
use dlock_contract::lock::*;
use dlock_contract::openapi::BearerAuth;
use dlock_server::openapi::{
    BatchEndpoint, BatchEndpoints, Invalid, InvalidToken, NotLeader, Unauthorized,
};
use utoipa::OpenApi;

#[derive(OpenApi)]
#[openapi(
    info(title = "dlock lock server", description = "Sessions, leases and fencing tokens."),
    paths(create_session, heartbeat, end_session, held_locks, acquire, renew, revoke, lock_info, release, batch_acquire, batch_release, healthz, readyz),
    modifiers(&BearerAuth, &BATCHES)
)]
pub struct ApiDoc;

/// The batch endpoints' owner header, security and refusals.
const BATCHES: BatchEndpoints = BatchEndpoints(&[
    BatchEndpoint::new("/v1/batches/acquire", "acquires", "L4's", NOT_LEADER),
    BatchEndpoint::new("/v1/batches/release", "releases", "L6's", NOT_LEADER),
]);
const NOT_LEADER: &str =
    "nothing ran. An item the backend does not take is that item's 503 NOT_LEADER, in its answer";

/// L1: open a session.
#[utoipa::path(post, path = "/v1/sessions", request_body = CreateSessionRequest,
    params(("X-Owner-Id" = Option<String>, Header, description = "owner id, ≤64 chars (or ownerId in the body)")),
    security(("bearerAuth" = [])),
    responses((status = 201, body = Session), Invalid, Unauthorized, NotLeader,
        (status = 403, description = "FORBIDDEN: X-Owner-Id or the body's ownerId does not belong to the authenticated identity", body = ErrorBody),
    ))]
fn create_session() {}

/// L2: heartbeat a session.
#[utoipa::path(post, path = "/v1/sessions/{sessionId}/heartbeat",
    params(("sessionId" = String, Path), ("X-Owner-Id" = String, Header, description = "owner id, ≤64 chars")),
    security(("bearerAuth" = [])),
    responses((status = 200, body = Heartbeat), Invalid, Unauthorized, SessionGone, NotLeader))]
fn heartbeat() {}

/// L3: end a session, releasing every lock it holds.
#[utoipa::path(delete, path = "/v1/sessions/{sessionId}",
    params(("sessionId" = String, Path), ("X-Owner-Id" = String, Header, description = "owner id, ≤64 chars")),
    security(("bearerAuth" = [])),
    responses((status = 204, description = "ended"), Invalid, Unauthorized, SessionGone, NotLeader))]
fn end_session() {}

/// Every held lock (advisory).
#[utoipa::path(get, path = "/v1/locks",
    params(("limit" = Option<i64>, Query, description = "1 to 1000, default 500")),
    responses((status = 200, body = HeldLocks), Invalid, NotLeader))]
fn held_locks() {}

/// L4: acquire a lock, optionally waiting in the key's FIFO queue.
#[utoipa::path(post, path = "/v1/locks/{key}/acquire", request_body = AcquireRequest,
    params(("key" = String, Path, description = "1–128 of [a-zA-Z0-9:._-]"), ("X-Owner-Id" = String, Header)),
    security(("bearerAuth" = [])),
    responses((status = 200, body = LockGrant), Invalid, Unauthorized, SessionGone, NotLeader,
        (status = 409, description = "LOCK_CONTENDED", body = ErrorBody),
        (status = 429, description = "CONTENTION_EXCEEDED: the key's waiter queue is full, or this session already has its share of it (lock.waiters.max-per-session)", body = ErrorBody),
    ))]
fn acquire() {}

/// L5: renew a grant; the token never changes.
///
/// Only the session that holds the grant, under the grant's owner, may renew it: the answer
/// carries the grant's proof.
#[utoipa::path(post, path = "/v1/locks/{key}/renew", request_body = RenewRequest,
    params(("key" = String, Path), ("X-Owner-Id" = String, Header), ("X-Fencing-Token" = String, Header, description = "decimal int64 > 0")),
    security(("bearerAuth" = [])),
    responses((status = 200, body = LockGrant), InvalidToken, Unauthorized, SessionGone, NotLeader,
        (status = 403, description = "FORBIDDEN: X-Owner-Id does not belong to the authenticated identity (an operator too renews only under an owner of its own)", body = ErrorBody),
        (status = 409, description = "LOCK_LOST: the grant ended, was taken over, or is not held by the caller's owner and session", body = ErrorBody),
    ))]
fn renew() {}

/// L8: force-revoke a held lock (operator).
#[utoipa::path(post, path = "/v1/locks/{key}/revoke", request_body = RevokeRequest,
    params(("key" = String, Path), ("X-Owner-Id" = String, Header)),
    security(("bearerAuth" = [])),
    responses((status = 200, body = Revocation), Invalid, Unauthorized, NotLeader,
        (status = 404, description = "NOT_FOUND: not held", body = ErrorBody),
        (status = 409, description = "FENCED_OUT: expectedToken stale", body = ErrorBody),
    ))]
fn revoke() {}

/// L7: who holds a key (advisory only).
#[utoipa::path(get, path = "/v1/locks/{key}",
    params(("key" = String, Path)),
    responses((status = 200, body = LockInfo), Invalid, NotLeader,
        (status = 404, description = "NOT_FOUND: never locked, or not granted for lock.keys-seen.retention", body = ErrorBody),
    ))]
fn lock_info() {}

/// L6: release a grant (compare-and-delete on key and token).
#[utoipa::path(delete, path = "/v1/locks/{key}", request_body(content = Option<ReleaseRequest>, description = "or sessionId in the query"),
    params(("key" = String, Path), ("sessionId" = Option<String>, Query), ("X-Owner-Id" = String, Header), ("X-Fencing-Token" = String, Header, description = "decimal int64 > 0")),
    security(("bearerAuth" = [])),
    responses((status = 204, description = "released"), InvalidToken, Unauthorized, NotLeader,
        (status = 409, description = "LOCK_LOST", body = ErrorBody),
    ))]
fn release() {}

/// A batch of L4 acquires (docs/contract.md#batches).
///
/// Each item is one key's acquire and is answered exactly as `POST /v1/locks/{key}/acquire` (L4)
/// answers it: in the 200's `items`, in the request's order, the status and body L4 answers for
/// that item (a grant, or its error envelope). The items run concurrently, each through L4's own
/// checks and waiting; one item's refusal changes nothing for its neighbours. `X-Owner-Id` and the
/// credential are the batch request's and apply to every item; the batch needs L4's roles. No
/// answer to the batch request leaves every item's outcome unknown: read each key (L7).
#[utoipa::path(post, path = "/v1/batches/acquire", request_body = BatchRequest<AcquireItem>,
    responses((status = 200, description = "one answer per item, in the request's order: what L4 answers for it", body = BatchAnswer)))]
fn batch_acquire() {}

/// A batch of L6 releases (docs/contract.md#batches).
///
/// Each item is one grant's release and is answered exactly as `DELETE /v1/locks/{key}` (L6)
/// answers it: in the 200's `items`, in the request's order, the status L6 answers for that item
/// (no body for its 204, else its error envelope). The items run concurrently, each through L6's
/// own checks; one item's refusal changes nothing for its neighbours. `X-Owner-Id` and the
/// credential are the batch request's and apply to every item; the batch needs L6's roles.
#[utoipa::path(post, path = "/v1/batches/release", request_body = BatchRequest<ReleaseItem>,
    responses((status = 200, description = "one answer per item, in the request's order: what L6 answers for it", body = BatchAnswer)))]
fn batch_release() {}

/// Process up.
#[utoipa::path(get, path = "/healthz", responses((status = 200, body = serde_json::Value)))]
fn healthz() {}

/// The backend takes writes.
#[utoipa::path(get, path = "/readyz", responses((status = 200, body = serde_json::Value), NotLeader))]
fn readyz() {}

/// 404 and 410: a session-bound call on a session that is unknown or has expired.
#[derive(utoipa::IntoResponses)]
enum SessionGone {
    #[response(status = 404, description = "SESSION_UNKNOWN")]
    SessionUnknown(ErrorBody),
    #[response(status = 410, description = "SESSION_EXPIRED")]
    SessionExpired(ErrorBody),
}

/// The lock server's document.
pub fn document() -> utoipa::openapi::OpenApi {
    ApiDoc::openapi()
}
