//! Throwaway backing servers and supervised child processes, for `dlock dev up`, the test
//! harness and the benchmarks.
//!
//! PostgreSQL comes from the binaries on the machine (`/usr/lib/postgresql/*/bin`, or
//! `DLOCK_PG_BIN`), etcd from `etcd` on the `PATH` (or `DLOCK_ETCD_BIN`). Both listen on free
//! loopback ports. PostgreSQL refuses to run as root, so as root it runs as the `postgres` user
//! through `setpriv`, which execs (no intermediate process that could outlive a kill).

pub mod bench;
pub mod certs;
mod etcd;
pub mod etcd_cluster;
pub mod faultproxy;
pub mod kube;
pub mod netfault;
mod pg;
pub mod pg_standby;
pub mod stack;

pub use etcd::*;
pub use pg::*;

use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
pub use nix::sys::signal::Signal;
use nix::sys::signal::kill;
use nix::unistd::Pid;

/// A port that was free a moment ago on 127.0.0.1, reserved for this caller for a while.
///
/// The port is handed out and bound later by another process, so two things could take it in
/// between; both are ruled out here:
/// - it lies outside the kernel's ephemeral range, where every outgoing connection of every test
///   gets its local port (a port from `bind(":0")` lies inside it and was once taken by a
///   client's connection before the service started);
/// - a marker file under the temporary directory, taken under a file lock, reserves it for
///   [`PORT_RESERVATION`] against every other process that calls this function (the suites run
///   as many processes at once).
pub fn free_port() -> Result<u16> {
    let (low, high) = ephemeral_range();
    // The larger stretch outside the ephemeral range, above 10 000 (below it live well-known
    // services).
    let (from, to) = if low.saturating_sub(10_000) >= 65_535 - high {
        (10_000, low.saturating_sub(1).max(10_000))
    } else {
        (high.saturating_add(1), 65_535)
    };
    let dir = std::env::temp_dir().join("dlock-ports");
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let lock = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(dir.join(".lock"))
        .with_context(|| format!("opening {}/.lock", dir.display()))?;
    // Held until this function returns: one caller at a time picks and reserves.
    let _held = nix::fcntl::Flock::lock(lock, nix::fcntl::FlockArg::LockExclusive)
        .map_err(|(_, e)| anyhow!("locking {}/.lock: {e}", dir.display()))?;
    let span = u32::from(to - from) + 1;
    let mut seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
        .subsec_nanos()
        ^ std::process::id().rotate_left(16)
        | 1;
    for _ in 0..512 {
        // xorshift: enough to spread concurrent callers over the range.
        seed ^= seed << 13;
        seed ^= seed >> 17;
        seed ^= seed << 5;
        let port = from + u16::try_from(seed % span).unwrap_or(0);
        if reserve(&dir.join(port.to_string())) && TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return Ok(port);
        }
    }
    bail!(
        "no free port found between {from} and {to} on 127.0.0.1; see what holds them with `ss -ltn`"
    )
}

/// How long a port handed out by [`free_port`] stays reserved against other callers.
pub const PORT_RESERVATION: Duration = Duration::from_secs(600);

/// Takes the marker `path` unless another caller took it within [`PORT_RESERVATION`]. The
/// caller holds the directory's lock, so checking and taking are one step.
fn reserve(path: &Path) -> bool {
    let fresh = std::fs::metadata(path)
        .and_then(|m| m.modified())
        .ok()
        .and_then(|t| t.elapsed().ok())
        .is_some_and(|age| age < PORT_RESERVATION);
    !fresh && std::fs::write(path, std::process::id().to_string()).is_ok()
}

/// The kernel's range of ephemeral ports (Linux's default when it cannot be read).
fn ephemeral_range() -> (u16, u16) {
    std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| {
            let mut it = s.split_whitespace().map(|w| w.parse::<u16>().ok());
            Some((it.next()??, it.next()??))
        })
        .unwrap_or((32_768, 60_999))
}

/// Waits until `probe` says yes, or fails after `timeout` naming `what`.
pub fn wait_until(what: &str, timeout: Duration, mut probe: impl FnMut() -> bool) -> Result<()> {
    let deadline = Instant::now() + timeout;
    let mut nap = Duration::from_millis(5);
    while Instant::now() < deadline {
        if probe() {
            return Ok(());
        }
        std::thread::sleep(nap);
        nap = (nap * 2).min(Duration::from_millis(100));
    }
    bail!(
        "{what} did not become ready within {} ms",
        timeout.as_millis()
    )
}

/// The status code of a plain `GET` on loopback, without an HTTP client (or `None`).
pub fn http_status(addr: SocketAddr, path: &str) -> Option<u16> {
    let mut stream = TcpStream::connect_timeout(&addr, Duration::from_millis(500)).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    write!(stream, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").ok()?;
    let mut head = [0u8; 64];
    let n = stream.read(&mut head).ok()?;
    let line = std::str::from_utf8(&head[..n]).ok()?;
    line.split_whitespace().nth(1)?.parse().ok()
}

/// A child process that is stopped (SIGTERM, then SIGKILL) when dropped.
pub struct ManagedChild {
    pub name: String,
    child: Option<Child>,
}

impl ManagedChild {
    pub fn new(name: &str, child: Child) -> Self {
        Self {
            name: name.to_owned(),
            child: Some(child),
        }
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    pub fn signal(&self, signal: Signal) -> Result<()> {
        let pid = self
            .pid()
            .ok_or_else(|| anyhow!("{} is not running", self.name))?;
        kill(Pid::from_raw(pid as i32), signal)
            .with_context(|| format!("signal {signal} to {}", self.name))
    }

    /// Whether the process has exited (and reaps it if so).
    pub fn exited(&mut self) -> bool {
        matches!(
            self.child.as_mut().map(Child::try_wait),
            Some(Ok(Some(_))) | None
        )
    }

    /// Waits up to `timeout` for the process to exit by itself; its status, or `None`.
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<std::process::ExitStatus> {
        let deadline = Instant::now() + timeout;
        let child = self.child.as_mut()?;
        loop {
            match child.try_wait() {
                Ok(Some(status)) => return Some(status),
                Ok(None) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(20))
                }
                _ => return None,
            }
        }
    }

    /// Stops the process with `signal`, escalating to SIGKILL after `grace`.
    pub fn stop_with(&mut self, signal: Signal, grace: Duration) {
        let Some(mut child) = self.child.take() else {
            return;
        };
        let _ = kill(Pid::from_raw(child.id() as i32), signal);
        let deadline = Instant::now() + grace;
        loop {
            match child.try_wait() {
                Ok(Some(_)) | Err(_) => return,
                Ok(None) if Instant::now() >= deadline => break,
                Ok(None) => std::thread::sleep(Duration::from_millis(10)),
            }
        }
        let _ = child.kill();
        let _ = child.wait();
    }

    pub fn stop(&mut self) {
        self.stop_with(Signal::SIGTERM, Duration::from_secs(10));
    }

    /// SIGKILL, no grace: a crash.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for ManagedChild {
    fn drop(&mut self) {
        self.stop();
    }
}

/// A backing server's process (PostgreSQL, etcd): spawned with its output in a log file in the
/// server's directory, stopped with its own signal and grace when dropped, and startable again on
/// the same ports and data after a stop or a kill. The servers deref to it for `pid`, `stop` and
/// `kill`.
pub struct Daemon {
    name: &'static str,
    log: PathBuf,
    signal: Signal,
    grace: Duration,
    child: Option<ManagedChild>,
}

impl Daemon {
    /// Not running yet; `name` names it in errors, its output goes to `log`, and it is stopped
    /// with `signal`, escalating to SIGKILL after `grace`.
    pub(crate) fn new(name: &'static str, log: PathBuf, signal: Signal, grace: Duration) -> Self {
        Self {
            name,
            log,
            signal,
            grace,
            child: None,
        }
    }

    /// Spawns `command` (`install` says what to do when that fails), then waits up to 30 s for
    /// `ready`; an error points at the log.
    ///
    /// A server that exits before it is ready is spawned again within those 30 s, as a
    /// supervisor would: after a kill, what the crashed server left behind can refuse the first
    /// start for a moment (PostgreSQL's backends outlive a killed postmaster until they notice,
    /// and a new postmaster refuses to start while they still hold its shared memory).
    pub(crate) fn launch(
        &mut self,
        mut command: Command,
        install: &str,
        mut ready: impl FnMut() -> bool,
    ) -> Result<()> {
        let spawn = |command: &mut Command| -> Result<ManagedChild> {
            let (stdout, stderr) = log_stdio(Some(&self.log))?;
            let child = command
                .stdin(Stdio::null())
                .stdout(stdout)
                .stderr(stderr)
                .spawn()
                .with_context(|| format!("starting {} ({install})", self.name))?;
            Ok(ManagedChild::new(self.name, child))
        };
        let mut child = spawn(&mut command)?;
        let mut exits = 0;
        let waited = wait_until(self.name, Duration::from_secs(30), || {
            if child.exited() {
                exits += 1;
                match spawn(&mut command) {
                    Ok(again) => child = again,
                    Err(e) => tracing::warn!("{e:#}"),
                }
                return false;
            }
            ready()
        });
        self.child = Some(child);
        waited.with_context(|| {
            format!(
                "it exited {exits} times before it was ready; see {}",
                self.log.display()
            )
        })
    }

    /// The file its output goes to.
    pub fn log(&self) -> &Path {
        &self.log
    }

    /// Whether it was started and has not been stopped or killed since.
    pub fn running(&self) -> bool {
        self.child.is_some()
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().and_then(ManagedChild::pid)
    }

    /// Stops the server with its own signal (a clean shutdown).
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            child.stop_with(self.signal, self.grace);
        }
    }

    /// Kills the server outright, as a crash would.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            child.kill();
        }
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Gives a server type with a `daemon: Daemon` field and a `launch(&mut self) -> Result<()>`
/// its `start_again` and the [`Daemon`] methods.
macro_rules! daemon_server {
    ($server:ty) => {
        impl $server {
            /// Launches a server just built.
            fn started(mut self) -> Result<Self> {
                self.launch()?;
                Ok(self)
            }

            /// Starts it after a stop or kill, on the same ports and data.
            pub fn start_again(&mut self) -> Result<()> {
                if !self.daemon.running() {
                    self.launch()?;
                }
                Ok(())
            }
        }

        impl std::ops::Deref for $server {
            type Target = Daemon;
            fn deref(&self) -> &Daemon {
                &self.daemon
            }
        }

        impl std::ops::DerefMut for $server {
            fn deref_mut(&mut self) -> &mut Daemon {
                &mut self.daemon
            }
        }
    };
}
pub(crate) use daemon_server;

/// `dir`, created, or a fresh temporary directory named `prefix…` that lives as long as the
/// returned guard.
pub(crate) fn server_dir(
    dir: Option<&Path>,
    prefix: &str,
) -> Result<(Option<tempfile::TempDir>, PathBuf)> {
    let (temp, dir) = match dir {
        Some(dir) => (None, dir.to_path_buf()),
        None => {
            let temp = tempfile::Builder::new().prefix(prefix).tempdir()?;
            let path = temp.path().to_path_buf();
            (Some(temp), path)
        }
    };
    std::fs::create_dir_all(&dir)?;
    Ok((temp, dir))
}

/// Runs `command` to its end with `input` on stdin; its stdout, or an error naming `what` with
/// its stderr when it fails.
pub(crate) fn run_output(mut command: Command, what: &str, input: Option<&str>) -> Result<String> {
    let mut child = command
        .stdin(if input.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("starting {what} (is it installed?)"))?;
    if let (Some(text), Some(mut stdin)) = (input, child.stdin.take()) {
        stdin
            .write_all(text.as_bytes())
            .with_context(|| format!("writing the input of {what}"))?;
    }
    let output = child
        .wait_with_output()
        .with_context(|| format!("waiting for {what}"))?;
    if !output.status.success() {
        bail!(
            "{what} failed ({}): {}",
            output.status,
            String::from_utf8_lossy(&output.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&output.stdout).into_owned())
}

/// Opens (appending) a log file for a child's stderr and stdout.
pub(crate) fn log_stdio(log: Option<&Path>) -> Result<(Stdio, Stdio)> {
    match log {
        Some(path) => {
            let file = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(path)
                .with_context(|| format!("opening log {}", path.display()))?;
            Ok((Stdio::from(file.try_clone()?), Stdio::from(file)))
        }
        None => Ok((Stdio::null(), Stdio::null())),
    }
}

/// `pairs` as a service's TOML configuration file: one flat quoted key per line, every value a
/// string (the services read a number, a boolean or a comma-separated list from a string too).
pub fn config_toml(pairs: &[(String, String)]) -> String {
    // A JSON string is a TOML basic string: the same quotes and escapes.
    let quote = |text: &str| {
        let mut out = String::from("\"");
        for c in text.chars() {
            match c {
                '"' => out.push_str("\\\""),
                '\\' => out.push_str("\\\\"),
                '\n' => out.push_str("\\n"),
                '\r' => out.push_str("\\r"),
                '\t' => out.push_str("\\t"),
                c if c.is_control() => out.push_str(&format!("\\u{:04X}", c as u32)),
                c => out.push(c),
            }
        }
        out.push('"');
        out
    };
    pairs
        .iter()
        .map(|(key, value)| format!("{} = {}\n", quote(key), quote(value)))
        .collect()
}

/// Writes `pairs` ([`config_toml`]) to `path` and returns the `--config` argument naming it:
/// services take their configuration from a file only, never from the environment.
pub fn write_config(path: &Path, pairs: &[(String, String)]) -> Result<Vec<String>> {
    std::fs::write(path, config_toml(pairs))
        .with_context(|| format!("writing the configuration {}", path.display()))?;
    Ok(vec!["--config".to_owned(), path.display().to_string()])
}

/// Spawns `program args` with its output appended to `log`, stopped when the handle drops.
pub fn spawn_logged(
    name: &str,
    program: &Path,
    args: &[String],
    env: &[(String, String)],
    log: Option<&Path>,
) -> Result<ManagedChild> {
    spawn_command(name, Command::new(program), args, env, log)
}

/// Spawns `command args` with `env` (a [`netfault::NetNs::command`], say), its output appended
/// to `log`, stopped when the handle drops.
pub fn spawn_command(
    name: &str,
    mut command: Command,
    args: &[String],
    env: &[(String, String)],
    log: Option<&Path>,
) -> Result<ManagedChild> {
    let what = std::iter::once(command.get_program())
        .chain(command.get_args())
        .map(|part| part.to_string_lossy())
        .collect::<Vec<_>>()
        .join(" ");
    let (stdout, stderr) = log_stdio(log)?;
    let child = command
        .args(args)
        .envs(env.iter().map(|(k, v)| (k, v)))
        .stdin(Stdio::null())
        .stdout(stdout)
        .stderr(stderr)
        .spawn()
        .with_context(|| format!("starting {name} ({what})"))?;
    Ok(ManagedChild::new(name, child))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_free_port_lies_outside_the_ephemeral_range_and_is_handed_out_once() {
        let (low, high) = ephemeral_range();
        let mut seen = std::collections::HashSet::new();
        for _ in 0..50 {
            let port = free_port().unwrap_or_else(|e| panic!("{e:#}"));
            assert!(
                !(low..=high).contains(&port),
                "{port} lies in the ephemeral range {low}-{high}"
            );
            assert!(seen.insert(port), "{port} was handed out twice");
        }
        // The positive control for "outside the range": a port the kernel picks lies inside it.
        let kernel = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .unwrap_or_else(|e| panic!("{e}"))
            .port();
        assert!((low..=high).contains(&kernel), "{kernel} vs {low}-{high}");
    }

    #[test]
    fn a_reservation_is_refused_while_fresh_and_taken_over_when_old() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let marker = dir.path().join("20000");
        assert!(reserve(&marker), "a port nobody reserved");
        assert!(!reserve(&marker), "a port reserved a moment ago");
        let old = std::time::SystemTime::now() - PORT_RESERVATION - Duration::from_secs(1);
        std::fs::File::options()
            .write(true)
            .open(&marker)
            .and_then(|f| f.set_modified(old))
            .unwrap_or_else(|e| panic!("{e}"));
        assert!(
            reserve(&marker),
            "a reservation older than PORT_RESERVATION"
        );
    }
}
