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
    Condition, Lock, LockRevocation, LockRevocationSpec, LockServer, PaymentResource, PayoutBatch,
    RailProxy, Reconciliation, RevocationResult,
};
use futures::StreamExt as _;
use k8s_openapi::api::batch::v1::Job;
use kube::api::{Api, ListParams, ObjectMeta, PostParams};
use kube::runtime::WatchStreamExt as _;
use kube::{Client, Config, Resource, ResourceExt};
use serde::Serialize;
use uuid::Uuid;

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
    /// The RAIL_AMBIGUOUS payout (`kubectl dlock status` lists them).
    pub payout_id: Uuid,
    /// The rail did pay it: post it with the rail's reference.
    #[arg(long, conflicts_with = "failed", requires = "rail_reference")]
    pub posted: bool,
    /// The rail did not pay it: fail it and release its hold (needs --evidence).
    #[arg(long, requires = "evidence")]
    pub failed: bool,
    /// The rail's reference of the transfer (from its statement).
    #[arg(long)]
    pub rail_reference: Option<String>,
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

fn find<'a>(conditions: &'a [Condition], type_: &str) -> Option<&'a Condition> {
    conditions.iter().find(|c| c.type_ == type_)
}

// ---------------------------------------------------------------------------------------------
// status

#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct StatusView {
    pub context: String,
    pub namespace: String,
    pub resources: Vec<ResourceView>,
    pub locks: Vec<LockView>,
    pub ambiguous_payouts: Vec<AmbiguousView>,
}

#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ResourceView {
    pub kind: String,
    pub name: String,
    /// The Ready condition's status, `Unknown` when there is none yet.
    pub ready: String,
    /// The Degraded condition's status, `False` when there is none.
    pub degraded: String,
    /// The Degraded condition's reason and message when it is True, else the Ready one's.
    pub reason: String,
    pub message: String,
    pub conditions: Vec<Condition>,
}

#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct LockView {
    pub name: String,
    pub key: String,
    pub account_id: String,
    pub holder: Option<String>,
    pub token: Option<i64>,
    pub expires_at: Option<String>,
}

#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct AmbiguousView {
    pub batch: String,
    pub payout_id: String,
}

fn resource_view(kind: &str, name: String, conditions: &[Condition]) -> ResourceView {
    let ready = find(conditions, "Ready");
    let degraded = find(conditions, "Degraded");
    let explaining = degraded
        .filter(|d| d.status == "True")
        .or(ready)
        .or_else(|| find(conditions, "Progressing"));
    ResourceView {
        kind: kind.to_owned(),
        name,
        ready: ready.map_or("Unknown", |c| c.status.as_str()).to_owned(),
        degraded: degraded.map_or("False", |c| c.status.as_str()).to_owned(),
        reason: explaining.map(|c| c.reason.clone()).unwrap_or_default(),
        message: explaining.map(|c| c.message.clone()).unwrap_or_default(),
        conditions: conditions.to_vec(),
    }
}

fn conditions_of<S>(status: &Option<S>, get: impl Fn(&S) -> &Vec<Condition>) -> Vec<Condition> {
    status.as_ref().map(|s| get(s).clone()).unwrap_or_default()
}

pub async fn status_view(kube: &Kube) -> Result<StatusView> {
    let (
        lock_servers,
        payment_resources,
        rail_proxies,
        batches,
        reconciliations,
        revocations,
        locks,
    ) = futures::try_join!(
        kube.list::<LockServer>("lockservers.dlock.io"),
        kube.list::<PaymentResource>("paymentresources.dlock.io"),
        kube.list::<RailProxy>("railproxies.dlock.io"),
        kube.list::<PayoutBatch>("payoutbatches.dlock.io"),
        kube.list::<Reconciliation>("reconciliations.dlock.io"),
        kube.list::<LockRevocation>("lockrevocations.dlock.io"),
        kube.list::<Lock>("locks.dlock.io"),
    )?;
    let mut resources = Vec::new();
    for o in &lock_servers {
        resources.push(resource_view(
            "LockServer",
            o.name_any(),
            &conditions_of(&o.status, |s| &s.conditions),
        ));
    }
    for o in &payment_resources {
        resources.push(resource_view(
            "PaymentResource",
            o.name_any(),
            &conditions_of(&o.status, |s| &s.conditions),
        ));
    }
    for o in &rail_proxies {
        resources.push(resource_view(
            "RailProxy",
            o.name_any(),
            &conditions_of(&o.status, |s| &s.conditions),
        ));
    }
    for o in &batches {
        resources.push(resource_view(
            "PayoutBatch",
            o.name_any(),
            &conditions_of(&o.status, |s| &s.conditions),
        ));
    }
    for o in &reconciliations {
        resources.push(resource_view(
            "Reconciliation",
            o.name_any(),
            &conditions_of(&o.status, |s| &s.conditions),
        ));
    }
    for o in &revocations {
        resources.push(resource_view(
            "LockRevocation",
            o.name_any(),
            &conditions_of(&o.status, |s| &s.conditions),
        ));
    }
    let locks = locks
        .iter()
        .map(|l| {
            let status = l.status.clone().unwrap_or_default();
            LockView {
                name: l.name_any(),
                key: l.spec.key.clone(),
                account_id: l.spec.account_id.clone(),
                holder: status.holder,
                token: status.token,
                expires_at: status.expires_at,
            }
        })
        .collect();
    let ambiguous_payouts = batches
        .iter()
        .flat_map(|b| {
            let batch = b.name_any();
            b.status
                .iter()
                .flat_map(|s| s.ambiguous.clone())
                .map(move |payout_id| AmbiguousView {
                    batch: batch.clone(),
                    payout_id,
                })
        })
        .collect();
    Ok(StatusView {
        context: kube.context.clone(),
        namespace: kube.namespace.clone(),
        resources,
        locks,
        ambiguous_payouts,
    })
}

pub fn status_table(view: &StatusView) -> String {
    let ns = &view.namespace;
    let mut out = String::new();
    if view.resources.is_empty() {
        out.push_str(&format!("No dlock resources found in {ns} namespace.\n"));
    } else {
        let rows: Vec<Vec<String>> = view
            .resources
            .iter()
            .map(|r| {
                vec![
                    r.kind.clone(),
                    r.name.clone(),
                    r.ready.clone(),
                    r.degraded.clone(),
                    r.reason.clone(),
                    cell(&r.message, 100),
                ]
            })
            .collect();
        out.push_str(&table(
            &["kind", "name", "ready", "degraded", "reason", "message"],
            &rows,
        ));
    }
    out.push('\n');
    if view.locks.is_empty() {
        out.push_str(&format!("No held locks in {ns} namespace.\n"));
    } else {
        let rows: Vec<Vec<String>> = view
            .locks
            .iter()
            .map(|l| {
                vec![
                    l.name.clone(),
                    l.key.clone(),
                    l.holder.clone().unwrap_or_default(),
                    l.token.map(|t| t.to_string()).unwrap_or_default(),
                    l.expires_at.clone().unwrap_or_default(),
                ]
            })
            .collect();
        out.push_str(&table(
            &["lock", "key", "holder", "token", "expires"],
            &rows,
        ));
    }
    out.push('\n');
    if view.ambiguous_payouts.is_empty() {
        out.push_str(&format!("No RAIL_AMBIGUOUS payouts in {ns} namespace.\n"));
    } else {
        let rows: Vec<Vec<String>> = view
            .ambiguous_payouts
            .iter()
            .map(|a| {
                vec![
                    a.batch.clone(),
                    a.payout_id.clone(),
                    "RAIL_AMBIGUOUS".to_owned(),
                ]
            })
            .collect();
        out.push_str(&table(&["batch", "payout", "state"], &rows));
        out.push_str(&format!(
            "\nResolve each after checking the rail: kubectl dlock resolve PAYOUT -n {ns} --posted --rail-reference R | --failed --evidence TEXT\n"
        ));
    }
    out
}

async fn status(kube: &Kube, output: Output) -> Result<()> {
    let view = status_view(kube).await?;
    match output {
        Output::Table => {
            print!("{}", status_table(&view));
            Ok(())
        }
        _ => print_document(output, &view),
    }
}

// ---------------------------------------------------------------------------------------------
// revoke

#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct RevokeView {
    pub name: String,
    pub namespace: String,
    pub key: String,
    pub expected_token: Option<i64>,
    pub result: Option<RevocationResult>,
}

/// A LockRevocation name prefix from a key: `payout:acct-17` → `revoke-payout-acct-17-`.
pub fn revocation_prefix(key: &str) -> String {
    let mut name: String = key
        .to_ascii_lowercase()
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
        .collect();
    name.truncate(40);
    let name = name.trim_matches('-');
    format!("revoke-{name}-")
}

/// The lines that say what changed between two results of the same revocation.
pub fn revocation_steps(
    before: Option<&RevocationResult>,
    now: &RevocationResult,
    account: &str,
) -> Vec<String> {
    let mut lines = Vec::new();
    let floor = now
        .new_token_floor
        .map(|f| f.to_string())
        .unwrap_or_else(|| "?".into());
    if now.new_token_floor.is_some() && before.and_then(|b| b.new_token_floor).is_none() {
        match now.revoked_token {
            Some(token) => lines.push(format!(
                "lock server: grant with token {token} revoked, new token floor {floor}"
            )),
            None => lines.push(format!("lock server: revoked, new token floor {floor}")),
        }
    }
    if now.payment_fenced && !before.is_some_and(|b| b.payment_fenced) {
        lines.push(format!(
            "payment resource: account {account} fenced at {floor}"
        ));
    }
    if now.rail_fenced && !before.is_some_and(|b| b.rail_fenced) {
        lines.push(format!(
            "rail proxy: high-water mark of {account} advanced to {floor}"
        ));
    }
    let changed = before.is_none_or(|b| b.outcome != now.outcome || b.summary != now.summary);
    if changed && now.outcome == "Incomplete" {
        lines.push(format!(
            "incomplete, the operator retries: {}",
            now.summary.clone().unwrap_or_default()
        ));
    }
    lines
}

async fn revoke(kube: &Kube, args: RevokeArgs, output: Output) -> Result<()> {
    let ns = kube.namespace.clone();
    let operator = match &args.operator {
        Some(o) => o.clone(),
        None => kube.whoami().await,
    };
    // The contract's own checks (key, account, reason length), before anything is created.
    let order = dlock_contract::revoke::RevokeOrder::for_key(
        &args.key,
        &operator,
        &args.reason,
        args.expected_token,
    )
    .map_err(|e| anyhow!("{e}; nothing was created"))?;
    let locks = kube.list::<Lock>("locks.dlock.io").await?;
    let mirrored = locks.iter().find(|l| l.spec.key == args.key);
    let expected_token = match (args.expected_token, args.any_holder, mirrored) {
        (Some(token), _, _) => Some(token),
        (None, true, _) => None,
        (None, false, Some(lock)) => Some(lock.status.as_ref().and_then(|s| s.token).ok_or_else(|| {
            anyhow!(
                "Lock {} mirrors {} but shows no token yet; give --expected-token N or --any-holder",
                lock.name_any(),
                args.key
            )
        })?),
        (None, false, None) => bail!(
            "no Lock in namespace {ns} mirrors {}: the operator saw nobody holding it (it mirrors held locks \
             every 15 s; `kubectl get locks -n {ns}`). Give --expected-token N to revoke that grant only, or \
             --any-holder to revoke whichever grant holds it",
            args.key
        ),
    };
    let revocation = LockRevocation {
        metadata: ObjectMeta {
            generate_name: Some(revocation_prefix(&args.key)),
            namespace: Some(ns.clone()),
            labels: Some(BTreeMap::from([(
                "app.kubernetes.io/managed-by".to_owned(),
                PLUGIN_NAME.to_owned(),
            )])),
            ..ObjectMeta::default()
        },
        spec: LockRevocationSpec {
            key: order.key.clone(),
            account_id: mirrored
                .map_or_else(|| order.account_id.clone(), |l| l.spec.account_id.clone()),
            reason: order.reason.clone(),
            revoked_by: order.operator.clone(),
            expected_token,
            lock_server: mirrored.map(|l| l.spec.lock_server.clone()),
            payment_resource: None,
            rail_proxy: None,
        },
        status: None,
    };
    let account = revocation.spec.account_id.clone();
    let api = kube.api::<LockRevocation>();
    let created = api
        .create(&PostParams::default(), &revocation)
        .await
        .map_err(|e| kube.explain(e, "create", "lockrevocations.dlock.io", None))?;
    let name = created.name_any();
    // Steps go to stderr when stdout carries a document for a script.
    let say = |line: &str| {
        if output == Output::Table {
            println!("{line}");
        } else {
            eprintln!("{line}");
        }
    };
    say(&format!(
        "lockrevocation.dlock.io/{name} created: {} by {}, {}",
        args.key,
        order.operator,
        match expected_token {
            Some(t) => format!("only the grant with token {t}"),
            None => "whichever grant holds it".to_owned(),
        }
    ));
    let mut last: Option<RevocationResult> = None;
    let watch = kube::runtime::watcher::watch_object(api, &name).default_backoff();
    let mut watch = std::pin::pin!(watch);
    let mut failures = 0;
    let deadline = tokio::time::Instant::now() + args.timeout;
    let verdict: Result<()> = loop {
        let event = match tokio::time::timeout_at(deadline, watch.next()).await {
            Err(_) => {
                break Err(match &last {
                    Some(r) => anyhow!(
                        "timed out after {:?}: the revocation is {} ({}); the operator keeps retrying, watch it with \
                         `kubectl get lockrevocation {name} -n {ns} -w`",
                        args.timeout,
                        r.outcome,
                        r.summary.clone().unwrap_or_default()
                    ),
                    None => anyhow!(
                        "timed out after {:?}: the operator has not answered LockRevocation {name}; is it running, \
                         and does it watch namespace {ns}? (`kubectl get pods -n dlock-system`, \
                         `kubectl describe lockrevocation {name} -n {ns}`)",
                        args.timeout
                    ),
                });
            }
            Ok(None) => break Err(anyhow!("the watch on LockRevocation {name} ended")),
            Ok(Some(Err(e))) => {
                failures += 1;
                if failures >= WATCH_FAILURES_MAX {
                    break Err(anyhow!(
                        "watching LockRevocation {name} in namespace {ns}: {e} ({failures} times in a row)"
                    ));
                }
                eprintln!("note: watching LockRevocation {name} again after: {e}");
                continue;
            }
            Ok(Some(Ok(None))) => {
                break Err(anyhow!(
                    "LockRevocation {name} was deleted before it completed"
                ));
            }
            Ok(Some(Ok(Some(object)))) => {
                failures = 0;
                object
            }
        };
        let Some(result) = event.status.and_then(|s| s.result) else {
            continue;
        };
        for line in revocation_steps(last.as_ref(), &result, &account) {
            say(&line);
        }
        let outcome = result.outcome.clone();
        let summary = result.summary.clone().unwrap_or_default();
        last = Some(result);
        match outcome.as_str() {
            "Complete" => {
                say(&format!("done: {summary}"));
                break Ok(());
            }
            "Refused" => {
                break Err(anyhow!(
                    "the revocation was refused: {summary} (LockRevocation {name} stays as the record; \
                     `kubectl describe lockrevocation {name} -n {ns}`)"
                ));
            }
            _ => {}
        }
    };
    if output != Output::Table {
        print_document(
            output,
            &RevokeView {
                name,
                namespace: ns,
                key: args.key.clone(),
                expected_token,
                result: last,
            },
        )?;
    }
    verdict
}

// ---------------------------------------------------------------------------------------------
// resolve

async fn resolve(kube: &Kube, args: ResolveArgs) -> Result<()> {
    let ns = &kube.namespace;
    let outcome_given = args.posted || args.failed;
    if !outcome_given {
        bail!(
            "say --posted --rail-reference R (the rail paid it) or --failed --evidence TEXT (it did not)"
        );
    }
    let token = match (&args.credential_file, &args.operator_token) {
        (Some(path), _) => dlock_contract::auth::Credential::from_file(path)
            .map_err(|e| anyhow!("--credential-file (DLOCK_CREDENTIAL_FILE): {e}"))?
            .token(),
        (None, Some(token)) if !token.trim().is_empty() => token.trim().to_owned(),
        _ => bail!(
            "no operator credential: set DLOCK_OPERATOR_TOKEN or give --credential-file FILE (a token of an \
             identity the payment resource lists in auth.operator-identities)"
        ),
    };
    let resources = kube
        .list::<PaymentResource>("paymentresources.dlock.io")
        .await?;
    let resource = match &args.payment_resource {
        Some(name) => resources.iter().find(|r| &r.name_any() == name).ok_or_else(|| {
            anyhow!("paymentresource {name} not found in namespace {ns} (`kubectl get paymentresources -n {ns}`)")
        })?,
        None => match resources.as_slice() {
            [only] => only,
            [] => bail!("no PaymentResource in namespace {ns}: is this the namespace of the stack? (-n NAMESPACE)"),
            several => bail!(
                "{} PaymentResources in namespace {ns} ({}); say which with --payment-resource NAME",
                several.len(),
                several.iter().map(|r| r.name_any()).collect::<Vec<_>>().join(", ")
            ),
        },
    };
    let url = resource
        .status
        .as_ref()
        .and_then(|s| s.url.clone())
        .unwrap_or_else(|| dlock_operator::workload::service_url(&resource.name_any(), ns));
    let operator = match &args.operator {
        Some(o) => o.clone(),
        None => kube.whoami().await,
    };
    let evidence = match (&args.evidence, &args.rail_reference) {
        (Some(e), _) => e.clone(),
        (None, Some(r)) => format!("the rail's reference {r}"),
        (None, None) => bail!("--failed needs --evidence TEXT (what the decision rests on)"),
    };
    let payout = args.payout_id.to_string();
    let authority = url
        .trim_start_matches("http://")
        .trim_start_matches("https://")
        .to_owned();
    let resolved = crate::jobs::resolve(crate::jobs::ResolveArgs {
        payout_id: args.payout_id,
        posted: args.posted,
        failed: args.failed,
        rail_reference: args.rail_reference.clone(),
        operator,
        evidence,
        payment_resource: url.clone(),
        operator_token: token,
    })
    .await
    .map_err(|e| {
        let text = format!("{e:#}");
        if text.contains("no answer from") {
            anyhow!(
                "{text}\nthe PaymentResource {} is at {url}, an in-cluster address: from outside the cluster run \
                 `kubectl port-forward -n {ns} svc/{} 18080:8080` and set DLOCK_SERVICE_ADDRESSES={authority}=127.0.0.1:18080",
                resource.name_any(),
                resource.name_any()
            )
        } else {
            anyhow!("{text}")
        }
    });
    resolved?;
    refresh_batches_listing(kube, &payout).await;
    Ok(())
}

/// The annotation that asks the operator to count a batch's payouts again now (any change to
/// the object starts a reconcile, which re-reads the payouts' states from paydb).
pub const REFRESH_ANNOTATION: &str = "dlock.io/refresh-requested-at";

/// After a resolution: the batches that list `payout` as RAIL_AMBIGUOUS are asked to count again,
/// so `status` and `batch` stop listing it at once instead of at the next resync (5 minutes).
async fn refresh_batches_listing(kube: &Kube, payout: &str) {
    let Ok(batches) = kube.list::<PayoutBatch>("payoutbatches.dlock.io").await else {
        return;
    };
    let api = kube.api::<PayoutBatch>();
    let now = chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Millis, true);
    let patch = serde_json::json!({"metadata": {"annotations": {REFRESH_ANNOTATION: now}}});
    for batch in batches.iter().filter(|b| {
        b.status
            .as_ref()
            .is_some_and(|s| s.ambiguous.iter().any(|a| a == payout))
    }) {
        let name = batch.name_any();
        match api
            .patch(
                &name,
                &kube::api::PatchParams::default(),
                &kube::api::Patch::Merge(&patch),
            )
            .await
        {
            Ok(_) => println!("payoutbatch.dlock.io/{name} asked to count its payouts again"),
            Err(e) => eprintln!(
                "note: PayoutBatch {name} still lists {payout} until the operator counts again (within 5 minutes): {}",
                kube.explain(e, "patch", "payoutbatches.dlock.io", Some(&name))
            ),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// batch

#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct BatchView {
    pub name: String,
    pub namespace: String,
    /// `Pending` (no status yet), `Running`, `Succeeded`, `Degraded` or `Failed`.
    pub phase: String,
    /// The batch's size (`spec.payouts`).
    pub payouts: usize,
    /// Payouts per state as the operator last counted them in paydb.
    pub counts: BTreeMap<String, i64>,
    pub ambiguous: Vec<String>,
    pub fenced_out: Option<i64>,
    pub summary: Option<String>,
    pub conditions: Vec<Condition>,
    pub job: Option<JobView>,
}

#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct JobView {
    pub name: String,
    /// `Running`, `Complete`, `Failed` or `Absent`.
    pub state: String,
    pub active: i32,
    pub succeeded: i32,
    pub failed: i32,
    pub message: Option<String>,
}

pub fn batch_phase(conditions: &[Condition], job: Option<&JobView>) -> &'static str {
    let is_true = |t: &str| find(conditions, t).is_some_and(|c| c.status == "True");
    if is_true("Degraded") {
        if job.is_some_and(|j| j.state == "Failed") {
            "Failed"
        } else {
            "Degraded"
        }
    } else if is_true("Ready") {
        "Succeeded"
    } else if conditions.is_empty() {
        "Pending"
    } else {
        "Running"
    }
}

fn job_view(name: &str, job: Option<&Job>) -> JobView {
    let Some(job) = job else {
        return JobView {
            name: name.to_owned(),
            state: "Absent".to_owned(),
            active: 0,
            succeeded: 0,
            failed: 0,
            message: None,
        };
    };
    let status = job.status.clone().unwrap_or_default();
    let ended = status
        .conditions
        .iter()
        .flatten()
        .find(|c| c.status == "True" && (c.type_ == "Complete" || c.type_ == "Failed"));
    JobView {
        name: name.to_owned(),
        state: ended.map_or("Running", |c| c.type_.as_str()).to_owned(),
        active: status.active.unwrap_or(0),
        succeeded: status.succeeded.unwrap_or(0),
        failed: status.failed.unwrap_or(0),
        message: ended.and_then(|c| c.message.clone()),
    }
}

async fn batch_view(kube: &Kube, batch: &PayoutBatch) -> Result<BatchView> {
    let status = batch.status.clone().unwrap_or_default();
    let job = match &status.job_name {
        Some(job_name) => {
            let found = kube
                .api::<Job>()
                .get_opt(job_name)
                .await
                .map_err(|e| kube.explain(e, "get", "jobs.batch", Some(job_name)))?;
            Some(job_view(job_name, found.as_ref()))
        }
        None => None,
    };
    Ok(BatchView {
        name: batch.name_any(),
        namespace: kube.namespace.clone(),
        phase: batch_phase(&status.conditions, job.as_ref()).to_owned(),
        payouts: batch.spec.payouts.len(),
        counts: status.counts,
        ambiguous: status.ambiguous,
        fenced_out: status.fenced_out,
        summary: status.summary,
        conditions: status.conditions,
        job,
    })
}

pub fn batch_table(view: &BatchView) -> String {
    let job = view.job.as_ref();
    let mut out = table(
        &["name", "phase", "payouts", "counted", "job", "job-state"],
        &[vec![
            view.name.clone(),
            view.phase.clone(),
            view.payouts.to_string(),
            view.counts.values().sum::<i64>().to_string(),
            job.map(|j| j.name.clone()).unwrap_or_default(),
            job.map(|j| {
                if j.state == "Running" {
                    format!("Running ({} active)", j.active)
                } else {
                    j.state.clone()
                }
            })
            .unwrap_or_default(),
        ]],
    );
    out.push('\n');
    if view.counts.is_empty() {
        out.push_str("No payouts counted yet (the operator counts them in paydb every 10 s while the batch runs).\n");
    } else {
        let rows: Vec<Vec<String>> = view
            .counts
            .iter()
            .map(|(state, n)| vec![state.clone(), n.to_string()])
            .collect();
        out.push_str(&table(&["state", "payouts"], &rows));
    }
    out.push('\n');
    let rows: Vec<Vec<String>> = view
        .conditions
        .iter()
        .map(|c| {
            vec![
                c.type_.clone(),
                c.status.clone(),
                c.reason.clone(),
                cell(&c.message, 100),
            ]
        })
        .collect();
    if rows.is_empty() {
        out.push_str("No conditions yet: the operator has not reconciled the batch.\n");
    } else {
        out.push_str(&table(&["condition", "status", "reason", "message"], &rows));
    }
    if !view.ambiguous.is_empty() {
        out.push_str(&format!(
            "\n{} payout(s) are RAIL_AMBIGUOUS: `kubectl dlock status -n {}` lists them; resolve each with \
             `kubectl dlock resolve PAYOUT --posted --rail-reference R | --failed --evidence TEXT`\n",
            view.ambiguous.len(),
            view.namespace
        ));
    }
    out
}

fn show_batch(view: &BatchView, output: Output, watching: bool) -> Result<()> {
    match output {
        Output::Table => {
            print!("{}", batch_table(view));
            if watching {
                println!();
            }
            Ok(())
        }
        // One document per line while watching, as `kubectl get -w -o json` streams objects.
        Output::Json if watching => {
            println!("{}", serde_json::to_string(view)?);
            Ok(())
        }
        Output::Yaml if watching => {
            print!("---\n{}", serde_yaml_ng::to_string(view)?);
            Ok(())
        }
        _ => print_document(output, view),
    }
}

async fn batch(kube: &Kube, args: BatchArgs, output: Output) -> Result<()> {
    let api = kube.api::<PayoutBatch>();
    let object = api
        .get(&args.name)
        .await
        .map_err(|e| kube.explain(e, "get", "payoutbatches.dlock.io", Some(&args.name)))?;
    let view = batch_view(kube, &object).await?;
    show_batch(&view, output, args.watch)?;
    if !args.watch {
        return Ok(());
    }
    let ended = |v: &BatchView| {
        v.job
            .as_ref()
            .is_some_and(|j| j.state == "Complete" || j.state == "Failed")
    };
    if ended(&view) {
        return Ok(());
    }
    let mut shown = serde_json::to_value(&view)?;
    let watch = kube::runtime::watcher::watch_object(api, &args.name).default_backoff();
    let mut watch = std::pin::pin!(watch);
    let mut failures = 0;
    while let Some(event) = watch.next().await {
        if event.is_ok() {
            failures = 0;
        }
        let object = match event {
            Ok(Some(object)) => object,
            Ok(None) => bail!("PayoutBatch {} was deleted", args.name),
            Err(e) => {
                failures += 1;
                if failures >= WATCH_FAILURES_MAX {
                    bail!(
                        "watching PayoutBatch {}: {e} ({failures} times in a row)",
                        args.name
                    );
                }
                eprintln!("note: watching PayoutBatch {} again after: {e}", args.name);
                continue;
            }
        };
        let view = batch_view(kube, &object).await?;
        let now = serde_json::to_value(&view)?;
        if now != shown {
            show_batch(&view, output, true)?;
            shown = now;
        }
        if ended(&view) {
            return Ok(());
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn condition(type_: &str, status: &str, reason: &str) -> Condition {
        Condition {
            type_: type_.into(),
            status: status.into(),
            reason: reason.into(),
            message: format!("{type_} is {status}"),
            last_transition_time: None,
            observed_generation: None,
        }
    }

    #[test]
    fn durations_read_as_kubectl_writes_them() {
        assert_eq!(parse_duration("90s"), Ok(Duration::from_secs(90)));
        assert_eq!(parse_duration("2m"), Ok(Duration::from_secs(120)));
        assert_eq!(parse_duration("1m30s"), Ok(Duration::from_secs(90)));
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("45"), Ok(Duration::from_secs(45)));
        for bad in ["", "s", "10x", "1.5s", "-3s"] {
            assert!(parse_duration(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn tables_have_upper_case_headers_and_aligned_columns() {
        let text = table(
            &["kind", "name", "message"],
            &[
                vec![
                    "LockServer".into(),
                    "lock-server".into(),
                    "all 2 ready".into(),
                ],
                vec!["RailProxy".into(), "rp".into(), String::new()],
            ],
        );
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines[0], "KIND         NAME          MESSAGE");
        assert_eq!(lines[1], "LockServer   lock-server   all 2 ready");
        assert_eq!(lines[2], "RailProxy    rp            <none>");
    }

    #[test]
    fn a_degraded_resource_explains_itself_with_the_degraded_reason() {
        let view = resource_view(
            "PayoutBatch",
            "b".into(),
            &[
                condition("Ready", "True", "Completed"),
                condition("Degraded", "True", "RailAmbiguous"),
            ],
        );
        assert_eq!(
            (view.ready.as_str(), view.degraded.as_str()),
            ("True", "True")
        );
        assert_eq!(view.reason, "RailAmbiguous");
        let view = resource_view(
            "LockServer",
            "l".into(),
            &[condition("Ready", "True", "Available")],
        );
        assert_eq!(
            (view.degraded.as_str(), view.reason.as_str()),
            ("False", "Available")
        );
        let view = resource_view("RailProxy", "r".into(), &[]);
        assert_eq!((view.ready.as_str(), view.reason.as_str()), ("Unknown", ""));
    }

    #[test]
    fn revocation_names_and_steps() {
        assert_eq!(
            revocation_prefix("payout:Acct_17"),
            "revoke-payout-acct-17-"
        );
        let mut result = RevocationResult {
            request: "r".into(),
            outcome: "Incomplete".into(),
            revocation_id: Some("id".into()),
            revoked_token: Some(41),
            new_token_floor: Some(42),
            payment_fenced: true,
            rail_fenced: false,
            summary: Some("rail proxy unreachable".into()),
        };
        let first = revocation_steps(None, &result, "acct-17");
        assert_eq!(first.len(), 3, "{first:?}");
        assert!(first[0].contains("token 41") && first[0].contains("floor 42"));
        assert!(first[1].starts_with("payment resource"));
        assert!(first[2].starts_with("incomplete"));
        let before = result.clone();
        result.rail_fenced = true;
        result.outcome = "Complete".into();
        let next = revocation_steps(Some(&before), &result, "acct-17");
        assert_eq!(
            next,
            vec!["rail proxy: high-water mark of acct-17 advanced to 42".to_owned()]
        );
    }

    #[test]
    fn a_batch_phase_follows_its_conditions_and_job() {
        let failed = JobView {
            name: "j".into(),
            state: "Failed".into(),
            active: 0,
            succeeded: 0,
            failed: 1,
            message: None,
        };
        assert_eq!(batch_phase(&[], None), "Pending");
        assert_eq!(
            batch_phase(&[condition("Progressing", "True", "Executing")], None),
            "Running"
        );
        assert_eq!(
            batch_phase(&[condition("Ready", "True", "Completed")], None),
            "Succeeded"
        );
        let degraded = [condition("Degraded", "True", "ExecutorFailed")];
        assert_eq!(batch_phase(&degraded, Some(&failed)), "Failed");
        assert_eq!(batch_phase(&degraded, None), "Degraded");
    }
}
