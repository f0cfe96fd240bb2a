//! The smallest kubelet that lets the pods of Jobs really run here: no container runtime exists,
//! so the pod's one container runs as a local process of the `dlock` binary (the image's
//! entrypoint), with the pod's environment and its ConfigMap, Secret and service-account-token
//! volumes written to a directory, and the pod's phase reported through the API server as a
//! kubelet reports it. KWOK fakes every other pod (e2e/k8s/kwok.yaml leaves these to us).
//!
//! Test-only and deliberately small: one container, paths under a mount rewritten to the
//! directory that stands in for it, no probes, no restarts (the operator's Jobs use
//! `restartPolicy: Never`, so the Job controller makes a new pod for a retry).

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex};

use anyhow::{Context, Result, anyhow};
use futures::StreamExt;
use k8s_openapi::api::authentication::v1::{TokenRequest, TokenRequestSpec};
use k8s_openapi::api::core::v1::{ConfigMap, Container, Pod, Secret, ServiceAccount};
use kube::api::{Api, Patch, PatchParams, PostParams};
use kube::runtime::WatchStreamExt as _;
use kube::runtime::watcher;
use serde_json::json;

/// The label the Job controller puts on its pods.
pub const JOB_LABEL: &str = "batch.kubernetes.io/job-name";

/// What ran: one line per pod, for assertions and failure messages.
#[derive(Debug, Clone)]
pub struct Ran {
    pub namespace: String,
    pub pod: String,
    pub args: Vec<String>,
    pub exit_code: Option<i32>,
    pub log: PathBuf,
}

pub struct Kubelet {
    task: tokio::task::JoinHandle<()>,
    pub ran: Arc<Mutex<Vec<Ran>>>,
}

impl Drop for Kubelet {
    fn drop(&mut self) {
        self.task.abort();
    }
}

struct Shared {
    client: kube::Client,
    exe: PathBuf,
    extra_env: Vec<(String, String)>,
    dir: PathBuf,
    ran: Arc<Mutex<Vec<Ran>>>,
}

impl Kubelet {
    /// Runs every Job pod that the scheduler placed on a node, in any namespace, with
    /// `extra_env` added (the address map that stands in for cluster DNS).
    pub fn start(
        client: kube::Client,
        exe: PathBuf,
        extra_env: Vec<(String, String)>,
        dir: PathBuf,
    ) -> Self {
        let ran = Arc::new(Mutex::new(Vec::new()));
        let shared = Arc::new(Shared {
            client,
            exe,
            extra_env,
            dir,
            ran: ran.clone(),
        });
        let task = tokio::spawn(run(shared));
        Self { task, ran }
    }

    pub fn ran(&self) -> Vec<Ran> {
        self.ran.lock().map(|r| r.clone()).unwrap_or_default()
    }
}

async fn run(shared: Arc<Shared>) {
    let pods: Api<Pod> = Api::all(shared.client.clone());
    let config = watcher::Config::default().labels(JOB_LABEL);
    let mut started: HashMap<String, tokio::sync::watch::Sender<bool>> = HashMap::new();
    let mut events = watcher::watcher(pods, config).default_backoff().boxed();
    while let Some(event) = events.next().await {
        let pods = match event {
            Ok(watcher::Event::Apply(pod) | watcher::Event::InitApply(pod)) => vec![pod],
            Ok(watcher::Event::Delete(pod)) => {
                if let Some(stop) = pod.metadata.uid.as_ref().and_then(|u| started.get(u)) {
                    let _ = stop.send(true);
                }
                continue;
            }
            Ok(_) => continue,
            Err(e) => {
                eprintln!("kubelet: watch error (the watcher retries): {e}");
                continue;
            }
        };
        for pod in pods {
            let uid = pod.metadata.uid.clone().unwrap_or_default();
            if pod.metadata.deletion_timestamp.is_some() {
                if let Some(stop) = started.get(&uid) {
                    let _ = stop.send(true);
                }
                continue;
            }
            let scheduled = pod
                .spec
                .as_ref()
                .and_then(|s| s.node_name.as_ref())
                .is_some();
            let phase = pod.status.as_ref().and_then(|s| s.phase.clone());
            let pending = matches!(phase.as_deref(), None | Some("Pending"));
            if !scheduled || !pending || started.contains_key(&uid) {
                continue;
            }
            let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
            started.insert(uid, stop_tx);
            let shared = shared.clone();
            tokio::spawn(async move {
                let name = pod.metadata.name.clone().unwrap_or_default();
                if let Err(e) = run_pod(&shared, &pod, stop_rx).await {
                    eprintln!("kubelet: pod {name}: {e:#}");
                    let _ = report(&shared, &pod, Phase::Failed(-1, format!("{e:#}"))).await;
                }
            });
        }
    }
}

enum Phase {
    Running,
    /// With the container's termination message.
    Succeeded(String),
    Failed(i32, String),
}

async fn report(shared: &Shared, pod: &Pod, phase: Phase) -> Result<()> {
    let namespace = pod.metadata.namespace.clone().unwrap_or_default();
    let name = pod.metadata.name.clone().unwrap_or_default();
    let container = pod
        .spec
        .as_ref()
        .and_then(|s| s.containers.first())
        .map(|c| c.name.clone())
        .unwrap_or_default();
    let now = chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Secs, true);
    let (phase_text, ready, state) = match &phase {
        Phase::Running => ("Running", "True", json!({"running": {"startedAt": now}})),
        Phase::Succeeded(message) => (
            "Succeeded",
            "False",
            json!({"terminated": {"exitCode": 0, "reason": "Completed", "message": message, "finishedAt": now}}),
        ),
        Phase::Failed(code, message) => (
            "Failed",
            "False",
            json!({"terminated": {"exitCode": code, "reason": "Error", "message": message, "finishedAt": now}}),
        ),
    };
    let status = json!({
        "status": {
            "phase": phase_text,
            "hostIP": "127.0.0.1",
            "podIP": "127.0.0.1",
            "startTime": now,
            "conditions": [
                {"type": "Initialized", "status": "True", "lastTransitionTime": now},
                {"type": "Ready", "status": ready, "lastTransitionTime": now},
                {"type": "ContainersReady", "status": ready, "lastTransitionTime": now},
            ],
            "containerStatuses": [{
                "name": container,
                "image": pod.spec.as_ref().and_then(|s| s.containers.first()).and_then(|c| c.image.clone()).unwrap_or_default(),
                "imageID": "",
                "ready": ready == "True",
                "restartCount": 0,
                "started": matches!(phase, Phase::Running),
                "state": state,
            }],
        }
    });
    let pods: Api<Pod> = Api::namespaced(shared.client.clone(), &namespace);
    pods.patch_status(&name, &PatchParams::default(), &Patch::Merge(&status))
        .await
        .with_context(|| format!("reporting {phase_text} for pod {namespace}/{name}"))?;
    Ok(())
}

async fn run_pod(
    shared: &Shared,
    pod: &Pod,
    mut stop: tokio::sync::watch::Receiver<bool>,
) -> Result<()> {
    let namespace = pod.metadata.namespace.clone().unwrap_or_default();
    let name = pod.metadata.name.clone().unwrap_or_default();
    let spec = pod
        .spec
        .as_ref()
        .ok_or_else(|| anyhow!("pod without spec"))?;
    let container = spec
        .containers
        .first()
        .ok_or_else(|| anyhow!("pod without containers"))?;
    let root = shared.dir.join(format!("{namespace}.{name}"));
    std::fs::create_dir_all(&root).with_context(|| format!("creating {}", root.display()))?;
    let volumes = materialize_volumes(shared, pod, &root).await?;
    // Mount paths, longest first, mapped to the directories that stand in for them.
    let mut mounts: Vec<(String, PathBuf)> = container
        .volume_mounts
        .iter()
        .flatten()
        .filter_map(|m| {
            volumes
                .get(&m.name)
                .map(|dir| (m.mount_path.trim_end_matches('/').to_owned(), dir.clone()))
        })
        .collect();
    // The termination message file, as a kubelet mounts it into the container.
    let termination = root.join("termination-log");
    std::fs::write(&termination, b"")?;
    mounts.push((
        container
            .termination_message_path
            .clone()
            .unwrap_or_else(|| "/dev/termination-log".to_owned()),
        termination.clone(),
    ));
    mounts.sort_by_key(|(path, _)| std::cmp::Reverse(path.len()));
    let rewrite = |value: &str| -> String {
        for (path, dir) in &mounts {
            if value == path {
                return dir.display().to_string();
            }
            if let Some(rest) = value.strip_prefix(&format!("{path}/")) {
                return dir.join(rest).display().to_string();
            }
        }
        value.to_owned()
    };
    let env = resolve_env(shared, &namespace, pod, container).await?;
    let (program, mut args) = entrypoint(shared, container);
    args = args.iter().map(|a| rewrite(a)).collect();
    let log = root.join("container.log");
    let log_file = std::fs::File::create(&log)?;
    let mut command = tokio::process::Command::new(&program);
    command
        .args(&args)
        .env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .envs(env.iter().map(|(k, v)| (k.clone(), rewrite(v))))
        .envs(shared.extra_env.iter().cloned())
        .current_dir(&root)
        .stdin(Stdio::null())
        .stdout(log_file.try_clone()?)
        .stderr(log_file)
        .kill_on_drop(true);
    let mut child = command
        .spawn()
        .with_context(|| format!("starting {}", program.display()))?;
    report(shared, pod, Phase::Running).await?;
    let status = tokio::select! {
        status = child.wait() => status?,
        _ = async { stop.wait_for(|stop| *stop).await.is_ok() } => {
            // The pod is being deleted: stop the process as a kubelet would (SIGTERM, then kill).
            if let Some(pid) = child.id() {
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(pid as i32),
                    nix::sys::signal::Signal::SIGTERM,
                );
            }
            match tokio::time::timeout(std::time::Duration::from_secs(10), child.wait()).await {
                Ok(status) => status?,
                Err(_) => {
                    child.kill().await?;
                    child.wait().await?
                }
            }
        }
    };
    let code = status.code();
    if let Ok(mut ran) = shared.ran.lock() {
        ran.push(Ran {
            namespace: namespace.clone(),
            pod: name.clone(),
            args: args.clone(),
            exit_code: code,
            log: log.clone(),
        });
    }
    // What a kubelet reports: the termination message file (at most 4 KiB), or with
    // FallbackToLogsOnError and a failure, the log's tail.
    let mut message = std::fs::read_to_string(&termination).unwrap_or_default();
    if message.trim().is_empty()
        && code != Some(0)
        && container.termination_message_policy.as_deref() == Some("FallbackToLogsOnError")
    {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        message = lines[lines.len().saturating_sub(80)..].join("\n");
    }
    if message.len() > 4096 {
        let mut cut = 4096;
        while !message.is_char_boundary(cut) {
            cut -= 1;
        }
        message.truncate(cut);
    }
    let phase = match code {
        Some(0) => Phase::Succeeded(message),
        Some(code) => Phase::Failed(code, message),
        None => Phase::Failed(137, message),
    };
    // A pod deleted meanwhile has nothing left to report to.
    if !*stop.borrow() {
        report(shared, pod, phase).await?;
    }
    Ok(())
}

/// The image's entrypoint is `dlock` (the repository's Dockerfile): a container without a
/// `command` runs `dlock ARGS`; a `command` naming `dlock` runs it with the rest.
fn entrypoint(shared: &Shared, container: &Container) -> (PathBuf, Vec<String>) {
    let mut args: Vec<String> = Vec::new();
    if let Some(command) = &container.command {
        let mut rest = command.iter();
        if let Some(first) = rest.next()
            && !(first == "dlock" || first.ends_with("/dlock"))
        {
            // Not our binary: run it as it is (a shell, say), from the machine.
            return (
                PathBuf::from(first),
                rest.cloned()
                    .chain(container.args.clone().unwrap_or_default())
                    .collect(),
            );
        }
        args.extend(rest.cloned());
    }
    args.extend(container.args.clone().unwrap_or_default());
    (shared.exe.clone(), args)
}

async fn resolve_env(
    shared: &Shared,
    namespace: &str,
    pod: &Pod,
    container: &Container,
) -> Result<Vec<(String, String)>> {
    let secrets: Api<Secret> = Api::namespaced(shared.client.clone(), namespace);
    let maps: Api<ConfigMap> = Api::namespaced(shared.client.clone(), namespace);
    let mut env = Vec::new();
    for from in container.env_from.iter().flatten() {
        // As the kubelet does: an optional Secret or ConfigMap that is absent sets nothing.
        if let Some(r) = &from.secret_ref {
            let secret = match secrets.get_opt(&r.name).await? {
                Some(secret) => secret,
                None if r.optional == Some(true) => continue,
                None => secrets.get(&r.name).await?,
            };
            for (k, v) in secret_data(&secret) {
                env.push((format!("{}{k}", from.prefix.clone().unwrap_or_default()), v));
            }
        }
        if let Some(r) = &from.config_map_ref {
            let map = match maps.get_opt(&r.name).await? {
                Some(map) => map,
                None if r.optional == Some(true) => continue,
                None => maps.get(&r.name).await?,
            };
            for (k, v) in map.data.unwrap_or_default() {
                env.push((format!("{}{k}", from.prefix.clone().unwrap_or_default()), v));
            }
        }
    }
    for var in container.env.iter().flatten() {
        if let Some(value) = &var.value {
            env.push((var.name.clone(), value.clone()));
            continue;
        }
        let Some(from) = &var.value_from else {
            env.push((var.name.clone(), String::new()));
            continue;
        };
        let value = if let Some(r) = &from.secret_key_ref {
            let secret = secrets.get(&r.name).await?;
            secret_data(&secret)
                .remove(&r.key)
                .ok_or_else(|| anyhow!("secret {} has no key {}", r.name, r.key))?
        } else if let Some(r) = &from.config_map_key_ref {
            let value = match maps.get_opt(&r.name).await? {
                Some(map) => map.data.unwrap_or_default().remove(&r.key),
                None => None,
            };
            match value {
                Some(value) => value,
                // As the kubelet does: an optional key that is absent sets no variable.
                None if r.optional == Some(true) => continue,
                None => return Err(anyhow!("configmap {} has no key {}", r.name, r.key)),
            }
        } else if let Some(r) = &from.field_ref {
            match r.field_path.as_str() {
                "metadata.name" => pod.metadata.name.clone().unwrap_or_default(),
                "metadata.namespace" => namespace.to_owned(),
                "metadata.uid" => pod.metadata.uid.clone().unwrap_or_default(),
                "spec.nodeName" => pod
                    .spec
                    .as_ref()
                    .and_then(|s| s.node_name.clone())
                    .unwrap_or_default(),
                "spec.serviceAccountName" => pod
                    .spec
                    .as_ref()
                    .and_then(|s| s.service_account_name.clone())
                    .unwrap_or_else(|| "default".to_owned()),
                other => return Err(anyhow!("fieldRef {other} is not supported here")),
            }
        } else {
            return Err(anyhow!("env {}: unsupported valueFrom", var.name));
        };
        env.push((var.name.clone(), value));
    }
    Ok(env)
}

fn secret_data(secret: &Secret) -> BTreeMap<String, String> {
    let mut out: BTreeMap<String, String> = secret
        .data
        .clone()
        .unwrap_or_default()
        .into_iter()
        .map(|(k, v)| (k, String::from_utf8_lossy(&v.0).into_owned()))
        .collect();
    out.extend(secret.string_data.clone().unwrap_or_default());
    out
}

fn write_file(dir: &Path, relative: &str, content: &[u8]) -> Result<()> {
    let path = dir.join(relative);
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent)?;
    }
    std::fs::write(&path, content).with_context(|| format!("writing {}", path.display()))
}

/// Writes each volume the container can mount into `root/volumes/<name>`; returns name → dir.
async fn materialize_volumes(
    shared: &Shared,
    pod: &Pod,
    root: &Path,
) -> Result<HashMap<String, PathBuf>> {
    let namespace = pod.metadata.namespace.clone().unwrap_or_default();
    let secrets: Api<Secret> = Api::namespaced(shared.client.clone(), &namespace);
    let maps: Api<ConfigMap> = Api::namespaced(shared.client.clone(), &namespace);
    let mut out = HashMap::new();
    let volumes = pod
        .spec
        .as_ref()
        .and_then(|s| s.volumes.clone())
        .unwrap_or_default();
    for volume in volumes {
        let dir = root.join("volumes").join(&volume.name);
        std::fs::create_dir_all(&dir)?;
        if let Some(source) = &volume.config_map {
            let map = maps.get(&source.name).await?;
            for (k, v) in map.data.unwrap_or_default() {
                write_file(&dir, &k, v.as_bytes())?;
            }
        }
        if let Some(source) = &volume.secret {
            let name = source.secret_name.clone().unwrap_or_default();
            let secret = secrets.get(&name).await?;
            for (k, v) in secret_data(&secret) {
                write_file(&dir, &k, v.as_bytes())?;
            }
        }
        if let Some(projected) = &volume.projected {
            for source in projected.sources.iter().flatten() {
                if let Some(token) = &source.service_account_token {
                    let minted = mint_token(
                        shared,
                        pod,
                        token.audience.clone(),
                        token.expiration_seconds,
                    )
                    .await?;
                    write_file(&dir, &token.path, minted.as_bytes())?;
                }
                if let Some(map) = &source.config_map {
                    let data = maps.get(&map.name).await?.data.unwrap_or_default();
                    for (k, v) in data {
                        write_file(&dir, &k, v.as_bytes())?;
                    }
                }
                if let Some(secret) = &source.secret {
                    for (k, v) in secret_data(&secrets.get(&secret.name).await?) {
                        write_file(&dir, &k, v.as_bytes())?;
                    }
                }
            }
        }
        out.insert(volume.name.clone(), dir);
    }
    Ok(out)
}

/// A service-account token for the pod, as the kubelet mints it: TokenRequest bound to the pod.
async fn mint_token(
    shared: &Shared,
    pod: &Pod,
    audience: Option<String>,
    expiration_seconds: Option<i64>,
) -> Result<String> {
    let namespace = pod.metadata.namespace.clone().unwrap_or_default();
    let account = pod
        .spec
        .as_ref()
        .and_then(|s| s.service_account_name.clone())
        .unwrap_or_else(|| "default".to_owned());
    let accounts: Api<ServiceAccount> = Api::namespaced(shared.client.clone(), &namespace);
    let request = TokenRequest {
        spec: TokenRequestSpec {
            audiences: audience.into_iter().collect(),
            expiration_seconds: Some(expiration_seconds.unwrap_or(3600)),
            bound_object_ref: Some(k8s_openapi::api::authentication::v1::BoundObjectReference {
                api_version: Some("v1".to_owned()),
                kind: Some("Pod".to_owned()),
                name: pod.metadata.name.clone(),
                uid: pod.metadata.uid.clone(),
            }),
        },
        ..TokenRequest::default()
    };
    let answer: TokenRequest = accounts
        .create_subresource("token", &account, &PostParams::default(), &request)
        .await
        .with_context(|| format!("minting a token for {namespace}/{account}"))?;
    answer
        .status
        .map(|s| s.token)
        .ok_or_else(|| anyhow!("TokenRequest answered without a token"))
}
