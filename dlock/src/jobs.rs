//! The user-facing jobs: `dlock run`, `dlock reconcile`, `dlock resolve`, `dlock revoke`.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use clap::{Args, Subcommand};
use dlock_contract::auth::Credential;
use dlock_contract::client::LockClient;
use dlock_contract::payment::{
    CreateAccountRequest, FundRequest, Funded, Resolution, ResolveRequest,
};
use dlock_contract::payment_client::PaymentClient;
use dlock_contract::rail::RailClient;
use dlock_executor::{Endpoints, PayoutBatch, Report, RunOptions};
use uuid::Uuid;

mod accounts;
mod treasury;

pub use accounts::*;
pub use treasury::*;

#[derive(Debug, Args)]
pub struct RunArgs {
    /// The PayoutBatch manifest (the same YAML the operator takes).
    #[arg(short = 'f', long = "file")]
    pub file: PathBuf,
    #[command(flatten)]
    pub services: ServiceArgs,
    /// Concurrent workers in this process (default: the manifest's spec.workers).
    #[arg(long)]
    pub workers: Option<usize>,
    /// The TTL asked for the lock-server session. Default: long enough that the session never
    /// cuts a lock short (one and a half lock TTLs), and at least 15 s.
    #[arg(long)]
    pub session_ttl_ms: Option<i64>,
    /// The TTL asked for each payout's lock. Default: long enough for a submit that waits the
    /// whole rail read timeout (plus 2 s) and the post after it, and at least 10 s.
    #[arg(long)]
    pub lock_ttl_ms: Option<i64>,
    /// The worker identity sent as X-Owner-Id (default: `<identity>/<host>-<pid>`, or
    /// `dlock-run-<host>-<pid>` without an identity).
    #[arg(long)]
    pub owner_id: Option<String>,
    #[command(flatten)]
    pub credentials: CredentialArgs,
    /// The identity that registers the batch's payouts (the registrar role) when it is not the
    /// executor's: its owner ids are `<identity>/…`. With it, `--registrar-credential-file` or
    /// `DLOCK_REGISTRAR_CREDENTIAL` is its bearer token.
    #[arg(long, env = "DLOCK_REGISTRAR_IDENTITY")]
    pub registrar_identity: Option<String>,
    /// A file holding the registrar's bearer token.
    #[arg(long, env = "DLOCK_REGISTRAR_CREDENTIAL_FILE")]
    pub registrar_credential_file: Option<PathBuf>,
    /// Run payouts someone else registered (the operator, for a PayoutBatch's Job): register
    /// nothing, so the executor's identity needs no registrar role.
    #[arg(long)]
    pub no_register: bool,
    /// The rail proxy's read timeout towards the rail; a submit waits this plus 2 s
    /// (docs/contract.md#s3-8). In Kubernetes the operator sets it from the batch's RailProxy.
    #[arg(long, env = "DLOCK_RAIL_READ_TIMEOUT_MS", default_value_t = 8_000)]
    pub rail_read_timeout_ms: u64,
    /// Send each step's concurrent calls (acquire, claim, submit, post, release) as batch
    /// requests of up to this many items, 1 to 64 (docs/contract.md#batches); 1 sends one
    /// request per payout per step. Default: the manifest's spec.batchMax (32 when absent).
    #[arg(long, env = "DLOCK_BATCH_MAX",
        value_parser = clap::value_parser!(u16).range(1..=dlock_contract::batch::MAX_ITEMS as i64))]
    pub batch_max: Option<u16>,
    /// Give up waiting for in-flight payouts after this long.
    #[arg(long, default_value_t = 300)]
    pub settle_timeout_s: u64,
    /// Serve `/metrics` (payout_execute_total, payout_backlog_age_seconds) here while running.
    #[arg(long)]
    pub metrics_listen: Option<std::net::SocketAddr>,
}

/// The three services' URLs, as `dlock run` and `dlock revoke` take them.
#[derive(Debug, Args)]
pub struct ServiceArgs {
    #[arg(long, env = "DLOCK_LOCK_SERVER")]
    pub lock_server: String,
    #[arg(long, env = "DLOCK_PAYMENT_RESOURCE")]
    pub payment_resource: String,
    #[arg(long, env = "DLOCK_RAIL_PROXY")]
    pub rail_proxy: String,
}

impl RunArgs {
    pub fn endpoints(&self) -> Endpoints {
        Endpoints {
            lock_server: self.services.lock_server.clone(),
            payment_resource: self.services.payment_resource.clone(),
            rail_proxy: self.services.rail_proxy.clone(),
        }
    }
}

/// Who `dlock run` and `dlock accounts` are towards the services: the identity their owner ids
/// are bound to and the bearer token they present.
#[derive(Debug, Args)]
pub struct CredentialArgs {
    /// The identity the credential authenticates as; the owner ids sent are bound to it
    /// (`<identity>/…`).
    #[arg(long, env = "DLOCK_IDENTITY")]
    pub identity: Option<String>,
    /// A file holding the bearer token to present (re-read as it rotates; a projected
    /// service-account token in Kubernetes). `DLOCK_CREDENTIAL` passes the token itself.
    #[arg(long, env = "DLOCK_CREDENTIAL_FILE")]
    pub credential_file: Option<PathBuf>,
}

impl CredentialArgs {
    /// The credential of this process: `--credential-file`, else `DLOCK_CREDENTIAL`.
    pub fn credential(&self) -> Result<Option<Credential>> {
        credential_of(
            self.credential_file.as_deref(),
            "DLOCK_CREDENTIAL_FILE",
            "DLOCK_CREDENTIAL",
        )
    }
}

/// The credential in `file` when one is given, else the file named by `file_var`, else the
/// token in `token_var`; none of them is `None`.
pub fn credential_of(
    file: Option<&std::path::Path>,
    file_var: &str,
    token_var: &str,
) -> Result<Option<Credential>> {
    match file {
        Some(path) => Credential::from_file(path).map(Some),
        None => Credential::from_env_named(file_var, token_var),
    }
    .map_err(anyhow::Error::msg)
}

pub fn read_batch(file: &std::path::Path) -> Result<PayoutBatch> {
    let text =
        std::fs::read_to_string(file).with_context(|| format!("reading {}", file.display()))?;
    dlock_executor::manifest::parse(&text).with_context(|| format!("in {}", file.display()))
}

pub async fn run(args: RunArgs) -> Result<()> {
    let batch = read_batch(&args.file)?;
    let options = run_options(&args, &batch)?;
    eprintln!(
        "running batch {} ({} payouts) with {} workers as {}",
        batch.metadata.name,
        batch.spec.payouts.len(),
        options.workers,
        options.owner_id
    );
    let metrics_server = args
        .metrics_listen
        .map(|addr| serve_run_metrics(addr, options.metrics.clone()));
    let report = dlock_executor::execute(&batch, &args.endpoints(), options).await?;
    if let Some(server) = metrics_server {
        server.abort();
    }
    println!("{}", report.table());
    print_run_summary(&args, &report);
    if !report.complete {
        bail!("the batch stopped before every payout was terminal or RAIL_AMBIGUOUS; run it again");
    }
    Ok(())
}

/// The executor's options from the arguments and the manifest.
fn run_options(args: &RunArgs, batch: &PayoutBatch) -> Result<RunOptions> {
    // A cycle must outlast a rail that takes its whole read timeout, or a slow success is
    // posted only by a later cycle: the TTLs follow the read timeout unless given.
    let lock_ttl_ms = args.lock_ttl_ms.unwrap_or_else(|| {
        dlock_executor::executor::lock_ttl_ms_for(
            Duration::from_millis(args.rail_read_timeout_ms),
            RunOptions::default().safety_margin,
        )
    });
    let options = RunOptions {
        workers: args.workers.unwrap_or(batch.spec.workers as usize),
        session_ttl_ms: args
            .session_ttl_ms
            .unwrap_or_else(|| dlock_executor::executor::session_ttl_ms_for(lock_ttl_ms)),
        lock_ttl_ms,
        owner_id: args.owner_id.clone().unwrap_or_else(|| {
            dlock_executor::executor::owner_id_for(args.credentials.identity.as_deref())
        }),
        credential: args.credentials.credential()?,
        registrar: match &args.registrar_identity {
            Some(identity) => Some((
                dlock_executor::executor::owner_id_for(Some(identity)),
                credential_of(
                    args.registrar_credential_file.as_deref(),
                    "DLOCK_REGISTRAR_CREDENTIAL_FILE",
                    "DLOCK_REGISTRAR_CREDENTIAL",
                )?,
            )),
            None => None,
        },
        register: !args.no_register,
        batch_max: args
            .batch_max
            .map_or(batch.spec.batch_max as usize, usize::from),
        rail_read_timeout: Duration::from_millis(args.rail_read_timeout_ms),
        settle_timeout: Duration::from_secs(args.settle_timeout_s),
        progress: true,
        ..RunOptions::default()
    };
    Ok(options)
}

/// Serves this run's `/metrics` at `addr` while it runs; a failure to listen is a warning only.
fn serve_run_metrics(
    addr: std::net::SocketAddr,
    metrics: std::sync::Arc<dlock_executor::metrics::Metrics>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        if let Err(error) = metrics.serve(addr).await {
            tracing::warn!(
                event = "metrics_listen_failed",
                %addr,
                error = format!("{error:#}"),
                "the executor's /metrics is not served (the batch runs on): free the \
                 address or pick another --metrics-listen"
            );
        }
    })
}

/// Prints the [`summary`] of a run, with the services' and the run's own `/metrics`.
fn print_run_summary(args: &RunArgs, report: &Report) {
    let endpoints = args.endpoints();
    let metrics = args
        .metrics_listen
        .map(|addr| format!("http://{addr}/metrics"));
    print!(
        "{}",
        summary(
            report,
            &[
                ("lock server", endpoints.lock_server.as_str()),
                ("payment resource", endpoints.payment_resource.as_str()),
                ("rail proxy", endpoints.rail_proxy.as_str()),
            ],
            metrics.as_deref(),
        )
    );
}

/// Up to this many quarantined payouts, the summary prints each one's resolve commands.
const SUMMARY_COMMANDS_SHOWN: usize = 3;
/// Beyond that, it names this many and says how to list the rest.
const SUMMARY_IDS_SHOWN: usize = 5;

/// What a person reads after the table of a run: what was paid, what is quarantined and why,
/// what to do next (the exact commands) and where the metrics are. `services` are
/// (name, base URL) pairs; `run_metrics` is this run's own `/metrics`, if it served one.
pub fn summary(report: &Report, services: &[(&str, &str)], run_metrics: Option<&str>) -> String {
    let mut out = String::from("summary:\n");
    let ambiguous = summarize_states(report, &mut out);
    if ambiguous > 0 {
        out.push_str(&next_steps(&report.ambiguous));
    }
    out.push_str(&metrics_line(services, run_metrics));
    out
}

/// The lines of the summary per outcome; returns how many payouts are quarantined.
fn summarize_states(report: &Report, out: &mut String) -> usize {
    let n = |state: &str| report.states.get(state).copied().unwrap_or(0);
    out.push_str(&format!(
        "  paid         {:>6}  POSTED: the rail took them and the ledger has them\n",
        n("POSTED")
    ));
    if n("FAILED") > 0 {
        out.push_str(&format!(
            "  failed       {:>6}  FAILED: declined by the rail or not enough funds; nothing left \
             the account (GET /v1/payouts?state=FAILED says which)\n",
            n("FAILED")
        ));
    }
    if n("ABANDONED") > 0 {
        out.push_str(&format!(
            "  abandoned    {:>6}  ABANDONED: cancelled or out of attempts before the rail; never paid\n",
            n("ABANDONED")
        ));
    }
    let ambiguous = report.ambiguous.len().max(n("RAIL_AMBIGUOUS"));
    out.push_str(&format!(
        "  quarantined  {ambiguous:>6}  RAIL_AMBIGUOUS{}\n",
        if ambiguous > 0 {
            ": the rail's answer was lost (a timeout, a reset, a 5xx or a redirect), so it may \
             or may not have paid; dlock never sends them again"
        } else {
            ""
        }
    ));
    let open: usize = report
        .states
        .iter()
        .filter(|(state, _)| {
            !matches!(
                state.as_str(),
                "POSTED" | "FAILED" | "ABANDONED" | "RAIL_AMBIGUOUS"
            )
        })
        .map(|(_, n)| n)
        .sum();
    if open > 0 {
        out.push_str(&format!(
            "  unfinished   {open:>6}  not terminal yet: run the same command again (ids come from \
             the batch, so nobody is paid twice)\n"
        ));
    }
    if report.fenced_out > 0 {
        out.push_str(&format!(
            "  fenced out   {:>6}  cycles refused with FENCED_OUT: a newer lock holder (or a \
             revocation) took the account over, as designed\n",
            report.fenced_out
        ));
    }
    ambiguous
}

/// What to do about the quarantined payouts: reconcile, then resolve each (the commands for a
/// few, else the pattern and some of the ids).
fn next_steps(ambiguous: &[Uuid]) -> String {
    let mut out = String::new();
    out.push_str(
        "next:\n  dlock reconcile     classifies each quarantined payout against the rail's \
         statement (DLOCK_PAYDB, DLOCK_RAIL)\n",
    );
    let mut ids = ambiguous.to_vec();
    ids.sort();
    if ids.len() <= SUMMARY_COMMANDS_SHOWN {
        for id in &ids {
            out.push_str(&format!(
                "  dlock resolve {id} --posted --rail-reference REF --operator YOU --evidence TEXT   (on the statement)\n  \
                 dlock resolve {id} --failed --operator YOU --evidence TEXT   (not on it after the rail's settlement window)\n"
            ));
        }
    } else {
        out.push_str(
            "  then for each: dlock resolve ID --posted --rail-reference REF --operator YOU --evidence TEXT   (on the statement)\n  \
             or:            dlock resolve ID --failed --operator YOU --evidence TEXT   (not on it after the rail's settlement window)\n",
        );
        let shown: Vec<String> = ids
            .iter()
            .take(SUMMARY_IDS_SHOWN)
            .map(Uuid::to_string)
            .collect();
        out.push_str(&format!(
            "  quarantined: {}, and {} more (GET /v1/payouts?state=RAIL_AMBIGUOUS lists them)\n",
            shown.join(", "),
            ids.len() - shown.len()
        ));
    }
    out
}

/// Where the metrics are: this run's own `/metrics` first, then the services'.
fn metrics_line(services: &[(&str, &str)], run_metrics: Option<&str>) -> String {
    let mut metrics: Vec<String> = services
        .iter()
        .map(|(name, base)| format!("{}/metrics ({name})", base.trim_end_matches('/')))
        .collect();
    if let Some(run) = run_metrics {
        metrics.insert(0, format!("{run} (this run, while it runs)"));
    }
    if metrics.is_empty() {
        String::new()
    } else {
        format!("metrics: {}\n", metrics.join(", "))
    }
}

#[derive(Debug, Args)]
pub struct ReconcileArgs {
    /// paydb's URL (the reconciler reads it directly; it never writes). Prefer --paydb-file:
    /// whoever can read this process's environment or arguments sees this one.
    #[arg(long, env = "DLOCK_PAYDB", required_unless_present = "paydb_file")]
    pub paydb: Option<String>,
    /// A file holding paydb's URL, used instead of --paydb when given (in Kubernetes its
    /// Secret's key, mounted read-only; the operator names it).
    #[arg(long, env = "DLOCK_PAYDB_FILE")]
    pub paydb_file: Option<PathBuf>,
    /// The rail whose statement is compared (the stub in development).
    #[arg(long, env = "DLOCK_RAIL")]
    pub rail: String,
    /// Print the findings as JSON.
    #[arg(long)]
    pub json: bool,
    /// An unresolved intent older than this is reported (the rail read timeout plus margin).
    #[arg(long, default_value_t = 10_000)]
    pub unresolved_budget_ms: u64,
    /// A POSTED payout missing from the rail's statement longer than this after its posting is
    /// reported (the rail's settlement window; the stub's statement has no lag).
    #[arg(long, default_value_t = dlock_executor::reconcile::DEFAULT_SETTLEMENT_WINDOW.as_millis() as u64)]
    pub settlement_window_ms: u64,
    /// Also write a compact JSON summary of the findings (at most 4096 bytes) to this file: in
    /// Kubernetes `/dev/termination-log`, which the operator reads into the Reconciliation's
    /// status. Off when unset.
    #[arg(long, env = "DLOCK_TERMINATION_LOG")]
    pub termination_log: Option<PathBuf>,
}

pub use dlock_contract::reconcile::{ReconcileSummary, TERMINATION_MESSAGE_MAX};

/// The termination summary of `findings`, within [`TERMINATION_MESSAGE_MAX`] bytes as JSON.
pub fn termination_summary(findings: &dlock_executor::reconcile::Findings) -> String {
    use dlock_executor::reconcile::Severity;
    let count = |s: Severity| findings.findings.iter().filter(|f| f.severity == s).count();
    let mut ordered: Vec<_> = findings.findings.iter().collect();
    ordered.sort_by_key(|f| std::cmp::Reverse(f.severity));
    let lines: Vec<String> = ordered
        .iter()
        .map(|f| {
            let severity = match f.severity {
                Severity::Critical => "critical",
                Severity::Warning => "warning",
                Severity::Info => "info",
            };
            let line = format!("{severity} {} {}: {}", f.kind, f.subject, f.detail);
            line.chars().take(240).collect()
        })
        .collect();
    let mut summary = ReconcileSummary {
        critical: count(Severity::Critical),
        warning: count(Severity::Warning),
        info: count(Severity::Info),
        accounts_checked: findings.accounts_checked,
        payouts_checked: findings.payouts_checked,
        statement: findings.statement.clone(),
        findings: lines,
        omitted: 0,
    };
    loop {
        let text = serde_json::to_string(&summary).unwrap_or_default();
        if text.len() <= TERMINATION_MESSAGE_MAX || summary.findings.is_empty() {
            return text;
        }
        summary.findings.pop();
        summary.omitted += 1;
    }
}

/// The secret in `file` (a database URL), trimmed; the error names the file, never its text.
pub fn secret_from_file(file: &std::path::Path, what: &str) -> Result<String> {
    let text = std::fs::read_to_string(file)
        .with_context(|| format!("reading {what} from {}", file.display()))?;
    let value = text.trim();
    if value.is_empty() {
        bail!(
            "{} is empty: it must hold {what} (in Kubernetes, check the Secret's key)",
            file.display()
        );
    }
    Ok(value.to_owned())
}

impl ReconcileArgs {
    /// paydb's URL: the file's when one is given, else `--paydb`.
    pub fn paydb_url(&self) -> Result<String> {
        match (&self.paydb_file, &self.paydb) {
            (Some(file), _) => secret_from_file(file, "paydb's URL"),
            (None, Some(url)) => Ok(url.clone()),
            (None, None) => bail!("say where paydb is: --paydb-file FILE (or DLOCK_PAYDB_FILE)"),
        }
    }
}

/// Exit status 2 when a finding is critical.
pub async fn reconcile(args: ReconcileArgs) -> Result<std::process::ExitCode> {
    let pool = dlock_executor::reconcile::connect(&args.paydb_url()?).await?;
    let options = dlock_executor::reconcile::Options {
        unresolved_budget: Duration::from_millis(args.unresolved_budget_ms),
        settlement_window: Duration::from_millis(args.settlement_window_ms),
    };
    let findings = dlock_executor::reconcile::reconcile_with(&pool, &args.rail, &options).await?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&findings)?);
    } else {
        print!("{}", findings.table());
    }
    if let Some(path) = &args.termination_log {
        std::fs::write(path, termination_summary(&findings))
            .with_context(|| format!("writing the summary to {}", path.display()))?;
    }
    Ok(if findings.critical() {
        std::process::ExitCode::from(2)
    } else {
        std::process::ExitCode::SUCCESS
    })
}

/// What a resolution decides, as `dlock resolve` and `kubectl dlock resolve` both take it.
#[derive(Debug, Clone, Args)]
pub struct Decision {
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
}

#[derive(Debug, Args)]
pub struct ResolveArgs {
    #[command(flatten)]
    pub decision: Decision,
    #[arg(long)]
    pub operator: String,
    /// What the decision rests on (a statement line, a rail ticket).
    #[arg(long)]
    pub evidence: String,
    #[arg(long, env = "DLOCK_PAYMENT_RESOURCE")]
    pub payment_resource: String,
    #[arg(long, env = "DLOCK_OPERATOR_TOKEN")]
    pub operator_token: String,
}

pub async fn resolve(args: ResolveArgs) -> Result<()> {
    let outcome = match (args.decision.posted, args.decision.failed) {
        (true, false) => Resolution::Posted,
        (false, true) => Resolution::Failed,
        _ => bail!("say --posted --rail-reference R or --failed"),
    };
    let payment = PaymentClient::new(&args.payment_resource, &args.operator)?
        .as_operator(&args.operator_token);
    let body = ResolveRequest {
        outcome,
        rail_reference: args.decision.rail_reference.clone(),
        operator: args.operator.clone(),
        evidence: args.evidence.clone(),
    };
    let resolved = payment
        .resolve(
            args.decision.payout_id,
            &format!("resolve-{}", args.decision.payout_id),
            &body,
        )
        .await
        .with_context(|| format!("resolving {}", args.decision.payout_id))?;
    println!(
        "payout {} is {} ({} ledger entries; balance {})",
        resolved.payout_id,
        resolved.state.as_str(),
        resolved.entries.len(),
        resolved.balance_minor
    );
    Ok(())
}

#[derive(Debug, Args)]
pub struct RevokeArgs {
    /// The lock key, `payout:{accountId}`.
    pub key: String,
    #[arg(long)]
    pub reason: String,
    #[arg(long)]
    pub operator: String,
    /// Revoke only the grant with this fencing token (L8's expectedToken guard). Without it, the
    /// grant holding the key when it is read just before L8.
    #[arg(long)]
    pub expected_token: Option<i64>,
    /// Resume an earlier revocation that did not reach every fence: its revocation id (printed by
    /// that run). L8 is not called again; both fences get the recorded floor.
    #[arg(long, requires = "floor", conflicts_with = "settle")]
    pub resume: Option<Uuid>,
    /// The new token floor of the revocation given with --resume.
    #[arg(long, requires = "resume")]
    pub floor: Option<i64>,
    /// Settle an earlier run whose L8 for this token has no known outcome (that run exited 3):
    /// the key is read first; still held under the token, L8 is sent for that grant again;
    /// not, the revocation took effect and both fences get the token after it. Never an L8 for
    /// another grant.
    #[arg(long, value_name = "TOKEN", conflicts_with = "expected_token")]
    pub settle: Option<i64>,
    #[command(flatten)]
    pub services: ServiceArgs,
    #[arg(long, env = "DLOCK_OPERATOR_TOKEN")]
    pub operator_token: String,
    #[arg(long)]
    pub json: bool,
}

/// `dlock revoke`'s exit status when L8's outcome is unknown: its answer was lost and the key
/// could not be read to settle it (1 is a failure, 0 a revocation at both fences).
pub const EXIT_OUTCOME_UNKNOWN: u8 = 3;

pub async fn revoke(args: RevokeArgs) -> Result<std::process::ExitCode> {
    use dlock_contract::revoke::{Outcome, Progress, RevokeClients, RevokeOrder};

    let credential = Some(Credential::fixed(&args.operator_token));
    let clients = RevokeClients {
        lock: LockClient::new(&args.services.lock_server, &args.operator)?
            .with_credential(credential.clone()),
        payment: PaymentClient::new(&args.services.payment_resource, &args.operator)?
            .with_credential(credential.clone()),
        rail: RailClient::new(
            &args.services.rail_proxy,
            &args.operator,
            Duration::from_secs(8),
        )?
        .with_credential(credential),
    };
    let order = RevokeOrder::for_key(&args.key, &args.operator, &args.reason, args.expected_token)
        .map_err(anyhow::Error::msg)?;
    let resume = match (args.resume, args.floor) {
        (Some(revocation_id), Some(new_token_floor)) => Some(Progress {
            revocation_id,
            new_token_floor,
            revoked_token: None,
            payment_fenced: false,
            rail_fenced: false,
        }),
        _ => None,
    };
    let report = match (resume, args.settle) {
        (None, Some(token)) => {
            dlock_contract::revoke::settle_and_run(&clients, &order, token).await
        }
        (resume, _) => dlock_contract::revoke::run(&clients, &order, resume.as_ref()).await,
    };
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        for line in report.lines() {
            println!("{line}");
        }
    }
    match (report.outcome, &report.progress) {
        (Outcome::Complete, _) => Ok(std::process::ExitCode::SUCCESS),
        (Outcome::Unknown, _) => {
            let token = report.unsettled_token().unwrap_or_default();
            let key = &args.key;
            eprintln!(
                "dlock revoke: the outcome of L8 for token {token} is unknown: its answer was \
                 lost and reading {key} afterwards failed, so it may or may not have revoked \
                 that grant. Nothing was resent. Check the key at the lock server (GET \
                 {}/v1/locks/{key}): held under token {token}, nothing was revoked; not, it was, \
                 and both fences still need floor {}. Either way, run the same command with \
                 --settle {token} (instead of --expected-token): it reads the key first, then \
                 revokes that grant only or finishes the fences.",
                args.services.lock_server.trim_end_matches('/'),
                token.saturating_add(1)
            );
            Ok(std::process::ExitCode::from(EXIT_OUTCOME_UNKNOWN))
        }
        (Outcome::Incomplete, Some(p)) => bail!(
            "the revocation is not at every fence yet; finish it with --resume {} --floor {}",
            p.revocation_id,
            p.new_token_floor
        ),
        (Outcome::Incomplete, None) => bail!(
            "nothing was revoked ({}); the same command may be run again",
            report.summary()
        ),
        _ => bail!("the revocation did not complete: {}", report.summary()),
    }
}

#[cfg(test)]
mod tests;

#[cfg(test)]
mod run_options_tests {
    use clap::Parser;

    use super::*;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        run: RunArgs,
    }

    fn options(flags: &[&str], manifest: &str) -> RunOptions {
        let services = [
            "dlock",
            "-f",
            "batch.yaml",
            "--lock-server",
            "http://locks",
            "--payment-resource",
            "http://payments",
            "--rail-proxy",
            "http://rail",
        ];
        let cli = Cli::try_parse_from(services.iter().chain(flags))
            .unwrap_or_else(|e| panic!("{flags:?}: {e}"));
        let batch = dlock_executor::manifest::parse(manifest).unwrap_or_else(|e| panic!("{e}"));
        run_options(&cli.run, &batch).unwrap_or_else(|e| panic!("{e}"))
    }

    const MANIFEST: &str = "apiVersion: dlock.io/v1alpha1\nkind: PayoutBatch\n\
        metadata: {name: b}\nspec:\n  workers: 2\n  batchMax: 16\n  payouts:\n  \
        - {key: k, accountId: acct-1, amountMinor: 1, currency: EUR, beneficiaryRef: ben-1}\n";

    /// The batch size is `--batch-max` when given, else the manifest's `spec.batchMax` (as the
    /// operator's Job runs it: no flag), else 32; the flag keeps the batch request's range.
    #[test]
    fn the_batch_size_is_the_flag_else_the_manifests_batch_max() {
        assert_eq!(options(&[], MANIFEST).batch_max, 16);
        assert_eq!(options(&["--batch-max", "4"], MANIFEST).batch_max, 4);
        assert_eq!(options(&["--batch-max", "64"], MANIFEST).batch_max, 64);
        let absent = MANIFEST.replace("  batchMax: 16\n", "");
        assert_ne!(absent, MANIFEST);
        assert_eq!(options(&[], &absent).batch_max, 32);
        assert_eq!(options(&[], &absent).workers, 2);
        for outside in ["0", "65"] {
            assert!(
                Cli::try_parse_from([
                    "dlock",
                    "-f",
                    "b.yaml",
                    "--lock-server",
                    "l",
                    "--payment-resource",
                    "p",
                    "--rail-proxy",
                    "r",
                    "--batch-max",
                    outside,
                ])
                .is_err(),
                "--batch-max {outside}"
            );
        }
    }
}
