//! A throwaway single-member etcd on free loopback ports.

use crate::*;

/// A throwaway single-member etcd on free loopback ports.
pub struct EtcdServer {
    pub client_port: u16,
    peer_port: u16,
    /// Addresses its client port listens on besides 127.0.0.1.
    extra_listen: Vec<IpAddr>,
    dir: PathBuf,
    /// Declared before the directory guard: stopped before its data is removed.
    daemon: Daemon,
    _temp: Option<tempfile::TempDir>,
}

pub(crate) fn etcd_bin() -> PathBuf {
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
        let (temp, dir) = server_dir(dir, "dlock-etcd-")?;
        Self {
            daemon: Daemon::new(
                "etcd",
                dir.join("etcd.log"),
                Signal::SIGTERM,
                Duration::from_secs(10),
            ),
            client_port: free_port()?,
            peer_port: free_port()?,
            extra_listen: extra.to_vec(),
            dir,
            _temp: temp,
        }
        .started()
    }

    fn launch(&mut self) -> Result<()> {
        let client = std::iter::once(IpAddr::from([127, 0, 0, 1]))
            .chain(self.extra_listen.iter().copied())
            .map(|ip| format!("http://{}", SocketAddr::new(ip, self.client_port)))
            .collect::<Vec<_>>()
            .join(",");
        let peer = format!("http://127.0.0.1:{}", self.peer_port);
        let mut command = Command::new(etcd_bin());
        command
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
            .args(["--logger", "zap", "--log-level", "warn"]);
        let addr: SocketAddr = ([127, 0, 0, 1], self.client_port).into();
        self.daemon.launch(
            command,
            "install Debian's etcd-server, or set DLOCK_ETCD_BIN",
            || http_status(addr, "/health") == Some(200),
        )
    }

    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.client_port)
    }

    /// Copies the member's data directory to `to` (a backup, as an operator takes one of a
    /// stopped member). Refused while etcd runs: a running member's files are not a consistent
    /// copy.
    pub fn copy_data(&self, to: &Path) -> Result<()> {
        if self.daemon.running() {
            bail!("stop etcd before copying its data directory");
        }
        copy_tree(&self.dir.join("data"), to)
    }

    /// Puts `from` (a copy [`EtcdServer::copy_data`] made) back as the member's data directory:
    /// a restore to the revision of that copy. Start it again afterwards
    /// ([`EtcdServer::start_again`]).
    pub fn restore_data(&mut self, from: &Path) -> Result<()> {
        if self.daemon.running() {
            bail!("stop etcd before putting a data directory back");
        }
        let data = self.dir.join("data");
        std::fs::remove_dir_all(&data).with_context(|| format!("removing {}", data.display()))?;
        copy_tree(from, &data)
    }
}

/// Copies the directory `from` to `to` (created), files and subdirectories, keeping permissions.
fn copy_tree(from: &Path, to: &Path) -> Result<()> {
    std::fs::create_dir_all(to).with_context(|| format!("creating {}", to.display()))?;
    for entry in std::fs::read_dir(from).with_context(|| format!("reading {}", from.display()))? {
        let entry = entry?;
        let target = to.join(entry.file_name());
        if entry.file_type()?.is_dir() {
            copy_tree(&entry.path(), &target)?;
        } else {
            std::fs::copy(entry.path(), &target)
                .with_context(|| format!("copying {}", entry.path().display()))?;
        }
    }
    std::fs::set_permissions(to, std::fs::metadata(from)?.permissions())?;
    Ok(())
}

daemon_server!(EtcdServer);
