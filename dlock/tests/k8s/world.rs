//! One test's world: a real control plane (its own, so tests never share cluster-scoped state),
//! dlock's CRDs and the Helm chart applied with server-side apply, and on demand the real
//! services (`dlock dev up`), the operator as a separate process under the chart's RBAC, and the
//! kubelet that runs the pods of Jobs.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use dlock_devstack::kube::KubeCluster;
use dlock_devstack::{ManagedChild, free_port, spawn_logged, wait_until};
use serde_json::Value;

use crate::kubelet::Kubelet;
use crate::shared::process::wait_serving;

pub const EXE: &str = env!("CARGO_BIN_EXE_dlock");
/// Where the chart is installed, as in the README (`helm install … -n dlock-system`).
pub const OPERATOR_NAMESPACE: &str = "dlock-system";
/// The chart's ServiceAccount for release `dlock`.
pub const OPERATOR_ACCOUNT: &str = "dlock-operator";
/// The in-cluster port of every dlock Service.
pub const SERVICE_PORT: u16 = 8080;

pub fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// `dlock args…` with `env` as a process named `name`, its output in `log`, once it answers
/// `path` with 200 on 127.0.0.1:`port` (within `timeout`; it panics with the log if the process
/// exits or never does).
pub fn spawn_serving(
    name: &str,
    args: &[String],
    env: &[(String, String)],
    log: &Path,
    (port, path): (u16, &str),
    timeout: Duration,
) -> ManagedChild {
    let mut child = spawn_logged(name, Path::new(EXE), args, env, Some(log))
        .unwrap_or_else(|e| panic!("{e:#}"));
    wait_serving(
        name,
        &mut child,
        ([127, 0, 0, 1], port).into(),
        path,
        timeout,
        log,
    );
    child
}

/// `dlock serve <service>` on `config`, written to `<dir>/<service>.toml`, once it is ready on
/// 127.0.0.1:`port` (within `timeout`): the process, named `name`, and its log
/// (`<dir>/<service>.log`).
pub fn serve(
    name: &str,
    service: &str,
    dir: &Path,
    config: &str,
    port: u16,
    timeout: Duration,
) -> (ManagedChild, PathBuf) {
    let config_path = dir.join(format!("{service}.toml"));
    std::fs::write(&config_path, config).unwrap_or_else(|e| panic!("{e}"));
    let log = dir.join(format!("{service}.log"));
    let args = [
        "serve".to_owned(),
        service.to_owned(),
        "--config".to_owned(),
        config_path.display().to_string(),
    ];
    let child = spawn_serving(name, &args, &[], &log, (port, "/readyz"), timeout);
    (child, log)
}

/// examples/payoutbatch.yaml for the services of `dlock dev up` (a tokens file): its executor
/// presents the Secret `executor-credential` as `executor`, the form the example's comment gives,
/// where the example itself uses a ServiceAccount's projected token (TokenReview).
/// `yaml` (examples/stack.yaml) without its `tls: {secretName: …}` lines: plain HTTP.
pub fn without_tls(yaml: &str) -> String {
    let kept: Vec<&str> = yaml
        .lines()
        .filter(|line| !line.trim_start().starts_with("tls: {secretName:"))
        .collect();
    assert!(
        kept.len() < yaml.lines().count(),
        "examples/stack.yaml has no `tls: {{secretName: …}}` line any more"
    );
    kept.join("\n") + "\n"
}

pub fn example_batch_with_executor_credential() -> String {
    let example = std::fs::read_to_string(repo().join("examples/payoutbatch.yaml"))
        .unwrap_or_else(|e| panic!("{e}"));
    let token_review = "  executor:\n    serviceAccountName: dlock-executor\n";
    assert!(
        example.contains(token_review),
        "examples/payoutbatch.yaml no longer names its executor's ServiceAccount as {token_review:?}"
    );
    example.replace(
        token_review,
        "  executor:\n    identity: executor\n    credentialSecret:\n      \
         name: executor-credential\n      key: token\n",
    )
}

/// `dlock dev up` as a process: the four services, PostgreSQL, authentication on.
pub use crate::shared::dev_up::DevUp as DevStack;

impl DevStack {
    /// A client of the lock server with the executor identity's credential, calling as
    /// `executor/e2e`.
    pub fn executor_locks(&self) -> dlock_contract::client::LockClient {
        dlock_contract::client::LockClient::new(&self.url("lockServer"), "executor/e2e")
            .unwrap_or_else(|e| panic!("{e}"))
            .with_credential(Some(dlock_contract::auth::Credential::fixed(
                &self.token("executor"),
            )))
    }
}

pub struct World {
    pub cluster: KubeCluster,
    pub client: kube::Client,
    pub started: Instant,
    stack: Option<DevStack>,
    operators: Vec<ManagedChild>,
    kubelet: Option<Kubelet>,
}

impl World {
    /// A cluster with two fake nodes, the CRDs established and the chart applied.
    pub async fn start() -> Self {
        let started = Instant::now();
        let cluster = tokio::task::spawn_blocking(|| KubeCluster::start(2))
            .await
            .unwrap_or_else(|e| panic!("{e}"))
            .unwrap_or_else(|e| panic!("the control plane did not start: {e:#}"));
        eprintln!(
            "control plane {} up in {} ms",
            cluster.name(),
            started.elapsed().as_millis()
        );
        let kubeconfig = kube::config::Kubeconfig::read_from(cluster.kubeconfig())
            .unwrap_or_else(|e| panic!("{e}"));
        let config = kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default())
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        let client = kube::Client::try_from(config).unwrap_or_else(|e| panic!("{e}"));
        let world = Self {
            cluster,
            client,
            started,
            stack: None,
            operators: Vec::new(),
            kubelet: None,
        };
        let crds = repo().join("crds");
        world.kubectl(&[
            "apply",
            "--server-side",
            "--field-manager=dlock-e2e",
            "-f",
            &crds.display().to_string(),
        ]);
        world.kubectl(&[
            "wait",
            "--for=condition=Established",
            "crd",
            "--all",
            "--timeout=60s",
        ]);
        world.namespace(OPERATOR_NAMESPACE);
        let rendered = render_chart(&[]);
        world
            .apply(OPERATOR_NAMESPACE, &rendered)
            .unwrap_or_else(|e| panic!("the rendered chart was refused: {e}"));
        world
    }

    /// [`World::start`] with the namespace `ns` created.
    pub async fn with_namespace(ns: &str) -> Self {
        let world = Self::start().await;
        world.namespace(ns);
        world
    }

    /// [`World::with_namespace`], the services started with `dlock dev up ARGS` and an operator
    /// watching the namespace.
    pub async fn with_operator(ns: &str, args: &[&str]) -> Self {
        let mut world = Self::with_namespace(ns).await;
        world.start_services(args);
        world.start_operator(&[ns], &[]);
        world
    }

    /// `kubectl ARGS` as the admin; panics with kubectl's message on failure.
    pub fn kubectl(&self, args: &[&str]) -> String {
        self.cluster
            .kubectl(args)
            .unwrap_or_else(|e| panic!("{e:#}"))
    }

    pub fn try_kubectl(&self, args: &[&str]) -> anyhow::Result<String> {
        self.cluster.kubectl(args)
    }

    /// `kubectl get … -o json`, parsed.
    pub fn get_json(&self, args: &[&str]) -> Value {
        let mut all = vec!["get"];
        all.extend_from_slice(args);
        all.extend_from_slice(&["-o", "json"]);
        let text = self.kubectl(&all);
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"))
    }

    /// Server-side apply of a YAML stream into `namespace`.
    pub fn apply(&self, namespace: &str, yaml: &str) -> anyhow::Result<String> {
        self.cluster.kubectl_with_input(
            &[
                "apply",
                "--server-side",
                "--field-manager=dlock-e2e",
                "-n",
                namespace,
                "-f",
                "-",
            ],
            Some(yaml),
        )
    }

    /// `kubectl apply -f examples/stack.yaml` into `namespace` (the three services and their
    /// Secrets, as a user applies them), without its `spec.tls`: the services these scenarios
    /// call are the dev stack's processes on plain HTTP (`DLOCK_SERVICE_ADDRESSES`), not the
    /// operator's pods. TLS between the pods is tried on a real node (tls_pods.rs).
    pub fn apply_stack(&self, namespace: &str) {
        let stack = std::fs::read_to_string(repo().join("examples/stack.yaml"))
            .unwrap_or_else(|e| panic!("{e}"));
        let stack = without_tls(&stack);
        self.apply(namespace, &stack)
            .unwrap_or_else(|e| panic!("examples/stack.yaml: {e:#}"));
    }

    /// `apply_stack`, then waits until the LockServer is Ready (diagnostics on failure).
    pub fn apply_stack_ready(&self, namespace: &str) {
        self.apply_stack(namespace);
        self.wait_ready("lockserver/lock-server", namespace, "120s");
    }

    pub fn namespace(&self, name: &str) {
        let yaml = format!("apiVersion: v1\nkind: Namespace\nmetadata:\n  name: {name}\n");
        self.cluster
            .kubectl_with_input(
                &[
                    "apply",
                    "--server-side",
                    "--field-manager=dlock-e2e",
                    "-f",
                    "-",
                ],
                Some(&yaml),
            )
            .unwrap_or_else(|e| panic!("namespace {name}: {e:#}"));
    }

    /// The real services, started once (with `dlock dev up`'s defaults unless
    /// `start_services` came first).
    pub fn services(&mut self) -> &DevStack {
        if self.stack.is_none() {
            self.stack = Some(DevStack::start(&[], &[]));
        }
        self.stack.as_ref().unwrap_or_else(|| unreachable!())
    }

    /// The real services with `dlock dev up` options (`--rail-latency-ms 1500`, …).
    pub fn start_services(&mut self, args: &[&str]) -> &DevStack {
        assert!(self.stack.is_none(), "the services are already running");
        self.stack = Some(DevStack::start(args, &[]));
        self.stack.as_ref().unwrap_or_else(|| unreachable!())
    }

    /// The address map that stands in for cluster DNS: each namespace's Services, by the names
    /// the operator gives them, to the real processes.
    pub fn service_addresses(&mut self, namespaces: &[&str]) -> String {
        let stack = self.services();
        let mut entries = Vec::new();
        for ns in namespaces {
            for (service, key) in [
                ("lock-server", "lockServer"),
                ("payment-resource", "paymentResource"),
                ("rail-proxy", "railProxy"),
                ("rail-proxy-stub", "railStub"),
            ] {
                let authority = stack.url(key).trim_start_matches("http://").to_owned();
                entries.push(format!("{service}.{ns}.svc:{SERVICE_PORT}={authority}"));
            }
        }
        entries.join(",")
    }

    /// A kubeconfig that authenticates as the chart's ServiceAccount, with a token from the
    /// TokenRequest API: the operator gets exactly the chart's RBAC, never cluster-admin.
    pub fn operator_kubeconfig(&self) -> PathBuf {
        self.service_account_kubeconfig(
            OPERATOR_NAMESPACE,
            OPERATOR_ACCOUNT,
            &format!("operator-{}.kubeconfig", self.operators.len()),
        )
    }

    /// A kubeconfig (written to `file` in the cluster's directory) that authenticates as the
    /// ServiceAccount `account` of `namespace`, with a token from the TokenRequest API.
    pub fn service_account_kubeconfig(
        &self,
        namespace: &str,
        account: &str,
        file: &str,
    ) -> PathBuf {
        let token = self
            .kubectl(&["create", "token", account, "-n", namespace, "--duration=2h"])
            .trim()
            .to_owned();
        let view: Value = serde_json::from_str(
            &self.kubectl(&["config", "view", "--raw", "--minify", "-o", "json"]),
        )
        .unwrap_or_else(|e| panic!("{e}"));
        let cluster = &view["clusters"][0]["cluster"];
        let server = cluster["server"].as_str().unwrap_or_default();
        let mut cluster_yaml = format!("    server: {server}\n");
        if let Some(ca) = cluster["certificate-authority-data"].as_str() {
            cluster_yaml.push_str(&format!("    certificate-authority-data: {ca}\n"));
        } else if let Some(ca) = cluster["certificate-authority"].as_str() {
            cluster_yaml.push_str(&format!("    certificate-authority: {ca}\n"));
        } else if cluster["insecure-skip-tls-verify"].as_bool() == Some(true) {
            cluster_yaml.push_str("    insecure-skip-tls-verify: true\n");
        }
        let text = format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: e2e\n  cluster:\n{cluster_yaml}\
             users:\n- name: operator\n  user:\n    token: {token}\n\
             contexts:\n- name: operator\n  context: {{cluster: e2e, user: operator}}\n\
             current-context: operator\n"
        );
        let path = self.cluster.dir().join(file);
        std::fs::write(&path, text).unwrap_or_else(|e| panic!("{e}"));
        path
    }

    /// `dlock operator` as a process with the chart's RBAC; returns its index and metrics port.
    pub fn start_operator(&mut self, namespaces: &[&str], extra: &[(&str, &str)]) -> (usize, u16) {
        let addresses = self.service_addresses(namespaces);
        let operator_token = self.services().token("operator");
        let kubeconfig = self.operator_kubeconfig();
        let port = free_port().unwrap_or_else(|e| panic!("{e}"));
        let index = self.operators.len();
        let mut env: Vec<(String, String)> = vec![
            ("KUBECONFIG".into(), kubeconfig.display().to_string()),
            ("POD_NAMESPACE".into(), OPERATOR_NAMESPACE.into()),
            ("POD_NAME".into(), format!("dlock-operator-{index}")),
            ("DLOCK_OPERATOR_LISTEN".into(), format!("127.0.0.1:{port}")),
            ("DLOCK_OPERATOR_IMAGE".into(), "dlock:e2e".into()),
            ("DLOCK_OPERATOR_TOKEN".into(), operator_token),
            ("DLOCK_SERVICE_ADDRESSES".into(), addresses),
            ("DLOCK_LOG".into(), "info".into()),
        ];
        env.extend(
            extra
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned())),
        );
        let log = self.cluster.dir().join(format!("operator-{index}.log"));
        let child = spawn_serving(
            "operator",
            &["operator".to_owned()],
            &env,
            &log,
            (port, "/healthz"),
            Duration::from_secs(30),
        );
        self.operators.push(child);
        (index, port)
    }

    /// Stops operator `index` with SIGTERM (a graceful shutdown, as a pod deletion would).
    pub fn stop_operator(&mut self, index: usize) {
        self.operators[index].stop_with(
            dlock_devstack::Signal::SIGTERM,
            std::time::Duration::from_secs(20),
        );
    }

    /// Sends `signal` to operator `index` (SIGKILL: a crash that releases nothing).
    pub fn operator_signal(
        &self,
        index: usize,
        signal: dlock_devstack::Signal,
    ) -> anyhow::Result<()> {
        self.operators[index].signal(signal)
    }

    pub fn operator_log(&self, index: usize) -> String {
        std::fs::read_to_string(self.cluster.dir().join(format!("operator-{index}.log")))
            .unwrap_or_default()
    }

    /// Runs the pods of Jobs in `namespaces` (see kubelet.rs).
    pub fn start_kubelet(&mut self, namespaces: &[&str]) -> &Kubelet {
        let addresses = self.service_addresses(namespaces);
        let dir = self.cluster.dir().join("kubelet");
        let kubelet = Kubelet::start(
            self.client.clone(),
            PathBuf::from(EXE),
            vec![("DLOCK_SERVICE_ADDRESSES".to_owned(), addresses)],
            dir,
        );
        self.kubelet = Some(kubelet);
        self.kubelet.as_ref().unwrap_or_else(|| unreachable!())
    }

    pub fn kubelet(&self) -> &Kubelet {
        self.kubelet
            .as_ref()
            .unwrap_or_else(|| panic!("start_kubelet first"))
    }

    /// Everything a failing scenario's reader needs: the operator logs and the cluster's events.
    pub fn diagnostics(&self) -> String {
        let mut text = String::new();
        for index in 0..self.operators.len() {
            text.push_str(&format!(
                "\n--- operator {index} ---\n{}",
                self.operator_log(index)
            ));
        }
        if let Some(kubelet) = &self.kubelet {
            for ran in kubelet.ran() {
                text.push_str(&format!(
                    "\n--- pod {}/{} (exit {:?}) ---\n{}",
                    ran.namespace,
                    ran.pod,
                    ran.exit_code,
                    std::fs::read_to_string(&ran.log).unwrap_or_default()
                ));
            }
        }
        if let Ok(events) = self.try_kubectl(&["get", "events", "-A"]) {
            text.push_str(&format!("\n--- events ---\n{events}"));
        }
        text.push_str(&format!(
            "\n--- control plane logs: {} ---\n",
            self.cluster.logs_dir().display()
        ));
        text
    }

    /// Waits up to `timeout` until `done` holds; panics with the diagnostics if it never does.
    pub fn wait_until(&self, what: &str, timeout: Duration, done: impl FnMut() -> bool) {
        wait_until(what, timeout, done).unwrap_or_else(|e| panic!("{e:#}{}", self.diagnostics()));
    }

    /// Waits up to `timeout` until `kubectl ARGS` succeeds with an output of which `done`
    /// holds; panics with the diagnostics if it never does.
    pub fn wait_kubectl(
        &self,
        what: &str,
        timeout: Duration,
        args: &[&str],
        done: impl Fn(&str) -> bool,
    ) {
        self.wait_until(what, timeout, || {
            self.try_kubectl(args).is_ok_and(|out| done(&out))
        });
    }

    /// Reads with `read` until `done` holds of the reading (at most `timeout`) and returns that
    /// reading; panics with the last one and the diagnostics if it never comes.
    pub fn wait_for(
        &self,
        what: &str,
        timeout: Duration,
        mut read: impl FnMut() -> Value,
        done: impl Fn(&Value) -> bool,
    ) -> Value {
        let mut last = Value::Null;
        wait_until(what, timeout, || {
            last = read();
            done(&last)
        })
        .unwrap_or_else(|e| panic!("{e:#}: {last}{}", self.diagnostics()));
        last
    }

    /// `kubectl wait --for=condition=Ready RESOURCE -n NAMESPACE --timeout=TIMEOUT`; panics
    /// with the diagnostics if it is not Ready by then.
    pub fn wait_ready(&self, resource: &str, namespace: &str, timeout: &str) {
        if let Err(e) = self.try_kubectl(&[
            "wait",
            "--for=condition=Ready",
            resource,
            "-n",
            namespace,
            &format!("--timeout={timeout}"),
        ]) {
            panic!("{e:#}{}", self.diagnostics());
        }
    }

    /// Milliseconds since the control plane was started, for the line a scenario ends with.
    pub fn elapsed_ms(&self) -> u128 {
        self.started.elapsed().as_millis()
    }

    /// The API server as a pod in `namespace` reaches it: its URL, and the cluster's CA bundle
    /// from the `kube-root-ca.crt` ConfigMap (what kubelet mounts as
    /// `/var/run/secrets/kubernetes.io/serviceaccount/ca.crt`), written to a file.
    pub fn api_server(&self, namespace: &str) -> (String, PathBuf) {
        let url = self
            .kubectl(&[
                "config",
                "view",
                "--minify",
                "-o",
                "jsonpath={.clusters[0].cluster.server}",
            ])
            .trim()
            .to_owned();
        let mut ca = String::new();
        wait_until(
            "the kube-root-ca.crt ConfigMap",
            Duration::from_secs(60),
            || {
                ca = self
                    .try_kubectl(&[
                        "get",
                        "configmap",
                        "kube-root-ca.crt",
                        "-n",
                        namespace,
                        "-o",
                        "jsonpath={.data.ca\\.crt}",
                    ])
                    .unwrap_or_default();
                ca.contains("BEGIN CERTIFICATE")
            },
        )
        .unwrap_or_else(|e| panic!("{e:#}"));
        let path = self.cluster.dir().join(format!("ca-{namespace}.crt"));
        std::fs::write(&path, ca).unwrap_or_else(|e| panic!("{e}"));
        (url, path)
    }
}

/// `scripts/render-chart` with `values` given as `--set-json` documents.
pub fn render_chart(values: &[&str]) -> String {
    let mut command = Command::new(repo().join("scripts/render-chart"));
    for v in values {
        command.args(["--set-json", v]);
    }
    rendered(command)
}

/// `scripts/render-chart` with values files, as `helm template -f FILE` takes them.
pub fn render_chart_with_files(files: &[&str]) -> String {
    let mut command = Command::new(repo().join("scripts/render-chart"));
    command.args(files);
    rendered(command)
}

fn rendered(mut command: Command) -> String {
    let output = command
        .stderr(Stdio::inherit())
        .output()
        .unwrap_or_else(|e| panic!("scripts/render-chart: {e}"));
    assert!(output.status.success(), "scripts/render-chart failed");
    String::from_utf8(output.stdout).unwrap_or_else(|e| panic!("{e}"))
}

/// Argo CD's verdict on `object` as read from the API server: the shipped
/// `argocd/dlock.io/_/health.lua` (one script for every kind), run by a real Lua 5.4 as Argo CD
/// runs it; `kind` names the object in a failure.
pub fn argocd_health(kind: &str, object: &Value) -> (String, String) {
    use mlua::LuaSerdeExt as _;
    let path = repo().join("argocd/dlock.io/_/health.lua");
    let script =
        std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let lua = mlua::Lua::new();
    let value = lua.to_value(object).unwrap_or_else(|e| panic!("{e}"));
    lua.globals()
        .set("obj", value)
        .unwrap_or_else(|e| panic!("{e}"));
    let result: mlua::Table = lua
        .load(script.as_str())
        .eval()
        .unwrap_or_else(|e| panic!("{kind} health.lua: {e}"));
    (
        result.get("status").unwrap_or_default(),
        result.get("message").unwrap_or_default(),
    )
}

/// `status.conditions[type == type_]` of an object as the API server returns it.
pub fn condition<'a>(object: &'a Value, type_: &str) -> Option<&'a Value> {
    object["status"]["conditions"]
        .as_array()?
        .iter()
        .find(|c| c["type"] == type_)
}
