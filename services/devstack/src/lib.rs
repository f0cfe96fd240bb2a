//! Throwaway backing servers and supervised child processes, for `dlock dev up`, the test
//! harness and the benchmarks.
//!
//! PostgreSQL comes from the binaries on the machine (`/usr/lib/postgresql/*/bin`, or
//! `DLOCK_PG_BIN`), etcd from `etcd` on the `PATH` (or `DLOCK_ETCD_BIN`). Both listen on free
//! loopback ports. PostgreSQL refuses to run as root, so as root it runs as the `postgres` user
//! through `setpriv`, which execs (no intermediate process that could outlive a kill).

pub mod certs;
pub mod etcd_cluster;
pub mod faultproxy;
pub mod kube;
pub mod netfault;

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

/// A port that was free a moment ago on 127.0.0.1.
pub fn free_port() -> Result<u16> {
    let listener = TcpListener::bind("127.0.0.1:0").context("binding a probe socket")?;
    Ok(listener.local_addr()?.port())
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

fn running_as_root() -> bool {
    std::fs::metadata("/proc/self")
        .map(|m| m.uid() == 0)
        .unwrap_or(false)
}

fn postgres_ids() -> Result<(u32, u32)> {
    let user = nix::unistd::User::from_name("postgres")
        .context("looking up the postgres user")?
        .ok_or_else(|| anyhow!("running as root needs a `postgres` user to run PostgreSQL as"))?;
    Ok((user.uid.as_raw(), user.gid.as_raw()))
}

/// A command that runs as `postgres` when we are root.
fn pg_command(bin: &Path) -> Command {
    if running_as_root() {
        let mut command = Command::new("setpriv");
        command
            .args([
                "--reuid=postgres",
                "--regid=postgres",
                "--init-groups",
                "--",
            ])
            .arg(bin);
        command
    } else {
        Command::new(bin)
    }
}

pub(crate) fn chown_for_postgres(path: &Path) -> Result<()> {
    if running_as_root() {
        let (uid, gid) = postgres_ids()?;
        std::os::unix::fs::chown(path, Some(uid), Some(gid))
            .with_context(|| format!("chown {} to postgres", path.display()))?;
    }
    Ok(())
}

/// The directory of the PostgreSQL server binaries.
pub fn pg_bin_dir() -> Result<PathBuf> {
    if let Ok(dir) = std::env::var("DLOCK_PG_BIN") {
        return Ok(PathBuf::from(dir));
    }
    let mut versions: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .context("PostgreSQL binaries not found under /usr/lib/postgresql; set DLOCK_PG_BIN")?
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let v = e.file_name().to_str()?.parse::<u32>().ok()?;
            let bin = e.path().join("bin");
            bin.join("postgres").exists().then_some((v, bin))
        })
        .collect();
    versions.sort();
    versions.pop().map(|(_, bin)| bin).ok_or_else(|| {
        anyhow!("no PostgreSQL server binaries under /usr/lib/postgresql; set DLOCK_PG_BIN")
    })
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

/// Opens (appending) a log file for a child's stderr and stdout.
fn log_stdio(log: Option<&Path>) -> Result<(Stdio, Stdio)> {
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

/// The initialized, never-started data directory that new servers copy instead of running
/// initdb each time (initdb is most of a start's cost).
fn pg_template(bin: &Path) -> Result<PathBuf> {
    let root = std::env::temp_dir().join(format!(
        "dlock-pg-template-{}-{}",
        bin.to_string_lossy().replace('/', "_"),
        if running_as_root() { "root" } else { "user" }
    ));
    let data = root.join("data");
    if data.join("PG_VERSION").exists() && root.join("ready").exists() {
        return Ok(data);
    }
    let staging = std::env::temp_dir().join(format!("dlock-pg-staging-{}", uuid_like()));
    std::fs::create_dir_all(&staging)?;
    chown_for_postgres(&staging)?;
    let staged = staging.join("data");
    let output = pg_command(&bin.join("initdb"))
        .args([
            "-U",
            "postgres",
            "-A",
            "trust",
            "-E",
            "UTF8",
            "--locale=C",
            "--no-sync",
            "-D",
        ])
        .arg(&staged)
        .output()
        .context("running initdb")?;
    if !output.status.success() {
        bail!(
            "initdb failed: {}",
            String::from_utf8_lossy(&output.stderr).trim()
        );
    }
    std::fs::write(staging.join("ready"), b"")?;
    // Whoever renames first wins; a loser's copy is simply removed.
    match std::fs::rename(&staging, &root) {
        Ok(()) => {}
        Err(_) => {
            let _ = std::fs::remove_dir_all(&staging);
        }
    }
    if data.join("PG_VERSION").exists() {
        Ok(data)
    } else {
        bail!("the PostgreSQL template at {} is unusable", root.display())
    }
}

fn uuid_like() -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or_default();
    format!("{}-{nanos}", std::process::id())
}

/// A throwaway PostgreSQL server on a free loopback port.
pub struct PgServer {
    pub port: u16,
    bin: PathBuf,
    dir: PathBuf,
    /// Addresses it listens on besides 127.0.0.1 (a netfault veth, say).
    extra_listen: Vec<IpAddr>,
    /// More `-c name=value` server settings (`ssl=on`, say; see [`PgServer::start_tls`]).
    settings: Vec<String>,
    _temp: Option<tempfile::TempDir>,
    child: Option<ManagedChild>,
}

impl PgServer {
    /// Starts a server in `dir` (initialized from the template if empty) or in a temp dir.
    pub fn start(dir: Option<&Path>) -> Result<Self> {
        Self::start_listening(dir, &[])
    }

    /// Like [`PgServer::start`], also listening on `extra` addresses (which must exist), with
    /// trust authentication for clients on their subnets (`samenet`).
    pub fn start_listening(dir: Option<&Path>, extra: &[IpAddr]) -> Result<Self> {
        Self::start_with(dir, extra, |_| Ok(Vec::new()))
    }

    /// Starts a server with the `-c name=value` settings that `prepare` returns once it has
    /// seen the server's directory (the data directory is `dir/data`).
    pub(crate) fn start_with(
        dir: Option<&Path>,
        extra: &[IpAddr],
        prepare: impl FnOnce(&Path) -> Result<Vec<String>>,
    ) -> Result<Self> {
        let bin = pg_bin_dir()?;
        let (temp, dir) = match dir {
            Some(dir) => (None, dir.to_path_buf()),
            None => {
                let temp = tempfile::Builder::new().prefix("dlock-pg-").tempdir()?;
                let path = temp.path().to_path_buf();
                (Some(temp), path)
            }
        };
        std::fs::create_dir_all(&dir)?;
        chown_for_postgres(&dir)?;
        let data = dir.join("data");
        if !data.join("PG_VERSION").exists() {
            let template = pg_template(&bin)?;
            let status = Command::new("cp")
                .arg("-a")
                .arg(&template)
                .arg(&data)
                .status()
                .context("copying the PostgreSQL template")?;
            if !status.success() {
                bail!(
                    "copying the PostgreSQL template into {} failed",
                    data.display()
                );
            }
        }
        if !extra.is_empty() {
            let hba = data.join("pg_hba.conf");
            let text = std::fs::read_to_string(&hba).context("reading pg_hba.conf")?;
            let line = "host all all samenet trust";
            if !text.lines().any(|l| l.trim() == line) {
                std::fs::write(&hba, format!("{text}\n{line}\n")).context("writing pg_hba.conf")?;
            }
        }
        let settings = prepare(&dir)?;
        let mut server = Self {
            port: free_port()?,
            bin,
            dir,
            extra_listen: extra.to_vec(),
            settings,
            _temp: temp,
            child: None,
        };
        server.launch()?;
        Ok(server)
    }

    fn launch(&mut self) -> Result<()> {
        let data = self.dir.join("data");
        let socket_dir = self.dir.join("socket");
        std::fs::create_dir_all(&socket_dir)?;
        chown_for_postgres(&socket_dir)?;
        let (stdout, stderr) = log_stdio(Some(&self.dir.join("postgres.log")))?;
        let listen = std::iter::once("127.0.0.1".to_owned())
            .chain(self.extra_listen.iter().map(IpAddr::to_string))
            .collect::<Vec<_>>()
            .join(",");
        let listen = format!("listen_addresses={listen}");
        let child = pg_command(&self.bin.join("postgres"))
            .arg("-D")
            .arg(&data)
            .args(["-p", &self.port.to_string(), "-k"])
            .arg(&socket_dir)
            .args([
                "-c",
                listen.as_str(),
                "-c",
                "max_connections=300",
                "-c",
                "shared_buffers=128MB",
                // A throwaway server: an fsync protects against a machine crash, which would
                // take the test with it. A killed process loses nothing without it.
                "-c",
                "fsync=off",
                "-c",
                "full_page_writes=off",
            ])
            .args(self.settings.iter().flat_map(|s| ["-c", s.as_str()]))
            .stdin(Stdio::null())
            .stdout(stdout)
            .stderr(stderr)
            .spawn()
            .context("starting postgres")?;
        self.child = Some(ManagedChild::new("postgres", child));
        let port = self.port;
        let bin = self.bin.clone();
        wait_until("PostgreSQL", Duration::from_secs(30), || {
            Command::new(bin.join("pg_isready"))
                .args([
                    "-q",
                    "-h",
                    "127.0.0.1",
                    "-p",
                    &port.to_string(),
                    "-U",
                    "postgres",
                ])
                .status()
                .map(|s| s.success())
                .unwrap_or(false)
        })
        .with_context(|| format!("see {}", self.dir.join("postgres.log").display()))
    }

    pub fn url(&self, database: &str) -> String {
        format!("postgres://postgres@127.0.0.1:{}/{database}", self.port)
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().and_then(ManagedChild::pid)
    }

    /// Runs one SQL statement with psql as the superuser.
    pub fn psql(&self, database: &str, sql: &str) -> Result<String> {
        let output = Command::new(self.bin.join("psql"))
            .args([
                "-X",
                "-q",
                "-A",
                "-t",
                "-v",
                "ON_ERROR_STOP=1",
                "-h",
                "127.0.0.1",
            ])
            .args([
                "-p",
                &self.port.to_string(),
                "-U",
                "postgres",
                "-d",
                database,
                "-c",
                sql,
            ])
            .output()
            .context("running psql")?;
        if !output.status.success() {
            bail!(
                "psql failed: {}",
                String::from_utf8_lossy(&output.stderr).trim()
            );
        }
        Ok(String::from_utf8_lossy(&output.stdout).trim().to_owned())
    }

    pub fn create_database(&self, name: &str) -> Result<()> {
        let exists = self.psql(
            "postgres",
            &format!("SELECT 1 FROM pg_database WHERE datname = '{name}'"),
        )?;
        if exists.is_empty() {
            self.psql("postgres", &format!("CREATE DATABASE \"{name}\""))?;
        }
        Ok(())
    }

    /// Stops the server (fast shutdown).
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            child.stop_with(Signal::SIGINT, Duration::from_secs(15));
        }
    }

    /// Kills the server outright, as a crash would.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            child.kill();
        }
    }

    /// Starts it again on the same port and data.
    pub fn restart(&mut self) -> Result<()> {
        self.stop();
        self.launch()
    }

    /// Starts it after a stop or kill.
    pub fn start_again(&mut self) -> Result<()> {
        if self.child.is_none() {
            self.launch()?;
        }
        Ok(())
    }
}

impl Drop for PgServer {
    fn drop(&mut self) {
        self.stop();
    }
}

/// A throwaway single-member etcd on free loopback ports.
pub struct EtcdServer {
    pub client_port: u16,
    peer_port: u16,
    /// Addresses its client port listens on besides 127.0.0.1.
    extra_listen: Vec<IpAddr>,
    dir: PathBuf,
    _temp: Option<tempfile::TempDir>,
    child: Option<ManagedChild>,
}

fn etcd_bin() -> PathBuf {
    std::env::var("DLOCK_ETCD_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|_| PathBuf::from("etcd"))
}

impl EtcdServer {
    pub fn start(dir: Option<&Path>) -> Result<Self> {
        Self::start_listening(dir, &[])
    }

    /// Like [`EtcdServer::start`], the client port also listening on `extra` addresses.
    pub fn start_listening(dir: Option<&Path>, extra: &[IpAddr]) -> Result<Self> {
        let (temp, dir) = match dir {
            Some(dir) => (None, dir.to_path_buf()),
            None => {
                let temp = tempfile::Builder::new().prefix("dlock-etcd-").tempdir()?;
                let path = temp.path().to_path_buf();
                (Some(temp), path)
            }
        };
        std::fs::create_dir_all(&dir)?;
        let mut server = Self {
            client_port: free_port()?,
            peer_port: free_port()?,
            extra_listen: extra.to_vec(),
            dir,
            _temp: temp,
            child: None,
        };
        server.launch()?;
        Ok(server)
    }

    fn launch(&mut self) -> Result<()> {
        let client = std::iter::once(IpAddr::from([127, 0, 0, 1]))
            .chain(self.extra_listen.iter().copied())
            .map(|ip| format!("http://{}", SocketAddr::new(ip, self.client_port)))
            .collect::<Vec<_>>()
            .join(",");
        let peer = format!("http://127.0.0.1:{}", self.peer_port);
        let (stdout, stderr) = log_stdio(Some(&self.dir.join("etcd.log")))?;
        let child = Command::new(etcd_bin())
            .args(["--name", "dlock-dev", "--data-dir"])
            .arg(self.dir.join("data"))
            .args([
                "--listen-client-urls",
                &client,
                "--advertise-client-urls",
                &client,
            ])
            .args([
                "--listen-peer-urls",
                &peer,
                "--initial-advertise-peer-urls",
                &peer,
            ])
            .args(["--initial-cluster", &format!("dlock-dev={peer}")])
            .args(["--logger", "zap", "--log-level", "warn"])
            .stdin(Stdio::null())
            .stdout(stdout)
            .stderr(stderr)
            .spawn()
            .context("starting etcd (install Debian's etcd-server, or set DLOCK_ETCD_BIN)")?;
        self.child = Some(ManagedChild::new("etcd", child));
        let addr: SocketAddr = ([127, 0, 0, 1], self.client_port).into();
        wait_until("etcd", Duration::from_secs(30), || {
            http_status(addr, "/health") == Some(200)
        })
        .with_context(|| format!("see {}", self.dir.join("etcd.log").display()))
    }

    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.client_port)
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().and_then(ManagedChild::pid)
    }

    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            child.stop();
        }
    }

    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            child.kill();
        }
    }

    pub fn start_again(&mut self) -> Result<()> {
        if self.child.is_none() {
            self.launch()?;
        }
        Ok(())
    }
}

impl Drop for EtcdServer {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Spawns `program args` with its output appended to `log`, stopped when the handle drops.
pub fn spawn_logged(
    name: &str,
    program: &Path,
    args: &[String],
    env: &[(String, String)],
    log: Option<&Path>,
) -> Result<ManagedChild> {
    let (stdout, stderr) = log_stdio(log)?;
    let child = Command::new(program)
        .args(args)
        .envs(env.iter().map(|(k, v)| (k, v)))
        .stdin(Stdio::null())
        .stdout(stdout)
        .stderr(stderr)
        .spawn()
        .with_context(|| format!("starting {name} ({})", program.display()))?;
    Ok(ManagedChild::new(name, child))
}
