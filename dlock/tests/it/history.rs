//! A Jepsen-style history check of the lock server (docs/testing.md#history-check): six clients
//! open sessions and acquire, renew, release, read and revoke over three keys, heartbeating, on
//! a real `dlock serve lock-server` process, while it is frozen (SIGSTOP, SIGCONT), killed
//! (SIGKILL) and restarted, and its store fails: PostgreSQL restarted, or the leader of a
//! three-member etcd cluster killed. Every call is recorded with its wall-clock call and return
//! times and its answer; the history goes to `DLOCK_HISTORY_DIR` (default `target/history/`)
//! and is checked by porcupine against a model of a lease lock with global fencing tokens
//! (e2e/history-check, built by scripts/history-check). An answer whose outcome is unknown (503
//! OUTCOME_UNKNOWN, 500, no answer) is recorded as such: it may or may not have taken effect.
//!
//! A positive control plants three violations in copies of the history (a token given to a
//! second acquire; a read that shows a released grant still held; an acquire whose grant was
//! then used answered `503 NOT_LEADER`) and requires the checker to refuse each and name the
//! key or the planted call.
//!
//! history/pg_failover.rs runs the same workload across a PostgreSQL failover.
//!
//! `DLOCK_HISTORY_SECS` (default 40) sets the length of each backend's run: the faults repeat
//! in cycles of about 25 s, so a long run (e.g. 600) goes through many of each. `DLOCK_BIN`
//! runs another `dlock` binary as the lock server.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use dlock_contract::auth::Credential;
use dlock_contract::client::{ClientError, LockClient};
use dlock_contract::error::ErrorCode;
use dlock_devstack::etcd_cluster::EtcdCluster;
use dlock_devstack::{ManagedChild, PgServer};
use nix::sys::signal::Signal;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{Value, json};
use tokio::sync::Mutex;

use crate::harness::{
    Backend, client, eventually, leading_member, on_each_backend, port, serve_process,
    serve_process_of,
};

const CLIENTS: usize = 6;
const KEYS: [&str; 3] = ["hist:a", "hist:b", "hist:c"];
const SESSION_TTL_MS: i64 = 10_000;
const GRANT_TTL_MS: i64 = 2_000;
const EXECUTOR_TOKEN: &str = "history-executor-token-0123456789";
const OPERATOR_TOKEN: &str = "history-operator-token-0123456789";

fn now_ns() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as i64)
        .unwrap_or_default()
}

/// The history: one JSON value per line, calls and faults, in the order they ended.
#[derive(Default)]
struct History(Mutex<Vec<Value>>);

impl History {
    async fn push(&self, line: Value) {
        self.0.lock().await.push(line);
    }
}

/// A call about to be made: what it is, and when it was sent.
struct Call {
    line: Value,
    call: i64,
}

impl Call {
    fn new(client: usize, op: &str) -> Self {
        Self {
            line: json!({"client": client, "op": op}),
            call: now_ns(),
        }
    }

    fn with(mut self, field: &str, value: impl Into<Value>) -> Self {
        self.line[field] = value.into();
        self.call = now_ns();
        self
    }

    /// The answer: `Ok(out)`, or the error, classified as the contract does: a write whose
    /// outcome is unknown (OUTCOME_UNKNOWN, INTERNAL, no answer after the send) is `unknown`;
    /// a read that got no answer changed nothing either way (`fail`).
    fn finish(mut self, answer: Result<Value, &ClientError>) -> Value {
        let ret = now_ns();
        self.line["call"] = self.call.into();
        let read = self.line["op"] == "read";
        match answer {
            Ok(out) => {
                self.line["ret"] = ret.into();
                self.line["status"] = "ok".into();
                self.line["out"] = out;
            }
            Err(e) => {
                let (unknown, code) = match e {
                    ClientError::Api { body, .. } => (
                        matches!(body.code, ErrorCode::OutcomeUnknown | ErrorCode::Internal),
                        body.code.as_str().to_owned(),
                    ),
                    ClientError::Transport { connect: true, .. } => {
                        (false, "NO_CONNECTION".to_owned())
                    }
                    ClientError::Transport { .. } => (true, "NO_ANSWER".to_owned()),
                    ClientError::Protocol { .. } => (true, "PROTOCOL".to_owned()),
                };
                let unknown = unknown && !read;
                self.line["ret"] = if unknown { Value::Null } else { ret.into() };
                self.line["status"] = if unknown { "unknown" } else { "fail" }.into();
                self.line["code"] = code.into();
                self.line["out"] = json!({});
            }
        }
        self.line
    }
}

fn code(e: &ClientError) -> Option<ErrorCode> {
    e.code()
}

fn session_gone(e: &ClientError) -> bool {
    matches!(
        code(e),
        Some(ErrorCode::SessionExpired | ErrorCode::SessionUnknown)
    )
}

/// What one client knows of its own state.
struct Mine {
    /// The session, and the time (ns) until which it lives at least: the last open or
    /// heartbeat that succeeded, sent then, plus the session's TTL.
    session: Option<(uuid::Uuid, i64)>,
    session_ttl_ms: i64,
    last_heartbeat: Instant,
    held: Option<(&'static str, i64)>,
    /// A key an acquire or release left in doubt: read it before anything else.
    doubt: Option<&'static str>,
}

/// One client's loop until `stop`: a random walk through the lock server's calls.
async fn client_loop(
    i: usize,
    lock: LockClient,
    operator: LockClient,
    history: Arc<History>,
    stop: Arc<AtomicBool>,
    seed: u64,
) {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut seen: HashMap<&'static str, i64> = HashMap::new();
    let mut me = Mine {
        session: None,
        session_ttl_ms: SESSION_TTL_MS,
        last_heartbeat: Instant::now(),
        held: None,
        doubt: None,
    };
    while !stop.load(Ordering::Relaxed) {
        tokio::time::sleep(Duration::from_millis(rng.random_range(5..25))).await;
        let Some((session, until)) = me.session else {
            let call = Call::new(i, "open");
            let answer = lock.create_session(Some(SESSION_TTL_MS)).await;
            let at = call.call;
            let line = call.finish(
                answer
                    .as_ref()
                    .map(|s| json!({"new_session": s.session_id.to_string()})),
            );
            history.push(line).await;
            match answer {
                Ok(s) => {
                    // The TTL as granted (the server may clamp it down).
                    me.session_ttl_ms = s.ttl_millis;
                    me.session = Some((s.session_id, at + s.ttl_millis * 1_000_000));
                    me.last_heartbeat = Instant::now();
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
            }
            continue;
        };
        let sid = session.to_string();
        let base = |op: &str| {
            Call::new(i, op)
                .with("session", sid.clone())
                .with("session_until", until)
        };

        // A heartbeat every second keeps the session (10 s) alive through the faults, and a
        // few more at random.
        if me.last_heartbeat.elapsed() > Duration::from_secs(1) || rng.random_bool(0.05) {
            let call = base("heartbeat");
            let at = call.call;
            let answer = lock.heartbeat(session).await;
            history
                .push(call.finish(answer.as_ref().map(|_| json!({}))))
                .await;
            match answer {
                Ok(_) => {
                    me.session = Some((session, at + me.session_ttl_ms * 1_000_000));
                    me.last_heartbeat = Instant::now();
                }
                Err(e) if session_gone(&e) => me = forget(me),
                Err(_) => {}
            }
            continue;
        }

        // An acquire or release in doubt is settled by a read of its key, as the contract says.
        if let Some(key) = me.doubt {
            let call = Call::new(i, "read").with("key", key);
            let answer = lock.get(key).await;
            history.push(call.finish(read_out(&answer))).await;
            match answer {
                Ok(info) => {
                    me.doubt = None;
                    me.held = match (info.held, info.session_id, info.fencing_token) {
                        (true, Some(s), Some(t)) if s == session => Some((key, t)),
                        _ => None,
                    };
                }
                Err(e) if code(&e) == Some(ErrorCode::NotFound) => me.doubt = None,
                Err(_) => {}
            }
            continue;
        }

        let roll: u32 = rng.random_range(0..100);
        if let Some((key, token)) = me.held {
            if roll < 45 {
                let call = base("renew")
                    .with("key", key)
                    .with("token", token)
                    .with("ttl_ms", GRANT_TTL_MS);
                let answer = lock.renew(key, session, token, Some(GRANT_TTL_MS)).await;
                history
                    .push(call.finish(answer.as_ref().map(|g| json!({"token": g.fencing_token}))))
                    .await;
                match answer {
                    Err(e) if code(&e) == Some(ErrorCode::LockLost) => me.held = None,
                    Err(e) if session_gone(&e) => me = forget(me),
                    _ => {}
                }
            } else if roll < 85 {
                let call = base("release").with("key", key).with("token", token);
                let answer = lock.release(key, session, token).await;
                history
                    .push(call.finish(answer.as_ref().map(|_| json!({}))))
                    .await;
                match answer {
                    Ok(()) => me.held = None,
                    Err(e) if code(&e) == Some(ErrorCode::LockLost) => me.held = None,
                    Err(e) if session_gone(&e) => me = forget(me),
                    Err(e) if e.outcome_unknown() => {
                        me.held = None;
                        me.doubt = Some(key);
                    }
                    Err(_) => {}
                }
            } else {
                read(
                    i,
                    &lock,
                    KEYS[rng.random_range(0..KEYS.len())],
                    &history,
                    &mut seen,
                )
                .await;
            }
            continue;
        }
        let key = KEYS[rng.random_range(0..KEYS.len())];
        if roll < 60 {
            let call = base("acquire")
                .with("key", key)
                .with("ttl_ms", GRANT_TTL_MS);
            let answer = lock.acquire(key, session, Some(GRANT_TTL_MS), None).await;
            history
                .push(call.finish(answer.as_ref().map(|g| json!({"token": g.fencing_token}))))
                .await;
            match answer {
                Ok(g) => me.held = Some((key, g.fencing_token)),
                Err(e) if session_gone(&e) => me = forget(me),
                Err(e) if e.outcome_unknown() => me.doubt = Some(key),
                Err(_) => {}
            }
        } else if roll < 80 {
            read(i, &lock, key, &history, &mut seen).await;
        } else if roll < 86 {
            // Half of the revocations name the token this client last saw on the key.
            let expected = seen.get(key).copied().filter(|_| rng.random_bool(0.5));
            let call = Call::new(i, "revoke")
                .with("key", key)
                .with("token", expected.unwrap_or_default());
            let answer = operator
                .revoke(
                    key,
                    "history-check",
                    "the history workload revokes",
                    expected,
                )
                .await;
            history
                .push(call.finish(answer.as_ref().map(
                    |r| json!({"revoked_token": r.revoked_token, "floor": r.new_token_floor}),
                )))
                .await;
        } else if roll < 89 {
            let call = base("end");
            let answer = lock.end_session(session).await;
            history
                .push(call.finish(answer.as_ref().map(|_| json!({}))))
                .await;
            // Whatever the answer, this client starts a new session: one in doubt lapses.
            me = forget(me);
        } else {
            read(i, &lock, key, &history, &mut seen).await;
        }
    }
}

fn forget(me: Mine) -> Mine {
    Mine {
        session: None,
        held: None,
        doubt: None,
        ..me
    }
}

fn read_out(
    answer: &Result<dlock_contract::lock::LockInfo, ClientError>,
) -> Result<Value, &ClientError> {
    answer.as_ref().map(|info| {
        json!({
            "held": info.held,
            "session": info.session_id.map(|s| s.to_string()).unwrap_or_default(),
            "token": info.fencing_token.unwrap_or_default(),
        })
    })
}

/// A read of `key`; the token it shows is remembered in `seen` (for a guarded revocation).
async fn read(
    i: usize,
    lock: &LockClient,
    key: &'static str,
    history: &History,
    seen: &mut HashMap<&'static str, i64>,
) {
    let call = Call::new(i, "read").with("key", key);
    let answer = lock.get(key).await;
    history.push(call.finish(read_out(&answer))).await;
    if let Ok(info) = answer
        && let Some(token) = info.fencing_token
    {
        seen.insert(key, token);
    }
}

/// A store under the lock server: the lock server's keys for it, and the fault that fails it
/// once in each cycle of faults (what was done, for the history).
trait StoreFault {
    fn pairs(&self) -> Vec<(String, String)>;
    async fn fail(&mut self) -> String;
}

/// The store under the lock server, and what fails it.
enum Store {
    Pg(PgServer),
    Etcd(EtcdCluster),
}

impl Store {
    fn start(backend: Backend) -> Self {
        match backend {
            Backend::Pg => {
                let pg = PgServer::start(None).unwrap_or_else(|e| panic!("PostgreSQL: {e:#}"));
                pg.create_database("lockdb")
                    .unwrap_or_else(|e| panic!("create lockdb: {e:#}"));
                Store::Pg(pg)
            }
            Backend::Etcd => Store::Etcd(
                EtcdCluster::start(3, None).unwrap_or_else(|e| panic!("etcd cluster: {e:#}")),
            ),
        }
    }
}

impl StoreFault for Store {
    fn pairs(&self) -> Vec<(String, String)> {
        match self {
            Store::Pg(pg) => vec![
                ("lock.backend".into(), "pg".into()),
                ("lock.pg.url".into(), pg.url("lockdb")),
                ("lock.pg.acquire-timeout-ms".into(), "1000".into()),
            ],
            Store::Etcd(cluster) => vec![
                ("lock.backend".into(), "etcd".into()),
                ("lock.etcd.endpoints".into(), cluster.endpoints().join(",")),
                ("lock.etcd.request-timeout-ms".into(), "1500".into()),
                ("lock.etcd.connect-timeout-ms".into(), "500".into()),
            ],
        }
    }

    /// Fails the store: PostgreSQL restarted; etcd's leader killed, restarted after 4 s.
    async fn fail(&mut self) -> String {
        match self {
            Store::Pg(pg) => {
                tokio::task::block_in_place(|| pg.restart())
                    .unwrap_or_else(|e| panic!("restart PostgreSQL: {e:#}"));
                "PostgreSQL restarted".to_owned()
            }
            Store::Etcd(cluster) => {
                let leader = etcd_leader(cluster).await;
                cluster.kill(leader);
                tokio::time::sleep(Duration::from_secs(4)).await;
                tokio::task::block_in_place(|| cluster.restart(leader))
                    .unwrap_or_else(|e| panic!("restart etcd member {leader}: {e:#}"));
                format!("etcd leader (member {leader}) killed, back after 4 s")
            }
        }
    }
}

/// The member that leads now, by etcd's status API.
async fn etcd_leader(cluster: &EtcdCluster) -> usize {
    eventually(
        "an etcd member says it leads",
        Duration::from_secs(20),
        || leading_member(cluster, None),
    )
    .await
}

/// Where histories go: `DLOCK_HISTORY_DIR`, or `target/history/`.
fn history_dir() -> PathBuf {
    let dir = std::env::var_os("DLOCK_HISTORY_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("..")
                .join("target")
                .join("history")
        });
    std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    dir
}

/// Runs the checker on `history`: its exit status and what it printed. The checker is
/// `DLOCK_HISTORY_CHECK_BIN`, or scripts/history-check builds it (cached).
fn check(history: &Path) -> (i32, String) {
    let bin = std::env::var_os("DLOCK_HISTORY_CHECK_BIN").map(PathBuf::from);
    let mut command = match bin {
        Some(bin) => std::process::Command::new(bin),
        None => std::process::Command::new(
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/history-check"),
        ),
    };
    let output = command.arg(history).output().unwrap_or_else(|e| {
        panic!("running the history checker: {e} (scripts/history-check needs Go)")
    });
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
            .lines()
            .filter(|l| !l.starts_with("history-check: cached"))
            .map(|l| format!("{l}\n"))
            .collect::<String>()
    );
    std::fs::write(history.with_extension("verdict.txt"), &text).unwrap_or_else(|e| panic!("{e}"));
    (output.status.code().unwrap_or(-1), text)
}

fn write_lines(path: &Path, lines: &[Value]) {
    let text: String = lines.iter().map(|l| format!("{l}\n")).collect();
    std::fs::write(path, text).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
}

/// A workload run under faults, its history written to `path`.
struct Run {
    name: String,
    dir: PathBuf,
    path: PathBuf,
    lines: Vec<Value>,
    secs: u64,
    faults: usize,
    log: PathBuf,
    _scratch: tempfile::TempDir,
}

/// Six clients against a lock server on `store` for `DLOCK_HISTORY_SECS` (default 40), while
/// faults come in cycles; the history is written as `{label}-{time}.jsonl`. Fails unless the
/// workload made progress.
async fn run_under_faults(store: &mut impl StoreFault, label: &str) -> Run {
    let secs: u64 = std::env::var("DLOCK_HISTORY_SECS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(40);
    let scratch = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let tokens = scratch.path().join("tokens");
    std::fs::write(
        &tokens,
        format!("executor {EXECUTOR_TOKEN}\noperator {OPERATOR_TOKEN}\n"),
    )
    .unwrap_or_else(|e| panic!("{e}"));
    let listen: std::net::SocketAddr = ([127, 0, 0, 1], port()).into();
    let mut pairs = vec![("server.listen".to_owned(), listen.to_string())];
    pairs.extend(store.pairs());
    pairs.extend([
        ("auth.mode".to_owned(), "tokens".to_owned()),
        ("auth.tokens-file".to_owned(), tokens.display().to_string()),
        ("fencing.insecure-no-proofs".to_owned(), "true".to_owned()),
    ]);
    let log = scratch.path().join("lock-server.log");
    let mut server = lock_server(listen, &pairs, &log);
    let url = format!("http://{listen}");

    let history = Arc::new(History::default());
    let stop = Arc::new(AtomicBool::new(false));
    let seed = now_ns() as u64;
    let mut clients = Vec::new();
    for i in 0..CLIENTS {
        let lock = client(&url, &format!("executor/c{i}"))
            .with_credential(Some(Credential::fixed(EXECUTOR_TOKEN)));
        let operator =
            client(&url, "operator").with_credential(Some(Credential::fixed(OPERATOR_TOKEN)));
        clients.push(tokio::spawn(client_loop(
            i,
            lock,
            operator,
            history.clone(),
            stop.clone(),
            seed.wrapping_add(i as u64),
        )));
    }

    // Faults in cycles until the time is up: quiet, frozen, quiet, killed, quiet, store failed.
    let started = Instant::now();
    let deadline = started + Duration::from_secs(secs);
    let quiet = Duration::from_secs(4);
    let mut step = 0usize;
    while Instant::now() + quiet < deadline {
        tokio::time::sleep(quiet).await;
        let start = now_ns();
        let what = match step % 3 {
            0 => {
                server
                    .signal(Signal::SIGSTOP)
                    .unwrap_or_else(|e| panic!("{e:#}"));
                tokio::time::sleep(Duration::from_secs(3)).await;
                server
                    .signal(Signal::SIGCONT)
                    .unwrap_or_else(|e| panic!("{e:#}"));
                "lock server frozen 3 s (SIGSTOP, SIGCONT)".to_owned()
            }
            1 => {
                server.kill();
                tokio::time::sleep(Duration::from_millis(500)).await;
                server = tokio::task::block_in_place(|| lock_server(listen, &pairs, &log));
                "lock server killed (SIGKILL) and restarted".to_owned()
            }
            _ => store.fail().await,
        };
        history
            .push(json!({"fault": what, "start": start, "end": now_ns()}))
            .await;
        step += 1;
    }
    stop.store(true, Ordering::Relaxed);
    for c in clients {
        c.await.unwrap_or_else(|e| panic!("a client panicked: {e}"));
    }
    let lines = history.0.lock().await.clone();
    drop(server);

    let name = format!("{label}-{}", chrono::Utc::now().format("%Y%m%dT%H%M%SZ"));
    let dir = history_dir();
    let path = dir.join(format!("{name}.jsonl"));
    write_lines(&path, &lines);
    // Beside the history, for the answers it shows (the scratch copy goes with the run).
    let _ = std::fs::copy(&log, dir.join(format!("{name}.lock-server.log")));
    let calls = lines.iter().filter(|l| l.get("op").is_some()).count();
    let oks = lines.iter().filter(|l| l["status"] == "ok").count();
    assert!(
        oks * 2 > calls && calls > 200,
        "the workload made progress: {oks} of {calls} calls answered ok ({})",
        path.display()
    );
    Run {
        name,
        dir,
        path,
        lines,
        secs,
        faults: step,
        log,
        _scratch: scratch,
    }
}

impl Run {
    /// The checker's verdict on the history, printed with the run's figures; fails unless it is
    /// linearizable. `on` names the store, for the failure.
    fn linearizable(&self, on: &str) -> String {
        let calls = self.lines.iter().filter(|l| l.get("op").is_some()).count();
        let checked_at = Instant::now();
        let (status, verdict) = check(&self.path);
        println!(
            "{}: {calls} calls in {} s with {} faults, checked in {} ms:\n{verdict}",
            self.name,
            self.secs,
            self.faults,
            checked_at.elapsed().as_millis()
        );
        assert_eq!(
            status,
            0,
            "the lock server's history on {on} is not linearizable against the lease-lock model \
             (history {}, visualisation beside it, lock server's log {}):\n{verdict}",
            self.path.display(),
            self.log.display()
        );
        verdict
    }
}

async fn history_is_linearizable(backend: Backend) {
    let mut store = Store::start(backend);
    let run = run_under_faults(&mut store, &format!("{backend:?}").to_lowercase()).await;
    run.linearizable(&format!("{backend:?}"));
    planted_violations_are_caught(&run.dir, &run.name, &run.lines);
}

/// `dlock serve lock-server` on `listen`, ready: the binary `DLOCK_BIN` names (a long run
/// against a release build, or against a copy that a rebuild cannot replace mid-run), else the
/// test build's.
fn lock_server(
    listen: std::net::SocketAddr,
    pairs: &[(String, String)],
    log: &Path,
) -> ManagedChild {
    let Some(exe) = std::env::var_os("DLOCK_BIN") else {
        return serve_process("lock-server", listen, pairs, log);
    };
    let ready_within = Duration::from_secs(30);
    serve_process_of(
        Path::new(&exe),
        "lock-server",
        listen,
        pairs,
        log,
        ready_within,
    )
}

mod pg_failover;
mod planted;

use planted::{applied_acquire_refused_is_caught, planted_violations_are_caught};

on_each_backend!(history_is_linearizable => history_on_pg_is_linearizable, history_on_etcd_is_linearizable);
