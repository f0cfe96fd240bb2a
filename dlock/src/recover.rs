//! `dlock recover`: an operator's confirmation that a store which went back in time has been
//! reconciled (docs/design.md#d-12).

use std::collections::BTreeSet;
use std::path::PathBuf;

use anyhow::{Context, bail};
use clap::{Args, Subcommand};
use dlock_contract::rail::read_statement;
use uuid::Uuid;

#[derive(Subcommand)]
pub enum RecoverCommand {
    /// paydb is on a new timeline after a primary that was not replicating synchronously, and
    /// refuses every write: confirm that it was reconciled (`dlock reconcile`), raise every
    /// account fence and rail high-water mark to a token floor, quarantine every payout the rail
    /// received whose presentation paydb lost, and let it take writes again, in one
    /// transaction. Recorded in pay_store_epoch_changes with the operator and the reason.
    PaydbEpoch(PaydbEpochArgs),
}

#[derive(Args)]
pub struct PaydbEpochArgs {
    /// paydb's URL (the primary). Prefer --paydb-file.
    #[arg(long, env = "DLOCK_PAYDB", required_unless_present = "paydb_file")]
    pub paydb: Option<String>,
    /// A file holding paydb's URL, used instead of --paydb when given.
    #[arg(long, env = "DLOCK_PAYDB_FILE")]
    pub paydb_file: Option<PathBuf>,
    /// lockdb's URL: the token floor is read from it with `dlock_epoch_floor()`, which runs
    /// lockdb's epoch check first, so a lockdb that went back too reports tokens its lost commits
    /// issued (migrations/lockdb/0016_baseline.sql). Prefer --lockdb-file.
    #[arg(long, env = "DLOCK_LOCKDB", conflicts_with_all = ["lockdb_file", "token_floor"])]
    pub lockdb: Option<String>,
    /// A file holding lockdb's URL, used instead of --lockdb.
    #[arg(long, env = "DLOCK_LOCKDB_FILE", conflicts_with = "token_floor")]
    pub lockdb_file: Option<PathBuf>,
    /// The highest fencing token the lock server may have issued, when its store is not a
    /// lockdb this command can read (instead of --lockdb). Every fence and mark below it is
    /// raised to it, so every token issued before it is fenced out and a claim needs a token
    /// issued after: holders acquire again.
    #[arg(long, required_unless_present_any = ["lockdb", "lockdb_file"])]
    pub token_floor: Option<i64>,
    /// The rail whose statement is read (as `dlock reconcile` reads it): every payout it holds
    /// that paydb shows PENDING or CLAIMED with no attempt presented is quarantined
    /// RAIL_AMBIGUOUS with the confirmation. Unreadable: the recovery refuses.
    #[arg(long, env = "DLOCK_RAIL")]
    pub rail: String,
    /// Who confirms (recorded).
    #[arg(long)]
    pub operator: String,
    /// Why, and what was reconciled (recorded).
    #[arg(long)]
    pub reason: String,
}

pub async fn recover(command: RecoverCommand) -> anyhow::Result<()> {
    match command {
        RecoverCommand::PaydbEpoch(args) => paydb_epoch(args).await,
    }
}

/// A URL given directly or in a file (the file wins).
fn url_of(
    name: &str,
    file: &Option<PathBuf>,
    url: &Option<String>,
) -> anyhow::Result<Option<String>> {
    Ok(match (file, url) {
        (Some(file), _) => Some(
            std::fs::read_to_string(file)
                .with_context(|| format!("reading {name}'s URL from {}", file.display()))?
                .trim()
                .to_owned(),
        ),
        (None, Some(url)) => Some(url.clone()),
        (None, None) => None,
    })
}

/// The highest token lockdb may have issued, after its epoch check (a lockdb that went back
/// moves its sequence past the gap first).
async fn lockdb_floor(url: &str) -> anyhow::Result<i64> {
    let pool = dlock_server::pg::pool_options(1, std::time::Duration::from_secs(5))
        .connect(url)
        .await
        .context("connecting to lockdb (the primary) for the token floor")?;
    let floor: i64 = sqlx::query_scalar("SELECT dlock_epoch_floor()")
        .fetch_one(&pool)
        .await
        .context(
            "reading lockdb's token floor (dlock_epoch_floor(): is lockdb migrated to 0010?)",
        )?;
    pool.close().await;
    Ok(floor)
}

async fn paydb_epoch(args: PaydbEpochArgs) -> anyhow::Result<()> {
    if args.operator.trim().is_empty() || args.reason.trim().is_empty() {
        bail!("--operator and --reason are recorded with the recovery: give both");
    }
    let Some(url) = url_of("paydb", &args.paydb_file, &args.paydb)? else {
        bail!("give --paydb or --paydb-file");
    };
    let token_floor = match (
        url_of("lockdb", &args.lockdb_file, &args.lockdb)?,
        args.token_floor,
    ) {
        (Some(lockdb), _) => lockdb_floor(&lockdb).await?,
        (None, Some(floor)) => floor,
        (None, None) => bail!("give --lockdb (or --lockdb-file), or --token-floor"),
    };
    if token_floor <= 0 {
        bail!("the token floor must be a fencing token (> 0), not {token_floor}");
    }
    // What the rail received, as `dlock reconcile` reads it: a payout there that paydb lost the
    // presentation of is quarantined in the confirmation's transaction. Without it, no recovery.
    let statement = read_statement(&args.rail, None).await.with_context(|| {
        format!(
            "reading the rail's statement from {}: the recovery needs it to quarantine the \
             payouts the rail received and paydb lost, and changes nothing without it",
            args.rail
        )
    })?;
    let on_rail: Vec<Uuid> = statement
        .transfers
        .iter()
        .filter_map(|t| Uuid::parse_str(&t.client_ref).ok())
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect();
    let pool = dlock_executor::reconcile::connect(&url).await?;
    let (from_timeline, to_timeline, fences, marks, quarantined): (
        i64,
        i64,
        Option<i32>,
        Option<i32>,
        Option<i32>,
    ) = sqlx::query_as(
        "SELECT from_timeline, to_timeline, fences_raised, marks_raised, quarantined \
         FROM pay_epoch_confirm($1, $2, $3, $4)",
    )
    .bind(token_floor)
    .bind(&args.operator)
    .bind(&args.reason)
    .bind(&on_rail)
    .fetch_one(&pool)
    .await
    .context("confirming paydb's epoch (pay_epoch_confirm; is paydb migrated to 0021?)")?;
    match (fences, marks, quarantined) {
        (Some(fences), Some(marks), Some(quarantined)) => println!(
            "paydb takes writes again on timeline {to_timeline} (was {from_timeline}): {fences} \
             account fences and {marks} rail high-water marks raised to {token_floor}; every \
             holder acquires again. {quarantined} payouts on the rail's statement ({} there) \
             had no attempt left in paydb and are RAIL_AMBIGUOUS now (pay_epoch_quarantined): \
             resolve each with the rail's evidence",
            on_rail.len()
        ),
        _ => println!("paydb is already on its epoch (timeline {to_timeline}): nothing changed"),
    }
    Ok(())
}
