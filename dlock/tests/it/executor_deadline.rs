//! The executor's local deadline comes from what the lock server
//! *granted* (the lock's and the session's expiry, both possibly clamped down by its
//! `lock.ttl-max` and `lock.session.ttl-max`), and no protected write starts past it, the one
//! retry of a claim or post included (docs/contract.md#client-deadline).
//!
//! The executor runs against the real services as `dlock` processes — lock server (backend pg),
//! payment resource, rail stub and rail proxy — on one real PostgreSQL holding lockdb and paydb.
//! What happened is read from the real side, on the database server's one clock:
//!
//! - every grant the lock server made (token, `acquired_at`, `expires_at`, and its session's
//!   expiry at that moment) and every session it created or extended, recorded by test triggers
//!   on lockdb's `locks` and `sessions`;
//! - every claim and post that paydb took (a trigger on `payouts` records when the row became
//!   CLAIMED or POSTED) and every submission the rail proxy recorded (`rail_submission`).
//!
//! A write belongs to the latest grant made before it; its deadline is 0.7 × the lease the server
//! gave (the smaller of the granted lock expiry and the session's expiry at the acquire).
//!
//! For the retry scenario the same trigger makes paydb stall 750 ms on the first claim and the
//! first post and then refuse them as a read-only replica would (SQLSTATE 25006): the real
//! payment resource answers 503 NOT_LEADER, which is what the executor retries once. The sequences
//! counting those attempts are not transactional, so refused attempts are counted too.

use std::time::Duration;

use crate::shared::accounts::open_account;
use dlock_contract::payment_client::PaymentClient;
use dlock_devstack::PgServer;
use dlock_devstack::stack::{Role, Stack};
use dlock_executor::executor::{Report, RunOptions, execute};

use crate::harness::endpoints;

/// A write lands in paydb a few milliseconds after the executor's check; this much is allowed.
const SLACK_MS: f64 = 60.0;
const EXE: &str = env!("CARGO_BIN_EXE_dlock");
const OPERATOR_TOKEN: &str = "deadline-operator-token";

/// What the lock server is configured with and how paydb and the rail behave.
#[derive(Clone, Copy, Default)]
struct Setup {
    /// The lock server's `lock.ttl-max`.
    lock_ttl_max_ms: i64,
    /// The lock server's `lock.session.ttl-max`.
    session_ttl_max_ms: i64,
    /// The rail stub's `rail.stub.latency-ms`: how long the rail takes to acknowledge.
    rail_latency_ms: u64,
    /// paydb stalls 750 ms on the first claim and the first post, then refuses them (25006).
    stall_first_claim_and_post: bool,
}

const LOCKDB_OBSERVER: &str = "
CREATE TABLE test_grants (token bigint, acquired_at timestamptz, expires_at timestamptz,
                          session_expires_at timestamptz);
CREATE FUNCTION test_grant_seen() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF TG_OP = 'INSERT' OR NEW.fencing_token IS DISTINCT FROM OLD.fencing_token THEN
    INSERT INTO test_grants
      SELECT NEW.fencing_token, NEW.acquired_at, NEW.expires_at, s.expires_at
      FROM sessions s WHERE s.session_id = NEW.session_id;
  END IF;
  RETURN NEW;
END $$;
CREATE TRIGGER test_grant_seen AFTER INSERT OR UPDATE ON locks
  FOR EACH ROW EXECUTE FUNCTION test_grant_seen();
CREATE TABLE test_sessions (op text, ttl_ms bigint, at timestamptz, old_expires_at timestamptz);
CREATE FUNCTION test_session_seen() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  INSERT INTO test_sessions VALUES (TG_OP, NEW.ttl_ms, clock_timestamp(),
    CASE WHEN TG_OP = 'UPDATE' THEN OLD.expires_at END);
  RETURN NEW;
END $$;
CREATE TRIGGER test_session_seen AFTER INSERT OR UPDATE OF expires_at ON sessions
  FOR EACH ROW EXECUTE FUNCTION test_session_seen();
";

const PAYDB_OBSERVER: &str = "
CREATE SEQUENCE test_claim_attempts;
CREATE SEQUENCE test_post_attempts;
CREATE TABLE test_faults (what text PRIMARY KEY);
CREATE TABLE test_writes (what text, token bigint, at timestamptz);
CREATE FUNCTION test_write_seen() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE v_what text; v_n bigint;
BEGIN
  IF NEW.state = 'CLAIMED' AND OLD.state IS DISTINCT FROM 'CLAIMED' THEN
    v_what := 'claim'; v_n := nextval('test_claim_attempts');
  ELSIF NEW.state = 'POSTED' AND OLD.state IS DISTINCT FROM 'POSTED' THEN
    v_what := 'post'; v_n := nextval('test_post_attempts');
  ELSE
    RETURN NEW;
  END IF;
  IF v_n = 1 AND EXISTS (SELECT 1 FROM test_faults f WHERE f.what = v_what) THEN
    PERFORM pg_sleep(0.75);
    RAISE EXCEPTION 'paydb stalled and refuses this %', v_what USING ERRCODE = '25006';
  END IF;
  INSERT INTO test_writes VALUES (v_what, NEW.claim_token, clock_timestamp());
  RETURN NEW;
END $$;
CREATE TRIGGER test_write_seen BEFORE UPDATE ON payouts
  FOR EACH ROW EXECUTE FUNCTION test_write_seen();
";

/// What the real side saw during one run.
struct Seen {
    report: Report,
    state: String,
    /// Writes that started past their grant's deadline (plus slack).
    violations: Vec<String>,
    /// Every write: `what@ms-after-its-grant(token, allowed ms)`.
    writes: Vec<String>,
    claim_attempts: i64,
    post_attempts: i64,
    /// (op, ttl_ms, ms before the expiry it extended; None for a create)
    sessions: Vec<(String, i64, Option<f64>)>,
    granted_ttls_ms: Vec<f64>,
}

fn rows(pg: &PgServer, db: &str, sql: &str) -> Vec<Vec<String>> {
    pg.psql(db, sql)
        .unwrap_or_else(|e| panic!("{db}: {e:#}"))
        .lines()
        .filter(|l| !l.is_empty())
        .map(|l| l.split('|').map(str::to_owned).collect())
        .collect()
}

fn num(s: &str) -> f64 {
    s.parse()
        .unwrap_or_else(|e| panic!("not a number {s:?}: {e}"))
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

/// Runs one payout through the executor against the real services; returns what they saw.
async fn run(setup: Setup, options: RunOptions) -> Seen {
    let stack = Stack::builder(EXE)
        .operator_token(OPERATOR_TOKEN)
        .set(
            Role::LockServer,
            "lock.ttl-max",
            setup.lock_ttl_max_ms.to_string(),
        )
        .set(
            Role::LockServer,
            "lock.session.ttl-max",
            setup.session_ttl_max_ms.to_string(),
        )
        .rail_stub(&[("rail.stub.latency-ms", &setup.rail_latency_ms.to_string())])
        .start();
    let pg = stack.pg();
    pg.psql("lockdb", LOCKDB_OBSERVER)
        .unwrap_or_else(|e| panic!("lockdb observer: {e:#}"));
    pg.psql("paydb", PAYDB_OBSERVER)
        .unwrap_or_else(|e| panic!("paydb observer: {e:#}"));
    if setup.stall_first_claim_and_post {
        pg.psql(
            "paydb",
            "INSERT INTO test_faults VALUES ('claim'), ('post')",
        )
        .unwrap_or_else(|e| panic!("{e:#}"));
    }

    let client =
        PaymentClient::new(&stack.payment().url(), "deadline").unwrap_or_else(|e| panic!("{e}"));
    open_account(&client, "acct-1", Some(10_000)).await;

    let batch = dlock_executor::manifest::parse(BATCH).unwrap_or_else(|e| panic!("{e}"));
    let endpoints = endpoints(&stack);
    let margin = options.safety_margin;
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

    let grants: Vec<(String, f64, f64, f64)> = rows(
        pg,
        "lockdb",
        "SELECT token, extract(epoch FROM acquired_at), extract(epoch FROM expires_at),
                extract(epoch FROM session_expires_at)
         FROM test_grants ORDER BY acquired_at",
    )
    .into_iter()
    .map(|r| (r[0].clone(), num(&r[1]), num(&r[2]), num(&r[3])))
    .collect();
    let sessions = rows(
        pg,
        "lockdb",
        "SELECT op, ttl_ms, extract(epoch FROM old_expires_at - at) * 1000
         FROM test_sessions ORDER BY at",
    )
    .into_iter()
    .map(|r| {
        let before = (!r[2].is_empty()).then(|| num(&r[2]));
        (r[0].clone(), num(&r[1]) as i64, before)
    })
    .collect();
    let writes: Vec<(String, String, f64)> = rows(
        pg,
        "paydb",
        "SELECT what, token, extract(epoch FROM at) FROM test_writes
         UNION ALL
         SELECT 'submit', presented_token, extract(epoch FROM submitted_at) FROM rail_submission
         ORDER BY 3",
    )
    .into_iter()
    .map(|r| (r[0].clone(), r[1].clone(), num(&r[2])))
    .collect();
    let keep = 1.0 - margin;
    let mut violations = Vec::new();
    let mut seen = Vec::new();
    for (what, token, at) in &writes {
        let Some((grant, acquired, expires, session_expires)) =
            grants.iter().rev().find(|g| g.1 <= *at)
        else {
            violations.push(format!("{what} (token {token}) came before any grant"));
            continue;
        };
        let after_ms = (at - acquired) * 1000.0;
        let allowed_ms = (expires.min(*session_expires) - acquired) * 1000.0 * keep;
        seen.push(format!(
            "{what}@{after_ms:.0}ms(grant {grant}, allowed {allowed_ms:.0}ms)"
        ));
        if after_ms > allowed_ms + SLACK_MS {
            violations.push(format!(
                "{what} under grant {grant} started {after_ms:.0} ms after the acquire, past its deadline of {allowed_ms:.0} ms"
            ));
        }
    }
    let counters = rows(
        pg,
        "paydb",
        "SELECT (SELECT CASE WHEN is_called THEN last_value ELSE 0 END FROM test_claim_attempts),
                (SELECT CASE WHEN is_called THEN last_value ELSE 0 END FROM test_post_attempts),
                (SELECT state FROM payouts)",
    );
    let counters = counters
        .first()
        .unwrap_or_else(|| panic!("no counters"))
        .clone();
    Seen {
        report,
        state: counters[2].clone(),
        violations,
        writes: seen,
        claim_attempts: num(&counters[0]) as i64,
        post_attempts: num(&counters[1]) as i64,
        sessions,
        granted_ttls_ms: grants.iter().map(|g| (g.2 - g.1) * 1000.0).collect(),
    }
}

impl Seen {
    /// The payout is POSTED and no write started past its grant's deadline.
    fn assert_paid_within_every_deadline(&self) {
        let writes = &self.writes;
        assert!(
            self.violations.is_empty(),
            "{:#?}\nwrites: {writes:?}",
            self.violations
        );
        assert_eq!(self.state, "POSTED", "writes: {writes:?}");
    }

    /// The post after the slow submit came too late for its cycle and went to the next one.
    fn assert_a_post_was_deferred(&self) {
        let deferred = self
            .report
            .outcomes
            .get("DeadlinePassed")
            .copied()
            .unwrap_or(0);
        assert!(
            deferred >= 1,
            "the post after the slow submit was not deferred to the next cycle: {:?}\nwrites: {:?}",
            self.report.outcomes,
            self.writes
        );
    }
}

/// The clamped-TTL runs: the executor asks for 10 s locks in 15 s sessions, more than a server that
/// grants at most `lock_ttl_max_ms` and `session_ttl_max_ms` gives it; the rail answers in
/// `rail_latency_ms`.
async fn run_asking_more_than_granted(
    lock_ttl_max_ms: i64,
    session_ttl_max_ms: i64,
    rail_latency_ms: u64,
) -> Seen {
    let setup = Setup {
        lock_ttl_max_ms,
        session_ttl_max_ms,
        rail_latency_ms,
        ..Setup::default()
    };
    let asking = RunOptions {
        lock_ttl_ms: 10_000,
        session_ttl_ms: 15_000,
        ..RunOptions::default()
    };
    run(setup, asking).await
}

/// The server clamps the lock TTL (10 s asked, 1 s granted). The deadline is 0.7 × the
/// granted second, so the post after a 900 ms submit belongs to the next lock cycle.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_deadline_follows_the_granted_lock_ttl_not_the_requested_one() {
    let seen = run_asking_more_than_granted(1_000, 60_000, 900).await;
    assert!(
        seen.granted_ttls_ms
            .iter()
            .all(|t| (*t - 1_000.0).abs() < 1.0),
        "the lock server clamps every grant to 1 s: {:?}",
        seen.granted_ttls_ms
    );
    seen.assert_paid_within_every_deadline();
    seen.assert_a_post_was_deferred();
}

/// The server clamps the session TTL (15 s asked, 1.5 s granted). Heartbeats follow the
/// granted TTL, so the session never lapses, and the deadline is bounded by the session's expiry
/// when it comes before the lock's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heartbeats_and_the_deadline_follow_the_granted_session_ttl() {
    let seen = run_asking_more_than_granted(60_000, 1_500, 1_200).await;
    let sessions = &seen.sessions;
    let created: Vec<_> = sessions.iter().filter(|s| s.0 == "INSERT").collect();
    assert_eq!(
        created.len(),
        1,
        "the session lapsed and was created again: {sessions:?}"
    );
    assert_eq!(created[0].1, 1_500, "the server grants 1.5 s: {sessions:?}");
    let heartbeats: Vec<f64> = sessions.iter().filter_map(|s| s.2).collect();
    assert!(
        heartbeats.len() >= 2,
        "the session was not kept alive by heartbeats: {sessions:?}"
    );
    assert!(
        heartbeats.iter().all(|before| *before > 0.0),
        "a heartbeat came after the session's expiry: {sessions:?}"
    );
    seen.assert_paid_within_every_deadline();
    seen.assert_a_post_was_deferred();
}

/// Paydb stalls 750 ms on the first claim and the first post and refuses them, so the
/// payment resource answers 503 under a 700 ms deadline (1 s granted). The one retry they allow
/// must not start past the deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_one_retry_of_a_claim_or_post_never_starts_past_the_deadline() {
    let seen = run(
        Setup {
            lock_ttl_max_ms: 1_000,
            session_ttl_max_ms: 60_000,
            rail_latency_ms: 0,
            stall_first_claim_and_post: true,
        },
        RunOptions {
            lock_ttl_ms: 1_000,
            session_ttl_ms: 15_000,
            ..RunOptions::default()
        },
    )
    .await;
    let writes = &seen.writes;
    seen.assert_paid_within_every_deadline();
    assert!(
        seen.claim_attempts >= 2 && seen.post_attempts >= 2,
        "the stalled, refused claim and post were not exercised: {} claims, {} posts reached paydb; writes: {writes:?}",
        seen.claim_attempts,
        seen.post_attempts
    );
}
