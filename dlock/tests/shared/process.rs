//! A service spawned as a process, waited for until it serves.

use std::net::SocketAddr;
use std::path::Path;
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
