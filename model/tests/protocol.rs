//! The fencing protocol checked exhaustively (breadth-first, every interleaving within the bounds),
//! and the positive controls: each defence taken away alone lets the checker find the failure it
//! exists to prevent. What is modelled and the figures: docs/model.md.
//!
//! `cargo test -p dlock-model -- --nocapture` prints the bounds, the states explored, the time, and
//! each control's counterexample step by step.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use dlock_model::{
    ALL_POSTED, Bounds, Fencing, GRANT_ORDER, PAID_ONCE, POSTED_AFTER_FAILOVERS, REVOKED_STAYS_OUT,
    SOME_POSTED, SOME_REVOKED, Variant, render_path,
};
use stateright::{Checker, HasDiscoveries, Model};

struct Run {
    unique: usize,
    depth: usize,
    elapsed: Duration,
    /// CPU time of this process over the run (the machine is shared; wall time alone misleads).
    cpu: f64,
    found: BTreeSet<&'static str>,
    checker_paths: Vec<(&'static str, String)>,
}

fn run(model: Fencing, stop_at: Option<&'static str>) -> Run {
    let started = Instant::now();
    let cpu_before = process_cpu_seconds();
    let mut builder = model.checker().threads(1);
    if let Some(name) = stop_at {
        builder = builder.finish_when(HasDiscoveries::AnyOf(BTreeSet::from([name])));
    }
    let checker = builder.spawn_bfs().join();
    let elapsed = started.elapsed();
    let cpu = process_cpu_seconds() - cpu_before;
    let discoveries = checker.discoveries();
    let mut checker_paths: Vec<_> = discoveries
        .iter()
        .map(|(name, path)| (*name, render_path(path)))
        .collect();
    checker_paths.sort();
    Run {
        unique: checker.unique_state_count(),
        depth: checker.max_depth(),
        elapsed,
        cpu,
        found: discoveries.keys().copied().collect(),
        checker_paths,
    }
}

/// User and system CPU seconds of this process so far, from /proc/self/stat (0 where there is
/// none).
fn process_cpu_seconds() -> f64 {
    let Ok(stat) = std::fs::read_to_string("/proc/self/stat") else {
        return 0.0;
    };
    // Fields after the command name (which may hold spaces) start at state; utime and stime are
    // the 14th and 15th fields of the whole line, in clock ticks (100 per second on Linux).
    let Some(rest) = stat.rsplit_once(')').map(|(_, r)| r) else {
        return 0.0;
    };
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| {
        fields
            .get(i)
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    (ticks(11) + ticks(12)) / 100.0
}

fn path_of<'a>(run: &'a Run, name: &str) -> Option<&'a str> {
    run.checker_paths
        .iter()
        .find(|(n, _)| *n == name)
        .map(|(_, p)| p.as_str())
}

fn bounds_line(b: &Bounds) -> String {
    format!(
        "{} workers, {} payouts of one account, {} grants, {} revocation(s), {} lockdb and {} paydb failover(s) losing writes, safety gap {}, client retries {}",
        b.workers,
        b.payouts,
        b.grants,
        b.revocations,
        b.lockdb_failovers,
        b.paydb_failovers,
        b.safety_gap,
        if b.client_retries { "on" } else { "off" },
    )
}

/// The whole state space of dlock as designed within `bounds`, explored breadth-first to the end,
/// with a line saying what was explored under `label`.
fn explore(label: &str, bounds: Bounds) -> Run {
    let run = run(Fencing::new(bounds, Variant::DLOCK), None);
    println!(
        "{label}, BFS: {}\n  {} unique states, depth {}, {:.1} s ({:.1} s CPU)",
        bounds_line(&bounds),
        run.unique,
        run.depth,
        run.elapsed.as_secs_f64(),
        run.cpu
    );
    run
}

/// The bounds of the exhaustive check: [`Bounds::CHECKED`], or deeper ones from the environment
/// (`DLOCK_MODEL_WORKERS`, `DLOCK_MODEL_PAYOUTS`, `DLOCK_MODEL_GRANTS`, `DLOCK_MODEL_REVOCATIONS`;
/// the safety gap follows the grants and revocations).
fn checked_bounds() -> Bounds {
    let read = |name: &str, default: u8| -> u8 {
        std::env::var(name)
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(default)
    };
    let grants = read("DLOCK_MODEL_GRANTS", Bounds::CHECKED.grants);
    let revocations = read("DLOCK_MODEL_REVOCATIONS", Bounds::CHECKED.revocations);
    Bounds {
        workers: read("DLOCK_MODEL_WORKERS", Bounds::CHECKED.workers),
        payouts: read("DLOCK_MODEL_PAYOUTS", Bounds::CHECKED.payouts),
        grants,
        revocations,
        safety_gap: grants + revocations,
        ..Bounds::CHECKED
    }
}

/// dlock as designed: both safety properties hold in every reachable state, and the payouts do
/// get paid (including after both databases failed over), so the safety is not bought by a model
/// in which nothing can happen.
#[test]
fn the_protocol_holds_in_every_interleaving() {
    let run = explore("dlock fencing model", checked_bounds());
    for reachable in [SOME_POSTED, ALL_POSTED, POSTED_AFTER_FAILOVERS] {
        println!(
            "  '{reachable}': {}",
            if run.found.contains(reachable) {
                "reached"
            } else {
                "NEVER REACHED"
            }
        );
    }
    assert!(
        !run.found.contains(PAID_ONCE),
        "double presentation found:\n{}",
        path_of(&run, PAID_ONCE).unwrap_or_default()
    );
    assert!(
        !run.found.contains(REVOKED_STAYS_OUT),
        "revoked token admitted:\n{}",
        path_of(&run, REVOKED_STAYS_OUT).unwrap_or_default()
    );
    assert!(
        !run.found.contains(GRANT_ORDER),
        "stale write found:\n{}",
        path_of(&run, GRANT_ORDER).unwrap_or_default()
    );
    for reachable in [SOME_POSTED, ALL_POSTED, POSTED_AFTER_FAILOVERS] {
        assert!(
            run.found.contains(reachable),
            "'{reachable}' is never reached: the model cannot pay"
        );
    }
}

/// The bounds of the revocation check: the suite's, with one revocation and one payout (two
/// payouts with a revocation: `DLOCK_MODEL_REVOCATIONS=1`, about 19 million states).
const REVOCATION_BOUNDS: Bounds = Bounds {
    revocations: 1,
    payouts: 1,
    safety_gap: 4,
    ..Bounds::CHECKED
};

/// An operator's revocation: once its floor is at both fences, the revoked grant (and any token
/// at or below the floor) writes nothing, and payouts are still paid after it.
#[test]
fn a_completed_revocation_keeps_the_revoked_grant_out() {
    let run = explore("revocation check", REVOCATION_BOUNDS);
    for property in [REVOKED_STAYS_OUT, PAID_ONCE, GRANT_ORDER] {
        assert!(
            !run.found.contains(property),
            "'{property}' violated:\n{}",
            path_of(&run, property).unwrap_or_default()
        );
    }
    assert!(
        run.found.contains(SOME_REVOKED),
        "'{SOME_REVOKED}' is never reached"
    );
}

/// The code before lockdb 0010: lockdb's epoch guard was a trigger on grants, and `dlock_revoke`
/// drew its floor straight from the sequence, so a revocation that comes first on a new epoch can issue
/// as its floor a token a lost grant already holds. (The one write it lets through is a post:
/// `fence <= token`.)
#[test]
fn a_revocation_first_on_a_new_lockdb_epoch_takes_a_lost_token_as_its_floor() {
    let variant = Variant {
        revoke_checks_epoch: false,
        ..Variant::DLOCK
    };
    control(
        "revocation floor drawn without the epoch guard",
        REVOCATION_BOUNDS,
        variant,
        REVOKED_STAYS_OUT,
    );
}

/// The code before lockdb 0010: `dlock recover paydb-epoch --token-floor` took lockdb's sequence
/// as it is. When lockdb went back too (one PostgreSQL instance holding both databases fails over) and
/// no grant has run its epoch guard yet, that floor is below tokens already issued, and a holder
/// of such a token writes after a newer grant's lost write.
#[test]
fn a_recovery_floor_read_before_lockdb_epoch_guard_lets_an_older_grant_write() {
    let variant = Variant {
        recovery_floor_checks_epoch: false,
        ..Variant::DLOCK
    };
    control(
        "recovery floor read from lockdb's sequence as it is",
        Bounds::CHECKED,
        variant,
        GRANT_ORDER,
    );
}

/// The code as it stands (lockdb 0010, paydb 0021) models as dlock as designed, whose every
/// interleaving the main check explores: it presents no payout twice.
/// The code before them, all three gaps at once, presented a payout the rail received before
/// paydb lost its intent again after the operator's confirmation: kept as a control.
#[test]
fn the_code_today_is_the_protocol_and_the_code_before_presented_a_payout_twice() {
    assert_eq!(Variant::CODE, Variant::DLOCK);
    control(
        "the code before lockdb 0010 and paydb 0021",
        Bounds::CHECKED,
        Variant {
            recovery_floor_checks_epoch: false,
            revoke_checks_epoch: false,
            recovery_reads_rail: false,
            ..Variant::DLOCK
        },
        PAID_ONCE,
    );
}

/// L8 alone, without pushing the floor to the fences (docs/design.md#d-3): the revoked holder
/// still claims and writes.
#[test]
fn a_revocation_that_does_not_push_its_floor_lets_the_revoked_grant_write() {
    let variant = Variant {
        revocation_pushes_floor: false,
        ..Variant::DLOCK
    };
    control(
        "revocation without pushing the floor",
        REVOCATION_BOUNDS,
        variant,
        REVOKED_STAYS_OUT,
    );
}

/// A control: runs `variant` until `property` is violated, asserts it is, and prints the path.
fn control(label: &str, bounds: Bounds, variant: Variant, property: &'static str) -> Run {
    let run = run(Fencing::new(bounds, variant), Some(property));
    let path = path_of(&run, property);
    println!(
        "control '{label}': {}\n  '{property}' {} after {} unique states, {:.1} s ({:.1} s CPU)",
        bounds_line(&bounds),
        if path.is_some() { "VIOLATED" } else { "holds" },
        run.unique,
        run.elapsed.as_secs_f64(),
        run.cpu
    );
    if let Some(path) = path {
        let steps = path.lines().count().saturating_sub(1) / 2;
        println!("  counterexample, {steps} steps:\n{path}");
    }
    assert!(
        path.is_some(),
        "control '{label}': expected a counterexample to '{property}', none in {} states",
        run.unique
    );
    run
}

/// Without the payment side's epoch refusal, paydb's failover forgets an intent the rail already
/// received, and a newer holder presents the payout again.
#[test]
fn without_the_paydb_epoch_defence_a_payout_is_paid_twice() {
    let variant = Variant {
        pay_epoch_refusal: false,
        ..Variant::DLOCK
    };
    control(
        "no paydb epoch defence",
        Bounds::CHECKED,
        variant,
        PAID_ONCE,
    );
    // Without a client that sends again, a newer holder presents it again.
    control(
        "no paydb epoch defence, no client retries",
        Bounds {
            client_retries: false,
            ..Bounds::CHECKED
        },
        variant,
        PAID_ONCE,
    );
}

/// Without the lock server's jump past the safety gap, lockdb's failover hands out a token again,
/// and the two holders of one token both write: the older grant after the newer one.
#[test]
fn without_the_lockdb_epoch_jump_two_grants_write_out_of_order() {
    let variant = Variant {
        lock_epoch_jump: false,
        ..Variant::DLOCK
    };
    control(
        "no lockdb epoch jump",
        Bounds::CHECKED,
        variant,
        GRANT_ORDER,
    );
}

/// A gap smaller than what could have been issued since the standby stopped is no defence.
#[test]
fn a_safety_gap_too_small_repeats_a_token() {
    let bounds = Bounds {
        safety_gap: 1,
        ..Bounds::CHECKED
    };
    control("safety gap 1", bounds, Variant::DLOCK, GRANT_ORDER);
}

/// A recovery that only raises the fences, without reading the rail's record, leaves a payout the
/// rail received but paydb forgot CLAIMED: the next holder presents it again.
#[test]
fn a_recovery_that_does_not_read_the_rail_pays_twice() {
    let variant = Variant {
        recovery_reads_rail: false,
        ..Variant::DLOCK
    };
    control(
        "recovery without the rail's record",
        Bounds::CHECKED,
        variant,
        PAID_ONCE,
    );
}

/// A recovery that quarantines what the rail saw but leaves the fences where the failover put
/// them lets a grant whose claim survived write after a newer grant whose writes were lost.
#[test]
fn a_recovery_that_leaves_the_fences_down_lets_an_older_grant_write() {
    let variant = Variant {
        recovery_raises_fences: false,
        ..Variant::DLOCK
    };
    control(
        "recovery without raising the fences",
        Bounds::CHECKED,
        variant,
        GRANT_ORDER,
    );
}

/// The rail mark's strictness. With the proxy's per-payout checks taken out (replay, one presented
/// attempt per payout, CLAIMED under this token), a `>=` mark lets a retried submission with the
/// same token present the payout again, and the strict mark alone stops it. With the per-payout
/// checks in, a `>=` mark does not lead to a double presentation within the bounds: the strict mark
/// and the per-payout checks are two independent guards (docs/model.md#what-the-controls-find).
#[test]
fn a_non_strict_rail_mark_pays_twice_where_it_is_the_only_guard() {
    // One payout: the double presentation is one payout's; the two runs that hold stay short.
    let bounds = Bounds {
        payouts: 1,
        ..Bounds::CHECKED
    };
    let no_guards = Variant {
        per_payout_guards: false,
        ..Variant::DLOCK
    };
    control(
        "mark >= and no per-payout checks",
        bounds,
        Variant {
            strict_mark: false,
            ..no_guards
        },
        PAID_ONCE,
    );
    for (label, variant) in [
        ("a strict mark without the per-payout checks", no_guards),
        (
            "the per-payout checks with a mark >=",
            Variant {
                strict_mark: false,
                ..Variant::DLOCK
            },
        ),
    ] {
        let run = run(Fencing::new(bounds, variant), None);
        println!(
            "  {label}: '{PAID_ONCE}' {} in {} unique states, {:.1} s ({:.1} s CPU)",
            if run.found.contains(PAID_ONCE) {
                "VIOLATED"
            } else {
                "holds"
            },
            run.unique,
            run.elapsed.as_secs_f64(),
            run.cpu
        );
        assert!(
            !run.found.contains(PAID_ONCE),
            "{label}: expected to hold:\n{}",
            path_of(&run, PAID_ONCE).unwrap_or_default()
        );
    }
}
