//! The HTTP surface: P1–P5, the writes around them (DESIGN §9) and the health endpoints.
//!
//! Every write follows one shape: validate everything (nothing is written for bad input), open
//! the transaction and claim the idempotency record in it, run the effect (one paydb function),
//! store the answer in the same transaction, commit, and send exactly the stored bytes.

use std::sync::Arc;

use axum::Router;
use axum::extract::rejection::QueryRejection;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use chrono::{DateTime, Utc};
use dlock_contract::error::{ApiError, ErrorCode, FieldError};
use dlock_contract::headers;
use dlock_contract::http::{JSON_CONTENT_TYPE, METRICS_CONTENT_TYPE, json_response};
use dlock_contract::json::Json;
use dlock_contract::payment::*;
use serde::{Deserialize, Serialize};
use serde_json::json;
use sha2::{Digest, Sha256};
use sqlx::PgConnection;
use uuid::Uuid;

use crate::config::PaymentConfig;
use crate::metrics::{Lookup, Metrics, Resource};
use crate::store::{
    AbandonOutcome, AdvanceOutcome, Audit, Begin, ClaimOutcome, CreateAccountOutcome,
    CreatePayoutOutcome, FenceMove, FundOutcome, LowerOutcome, Once, PayStore, PostOutcome,
    ResolveOutcome, Scope, StoreError, StoreResult, Tx,
};
use dlock_contract::proof::{FenceLowerRequest, FenceLowered};

/// The header that marks a replayed answer. The body is the stored one, byte for byte.
pub const REPLAY_HEADER: &str = "x-idempotent-replay";

#[derive(Clone)]
pub struct AppState {
    pub store: PayStore,
    pub config: Arc<PaymentConfig>,
    pub metrics: Arc<Metrics>,
}

impl AppState {
    pub fn new(store: PayStore, config: Arc<PaymentConfig>) -> Self {
        Self {
            store,
            config,
            metrics: Metrics::new(),
        }
    }
}

pub fn app(state: AppState) -> Router {
    let limits = state.config.http;
    let routes = Router::new()
        .route("/v1/accounts", post(create_account))
        .route("/v1/accounts/{account_id}", get(get_account))
        .route("/v1/accounts/{account_id}/fund", post(fund))
        .route("/v1/accounts/{account_id}/fence", post(advance_fence))
        .route("/v1/accounts/{account_id}/fence/lower", post(lower_fence))
        .route("/v1/payouts", post(create_payout).get(list_payouts))
        .route("/v1/payouts/{payout_id}", get(get_payout))
        .route("/v1/payouts/{payout_id}/claim", post(claim))
        .route("/v1/payouts/{payout_id}/post", post(post_payout))
        .route("/v1/payouts/{payout_id}/resolve", post(resolve))
        .route("/v1/payouts/{payout_id}/cancel", post(cancel))
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

// ---------------------------------------------------------------------------------------------
// Validation
// ---------------------------------------------------------------------------------------------

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

    fn check(&mut self, ok: bool, field: &str, reason: impl Into<String>) {
        if !ok {
            self.0.push(FieldError::new(field, reason));
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

fn check_account_id(checks: &mut Checks, field: &str, id: &str) {
    checks.check(
        account_id_is_valid(id),
        field,
        format!("must be 1 to {ACCOUNT_ID_LEN_MAX} characters of [a-zA-Z0-9:._-]"),
    );
}

fn check_amount(checks: &mut Checks, amount: i64) {
    checks.check(
        (1..=AMOUNT_MINOR_MAX).contains(&amount),
        "amountMinor",
        format!(
            "must be an integer number of minor units from 1 to {AMOUNT_MINOR_MAX}, got {amount}"
        ),
    );
}

fn check_currency(checks: &mut Checks, currency: &str) {
    checks.check(
        currency_is_valid(currency),
        "currency",
        format!("must be an active ISO 4217 code in upper case (EUR, USD, ...), got {currency:?}"),
    );
}

fn check_reference(checks: &mut Checks, field: &str, text: &str) {
    checks.check(
        reference_is_valid(text),
        field,
        format!("must be 1 to {REFERENCE_LEN_MAX} visible ASCII characters without spaces"),
    );
}

fn check_text(checks: &mut Checks, field: &str, text: &str, min: usize, max: usize) {
    let chars = text.trim().chars().count();
    checks.check(
        (min..=max).contains(&chars) && !text.chars().any(char::is_control),
        field,
        format!("must be {min} to {max} characters without control characters, got {chars}"),
    );
}

fn path_payout(checks: &mut Checks, text: &str) -> Option<Uuid> {
    checks.take(Uuid::parse_str(text).map_err(|_| FieldError::new("payoutId", "must be a UUID")))
}

/// The headers every write carries.
struct WriteHeaders {
    owner_id: String,
    key: String,
}

fn write_headers(checks: &mut Checks, headers: &HeaderMap) -> Option<WriteHeaders> {
    let owner_id = checks.take(headers::owner_id(headers));
    let key = checks.take(headers::idempotency_key(headers));
    Some(WriteHeaders {
        owner_id: owner_id?,
        key: key?,
    })
}

// ---------------------------------------------------------------------------------------------
// Idempotent execution
// ---------------------------------------------------------------------------------------------

/// An answer, as it is stored and sent.
pub struct Reply {
    pub status: StatusCode,
    pub body: Vec<u8>,
}

impl Reply {
    fn json<T: Serialize>(status: StatusCode, value: &T) -> Result<Self, ApiError> {
        serde_json::to_vec(value)
            .map(|body| Self { status, body })
            .map_err(|e| ApiError::internal(format!("response did not serialize: {e}")))
    }

    fn into_response(self, replayed: bool) -> Response {
        let mut response = (self.status, self.body).into_response();
        let headers = response.headers_mut();
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static(JSON_CONTENT_TYPE),
        );
        if replayed {
            headers.insert(REPLAY_HEADER, HeaderValue::from_static("true"));
        }
        response
    }
}

fn store_error(error: StoreError) -> ApiError {
    match error {
        StoreError::NotLeader(reason) => {
            tracing::warn!(event = "backend_not_leader", %reason, "paydb refused a write");
            ApiError::new(
                ErrorCode::NotLeader,
                "paydb cannot take writes right now; nothing was changed, retry",
            )
        }
        // Not NOT_LEADER: paydb is fine, the caller's own identical request holds the record.
        // C3 has no in-progress code; CONTENTION_EXCEEDED (429) is its answer to a caller whose
        // own retry came too soon: retry-safe, but only after retryAfterMillis.
        StoreError::InProgress => ApiError::new(
            ErrorCode::ContentionExceeded,
            "an identical request (same key, token and body) is still in progress; this one changed nothing, retry after retryAfterMillis to get its answer",
        ),
        StoreError::Backend(reason) => ApiError::internal(reason),
    }
}

/// The canonical hash of a request: its route and its parsed body re-serialized, so the same
/// request with its fields in another order or other whitespace is the same request.
fn payload_hash<T: Serialize>(route: &str, body: &T) -> Result<[u8; 32], ApiError> {
    let bytes = serde_json::to_vec(body)
        .map_err(|e| ApiError::internal(format!("request did not serialize: {e}")))?;
    let mut hasher = Sha256::new();
    hasher.update(route.as_bytes());
    hasher.update([0u8]);
    hasher.update(&bytes);
    Ok(hasher.finalize().into())
}

enum Started {
    Fresh(Tx),
    Done(Response),
}

impl AppState {
    fn scope<T: Serialize>(
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

    async fn start(&self, scope: &Scope) -> Result<Started, ApiError> {
        let begun = self
            .store
            .begin(scope, self.config.idempotency.in_progress_wait_ms)
            .await;
        self.started(scope, begun)
    }

    /// A `*_once` call's verdict: the effect's row in the open transaction when fresh, the
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

    fn started(&self, scope: &Scope, begun: StoreResult<Begin>) -> Result<Started, ApiError> {
        match begun {
            Ok(Begin::Fresh(tx)) => {
                self.metrics.lookup(Lookup::miss);
                Ok(Started::Fresh(tx))
            }
            Ok(Begin::Replay { status, body }) => {
                self.metrics.lookup(Lookup::hit);
                let status = StatusCode::from_u16(status)
                    .map_err(|_| ApiError::internal(format!("stored status {status}")))?;
                tracing::debug!(event = "idempotent_replay", route = %scope.route, idempotency_key = %scope.key, "replayed a stored answer");
                Ok(Started::Done(Reply { status, body }.into_response(true)))
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

    /// Stores the effect's answer with the effect and commits. A server fault (5xx) rolls the
    /// whole transaction back, record included, so a retry runs again. So does 404: nothing
    /// happened, and the thing may exist by the time the caller retries.
    async fn finish(&self, tx: Tx, scope: &Scope, result: Result<Reply, ApiError>) -> Response {
        let reply = match result {
            Ok(reply) => reply,
            Err(error)
                if error.status.is_server_error() || error.status == StatusCode::NOT_FOUND =>
            {
                drop(tx);
                return error.into_response();
            }
            Err(error) => match Reply::json(error.status, &error.body()) {
                Ok(reply) => reply,
                Err(error) => return error.into_response(),
            },
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

/// Runs one idempotent write: `$effect` is an expression over `$conn: &mut PgConnection` that
/// yields `Result<Reply, ApiError>`.
macro_rules! idempotent {
    ($state:expr, $scope:expr, |$conn:ident| $effect:expr) => {{
        let state = $state;
        let scope = $scope;
        match state.start(&scope).await {
            Err(error) => error.into_response(),
            Ok(Started::Done(response)) => response,
            Ok(Started::Fresh(mut tx)) => {
                let result = {
                    let $conn: &mut PgConnection = &mut tx;
                    $effect
                };
                state.finish(tx, &scope, result).await
            }
        }
    }};
}

// ---------------------------------------------------------------------------------------------
// Fenced-out answers
// ---------------------------------------------------------------------------------------------

struct Fenced<'a> {
    resource: Resource,
    resource_id: &'a str,
    presented: i64,
    highest: i64,
    payout_id: Uuid,
    write: &'a WriteHeaders,
}

/// The 409 FENCED_OUT body is a contract (C3 §3.4): both tokens, the resource and the owner,
/// enough to alert on without a database query. Also the log event and the counter.
fn fenced_out(state: &AppState, f: Fenced<'_>) -> ApiError {
    state.metrics.fenced_out(f.resource);
    tracing::warn!(
        event = "fenced_out",
        resource = f.resource.as_str(),
        resource_id = %f.resource_id,
        payout_id = %f.payout_id,
        idempotency_key = %f.write.key,
        owner = %f.write.owner_id,
        presented_token = f.presented,
        highest_token = f.highest,
        trace = %dlock_contract::trace::current_trace_id(),
        "a write presented a token below the stored fence: a newer holder exists"
    );
    ApiError::fenced_out(
        "a newer holder's token is stored for this resource; abort the whole critical section, do not retry",
        &dlock_contract::error::FencedOutDetails {
            presented_token: f.presented,
            highest_token: f.highest,
            resource_type: Some(f.resource.as_str().to_owned()),
            resource_id: f.resource_id.to_owned(),
            owner_id: f.write.owner_id.clone(),
        },
    )
}

fn not_claimable(payout_id: Uuid, state: Option<&str>, wanted: &str) -> ApiError {
    ApiError::new(
        ErrorCode::PayoutNotClaimable,
        format!(
            "payout {payout_id} is {} and this write needs it {wanted}; retrying changes nothing",
            state.unwrap_or("in another state")
        ),
    )
    .with_details(json!({ "payoutId": payout_id, "state": state, "requiredState": wanted }))
}

fn payout_not_found(payout_id: Uuid) -> ApiError {
    ApiError::not_found(format!("payout {payout_id} does not exist"))
}

fn account_not_found(account_id: &str) -> ApiError {
    ApiError::not_found(format!("account {account_id} does not exist"))
}

fn missing(what: &str) -> ApiError {
    ApiError::internal(format!("paydb returned no {what}"))
}

// ---------------------------------------------------------------------------------------------
// Accounts
// ---------------------------------------------------------------------------------------------

async fn create_account(
    State(state): State<AppState>,
    headers: HeaderMap,
    Json(body): Json<CreateAccountRequest>,
) -> Result<Response, ApiError> {
    let mut checks = Checks::default();
    let write = write_headers(&mut checks, &headers);
    check_account_id(&mut checks, "accountId", &body.account_id);
    checks.check(
        !body.account_id.starts_with(FUNDING_PREFIX)
            && !body.account_id.starts_with(SETTLEMENT_PREFIX),
        "accountId",
        format!("{FUNDING_PREFIX}* and {SETTLEMENT_PREFIX}* are the system accounts' names"),
    );
    check_currency(&mut checks, &body.currency);
    checks.done()?;
    let write = present(write)?;
    let scope = state.scope("POST /v1/accounts".to_owned(), &write, 0, &body, false)?;
    Ok(idempotent!(&state, scope, |conn| {
        create_account_effect(conn, &body).await
    }))
}

async fn create_account_effect(
    conn: &mut PgConnection,
    body: &CreateAccountRequest,
) -> Result<Reply, ApiError> {
    match PayStore::create_account(conn, &body.account_id, &body.currency)
        .await
        .map_err(store_error)?
    {
        CreateAccountOutcome::Created | CreateAccountOutcome::Exists => {}
        CreateAccountOutcome::Conflict { currency } => {
            return Err(ApiError::new(
                ErrorCode::IdempotencyConflict,
                format!(
                    "account {} already exists with another currency or kind",
                    body.account_id
                ),
            )
            .with_details(json!({ "accountId": body.account_id, "currency": currency })));
        }
    }
    let account = PayStore::account(conn, &body.account_id)
        .await
        .map_err(store_error)?
        .ok_or_else(|| missing("account"))?;
    Reply::json(StatusCode::CREATED, &account)
}

async fn get_account(
    State(state): State<AppState>,
    Path(account_id): Path<String>,
) -> Result<Response, ApiError> {
    let mut checks = Checks::default();
    check_account_id(&mut checks, "accountId", &account_id);
    checks.done()?;
    match state
        .store
        .read_account(&account_id)
        .await
        .map_err(store_error)?
    {
        Some(account) => Ok(json_response(StatusCode::OK, &account)),
        None => Err(account_not_found(&account_id)),
    }
}

async fn fund(
    State(state): State<AppState>,
    Path(account_id): Path<String>,
    headers: HeaderMap,
    Json(body): Json<FundRequest>,
) -> Result<Response, ApiError> {
    let mut checks = Checks::default();
    let write = write_headers(&mut checks, &headers);
    check_account_id(&mut checks, "accountId", &account_id);
    check_amount(&mut checks, body.amount_minor);
    check_reference(&mut checks, "reference", &body.reference);
    checks.done()?;
    let write = present(write)?;
    let route = format!("POST /v1/accounts/{account_id}/fund");
    let scope = state.scope(route, &write, 0, &body, true)?;
    Ok(idempotent!(&state, scope, |conn| {
        fund_effect(conn, &account_id, &body).await
    }))
}

async fn fund_effect(
    conn: &mut PgConnection,
    account_id: &str,
    body: &FundRequest,
) -> Result<Reply, ApiError> {
    let outcome = PayStore::fund(conn, account_id, body.amount_minor, &body.reference)
        .await
        .map_err(store_error)?;
    let balance_minor = match outcome {
        FundOutcome::Funded { balance_minor } | FundOutcome::Exists { balance_minor } => {
            balance_minor
        }
        FundOutcome::Conflict => {
            return Err(ApiError::new(
                ErrorCode::IdempotencyConflict,
                "this funding reference was already used for another account or amount",
            )
            .with_details(json!({ "reference": body.reference })));
        }
        FundOutcome::NotFound => return Err(account_not_found(account_id)),
        FundOutcome::NotCustomer => {
            return Err(ApiError::field(
                "accountId",
                "is a system account; only customer accounts are funded",
            ));
        }
    };
    let entries = PayStore::entries(conn, &format!("fund:{}", body.reference), false)
        .await
        .map_err(store_error)?;
    Reply::json(
        StatusCode::OK,
        &FundResponse {
            account_id: account_id.to_owned(),
            reference: body.reference.clone(),
            entries,
            balance_minor,
        },
    )
}

async fn advance_fence(
    State(state): State<AppState>,
    caller: dlock_contract::auth::Caller,
    Path(account_id): Path<String>,
    headers: HeaderMap,
    Json(body): Json<FenceRequest>,
) -> Result<Response, ApiError> {
    caller.require_operator("the fence advance")?;
    let identity = identity_of(&caller);
    let mut checks = Checks::default();
    let write = write_headers(&mut checks, &headers);
    check_account_id(&mut checks, "accountId", &account_id);
    checks.check(body.floor > 0, "floor", "must be a token greater than 0");
    check_text(&mut checks, "operator", &body.operator, 1, OPERATOR_LEN_MAX);
    check_text(
        &mut checks,
        "reason",
        &body.reason,
        REASON_LEN_MIN,
        REASON_LEN_MAX,
    );
    checks.done()?;
    let write = present(write)?;
    let route = format!("POST /v1/accounts/{account_id}/fence");
    let scope = state.scope(route, &write, 0, &body, true)?;
    Ok(idempotent!(&state, scope, |conn| {
        fence_effect(conn, &account_id, &body, &write, &identity).await
    }))
}

async fn fence_effect(
    conn: &mut PgConnection,
    account_id: &str,
    body: &FenceRequest,
    write: &WriteHeaders,
    identity: &str,
) -> Result<Reply, ApiError> {
    let outcome = PayStore::advance_fence(
        conn,
        account_id,
        body.floor,
        body.operator.trim(),
        body.reason.trim(),
        body.revocation_id,
        &write.owner_id,
        identity,
    )
    .await
    .map_err(store_error)?;
    let AdvanceOutcome::Advanced(FenceMove {
        previous_fence,
        fence,
    }) = outcome
    else {
        return Err(account_not_found(account_id));
    };
    tracing::warn!(
        event = "fence_advanced",
        account_id,
        previous_fence,
        fence,
        revocation_id = %body.revocation_id,
        operator = %body.operator.trim(),
        identity,
        owner = %write.owner_id,
        "account fence advanced to a revocation floor"
    );
    Reply::json(
        StatusCode::OK,
        &FenceAdvanced {
            account_id: account_id.to_owned(),
            previous_fence,
            fence,
            revocation_id: body.revocation_id,
            operator: body.operator.trim().to_owned(),
            identity: identity.to_owned(),
        },
    )
}

/// DESIGN D-8 recovery: lowers a fence poisoned by a forged token to the token of the
/// operator's own grant on `payout:{accountId}`. Operator only; needs proof keys, because only
/// a proven grant shows that the lock server let the operator hold the key, i.e. that the
/// previous holder's lock was revoked or had lapsed, and that the token is above every token
/// issued before it. Recorded in `fence_recoveries` with the operator, the reason and the
/// authenticated identity.
async fn lower_fence(
    State(state): State<AppState>,
    caller: dlock_contract::auth::Caller,
    Path(account_id): Path<String>,
    headers: HeaderMap,
    Json(body): Json<FenceLowerRequest>,
) -> Result<Response, ApiError> {
    caller.require_operator("lowering a fence")?;
    let Some(keys) = &state.config.proof_keys else {
        return Err(dlock_contract::proof::recovery_disabled());
    };
    let token = headers::fencing_token(&headers)?;
    let mut checks = Checks::default();
    let write = write_headers(&mut checks, &headers);
    check_account_id(&mut checks, "accountId", &account_id);
    checks
        .0
        .extend(dlock_contract::proof::check_lower_request(&body));
    checks.done()?;
    let write = present(write)?;
    keys.require(
        &headers,
        &dlock_contract::proof::payout_lock_key(&account_id),
        token,
    )?;
    let identity = identity_of(&caller);
    let route = format!("POST /v1/accounts/{account_id}/fence/lower");
    let scope = state.scope(route, &write, token, &body, true)?;
    Ok(idempotent!(&state, scope, |conn| {
        lower_fence_effect(conn, &account_id, token, &body, &identity, &write).await
    }))
}

async fn lower_fence_effect(
    conn: &mut PgConnection,
    account_id: &str,
    token: i64,
    body: &FenceLowerRequest,
    identity: &str,
    write: &WriteHeaders,
) -> Result<Reply, ApiError> {
    let audit = Audit {
        operator: body.operator.trim(),
        identity,
        owner_id: &write.owner_id,
        reason: body.reason.trim(),
    };
    let (moved, recovery_id, lowered) = match PayStore::lower_fence(conn, account_id, token, &audit)
        .await
        .map_err(store_error)?
    {
        LowerOutcome::Lowered { fence, recovery_id } => (fence, recovery_id, true),
        LowerOutcome::Unchanged(fence) => (fence, None, false),
        LowerOutcome::NotFound => return Err(account_not_found(account_id)),
    };
    if lowered {
        tracing::warn!(
            event = "fence_lowered",
            account_id,
            previous_fence = moved.previous_fence,
            fence = moved.fence,
            recovery_id,
            operator = %audit.operator,
            identity,
            owner = %write.owner_id,
            "an account fence poisoned by a forged token was lowered to the operator's grant"
        );
    }
    Reply::json(
        StatusCode::OK,
        &FenceLowered {
            account_id: account_id.to_owned(),
            resource: "account".into(),
            previous_token: moved.previous_fence,
            token: moved.fence,
            lowered,
            recovery_id,
        },
    )
}

// ---------------------------------------------------------------------------------------------
// Payouts
// ---------------------------------------------------------------------------------------------

async fn create_payout(
    State(state): State<AppState>,
    headers: HeaderMap,
    Json(body): Json<CreatePayoutRequest>,
) -> Result<Response, ApiError> {
    let mut checks = Checks::default();
    let write = write_headers(&mut checks, &headers);
    check_account_id(&mut checks, "accountId", &body.account_id);
    check_amount(&mut checks, body.amount_minor);
    check_currency(&mut checks, &body.currency);
    check_reference(&mut checks, "beneficiaryRef", &body.beneficiary_ref);
    checks.done()?;
    let write = present(write)?;
    let scope = state.scope("POST /v1/payouts".to_owned(), &write, 0, &body, false)?;
    Ok(idempotent!(&state, scope, |conn| {
        create_payout_effect(conn, &body).await
    }))
}

async fn create_payout_effect(
    conn: &mut PgConnection,
    body: &CreatePayoutRequest,
) -> Result<Reply, ApiError> {
    let outcome = PayStore::create_payout(
        conn,
        body.payout_id,
        &body.account_id,
        body.amount_minor,
        &body.currency,
        &body.beneficiary_ref,
    )
    .await
    .map_err(store_error)?;
    match outcome {
        CreatePayoutOutcome::Created | CreatePayoutOutcome::Exists => {}
        CreatePayoutOutcome::Conflict => {
            return Err(ApiError::new(
                ErrorCode::IdempotencyConflict,
                format!(
                    "payout {} already exists with a different body",
                    body.payout_id
                ),
            )
            .with_details(json!({ "payoutId": body.payout_id })));
        }
        CreatePayoutOutcome::AccountUnknown => return Err(account_not_found(&body.account_id)),
        CreatePayoutOutcome::CurrencyMismatch => {
            return Err(ApiError::field(
                "currency",
                "differs from the account's currency",
            ));
        }
    }
    let payout = PayStore::payout(conn, body.payout_id)
        .await
        .map_err(store_error)?
        .ok_or_else(|| missing("payout"))?;
    Reply::json(StatusCode::CREATED, &payout)
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct ListQuery {
    state: Option<String>,
    account_id: Option<String>,
    limit: Option<String>,
    cursor: Option<String>,
}

fn query_error(rejection: QueryRejection) -> ApiError {
    let text = rejection.body_text();
    let field = text.split('`').nth(1).unwrap_or("query").to_owned();
    let reason = text
        .strip_prefix("Failed to deserialize query string: ")
        .unwrap_or(&text)
        .to_owned();
    ApiError::field(field, reason)
}

/// Cursors are opaque to callers: hex of `v1:{created_at µs}:{payout_id}`.
fn encode_cursor(created_at: DateTime<Utc>, payout_id: Uuid) -> String {
    format!("v1:{}:{payout_id}", created_at.timestamp_micros())
        .bytes()
        .map(|b| format!("{b:02x}"))
        .collect()
}

fn decode_cursor(cursor: &str) -> Option<(DateTime<Utc>, Uuid)> {
    if !cursor.len().is_multiple_of(2) || cursor.len() > 256 {
        return None;
    }
    let bytes: Option<Vec<u8>> = (0..cursor.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(cursor.get(i..i + 2)?, 16).ok())
        .collect();
    let text = String::from_utf8(bytes?).ok()?;
    let mut parts = text.split(':');
    if parts.next()? != "v1" {
        return None;
    }
    let micros = parts.next()?.parse::<i64>().ok()?;
    let payout_id = Uuid::parse_str(parts.next()?).ok()?;
    if parts.next().is_some() {
        return None;
    }
    Some((DateTime::from_timestamp_micros(micros)?, payout_id))
}

async fn list_payouts(
    State(state): State<AppState>,
    query: Result<Query<ListQuery>, QueryRejection>,
) -> Result<Response, ApiError> {
    let Query(query) = query.map_err(query_error)?;
    let mut checks = Checks::default();
    let payout_state = match &query.state {
        None => None,
        Some(text) => checks
            .take(PayoutState::parse(text).map(Some).ok_or_else(|| {
                FieldError::new(
                    "state",
                    "must be one of the eight payout states (PENDING, CLAIMED, ...)",
                )
            }))
            .flatten(),
    };
    if let Some(id) = &query.account_id {
        check_account_id(&mut checks, "accountId", id);
    }
    let limit = match &query.limit {
        None => Some(LIST_LIMIT_DEFAULT),
        Some(text) => checks.take(
            text.parse::<i64>()
                .ok()
                .filter(|n| (1..=LIST_LIMIT_MAX).contains(n))
                .ok_or_else(|| {
                    FieldError::new(
                        "limit",
                        format!("must be an integer from 1 to {LIST_LIMIT_MAX}"),
                    )
                }),
        ),
    };
    let after =
        match &query.cursor {
            None => None,
            Some(text) => checks
                .take(decode_cursor(text).map(Some).ok_or_else(|| {
                    FieldError::new("cursor", "is not a cursor this service issued")
                }))
                .flatten(),
        };
    checks.done()?;
    let limit = present(limit)?;
    let mut items = state
        .store
        .list_payouts(payout_state, query.account_id.as_deref(), limit, after)
        .await
        .map_err(store_error)?;
    let next_cursor = if items.len() as i64 > limit {
        items.truncate(limit as usize);
        items
            .last()
            .map(|p| encode_cursor(p.created_at, p.payout_id))
    } else {
        None
    };
    Ok(json_response(
        StatusCode::OK,
        &PayoutPage { items, next_cursor },
    ))
}

async fn get_payout(
    State(state): State<AppState>,
    Path(payout_id): Path<String>,
) -> Result<Response, ApiError> {
    let mut checks = Checks::default();
    let payout_id = path_payout(&mut checks, &payout_id);
    checks.done()?;
    let payout_id = present(payout_id)?;
    match state
        .store
        .read_payout(payout_id)
        .await
        .map_err(store_error)?
    {
        Some(payout) => Ok(json_response(StatusCode::OK, &payout)),
        None => Err(payout_not_found(payout_id)),
    }
}

/// DESIGN D-8: with proof keys configured, a claim or post must carry the lock server's proof of
/// its token on `payout:{accountId}` of the payout's account. Checked before the idempotency
/// record and before any fence, so a refused write leaves nothing behind. A payout that does
/// not exist is 404, as the write itself would answer.
async fn prove(
    state: &AppState,
    headers: &HeaderMap,
    payout_id: Uuid,
    token: i64,
) -> Result<(), ApiError> {
    let Some(keys) = &state.config.proof_keys else {
        return Ok(());
    };
    let account_id = state
        .store
        .payout_account(payout_id)
        .await
        .map_err(store_error)?
        .ok_or_else(|| payout_not_found(payout_id))?;
    keys.require(
        headers,
        &dlock_contract::proof::payout_lock_key(&account_id),
        token,
    )
}

async fn claim(
    State(state): State<AppState>,
    Path(payout_id): Path<String>,
    headers: HeaderMap,
    Json(body): Json<ClaimRequest>,
) -> Result<Response, ApiError> {
    let token = headers::fencing_token(&headers)?;
    let mut checks = Checks::default();
    let write = write_headers(&mut checks, &headers);
    let payout_id = path_payout(&mut checks, &payout_id);
    checks.check(
        matches!(
            body.expected_state,
            PayoutState::Pending | PayoutState::Claimed
        ),
        "expectedState",
        "must be PENDING, or CLAIMED for a recovery re-claim",
    );
    checks.done()?;
    let (write, payout_id) = (present(write)?, present(payout_id)?);
    prove(&state, &headers, payout_id, token).await?;
    let route = format!("POST /v1/payouts/{payout_id}/claim");
    let scope = state.scope(route, &write, token, &body, false)?;
    let max_attempts = state.config.max_attempts;
    let expected = body.expected_state;
    // One round trip: the idempotency record and the claim in one call (paydb 0007).
    let once = state
        .start_once(&scope, |tx, wait| {
            PayStore::claim_once(tx, &scope, wait, payout_id, expected, max_attempts)
        })
        .await;
    Ok(match once {
        Err(response) => response,
        Ok((tx, outcome)) => {
            let result = claim_effect(&state, outcome, payout_id, token, expected, &write);
            state.finish(tx, &scope, result).await
        }
    })
}

/// What the caller's credential authenticated as, for the audit rows (issue 13, item 13).
fn identity_of(caller: &dlock_contract::auth::Caller) -> String {
    caller
        .identity()
        .map_or_else(|| "anonymous".to_owned(), |i| i.name.clone())
}

fn claim_effect(
    state: &AppState,
    outcome: ClaimOutcome,
    payout_id: Uuid,
    token: i64,
    expected_state: PayoutState,
    write: &WriteHeaders,
) -> Result<Reply, ApiError> {
    match outcome {
        ClaimOutcome::Claimed {
            account_id,
            claim_token,
            fence,
            attempt_count,
        } => {
            let response = ClaimResponse {
                payout_id,
                state: PayoutState::Claimed,
                claim_token,
                account_fence: fence,
                attempt_count,
                idempotency_key: write.key.clone(),
            };
            tracing::info!(event = "payout_claimed", %payout_id, account_id = %account_id, token, owner = %write.owner_id, attempt_count = response.attempt_count, "payout claimed");
            Reply::json(StatusCode::OK, &response)
        }
        ClaimOutcome::FencedOut { account_id, fence } => Err(fenced_out(
            state,
            Fenced {
                resource: Resource::account,
                resource_id: &account_id,
                presented: token,
                highest: fence,
                payout_id,
                write,
            },
        )),
        ClaimOutcome::NotClaimable { state } => Err(not_claimable(
            payout_id,
            state.as_deref(),
            expected_state.as_str(),
        )),
        ClaimOutcome::Abandoned {
            account_id,
            attempt_count: attempts,
        } => {
            tracing::warn!(event = "payout_abandoned", %payout_id, account_id = %account_id, token, owner = %write.owner_id, attempt_count = attempts, cause = "attempts_exhausted", "a payout out of attempts was abandoned instead of claimed again");
            Err(ApiError::new(
                ErrorCode::PayoutNotClaimable,
                format!(
                    "payout {payout_id} was claimed {attempts} times, the most this service allows (payment.payout.max-attempts); it is now ABANDONED and nothing will pay it, retrying changes nothing"
                ),
            )
            .with_details(json!({
                "payoutId": payout_id,
                "state": PayoutState::Abandoned,
                "requiredState": expected_state.as_str(),
                "attemptCount": attempts,
                "cause": "attempts_exhausted",
            })))
        }
        ClaimOutcome::InsufficientFunds {
            account_id,
            available_minor,
            amount_minor,
        } => {
            tracing::info!(event = "payout_insufficient_funds", %payout_id, account_id = %account_id, owner = %write.owner_id, "claim refused for insufficient funds; payout FAILED");
            Err(ApiError::new(
                ErrorCode::InsufficientFunds,
                "the account's available balance (balance minus holds) does not cover the payout; it is now FAILED",
            )
            .with_details(json!({
                "payoutId": payout_id,
                "accountId": account_id,
                "state": PayoutState::Failed,
                "availableMinor": available_minor,
                "amountMinor": amount_minor,
            })))
        }
        ClaimOutcome::NotFound => Err(payout_not_found(payout_id)),
    }
}

async fn post_payout(
    State(state): State<AppState>,
    Path(payout_id): Path<String>,
    headers: HeaderMap,
    Json(body): Json<PostRequest>,
) -> Result<Response, ApiError> {
    let token = headers::fencing_token(&headers)?;
    let mut checks = Checks::default();
    let write = write_headers(&mut checks, &headers);
    let payout_id = path_payout(&mut checks, &payout_id);
    check_reference(&mut checks, "railReference", &body.rail_reference);
    checks.done()?;
    let (write, payout_id) = (present(write)?, present(payout_id)?);
    prove(&state, &headers, payout_id, token).await?;
    let route = format!("POST /v1/payouts/{payout_id}/post");
    let scope = state.scope(route, &write, token, &body, true)?;
    // One round trip: the idempotency record, the post and its entries in one call (paydb 0007).
    let once = state
        .start_once(&scope, |tx, wait| {
            PayStore::post_once(
                tx,
                &scope,
                wait,
                payout_id,
                &body.rail_reference,
                body.submission_id,
            )
        })
        .await;
    Ok(match once {
        Err(response) => response,
        Ok((tx, (outcome, entries))) => {
            let result = post_effect(&state, outcome, entries, payout_id, token, &write);
            state.finish(tx, &scope, result).await
        }
    })
}

fn post_effect(
    state: &AppState,
    outcome: PostOutcome,
    entries: Vec<LedgerEntry>,
    payout_id: Uuid,
    token: i64,
    write: &WriteHeaders,
) -> Result<Reply, ApiError> {
    match outcome {
        PostOutcome::Posted { balance_minor } => {
            tracing::info!(event = "payout_posted", %payout_id, token, owner = %write.owner_id, "payout posted to the ledger");
            Reply::json(
                StatusCode::OK,
                &PostResponse {
                    payout_id,
                    state: PayoutState::Posted,
                    entries,
                    balance_minor,
                },
            )
        }
        PostOutcome::FencedOut { fence } => Err(fenced_out(
            state,
            Fenced {
                resource: Resource::ledger,
                resource_id: &payout_id.to_string(),
                presented: token,
                highest: fence,
                payout_id,
                write,
            },
        )),
        PostOutcome::NotClaimable { state } => {
            Err(not_claimable(payout_id, state.as_deref(), "RAIL_ACKED"))
        }
        PostOutcome::ReferenceMismatch => Err(ApiError::validation(vec![
            FieldError::new(
                "railReference",
                "must match what the rail acknowledged for this payout",
            ),
            FieldError::new(
                "submissionId",
                "must match the submission the rail acknowledged",
            ),
        ])),
        PostOutcome::NotFound => Err(payout_not_found(payout_id)),
    }
}

async fn resolve(
    State(state): State<AppState>,
    caller: dlock_contract::auth::Caller,
    Path(payout_id): Path<String>,
    headers: HeaderMap,
    Json(body): Json<ResolveRequest>,
) -> Result<Response, ApiError> {
    caller.require_operator("resolution")?;
    let identity = identity_of(&caller);
    let mut checks = Checks::default();
    let write = write_headers(&mut checks, &headers);
    let payout_id = path_payout(&mut checks, &payout_id);
    match (&body.outcome, &body.rail_reference) {
        (_, Some(reference)) => check_reference(&mut checks, "railReference", reference),
        (Resolution::Posted, None) => checks.check(
            false,
            "railReference",
            "is required to resolve POSTED: the rail's statement names the transfer",
        ),
        (Resolution::Failed, None) => {}
    }
    check_text(&mut checks, "operator", &body.operator, 1, OPERATOR_LEN_MAX);
    check_text(&mut checks, "evidence", &body.evidence, 1, REASON_LEN_MAX);
    checks.done()?;
    let (write, payout_id) = (present(write)?, present(payout_id)?);
    let route = format!("POST /v1/payouts/{payout_id}/resolve");
    let scope = state.scope(route, &write, 0, &body, true)?;
    Ok(idempotent!(&state, scope, |conn| {
        resolve_effect(conn, payout_id, &body, &write, &identity).await
    }))
}

async fn resolve_effect(
    conn: &mut PgConnection,
    payout_id: Uuid,
    body: &ResolveRequest,
    write: &WriteHeaders,
    identity: &str,
) -> Result<Reply, ApiError> {
    let outcome = match body.outcome {
        Resolution::Posted => PayoutState::Posted,
        Resolution::Failed => PayoutState::Failed,
    };
    let resolved = PayStore::resolve(
        conn,
        payout_id,
        outcome,
        body.rail_reference.as_deref(),
        body.operator.trim(),
        body.evidence.trim(),
        &write.owner_id,
        identity,
    )
    .await
    .map_err(store_error)?;
    match resolved {
        ResolveOutcome::Resolved {
            state,
            balance_minor,
        } => {
            let entries = if outcome == PayoutState::Posted {
                PayStore::entries(conn, &format!("payout:{payout_id}"), true)
                    .await
                    .map_err(store_error)?
            } else {
                Vec::new()
            };
            tracing::warn!(event = "rail_ambiguous_resolved", %payout_id, outcome = outcome.as_str(), operator = %body.operator.trim(), identity, owner = %write.owner_id, "an ambiguous payout was resolved out of band");
            Reply::json(
                StatusCode::OK,
                &Resolved {
                    payout_id,
                    state,
                    entries,
                    balance_minor,
                    operator: body.operator.trim().to_owned(),
                    identity: identity.to_owned(),
                },
            )
        }
        ResolveOutcome::NotClaimable { state } => {
            Err(not_claimable(payout_id, state.as_deref(), "RAIL_AMBIGUOUS"))
        }
        ResolveOutcome::NotFound => Err(payout_not_found(payout_id)),
    }
}

/// The answer of a fence advance: [`FenceResponse`] and who made it, as the audit row records
/// it (the typed-in operator and the authenticated identity).
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct FenceAdvanced {
    pub account_id: String,
    pub previous_fence: i64,
    /// `max(previousFence, floor)`.
    pub fence: i64,
    pub revocation_id: Uuid,
    /// The body's operator, as typed.
    pub operator: String,
    /// What the caller's credential authenticated as; recorded beside the operator.
    pub identity: String,
}

/// The answer of a resolution: [`ResolveResponse`] and who made it.
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct Resolved {
    pub payout_id: Uuid,
    pub state: PayoutState,
    /// Two rows when resolved POSTED, none when FAILED.
    pub entries: Vec<LedgerEntry>,
    pub balance_minor: i64,
    pub operator: String,
    pub identity: String,
}

/// Not in C3 (its tables stop at P5): DESIGN §2's `cancel` transition, PENDING | CLAIMED →
/// ABANDONED. Operator only, and a fenced write like a claim (X-Fencing-Token of a grant on
/// `payout:{accountId}`, with its proof when proof keys are configured): strict `fence < token`,
/// the fence advances, so no older holder can act on the payout afterwards. paydb refuses it
/// once an attempt reached the rail proxy, and records it in `payout_abandonments`.
async fn cancel(
    State(state): State<AppState>,
    caller: dlock_contract::auth::Caller,
    Path(payout_id): Path<String>,
    headers: HeaderMap,
    Json(body): Json<CancelRequest>,
) -> Result<Response, ApiError> {
    caller.require_operator("cancelling a payout")?;
    let token = headers::fencing_token(&headers)?;
    let mut checks = Checks::default();
    let write = write_headers(&mut checks, &headers);
    let payout_id = path_payout(&mut checks, &payout_id);
    checks.check(
        matches!(
            body.expected_state,
            PayoutState::Pending | PayoutState::Claimed
        ),
        "expectedState",
        "must be PENDING or CLAIMED: only a payout that never reached the rail can be cancelled",
    );
    check_text(&mut checks, "operator", &body.operator, 1, OPERATOR_LEN_MAX);
    check_text(
        &mut checks,
        "reason",
        &body.reason,
        REASON_LEN_MIN,
        REASON_LEN_MAX,
    );
    checks.done()?;
    let (write, payout_id) = (present(write)?, present(payout_id)?);
    prove(&state, &headers, payout_id, token).await?;
    let identity = identity_of(&caller);
    let route = format!("POST /v1/payouts/{payout_id}/cancel");
    let scope = state.scope(route, &write, token, &body, false)?;
    Ok(idempotent!(&state, scope, |conn| {
        cancel_effect(&state, conn, payout_id, token, &body, &write, &identity).await
    }))
}

async fn cancel_effect(
    state: &AppState,
    conn: &mut PgConnection,
    payout_id: Uuid,
    token: i64,
    body: &CancelRequest,
    write: &WriteHeaders,
    identity: &str,
) -> Result<Reply, ApiError> {
    let audit = Audit {
        operator: body.operator.trim(),
        identity,
        owner_id: &write.owner_id,
        reason: body.reason.trim(),
    };
    let outcome = PayStore::abandon(conn, payout_id, token, body.expected_state, &audit)
        .await
        .map_err(store_error)?;
    match outcome {
        AbandonOutcome::Abandoned {
            account_id,
            fence,
            attempt_count,
        } => {
            let response = Cancelled {
                payout_id,
                state: PayoutState::Abandoned,
                account_fence: fence,
                attempt_count,
                operator: audit.operator.to_owned(),
                identity: identity.to_owned(),
            };
            tracing::warn!(event = "payout_abandoned", %payout_id, account_id = %account_id, token, owner = %write.owner_id, operator = %audit.operator, identity, cause = "cancelled", "a payout was cancelled; it is ABANDONED and nothing will pay it");
            Reply::json(StatusCode::OK, &response)
        }
        AbandonOutcome::FencedOut { account_id, fence } => Err(fenced_out(
            state,
            Fenced {
                resource: Resource::account,
                resource_id: &account_id,
                presented: token,
                highest: fence,
                payout_id,
                write,
            },
        )),
        AbandonOutcome::NotClaimable { state } => Err(not_claimable(
            payout_id,
            state.as_deref(),
            body.expected_state.as_str(),
        )),
        AbandonOutcome::NotFound => Err(payout_not_found(payout_id)),
    }
}

// ---------------------------------------------------------------------------------------------
// Health and metrics
// ---------------------------------------------------------------------------------------------

async fn healthz() -> Json<serde_json::Value> {
    Json(json!({ "status": "ok" }))
}

async fn readyz(State(state): State<AppState>) -> Response {
    match state.store.ready().await {
        Ok(()) => json_response(StatusCode::OK, &json!({ "status": "ready" })),
        Err(error) => {
            tracing::warn!(event = "not_ready", %error, "paydb check failed");
            ApiError::new(
                ErrorCode::NotLeader,
                "paydb is not ready for writes; this replica should not receive traffic",
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cursors_round_trip_and_garbage_is_refused() {
        let t = DateTime::from_timestamp_micros(1_764_692_400_123_456).unwrap_or_default();
        let id = Uuid::new_v4();
        assert_eq!(decode_cursor(&encode_cursor(t, id)), Some((t, id)));
        for bad in ["", "zz", "abc", "7631", &"00".repeat(200)] {
            assert_eq!(decode_cursor(bad), None, "{bad}");
        }
    }

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
