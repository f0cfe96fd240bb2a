//! The history check across a PostgreSQL failover (docs/faults.md#history-check): the workload of
//! history.rs on a lock server whose lockdb is a primary with a synchronous streaming standby
//! (services/devstack/src/pg_standby.rs, what a managed HA database gives), reached by the
//! pair's multi-host URL (`target_session_attrs=read-write`) as the failover scenarios start
//! their services. The faults come in the same cycles (the lock server frozen, then killed and
//! restarted, then its store failed); the first store fault SIGKILLs the primary and promotes the
//! standby, the later ones restart the promoted server. The clients carry on through it, and the
//! history must still be linearizable: a synchronous promotion loses no acknowledged commit.
//! Unknown outcomes are kept open to the end of the history, as in the other runs.
//!
//! The first grant on the new timeline moves lockdb's tokens 10^9 past the highest it knows
//! (migrations/lockdb/0016_baseline.sql, docs/design.md#d-12). The test requires the history
//! to hold tokens on both sides of that jump, none inside it, and the checker's global token
//! order to take it. Positive controls on this history: history.rs's three planted violations;
//! a token from below the jump given just after the first grant above it; and the first acquire
//! after the promotion whose grant was then used, answered `503 NOT_LEADER` (what the lock server
//! answers while it has no primary). Each must make the checker refuse the history.

use std::collections::BTreeMap;
use std::time::Duration;

use dlock_devstack::pg_standby::{PgPair, Replication};
use serde_json::Value;

use super::planted::{first_ok, planted_token_is_caught};
use super::{
    StoreFault, applied_acquire_refused_is_caught, now_ns, planted_violations_are_caught,
    run_under_faults,
};

/// How far lockdb moves its tokens on a new timeline (`store_epoch.token_gap`'s default).
const TOKEN_GAP: i64 = 1_000_000_000;

/// The longest a call can wait for its answer (`WRITE_TIMEOUT` of the lock client): a call sent
/// that long before the kill, left without an answer, may have been cut by it.
const LONGEST_CALL_NS: i64 = 2_000_000_000;

/// lockdb on a synchronous pair; the first store fault is the failover.
struct Failover {
    pair: PgPair,
    promotion: Option<Promotion>,
}

/// When the primary was killed and the standby promoted (ns since the epoch), and how long
/// `pg_promote()` took.
struct Promotion {
    killed: i64,
    promoted: i64,
    took: Duration,
}

impl StoreFault for Failover {
    fn pairs(&self) -> Vec<(String, String)> {
        vec![
            ("lock.backend".into(), "pg".into()),
            ("lock.pg.url".into(), self.pair.url("lockdb")),
            ("lock.pg.acquire-timeout-ms".into(), "1000".into()),
        ]
    }

    async fn fail(&mut self) -> String {
        if self.promotion.is_some() {
            tokio::task::block_in_place(|| self.pair.standby.restart())
                .unwrap_or_else(|e| panic!("restart the promoted PostgreSQL: {e:#}"));
            return "PostgreSQL (the promoted standby) restarted".to_owned();
        }
        let killed = now_ns();
        tokio::task::block_in_place(|| self.pair.kill_primary())
            .unwrap_or_else(|e| panic!("SIGKILL the primary: {e:#}"));
        let took = tokio::task::block_in_place(|| self.pair.promote())
            .unwrap_or_else(|e| panic!("promote the standby: {e:#}"));
        let promoted = now_ns();
        self.promotion = Some(Promotion {
            killed,
            promoted,
            took,
        });
        format!(
            "PostgreSQL primary SIGKILLed, synchronous standby promoted (pg_promote() took {} ms)",
            took.as_millis()
        )
    }
}

fn ns(line: &Value, field: &str) -> Option<i64> {
    line[field].as_i64()
}

fn token(line: &Value) -> i64 {
    line["out"]["token"].as_i64().unwrap_or_default()
}

fn is_write(line: &Value) -> bool {
    line["op"] != "read" && line.get("op").is_some()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn history_across_a_synchronous_pg_failover_is_linearizable() {
    let pair = PgPair::start(Replication::Synchronous).unwrap_or_else(|e| panic!("{e:#}"));
    pair.create_database("lockdb")
        .unwrap_or_else(|e| panic!("create lockdb: {e:#}"));
    let mut store = Failover {
        pair,
        promotion: None,
    };
    let run = run_under_faults(&mut store, "pg-failover").await;
    let Some(Promotion {
        killed,
        promoted,
        took,
    }) = store.promotion
    else {
        panic!(
            "the run ended before the failover ({} faults; DLOCK_HISTORY_SECS too short?)",
            run.faults
        )
    };
    let lines = &run.lines;

    // The jump: recorded once by lockdb on the promoted server (a restart keeps the timeline).
    let changes = store
        .pair
        .standby
        .psql(
            "lockdb",
            "SELECT highest_known, floor FROM store_epoch_changes",
        )
        .unwrap_or_else(|e| panic!("{e:#}"));
    let (highest, floor) = changes
        .split_once('|')
        .and_then(|(h, f)| Some((h.parse::<i64>().ok()?, f.parse::<i64>().ok()?)))
        .unwrap_or_else(|| {
            panic!("lockdb recorded one epoch change on the promoted server, not {changes:?}")
        });
    assert_eq!(floor, highest + TOKEN_GAP, "the jump is lockdb's gap");
    let acquired: Vec<&Value> = lines
        .iter()
        .filter(|l| l["op"] == "acquire" && l["status"] == "ok")
        .collect();
    let before: Vec<i64> = acquired
        .iter()
        .filter(|l| ns(l, "ret").is_some_and(|t| t < killed))
        .map(|l| token(l))
        .collect();
    let after: Vec<i64> = acquired
        .iter()
        .filter(|l| ns(l, "call").is_some_and(|t| t > promoted))
        .map(|l| token(l))
        .collect();
    let (Some(&last_before), Some(&first_after)) = (before.iter().max(), after.iter().min()) else {
        panic!(
            "the history holds grants on both sides of the failover: {} before, {} after",
            before.len(),
            after.len()
        )
    };
    assert!(
        last_before <= highest && first_after > floor,
        "tokens before the kill (up to {last_before}) are at most lockdb's highest known \
         ({highest}), those after the promotion (from {first_after}) above its floor ({floor})"
    );
    let inside: Vec<i64> = acquired
        .iter()
        .map(|l| token(l))
        .filter(|t| (highest + 1..=floor).contains(t))
        .collect();
    assert!(inside.is_empty(), "tokens inside the jump: {inside:?}");

    // What the clients saw: the first write answered ok that was sent after the kill, and every
    // answer of the calls in flight from the kill until then.
    let back = lines
        .iter()
        .filter(|l| is_write(l) && l["status"] == "ok")
        .filter(|l| ns(l, "call").is_some_and(|t| t >= killed))
        .filter_map(|l| ns(l, "ret"))
        .min()
        .unwrap_or_else(|| panic!("no write was answered ok after the kill"));
    assert!(
        back - promoted < 15_000_000_000,
        "the clients carried on within 15 s of the promotion: {} ms",
        (back - promoted) / 1_000_000
    );
    let mut codes: BTreeMap<String, BTreeMap<String, usize>> = BTreeMap::new();
    for l in lines.iter().filter(|l| l.get("op").is_some()) {
        let (Some(call), ret) = (ns(l, "call"), ns(l, "ret")) else {
            continue;
        };
        let during = call <= back
            && match ret {
                Some(ret) => ret >= killed,
                None => call >= killed - LONGEST_CALL_NS,
            };
        if !during {
            continue;
        }
        let code = match (l["status"].as_str(), l["code"].as_str()) {
            (Some("ok"), _) => "ok".to_owned(),
            (Some("unknown"), Some(c)) => format!("{c} (unknown outcome)"),
            (_, Some(c)) => c.to_owned(),
            _ => "?".to_owned(),
        };
        let op = l["op"].as_str().unwrap_or_default().to_owned();
        *codes.entry(code).or_default().entry(op).or_default() += 1;
    }
    let codes = codes
        .iter()
        .map(|(code, ops)| {
            let n: usize = ops.values().sum();
            let ops: Vec<String> = ops.iter().map(|(op, k)| format!("{k} {op}")).collect();
            format!("{code} {n} ({})", ops.join(", "))
        })
        .collect::<Vec<_>>()
        .join("; ");

    let verdict = run.linearizable("PostgreSQL across a synchronous failover");
    let calls = lines.iter().filter(|l| l.get("op").is_some()).count();
    println!(
        "{}: {calls} calls checked, linearizable; pg_promote() took {} ms; writes answered ok \
         again {} ms after the kill ({} ms after the promotion); answers from the kill until \
         then: {codes}; tokens {last_before} (last before the kill) -> {first_after} (first after \
         the promotion), lockdb's highest known {highest}, floor {floor}",
        run.name,
        took.as_millis(),
        (back - killed) / 1_000_000,
        (back - promoted).max(0) / 1_000_000,
    );
    assert!(verdict.contains("verdict: linearizable"), "{verdict}");

    // Positive controls: history.rs's three, then two about the failover.
    planted_violations_are_caught(&run.dir, &run.name, lines);

    // A token from below the jump given after the first grant above it: what lockdb would have
    // issued next without its epoch guard.
    let first = first_ok(
        lines,
        "acquire",
        |l| ns(l, "call").is_some_and(|t| t > promoted),
        "no acquire after the promotion",
    );
    let below = highest + 1;
    planted_token_is_caught(
        &run.dir
            .join(format!("{}.planted-below-jump.jsonl", run.name)),
        lines,
        first,
        below,
        "token from below the jump after it",
    );

    // The first acquire after the promotion whose grant was then used, answered NOT_LEADER.
    let line = applied_acquire_refused_is_caught(
        &run.dir,
        &format!("{}.planted-not-leader-after-promotion", run.name),
        lines,
        promoted,
    );
    println!(
        "{}: positive controls refused: a token given twice, a read of a released grant, an \
         applied acquire answered NOT_LEADER, token {below} after {first_after}, the acquire of \
         line {line} (after the promotion) answered NOT_LEADER",
        run.name
    );
}
