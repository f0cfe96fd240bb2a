//! The rail proxy and the rail stub (docs/contract.md#s3-5 to #s3-7), against real PostgreSQL, the
//! real stub over HTTP and, where the process boundary is the point, real `dlock` processes.
//!
//! Payouts are set up with paydb's own functions (account, funding, payout, claim), so these
//! tests exercise the proxy alone; tokens are plain increasing numbers, as a lock server's are.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use dlock_devstack::{ManagedChild, PgServer};
use dlock_server::config::{RawConfig, env_name};
use reqwest::Method;
use serde_json::{Value, json};
use sqlx::PgPool;
use uuid::Uuid;

use crate::conformance::assert_envelope;
use crate::harness::{
    Servers, eventually, loopback, port, post_json, raw, serve_in_task, serve_process,
};

fn raw_config(pairs: &[(&str, String)]) -> RawConfig {
    RawConfig::from_pairs(pairs).unwrap_or_else(|e| panic!("{e}"))
}

/// The URLs of [`RailWorld::with_three_rails`]: the stubs and the proxies in front of them.
pub struct Rails {
    pub good: String,
    pub slow: String,
    pub declining: String,
    /// In front of `good`.
    pub proxy: String,
    /// In front of `slow`, with a 300 ms read timeout.
    pub timing_out: String,
    pub declining_proxy: String,
}

pub struct RailWorld {
    /// First: the servers stop before their database does.
    servers: Servers,
    pub pg: PgServer,
    pub pool: PgPool,
    dir: tempfile::TempDir,
}

impl RailWorld {
    /// A world with a plain stub and one proxy in front of it (their URLs), and `account` holding
    /// 10 000.
    pub async fn with_proxy(account: &str) -> (Self, String, String) {
        let (mut w, stub) = Self::with_stub("stub", &[]).await;
        let proxy = w.proxy(&stub, &[]).await;
        w.account(account, 10_000).await;
        (w, stub, proxy)
    }

    /// A world with one rail stub, `name` with `settings` (its URL).
    pub async fn with_stub(name: &str, settings: &[(&str, &str)]) -> (Self, String) {
        let mut w = Self::new().await;
        let stub = w.stub(name, settings).await;
        (w, stub)
    }

    pub async fn new() -> Self {
        let pg = PgServer::start(None).unwrap_or_else(|e| panic!("{e:#}"));
        pg.create_database("paydb")
            .unwrap_or_else(|e| panic!("{e:#}"));
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(8)
            .connect(&pg.url("paydb"))
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        dlock_rail_proxy::MIGRATOR
            .run(&pool)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        Self {
            pg,
            pool,
            dir: tempfile::tempdir().unwrap_or_else(|e| panic!("{e}")),
            servers: Servers::default(),
        }
    }

    /// A rail stub in this process; returns its URL.
    pub async fn stub(&mut self, name: &str, settings: &[(&str, &str)]) -> String {
        let (listener, addr) = loopback().await;
        let mut pairs = vec![
            ("server.listen", addr.to_string()),
            (
                "rail.stub.statement-path",
                self.dir
                    .path()
                    .join(format!("{name}.jsonl"))
                    .display()
                    .to_string(),
            ),
        ];
        pairs.extend(settings.iter().map(|(k, v)| (*k, (*v).to_owned())));
        let config = dlock_rail_stub::RailStubConfig::from_raw(&mut raw_config(&pairs))
            .unwrap_or_else(|e| panic!("{e}"));
        let state = dlock_rail_stub::StubState::open(config).unwrap_or_else(|e| panic!("{e:#}"));
        self.servers
            .push(serve_in_task(listener, dlock_rail_stub::app(state)));
        format!("http://{addr}")
    }

    fn proxy_pairs(
        &self,
        listen: SocketAddr,
        rail: &str,
        settings: &[(&str, &str)],
    ) -> Vec<(&'static str, String)> {
        let mut pairs: Vec<(&'static str, String)> = vec![
            ("server.listen", listen.to_string()),
            ("rail.proxy.pg.url", self.pg.url("paydb")),
            ("rail.proxy.rail-url", rail.to_owned()),
            ("rail.proxy.operator-token", "test-operator".to_owned()),
            ("rail.proxy.pg.acquire-timeout-ms", "1000".to_owned()),
        ];
        for (k, v) in settings {
            let key: &'static str = Box::leak(k.to_string().into_boxed_str());
            pairs.push((key, (*v).to_owned()));
        }
        pairs
    }

    /// A rail proxy in this process; returns its URL.
    pub async fn proxy(&mut self, rail: &str, settings: &[(&str, &str)]) -> String {
        let (listener, addr) = loopback().await;
        let pairs = self.proxy_pairs(addr, rail, settings);
        let config = dlock_rail_proxy::RailProxyConfig::from_raw(&mut raw_config(&pairs))
            .unwrap_or_else(|e| panic!("{e}"));
        let pool = dlock_rail_proxy::connect(&config)
            .await
            .unwrap_or_else(|e| panic!("{e:#}"));
        let state = dlock_rail_proxy::AppState::new(pool, Arc::new(config))
            .unwrap_or_else(|e| panic!("{e:#}"));
        self.servers
            .push(serve_in_task(listener, dlock_rail_proxy::app(state)));
        format!("http://{addr}")
    }

    /// A rail proxy as a real `dlock serve rail-proxy` process on `port`.
    pub fn proxy_process(&self, port: u16, rail: &str, settings: &[(&str, &str)]) -> ManagedChild {
        let listen: SocketAddr = ([127, 0, 0, 1], port).into();
        let env: Vec<(String, String)> = self
            .proxy_pairs(listen, rail, settings)
            .into_iter()
            .map(|(k, v)| (env_name(k), v))
            .collect();
        let log = self.dir.path().join("rail-proxy.log");
        serve_process("rail-proxy", listen, &env, &log)
    }

    /// A world with the three rails both admission suites use (answering at once, after 1.5 s,
    /// declining everything), each behind a proxy with the default settings, and the slow one
    /// also behind a proxy that gives up reading after 300 ms.
    pub async fn with_three_rails() -> (Self, Rails) {
        let mut w = Self::new().await;
        let good = w.stub("good", &[]).await;
        let slow = w.stub("slow", &[("rail.stub.latency-ms", "1500")]).await;
        let declining = w
            .stub("declining", &[("rail.stub.decline-rate", "1")])
            .await;
        let rails = Rails {
            proxy: w.proxy(&good, &[]).await,
            timing_out: w
                .proxy(&slow, &[("rail.proxy.read-timeout-ms", "300")])
                .await,
            declining_proxy: w.proxy(&declining, &[]).await,
            good,
            slow,
            declining,
        };
        (w, rails)
    }

    /// What paydb's function `call` (`SELECT outcome FROM pay_…(…)`, its parameters bound)
    /// answers.
    async fn outcome(
        &self,
        call: sqlx::query::QueryAs<'_, sqlx::Postgres, (String,), sqlx::postgres::PgArguments>,
    ) -> String {
        let (outcome,) = call
            .fetch_one(&self.pool)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        outcome
    }

    pub async fn account(&self, id: &str, funds: i64) {
        let create = sqlx::query_as("SELECT outcome FROM pay_create_account($1, 'EUR')").bind(id);
        assert_eq!(self.outcome(create).await, "created");
        let fund = sqlx::query_as("SELECT outcome FROM pay_fund($1, $2, $3)")
            .bind(id)
            .bind(funds)
            .bind(format!("initial-{id}"));
        assert_eq!(self.outcome(fund).await, "funded");
    }

    /// A PENDING payout, claimed with `token`.
    pub async fn claimed(&self, account: &str, amount: i64, token: i64) -> Uuid {
        let payout = Uuid::new_v4();
        let create =
            sqlx::query_as("SELECT outcome FROM pay_create_payout($1, $2, $3, 'EUR', 'ben')")
                .bind(payout)
                .bind(account)
                .bind(amount);
        assert_eq!(self.outcome(create).await, "created");
        let claim = sqlx::query_as("SELECT outcome FROM pay_claim($1, $2, 'PENDING')")
            .bind(payout)
            .bind(token);
        assert_eq!(
            self.outcome(claim).await,
            "claimed",
            "claim {payout} with {token}"
        );
        payout
    }

    /// A payout of `amount` from `account`, claimed with `token` and submitted under it through
    /// `proxy`: the payout, and the answer's status and body.
    pub async fn submit_claimed(
        &self,
        proxy: &str,
        account: &str,
        amount: i64,
        token: i64,
    ) -> (Uuid, u16, Value) {
        let payout = self.claimed(account, amount, token).await;
        let (status, body) = submit(proxy, account, payout, amount, &token.to_string()).await;
        (payout, status, body)
    }

    /// What `account` holds for its payouts in flight.
    pub async fn held(&self, account: &str) -> i64 {
        let (held,): (i64,) =
            sqlx::query_as("SELECT held_minor FROM accounts WHERE account_id = $1")
                .bind(account)
                .fetch_one(&self.pool)
                .await
                .unwrap_or_else(|e| panic!("{e}"));
        held
    }

    pub async fn state(&self, payout: Uuid) -> String {
        crate::payment::payout_state(&self.pool, payout).await
    }

    /// Waits (up to 10 s) until `payout`'s intent under `token` is committed and unresolved: the
    /// forward is on its way.
    pub async fn intent_committed(&self, payout: Uuid, token: i64) {
        eventually(
            "the intent row is committed",
            Duration::from_secs(10),
            || async {
                (self.submissions(payout).await == vec![("unresolved".to_owned(), token)])
                    .then_some(())
            },
        )
        .await;
    }

    pub async fn submissions(&self, payout: Uuid) -> Vec<(String, i64)> {
        sqlx::query_as("SELECT outcome, presented_token FROM rail_submission WHERE payout_id = $1 ORDER BY submitted_at")
            .bind(payout)
            .fetch_all(&self.pool)
            .await
            .unwrap_or_else(|e| panic!("{e}"))
    }
}

pub async fn submit(
    proxy: &str,
    account: &str,
    payout: Uuid,
    amount: i64,
    token: &str,
) -> (u16, Value) {
    submit_to(proxy, account, payout, amount, token, "ben").await
}

/// The body of a submission of `amount` from `account` for `payout` to `beneficiary`.
fn submission_body(account: &str, payout: Uuid, amount: i64, beneficiary: &str) -> Value {
    json!({
        "payoutId": payout, "accountId": account, "amountMinor": amount,
        "currency": "EUR", "beneficiaryRef": beneficiary,
    })
}

/// The headers of a submission by `worker` under the idempotency `key` (`payout-{payout}`),
/// besides its content type.
fn submission_headers<'a>(key: &'a str, token: &'a str) -> [(&'static str, &'a str); 3] {
    [
        ("x-owner-id", "worker"),
        ("x-idempotency-key", key),
        ("x-fencing-token", token),
    ]
}

/// `submit` with another beneficiary: the same key and token with a different body.
pub async fn submit_to(
    proxy: &str,
    account: &str,
    payout: Uuid,
    amount: i64,
    token: &str,
    beneficiary: &str,
) -> (u16, Value) {
    let key = format!("payout-{payout}");
    let (status, content_type, json) = post_json(
        &format!("{proxy}/v1/rail/submissions"),
        &submission_headers(&key, token),
        &submission_body(account, payout, amount, beneficiary),
    )
    .await;
    assert_eq!(content_type, "application/json; charset=utf-8");
    (status, json)
}

/// The request `submit` sends, sent by `client`: for the tests where the caller's own connection
/// is the point (it hangs up, or the proxy dies under it).
pub fn submission(
    client: &reqwest::Client,
    proxy: &str,
    account: &str,
    payout: Uuid,
    amount: i64,
    token: &str,
) -> reqwest::RequestBuilder {
    let key = format!("payout-{payout}");
    let request = client
        .post(format!("{proxy}/v1/rail/submissions"))
        .header("content-type", "application/json");
    submission_headers(&key, token)
        .into_iter()
        .fold(request, |request, (name, value)| {
            request.header(name, value)
        })
        .body(submission_body(account, payout, amount, "ben").to_string())
}

pub async fn statement(stub: &str, payout: Uuid) -> Vec<Value> {
    let (status, _, body) = raw(
        Method::GET,
        &format!("{stub}/statement?clientRef={payout}"),
        &[],
        None,
    )
    .await;
    assert_eq!(status, 200);
    body["transfers"].as_array().cloned().unwrap_or_default()
}

/// Waits (up to 10 s) until the rail `stub` holds the one transfer of `payout`: a slow rail takes
/// the transfer after its proxy gave up waiting for the answer.
pub async fn taken_late(stub: &str, payout: Uuid) {
    eventually(
        "the slow rail takes the transfer",
        Duration::from_secs(10),
        || async { (statement(stub, payout).await.len() == 1).then_some(()) },
    )
    .await;
}

pub async fn metric(proxy: &str, name: &str) -> f64 {
    let text = reqwest::get(format!("{proxy}/metrics"))
        .await
        .unwrap_or_else(|e| panic!("{e}"))
        .text()
        .await
        .unwrap_or_default();
    text.lines()
        .filter(|l| l.starts_with(name))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_row_of_the_admission_table_answers_with_its_code() {
    let (
        w,
        Rails {
            good,
            slow,
            declining,
            proxy,
            timing_out: slow_proxy,
            declining_proxy,
        },
    ) = RailWorld::with_three_rails().await;
    w.account("acct-a", 100_000).await;

    // Admitted, forwarded once, ACKED: the payout is RAIL_ACKED and the rail shows one transfer.
    let (p1, status, body) = w.submit_claimed(&proxy, "acct-a", 1_000, 10).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["outcome"], "ACKED");
    assert_eq!(body["presentedToken"], 10);
    assert_eq!(w.state(p1).await, "RAIL_ACKED");
    let transfers = statement(&good, p1).await;
    assert_eq!(transfers.len(), 1);
    assert_eq!(transfers[0]["railReference"], body["railReference"]);

    // docs/contract.md#submit-replay: the identical request again is a replay of the first answer,
    // not a duplicate.
    let (status, replay) = submit(&proxy, "acct-a", p1, 1_000, "10").await;
    assert_eq!((status, &replay), (200, &body));
    assert_eq!(metric(&proxy, "rail_duplicate_attempted_total").await, 0.0);
    // Step 2: another attempt (a newer token) is DUPLICATE_SUBMISSION, counted, never forwarded.
    let (status, dup) = submit(&proxy, "acct-a", p1, 1_000, "11").await;
    assert_eq!(status, 409);
    assert_envelope("duplicate", status, &dup, "DUPLICATE_SUBMISSION");
    assert_eq!(dup["details"]["submissionId"], body["submissionId"]);
    assert_eq!(metric(&proxy, "rail_duplicate_attempted_total").await, 1.0);
    assert_eq!(statement(&good, p1).await.len(), 1);

    // Step 1, rail: a token at or below the high-water mark is FENCED_OUT, recorded as FENCED,
    // and the rail never hears of it.
    let p2 = w.claimed("acct-a", 1_000, 12).await;
    let (status, fenced) = submit(&proxy, "acct-a", p2, 1_000, "9").await;
    assert_eq!(status, 409);
    assert_envelope("fenced rail", status, &fenced, "FENCED_OUT");
    let d = &fenced["details"];
    assert_eq!(
        (d["presentedToken"].as_i64(), d["highestToken"].as_i64()),
        (Some(9), Some(10))
    );
    assert_eq!(
        (
            d["resourceType"].as_str(),
            d["resourceId"].as_str(),
            d["ownerId"].as_str()
        ),
        (Some("rail"), Some("acct-a"), Some("worker"))
    );
    assert!(statement(&good, p2).await.is_empty());
    assert_eq!(w.submissions(p2).await, vec![("FENCED".to_owned(), 9)]);
    // docs/design.md#d-2: the fenced stale attempt does not block the legitimate holder.
    let (status, body) = submit(&proxy, "acct-a", p2, 1_000, "12").await;
    assert_eq!(status, 200, "{body}");

    // Step 1, account: a token above the mark but below a newer claim's is fenced too.
    let p3 = w.claimed("acct-a", 1_000, 13).await;
    let _p4 = w.claimed("acct-a", 1_000, 14).await;
    let (status, fenced) = submit(&proxy, "acct-a", p3, 1_000, "13").await;
    assert_eq!(status, 409);
    assert_envelope("fenced account", status, &fenced, "FENCED_OUT");
    assert_eq!(fenced["details"]["resourceType"], "account");
    assert_eq!(fenced["details"]["highestToken"], 14);
    assert!(metric(&proxy, "lock_fenced_out_total").await >= 2.0);

    // A payout not claimed with this token cannot be submitted.
    let p5 = w.claimed("acct-a", 1_000, 20).await;
    let (status, body) = submit(&proxy, "acct-a", p5, 1_000, "21").await;
    assert_eq!(status, 409);
    assert_envelope("not claimable", status, &body, "PAYOUT_NOT_CLAIMABLE");

    // Step 4, timeout: a rail slower than the read timeout leaves the outcome unknown.
    let (p6, status, body) = w.submit_claimed(&slow_proxy, "acct-a", 1_000, 30).await;
    assert_eq!(status, 409, "{body}");
    assert_envelope("ambiguous", status, &body, "RAIL_AMBIGUOUS");
    assert_eq!(body["details"]["outcome"], "TIMEOUT");
    assert_eq!(w.state(p6).await, "RAIL_AMBIGUOUS");
    assert_eq!(w.submissions(p6).await, vec![("TIMEOUT".to_owned(), 30)]);
    // The rail did take it, late: exactly the case that must never be submitted again.
    taken_late(&slow, p6).await;
    let (status, body) = submit(&slow_proxy, "acct-a", p6, 1_000, "31").await;
    assert_eq!(status, 409);
    assert_envelope(
        "ambiguous is quarantined",
        status,
        &body,
        "DUPLICATE_SUBMISSION",
    );

    // Step 4, declined: REJECTED, 422 VALIDATION_FAILED, the payout FAILED and its hold released.
    let held_before = w.held("acct-a").await;
    let (p7, status, body) = w
        .submit_claimed(&declining_proxy, "acct-a", 2_000, 40)
        .await;
    assert_eq!(status, 422, "{body}");
    assert_envelope("declined", status, &body, "VALIDATION_FAILED");
    assert_eq!(body["details"]["outcome"], "REJECTED");
    assert_eq!(w.state(p7).await, "FAILED");
    assert_eq!(
        w.held("acct-a").await,
        held_before,
        "the declined payout's hold is released"
    );
    assert!(statement(&declining, p7).await.is_empty());

    // Malformed tokens and bodies change nothing.
    let p8 = w.claimed("acct-a", 1_000, 50).await;
    for bad in ["0", "-1", "abc", "1e3", "", "9223372036854775808"] {
        let (status, body) = submit(&proxy, "acct-a", p8, 1_000, bad).await;
        assert_eq!(status, 400, "{bad}: {body}");
        assert_envelope("bad token", status, &body, "INVALID_TOKEN");
    }
    let (status, body) = submit(&proxy, "acct-a", p8, -5, "50").await;
    assert_eq!(status, 400);
    assert_envelope("bad amount", status, &body, "VALIDATION_FAILED");
    let (status, body) = submit(&proxy, "acct-a", p8, 999, "50").await;
    assert_eq!(status, 400, "an amount that is not the payout's: {body}");
    // The account id rule is the contract's, the same one the payment resource applies.
    for bad in ["acct a", "acct/a", "", &"a".repeat(65)] {
        let (status, body) = submit(&proxy, bad, p8, 1_000, "50").await;
        assert_envelope("bad account id", status, &body, "VALIDATION_FAILED");
        assert_eq!(
            body["details"]["fields"][0]["field"], "accountId",
            "{bad:?}: {body}"
        );
    }
    assert!(w.submissions(p8).await.is_empty());
    assert_eq!(w.state(p8).await, "CLAIMED");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn paydb_down_before_the_intent_commits_is_rail_unavailable_and_nothing_reaches_the_rail() {
    let (mut w, stub, proxy) = RailWorld::with_proxy("acct-b").await;
    let payout = w.claimed("acct-b", 500, 7).await;
    w.pg.kill();
    let (status, body) = submit(&proxy, "acct-b", payout, 500, "7").await;
    assert_eq!(status, 503, "{body}");
    assert_envelope("paydb down", status, &body, "RAIL_UNAVAILABLE");
    assert!(
        statement(&stub, payout).await.is_empty(),
        "nothing was presented to the rail"
    );
    w.pg.start_again().unwrap_or_else(|e| panic!("{e:#}"));
    // Retry-safe: once paydb is back, the same request goes through, once.
    let (status, body) = eventually("the proxy reconnects", Duration::from_secs(20), || async {
        let (status, body) = submit(&proxy, "acct-b", payout, 500, "7").await;
        (status != 503).then_some((status, body))
    })
    .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(statement(&stub, payout).await.len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_proxy_killed_mid_forward_leaves_the_payout_ambiguous_and_never_forwards_again() {
    let (w, stub) = RailWorld::with_stub("stub", &[("rail.stub.latency-ms", "1500")]).await;
    let settings = [
        ("rail.proxy.read-timeout-ms", "3000"),
        ("rail.proxy.unresolved-margin-ms", "200"),
        ("rail.proxy.sweep-interval-ms", "100"),
    ];
    let port = port();
    let url = format!("http://127.0.0.1:{port}");
    let mut proxy = w.proxy_process(port, &stub, &settings);
    w.account("acct-c", 10_000).await;
    let payout = w.claimed("acct-c", 700, 3).await;
    let client = dlock_contract::client::http_client().unwrap_or_else(|e| panic!("{e}"));
    let in_flight = tokio::spawn(submission(&client, &url, "acct-c", payout, 700, "3").send());
    // Wait until the intent is committed and the forward is on its way, then kill the proxy.
    w.intent_committed(payout, 3).await;
    proxy.kill();
    let answer = in_flight.await.unwrap_or_else(|e| panic!("{e}"));
    assert!(answer.is_err(), "the caller got no answer: {answer:?}");
    assert_eq!(w.state(payout).await, "SUBMITTING");
    // After a restart the unresolved intent is declared ambiguous, never re-forwarded.
    let _proxy = w.proxy_process(port, &stub, &settings);
    eventually(
        "the payout is quarantined",
        Duration::from_secs(20),
        || async { (w.state(payout).await == "RAIL_AMBIGUOUS").then_some(()) },
    )
    .await;
    assert_eq!(w.submissions(payout).await, vec![("TIMEOUT".to_owned(), 3)]);
    // The identical request is answered from the timed-out attempt; another token is a duplicate.
    let (status, body) = submit(&url, "acct-c", payout, 700, "3").await;
    assert_eq!(status, 409);
    assert_envelope("replay after restart", status, &body, "RAIL_AMBIGUOUS");
    assert_eq!(body["details"]["outcome"], "TIMEOUT");
    let (status, body) = submit(&url, "acct-c", payout, 700, "4").await;
    assert_eq!(status, 409);
    assert_envelope("after restart", status, &body, "DUPLICATE_SUBMISSION");
    // The rail may have taken the one attempt; it never sees a second.
    let transfers = statement(&stub, payout).await;
    assert!(transfers.len() <= 1, "{transfers:?}");
}

/// A rollout stops a proxy with SIGTERM while a forward is in flight and its caller has already
/// hung up (a client timeout, or an executor killed in the same rollout): the proxy waits for the
/// rail's answer and records it before it exits, so the payout is RAIL_ACKED, not left SUBMITTING
/// to be timed out as RAIL_AMBIGUOUS.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_proxy_stopped_with_sigterm_records_the_forward_whose_caller_hung_up() {
    let (w, stub) = RailWorld::with_stub("stub", &[("rail.stub.latency-ms", "2000")]).await;
    let port = port();
    let url = format!("http://127.0.0.1:{port}");
    let mut proxy = w.proxy_process(port, &stub, &[("rail.proxy.read-timeout-ms", "6000")]);
    w.account("acct-t", 10_000).await;
    let payout = w.claimed("acct-t", 700, 3).await;
    // The caller gives up long before the rail answers, and is gone when the proxy is stopped.
    let client = dlock_contract::client::http_client().unwrap_or_else(|e| panic!("{e}"));
    let answer = submission(&client, &url, "acct-t", payout, 700, "3")
        .timeout(Duration::from_millis(300))
        .send()
        .await;
    assert!(
        answer.as_ref().is_err_and(reqwest::Error::is_timeout),
        "the caller timed out: {answer:?}"
    );
    w.intent_committed(payout, 3).await;
    // Positive control: the rail has not answered yet, so the answer is still to be recorded.
    assert_eq!(w.state(payout).await, "SUBMITTING");
    assert!(statement(&stub, payout).await.is_empty());
    proxy
        .signal(dlock_devstack::Signal::SIGTERM)
        .unwrap_or_else(|e| panic!("{e}"));
    let exit = proxy.wait_exit(Duration::from_secs(15));
    assert!(
        exit.is_some_and(|status| status.success()),
        "the proxy exits cleanly after draining: {exit:?}"
    );
    assert_eq!(w.submissions(payout).await, vec![("ACKED".to_owned(), 3)]);
    assert_eq!(w.state(payout).await, "RAIL_ACKED");
    assert_eq!(statement(&stub, payout).await.len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_stale_token_sent_to_another_replica_is_fenced() {
    let (mut w, stub) = RailWorld::with_stub("stub", &[]).await;
    let replica_a = w.proxy(&stub, &[]).await;
    let replica_b = w.proxy(&stub, &[]).await;
    w.account("acct-d", 10_000).await;
    let (_, status, body) = w.submit_claimed(&replica_a, "acct-d", 100, 20).await;
    assert_eq!(status, 200, "{body}");
    let second = w.claimed("acct-d", 100, 25).await;
    let stale = second;
    // An in-memory mark on replica B would have seen nothing and let token 15 through.
    let (status, body) = submit(&replica_b, "acct-d", stale, 100, "15").await;
    assert_eq!(status, 409);
    assert_envelope("other replica", status, &body, "FENCED_OUT");
    assert_eq!(body["details"]["highestToken"], 20);
    assert!(statement(&stub, stale).await.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_high_water_mark_rises_to_a_revocation_floor_only_for_the_operator() {
    let (w, _, proxy) = RailWorld::with_proxy("acct-e").await;
    let payout = w.claimed("acct-e", 100, 5).await;
    let floor = json!({"floor": 9, "operator": "ops", "reason": "revoked a stuck holder"});
    // Raises `account`'s (as the path spells it) high-water mark to the floor, as `auth` if any.
    let (proxy, floor) = (&proxy, &floor);
    let advance = move |account: &'static str, auth: Option<&'static str>| async move {
        let mut headers = vec![("x-owner-id", "ops")];
        headers.extend(auth.map(|a| ("authorization", a)));
        post_json(
            &format!("{proxy}/v1/rail/high-water/{account}"),
            &headers,
            floor,
        )
        .await
    };
    let (status, _, body) = advance("acct-e", None).await;
    assert_eq!(status, 401);
    assert_envelope("no credential", status, &body, "UNAUTHENTICATED");
    // A credential that authenticates nobody is 401; 403 is for a known non-operator.
    let (status, _, body) = advance("acct-e", Some("Bearer wrong")).await;
    assert_eq!(status, 401);
    assert_envelope("wrong credential", status, &body, "UNAUTHENTICATED");
    let (status, _, body) = advance("acct-e", Some("Bearer test-operator")).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["highestToken"], 9);
    // An account id outside the contract's rule is refused and creates no mark.
    let (status, _, body) = advance("acct%20e", Some("Bearer test-operator")).await;
    assert_envelope("bad account id", status, &body, "VALIDATION_FAILED");
    let marks: (i64,) =
        sqlx::query_as("SELECT count(*) FROM rail_high_water WHERE account_id = 'acct e'")
            .fetch_one(&w.pool)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(marks.0, 0);
    // The revoked holder's token is now fenced at the rail, before it ever submitted.
    let (status, body) = submit(proxy, "acct-e", payout, 100, "5").await;
    assert_eq!(status, 409);
    assert_envelope("after the floor", status, &body, "FENCED_OUT");
    assert_eq!(body["details"]["highestToken"], 9);
}

/// A hostile rail (failures 0.3, every repeat accepted again, latency around the read timeout)
/// under many concurrent submissions, retries and stale tokens.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_hostile_rail_never_sees_two_transfers_for_one_payout() {
    let hostile = [
        ("rail.stub.failure-rate", "0.3"),
        ("rail.stub.duplicate-ack-rate", "1.0"),
        ("rail.stub.latency-ms", "150"),
        ("rail.stub.latency-jitter-ms", "200"),
        ("rail.stub.hang-ms", "1000"),
    ];
    let (mut w, stub) = RailWorld::with_stub("hostile", &hostile).await;
    let settings = [("rail.proxy.read-timeout-ms", "250")];
    let proxies = [
        w.proxy(&stub, &settings).await,
        w.proxy(&stub, &settings).await,
    ];
    const ACCOUNTS: usize = 10;
    const PER_ACCOUNT: usize = 12;
    // Accounts run in parallel; within an account each payout is one lock cycle: a claim with a
    // fresh token, then three concurrent submits with it (a retrying worker) and one with the
    // previous cycle's token (a stale worker), spread over both replicas.
    let world = Arc::new(w);
    let mut accounts = Vec::new();
    for a in 0..ACCOUNTS {
        let account = format!("hostile-{a}");
        world.account(&account, 1_000_000).await;
        let (world, proxies) = (world.clone(), proxies.clone());
        accounts.push(tokio::spawn(async move {
            let mut cycles = Vec::new();
            for i in 0..PER_ACCOUNT {
                let token = 100 + 2 * i as i64;
                let amount = 100 + i as i64;
                let payout = world.claimed(&account, amount, token).await;
                let mut attempts = Vec::new();
                for attempt in 0..4 {
                    let proxy = proxies[(i + attempt) % 2].clone();
                    let account = account.clone();
                    let presented = if attempt == 3 { token - 2 } else { token };
                    attempts.push(tokio::spawn(async move {
                        submit(&proxy, &account, payout, amount, &presented.to_string()).await
                    }));
                }
                let mut statuses = Vec::new();
                for attempt in attempts {
                    let (status, body) = attempt.await.unwrap_or_else(|e| panic!("{e}"));
                    assert!(
                        [200, 409, 422].contains(&status),
                        "unexpected {status} for {payout}: {body}"
                    );
                    // Identical retries replay one answer: every 200 names the same attempt.
                    statuses.push((status, body["submissionId"].as_str().map(str::to_owned)));
                }
                cycles.push((payout, statuses));
            }
            cycles
        }));
    }
    let mut answers: HashMap<Uuid, Vec<(u16, Option<String>)>> = HashMap::new();
    for task in accounts {
        for (payout, statuses) in task.await.unwrap_or_else(|e| panic!("{e}")) {
            answers.insert(payout, statuses);
        }
    }
    let w = world;
    let payouts: Vec<Uuid> = answers.keys().copied().collect();
    assert_eq!(payouts.len(), ACCOUNTS * PER_ACCOUNT);
    let mut acked = 0;
    let mut ambiguous = 0;
    for payout in &payouts {
        let transfers = statement(&stub, *payout).await;
        assert!(
            transfers.len() <= 1,
            "payout {payout} was paid {} times",
            transfers.len()
        );
        let presented: Vec<(String, i64)> = w
            .submissions(*payout)
            .await
            .into_iter()
            .filter(|(o, _)| o != "FENCED")
            .collect();
        assert_eq!(
            presented.len(),
            1,
            "{payout}: one presented attempt, got {presented:?}"
        );
        let state = w.state(*payout).await;
        let expected = match presented[0].0.as_str() {
            "ACKED" => "RAIL_ACKED",
            "TIMEOUT" => "RAIL_AMBIGUOUS",
            "REJECTED" => "FAILED",
            other => panic!("{payout}: outcome {other}"),
        };
        assert_eq!(
            state, expected,
            "{payout}: state matches the proxy's record"
        );
        if state == "RAIL_ACKED" {
            acked += 1;
            assert_eq!(
                transfers.len(),
                1,
                "{payout}: an ACKED payout is on the statement"
            );
        }
        if state == "RAIL_AMBIGUOUS" {
            ambiguous += 1;
        }
        let acked_ids: std::collections::HashSet<_> = answers[payout]
            .iter()
            .filter(|(s, _)| *s == 200)
            .map(|(_, id)| id.clone())
            .collect();
        assert!(
            acked_ids.len() <= 1,
            "{payout}: callers were told ACKED for {acked_ids:?}"
        );
    }
    assert!(
        acked > 0 && ambiguous > 0,
        "the run saw both outcomes: {acked} acked, {ambiguous} ambiguous"
    );
}

/// docs/contract.md#rail-step-4, forward once: a rail (or a gateway in front of it) that takes the
/// transfer and answers `307` must not see the transfer again. Following the redirect re-sends the
/// POST body, and a rail that takes repeats (duplicate-ack rate 1) would pay it once per hop.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_rail_that_redirects_after_taking_a_transfer_is_ambiguous_and_paid_once() {
    let redirecting = [
        ("rail.stub.redirect-rate", "1.0"),
        ("rail.stub.duplicate-ack-rate", "1.0"),
    ];
    let (mut w, stub) = RailWorld::with_stub("redirecting", &redirecting).await;
    let proxy = w.proxy(&stub, &[]).await;
    w.account("redirected", 10_000).await;
    let (payout, status, body) = w.submit_claimed(&proxy, "redirected", 700, 5).await;
    assert_envelope(
        "submit to a redirecting rail",
        status,
        &body,
        "RAIL_AMBIGUOUS",
    );
    assert_eq!(status, 409, "{body}");
    assert_eq!(w.state(payout).await, "RAIL_AMBIGUOUS");
    assert_eq!(
        w.submissions(payout).await,
        vec![("TIMEOUT".to_owned(), 5)],
        "one presented attempt, recorded as an unknown outcome"
    );
    let transfers = statement(&stub, payout).await;
    assert_eq!(
        transfers.len(),
        1,
        "the rail took the transfer once and was never asked again: {transfers:?}"
    );
}
