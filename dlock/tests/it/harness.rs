//! Starts what a test needs: a throwaway PostgreSQL or etcd and lock servers on it, real `dlock`
//! processes of a devstack [`Stack`], and the helpers the tests share.

use std::net::SocketAddr;
use std::time::Duration;

use dlock_contract::client::LockClient;
use dlock_devstack::stack::{LockBackend, Role, Stack};
use dlock_devstack::{
    EtcdServer, ManagedChild, PgServer, free_port, http_status, spawn_logged, wait_until,
};
use sqlx::{Connection, PgConnection};

pub use crate::shared::http::{post_json, raw};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    Pg,
    Etcd,
}

pub const BOTH: [Backend; 2] = [Backend::Pg, Backend::Etcd];

/// A test named `$test` that runs the scenario `$scenario(backend)` on each of [`BOTH`] in turn.
macro_rules! on_both_backends {
    ($test:ident => $scenario:ident) => {
        #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
        async fn $test() {
            for backend in $crate::harness::BOTH {
                $scenario(backend).await;
            }
        }
    };
}
pub(crate) use on_both_backends;

/// Two tests, `$pg` and `$etcd`, that run the scenario `$scenario(backend)` on that backend.
macro_rules! on_each_backend {
    ($scenario:ident => $pg:ident, $etcd:ident) => {
        #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
        async fn $pg() {
            $scenario($crate::harness::Backend::Pg).await;
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
        async fn $etcd() {
            $scenario($crate::harness::Backend::Etcd).await;
        }
    };
}
pub(crate) use on_each_backend;

/// Lock servers on a throwaway backend: a [`Stack`] of the lock server alone, deferred, so
/// that a test starts as many replicas as it needs ([`LockStack::serve`]), each a real
/// `dlock serve lock-server` process on the stack's PostgreSQL or etcd.
pub struct LockStack {
    stack: Stack,
    pub backend: Backend,
    /// Keys the replicas started from now on get besides the stack's.
    pub extra: Vec<(String, String)>,
}

impl LockStack {
    /// A backend with the given extra configuration for the lock servers on it.
    pub fn backend(backend: Backend, extra: &[(&str, &str)]) -> Self {
        let builder = Stack::builder(env!("CARGO_BIN_EXE_dlock"))
            .only(&[Role::LockServer])
            .deferred(&[Role::LockServer]);
        let defaults = match backend {
            Backend::Pg => vec![("lock.pg.acquire-timeout-ms", "5000")],
            Backend::Etcd => vec![
                ("lock.etcd.request-timeout-ms", "5000"),
                ("lock.etcd.connect-timeout-ms", "500"),
            ],
        };
        let builder = match backend {
            Backend::Pg => builder.lock_backend(LockBackend::Pg),
            Backend::Etcd => builder.lock_backend(LockBackend::Etcd),
        };
        let builder = defaults
            .into_iter()
            .chain(extra.iter().copied())
            .fold(builder, |b, (key, value)| {
                b.set(Role::LockServer, key, value)
            });
        Self {
            stack: builder.start(),
            backend,
            extra: Vec::new(),
        }
    }

    /// The stack's PostgreSQL, when the backend is PostgreSQL.
    pub fn pg(&self) -> Option<&PgServer> {
        self.stack.pg.as_ref()
    }

    pub fn pg_mut(&mut self) -> Option<&mut PgServer> {
        self.stack.pg.as_mut()
    }

    /// The stack's etcd, when the backend is etcd.
    pub fn etcd(&self) -> Option<&EtcdServer> {
        self.stack.etcd.as_ref()
    }

    pub fn etcd_mut(&mut self) -> Option<&mut EtcdServer> {
        self.stack.etcd.as_mut()
    }

    /// The configuration of a lock server on this backend listening on `listen`, as
    /// `(key, value)` pairs: the stack's, then [`LockStack::extra`].
    pub fn pairs(&self, listen: SocketAddr) -> Vec<(String, String)> {
        let mut pairs = vec![("server.listen".to_owned(), listen.to_string())];
        for (key, value) in self
            .stack
            .config(Role::LockServer)
            .into_iter()
            .chain(self.extra.iter().cloned())
        {
            match pairs.iter_mut().find(|(k, _)| *k == key) {
                Some(pair) => pair.1 = value,
                None => pairs.push((key, value)),
            }
        }
        pairs
    }

    /// A backend as [`LockStack::backend`] makes it, and one lock server on it (its URL).
    pub async fn serving(backend: Backend, extra: &[(&str, &str)]) -> (Self, String) {
        let mut stack = Self::backend(backend, extra);
        let url = stack.serve().await;
        (stack, url)
    }

    /// Starts one more lock-server replica, a process of the stack's; returns its URL.
    pub async fn serve(&mut self) -> String {
        let extra: Vec<(&str, &str)> = self
            .extra
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        let stack = &mut self.stack;
        // It waits for the process to answer /readyz: off the runtime's worker.
        tokio::task::block_in_place(|| stack.add(Role::LockServer, &extra).url())
    }

    /// Starts a lock server with the stack's configuration as a `dlock serve lock-server`
    /// process of the test's own on `port`, logging to `log`: for a test that kills it and
    /// starts it again on the same port.
    pub fn spawn_process(&self, port: u16, log: &std::path::Path) -> ManagedChild {
        let listen: SocketAddr = ([127, 0, 0, 1], port).into();
        serve_process("lock-server", listen, &self.pairs(listen), log)
    }
}

/// Servers running in tasks of this process; aborted on drop.
#[derive(Default)]
pub struct Servers(Vec<tokio::task::JoinHandle<()>>);

impl Servers {
    pub fn push(&mut self, server: tokio::task::JoinHandle<()>) {
        self.0.push(server);
    }
}

impl Drop for Servers {
    fn drop(&mut self) {
        for server in &self.0 {
            server.abort();
        }
    }
}

/// The arguments of `dlock serve {service}` with the configuration `pairs` in a file beside
/// `log` (services take their configuration from a file, never from the environment).
pub fn serve_args(service: &str, pairs: &[(String, String)], log: &std::path::Path) -> Vec<String> {
    let mut args = vec!["serve".to_owned(), service.to_owned()];
    let file = log.with_extension("toml");
    args.extend(dlock_devstack::write_config(&file, pairs).unwrap_or_else(|e| panic!("{e:#}")));
    args
}

/// Starts `dlock serve {service}` with the configuration `pairs` (in a file beside `log`), its
/// output in `log`, and waits until it answers `/readyz` on `listen`; a start that fails shows
/// the log.
pub fn serve_process(
    service: &str,
    listen: SocketAddr,
    pairs: &[(String, String)],
    log: &std::path::Path,
) -> ManagedChild {
    let exe = std::path::Path::new(env!("CARGO_BIN_EXE_dlock"));
    serve_process_of(exe, service, listen, pairs, log, Duration::from_secs(30))
}

/// [`serve_process`] of the `dlock` binary `exe`, given `ready_within` to answer `/readyz`.
pub fn serve_process_of(
    exe: &std::path::Path,
    service: &str,
    listen: SocketAddr,
    pairs: &[(String, String)],
    log: &std::path::Path,
    ready_within: Duration,
) -> ManagedChild {
    let args = serve_args(service, pairs, log);
    let mut child =
        spawn_logged(service, exe, &args, &[], Some(log)).unwrap_or_else(|e| panic!("{e:#}"));
    let what = format!("{} process", service.replace('-', " "));
    wait_until(&what, ready_within, || {
        !child.exited() && http_status(listen, "/readyz") == Some(200)
    })
    .unwrap_or_else(|e| {
        panic!(
            "{e:#}: {}",
            std::fs::read_to_string(log).unwrap_or_default()
        )
    });
    child
}

/// Waits up to 20 s for `child`, a service that must refuse its configuration (`what`), to stop
/// at start with a failure; its log (`log`).
pub fn stopped_at_start(child: &mut ManagedChild, what: &str, log: &std::path::Path) -> String {
    let status = child.wait_exit(Duration::from_secs(20));
    let text = std::fs::read_to_string(log).unwrap_or_default();
    assert!(
        status.is_some_and(|s| !s.success()),
        "{what} must stop at start, got {status:?}:\n{text}"
    );
    text
}

pub fn client(url: &str, owner: &str) -> LockClient {
    LockClient::new(url, owner).unwrap_or_else(|e| panic!("{e}"))
}

/// A new session of `client`'s, of `ttl_ms`.
pub async fn session(client: &LockClient, ttl_ms: i64) -> uuid::Uuid {
    client
        .create_session(Some(ttl_ms))
        .await
        .unwrap_or_else(|e| panic!("{}: {e}", client.owner_id()))
        .session_id
}

/// `session`, or else a new session of `client`'s of `ttl_ms`, kept in `session`: its id, or why
/// the new one was not created.
pub async fn session_kept(
    client: &LockClient,
    session: &mut Option<uuid::Uuid>,
    ttl_ms: i64,
) -> Result<uuid::Uuid, dlock_contract::client::ClientError> {
    if let Some(id) = *session {
        return Ok(id);
    }
    let id = client.create_session(Some(ttl_ms)).await?.session_id;
    *session = Some(id);
    Ok(id)
}

/// A client named `owner` on `url`, with a session of `ttl_ms`.
pub async fn party(url: &str, owner: &str, ttl_ms: i64) -> (LockClient, uuid::Uuid) {
    let c = client(url, owner);
    let s = session(&c, ttl_ms).await;
    (c, s)
}

/// `key` granted to `client` on `session` for `ttl_ms`.
pub async fn hold(
    client: &LockClient,
    key: &str,
    session: uuid::Uuid,
    ttl_ms: i64,
) -> dlock_contract::lock::LockGrant {
    client
        .acquire(key, session, Some(ttl_ms), None)
        .await
        .unwrap_or_else(|e| panic!("{} holds {key}: {e}", client.owner_id()))
}

/// Releases `client`'s grant of `key` (`token`, on `session`).
pub async fn release(client: &LockClient, key: &str, session: uuid::Uuid, token: i64) {
    client
        .release(key, session, token)
        .await
        .unwrap_or_else(|e| panic!("{} releases {key}: {e}", client.owner_id()));
}

/// `key` granted to `client` on `session` for `ttl_ms` (waiting up to `wait_ms` for it, when
/// given) and released at once: the grant's token.
pub async fn hold_and_release(
    client: &LockClient,
    key: &str,
    session: uuid::Uuid,
    ttl_ms: i64,
    wait_ms: Option<i64>,
) -> i64 {
    let token = client
        .acquire(key, session, Some(ttl_ms), wait_ms)
        .await
        .unwrap_or_else(|e| panic!("{} holds {key}: {e}", client.owner_id()))
        .fencing_token;
    release(client, key, session, token).await;
    token
}

/// Everything the etcd at `endpoint` holds under `prefix`.
pub async fn etcd_under(endpoint: &str, prefix: &str) -> etcd_client::GetResponse {
    let mut etcd = etcd_client::Client::connect([endpoint], None)
        .await
        .unwrap_or_else(|e| panic!("etcd: {e}"));
    let options = etcd_client::GetOptions::new().with_prefix();
    etcd.get(prefix, Some(options))
        .await
        .unwrap_or_else(|e| panic!("etcd {prefix}: {e}"))
}

/// What the service at `url` serves at `/metrics`; no answer, or one other than 2xx, fails the
/// test.
pub async fn metrics_of(url: &str) -> String {
    // A plain reqwest client, which needs the process's TLS provider.
    dlock_contract::tls::install_crypto_provider();
    let url = format!("{url}/metrics");
    let response = reqwest::get(&url)
        .await
        .unwrap_or_else(|e| panic!("{url}: {e}"));
    assert!(
        response.status().is_success(),
        "{url}: {}",
        response.status()
    );
    response
        .text()
        .await
        .unwrap_or_else(|e| panic!("{url}: {e}"))
}

/// The value of `sample` (a metric's name and labels) in the Prometheus text `text`.
pub fn metric(text: &str, sample: &str) -> f64 {
    text.lines()
        .find_map(|line| line.strip_prefix(sample)?.trim().parse::<f64>().ok())
        .unwrap_or_else(|| panic!("{sample} not in metrics:\n{text}"))
}

/// The group-commit metrics (docs/design.md#group-commit) a service serves at `{url}/metrics`:
/// the gauge `{prefix}_batch_queued` and the histogram `{prefix}_batch_size`, by kind.
pub struct BatchMetrics {
    pub url: String,
    pub prefix: &'static str,
}

impl BatchMetrics {
    async fn text(&self) -> String {
        metrics_of(&self.url).await
    }

    /// Waits until `n` requests of `kind` are queued behind the running transaction.
    pub async fn queued(&self, kind: &str, n: usize) {
        let sample = format!("{}_batch_queued{{kind=\"{kind}\"}}", self.prefix);
        eventually(
            &format!("{n} {kind}s queued"),
            Duration::from_secs(20),
            || async { (metric(&self.text().await, &sample) as usize == n).then_some(()) },
        )
        .await
    }

    /// (count, sum) of the batch-size histogram of `kind`.
    pub async fn batches(&self, kind: &str) -> (f64, f64) {
        let text = self.text().await;
        let sample = |part: &str| {
            let name = format!("{}_batch_size_{part}{{kind=\"{kind}\"}}", self.prefix);
            metric(&text, &name)
        };
        (sample("count"), sample("sum"))
    }

    /// Growth of the batch-size histogram of `kind` since `before` (a [`BatchMetrics::batches`]):
    /// (batches that ran, requests in them).
    pub async fn batches_since(&self, kind: &str, before: (f64, f64)) -> (f64, f64) {
        let after = self.batches(kind).await;
        (after.0 - before.0, after.1 - before.1)
    }
}

/// Waits until the service on loopback `port` answers `/readyz` with 200; `what` names it.
pub async fn until_ready(what: &str, port: u16) {
    let addr: SocketAddr = ([127, 0, 0, 1], port).into();
    eventually(what, Duration::from_secs(30), || async move {
        (http_status(addr, "/readyz") == Some(200)).then_some(())
    })
    .await;
}

/// A listener on a free loopback port, and its address.
pub async fn loopback() -> (tokio::net::TcpListener, SocketAddr) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .unwrap_or_else(|e| panic!("bind: {e}"));
    let addr = listener.local_addr().unwrap_or_else(|e| panic!("{e}"));
    (listener, addr)
}

/// Serves `app` on `listener` in a task of its own, until the task is aborted.
pub fn serve_in_task(
    listener: tokio::net::TcpListener,
    app: axum::Router,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let _ = dlock_server::http::serve(listener, app, std::future::pending()).await;
    })
}

pub fn port() -> u16 {
    free_port().unwrap_or_else(|e| panic!("{e}"))
}

/// A connection to the PostgreSQL database at `url` in a transaction that holds the rows
/// `select_for_update` (a `SELECT … FOR UPDATE` of one parameter, `param`) locks, until it is
/// closed ([`open`]) or dropped; asserts that it locked exactly one, `what`.
pub async fn hold_row<'q, T>(
    url: &str,
    select_for_update: &'static str,
    param: T,
    what: &str,
) -> PgConnection
where
    T: 'q + sqlx::Encode<'q, sqlx::Postgres> + sqlx::Type<sqlx::Postgres> + Send,
{
    let mut conn = PgConnection::connect(url)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    sqlx::query("BEGIN")
        .execute(&mut conn)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let locked = sqlx::query(select_for_update)
        .bind(param)
        .fetch_all(&mut conn)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(locked.len(), 1, "{what}, so its row can gate");
    conn
}

/// Lets a gate go: its locks end with its session.
pub async fn open(gate: PgConnection) {
    gate.close().await.unwrap_or_else(|e| panic!("{e}"));
}

/// What tests that start the services as processes on PostgreSQL need: a directory, a PostgreSQL
/// with `lockdb` and `paydb`, and in the directory a fencing-proof keys file of one key, `k1`.
pub struct ServiceDbs {
    pub dir: tempfile::TempDir,
    pub pg: PgServer,
    /// The keys file.
    pub keys: std::path::PathBuf,
}

impl ServiceDbs {
    /// [`ServiceDbs`] with `secret` (64 hex digits) as the key `k1`.
    pub fn start(secret: &str) -> Self {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let pg = PgServer::start(None).unwrap_or_else(|e| panic!("PostgreSQL: {e:#}"));
        for db in ["lockdb", "paydb"] {
            pg.create_database(db).unwrap_or_else(|e| panic!("{e:#}"));
        }
        let keys = dir.path().join("fencing-proof-keys");
        std::fs::write(&keys, format!("k1 {secret}\n")).unwrap_or_else(|e| panic!("{e}"));
        Self { dir, pg, keys }
    }
}

/// Where an executor run in this process reaches `stack`'s services.
pub fn endpoints(stack: &dlock_devstack::stack::Stack) -> dlock_executor::executor::Endpoints {
    dlock_executor::executor::Endpoints {
        lock_server: stack.lock().url(),
        payment_resource: stack.payment().url(),
        rail_proxy: stack.proxy().url(),
    }
}

/// Asserts that `answer` is a refusal with FENCED_OUT (`what`).
pub fn assert_fenced_out<T>(answer: Result<T, dlock_contract::client::ClientError>, what: &str) {
    assert_eq!(
        answer.err().and_then(|e| e.code()),
        Some(dlock_contract::ErrorCode::FencedOut),
        "{what}"
    );
}

/// A post of `payout` under `token`, as a worker whose grant was lost would send it (a forged
/// rail reference): asserts that the account fences it (`what`).
pub async fn stale_post_is_fenced(
    payment: &dlock_contract::payment_client::PaymentClient,
    payout: uuid::Uuid,
    token: i64,
    what: &str,
) {
    let post = payment
        .post(
            payout,
            dlock_contract::payment_client::Fence::new(
                &dlock_executor::manifest::idempotency_key(payout),
                token,
                None,
            ),
            "rail-forged",
            uuid::Uuid::new_v4(),
        )
        .await;
    assert_fenced_out(post, what);
}

/// The running member of `cluster` that says it leads, by etcd's status API (asked of each in
/// turn, connecting with `options`), if one does.
pub async fn leading_member(
    cluster: &dlock_devstack::etcd_cluster::EtcdCluster,
    options: Option<etcd_client::ConnectOptions>,
) -> Option<usize> {
    for i in 0..cluster.members.len() {
        if !cluster.members[i].running() {
            continue;
        }
        let endpoint = [cluster.endpoint(i)];
        let Ok(mut c) = etcd_client::Client::connect(endpoint, options.clone()).await else {
            continue;
        };
        let Ok(status) = c.status().await else {
            continue;
        };
        let me = status.header().map(|h| h.member_id()).unwrap_or_default();
        if status.leader() == me && me != 0 {
            return Some(i);
        }
    }
    None
}

/// Polls `probe` until it returns `Some`, failing the test after `timeout`.
pub async fn eventually<T, F, Fut>(what: &str, timeout: Duration, probe: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    eventually_or(what, timeout, probe, String::new).await
}

/// [`eventually`], and on failure the test's message ends with `explain()`: what the system
/// was doing when the wait ran out.
pub async fn eventually_or<T, F, Fut>(
    what: &str,
    timeout: Duration,
    mut probe: F,
    explain: impl FnOnce() -> String,
) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        if let Some(value) = probe().await {
            return value;
        }
        if tokio::time::Instant::now() >= deadline {
            panic!(
                "{what} did not happen within {} ms{}",
                timeout.as_millis(),
                explain()
            );
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The rows of each of `queries` (each selecting one text column), in order: what a test
/// compares between two ways of writing the same thing.
pub async fn text_rows(conn: &mut sqlx::PgConnection, queries: &[&'static str]) -> Vec<String> {
    let mut out = Vec::new();
    for sql in queries {
        let rows: Vec<(String,)> = sqlx::query_as(*sql)
            .fetch_all(&mut *conn)
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"));
        out.extend(rows.into_iter().map(|r| r.0));
    }
    out
}
