//! A cluster with a real node (`scripts/k8s-up --real-node`): the control plane of the other
//! tests, and one node where the kubelet runs pods in containerd with runc, kube-proxy programs
//! Services and CoreDNS answers for cluster.local (scripts/real-node). Nothing here is faked:
//! pods start from the `dlock` image built from this test binary's `dlock` (scripts/image) and
//! imported into the node's containerd, probes are the kubelet's, DNS and Service addresses are
//! the cluster's, and PostgreSQL, the one part the operator never deploys, runs on the machine
//! behind a Service of the namespace (`postgres:5432`, as examples/stack.yaml expects).

use std::io::{BufRead, BufReader};
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use dlock_devstack::PgServer;
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use serde_json::Value;

use crate::shared::process::succeeded;
use crate::world::{EXE, repo};

/// The pods' network on the real node (scripts/real-node).
const POD_CIDR: &str = "10.244.0.0/16";

/// The chart's image name at its appVersion: what `helm install` deploys without `--set image`.
fn chart_image() -> String {
    let read = |file: &str| -> serde_yaml_ng::Value {
        let path = repo().join("charts/dlock").join(file);
        let text =
            std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        serde_yaml_ng::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
    };
    let (chart, values) = (read("Chart.yaml"), read("values.yaml"));
    let app_version = chart["appVersion"].as_str();
    let repository = values["image"]["repository"].as_str();
    match (repository, app_version) {
        (Some(repository), Some(version)) => format!("{repository}:{version}"),
        _ => panic!("charts/dlock names no image.repository or appVersion"),
    }
}

pub struct RealCluster {
    pub dir: tempfile::TempDir,
    pub kubeconfig: PathBuf,
    /// `PATH` with the pinned kubectl and helm first.
    path: String,
    /// The node's address: the API server's, the kubelet's, CoreDNS's and PostgreSQL's.
    pub node_ip: IpAddr,
    up: Option<Child>,
    up_log: PathBuf,
    pg: Option<PgServer>,
}

impl RealCluster {
    /// Builds the image, starts the control plane and the real node, and PostgreSQL for pods.
    pub fn start() -> Self {
        let started = Instant::now();
        let dir = tempfile::Builder::new()
            .prefix("dlock-real-node-")
            .tempdir()
            .unwrap_or_else(|e| panic!("{e}"));
        let archive = dir.path().join("dlock.oci.tar");
        let image = Command::new(repo().join("scripts/image"))
            .args(["--binary", EXE, "--tag", &chart_image(), "--out"])
            .arg(&archive)
            .stdout(Stdio::null())
            .output()
            .unwrap_or_else(|e| panic!("scripts/image: {e}"));
        succeeded(&image, "scripts/image failed");
        let up_log = dir.path().join("k8s-up.log");
        let log = std::fs::File::create(&up_log).unwrap_or_else(|e| panic!("{e}"));
        let mut up = Command::new(repo().join("scripts/k8s-up"))
            .args(["--real-node", "--image"])
            .arg(&archive)
            .stdout(Stdio::piped())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("scripts/k8s-up: {e}"));
        // The one line on stdout: `export KUBECONFIG=<path> PATH=<bin>:$PATH`, once Ready.
        let stdout = up.stdout.take().unwrap_or_else(|| panic!("no stdout"));
        let line = BufReader::new(stdout).lines().next();
        let Some(Ok(line)) = line else {
            let log = std::fs::read_to_string(&up_log).unwrap_or_default();
            panic!("scripts/k8s-up --real-node did not come up:\n{log}");
        };
        let (kubeconfig, bin) = line
            .strip_prefix("export KUBECONFIG=")
            .and_then(|rest| rest.split_once(" PATH="))
            .map(|(k, p)| (PathBuf::from(k), p.trim_end_matches(":$PATH").to_owned()))
            .unwrap_or_else(|| panic!("scripts/k8s-up printed {line:?}"));
        let node_bin = Command::new(repo().join("scripts/k8s-bin"))
            .args(["--node", "--cached"])
            .output()
            .unwrap_or_else(|e| panic!("{e}"));
        let node_bin = String::from_utf8_lossy(&node_bin.stdout).trim().to_owned();
        let path = format!(
            "{bin}:{node_bin}:{}",
            std::env::var("PATH").unwrap_or_default()
        );
        let mut cluster = Self {
            dir,
            kubeconfig,
            path,
            node_ip: IpAddr::from([127, 0, 0, 1]),
            up: Some(up),
            up_log,
            pg: None,
        };
        let ip = cluster.kubectl(&[
            "get",
            "node",
            "dlock-node",
            "-o",
            "jsonpath={.status.addresses[?(@.type==\"InternalIP\")].address}",
        ]);
        cluster.node_ip = ip
            .trim()
            .parse()
            .unwrap_or_else(|e| panic!("the node's address {ip:?}: {e}"));
        let pg = PgServer::start_trusting(None, &[cluster.node_ip], &[POD_CIDR])
            .unwrap_or_else(|e| panic!("PostgreSQL: {e:#}"));
        for sql in [
            "CREATE ROLE dlock LOGIN PASSWORD 'dlock'",
            "CREATE DATABASE lockdb OWNER dlock",
            "CREATE DATABASE paydb OWNER dlock",
        ] {
            pg.psql("postgres", sql)
                .unwrap_or_else(|e| panic!("{sql}: {e:#}"));
        }
        cluster.pg = Some(pg);
        eprintln!(
            "real node up in {} ms (control plane, node, image, PostgreSQL)",
            started.elapsed().as_millis()
        );
        cluster
    }

    /// PostgreSQL on the machine, as `postgres` SQL.
    pub fn psql(&self, database: &str, sql: &str) -> String {
        self.pg
            .as_ref()
            .unwrap_or_else(|| panic!("no PostgreSQL"))
            .psql(database, sql)
            .unwrap_or_else(|e| panic!("{sql}: {e:#}"))
    }

    /// The Service `postgres` of `namespace`: port 5432 to PostgreSQL on the machine.
    pub fn postgres_service(&self, namespace: &str) {
        let port = self.pg.as_ref().map(|pg| pg.port).unwrap_or_default();
        let yaml = format!(
            "apiVersion: v1\nkind: Service\nmetadata: {{name: postgres, namespace: {namespace}}}\n\
             spec:\n  ports: [{{port: 5432, targetPort: {port}, protocol: TCP}}]\n---\n\
             apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  \
             name: postgres-machine\n  namespace: {namespace}\n  \
             labels: {{kubernetes.io/service-name: postgres}}\naddressType: IPv4\n\
             ports: [{{port: {port}, protocol: TCP}}]\nendpoints: [{{addresses: [\"{}\"]}}]\n",
            self.node_ip
        );
        self.apply_stdin(&yaml);
    }

    fn command(&self, program: &str, args: &[&str]) -> Command {
        let mut command = Command::new(program);
        command
            .args(args)
            .env("KUBECONFIG", &self.kubeconfig)
            .env("PATH", &self.path);
        command
    }

    /// `kubectl ARGS` as a command to run later (from another thread, say).
    pub fn kubectl_command(&self, args: &[&str]) -> Command {
        self.command("kubectl", args)
    }

    /// `kubectl ARGS`, or its error.
    pub fn try_kubectl(&self, args: &[&str]) -> Result<String, String> {
        run(self.command("kubectl", args))
    }

    /// `kubectl ARGS`; panics with kubectl's message on failure.
    pub fn kubectl(&self, args: &[&str]) -> String {
        self.try_kubectl(args)
            .unwrap_or_else(|e| panic!("kubectl {}: {e}{}", args.join(" "), self.diagnostics()))
    }

    /// `kubectl get ARGS -o json`.
    pub fn get_json(&self, args: &[&str]) -> Value {
        let mut all = vec!["get"];
        all.extend(args);
        all.extend(["-o", "json"]);
        serde_json::from_str(&self.kubectl(&all)).unwrap_or_else(|e| panic!("{e}"))
    }

    /// `helm ARGS`; panics with helm's message on failure.
    pub fn helm(&self, args: &[&str]) -> String {
        run(self.command("helm", args))
            .unwrap_or_else(|e| panic!("helm {}: {e}{}", args.join(" "), self.diagnostics()))
    }

    /// `kubectl apply -f -` of `yaml`.
    pub fn apply_stdin(&self, yaml: &str) -> String {
        let path = self
            .dir
            .path()
            .join(format!("apply-{}.yaml", std::process::id()));
        std::fs::write(&path, yaml).unwrap_or_else(|e| panic!("{e}"));
        self.kubectl(&["apply", "-f", &path.display().to_string()])
    }

    /// The address of Service `name` in `namespace`, reachable from the machine (kube-proxy
    /// programs the machine's own connections too).
    pub fn service_url(&self, namespace: &str, name: &str) -> String {
        let ip = self.try_cluster_ip(namespace, name).unwrap_or_else(|e| {
            panic!(
                "kubectl get service {name} -n {namespace}: {e}{}",
                self.diagnostics()
            )
        });
        format!("http://{ip}:8080")
    }

    /// The cluster IP of Service `name` in `namespace` (empty while it has none), or kubectl's
    /// error.
    pub fn try_cluster_ip(&self, namespace: &str, name: &str) -> Result<String, String> {
        let ip = self.try_kubectl(&[
            "get",
            "service",
            name,
            "-n",
            namespace,
            "-o",
            "jsonpath={.spec.clusterIP}",
        ])?;
        Ok(ip.trim().to_owned())
    }

    /// The node's containerd, as `ctr -n k8s.io ARGS`.
    pub fn ctr(&self, args: &[&str]) -> String {
        let socket = self
            .kubeconfig
            .parent()
            .unwrap_or_else(|| Path::new("/"))
            .join("node/containerd/containerd.sock");
        let mut all = vec![
            "--address",
            socket.to_str().unwrap_or_default(),
            "-n",
            "k8s.io",
        ];
        all.extend(args);
        run(self.command("ctr", &all)).unwrap_or_else(|e| panic!("ctr {}: {e}", args.join(" ")))
    }

    /// What a failing test prints: pods, events, and the node's logs' tails.
    pub fn diagnostics(&self) -> String {
        let mut text = String::from("\n--- pods ---\n");
        text += &self
            .try_kubectl(&["get", "pods", "-A", "-o", "wide"])
            .unwrap_or_else(|e| e);
        // Why a container that is not ready stopped: its last run's log.
        let pods = self
            .try_kubectl(&[
                "get",
                "pods",
                "-A",
                "-o",
                "jsonpath={range .items[*]}{.metadata.namespace} {.metadata.name} {.status.containerStatuses[0].ready} {.status.containerStatuses[0].restartCount}{\"\\n\"}{end}",
            ])
            .unwrap_or_default();
        for line in pods.lines().take(12) {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let [ns, pod, ready, restarts] = fields[..] else {
                continue;
            };
            if ready == "true" {
                continue;
            }
            let previous = if restarts == "0" {
                "--previous=false"
            } else {
                "--previous"
            };
            text +=
                &format!("\n--- {ns}/{pod} (not ready, {restarts} restarts): last log lines ---\n");
            text += &self
                .try_kubectl(&["logs", "-n", ns, pod, previous, "--tail=15"])
                .unwrap_or_else(|e| e);
        }
        text += "\n--- node conditions and taints ---\n";
        text += &self
            .try_kubectl(&[
                "get",
                "nodes",
                "-o",
                "jsonpath={range .items[*]}{.metadata.name}: {range .status.conditions[*]}{.type}={.status} {end}taints={.spec.taints}{\"\\n\"}{end}",
            ])
            .unwrap_or_else(|e| e);
        text += "\n--- events ---\n";
        text += &self
            .try_kubectl(&["get", "events", "-A", "--sort-by=.lastTimestamp"])
            .unwrap_or_else(|e| e);
        let logs = self
            .kubeconfig
            .parent()
            .unwrap_or_else(|| Path::new("/"))
            .join("node/logs");
        for name in ["kubelet", "containerd", "kube-proxy", "coredns"] {
            let log = std::fs::read_to_string(logs.join(format!("{name}.log"))).unwrap_or_default();
            let evictions: Vec<&str> = log
                .lines()
                .filter(|l| l.contains("eviction"))
                .take(10)
                .collect();
            if !evictions.is_empty() {
                text += &format!(
                    "\n--- {name}: eviction lines ---\n{}\n",
                    evictions.join("\n")
                );
            }
            let tail: Vec<&str> = log.lines().rev().take(15).collect();
            text += &format!("\n--- {name} (last lines) ---\n");
            for line in tail.into_iter().rev() {
                text += line;
                text.push('\n');
            }
        }
        text += &format!("\n--- scripts/k8s-up: {} ---\n", self.up_log.display());
        text
    }
}

impl Drop for RealCluster {
    fn drop(&mut self) {
        if let Some(mut up) = self.up.take() {
            // scripts/k8s-up stops the node (every container, mount and table) and the cluster.
            let _ = kill(Pid::from_raw(up.id() as i32), Signal::SIGTERM);
            let deadline = Instant::now() + Duration::from_secs(120);
            while Instant::now() < deadline {
                if let Ok(Some(_)) = up.try_wait() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
            let _ = up.kill();
            let _ = up.wait();
        }
    }
}

fn run(mut command: Command) -> Result<String, String> {
    let out = command.output().map_err(|e| e.to_string())?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ))
    }
}
