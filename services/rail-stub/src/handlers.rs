//! POST /submit (the dice, the latency, the answer) and GET /statement.

use std::path::PathBuf;
use std::time::Duration;

use axum::extract::{RawQuery, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use chrono::Utc;
use dlock_contract::error::{ApiError, ErrorBody, ErrorCode};
use dlock_contract::http::json_response;
use dlock_contract::json::Json;
use dlock_server::auth::{AuthMode, Caller};
use rand::Rng;
use serde_json::json;

use crate::ledger::Ledger;
use crate::{RailStubConfig, SUBMITTERS_KEY, Statement, StubState, SubmitRequest, Transfer};

fn new_reference() -> String {
    format!("rail-{}", uuid::Uuid::new_v4().simple())
}

/// What the dice decided for one call, drawn before the latency so it cannot depend on timing.
enum Fate {
    Fail5xx,
    Drop { accepted: bool },
    Decline,
    Redirect,
    Accept,
}

fn draw(config: &RailStubConfig) -> Fate {
    let mut rng = rand::rng();
    if rng.random_bool(config.failure_rate) {
        if rng.random_bool(0.5) {
            Fate::Fail5xx
        } else {
            Fate::Drop {
                accepted: rng.random_bool(0.5),
            }
        }
    } else if rng.random_bool(config.decline_rate) {
        Fate::Decline
    } else if rng.random_bool(config.redirect_rate) {
        Fate::Redirect
    } else {
        Fate::Accept
    }
}

/// One transfer; every accepted call is a fresh transfer.
#[utoipa::path(post, path = "/submit", request_body = SubmitRequest, responses(
    (status = 200, description = "accepted: railReference, acceptedAt", body = serde_json::Value),
    (status = 400, description = "VALIDATION_FAILED", body = ErrorBody),
    (status = 401, description = "UNAUTHENTICATED: no credential, or one that authenticates nobody", body = ErrorBody),
    (status = 403, description = "FORBIDDEN: the identity is not in rail.stub.submitter-identities", body = ErrorBody),
    (status = 402, description = "declined (the rail's own body, not the envelope)", body = serde_json::Value),
    (status = 502, description = "the rail failed (the rail's own body, not the envelope)", body = serde_json::Value),
))]
// A real rail keeps processing a transfer whose caller hung up, so the work runs in its own
// task: a proxy that dies mid-flight cannot cancel it. Only a submitter identity gets that far.
pub(crate) async fn submit(
    State(state): State<StubState>,
    caller: Caller,
    Json(body): Json<SubmitRequest>,
) -> Result<Response, ApiError> {
    require_submitter(&state.config, &caller)?;
    tokio::spawn(process(state, body))
        .await
        .unwrap_or_else(|e| Err(ApiError::internal(format!("the transfer task failed: {e}"))))
}

/// The auth middleware has already refused a missing or unknown credential (401); here an
/// authenticated identity that is not the rail proxy's is refused (403) before anything is
/// recorded. With `auth.mode = "none"` nobody is identified and anyone may submit.
fn require_submitter(config: &RailStubConfig, caller: &Caller) -> Result<(), ApiError> {
    if config.auth.mode() == AuthMode::None {
        return Ok(());
    }
    let name = caller.identity().map_or("", |i| i.name.as_str());
    if config.submitters.iter().any(|s| s == name) {
        return Ok(());
    }
    tracing::warn!(
        event = "rail_submit_refused",
        identity = name,
        "a transfer from an identity that is not a submitter was refused"
    );
    Err(ApiError::new(
        ErrorCode::Forbidden,
        format!(
            "`{name}` may not submit transfers: only the rail proxy may \
             ({SUBMITTERS_KEY}); nothing was accepted"
        ),
    ))
}

async fn process(state: StubState, body: SubmitRequest) -> Result<Response, ApiError> {
    check(&body)?;
    let config = state.config.clone();
    let fate = draw(&config);
    let jitter = if config.latency_jitter_ms > 0 {
        rand::rng().random_range(0..=config.latency_jitter_ms)
    } else {
        0
    };
    if config.latency_ms + jitter > 0 {
        tokio::time::sleep(Duration::from_millis(config.latency_ms + jitter)).await;
    }
    answer(state, &config, fate, body).await
}

/// The transfer's fields, checked before the dice are thrown.
fn check(body: &SubmitRequest) -> Result<(), ApiError> {
    if body.client_ref.is_empty() || body.client_ref.len() > 128 {
        return Err(ApiError::field("clientRef", "must be 1 to 128 characters"));
    }
    if body.amount_minor <= 0 {
        return Err(ApiError::field("amountMinor", "must be greater than 0"));
    }
    if body.currency.len() != 3 || !body.currency.bytes().all(|b| b.is_ascii_uppercase()) {
        return Err(ApiError::field("currency", "must be an ISO-4217 code"));
    }
    Ok(())
}

/// What the rail does and answers, as the dice decided.
async fn answer(
    state: StubState,
    config: &RailStubConfig,
    fate: Fate,
    body: SubmitRequest,
) -> Result<Response, ApiError> {
    match fate {
        Fate::Fail5xx => Ok(json_response(
            StatusCode::BAD_GATEWAY,
            &json!({"code": "RAIL_INTERNAL", "message": "the rail failed; nothing was accepted"}),
        )),
        Fate::Decline => Ok(json_response(
            StatusCode::PAYMENT_REQUIRED,
            &json!({"code": "DECLINED", "message": "the rail declined the transfer"}),
        )),
        Fate::Drop { accepted } => {
            if accepted {
                record(&state, &body).await?;
            }
            // Hold the connection open, then give up on it without a proper answer.
            tokio::time::sleep(Duration::from_millis(config.hang_ms)).await;
            Ok((
                StatusCode::OK,
                [("connection", "close")],
                "{\"railRef", // a torn, malformed acknowledgement
            )
                .into_response())
        }
        Fate::Redirect => {
            record(&state, &body).await?;
            Ok((
                StatusCode::TEMPORARY_REDIRECT,
                [("location", "/submit")],
                "",
            )
                .into_response())
        }
        Fate::Accept => accept(state, config, &body).await,
    }
}

/// Takes the transfer onto the ledger under a new reference, whatever the caller hears.
async fn record(state: &StubState, body: &SubmitRequest) -> Result<Transfer, ApiError> {
    let mut transfer = transfer(body, new_reference());
    with_ledger(state, "accept", move |ledger| {
        // Accepted when it reaches the statement, not when it started to wait for it.
        transfer.accepted_at = Utc::now();
        ledger.accept(transfer)
    })
    .await
}

/// A statement operation slower than this is logged: the transfers behind it waited as long.
const SLOW_LEDGER: Duration = Duration::from_millis(500);

/// Runs `op` on the ledger on a blocking thread, once the ledger is free. The statement's write
/// and, every so many accepts, the index's durable commit (an fsync) wait on the disk; on the
/// runtime's own threads that wait would stall every other request, readiness included.
async fn with_ledger<T: Send + 'static>(
    state: &StubState,
    what: &'static str,
    op: impl FnOnce(&mut Ledger) -> anyhow::Result<T> + Send + 'static,
) -> Result<T, ApiError> {
    let mut ledger = state.ledger.clone().lock_owned().await;
    let started = std::time::Instant::now();
    let out = tokio::task::spawn_blocking(move || op(&mut ledger))
        .await
        .map_err(|e| ApiError::internal(format!("the statement task failed: {e}")))?;
    let took = started.elapsed();
    if took > SLOW_LEDGER {
        tracing::warn!(
            event = "statement_slow",
            op = what,
            ms = took.as_millis() as u64,
            "a statement operation waited on the disk; every transfer behind it waited as long \
             (a rail proxy whose read timeout is shorter marks them RAIL_AMBIGUOUS): check the \
             disk under the statement's volume"
        );
    }
    out.map_err(ApiError::internal)
}

/// A transfer of the body's amount under a new reference, accepted now.
fn transfer(body: &SubmitRequest, reference: String) -> Transfer {
    Transfer {
        client_ref: body.client_ref.clone(),
        rail_reference: reference,
        amount_minor: body.amount_minor,
        currency: body.currency.clone(),
        accepted_at: Utc::now(),
    }
}

/// Accepted: a fresh transfer, or (a repeat the rail does not take again) the first one's answer.
async fn accept(
    state: StubState,
    config: &RailStubConfig,
    body: &SubmitRequest,
) -> Result<Response, ApiError> {
    let mut fresh = transfer(body, new_reference());
    let duplicate_ack_rate = config.duplicate_ack_rate;
    let accepted = with_ledger(&state, "accept", move |ledger| {
        fresh.accepted_at = Utc::now();
        match ledger.first(&fresh.client_ref)? {
            // A repeat that the rail does not take again answers with the first reference.
            Some(first) if !rand::rng().random_bool(duplicate_ack_rate) => Ok(first),
            _ => ledger.accept(fresh),
        }
    })
    .await?;
    Ok(json_response(
        StatusCode::OK,
        &json!({
            "railReference": accepted.rail_reference,
            "acceptedAt": dlock_contract::time::format(&accepted.accepted_at),
        }),
    ))
}

/// Ready.
#[utoipa::path(get, path = "/readyz", responses((status = 200, body = serde_json::Value)))]
pub(crate) async fn readyz() -> Json<serde_json::Value> {
    dlock_server::http::healthz().await
}

/// The durable statement, optionally for one clientRef. Readable without a credential: it
/// shows transfers, it cannot make one (docs/threat-model.md).
#[utoipa::path(get, path = "/statement", params(("clientRef" = Option<String>, Query)), responses(
    (status = 200, body = Statement),
    (status = 400, description = "VALIDATION_FAILED", body = ErrorBody),
))]
pub(crate) async fn statement(
    State(state): State<StubState>,
    RawQuery(query): RawQuery,
) -> Result<Response, ApiError> {
    let mut client_ref = None;
    for pair in query
        .as_deref()
        .unwrap_or("")
        .split('&')
        .filter(|p| !p.is_empty())
    {
        match pair.split_once('=') {
            Some(("clientRef", v)) => client_ref = Some(v.to_owned()),
            _ => {
                return Err(ApiError::new(
                    ErrorCode::ValidationFailed,
                    "the only query parameter is clientRef",
                ));
            }
        }
    }
    match client_ref {
        Some(r) => {
            let transfers =
                with_ledger(&state, "statement", move |ledger| ledger.all_for(&r)).await?;
            Ok(Json(Statement { transfers }).into_response())
        }
        None => {
            let (path, len) = {
                let ledger = state.ledger.lock().await;
                (ledger.path.clone(), ledger.len)
            };
            stream_statement(path, len)
        }
    }
}

/// The whole statement, read from the file up to `len` (its end when asked) and sent as it is
/// read: the response has the shape of [`Statement`], and memory holds a few chunks of it.
fn stream_statement(path: PathBuf, len: u64) -> Result<Response, ApiError> {
    use std::io::BufRead;
    let file = std::fs::File::open(&path).map_err(|e| {
        ApiError::internal(format!("cannot open the statement {}: {e}", path.display()))
    })?;
    let (tx, rx) = tokio::sync::mpsc::channel::<std::io::Result<Vec<u8>>>(4);
    tokio::task::spawn_blocking(move || {
        use std::io::Read;
        const CHUNK: usize = 64 * 1024;
        let mut reader = std::io::BufReader::new(file).take(len);
        let mut out = b"{\"transfers\":[".to_vec();
        let mut first = true;
        let mut line = Vec::new();
        loop {
            line.clear();
            match reader.read_until(b'\n', &mut line) {
                Ok(0) => break,
                Ok(_) => {}
                Err(e) => {
                    let _ = tx.blocking_send(Err(e));
                    return;
                }
            }
            // Each line is re-encoded from its Transfer, so the answer is exactly what the
            // statement type serializes to; unreadable lines were never accepted transfers.
            let Ok(transfer) = serde_json::from_slice::<Transfer>(line.trim_ascii_end()) else {
                continue;
            };
            if !first {
                out.push(b',');
            }
            first = false;
            if let Err(e) = serde_json::to_writer(&mut out, &transfer) {
                let _ = tx.blocking_send(Err(std::io::Error::other(e)));
                return;
            }
            if out.len() >= CHUNK && tx.blocking_send(Ok(std::mem::take(&mut out))).is_err() {
                return; // the client went away
            }
        }
        out.extend_from_slice(b"]}");
        let _ = tx.blocking_send(Ok(out));
    });
    let body = futures::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|chunk| (chunk, rx))
    });
    Ok((
        StatusCode::OK,
        [(
            axum::http::header::CONTENT_TYPE,
            dlock_contract::http::JSON_CONTENT_TYPE,
        )],
        axum::body::Body::from_stream(body),
    )
        .into_response())
}
