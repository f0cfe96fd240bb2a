//! The idempotency engine (docs/design.md#d-7, docs/contract.md#idempotency-rules): every write
//! claims its record in the transaction that runs its effect, stores its answer there, and a
//! retry of the identical request gets the stored bytes back (marked
//! `dlock_contract::headers::IDEMPOTENT_REPLAY`, by [`Reply`]); a key reused with another body is
//! refused.

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use dlock_contract::error::{ApiError, ErrorCode};
use dlock_contract::json::Json;
use dlock_server::auth::Caller;
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::json;
use sha2::{Digest, Sha256};
use sqlx::PgConnection;

use super::AppState;
use super::checks::{Checks, WriteHeaders, checked_write};
use super::errors::{missing, store_error};
use crate::metrics::Lookup;
use crate::store::{Begin, Once, Scope, StoreError, StoreResult, Tx};

pub use dlock_server::idempotency::Reply;

/// The answer of a create: 201 with the `what` it read back in its transaction.
pub(super) fn created<T: Serialize>(
    read: StoreResult<Option<T>>,
    what: &str,
) -> Result<Reply, ApiError> {
    let row = read.map_err(store_error)?.ok_or_else(|| missing(what))?;
    Reply::json(StatusCode::CREATED, &row)
}

/// The canonical hash of a request: its route and its parsed body re-serialized, so the same
/// request with its fields in another order or other whitespace is the same request.
pub(super) fn payload_hash<T: Serialize>(route: &str, body: &T) -> Result<[u8; 32], ApiError> {
    let bytes = serde_json::to_vec(body)
        .map_err(|e| ApiError::internal(format!("request did not serialize: {e}")))?;
    let mut hasher = Sha256::new();
    hasher.update(route.as_bytes());
    hasher.update([0u8]);
    hasher.update(&bytes);
    Ok(hasher.finalize().into())
}

pub(super) enum Started {
    Fresh(Tx),
    Done(Response),
}

impl AppState {
    pub(super) fn scope<T: Serialize>(
        &self,
        route: String,
        write: &WriteHeaders,
        token: i64,
        body: &T,
        ledger: bool,
    ) -> Result<Scope, ApiError> {
        let retention = &self.config.idempotency;
        Ok(Scope {
            payload_hash: payload_hash(&route, body)?,
            route,
            key: write.key.clone(),
            token,
            owner_id: write.owner_id.clone(),
            retention_ms: if ledger {
                retention.ledger_retention_ms
            } else {
                retention.payout_retention_ms
            },
        })
    }

    pub(super) async fn start(&self, scope: &Scope) -> Result<Started, ApiError> {
        let begun = self
            .store
            .begin(scope, self.config.idempotency.in_progress_wait_ms)
            .await;
        self.started(scope, begun)
    }

    /// Runs one `*_once` write: `call` claims the record and runs the effect in one round trip;
    /// when the request is fresh, `answer` turns the effect's outcome into the reply, which is
    /// stored and committed as by [`Self::finish`]. Otherwise the replayed or refused answer.
    pub(super) async fn once<T, F, Fut>(
        &self,
        scope: &Scope,
        call: F,
        answer: impl FnOnce(T) -> Result<Reply, ApiError>,
    ) -> Response
    where
        F: FnOnce(Tx, i32) -> Fut,
        Fut: std::future::Future<Output = StoreResult<Once<T>>>,
    {
        match self.start_once(scope, call).await {
            Err(response) => response,
            Ok((tx, outcome)) => self.finish(tx, scope, answer(outcome)).await,
        }
    }

    /// A `*_once` call's verdict: the effect's outcome in the open transaction when fresh, the
    /// replayed or refused answer otherwise (as [`Self::start`]).
    async fn start_once<T, F, Fut>(&self, scope: &Scope, call: F) -> Result<(Tx, T), Response>
    where
        F: FnOnce(Tx, i32) -> Fut,
        Fut: std::future::Future<Output = StoreResult<Once<T>>>,
    {
        let tx = self
            .store
            .begin_tx()
            .await
            .map_err(|e| store_error(e).into_response())?;
        let (begun, row) = match call(tx, self.config.idempotency.in_progress_wait_ms).await {
            Ok(Once::Fresh(tx, row)) => (Ok(Begin::Fresh(tx)), Some(row)),
            Ok(Once::Replay { status, body }) => (Ok(Begin::Replay { status, body }), None),
            Ok(Once::Conflict) => (Ok(Begin::Conflict), None),
            Err(e) => (Err(e), None),
        };
        match (self.started(scope, begun), row) {
            (Ok(Started::Fresh(tx)), Some(row)) => Ok((tx, row)),
            (Ok(Started::Done(response)), _) => Err(response),
            (Err(error), _) => Err(error.into_response()),
            (Ok(Started::Fresh(_)), None) => Err(missing("effect row").into_response()),
        }
    }

    pub(super) fn started(
        &self,
        scope: &Scope,
        begun: StoreResult<Begin>,
    ) -> Result<Started, ApiError> {
        match begun {
            Ok(Begin::Fresh(tx)) => {
                self.metrics.lookup(Lookup::miss);
                Ok(Started::Fresh(tx))
            }
            Ok(Begin::Replay { status, body }) => {
                self.metrics.lookup(Lookup::hit);
                let reply = Reply::stored(status, body)?;
                tracing::debug!(event = "idempotent_replay", route = %scope.route, idempotency_key = %scope.key, "replayed a stored answer");
                Ok(Started::Done(reply.into_response(true)))
            }
            Ok(Begin::Conflict) => {
                self.metrics.conflict();
                tracing::warn!(event = "idempotency_conflict", route = %scope.route, idempotency_key = %scope.key, owner = %scope.owner_id, "a key was re-used with a different body");
                Err(ApiError::new(
                    ErrorCode::IdempotencyConflict,
                    "this X-Idempotency-Key was already used with this token for a different request",
                )
                .with_details(json!({ "idempotencyKey": scope.key, "route": scope.route })))
            }
            Err(StoreError::InProgress) => {
                self.metrics.in_progress_timeout();
                tracing::info!(event = "idempotency_in_progress", route = %scope.route, idempotency_key = %scope.key, owner = %scope.owner_id, "an identical request still holds the idempotency record; told to retry");
                Err(store_error(StoreError::InProgress)
                    .with_retry_after_ms(self.config.idempotency.in_progress_wait_ms as u64)
                    .with_details(json!({
                        "idempotencyKey": scope.key,
                        "route": scope.route,
                        "status": "in_progress",
                    })))
            }
            Err(error) => Err(store_error(error)),
        }
    }

    /// Stores the effect's answer with the effect and commits; an answer that is not kept
    /// ([`kept`]) rolls the whole transaction back, record included.
    pub(super) async fn finish(
        &self,
        tx: Tx,
        scope: &Scope,
        result: Result<Reply, ApiError>,
    ) -> Response {
        let reply = match kept(result) {
            Ok(reply) => reply,
            Err(error) => {
                drop(tx);
                return error.into_response();
            }
        };
        match self
            .store
            .finish(tx, scope, reply.status.as_u16(), &reply.body)
            .await
        {
            Ok(()) => reply.into_response(false),
            Err(error) => store_error(error).into_response(),
        }
    }
}

/// The answer an effect's `result` keeps with its idempotency record: its reply, or its
/// refusal's envelope; `Err` when it keeps nothing and rolls back, so a retry runs again. A server
/// fault (5xx) keeps nothing. Nor does 404: nothing happened, and the thing may exist by the time
/// the caller retries. Nor does LIMIT_EXCEEDED: paydb raised it, so the transaction cannot store
/// anything, and the limit may allow the same request later (a new day, a raised limit). Nor
/// FORBIDDEN (a treasury identity approving its own funding): a refusal of who asks keeps
/// nothing.
pub(super) fn kept(result: Result<Reply, ApiError>) -> Result<Reply, ApiError> {
    match result {
        Ok(reply) => Ok(reply),
        Err(error)
            if error.status.is_server_error()
                || error.status == StatusCode::NOT_FOUND
                || matches!(error.code, ErrorCode::LimitExceeded | ErrorCode::Forbidden) =>
        {
            Err(error)
        }
        Err(error) => Reply::error(&error),
    }
}

/// Runs one idempotent write: `$effect` is an expression over `$conn: &mut PgConnection` that
/// yields `Result<Reply, ApiError>`.
macro_rules! idempotent {
    ($state:expr, $scope:expr, |$conn:ident| $effect:expr) => {{
        let state = $state;
        let scope = $scope;
        match state.start(&scope).await {
            Err(error) => ::axum::response::IntoResponse::into_response(error),
            Ok($crate::routes::idempotency::Started::Done(response)) => response,
            Ok($crate::routes::idempotency::Started::Fresh(mut tx)) => {
                let result = {
                    let $conn: &mut ::sqlx::PgConnection = &mut tx;
                    $effect
                };
                state.finish(tx, &scope, result).await
            }
        }
    }};
}
pub(super) use idempotent;

/// A create (an account, a payout): its body is checked with the write headers, then made once
/// per idempotency key under one fixed route, and its answer is kept as long as a payout's.
pub(super) trait Create: Serialize + DeserializeOwned + Send + Sync {
    /// The route its idempotency records name.
    const ROUTE: &'static str;

    /// The body's field checks; a failed one refuses the request before anything is written.
    fn check(&self, checks: &mut Checks);

    /// Whether `caller` may make one at all; checked before anything else. Every authenticated
    /// caller, unless the kind says otherwise.
    fn authorize(caller: &Caller) -> Result<(), ApiError> {
        let _ = caller;
        Ok(())
    }

    /// The effect, in the transaction that holds the idempotency record.
    fn effect(
        &self,
        conn: &mut PgConnection,
    ) -> impl Future<Output = Result<Reply, ApiError>> + Send;

    /// Makes the checked create under `scope`: the effect and the idempotency record in a
    /// transaction of their own, unless the kind says otherwise.
    fn run(state: AppState, scope: Scope, body: Self) -> impl Future<Output = Response> + Send {
        async move { idempotent!(&state, scope, |conn| body.effect(conn).await) }
    }
}

/// The handler of every [`Create`].
pub(super) async fn create<B: Create>(
    State(state): State<AppState>,
    caller: Caller,
    headers: HeaderMap,
    Json(body): Json<B>,
) -> Result<Response, ApiError> {
    let scope = checked_create(&state, &caller, &headers, &body)?;
    Ok(B::run(state, scope, body).await)
}

/// A create's checks, in order (who may make one, then its write headers and its fields), and
/// its idempotency scope.
fn checked_create<B: Create>(
    state: &AppState,
    caller: &Caller,
    headers: &HeaderMap,
    body: &B,
) -> Result<Scope, ApiError> {
    B::authorize(caller)?;
    let write = checked_write(headers, |checks| body.check(checks))?;
    state.scope(B::ROUTE.to_owned(), &write, 0, body, false)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn payload_hash_depends_on_route_and_body() {
        let a = payload_hash("r1", &json!({"a": 1})).unwrap_or_default();
        let b = payload_hash("r2", &json!({"a": 1})).unwrap_or_default();
        let c = payload_hash("r1", &json!({"a": 2})).unwrap_or_default();
        assert_ne!(a, b);
        assert_ne!(a, c);
        assert_eq!(a, payload_hash("r1", &json!({"a": 1})).unwrap_or_default());
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(2048))]

        /// The idempotency fingerprint: the same route and body always give the same digest
        /// (a replay is recognised), and any change to either gives another (a reused key
        /// with a different body is IDEMPOTENCY_CONFLICT, never a wrong replay).
        #[test]
        fn the_fingerprint_is_stable_and_tells_any_change_apart(
            route in "/v1/[a-z/{}]{1,30}",
            other_route in "/v1/[a-z/{}]{1,30}",
            amount in proptest::prelude::any::<i64>(),
            other_amount in proptest::prelude::any::<i64>(),
            reference in "\\PC{0,40}",
        ) {
            let body = json!({"amountMinor": amount, "reference": reference});
            let same = payload_hash(&route, &body).unwrap_or_default();
            proptest::prop_assert_eq!(same, payload_hash(&route, &body.clone()).unwrap_or_default());
            let moved = json!({"amountMinor": other_amount, "reference": reference});
            proptest::prop_assert_eq!(
                amount == other_amount,
                same == payload_hash(&route, &moved).unwrap_or_default()
            );
            proptest::prop_assert_eq!(
                route == other_route,
                same == payload_hash(&other_route, &body).unwrap_or_default()
            );
        }
    }
}
