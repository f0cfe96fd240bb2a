//! A service spawned as a process, waited for until it serves; a command run to its end, and
//! what it printed.

use std::net::SocketAddr;
use std::path::Path;
use std::process::{Command, Output};
use std::time::Duration;

use dlock_devstack::{ManagedChild, http_status, wait_until};

/// Waits up to `timeout` until `child` answers `path` on `addr` with 200; panics with its log
/// (`log`) if it exits or never does. `what` names it.
pub fn wait_serving(
    what: &str,
    child: &mut ManagedChild,
    addr: SocketAddr,
    path: &str,
    timeout: Duration,
    log: &Path,
) {
    wait_until(what, timeout, || {
        !child.exited() && http_status(addr, path) == Some(200)
    })
    .unwrap_or_else(|e| {
        panic!(
            "{e:#}\n{}",
            std::fs::read_to_string(log).unwrap_or_default()
        )
    });
}

/// What a command printed, and how it ended.
pub struct Ran {
    pub code: Option<i32>,
    pub out: String,
    pub err: String,
}

impl From<Output> for Ran {
    fn from(output: Output) -> Self {
        Self {
            code: output.status.code(),
            out: String::from_utf8_lossy(&output.stdout).into_owned(),
            err: String::from_utf8_lossy(&output.stderr).into_owned(),
        }
    }
}

impl std::fmt::Display for Ran {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "exit {:?}\nstdout:\n{}\nstderr:\n{}",
            self.code, self.out, self.err
        )
    }
}

/// The stdout of `output`, a run that must have succeeded (`what` names it; its stderr if not).
pub fn succeeded(output: &Output, what: &str) -> String {
    assert!(
        output.status.success(),
        "{what}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout).into_owned()
}

/// `dlock reconcile` of `paydb` against the rail statement at `rail`, with
/// `--settlement-window-ms window_ms` and `extra`: it exits 0, or 2 with findings.
pub fn reconcile(paydb: &str, rail: &str, window_ms: u64, extra: &[&str]) {
    const EXE: &str = env!("CARGO_BIN_EXE_dlock");
    let out = Command::new(EXE)
        .args(["reconcile", "--paydb", paydb, "--rail", rail])
        .args(["--settlement-window-ms", &window_ms.to_string()])
        .args(extra)
        .env_remove("DLOCK_TERMINATION_LOG")
        .output()
        .unwrap_or_else(|e| panic!("{EXE}: {e}"));
    assert!(
        matches!(out.status.code(), Some(0 | 2)),
        "dlock reconcile: {:?}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
}
