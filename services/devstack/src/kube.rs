//! A real Kubernetes control plane on loopback, for the Kubernetes end-to-end suite and for
//! `scripts/k8s-up`: etcd, kube-apiserver (RBAC and admission on), kube-controller-manager,
//! kube-scheduler and KWOK's controller, started by `kwokctl create cluster --runtime binary` with
//! the pinned binaries that `scripts/k8s-bin` builds from the Go module proxy.
//!
//! KWOK plays the kubelet of fake nodes: pods scheduled there become Running and Ready without a
//! container runtime. The stages in `e2e/k8s/kwok.yaml` leave the pods of Jobs alone, so that a
//! test can run them for real and report their phase itself.
//!
//! Each cluster lives in its own temporary work directory (`KWOK_WORKDIR`) under a unique name,
//! so several can run side by side; dropping the handle deletes the cluster and its processes.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Instant;

use anyhow::{Context, Result, bail};

/// The repository root, for `scripts/k8s-bin` and `e2e/k8s/kwok.yaml`.
fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The directory of the pinned binaries: `DLOCK_K8S_BIN` when set, else what `scripts/k8s-bin`
/// prints (it builds them on first use, which takes minutes, and answers at once afterwards).
pub fn binaries() -> Result<PathBuf> {
    if let Some(dir) = std::env::var_os("DLOCK_K8S_BIN") {
        return Ok(PathBuf::from(dir));
    }
    let script = repo_root().join("scripts/k8s-bin");
    let output = Command::new(&script)
        .stderr(Stdio::inherit())
        .output()
        .with_context(|| format!("running {}", script.display()))?;
    if !output.status.success() {
        bail!(
            "{} failed ({}); it builds the control plane from the Go module proxy and needs Go",
            script.display(),
            output.status
        );
    }
    let text = String::from_utf8_lossy(&output.stdout);
    let dir = text.lines().last().unwrap_or_default().trim();
    if dir.is_empty() {
        bail!("{} printed no directory", script.display());
    }
    Ok(PathBuf::from(dir))
}

/// A running control plane; dropped, it is deleted.
pub struct KubeCluster {
    name: String,
    bin: PathBuf,
    workdir: tempfile::TempDir,
    kubeconfig: PathBuf,
}

impl KubeCluster {
    /// Starts a cluster with `nodes` fake nodes and waits until the nodes are Ready.
    pub fn start(nodes: u32) -> Result<Self> {
        static SEQUENCE: AtomicU32 = AtomicU32::new(0);
        let bin = binaries()?;
        let workdir = tempfile::Builder::new()
            .prefix("dlock-kube-")
            .tempdir()
            .context("creating the cluster's work directory")?;
        let name = format!(
            "dlock-{}-{}",
            std::process::id(),
            SEQUENCE.fetch_add(1, Ordering::Relaxed)
        );
        let kubeconfig = workdir.path().join("kubeconfig");
        let cluster = Self {
            name,
            bin,
            workdir,
            kubeconfig,
        };
        let started = Instant::now();
        let stages = repo_root().join("e2e/k8s/kwok.yaml");
        let binary = |name: &str| cluster.bin.join(name).display().to_string();
        let create = [
            "create".to_owned(),
            "cluster".to_owned(),
            "--runtime=binary".to_owned(),
            format!("--kube-apiserver-binary={}", binary("kube-apiserver")),
            format!(
                "--kube-controller-manager-binary={}",
                binary("kube-controller-manager")
            ),
            format!("--kube-scheduler-binary={}", binary("kube-scheduler")),
            format!("--etcd-binary={}", binary("etcd")),
            format!("--kwok-controller-binary={}", binary("kwok")),
            format!("--config={}", stages.display()),
            format!("--kubeconfig={}", cluster.kubeconfig.display()),
            "--kube-authorization=true".to_owned(),
            "--kube-admission=true".to_owned(),
            "--wait=120s".to_owned(),
        ];
        cluster.kwokctl(&create)?;
        cluster.kwokctl(&[
            "scale".to_owned(),
            "node".to_owned(),
            format!("--replicas={nodes}"),
        ])?;
        cluster.kubectl(&[
            "wait",
            "--for=condition=Ready",
            "node",
            "--all",
            "--timeout=120s",
        ])?;
        tracing::info!(
            event = "kube_cluster_ready",
            name = %cluster.name,
            ms = started.elapsed().as_millis() as u64
        );
        Ok(cluster)
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// The admin kubeconfig (RBAC's `system:masters`).
    pub fn kubeconfig(&self) -> &Path {
        &self.kubeconfig
    }

    /// A directory for the test's own files, removed with the cluster.
    pub fn dir(&self) -> &Path {
        self.workdir.path()
    }

    /// Where the component logs are, for a failing test's message.
    pub fn logs_dir(&self) -> PathBuf {
        self.workdir
            .path()
            .join("clusters")
            .join(&self.name)
            .join("logs")
    }

    fn kwokctl(&self, args: &[String]) -> Result<String> {
        let output = Command::new(self.bin.join("kwokctl"))
            .arg(format!("--name={}", self.name))
            .args(args)
            .env("KWOK_WORKDIR", self.workdir.path())
            .stdin(Stdio::null())
            .output()
            .with_context(|| format!("running kwokctl {}", args.join(" ")))?;
        if !output.status.success() {
            bail!(
                "kwokctl {} failed ({}):\n{}{}",
                args.join(" "),
                output.status,
                String::from_utf8_lossy(&output.stdout),
                String::from_utf8_lossy(&output.stderr)
            );
        }
        Ok(String::from_utf8_lossy(&output.stdout).into_owned())
    }

    /// `kubectl ARGS` as the admin; its stdout, or an error with its stderr.
    pub fn kubectl(&self, args: &[&str]) -> Result<String> {
        self.kubectl_with_input(args, None)
    }

    /// `kubectl ARGS` with `input` on stdin (`-f -`).
    pub fn kubectl_with_input(&self, args: &[&str], input: Option<&str>) -> Result<String> {
        kubectl(&self.bin.join("kubectl"), &self.kubeconfig, args, input)
    }

    /// The pinned kubectl, of the API server's own version.
    pub fn kubectl_path(&self) -> PathBuf {
        self.bin.join("kubectl")
    }
}

/// `KUBECTL --kubeconfig KUBECONFIG ARGS`, with `input` on stdin.
pub fn kubectl(
    program: &Path,
    kubeconfig: &Path,
    args: &[&str],
    input: Option<&str>,
) -> Result<String> {
    let mut command = Command::new(program);
    command
        .arg(format!("--kubeconfig={}", kubeconfig.display()))
        .args(args);
    crate::run_output(command, &format!("kubectl {}", args.join(" ")), input)
}

impl Drop for KubeCluster {
    fn drop(&mut self) {
        if let Err(e) = self.kwokctl(&["delete".to_owned(), "cluster".to_owned()]) {
            tracing::warn!(event = "kube_cluster_delete_failed", name = %self.name, error = %e);
        }
    }
}
