//! Issue 13, items 4 and 5: the executor's local deadline comes from what the lock server
//! *granted* (the lock's and the session's expiry, both possibly clamped down), and no protected
//! write starts past it, the one retry of a claim or post included (FR-11).
//!
//! The executor runs against a scripted stand-in for the lock server, the payment resource and
//! the rail proxy (one HTTP server, the three surfaces' paths), which records when each protected
//! write arrives relative to the acquire of the token it carries. The stand-in computes the
//! deadline the contract asks for from its own side: TTL × 0.7, where the TTL is the smaller of
//! the granted lock TTL and what was left of the session when the acquire arrived.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use chrono::Utc;
use dlock_contract::error::{ApiError, ErrorCode};
use dlock_contract::json::Json;
use dlock_contract::lock::{AcquireRequest, CreateSessionRequest, Heartbeat, LockGrant, Session};
use dlock_contract::payment::{
    ClaimResponse, CreatePayoutRequest, Payout, PayoutState, PostResponse,
};
use dlock_contract::rail::{SubmissionRequest, SubmissionResponse};
use dlock_executor::executor::{Endpoints, RunOptions, execute};
use dlock_executor::manifest::PayoutBatch;
use uuid::Uuid;

/// Arrival of a write is a few milliseconds after the executor's check; this much is allowed.
const SLACK: Duration = Duration::from_millis(40);

#[derive(Clone, Copy, Default)]
struct Script {
    /// The server's `lock.ttl-max`: the granted lock TTL is the smaller of this and the request.
    lock_ttl_max_ms: i64,
    /// The server's `lock.session.ttl-max`.
    session_ttl_max_ms: i64,
    /// How long the rail takes to acknowledge.
    submit_delay: Duration,
    /// The first claim waits this long and then answers 503 NOT_LEADER.
    claim_503_after: Option<Duration>,
    /// The first post waits this long and then answers 503 NOT_LEADER.
    post_503_after: Option<Duration>,
}

#[derive(Default)]
struct World {
    next_token: i64,
    /// token → (when the acquire arrived, the deadline the contract gives it)
    grants: HashMap<i64, (Instant, Instant)>,
    /// session → (granted TTL, expiry)
    sessions: HashMap<Uuid, (i64, Instant)>,
    payouts: HashMap<Uuid, Payout>,
    claim_failed: bool,
    post_failed: bool,
    violations: Vec<String>,
    writes: Vec<String>,
}

#[derive(Clone)]
struct Fake {
    script: Script,
    world: Arc<Mutex<World>>,
}

impl Fake {
    fn world(&self) -> std::sync::MutexGuard<'_, World> {
        self.world.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Records a protected write and whether it started inside its token's deadline.
    fn protected(&self, what: &str, headers: &HeaderMap) {
        let now = Instant::now();
        let token: i64 = headers
            .get("x-fencing-token")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse().ok())
            .unwrap_or_default();
        let mut world = self.world();
        let Some(&(acquired, deadline)) = world.grants.get(&token) else {
            world
                .violations
                .push(format!("{what} with token {token} that was never granted"));
            return;
        };
        let at = now.duration_since(acquired).as_millis();
        world.writes.push(format!("{what}@{at}ms(token {token})"));
        if now > deadline + SLACK {
            let allowed = deadline.duration_since(acquired).as_millis();
            world.violations.push(format!(
                "{what} with token {token} started {at} ms after its acquire, past its deadline of {allowed} ms"
            ));
        }
    }

    fn session_live(&self, world: &mut World, session: Uuid, what: &str) -> Result<(), ApiError> {
        match world.sessions.get(&session) {
            Some(&(_, expires)) if Instant::now() < expires => Ok(()),
            Some(_) => {
                world
                    .violations
                    .push(format!("{what} on session {session} after it lapsed"));
                Err(ApiError::new(ErrorCode::SessionExpired, "lapsed"))
            }
            None => Err(ApiError::new(ErrorCode::SessionUnknown, "unknown")),
        }
    }
}

fn ms(ms: i64) -> Duration {
    Duration::from_millis(ms.max(0) as u64)
}

async fn create_session(
    State(fake): State<Fake>,
    Json(body): Json<CreateSessionRequest>,
) -> Response {
    let granted = body
        .ttl_millis
        .unwrap_or(15_000)
        .min(fake.script.session_ttl_max_ms);
    let id = Uuid::new_v4();
    fake.world()
        .sessions
        .insert(id, (granted, Instant::now() + ms(granted)));
    let session = Session {
        session_id: id,
        owner_id: body.owner_id.unwrap_or_else(|| "worker".into()),
        ttl_millis: granted,
        expires_at: Utc::now() + chrono::Duration::milliseconds(granted),
    };
    (StatusCode::CREATED, axum::Json(session)).into_response()
}

async fn heartbeat(
    State(fake): State<Fake>,
    Path(id): Path<Uuid>,
) -> Result<axum::Json<Heartbeat>, ApiError> {
    let mut world = fake.world();
    fake.session_live(&mut world, id, "heartbeat")?;
    let Some(entry) = world.sessions.get_mut(&id) else {
        return Err(ApiError::new(ErrorCode::SessionUnknown, "unknown"));
    };
    entry.1 = Instant::now() + ms(entry.0);
    let now = Utc::now();
    Ok(axum::Json(Heartbeat {
        session_id: id,
        expires_at: now + chrono::Duration::milliseconds(entry.0),
        server_time: now,
        held_lock_count: 0,
    }))
}

async fn acquire(
    State(fake): State<Fake>,
    Path(key): Path<String>,
    headers: HeaderMap,
    Json(body): Json<AcquireRequest>,
) -> Result<axum::Json<LockGrant>, ApiError> {
    let now = Instant::now();
    let mut world = fake.world();
    fake.session_live(&mut world, body.session_id, "acquire")?;
    let session_expires = world
        .sessions
        .get(&body.session_id)
        .map(|s| s.1)
        .unwrap_or(now);
    let ttl = body
        .ttl_millis
        .unwrap_or(10_000)
        .min(fake.script.lock_ttl_max_ms);
    let lease_end = (now + ms(ttl)).min(session_expires);
    let deadline = now + lease_end.duration_since(now).mul_f64(0.7);
    world.next_token += 1;
    let token = world.next_token;
    world.grants.insert(token, (now, deadline));
    let acquired_at = Utc::now();
    Ok(axum::Json(LockGrant {
        key,
        owner_id: headers
            .get("x-owner-id")
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_owned(),
        session_id: body.session_id,
        fencing_token: token,
        acquired_at,
        expires_at: acquired_at + chrono::Duration::milliseconds(ttl),
        fencing_proof: None,
    }))
}

async fn no_content() -> StatusCode {
    StatusCode::NO_CONTENT
}

async fn create_payout(
    State(fake): State<Fake>,
    Json(body): Json<CreatePayoutRequest>,
) -> Response {
    let now = Utc::now();
    let payout = Payout {
        payout_id: body.payout_id,
        account_id: body.account_id,
        amount_minor: body.amount_minor,
        currency: body.currency,
        beneficiary_ref: body.beneficiary_ref,
        state: PayoutState::Pending,
        attempt_count: 0,
        claim_token: None,
        rail_reference: None,
        submission_id: None,
        created_at: now,
        updated_at: now,
        submissions: Vec::new(),
    };
    fake.world()
        .payouts
        .insert(payout.payout_id, payout.clone());
    (StatusCode::CREATED, axum::Json(payout)).into_response()
}

async fn get_payout(
    State(fake): State<Fake>,
    Path(id): Path<Uuid>,
) -> Result<axum::Json<Payout>, ApiError> {
    fake.world()
        .payouts
        .get(&id)
        .cloned()
        .map(axum::Json)
        .ok_or_else(|| ApiError::not_found("no such payout"))
}

async fn claim(
    State(fake): State<Fake>,
    Path(id): Path<Uuid>,
    headers: HeaderMap,
) -> Result<axum::Json<ClaimResponse>, ApiError> {
    fake.protected("claim", &headers);
    let fail_first = {
        let mut world = fake.world();
        let first = !world.claim_failed;
        world.claim_failed = true;
        first
    };
    if let (true, Some(delay)) = (fail_first, fake.script.claim_503_after) {
        tokio::time::sleep(delay).await;
        return Err(ApiError::new(ErrorCode::NotLeader, "paydb is away"));
    }
    let token: i64 = headers
        .get("x-fencing-token")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok())
        .unwrap_or_default();
    let mut world = fake.world();
    let payout = world
        .payouts
        .get_mut(&id)
        .ok_or_else(|| ApiError::not_found("no such payout"))?;
    payout.state = PayoutState::Claimed;
    payout.attempt_count += 1;
    payout.claim_token = Some(token);
    Ok(axum::Json(ClaimResponse {
        payout_id: id,
        state: PayoutState::Claimed,
        claim_token: token,
        account_fence: token,
        attempt_count: payout.attempt_count,
        idempotency_key: String::new(),
    }))
}

async fn post_payout(
    State(fake): State<Fake>,
    Path(id): Path<Uuid>,
    headers: HeaderMap,
) -> Result<axum::Json<PostResponse>, ApiError> {
    fake.protected("post", &headers);
    let fail_first = {
        let mut world = fake.world();
        let first = !world.post_failed;
        world.post_failed = true;
        first
    };
    if let (true, Some(delay)) = (fail_first, fake.script.post_503_after) {
        tokio::time::sleep(delay).await;
        return Err(ApiError::new(ErrorCode::NotLeader, "paydb is away"));
    }
    let mut world = fake.world();
    let payout = world
        .payouts
        .get_mut(&id)
        .ok_or_else(|| ApiError::not_found("no such payout"))?;
    payout.state = PayoutState::Posted;
    Ok(axum::Json(PostResponse {
        payout_id: id,
        state: PayoutState::Posted,
        entries: Vec::new(),
        balance_minor: 0,
    }))
}

async fn submit(
    State(fake): State<Fake>,
    headers: HeaderMap,
    Json(body): Json<SubmissionRequest>,
) -> Result<axum::Json<SubmissionResponse>, ApiError> {
    fake.protected("submit", &headers);
    let submitted_at = Utc::now();
    tokio::time::sleep(fake.script.submit_delay).await;
    let submission_id = Uuid::new_v4();
    let reference = format!("rail-{}", body.payout_id.simple());
    let mut world = fake.world();
    if let Some(payout) = world.payouts.get_mut(&body.payout_id) {
        payout.state = PayoutState::RailAcked;
        payout.rail_reference = Some(reference.clone());
        payout.submission_id = Some(submission_id);
    }
    Ok(axum::Json(SubmissionResponse {
        submission_id,
        payout_id: body.payout_id,
        presented_token: 0,
        outcome: "ACKED".into(),
        rail_reference: reference,
        submitted_at,
        resolved_at: Utc::now(),
    }))
}

async fn serve(fake: Fake) -> String {
    let app = Router::new()
        .route("/v1/sessions", post(create_session))
        .route("/v1/sessions/{id}/heartbeat", post(heartbeat))
        .route("/v1/sessions/{id}", axum::routing::delete(no_content))
        .route("/v1/locks/{key}/acquire", post(acquire))
        .route("/v1/locks/{key}", axum::routing::delete(no_content))
        .route("/v1/payouts", post(create_payout))
        .route("/v1/payouts/{id}", get(get_payout))
        .route("/v1/payouts/{id}/claim", post(claim))
        .route("/v1/payouts/{id}/post", post(post_payout))
        .route("/v1/rail/submissions", post(submit))
        .with_state(fake);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .unwrap_or_else(|e| panic!("bind: {e}"));
    let addr = listener.local_addr().unwrap_or_else(|e| panic!("{e}"));
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    format!("http://{addr}")
}

const BATCH: &str = r#"
apiVersion: dlock.io/v1alpha1
kind: PayoutBatch
metadata:
  name: deadline
spec:
  payouts:
    - key: one
      accountId: acct-1
      amountMinor: 100
      currency: EUR
      beneficiaryRef: ben-1
"#;

/// Runs one payout through the executor against the scripted stand-in; returns what it saw.
async fn run(script: Script, options: RunOptions) -> (Vec<String>, Vec<String>, PayoutState) {
    let fake = Fake {
        script,
        world: Arc::default(),
    };
    let url = serve(fake.clone()).await;
    let batch = PayoutBatch::parse(BATCH).unwrap_or_else(|e| panic!("{e}"));
    let endpoints = Endpoints {
        lock_server: url.clone(),
        payment_resource: url.clone(),
        rail_proxy: url,
    };
    let report = execute(
        &batch,
        &endpoints,
        RunOptions {
            workers: 1,
            settle_timeout: Duration::from_secs(30),
            ..options
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e:#}"));
    assert!(report.complete, "the batch did not settle: {report:?}");
    let world = fake.world();
    let state = world
        .payouts
        .values()
        .next()
        .map(|p| p.state)
        .unwrap_or(PayoutState::Pending);
    (world.violations.clone(), world.writes.clone(), state)
}

/// Item 4: the server clamps the lock TTL (10 s asked, 1 s granted). The deadline is 0.7 × the
/// granted second, so the post after a 900 ms submit belongs to the next lock cycle.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_deadline_follows_the_granted_lock_ttl_not_the_requested_one() {
    let (violations, writes, state) = run(
        Script {
            lock_ttl_max_ms: 1_000,
            session_ttl_max_ms: 60_000,
            submit_delay: Duration::from_millis(900),
            ..Script::default()
        },
        RunOptions {
            lock_ttl_ms: 10_000,
            session_ttl_ms: 15_000,
            ..RunOptions::default()
        },
    )
    .await;
    assert!(violations.is_empty(), "{violations:#?}\nwrites: {writes:?}");
    assert_eq!(state, PayoutState::Posted, "writes: {writes:?}");
}

/// Item 4: the server clamps the session TTL (15 s asked, 1.5 s granted). Heartbeats follow the
/// granted TTL, so the session never lapses, and the deadline is bounded by the session's expiry
/// when it comes before the lock's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heartbeats_and_the_deadline_follow_the_granted_session_ttl() {
    let (violations, writes, state) = run(
        Script {
            lock_ttl_max_ms: 60_000,
            session_ttl_max_ms: 1_500,
            submit_delay: Duration::from_millis(1_200),
            ..Script::default()
        },
        RunOptions {
            lock_ttl_ms: 10_000,
            session_ttl_ms: 15_000,
            ..RunOptions::default()
        },
    )
    .await;
    assert!(violations.is_empty(), "{violations:#?}\nwrites: {writes:?}");
    assert_eq!(state, PayoutState::Posted, "writes: {writes:?}");
}

/// Item 5: the first claim and the first post each take 750 ms and answer 503 under a 700 ms
/// deadline (1 s granted). The one retry they allow must not start past the deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_one_retry_of_a_claim_or_post_never_starts_past_the_deadline() {
    let (violations, writes, state) = run(
        Script {
            lock_ttl_max_ms: 1_000,
            session_ttl_max_ms: 60_000,
            submit_delay: Duration::ZERO,
            claim_503_after: Some(Duration::from_millis(750)),
            post_503_after: Some(Duration::from_millis(750)),
        },
        RunOptions {
            lock_ttl_ms: 1_000,
            session_ttl_ms: 15_000,
            ..RunOptions::default()
        },
    )
    .await;
    assert!(violations.is_empty(), "{violations:#?}\nwrites: {writes:?}");
    assert_eq!(state, PayoutState::Posted, "writes: {writes:?}");
    assert!(
        writes.iter().filter(|w| w.starts_with("claim")).count() >= 2
            && writes.iter().filter(|w| w.starts_with("post")).count() >= 2,
        "the scripted 503s were not exercised: {writes:?}"
    );
}
