//! A throwaway PostgreSQL from the binaries on the machine, started from a copied template.

use crate::*;

pub(crate) fn running_as_root() -> bool {
    std::fs::metadata("/proc/self")
        .map(|m| m.uid() == 0)
        .unwrap_or(false)
}

pub(crate) fn postgres_ids() -> Result<(u32, u32)> {
    let user = nix::unistd::User::from_name("postgres")
        .context("looking up the postgres user")?
        .ok_or_else(|| anyhow!("running as root needs a `postgres` user to run PostgreSQL as"))?;
    Ok((user.uid.as_raw(), user.gid.as_raw()))
}

/// A command that runs as `postgres` when we are root.
pub(crate) fn pg_command(bin: &Path) -> Command {
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

/// The initialized, never-started data directory that new servers copy instead of running
/// initdb each time (initdb is most of a start's cost).
pub(crate) fn pg_template(bin: &Path) -> Result<PathBuf> {
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
    let mut initdb = pg_command(&bin.join("initdb"));
    initdb
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
        .arg(&staged);
    run_output(initdb, "initdb", None)?;
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

pub(crate) fn uuid_like() -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or_default();
    format!("{}-{nanos}", std::process::id())
}

/// How a throwaway server writes its WAL and data to disk.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Durability {
    /// `fsync=off`, `full_page_writes=off`: a commit waits for no disk. A killed process loses
    /// nothing, a machine crash would; tests and `dlock dev up` run so.
    Fast,
    /// Production's settings: `fsync=on`, `full_page_writes=on`, `synchronous_commit=on`, so a
    /// commit waits for its WAL flush. Benchmarks run so unless told otherwise
    /// (docs/benchmarks.md#running-the-benchmarks).
    Durable,
}

impl Durability {
    /// The `-c` settings of this mode.
    fn settings(self) -> [&'static str; 3] {
        match self {
            // A throwaway server: an fsync protects against a machine crash, which would take
            // the test with it. A killed process loses nothing without it.
            Self::Fast => ["fsync=off", "full_page_writes=off", "synchronous_commit=on"],
            Self::Durable => ["fsync=on", "full_page_writes=on", "synchronous_commit=on"],
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::Fast => "fast (fsync=off, full_page_writes=off: not production's)",
            Self::Durable => {
                "durable (fsync=on, full_page_writes=on, synchronous_commit=on: production's)"
            }
        }
    }
}

/// Raw PostgreSQL commits, measured by pgbench on the same server: `updates` conditional
/// `UPDATE`s per transaction, from `clients` connections (each on rows of its own).
#[derive(Clone, Copy, Debug)]
pub struct RawCommits {
    pub clients: usize,
    pub updates: usize,
    pub commits_per_second: f64,
}

impl RawCommits {
    pub fn updates_per_second(&self) -> f64 {
        self.commits_per_second * self.updates as f64
    }
}

/// A throwaway PostgreSQL server on a free loopback port.
pub struct PgServer {
    pub port: u16,
    pub durability: Durability,
    bin: PathBuf,
    dir: PathBuf,
    /// Addresses it listens on besides 127.0.0.1 (a netfault veth, say).
    extra_listen: Vec<IpAddr>,
    /// More `-c name=value` server settings (`ssl=on`, say; see [`PgServer::start_tls`]).
    settings: Vec<String>,
    /// Declared before the directory guard: stopped before its data is removed.
    daemon: Daemon,
    _temp: Option<tempfile::TempDir>,
}

/// A PostgreSQL server setting as `postgres -c` takes it: `name=value`, with a name of letters,
/// digits, `_` and `.` (`shared_preload_libraries`, `pg_stat_statements.track`). The setting
/// itself, or what is wrong with it.
pub fn pg_setting(setting: &str) -> Result<String> {
    match setting.split_once('=') {
        Some((name, _))
            if !name.is_empty()
                && name
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '.') =>
        {
            Ok(setting.to_owned())
        }
        _ => bail!(
            "PostgreSQL setting `{setting}` is not NAME=VALUE (a name of letters, digits, `_` \
             and `.`): write it as for `postgres -c`"
        ),
    }
}

impl PgServer {
    /// Starts a server in `dir` (initialized from the template if empty) or in a temp dir.
    pub fn start(dir: Option<&Path>) -> Result<Self> {
        Self::start_listening(dir, &[])
    }

    /// Like [`PgServer::start`] in a temp dir, with the given [`Durability`].
    pub fn start_durability(durability: Durability) -> Result<Self> {
        Self::start_in(None, durability)
    }

    /// Like [`PgServer::start`] in `dir` (a temp dir when None), with the given [`Durability`].
    pub fn start_in(dir: Option<&Path>, durability: Durability) -> Result<Self> {
        Self::start_configured(dir, durability, &[])
    }

    /// Like [`PgServer::start_in`], with more server settings (`name=value`, each passed as
    /// `-c name=value` after the durability's, so one of these replaces a default): for
    /// instance `shared_preload_libraries=pg_stat_statements` to see where a run's time goes.
    pub fn start_configured(
        dir: Option<&Path>,
        durability: Durability,
        settings: &[String],
    ) -> Result<Self> {
        let settings = settings
            .iter()
            .map(|s| pg_setting(s))
            .collect::<Result<Vec<_>>>()?;
        Self::start_inner(dir, &[], durability, move |_| Ok(settings))
    }

    /// Like [`PgServer::start`], also listening on `extra` addresses (which must exist), with
    /// trust authentication for clients on their subnets (`samenet`).
    pub fn start_listening(dir: Option<&Path>, extra: &[IpAddr]) -> Result<Self> {
        Self::start_with(dir, extra, |_| Ok(Vec::new()))
    }

    /// Like [`PgServer::start_listening`], also trusting clients from `networks` (CIDRs): the
    /// pods of a real node reach the machine's address from their own network.
    pub fn start_trusting(dir: Option<&Path>, extra: &[IpAddr], networks: &[&str]) -> Result<Self> {
        Self::start_with(dir, extra, |dir| {
            let hba = dir.join("data").join("pg_hba.conf");
            let mut text = std::fs::read_to_string(&hba).context("reading pg_hba.conf")?;
            for network in networks {
                let line = format!("host all all {network} trust");
                if !text.lines().any(|l| l.trim() == line) {
                    text = format!("{text}\n{line}\n");
                }
            }
            std::fs::write(&hba, text).context("writing pg_hba.conf")?;
            Ok(Vec::new())
        })
    }

    /// Starts a server with the `-c name=value` settings that `prepare` returns once it has
    /// seen the server's directory (the data directory is `dir/data`).
    pub(crate) fn start_with(
        dir: Option<&Path>,
        extra: &[IpAddr],
        prepare: impl FnOnce(&Path) -> Result<Vec<String>>,
    ) -> Result<Self> {
        Self::start_inner(dir, extra, Durability::Fast, prepare)
    }

    fn start_inner(
        dir: Option<&Path>,
        extra: &[IpAddr],
        durability: Durability,
        prepare: impl FnOnce(&Path) -> Result<Vec<String>>,
    ) -> Result<Self> {
        let bin = pg_bin_dir()?;
        let (temp, dir) = server_dir(dir, "dlock-pg-")?;
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
        Self {
            daemon: Daemon::new(
                "PostgreSQL",
                dir.join("postgres.log"),
                Signal::SIGINT,
                Duration::from_secs(15),
            ),
            port: free_port()?,
            durability,
            bin,
            dir,
            extra_listen: extra.to_vec(),
            settings,
            _temp: temp,
        }
        .started()
    }

    fn launch(&mut self) -> Result<()> {
        let data = self.dir.join("data");
        let socket_dir = self.dir.join("socket");
        std::fs::create_dir_all(&socket_dir)?;
        chown_for_postgres(&socket_dir)?;
        let listen = std::iter::once("127.0.0.1".to_owned())
            .chain(self.extra_listen.iter().map(IpAddr::to_string))
            .collect::<Vec<_>>()
            .join(",");
        let listen = format!("listen_addresses={listen}");
        let mut command = pg_command(&self.bin.join("postgres"));
        command
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
            ])
            .args(self.durability.settings().iter().flat_map(|s| ["-c", *s]))
            .args(self.settings.iter().flat_map(|s| ["-c", s.as_str()]));
        let port = self.port.to_string();
        let pg_isready = self.bin.join("pg_isready");
        self.daemon.launch(command, "is PostgreSQL installed?", || {
            Command::new(&pg_isready)
                .args(["-q", "-h", "127.0.0.1", "-p", &port, "-U", "postgres"])
                .status()
                .map(|s| s.success())
                .unwrap_or(false)
        })
    }

    pub fn url(&self, database: &str) -> String {
        format!("postgres://postgres@127.0.0.1:{}/{database}", self.port)
    }

    /// Runs one SQL statement with psql as the superuser.
    pub fn psql(&self, database: &str, sql: &str) -> Result<String> {
        let mut psql = Command::new(self.bin.join("psql"));
        psql.args([
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
        ])
        .args(["-c", sql]);
        Ok(run_output(psql, "psql", None)?.trim().to_owned())
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

    /// [`RawCommits`] over `seconds` with pgbench, in `database` (its table `raw_commit` is
    /// created when missing): the bound a service's commits are read against. Each connection
    /// updates rows of its own, in id order, so the figure is the cost of a commit, not of
    /// waiting for another connection's row locks.
    pub fn raw_commits(
        &self,
        database: &str,
        clients: usize,
        updates: usize,
        seconds: u64,
    ) -> Result<RawCommits> {
        self.psql(
            database,
            &format!(
                "CREATE TABLE IF NOT EXISTS raw_commit (id int PRIMARY KEY, fence bigint NOT NULL \
                 DEFAULT 0); INSERT INTO raw_commit (id) SELECT g FROM generate_series(0, {}) g \
                 ON CONFLICT DO NOTHING",
                clients * updates
            ),
        )?;
        let script = tempfile::NamedTempFile::new().context("creating the pgbench script")?;
        let mut text = String::from("BEGIN;\n");
        for j in 0..updates {
            text.push_str(&format!(
                "UPDATE raw_commit SET fence = fence + 1 WHERE id = :client_id * {updates} + {j} \
                 AND fence >= 0;\n"
            ));
        }
        text.push_str("COMMIT;\n");
        std::fs::write(script.path(), text).context("writing the pgbench script")?;
        let mut pgbench = Command::new(self.bin.join("pgbench"));
        pgbench
            .args(["-n", "-h", "127.0.0.1", "-p", &self.port.to_string()])
            .args(["-U", "postgres", "-c", &clients.to_string()])
            .args([
                "-j",
                &clients.min(2).to_string(),
                "-T",
                &seconds.to_string(),
            ])
            .arg("-f")
            .arg(script.path())
            .arg(database);
        let out = run_output(pgbench, "pgbench", None)?;
        let tps = out
            .lines()
            .find_map(|l| l.trim().strip_prefix("tps = "))
            .and_then(|rest| rest.split_whitespace().next())
            .and_then(|n| n.parse::<f64>().ok())
            .ok_or_else(|| anyhow!("pgbench printed no `tps = ` line: {out}"))?;
        Ok(RawCommits {
            clients,
            updates,
            commits_per_second: tps,
        })
    }

    /// Starts it again on the same port and data.
    pub fn restart(&mut self) -> Result<()> {
        self.stop();
        self.launch()
    }
}

daemon_server!(PgServer);
