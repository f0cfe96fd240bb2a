//! The rail proxy and the rail stub (docs/contract.md#s3-5 to #s3-7): real `dlock` processes that
//! [`Stack`] starts, on real PostgreSQL.
//!
//! Payouts are set up with paydb's own functions (account, funding, payout, claim), so these
//! tests exercise the proxy alone; tokens are plain increasing numbers, as a lock server's are.

mod admission;
mod forward;
mod group_commit;
mod set_based;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use dlock_devstack::stack::{Role, Stack};
use dlock_devstack::{Durability, ManagedChild, PgServer};
use reqwest::Method;
use serde_json::{Value, json};
use sqlx::PgPool;
use uuid::Uuid;

use crate::conformance::assert_envelope;
use crate::harness::{eventually, port, post_json, raw, serve_process};

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

/// A proxy process of [`RailWorld::with_restartable_proxy`]: where it listens, the stub it is in
/// front of, its settings.
pub struct Restartable {
    pub port: u16,
    pub url: String,
    pub stub: String,
    settings: Vec<(&'static str, &'static str)>,
}

/// Rail stubs and rail proxies on one paydb: a [`Stack`] of the two roles, deferred, so that a
/// test starts as many of each as it needs, each a real `dlock serve` process.
pub struct RailWorld {
    /// The test's own connections to paydb.
    pub pool: PgPool,
    /// Last: the pool closes before the services and PostgreSQL stop.
    stack: Stack,
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

    /// A world with a rail stub that answers after 1.5 s and a proxy process in front of it, with
    /// `extra` settings, to be killed mid-forward and started again ([`RailWorld::restart`]).
    pub async fn with_restartable_proxy(
        extra: &[(&'static str, &'static str)],
    ) -> (Self, Restartable, ManagedChild) {
        let (w, stub) = Self::with_stub("stub", &[("rail.stub.latency-ms", "1500")]).await;
        // A read timeout above the rail's latency; a dead process's unresolved intents declared
        // ambiguous soon after the restart.
        let mut settings = vec![
            ("rail.proxy.read-timeout-ms", "3000"),
            ("rail.proxy.unresolved-margin-ms", "200"),
            ("rail.proxy.sweep-interval-ms", "100"),
        ];
        settings.extend_from_slice(extra);
        let port = port();
        let proxy = Restartable {
            port,
            url: format!("http://127.0.0.1:{port}"),
            stub,
            settings,
        };
        let process = w.restart(&proxy);
        (w, proxy, process)
    }

    /// Starts `proxy`'s process (again), on its port with its settings.
    pub fn restart(&self, proxy: &Restartable) -> ManagedChild {
        self.proxy_process(proxy.port, &proxy.stub, &proxy.settings)
    }

    /// Waits until `payout`, whose attempt under `token` was in flight when its proxy died, is
    /// declared RAIL_AMBIGUOUS with that attempt recorded TIMEOUT.
    pub async fn quarantined(&self, payout: Uuid, token: i64, what: &str) {
        eventually(
            "the payout is quarantined",
            Duration::from_secs(20),
            || async { (self.state(payout).await == "RAIL_AMBIGUOUS").then_some(()) },
        )
        .await;
        assert_eq!(
            self.submissions(payout).await,
            vec![("TIMEOUT".to_owned(), token)],
            "{what}"
        );
    }

    /// A world with one rail stub, `name` with `settings` (its URL).
    pub async fn with_stub(name: &str, settings: &[(&str, &str)]) -> (Self, String) {
        let mut w = Self::new().await;
        let stub = w.stub(name, settings).await;
        (w, stub)
    }

    pub async fn new() -> Self {
        Self::with(Durability::Fast, 8).await
    }

    /// A world on a PostgreSQL of `durability`: its paydb, migrated, and a pool of
    /// `max_connections` to it.
    pub async fn with(durability: Durability, max_connections: u32) -> Self {
        // Tests build HTTP clients of their own (a caller that hangs up, say): the process's TLS
        // crypto provider, which nothing else here installs now that the services run apart.
        dlock_contract::tls::install_crypto_provider();
        let builder = Stack::builder(env!("CARGO_BIN_EXE_dlock"))
            .only(&[Role::RailStub, Role::RailProxy])
            .deferred(&[Role::RailStub, Role::RailProxy])
            .durability(durability)
            .operator_token("test-operator")
            .set(Role::RailProxy, "rail.proxy.pg.acquire-timeout-ms", "1000");
        let stack = tokio::task::spawn_blocking(move || builder.start())
            .await
            .unwrap_or_else(|e| panic!("starting the stack: {e}"));
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(max_connections)
            .connect(&stack.pg().url("paydb"))
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        // The schema before any proxy starts: tests that call paydb's functions directly run
        // none.
        dlock_rail_proxy::MIGRATOR
            .run(&pool)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        Self { pool, stack }
    }

    /// The stack's PostgreSQL, with paydb.
    pub fn pg(&self) -> &PgServer {
        self.stack.pg()
    }

    pub fn pg_mut(&mut self) -> &mut PgServer {
        self.stack
            .pg
            .as_mut()
            .unwrap_or_else(|| panic!("this stack runs no PostgreSQL"))
    }

    /// Starts one more service of `role` with `extra` keys; returns its URL.
    fn add(&mut self, role: Role, extra: &[(&str, &str)]) -> String {
        let stack = &mut self.stack;
        // It waits for the process to answer /readyz: off the runtime's worker.
        tokio::task::block_in_place(|| stack.add(role, extra).url())
    }

    /// A rail stub process, its statement in `<name>.jsonl`; returns its URL.
    pub async fn stub(&mut self, name: &str, settings: &[(&str, &str)]) -> String {
        let statement = self
            .stack
            .dir()
            .join(format!("{name}.jsonl"))
            .display()
            .to_string();
        let mut pairs = vec![("rail.stub.statement-path", statement.as_str())];
        pairs.extend_from_slice(settings);
        self.add(Role::RailStub, &pairs)
    }

    /// A rail proxy process in front of `rail`; returns its URL.
    pub async fn proxy(&mut self, rail: &str, settings: &[(&str, &str)]) -> String {
        let mut pairs = vec![("rail.proxy.rail-url", rail)];
        pairs.extend_from_slice(settings);
        self.add(Role::RailProxy, &pairs)
    }

    /// A rail proxy with the stack's configuration as a `dlock serve rail-proxy` process of the
    /// test's own on `port`: for a test that kills it and starts it again on the same port.
    pub fn proxy_process(&self, port: u16, rail: &str, settings: &[(&str, &str)]) -> ManagedChild {
        let listen: SocketAddr = ([127, 0, 0, 1], port).into();
        let mut pairs = vec![("server.listen".to_owned(), listen.to_string())];
        pairs.extend(self.stack.config(Role::RailProxy));
        if settings.iter().any(|(k, _)| k.starts_with("fencing.")) {
            pairs.retain(|(k, _)| k != "fencing.insecure-no-proofs");
        }
        let extra = [("rail.proxy.rail-url", rail)];
        for (key, value) in extra.iter().chain(settings) {
            match pairs.iter_mut().find(|(k, _)| k == key) {
                Some(pair) => pair.1 = (*value).to_owned(),
                None => pairs.push(((*key).to_owned(), (*value).to_owned())),
            }
        }
        let log = self.stack.dir().join("logs").join("rail-proxy.log");
        serve_process("rail-proxy", listen, &pairs, &log)
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

/// The value of `sample` (a metric's name and labels, exactly) that the service at `url` serves;
/// a sample it does not serve fails the test, so a zero read here is a zero served.
pub async fn metric(url: &str, sample: &str) -> f64 {
    crate::harness::metric(&crate::harness::metrics_of(url).await, sample)
}
