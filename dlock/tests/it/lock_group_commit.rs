//! Group commit of the lock server's acquires and releases on PostgreSQL
//! (docs/design.md#group-commit), against a real `dlock serve lock-server` process on a real
//! lockdb: requests that queue while a lockdb transaction of their kind runs go into the next one
//! together (dlock_acquire_many, dlock_release_many), and each still gets its own answer.
//!
//! A test makes a batch form for certain: from its own connection it holds the lock a "gate"
//! request needs (the key's advisory lock for an acquire, the grant's row for a release), sends
//! that request, which runs alone and waits in lockdb, then sends the requests under test, which
//! queue in the server (the `lock_batch_queued` gauge says how many), and only then lets the gate
//! go. The `lock_batch_size` histogram shows the batches that ran.

use std::collections::{BTreeMap, HashSet};
use std::time::Duration;

use dlock_contract::client::{ClientError, LockClient};
use dlock_contract::error::ErrorCode;
use dlock_contract::lock::LockGrant;
use dlock_devstack::ManagedChild;
use sqlx::{Connection, PgConnection};
use uuid::Uuid;

use crate::harness::{
    Backend, BatchMetrics, LockStack, client, eventually, hold_row, open, port, post_json, session,
};

mod failures;

const WAIT: Duration = Duration::from_secs(20);
/// The acquires under test may wait server-side this long: it only lengthens their client's
/// timeout (their keys are free), so a slow machine does not time them out while they queue.
const PATIENT_MS: i64 = 10_000;

struct Server {
    _process: ManagedChild,
    stack: LockStack,
    url: String,
    _dir: tempfile::TempDir,
}

/// A party: a client of its own owner with a session.
struct Party {
    client: LockClient,
    session: Uuid,
}

impl Server {
    async fn start() -> Self {
        let stack = LockStack::backend(Backend::Pg, &[("lock.pg.batch.max", "32")]);
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let port = port();
        let process = stack.spawn_process(port, &dir.path().join("lock-server.log"));
        Self {
            _process: process,
            stack,
            url: format!("http://127.0.0.1:{port}"),
            _dir: dir,
        }
    }

    async fn party(&self, owner: &str) -> Party {
        let client = client(&self.url, owner);
        let session = session(&client, 30_000).await;
        Party { client, session }
    }

    async fn parties(&self, prefix: &str, n: usize) -> Vec<Party> {
        let mut parties = Vec::new();
        for i in 0..n {
            parties.push(self.party(&format!("{prefix}-{i}")).await);
        }
        parties
    }

    fn psql(&self, sql: &str) -> String {
        self.stack
            .pg()
            .map(|pg| pg.psql("lockdb", sql).unwrap_or_else(|e| panic!("{e:#}")))
            .unwrap_or_default()
            .trim()
            .to_owned()
    }

    async fn connection(&self) -> PgConnection {
        let url = self.stack.pg().map(|pg| pg.url("lockdb"));
        PgConnection::connect(&url.unwrap_or_default())
            .await
            .unwrap_or_else(|e| panic!("{e}"))
    }

    /// A connection that holds `key`'s acquire lock (dlock_acquire's advisory lock) until
    /// [`open`] or until it is dropped.
    async fn gate_acquire(&self, key: &str) -> PgConnection {
        let mut conn = self.connection().await;
        sqlx::query("SELECT pg_advisory_lock(hashtextextended('dlock_acquire:' || $1, 0))")
            .bind(key)
            .execute(&mut conn)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        conn
    }

    /// A connection in a transaction that holds the row of `key`'s grant until [`open`].
    async fn gate_release(&self, key: &str) -> PgConnection {
        let url = self.stack.pg().map(|pg| pg.url("lockdb"));
        hold_row(
            &url.unwrap_or_default(),
            "SELECT fencing_token FROM locks WHERE lock_key = $1 FOR UPDATE",
            key,
            &format!("{key} is held"),
        )
        .await
    }

    /// Backends of lockdb waiting for a lock in a statement whose text holds `text`.
    fn waiting_in(&self, text: &str) -> Vec<i64> {
        self.psql(&format!(
            "SELECT pid FROM pg_stat_activity WHERE datname = 'lockdb' \
             AND wait_event_type IN ('Lock', 'Advisory') AND query LIKE '%{text}%' \
             AND pid <> pg_backend_pid()"
        ))
        .lines()
        .filter_map(|l| l.trim().parse().ok())
        .collect()
    }

    /// Waits until a statement calling `function` waits for a lock; its backend's pid.
    async fn waits_in(&self, function: &str) -> i64 {
        eventually(&format!("{function} waits for a lock"), WAIT, || async {
            self.waiting_in(&format!("{function}(")).first().copied()
        })
        .await
    }

    /// Its group-commit metrics.
    fn batch_metrics(&self) -> BatchMetrics {
        BatchMetrics {
            url: self.url.clone(),
            prefix: "lock",
        }
    }

    /// Sends `gate` (a request of `kind` that waits in lockdb behind `gate_conn`), then
    /// `requests` once it waits, then opens the gate once they are all queued; the answers of the
    /// gate and of the requests, and the batches of `kind` that ran meanwhile
    /// ([`BatchMetrics::batches_since`]).
    async fn gated<G: Future, R: Future>(
        &self,
        kind: &str,
        gate_conn: PgConnection,
        gate: G,
        requests: Vec<R>,
    ) -> (G::Output, Vec<R::Output>, (f64, f64)) {
        let metrics = self.batch_metrics();
        let before = metrics.batches(kind).await;
        let (gate, answers) = tokio::join!(gate, async {
            self.waits_in(&format!("dlock_{kind}")).await;
            let n = requests.len();
            let (answers, ()) = tokio::join!(futures::future::join_all(requests), async {
                metrics.queued(kind, n).await;
                open(gate_conn).await;
            });
            answers
        });
        (gate, answers, metrics.batches_since(kind, before).await)
    }

    /// [`Server::gated`] acquires: `gate_party`'s acquire of `gate_key`, whose lock is held until
    /// `requests` queue behind it, and `requests`.
    async fn acquires_gated<R: Future>(
        &self,
        gate_party: &Party,
        gate_key: &str,
        requests: Vec<R>,
    ) -> (Result<LockGrant, ClientError>, Vec<R::Output>, (f64, f64)) {
        let gate_conn = self.gate_acquire(gate_key).await;
        let gate = acquire(gate_party, gate_key, Some(PATIENT_MS));
        self.gated("acquire", gate_conn, gate, requests).await
    }

    /// [`Server::gated`] releases: `gate_party`'s release of its grant of `gate_key` under
    /// `gate_token`, whose row is held until `requests` queue behind it, and `requests`.
    async fn releases_gated<R: Future>(
        &self,
        (gate_party, gate_key, gate_token): (&Party, &str, i64),
        requests: Vec<R>,
    ) -> (Result<(), ClientError>, Vec<R::Output>, (f64, f64)) {
        let gate_conn = self.gate_release(gate_key).await;
        let gate = gate_party
            .client
            .release(gate_key, gate_party.session, gate_token);
        self.gated("release", gate_conn, gate, requests).await
    }

    /// Whether the key has a grant row, whatever its state, and whether it was ever seen.
    fn rows_of(&self, key: &str) -> (String, String) {
        (
            self.psql(&format!(
                "SELECT count(*) FROM locks WHERE lock_key = '{key}'"
            )),
            self.psql(&format!(
                "SELECT count(*) FROM lock_keys_seen WHERE lock_key = '{key}'"
            )),
        )
    }
}

fn code(result: &Result<impl std::fmt::Debug, ClientError>) -> Option<ErrorCode> {
    result.as_ref().err().and_then(ClientError::code)
}

async fn acquire(p: &Party, key: &str, wait_ms: Option<i64>) -> Result<LockGrant, ClientError> {
    p.client
        .acquire(key, p.session, Some(30_000), wait_ms)
        .await
}

/// L4 without a server-side wait, its answer's code when refused, sent with no client timeout:
/// a request held at a gate may wait longer than the client's write timeout of 2 s.
async fn acquire_now(server: &Server, p: &Party, key: &str) -> Result<LockGrant, ErrorCode> {
    let url = format!("{}/v1/locks/{key}/acquire", server.url);
    let body = serde_json::json!({ "sessionId": p.session, "ttlMillis": 30_000 });
    let owner = p.client.owner_id();
    let (status, _, json) = post_json(&url, &[("x-owner-id", owner)], &body).await;
    if status == 200 {
        return Ok(serde_json::from_value(json).unwrap_or_else(|e| panic!("{key}: {e}")));
    }
    Err(serde_json::from_value(json["code"].clone())
        .unwrap_or_else(|e| panic!("{key}: {status} {json}: {e}")))
}

/// Asserts that `key` is held by `p`'s session with `token` (L7).
async fn held_by(p: &Party, key: &str, token: i64) {
    let info = p
        .client
        .get(key)
        .await
        .unwrap_or_else(|e| panic!("{key}: {e}"));
    assert!(info.held, "{key} is held");
    assert_eq!(
        info.session_id,
        Some(p.session),
        "{key}: its caller's session"
    );
    assert_eq!(info.fencing_token, Some(token), "{key}: the token answered");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn acquires_of_distinct_keys_in_one_batch_each_get_their_own_grant() {
    let server = Server::start().await;
    let parties = server.parties("gc", 8).await;
    let gate_party = server.party("gc-gate").await;
    let keys: Vec<String> = (0..parties.len()).map(|i| format!("gc:key-{i}")).collect();

    let (gate, answers, batches) = server
        .acquires_gated(
            &gate_party,
            "gc:gate",
            parties
                .iter()
                .zip(&keys)
                .map(|(p, key)| acquire(p, key, Some(PATIENT_MS)))
                .collect(),
        )
        .await;
    gate.unwrap_or_else(|e| panic!("the gate's acquire: {e}"));
    // The gate alone (a batch of one), then the eight in one transaction.
    assert_eq!(batches, (2.0, 9.0), "one batch of one and one of eight");

    let mut tokens = HashSet::new();
    let mut first = BTreeMap::new();
    for ((p, key), answer) in parties.iter().zip(&keys).zip(answers) {
        let grant = answer.unwrap_or_else(|e| panic!("{key}: {e}"));
        assert_eq!(grant.key, *key);
        assert_eq!(grant.session_id, p.session, "{key}: granted to its caller");
        assert!(
            tokens.insert(grant.fencing_token),
            "{key}: a token of its own"
        );
        held_by(p, key, grant.fencing_token).await;
        first.insert(key.clone(), grant.fencing_token);
    }

    // Released in one batch too, then acquired again in one: each key's token only grows.
    let gate_token = server.psql("SELECT fencing_token FROM locks WHERE lock_key = 'gc:gate'");
    let gate_token: i64 = gate_token.parse().unwrap_or_else(|e| panic!("{e}"));
    let (gate, answers, batches) = server
        .releases_gated(
            (&gate_party, "gc:gate", gate_token),
            parties
                .iter()
                .zip(&keys)
                .map(|(p, key)| p.client.release(key, p.session, first[key]))
                .collect(),
        )
        .await;
    gate.unwrap_or_else(|e| panic!("the gate's release: {e}"));
    for (key, answer) in keys.iter().zip(answers) {
        answer.unwrap_or_else(|e| panic!("release {key}: {e}"));
        let info = gate_party
            .client
            .get(key)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        assert!(!info.held, "{key} was released");
    }
    assert_eq!(batches, (2.0, 9.0), "one release of one and one of eight");
    let again = futures::future::join_all(
        parties
            .iter()
            .zip(&keys)
            .map(|(p, key)| acquire(p, key, Some(PATIENT_MS))),
    )
    .await;
    for ((p, key), answer) in parties.iter().zip(&keys).zip(again) {
        let grant = answer.unwrap_or_else(|e| panic!("{key} again: {e}"));
        assert!(
            grant.fencing_token > first[key],
            "{key}: {} after {}",
            grant.fencing_token,
            first[key]
        );
        assert!(tokens.insert(grant.fencing_token), "{key}: a new token");
        held_by(p, key, grant.fencing_token).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_acquires_of_one_key_in_flight_are_one_grant_and_one_contention() {
    let server = Server::start().await;
    let (one, two, neighbour) = (
        server.party("gk-one").await,
        server.party("gk-two").await,
        server.party("gk-neighbour").await,
    );
    let gate_party = server.party("gk-gate").await;
    let (gate, answers, batches) = server
        .acquires_gated(
            &gate_party,
            "gk:gate",
            vec![
                acquire_now(&server, &one, "gk:key"),
                acquire_now(&server, &two, "gk:key"),
                acquire_now(&server, &neighbour, "gk:other"),
            ],
        )
        .await;
    gate.unwrap_or_else(|e| panic!("the gate's acquire: {e}"));
    let [a1, a2, other]: [_; 3] = answers
        .try_into()
        .unwrap_or_else(|a: Vec<_>| panic!("three answers, got {}", a.len()));
    let other = other.unwrap_or_else(|e| panic!("{e:?}"));
    held_by(&neighbour, "gk:other", other.fencing_token).await;
    // Exactly one of the two holds the key; the other heard LOCK_CONTENDED and holds nothing.
    let (winner, grant, loser) = match (&a1, &a2) {
        (Ok(g), Err(_)) => (&one, g, &a2),
        (Err(_), Ok(g)) => (&two, g, &a1),
        _ => panic!("one grant and one refusal, got {a1:?} and {a2:?}"),
    };
    assert_eq!(
        loser.as_ref().err(),
        Some(&ErrorCode::LockContended),
        "{loser:?}"
    );
    held_by(winner, "gk:key", grant.fencing_token).await;
    // Two rounds after the gate: the key's first request with its neighbour, then the second.
    assert_eq!(
        batches,
        (3.0, 4.0),
        "the gate, a batch of two, then the second request on the key alone"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn releases_in_one_batch_with_a_wrong_token_are_refused_alone() {
    let server = Server::start().await;
    let parties = server.parties("gr", 4).await;
    let gate_party = server.party("gr-gate").await;
    let mut grants = Vec::new();
    for (i, p) in parties.iter().enumerate() {
        let key = format!("gr:key-{i}");
        let grant = acquire(p, &key, None)
            .await
            .unwrap_or_else(|e| panic!("{key}: {e}"));
        grants.push((key, grant.fencing_token));
    }
    let gate = acquire(&gate_party, "gr:gate", None)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    // Items 1 and 3 name a token their grant does not have (a stale one, and another key's).
    let wrong = [(1usize, grants[1].1 - 1), (3, grants[0].1)];
    let presented: Vec<i64> = (0..grants.len())
        .map(|i| {
            wrong
                .iter()
                .find(|(w, _)| *w == i)
                .map_or(grants[i].1, |(_, t)| *t)
        })
        .collect();
    let (gate_answer, answers, batches) = server
        .releases_gated(
            (&gate_party, "gr:gate", gate.fencing_token),
            parties
                .iter()
                .zip(&grants)
                .zip(&presented)
                .map(|((p, (key, _)), token)| p.client.release(key, p.session, *token))
                .collect(),
        )
        .await;
    gate_answer.unwrap_or_else(|e| panic!("the gate's release: {e}"));
    assert_eq!(batches, (2.0, 5.0), "the gate, then one batch of four");
    for (i, ((p, (key, token)), answer)) in parties.iter().zip(&grants).zip(&answers).enumerate() {
        if wrong.iter().any(|(w, _)| *w == i) {
            assert_eq!(code(answer), Some(ErrorCode::LockLost), "{key}: {answer:?}");
            // Refused, and nothing changed: the grant is still its holder's.
            held_by(p, key, *token).await;
        } else {
            answer
                .as_ref()
                .unwrap_or_else(|e| panic!("{key}, its neighbour refused: {e}"));
            let info = p.client.get(key).await.unwrap_or_else(|e| panic!("{e}"));
            assert!(!info.held, "{key} was released");
        }
    }
    // Positive control: with their own tokens the refused two are released.
    for (i, _) in wrong {
        let (key, token) = &grants[i];
        let p = &parties[i];
        p.client
            .release(key, p.session, *token)
            .await
            .unwrap_or_else(|e| panic!("{key}: {e}"));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn under_load_batches_form_and_every_key_keeps_its_token_order() {
    const CLIENTS: usize = 16;
    const CYCLES: usize = 25;
    let server = Server::start().await;
    let parties = server.parties("gl", CLIENTS).await;
    let metrics = server.batch_metrics();
    let before = metrics.batches("acquire").await;
    let runs = futures::future::join_all(parties.iter().enumerate().map(|(i, p)| async move {
        let key = format!("gl:key-{i}");
        let mut tokens = Vec::new();
        for _ in 0..CYCLES {
            let grant = acquire(p, &key, Some(PATIENT_MS))
                .await
                .unwrap_or_else(|e| panic!("{key}: {e}"));
            assert_eq!(grant.session_id, p.session, "{key}: its caller's");
            tokens.push(grant.fencing_token);
            p.client
                .release(&key, p.session, grant.fencing_token)
                .await
                .unwrap_or_else(|e| panic!("{key}: {e}"));
        }
        (key, tokens)
    }))
    .await;
    let mut all = HashSet::new();
    for (key, tokens) in &runs {
        assert!(
            tokens.windows(2).all(|w| w[0] < w[1]),
            "{key}: tokens strictly increase: {tokens:?}"
        );
        for t in tokens {
            assert!(all.insert(*t), "{key}: token {t} issued twice");
        }
    }
    let (count, sum) = metrics.batches_since("acquire", before).await;
    assert_eq!(
        sum as usize,
        CLIENTS * CYCLES,
        "every acquire went through a batch"
    );
    assert!(
        sum / count > 1.0,
        "batches formed under load: {sum} acquires in {count} transactions"
    );
}
