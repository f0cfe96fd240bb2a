//! Authentication and TLS, end to end: the `dlock dev up` stack (every service with
//! `auth.mode = "tokens"`), a TLS listener, and TokenReview against a stand-in Kubernetes API.
//!
//! Every refused request is checked for the envelope and the JSON content type, and the durable
//! state of paydb, lockdb and the rail's statement is compared before and after: a refused
//! request changes nothing.

mod credentials;
mod funding_list;
mod funding_window;
mod roles;
mod secret_files;
mod tls;
mod tokenreview;
mod treasury_cli;

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use dlock_contract::payment_client::PaymentClient;
use dlock_devstack::{ManagedChild, free_port, spawn_logged};
use reqwest::Method;
use serde_json::{Value, json};
use sqlx::Row;

use crate::harness::{eventually, loopback, raw, until_ready};
use crate::shared::accounts::open_account;

use crate::shared::dev_up::DevUp;
use crate::shared::payouts::{Item, batch_manifest};

const EXE: &str = env!("CARGO_BIN_EXE_dlock");
const JSON: &str = "application/json; charset=utf-8";

/// `dlock dev up` as a process, its JSON line parsed; shared by the tests that need the stack.
pub(crate) struct DevStack(DevUp);

impl std::ops::Deref for DevStack {
    type Target = DevUp;

    fn deref(&self) -> &DevUp {
        &self.0
    }
}

impl DevStack {
    pub(crate) fn start() -> Self {
        Self::start_with_env(&[])
    }

    /// The stack with extra environment for every process of it (e.g. an OTLP endpoint).
    pub(crate) fn start_with_env(env: &[(&str, &str)]) -> Self {
        Self(DevUp::start(&[], env))
    }

    /// [`DevStack::start`], off the async runtime's threads.
    pub(crate) async fn up() -> Self {
        tokio::task::spawn_blocking(Self::start)
            .await
            .unwrap_or_else(|e| panic!("{e}"))
    }

    /// [`DevStack::up`] with `account` opened and funded with `balance` by the treasury.
    pub(crate) async fn with_account(account: &str, balance: i64) -> Self {
        let stack = Self::up().await;
        open_account(&stack.treasury_payments(), account, Some(balance)).await;
        stack
    }

    /// [`DevStack::up`] with fundings above `threshold` waiting for a second treasury identity.
    pub(crate) async fn with_dual_approval_above(threshold: &str) -> Self {
        let threshold = threshold.to_owned();
        tokio::task::spawn_blocking(move || {
            Self(DevUp::start(
                &["--treasury-dual-approval-above", &threshold],
                &[],
            ))
        })
        .await
        .unwrap_or_else(|e| panic!("{e}"))
    }

    /// [`DevStack::with_dual_approval_above`] `threshold`, with a second treasury identity,
    /// `treasury-2`, of `token`.
    pub(crate) async fn with_second_treasury(threshold: &str, token: &str) -> Self {
        let stack = Self::with_dual_approval_above(threshold).await;
        stack.add_tokens(&[("treasury-2", token, "treasury")]).await;
        stack
    }

    /// How many of the first 100 payouts the executor identity lists are POSTED.
    pub(crate) async fn posted(&self) -> usize {
        let page = self
            .executor_payments()
            .list_payouts(None, None, Some(100), None)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        page.items
            .iter()
            .filter(|p| p.state.as_str() == "POSTED")
            .count()
    }

    /// A payment client of the executor identity, with its credential.
    pub(crate) fn executor_payments(&self) -> PaymentClient {
        self.payments_as("executor/test")
    }

    /// `dlock run` of a batch `name` of `n` payouts on `account` (2 workers) as the executor
    /// identity with its credential; whether it succeeded, and its log.
    pub(crate) async fn run_batch(&self, name: &str, account: &str, n: usize) -> (bool, String) {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let text = batch_manifest(
            name,
            2,
            (0..n).map(|i| Item::numbered(i, format!("item-{i:02}"), account, 100)),
        );
        let batch = dir.path().join("batch.yaml");
        std::fs::write(&batch, text).unwrap_or_else(|e| panic!("{e}"));
        let args = self.run_args(&batch.display().to_string(), &[]);
        let log = dir.path().join("run.log");
        run_logged(&args, &self.run_env(), &log, Duration::from_secs(120)).await
    }

    /// The arguments of `dlock run` of the manifest `batch` against this stack's lock server,
    /// payment resource and rail proxy as the executor identity, then `extra`.
    pub(crate) fn run_args(&self, batch: &str, extra: &[&str]) -> Vec<String> {
        let (lock, payment, proxy) = self.services();
        let mut args: Vec<String> = [
            "run",
            "-f",
            batch,
            "--lock-server",
            &lock,
            "--payment-resource",
            &payment,
            "--rail-proxy",
            &proxy,
            "--identity",
            "executor",
        ]
        .iter()
        .map(|s| (*s).to_owned())
        .collect();
        args.extend(extra.iter().map(|s| (*s).to_owned()));
        args
    }

    /// The URLs of the lock server, the payment resource and the rail proxy.
    pub(crate) fn services(&self) -> (String, String, String) {
        (
            self.url("lockServer"),
            self.url("paymentResource"),
            self.url("railProxy"),
        )
    }

    /// The credentials of the executor and the operator identity.
    pub(crate) fn credentials(&self) -> (String, String) {
        (self.token("executor"), self.token("operator"))
    }

    /// A connection pool on the stack's `db` (`paydb`, `lockdb`).
    pub(crate) async fn pool(&self, db: &str) -> sqlx::PgPool {
        sqlx::PgPool::connect(&self.url(db))
            .await
            .unwrap_or_else(|e| panic!("{db}: {e}"))
    }

    /// Appends `lines` to the stack's tokens file (each service re-reads it when it changes) and
    /// waits until the first line's token is known at all three services (not 401).
    async fn add_tokens(&self, lines: &[(&str, &str, &str)]) {
        let path = self.url("tokensFile");
        let mut text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
        for (identity, token, roles) in lines {
            text.push_str(&format!("{identity} {token} {roles}\n"));
        }
        std::fs::write(&path, text).unwrap_or_else(|e| panic!("{path}: {e}"));
        let (lock, payment, proxy) = self.services();
        for url in [
            format!("{lock}/v1/locks"),
            format!("{payment}/v1/accounts/none"),
            format!("{proxy}/v1/rail/high-water/none"),
        ] {
            let what = format!("{url} reads the new tokens");
            eventually(&what, Duration::from_secs(20), || async {
                let (status, _, _) = get_as(&url, lines[0].1).await;
                (status != 401).then_some(())
            })
            .await;
        }
    }

    /// A digest of every row of every table of paydb and lockdb, and the rail's statement.
    /// Asserts that the `refused` requests since the [`DevStack::snapshot`] `before` changed
    /// nothing; the snapshot now.
    async fn unchanged_since(
        &self,
        before: &[(String, String)],
        refused: usize,
    ) -> Vec<(String, String)> {
        let after = self.snapshot().await;
        assert_eq!(before, after, "{refused} refused requests changed nothing");
        after
    }

    async fn snapshot(&self) -> Vec<(String, String)> {
        let mut out = Vec::new();
        for db in ["paydb", "lockdb"] {
            let pool = self.pool(db).await;
            let tables: Vec<String> = sqlx::query_scalar(
                "SELECT tablename::text FROM pg_tables WHERE schemaname = 'public' ORDER BY 1",
            )
            .fetch_all(&pool)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
            for table in tables {
                // The table names come from pg_tables, quoted.
                let row = sqlx::query(sqlx::AssertSqlSafe(format!(
                    "SELECT count(*)::text AS n, \
                     coalesce(md5(string_agg(t::text, '|' ORDER BY t::text)), '') AS d \
                     FROM \"{table}\" t"
                )))
                .fetch_one(&pool)
                .await
                .unwrap_or_else(|e| panic!("{table}: {e}"));
                let n: String = row.get("n");
                let d: String = row.get("d");
                out.push((format!("{db}.{table}"), format!("{n}:{d}")));
            }
            pool.close().await;
        }
        out.push((
            "rail statement".into(),
            self.rail_statement().await.to_string(),
        ));
        out
    }

    /// The rail stub's statement.
    pub(crate) async fn rail_statement(&self) -> Value {
        let url = format!("{}/statement", self.url("railStub"));
        raw(Method::GET, &url, &[], None).await.2
    }

    /// `dlock ARGS` against the payment resource as `identity` (its token in `file`) fails
    /// (`what`): 403 FORBIDDEN, with `hint`, and changes nothing.
    async fn forbidden_with_hint(
        &self,
        args: &[&str],
        (identity, file): (&str, &str),
        hint: &str,
        what: &str,
    ) {
        let before = self.snapshot().await;
        let (ok, _, said) = dlock_as(args, &self.url("paymentResource"), identity, file);
        assert!(!ok, "{what}: {said}");
        assert!(said.contains("403 FORBIDDEN"), "{said}");
        assert!(said.contains(&format!("hint: {hint}")), "{said}");
        assert_eq!(
            before,
            self.snapshot().await,
            "{what}: the refusal changed nothing"
        );
    }
}

/// Files of tokens for `--credential-file`, in a directory that goes with them.
pub(crate) struct TokenFiles(tempfile::TempDir);

impl TokenFiles {
    pub(crate) fn new() -> Self {
        Self(tempfile::tempdir().unwrap_or_else(|e| panic!("{e}")))
    }

    /// Writes `token` to the file `{name}.token`; its path.
    pub(crate) fn write(&self, name: &str, token: &str) -> String {
        let path = self.0.path().join(format!("{name}.token"));
        std::fs::write(&path, token).unwrap_or_else(|e| panic!("{e}"));
        path.display().to_string()
    }
}

/// `dlock ARGS` with `env`, its output logged to `log`, given `timeout` to exit: whether it
/// succeeded, and its log.
pub(crate) async fn run_logged(
    args: &[String],
    env: &[(String, String)],
    log: &Path,
    timeout: Duration,
) -> (bool, String) {
    let mut run = spawn_logged("dlock run", Path::new(EXE), args, env, Some(log))
        .unwrap_or_else(|e| panic!("{e:#}"));
    let status = tokio::task::spawn_blocking(move || run.wait_exit(timeout))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    (
        status.is_some_and(|s| s.success()),
        std::fs::read_to_string(log).unwrap_or_default(),
    )
}

/// `dlock fundings approve ID` against `payment` as the second treasury identity, `treasury-2`
/// (its token in `file`), of a funding `treasury` asked for: it succeeds (`what`) and says who
/// asked and who approved; its output.
fn approved_by_second(id: &str, payment: &str, file: &str, what: &str) -> String {
    let (ok, out, said) = dlock_as(&["fundings", "approve", id], payment, "treasury-2", file);
    assert!(ok, "{what}: {said}");
    assert!(
        out.contains("requested by treasury, approved by treasury-2"),
        "{out}"
    );
    out
}

/// The large funding `reference` (5 000 000 on an account of 100 000) applied once: the balance
/// `balance` reads, and one balanced pair in the ledger.
async fn assert_applied_once(pool: &sqlx::PgPool, balance: &str, reference: &str) {
    assert_eq!(scalar(pool, balance).await, 5_100_000, "applied once");
    let entries =
        format!("SELECT count(*) FROM ledger_entries WHERE reference = 'fund:{reference}'");
    assert_eq!(scalar(pool, &entries).await, 2, "one balanced pair");
}

/// `dlock ARGS` against `payment` as `identity`, its token read from `file`.
fn dlock_as(args: &[&str], payment: &str, identity: &str, file: &str) -> (bool, String, String) {
    let mut all = args.to_vec();
    all.extend([
        "--payment-resource",
        payment,
        "--identity",
        identity,
        "--credential-file",
        file,
    ]);
    dlock(&all)
}

/// `dlock ARGS` with no dlock variable of the test's environment: (success, stdout, stderr).
fn dlock(args: &[&str]) -> (bool, String, String) {
    let mut command = std::process::Command::new(EXE);
    command.args(args);
    for (name, _) in std::env::vars_os() {
        if name.to_string_lossy().starts_with("DLOCK_") {
            command.env_remove(name);
        }
    }
    let out = command
        .output()
        .unwrap_or_else(|e| panic!("dlock {args:?}: {e}"));
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The one number `sql` selects.
async fn scalar(pool: &sqlx::PgPool, sql: &str) -> i64 {
    sqlx::query_scalar::<_, i64>(sqlx::AssertSqlSafe(sql.to_owned()))
        .fetch_one(pool)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"))
}

/// A GET of `url` with `token`'s credential.
async fn get_as(url: &str, token: &str) -> (u16, String, Value) {
    let bearer = format!("Bearer {token}");
    raw(
        Method::GET,
        url,
        &[("authorization", bearer.as_str())],
        None,
    )
    .await
}

/// A write with `token`'s credential as `owner` (a fresh idempotency key each time), with a
/// fencing token and proof when given.
async fn write_as(
    url: &str,
    token: &str,
    owner: &str,
    fence: Option<(i64, &str)>,
    body: &Value,
) -> (u16, String, Value) {
    let bearer = format!("Bearer {token}");
    let key = format!("auth-{}", uuid::Uuid::new_v4());
    let fence_token = fence.map(|(t, _)| t.to_string());
    let mut headers = vec![
        ("content-type", "application/json"),
        ("authorization", bearer.as_str()),
        ("x-owner-id", owner),
        ("x-idempotency-key", key.as_str()),
    ];
    if let (Some(token), Some((_, proof))) = (fence_token.as_deref(), fence) {
        headers.push(("x-fencing-token", token));
        headers.push(("x-fencing-proof", proof));
    }
    raw(Method::POST, url, &headers, Some(&body.to_string())).await
}

/// [`assert_refused`] 403 FORBIDDEN, counted in `refused`.
fn forbidden(step: &str, answer: &(u16, String, Value), refused: &mut usize) {
    assert_refused(step, answer, 403, "FORBIDDEN");
    *refused += 1;
}

fn assert_refused(step: &str, answer: &(u16, String, Value), status: u16, code: &str) {
    let (got, content_type, body) = answer;
    assert_eq!(*got, status, "{step}: {body}");
    assert_eq!(content_type, JSON, "{step}: content type");
    assert_eq!(body["code"], code, "{step}: {body}");
    assert!(
        body["message"].as_str().is_some_and(|m| !m.is_empty()),
        "{step}: the envelope says what happened: {body}"
    );
    assert_eq!(
        body["retrySafe"],
        json!(code == "AUTH_UNAVAILABLE"),
        "{step}"
    );
}

/// `dlock serve {name}` with the configuration `pairs` (in a file beside `log`).
fn serve(name: &str, pairs: Vec<(String, String)>, log: &Path) -> ManagedChild {
    let args = crate::harness::serve_args(name, &pairs, log);
    spawn_logged(name, Path::new(EXE), &args, &[], Some(log)).unwrap_or_else(|e| panic!("{e:#}"))
}

/// Opens `account` with 100 000 and has `treasury` ask for 5 000 000 more, above the dev
/// stack's dual-approval threshold: the funding is recorded and waits for a second treasury
/// identity (idempotency key `fund-large-{tag}`, reference `large-{tag}`).
pub async fn large_funding_waits(
    treasury: &PaymentClient,
    account: &str,
    tag: &str,
) -> dlock_contract::payment::PendingFunding {
    open_account(treasury, account, Some(100_000)).await;
    let pending = treasury
        .request_funding(
            account,
            &format!("fund-large-{tag}"),
            &dlock_contract::payment::FundRequest {
                amount_minor: 5_000_000,
                reference: format!("large-{tag}"),
            },
        )
        .await
        .unwrap_or_else(|e| panic!("a large funding is recorded: {e}"));
    assert_eq!(pending.status, "PENDING_APPROVAL");
    pending
}
