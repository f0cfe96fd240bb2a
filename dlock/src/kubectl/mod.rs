//! `kubectl dlock`: the kubectl plugin (the `dlock` binary installed as `kubectl-dlock`).
//!
//! It works on the current kubeconfig context as kubectl does (`-n/--namespace`, `--context`,
//! the context's namespace by default) and reads what the operator writes: the custom resources'
//! conditions, the Lock mirror and the PayoutBatch statuses. `revoke` creates a LockRevocation and
//! watches it until the operator says both fences were advanced; `resolve` calls the payment
//! resource through `dlock resolve`'s own code path. Tables by default, `-o json|yaml` for scripts.

use std::collections::BTreeMap;
use std::io::Write as _;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context as _, Result, anyhow, bail};
use clap::{Args, Parser, Subcommand, ValueEnum};
use dlock_operator::crd::{
    Condition, Lock, LockRevocation, LockRevocationSpec, LockServer, LockSpec, LockStatus,
    PaymentResource, PayoutBatch, RailProxy, Reconciliation, Reported, RevocationResult,
};
use futures::StreamExt as _;
use k8s_openapi::api::batch::v1::Job;
use kube::api::{Api, ListParams, ObjectMeta, PostParams};
use kube::runtime::WatchStreamExt as _;
use kube::{Client, Config, Resource, ResourceExt};
use serde::Serialize;

mod batch;
mod resolve;
mod revoke;
mod status;
#[cfg(test)]
mod tests;

pub use batch::*;
pub use resolve::*;
pub use revoke::*;
pub use status::*;

/// A watch that fails this many times in a row (with kube's default back-off between the
/// attempts) gives up.
const WATCH_FAILURES_MAX: u32 = 5;

/// The file name kubectl finds the plugin under on PATH.
pub const PLUGIN_NAME: &str = "kubectl-dlock";

/// Whether this process was started as `kubectl-dlock` (kubectl runs plugins by that name).
pub fn invoked_as_plugin() -> bool {
    std::env::args_os()
        .next()
        .map(PathBuf::from)
        .and_then(|p| p.file_stem().map(|s| s.to_string_lossy().into_owned()))
        .is_some_and(|name| name == PLUGIN_NAME)
}

/// The command line of `kubectl dlock …` (the binary started as `kubectl-dlock`).
#[derive(Parser)]
#[command(
    name = "kubectl dlock",
    bin_name = "kubectl dlock",
    version,
    about = "dlock on the current kubeconfig context: status, revoke, resolve, batch"
)]
pub struct Plugin {
    #[command(flatten)]
    pub args: KubectlArgs,
}

#[derive(Debug, Args)]
pub struct KubectlArgs {
    /// The namespace (default: the context's namespace, else `default`).
    #[arg(short = 'n', long, global = true)]
    pub namespace: Option<String>,
    /// The kubeconfig context (default: the current context).
    #[arg(long, global = true)]
    pub context: Option<String>,
    /// Output format: a table for people, json or yaml for scripts.
    #[arg(short = 'o', long, global = true, value_enum, default_value_t = Output::Table)]
    pub output: Output,
    #[command(subcommand)]
    pub command: KubectlCommand,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Output {
    Table,
    Json,
    Yaml,
}

#[derive(Debug, Subcommand)]
pub enum KubectlCommand {
    /// The namespace's dlock resources and their conditions, the held locks and the
    /// RAIL_AMBIGUOUS payouts the batches report.
    Status,
    /// Force-revokes a lock: creates a LockRevocation (guarded by the holder's token) and waits
    /// until the operator has advanced both fences.
    Revoke(RevokeArgs),
    /// Resolves a RAIL_AMBIGUOUS payout at the namespace's payment resource (as `dlock resolve`).
    Resolve(ResolveArgs),
    /// The progress of a PayoutBatch: phase, payouts per state, conditions, the executor Job.
    Batch(BatchArgs),
}

#[derive(Debug, Args)]
pub struct RevokeArgs {
    /// The lock key, `payout:{accountId}`.
    pub key: String,
    /// Why (at least 8 characters; kept in the LockRevocation and the services' audit rows).
    #[arg(long)]
    pub reason: String,
    /// Who revokes (`spec.revokedBy`). Default: the user the API server knows you as.
    #[arg(long)]
    pub operator: Option<String>,
    /// Revoke only the grant with this token. Default: the token of the Lock the operator
    /// mirrors for KEY.
    #[arg(long)]
    pub expected_token: Option<i64>,
    /// Revoke whichever grant holds KEY, without the token guard (when no Lock mirrors it).
    #[arg(long, conflicts_with = "expected_token")]
    pub any_holder: bool,
    /// How long to wait for both fences (`90s`, `2m`).
    #[arg(long, default_value = "60s", value_parser = parse_duration)]
    pub timeout: Duration,
}

#[derive(Debug, Args)]
pub struct ResolveArgs {
    #[command(flatten)]
    pub decision: crate::jobs::Decision,
    /// What the decision rests on (a statement line, a rail ticket). Default with --posted: the
    /// rail reference.
    #[arg(long)]
    pub evidence: Option<String>,
    /// Who resolves. Default: the user the API server knows you as.
    #[arg(long)]
    pub operator: Option<String>,
    /// The PaymentResource (default: the only one in the namespace).
    #[arg(long)]
    pub payment_resource: Option<String>,
    /// The operator credential the payment resource accepts.
    #[arg(long, env = "DLOCK_OPERATOR_TOKEN", conflicts_with = "credential_file")]
    pub operator_token: Option<String>,
    /// A file holding the operator credential.
    #[arg(long, env = "DLOCK_CREDENTIAL_FILE")]
    pub credential_file: Option<PathBuf>,
}

#[derive(Debug, Args)]
pub struct BatchArgs {
    pub name: String,
    /// Print again on every change until the executor Job has ended.
    #[arg(short = 'w', long)]
    pub watch: bool,
}

/// `90s`, `2m`, `1m30s`, `500ms` or whole seconds.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let bad = || format!("{text:?} is not a duration (say 90s, 2m, 1m30s or 500ms)");
    if let Ok(seconds) = text.parse::<u64>() {
        return Ok(Duration::from_secs(seconds));
    }
    let mut total = Duration::ZERO;
    let mut rest = text.trim();
    if rest.is_empty() {
        return Err(bad());
    }
    while !rest.is_empty() {
        let digits = rest.find(|c: char| !c.is_ascii_digit()).ok_or_else(bad)?;
        let n: u64 = rest[..digits].parse().map_err(|_| bad())?;
        rest = &rest[digits..];
        let unit = rest
            .find(|c: char| c.is_ascii_digit())
            .unwrap_or(rest.len());
        total += match &rest[..unit] {
            "ms" => Duration::from_millis(n),
            "s" => Duration::from_secs(n),
            "m" => Duration::from_secs(n * 60),
            "h" => Duration::from_secs(n * 3600),
            _ => return Err(bad()),
        };
        rest = &rest[unit..];
    }
    Ok(total)
}

/// Runs one `kubectl dlock` command; errors are printed the way kubectl prints them.
pub async fn run(args: KubectlArgs) -> std::process::ExitCode {
    match dispatch(args).await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("error: {error:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

async fn dispatch(args: KubectlArgs) -> Result<()> {
    if matches!(args.command, KubectlCommand::Resolve(_)) && args.output != Output::Table {
        bail!(
            "resolve prints one line and has no -o {}; read the payout afterwards with `kubectl dlock status -o json`",
            format!("{:?}", args.output).to_lowercase()
        );
    }
    let kube = Kube::connect(args.namespace.as_deref(), args.context.as_deref()).await?;
    match args.command {
        KubectlCommand::Status => status(&kube, args.output).await,
        KubectlCommand::Revoke(revoke_args) => revoke(&kube, revoke_args, args.output).await,
        KubectlCommand::Resolve(resolve_args) => resolve(&kube, resolve_args).await,
        KubectlCommand::Batch(batch_args) => batch(&kube, batch_args, args.output).await,
    }
}

// ---------------------------------------------------------------------------------------------
// The connection and what its errors mean

/// A client on the chosen context, and where it points (for messages).
pub struct Kube {
    client: Client,
    namespace: String,
    context: String,
    server: String,
}

impl Kube {
    /// The kubeconfig as kubectl reads it (`KUBECONFIG`, else `~/.kube/config`; in a pod its
    /// service account), the context `context` or the current one.
    pub async fn connect(namespace: Option<&str>, context: Option<&str>) -> Result<Self> {
        let config = match context {
            Some(context) => {
                let options = kube::config::KubeConfigOptions {
                    context: Some(context.to_owned()),
                    ..Default::default()
                };
                Config::from_kubeconfig(&options)
                    .await
                    .map_err(|e| no_kubeconfig(&e.to_string(), Some(context)))?
            }
            None => Config::infer()
                .await
                .map_err(|e| no_kubeconfig(&e.to_string(), None))?,
        };
        let context = match context {
            Some(c) => c.to_owned(),
            None => kube::config::Kubeconfig::read()
                .ok()
                .and_then(|k| k.current_context)
                .unwrap_or_else(|| "in-cluster".to_owned()),
        };
        let server = config.cluster_url.to_string();
        let namespace = namespace
            .map(str::to_owned)
            .unwrap_or_else(|| config.default_namespace.clone());
        let client = Client::try_from(config)
            .with_context(|| format!("cannot build a client for {server} (context {context})"))?;
        Ok(Self {
            client,
            namespace,
            context,
            server,
        })
    }

    fn api<K>(&self) -> Api<K>
    where
        K: Resource<Scope = kube::core::NamespaceResourceScope, DynamicType = ()>,
    {
        Api::namespaced(self.client.clone(), &self.namespace)
    }

    /// What a failed API call means and what to do about it.
    fn explain(
        &self,
        error: kube::Error,
        verb: &str,
        resource: &str,
        name: Option<&str>,
    ) -> anyhow::Error {
        let ns = &self.namespace;
        let target = match name {
            Some(name) => format!("{resource} {name}"),
            None => resource.to_owned(),
        };
        match error {
            kube::Error::Api(status) => match status.code {
                404 if status.details.as_ref().is_some_and(|d| !d.name.is_empty()) => anyhow!(
                    "{target} not found in namespace {ns} (`kubectl dlock status -n {ns}` lists what is there)"
                ),
                404 => anyhow!(
                    "the API server at {} does not serve {resource}: the dlock CRDs are not installed \
                     in this cluster (context {}); install them with `kubectl apply --server-side -f crds/` \
                     or the Helm chart (charts/dlock)",
                    self.server,
                    self.context
                ),
                403 => anyhow!(
                    "forbidden: you may not {verb} {target} in namespace {ns} ({}); ask for a Role that \
                     grants it (check with `kubectl auth can-i {verb} {resource} -n {ns}`)",
                    status.message
                ),
                401 => anyhow!(
                    "the API server at {} refused the credentials of context {} (401 Unauthorized): log in \
                     again or refresh the token in your kubeconfig",
                    self.server,
                    self.context
                ),
                code => anyhow!(
                    "{verb} {target} in namespace {ns}: the API server answered {code} {}: {}",
                    status.reason,
                    status.message
                ),
            },
            other => anyhow!(
                "cannot reach the API server at {} (context {}): {other}; is the cluster up and is this \
                 the context you meant (`kubectl config current-context`)?",
                self.server,
                self.context
            ),
        }
    }

    async fn list<K>(&self, resource: &str) -> Result<Vec<K>>
    where
        K: Resource<Scope = kube::core::NamespaceResourceScope, DynamicType = ()>
            + Clone
            + serde::de::DeserializeOwned
            + std::fmt::Debug,
    {
        let mut items = self
            .api::<K>()
            .list(&ListParams::default())
            .await
            .map_err(|e| self.explain(e, "list", resource, None))?
            .items;
        items.sort_by_key(|o| o.name_any());
        Ok(items)
    }

    /// `--operator` when given, else [`Kube::whoami`].
    async fn operator(&self, given: Option<&str>) -> String {
        match given {
            Some(o) => o.to_owned(),
            None => self.whoami().await,
        }
    }

    /// The user the API server knows this context as (`kubectl auth whoami`), else `$USER`.
    async fn whoami(&self) -> String {
        use k8s_openapi::api::authentication::v1::SelfSubjectReview;
        let api: Api<SelfSubjectReview> = Api::all(self.client.clone());
        let review = api
            .create(&PostParams::default(), &SelfSubjectReview::default())
            .await
            .ok()
            .and_then(|r| r.status)
            .and_then(|s| s.user_info)
            .and_then(|u| u.username)
            .filter(|u| !u.is_empty());
        review
            .or_else(|| std::env::var("USER").ok().filter(|u| !u.is_empty()))
            .unwrap_or_else(|| PLUGIN_NAME.to_owned())
    }
}

fn no_kubeconfig(error: &str, context: Option<&str>) -> anyhow::Error {
    match context {
        Some(context) => anyhow!(
            "cannot use context {context:?} of the kubeconfig ({error}); `kubectl config get-contexts` lists them"
        ),
        None => anyhow!(
            "no usable kubeconfig ({error}): set KUBECONFIG or write ~/.kube/config (`kubectl config view` \
             shows what kubectl uses), or run inside a pod with a service account"
        ),
    }
}

// ---------------------------------------------------------------------------------------------
// Output

/// `view` as its table for people, else as one JSON or YAML document.
fn print_view<T: Serialize>(output: Output, view: &T, table: fn(&T) -> String) -> Result<()> {
    if output == Output::Table {
        print!("{}", table(view));
        Ok(())
    } else {
        print_document(output, view)
    }
}

fn print_document<T: Serialize>(output: Output, value: &T) -> Result<()> {
    let text = match output {
        Output::Yaml => serde_yaml_ng::to_string(value)?,
        _ => format!("{}\n", serde_json::to_string_pretty(value)?),
    };
    let mut out = std::io::stdout().lock();
    out.write_all(text.as_bytes())?;
    out.flush()?;
    Ok(())
}

/// Rows under upper-case headers, aligned as kubectl aligns them (Go's text/tabwriter with
/// kubectl's settings: minimum width 10, tab width 4, padding 3).
pub fn table(headers: &[&str], rows: &[Vec<String>]) -> String {
    let mut writer = tabwriter::TabWriter::new(Vec::new())
        .minwidth(10)
        .tab_indent(false)
        .padding(3);
    let line = |cells: Vec<String>| {
        let cells: Vec<String> = cells
            .into_iter()
            .map(|c| {
                let c = c.replace(['\t', '\n'], " ");
                if c.is_empty() { "<none>".to_owned() } else { c }
            })
            .collect();
        format!("{}\n", cells.join("\t"))
    };
    let mut text = line(headers.iter().map(|h| h.to_uppercase()).collect());
    for row in rows {
        text.push_str(&line(row.clone()));
    }
    let _ = writer.write_all(text.as_bytes());
    let _ = writer.flush();
    let bytes = writer.into_inner().unwrap_or_default();
    String::from_utf8_lossy(&bytes)
        .lines()
        .map(|l| format!("{}\n", l.trim_end()))
        .collect()
}

/// A message cut to fit a table cell; the JSON keeps all of it.
fn cell(text: &str, max: usize) -> String {
    if text.chars().count() <= max {
        text.to_owned()
    } else {
        format!("{}…", text.chars().take(max - 1).collect::<String>())
    }
}
