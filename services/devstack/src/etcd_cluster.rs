//! A throwaway etcd cluster of one or more members on loopback, optionally serving its clients
//! over TLS with client-certificate authentication, as production etcd runs.
//!
//! Each member also serves `/health` and `/metrics` over plain HTTP on a port of its own
//! (`--listen-metrics-urls`), so readiness is awaited the same way with or without TLS. Peers
//! talk plain HTTP to each other on loopback.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use anyhow::{Context, Result};

use crate::certs::CertFiles;
use crate::{ManagedChild, etcd_bin, free_port, http_status, log_stdio, wait_until};

/// TLS on the members' client port.
#[derive(Debug, Clone)]
pub struct EtcdTls {
    /// The members' serving certificate (valid for 127.0.0.1).
    pub server: CertFiles,
    /// The CA that client certificates must chain to (`--trusted-ca-file`).
    pub client_ca_file: PathBuf,
}

/// One member: its ports and process.
pub struct EtcdMember {
    pub name: String,
    pub client_port: u16,
    peer_port: u16,
    health_port: u16,
    child: Option<ManagedChild>,
}

impl EtcdMember {
    /// Whether its process runs.
    pub fn running(&self) -> bool {
        self.child.is_some()
    }

    fn health(&self) -> SocketAddr {
        ([127, 0, 0, 1], self.health_port).into()
    }
}

/// A cluster of `n` members started together (`--initial-cluster-state new`).
pub struct EtcdCluster {
    pub members: Vec<EtcdMember>,
    tls: Option<EtcdTls>,
    dir: PathBuf,
    _temp: tempfile::TempDir,
}

impl EtcdCluster {
    /// Starts `n` members and waits until every one reports healthy (a leader is elected).
    pub fn start(n: usize, tls: Option<EtcdTls>) -> Result<Self> {
        let temp = tempfile::Builder::new()
            .prefix("dlock-etcd-cluster-")
            .tempdir()?;
        let mut members = Vec::with_capacity(n);
        for i in 0..n {
            members.push(EtcdMember {
                name: format!("member-{i}"),
                client_port: free_port()?,
                peer_port: free_port()?,
                health_port: free_port()?,
                child: None,
            });
        }
        let mut cluster = Self {
            members,
            tls,
            dir: temp.path().to_path_buf(),
            _temp: temp,
        };
        for i in 0..n {
            cluster.spawn(i)?;
        }
        for i in 0..n {
            cluster.wait_healthy(i)?;
        }
        Ok(cluster)
    }

    fn scheme(&self) -> &'static str {
        if self.tls.is_some() { "https" } else { "http" }
    }

    /// The client URL of member `i`.
    pub fn endpoint(&self, i: usize) -> String {
        format!(
            "{}://127.0.0.1:{}",
            self.scheme(),
            self.members[i].client_port
        )
    }

    /// Every member's client URL.
    pub fn endpoints(&self) -> Vec<String> {
        (0..self.members.len()).map(|i| self.endpoint(i)).collect()
    }

    /// The log file of member `i`.
    pub fn log(&self, i: usize) -> PathBuf {
        self.dir.join(format!("{}.log", self.members[i].name))
    }

    fn spawn(&mut self, i: usize) -> Result<()> {
        let initial = self
            .members
            .iter()
            .map(|m| format!("{}=http://127.0.0.1:{}", m.name, m.peer_port))
            .collect::<Vec<_>>()
            .join(",");
        let client = self.endpoint(i);
        let member = &self.members[i];
        let peer = format!("http://127.0.0.1:{}", member.peer_port);
        let health = format!("http://127.0.0.1:{}", member.health_port);
        let (stdout, stderr) = log_stdio(Some(&self.log(i)))?;
        let mut command = Command::new(etcd_bin());
        command
            .args(["--name", &member.name, "--data-dir"])
            .arg(self.dir.join(&member.name))
            .args(["--listen-client-urls", &client])
            .args(["--advertise-client-urls", &client])
            .args(["--listen-peer-urls", &peer])
            .args(["--initial-advertise-peer-urls", &peer])
            .args(["--listen-metrics-urls", &health])
            .args(["--initial-cluster", &initial])
            .args(["--initial-cluster-state", "new"])
            .args(["--initial-cluster-token", "dlock-test"])
            .args(["--logger", "zap", "--log-level", "warn"]);
        if let Some(tls) = &self.tls {
            command
                .arg("--cert-file")
                .arg(&tls.server.cert_file)
                .arg("--key-file")
                .arg(&tls.server.key_file)
                .arg("--trusted-ca-file")
                .arg(&tls.client_ca_file)
                .arg("--client-cert-auth");
        }
        let child = command
            .stdin(Stdio::null())
            .stdout(stdout)
            .stderr(stderr)
            .spawn()
            .context("starting etcd (install Debian's etcd-server, or set DLOCK_ETCD_BIN)")?;
        self.members[i].child = Some(ManagedChild::new(&member.name.clone(), child));
        Ok(())
    }

    fn wait_healthy(&self, i: usize) -> Result<()> {
        let health = self.members[i].health();
        wait_until(
            &format!("etcd {}", self.members[i].name),
            Duration::from_secs(30),
            || http_status(health, "/health") == Some(200),
        )
        .with_context(|| format!("see {}", self.log(i).display()))
    }

    /// Kills member `i` outright (SIGKILL, no leadership hand-over): a crash.
    pub fn kill(&mut self, i: usize) {
        if let Some(mut child) = self.members[i].child.take() {
            child.kill();
        }
    }

    /// Starts member `i` again on its ports and data, and waits until it is healthy.
    pub fn restart(&mut self, i: usize) -> Result<()> {
        if self.members[i].child.is_none() {
            self.spawn(i)?;
        }
        self.wait_healthy(i)
    }

    /// The data directory of the cluster (logs beside it).
    pub fn dir(&self) -> &Path {
        &self.dir
    }
}
