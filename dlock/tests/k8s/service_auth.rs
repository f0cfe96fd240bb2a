//! A dlock service in `auth.mode = "tokenreview"` against the real API server
//! (docs/contract.md#authorization): projected tokens for the `dlock` audience get in, others are
//! refused; the service's own credential needs `system:auth-delegator`; a flood of made-up tokens
//! costs the API server no more TokenReviews than the burst, counted on the API server's own
//! /metrics.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use dlock_devstack::{ManagedChild, free_port};
use reqwest::header::{CONTENT_TYPE, RETRY_AFTER};
use serde_json::Value;

use crate::world::{World, serve};

const JSON: &str = "application/json; charset=utf-8";
const NS: &str = "service-auth";
/// The stub's own ServiceAccount (what the chart and the operator give every service).
const SERVICE_ACCOUNT: &str = "rail-stub";
/// A caller, as an executor Job's pod would be.
const CALLER: &str = "executor";
const BURST: u64 = 3;
const FLOOD: usize = 30;

/// `dlock serve rail-stub` with a config file, in tokenreview mode against the cluster.
struct Stub {
    url: String,
    log: PathBuf,
    _child: ManagedChild,
}

fn start_stub(
    world: &World,
    name: &str,
    api: &(String, PathBuf),
    own_token: &Path,
    limits: &[(&str, u64)],
) -> Stub {
    let dir = world.cluster.dir().join(name);
    std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("{e}"));
    let port = free_port().unwrap_or_else(|e| panic!("{e}"));
    let mut config = format!(
        "\"server.listen\" = \"127.0.0.1:{port}\"\n\
         \"rail.stub.statement-path\" = {:?}\n\
         \"auth.mode\" = \"tokenreview\"\n\
         \"auth.tokenreview.url\" = {:?}\n\
         \"auth.tokenreview.ca-file\" = {:?}\n\
         \"auth.tokenreview.token-file\" = {:?}\n\
         \"auth.tokenreview.audiences\" = [\"dlock\"]\n\
         \"rail.stub.submitter-identities\" = [\"system:serviceaccount:{NS}:{CALLER}\"]\n",
        dir.join("statement.jsonl").display().to_string(),
        api.0,
        api.1.display().to_string(),
        own_token.display().to_string(),
    );
    for (key, value) in limits {
        config.push_str(&format!("\"auth.tokenreview.{key}\" = {value}\n"));
    }
    let (child, log) = serve(
        name,
        "rail-stub",
        &dir,
        &config,
        port,
        Duration::from_secs(30),
    );
    Stub {
        url: format!("http://127.0.0.1:{port}"),
        log,
        _child: child,
    }
}

/// `kubectl create token` for a ServiceAccount of [`NS`].
fn token(world: &World, account: &str, audience: Option<&str>) -> String {
    let mut args = vec!["create", "token", account, "-n", NS, "--duration=1h"];
    if let Some(audience) = audience {
        args.extend_from_slice(&["--audience", audience]);
    }
    world.kubectl(&args).trim().to_owned()
}

/// TokenReviews the API server has answered so far, by its own `apiserver_request_total`.
fn tokenreviews(world: &World) -> u64 {
    let metrics = world.kubectl(&["get", "--raw", "/metrics"]);
    metrics
        .lines()
        .filter(|l| {
            l.starts_with("apiserver_request_total{") && l.contains("resource=\"tokenreviews\"")
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>() as u64
}

struct Answer {
    status: u16,
    content_type: String,
    retry_after: Option<String>,
    body: Value,
}

async fn submit(http: &reqwest::Client, stub: &Stub, bearer: &str, client_ref: &str) -> Answer {
    let response = http
        .post(format!("{}/submit", stub.url))
        .header("authorization", format!("Bearer {bearer}"))
        .header(CONTENT_TYPE, "application/json")
        .body(format!(
            r#"{{"clientRef":"{client_ref}","amountMinor":100,"currency":"EUR"}}"#
        ))
        .send()
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let status = response.status().as_u16();
    let header = |name| {
        response
            .headers()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
    };
    let content_type = header(CONTENT_TYPE).unwrap_or_default();
    let retry_after = header(RETRY_AFTER);
    let text = response.text().await.unwrap_or_default();
    let body = serde_json::from_str(&text)
        .unwrap_or_else(|e| panic!("the body of a {status} is not JSON ({e}): {text}"));
    Answer {
        status,
        content_type,
        retry_after,
        body,
    }
}

/// The contract's envelope with `status` and `code`, in JSON with its charset.
fn assert_refused(step: &str, answer: &Answer, status: u16, code: &str) {
    assert_eq!(answer.status, status, "{step}: {}", answer.body);
    assert_eq!(answer.content_type, JSON, "{step}");
    assert_eq!(answer.body["code"], code, "{step}: {}", answer.body);
    assert!(
        answer.body["message"]
            .as_str()
            .is_some_and(|m| !m.is_empty()),
        "{step}: {}",
        answer.body
    );
    assert!(
        answer.body["retrySafe"].is_boolean(),
        "{step}: {}",
        answer.body
    );
}

/// Each answer of a flood refused: 401 UNAUTHENTICATED (its token reviewed) or 503
/// AUTH_UNAVAILABLE (throttled, then checked by `throttled_check`); how many of each.
fn tally_flood(answers: &[Answer], throttled_check: impl Fn(usize, &Answer)) -> (u64, u64) {
    let mut unauthenticated = 0u64;
    let mut throttled = 0u64;
    for (n, answer) in answers.iter().enumerate() {
        match answer.status {
            401 => {
                assert_refused(&format!("flood {n}"), answer, 401, "UNAUTHENTICATED");
                unauthenticated += 1;
            }
            _ => {
                assert_refused(&format!("flood {n}"), answer, 503, "AUTH_UNAVAILABLE");
                throttled_check(n, answer);
                throttled += 1;
            }
        }
    }
    (unauthenticated, throttled)
}

/// Submits as `caller` until the stub's TokenReviews are allowed (the ClusterRoleBinding of
/// `system:auth-delegator` has reached RBAC): 503 AUTH_UNAVAILABLE until then, at most 30 s.
/// The number of the attempt that was paid; its clientRef is `<prefix>-<attempt>`.
async fn until_bound(http: &reqwest::Client, stub: &Stub, caller: &str, prefix: &str) -> u32 {
    let bound_at = Instant::now();
    let mut attempt = 0;
    loop {
        attempt += 1;
        let answer = submit(http, stub, caller, &format!("{prefix}-{attempt}")).await;
        if answer.status == 200 {
            return attempt;
        }
        assert_refused(
            "until RBAC sees the binding",
            &answer,
            503,
            "AUTH_UNAVAILABLE",
        );
        assert!(
            bound_at.elapsed() < Duration::from_secs(30),
            "the binding never took effect"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn statement_refs(http: &reqwest::Client, stub: &Stub) -> Vec<String> {
    let statement: Value = http
        .get(format!("{}/statement", stub.url))
        .send()
        .await
        .unwrap_or_else(|e| panic!("{e}"))
        .json()
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    statement["transfers"]
        .as_array()
        .map(|t| {
            t.iter()
                .filter_map(|t| t["clientRef"].as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default()
}

/// The chart's binding (charts/dlock/templates/rbac.yaml): the stub's service account may create
/// tokenreviews.
fn bind_auth_delegator(world: &World) {
    world.kubectl(&[
        "create",
        "clusterrolebinding",
        "rail-stub-auth-delegator",
        "--clusterrole=system:auth-delegator",
        &format!("--serviceaccount={NS}:{SERVICE_ACCOUNT}"),
    ]);
}

/// The real API server with namespace NS, the stub's service account and the caller's; the
/// API server's URL and CA, and a file holding the stub's own token.
async fn tokenreview_world() -> (World, (String, PathBuf), PathBuf) {
    let world = World::start().await;
    world.namespace(NS);
    world.kubectl(&["create", "serviceaccount", SERVICE_ACCOUNT, "-n", NS]);
    world.kubectl(&["create", "serviceaccount", CALLER, "-n", NS]);
    let api = world.api_server(NS);
    let own_token = world.cluster.dir().join("rail-stub-sa-token");
    std::fs::write(&own_token, token(&world, SERVICE_ACCOUNT, None))
        .unwrap_or_else(|e| panic!("{e}"));
    (world, api, own_token)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn tokenreview_against_the_real_api_server_admits_dlock_tokens_and_bounds_a_flood() {
    let (world, api, own_token) = tokenreview_world().await;
    let http = dlock_contract::client::http_client().unwrap_or_else(|e| panic!("{e}"));
    let caller = token(&world, CALLER, Some("dlock"));
    let api_authority = api.0.trim_start_matches("https://").to_owned();
    let api_port = api_authority
        .rsplit(':')
        .next()
        .unwrap_or_default()
        .to_owned();

    // Without system:auth-delegator, the stub's own account may not create
    // tokenreviews; a caller with a good token is told to retry, and nothing internal is named.
    let unbound = start_stub(&world, "stub-unbound", &api, &own_token, &[]);
    let refused = submit(&http, &unbound, &caller, "unbound-1").await;
    assert_refused(
        "no auth-delegator binding",
        &refused,
        503,
        "AUTH_UNAVAILABLE",
    );
    assert_eq!(refused.body["retrySafe"], true, "{}", refused.body);
    assert!(refused.retry_after.is_some(), "503 without Retry-After");
    let text = refused.body.to_string();
    for internal in [
        api.0.as_str(),
        &api_authority,
        &api_port,
        "127.0.0.1",
        &own_token.display().to_string(),
        "rail-stub-sa-token",
        &world.cluster.dir().display().to_string(),
    ] {
        assert!(!text.contains(internal), "the 503 shows {internal}: {text}");
    }
    let log = std::fs::read_to_string(&unbound.log).unwrap_or_default();
    assert!(
        log.contains("tokenreview_failed") && log.contains("403"),
        "the operator's log says why: {log}"
    );
    eprintln!("without auth-delegator: 503 AUTH_UNAVAILABLE, the log names the API server's 403");
    // Positive control: the chart's binding (charts/dlock/templates/rbac.yaml) lets the same
    // process with the same own token in.
    bind_auth_delegator(&world);
    let bound_at = Instant::now();
    let attempt = until_bound(&http, &unbound, &caller, "bound").await;
    eprintln!(
        "with auth-delegator: 200 after {} ms ({attempt} attempts)",
        bound_at.elapsed().as_millis()
    );
    // The same stub, now bound; and the positive control of the counter: every token
    // not yet known is one TokenReview the API server answers.
    let before = tokenreviews(&world);
    let other = token(&world, CALLER, Some("not-dlock"));
    let answer = submit(&http, &unbound, &other, "other-audience").await;
    assert_refused(
        "a token for another audience",
        &answer,
        401,
        "UNAUTHENTICATED",
    );
    let answer = submit(&http, &unbound, "a-made-up-token", "made-up").await;
    assert_refused("a made-up token", &answer, 401, "UNAUTHENTICATED");
    let after_refusals = tokenreviews(&world);
    eprintln!(
        "other audience 401, made-up 401: tokenreviews {before} -> {after_refusals} (+{})",
        after_refusals - before
    );
    assert_eq!(
        after_refusals - before,
        2,
        "two unknown tokens, two reviews"
    );
    assert_eq!(
        statement_refs(&http, &unbound).await,
        [format!("bound-{attempt}")],
        "only the authenticated submit reached the rail"
    );
    drop(unbound);

    // A stub with a small burst. The caller's token is reviewed once (the bucket keeps
    // BURST - 1), then the flood comes.
    let stub = start_stub(
        &world,
        "stub",
        &api,
        &own_token,
        &[("reviews-per-second", 1), ("review-burst", BURST)],
    );
    let before = tokenreviews(&world);
    let admitted = submit(&http, &stub, &caller, "valid-1").await;
    assert_eq!(admitted.status, 200, "{}", admitted.body);
    assert_eq!(admitted.content_type, JSON);
    let after_step1 = tokenreviews(&world);
    eprintln!(
        "valid 200 on the flood stub: tokenreviews {before} -> {after_step1} (+{})",
        after_step1 - before
    );
    assert_eq!(after_step1 - before, 1, "one unknown token, one review");

    // The flood: distinct made-up tokens, one after another.
    let started = Instant::now();
    let mut answers = Vec::new();
    for n in 0..FLOOD {
        answers.push(
            submit(
                &http,
                &stub,
                &format!("made-up-flood-token-{n:04}"),
                &format!("flood-{n}"),
            )
            .await,
        );
    }
    let elapsed = started.elapsed();
    let after_flood = tokenreviews(&world);
    let reviewed = after_flood - after_step1;
    let (unauthenticated, throttled) = tally_flood(&answers, |n, answer| {
        let wait = answer.body["retryAfterMillis"].as_u64().unwrap_or_default();
        assert!(wait > 0 && wait <= 1_000, "flood {n}: {}", answer.body);
        assert_eq!(answer.retry_after.as_deref(), Some("1"), "flood {n}");
    });
    // The bucket holds at most the burst when the flood starts and earns one a second.
    let allowed = BURST + elapsed.as_secs();
    eprintln!(
        "flood of {FLOOD} made-up tokens in {} ms: {unauthenticated} reviewed (401), {throttled} \
         throttled (503 + Retry-After); tokenreviews {after_step1} -> {after_flood} (+{reviewed}), \
         allowed at most {allowed}",
        elapsed.as_millis()
    );
    assert!(
        reviewed >= BURST - 1,
        "the rest of the burst was used: {reviewed} reviews"
    );
    assert!(
        reviewed <= allowed,
        "{reviewed} reviews, the burst allows {allowed}"
    );
    assert_eq!(
        reviewed, unauthenticated,
        "every review, and only those, answered 401"
    );
    assert!(throttled >= FLOOD as u64 - allowed);

    // The flood pushed nobody out; the valid token needs no new review.
    let again = submit(&http, &stub, &caller, "valid-2").await;
    assert_eq!(again.status, 200, "{}", again.body);
    let after_again = tokenreviews(&world);
    eprintln!(
        "valid token after the flood: 200; tokenreviews {after_flood} -> {after_again} (+{}); \
         scenario {} ms",
        after_again - after_flood,
        world.elapsed_ms()
    );
    assert_eq!(after_again, after_flood, "the cached answer was used");
    assert_eq!(
        statement_refs(&http, &stub).await,
        ["valid-1", "valid-2"],
        "only the authenticated submits reached the rail"
    );
}

/// The per-source budget of the fairness scenario, and the shared one around it.
const SOURCE_BURST: u64 = 2;
const SHARED_BURST: u64 = 6;

/// A client whose connections come from `ip` (any 127.0.0.0/8 address is this host's).
fn client_from(ip: [u8; 4]) -> reqwest::Client {
    reqwest::Client::builder()
        .local_address(std::net::IpAddr::from(ip))
        .timeout(Duration::from_secs(10))
        .build()
        .unwrap_or_else(|e| panic!("{e}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn tokenreview_budgets_per_source_so_a_flood_from_one_address_refuses_no_other() {
    let (world, api, own_token) = tokenreview_world().await;
    bind_auth_delegator(&world);
    let caller = token(&world, CALLER, Some("dlock"));
    let flooder = client_from([127, 0, 0, 2]);
    let legit = client_from([127, 0, 0, 1]);

    // Until RBAC sees the binding, on a stub of its own with the default limits, so the
    // scenario's stub starts with full budgets.
    let warm = start_stub(&world, "stub-warm-up", &api, &own_token, &[]);
    until_bound(&legit, &warm, &caller, "warm").await;
    drop(warm);

    let stub = start_stub(
        &world,
        "stub-fair",
        &api,
        &own_token,
        &[
            ("reviews-per-second", 1),
            ("review-burst", SHARED_BURST),
            ("source-reviews-per-second", 1),
            ("source-review-burst", SOURCE_BURST),
        ],
    );
    let before = tokenreviews(&world);
    let started = Instant::now();
    // The flood from 127.0.0.2: distinct made-up tokens, one after another; once the first is
    // throttled, the caller from 127.0.0.1 comes in with its valid token while the flood goes on.
    let (throttled_tx, throttled_rx) = tokio::sync::oneshot::channel::<usize>();
    let flood = async {
        let mut throttled_tx = Some(throttled_tx);
        let mut answers = Vec::new();
        for n in 0..FLOOD {
            let answer = submit(
                &flooder,
                &stub,
                &format!("made-up-fair-token-{n:04}"),
                &format!("flood-{n}"),
            )
            .await;
            if answer.status == 503
                && let Some(tx) = throttled_tx.take()
            {
                let _ = tx.send(n);
            }
            answers.push(answer);
        }
        answers
    };
    let legit_call = async {
        let first_throttled = throttled_rx.await.ok();
        (
            first_throttled,
            submit(&legit, &stub, &caller, "fair-valid-1").await,
        )
    };
    let (answers, (first_throttled, admitted)) = tokio::join!(flood, legit_call);
    let elapsed = started.elapsed();
    let after = tokenreviews(&world);
    let first_throttled =
        first_throttled.unwrap_or_else(|| panic!("the flood of {FLOOD} was never throttled"));
    let (unauthenticated, throttled) = tally_flood(&answers, |n, answer| {
        assert!(
            answer.retry_after.is_some(),
            "flood {n}: 503 without Retry-After"
        );
    });
    let reviewed = after - before;
    // The source's budget holds its burst when the flood starts and earns one a second.
    let source_allowed = SOURCE_BURST + elapsed.as_secs();
    eprintln!(
        "flood of {FLOOD} made-up tokens from 127.0.0.2 in {} ms: first throttled at #{first_throttled}, \
         {unauthenticated} reviewed (401), {throttled} throttled (503); the valid caller from \
         127.0.0.1 during the flood: {}; tokenreviews {before} -> {after} (+{reviewed}), the \
         source allowed at most {source_allowed}, all sources {}",
        elapsed.as_millis(),
        admitted.status,
        SHARED_BURST + elapsed.as_secs()
    );
    assert_eq!(
        admitted.status, 200,
        "the caller from another address was refused during the flood: {}",
        admitted.body
    );
    assert_eq!(admitted.content_type, JSON);
    assert!(
        unauthenticated >= SOURCE_BURST && unauthenticated <= source_allowed,
        "the flooding address got its own budget and no more: {unauthenticated} reviews, \
         {source_allowed} allowed"
    );
    assert!(throttled >= FLOOD as u64 - source_allowed);
    assert_eq!(
        reviewed,
        unauthenticated + 1,
        "every 401 of the flood, and the valid caller, was one review; nothing else was asked"
    );
    assert!(reviewed <= SHARED_BURST + elapsed.as_secs());
    assert_eq!(
        statement_refs(&legit, &stub).await,
        ["fair-valid-1"],
        "only the authenticated submit reached the rail"
    );
    eprintln!("scenario {} ms", world.elapsed_ms());
}
