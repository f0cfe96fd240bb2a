//! The PostgreSQL the suites start is started again after a kill as a supervisor would start it
//! (services/devstack/src/lib.rs, `Daemon::launch`): a killed postmaster leaves its backends
//! running until they notice, and a new postmaster refuses to start while one of them still
//! holds the old shared memory. The scenarios that kill paydb or lockdb mid-run rely on this.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use dlock_devstack::{PgServer, pg_bin_dir, wait_until};

/// A query that keeps its backend busy for a few seconds without waiting on anything, so that
/// the backend notices its postmaster's death only when the query is done.
const BUSY: &str = "SELECT count(*) FROM generate_series(1, 30000000)";

#[test]
fn a_killed_postgresql_starts_again_while_a_backend_of_the_old_one_still_runs() {
    let mut pg = PgServer::start(None).unwrap_or_else(|e| panic!("{e:#}"));
    let psql = pg_bin_dir()
        .unwrap_or_else(|e| panic!("{e:#}"))
        .join("psql");
    let mut busy = Command::new(&psql)
        .args(["-X", "-q", "-d", &pg.url("postgres"), "-c", BUSY])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| panic!("{e}"));
    let active = format!(
        "SELECT pid FROM pg_stat_activity WHERE state = 'active' AND query = '{}'",
        BUSY.replace('\'', "''")
    );
    let mut backend = String::new();
    wait_until("the busy query", Duration::from_secs(10), || {
        backend = pg.psql("postgres", &active).unwrap_or_default();
        !backend.trim().is_empty()
    })
    .unwrap_or_else(|e| panic!("{e:#}"));
    let backend = backend.trim().to_owned();

    pg.kill();
    // The situation under test: the old server's backend outlived its postmaster.
    assert!(
        Path::new(&format!("/proc/{backend}")).exists(),
        "backend {backend} exited with its postmaster; the query is too short to test anything"
    );
    pg.start_again().unwrap_or_else(|e| panic!("{e:#}"));
    assert_eq!(
        pg.psql("postgres", "SELECT 1")
            .unwrap_or_else(|e| panic!("{e:#}"))
            .trim(),
        "1"
    );
    // The first start was refused (what failed the start before it was retried), and the
    // retry is what started it.
    let log = std::fs::read_to_string(pg.log()).unwrap_or_default();
    assert!(
        log.contains("pre-existing shared memory block"),
        "the new postmaster was never refused; the log:\n{log}"
    );
    let _ = busy.wait();
}
