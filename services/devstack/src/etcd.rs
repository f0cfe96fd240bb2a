//! A throwaway single-member etcd on free loopback ports.

use crate::*;

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
