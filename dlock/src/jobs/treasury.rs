//! The treasury's commands beside funding: `dlock accounts limits` sets an account's limits,
//! `dlock fundings list` shows the fundings that wait for a second treasury identity and
//! `dlock fundings approve` applies one (docs/contract.md#account-limits,
//! docs/contract.md#dual-approval). Each goes through the contract's `PaymentClient`; a refusal
//! prints the service's message and what to do about it.

use dlock_contract::client::ClientError;
use dlock_contract::error::ErrorCode;
use dlock_contract::payment::{
    AccountLimitsRequest, ApproveFundingRequest, FundingList, FundingsFilter,
};

use super::*;

#[derive(Debug, Args)]
pub struct LimitsArgs {
    /// The account whose limits to set.
    pub account_id: String,
    /// The largest single payout, in minor units; absent: no such limit.
    #[arg(long = "max-payout", value_name = "MINOR_UNITS")]
    pub max_payout_minor: Option<i64>,
    /// The most the account's claims may take in one UTC day, in minor units; absent: no such
    /// limit.
    #[arg(long = "daily-outflow", value_name = "MINOR_UNITS")]
    pub daily_outflow_minor: Option<i64>,
    #[arg(long, env = "DLOCK_PAYMENT_RESOURCE")]
    pub payment_resource: String,
    #[command(flatten)]
    pub credentials: TreasuryCredentialArgs,
}

#[derive(Debug, Subcommand)]
pub enum FundingsCommand {
    /// Applies a funding that waits for a second treasury identity (printed by `dlock accounts
    /// fund`, and the `fundingId` of the 202 answer). Only a treasury identity other than the
    /// one that asked for it may; the same command again applies nothing twice.
    Approve(ApproveArgs),
    /// Lists the fundings that wait for a second treasury identity (by default), or those
    /// approved and applied, or both: id, account, amount, who asked and when, who approved.
    /// Needs a treasury identity's credential; it changes nothing.
    List(ListFundingsArgs),
}

/// Which fundings `dlock fundings list` shows.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum FundingsState {
    /// Waiting for a second treasury identity.
    Pending,
    /// Approved by a second treasury identity and applied.
    Applied,
    /// Both.
    All,
}

/// How `dlock fundings list` prints.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum ListOutput {
    /// A table for people.
    Table,
    /// The service's answer as JSON, for scripts.
    Json,
}

#[derive(Debug, Args)]
pub struct ListFundingsArgs {
    #[arg(long, value_enum, default_value_t = FundingsState::Pending)]
    pub state: FundingsState,
    /// At most this many, newest request first (1 to 500; the service's default is 100).
    #[arg(long)]
    pub limit: Option<i64>,
    #[arg(short = 'o', long = "output", value_enum, default_value_t = ListOutput::Table)]
    pub output: ListOutput,
    #[arg(long, env = "DLOCK_PAYMENT_RESOURCE")]
    pub payment_resource: String,
    #[command(flatten)]
    pub credentials: TreasuryCredentialArgs,
}

#[derive(Debug, Args)]
pub struct ApproveArgs {
    /// The pending funding's id.
    pub funding_id: Uuid,
    #[arg(long, env = "DLOCK_PAYMENT_RESOURCE")]
    pub payment_resource: String,
    #[command(flatten)]
    pub credentials: TreasuryCredentialArgs,
}

/// What to do after `error`, for a treasury command on `url`.
fn hint(error: &ClientError, url: &str) -> String {
    let details = match error {
        ClientError::Api { body, .. } => body.details.clone().unwrap_or_default(),
        ClientError::Transport { .. } => {
            return format!(
                "is the payment resource at {url} up? Check --payment-resource \
                 (DLOCK_PAYMENT_RESOURCE); a write without an answer may have been applied, so \
                 run the same command again"
            );
        }
        ClientError::Protocol { .. } => {
            return "the answer was not the contract's: is --payment-resource a dlock payment \
                    resource?"
                .to_owned();
        }
    };
    let field = |name: &str| {
        details
            .get(name)
            .and_then(|v| v.as_str())
            .map(str::to_owned)
    };
    match error.code() {
        Some(ErrorCode::Unauthenticated) => "the payment resource does not know this credential: \
             pass a treasury identity's token with --credential-file \
             (DLOCK_TREASURY_CREDENTIAL_FILE)"
            .to_owned(),
        Some(ErrorCode::Forbidden) => match field("requestedBy") {
            Some(requester) => format!(
                "{requester} asked for this funding and may not approve it too: run the command \
                 with another treasury identity's --identity and --credential-file"
            ),
            None => "this credential's identity has no treasury role: use a treasury identity's \
                     --credential-file (the payment resource's auth.treasury-identities)"
                .to_owned(),
        },
        Some(ErrorCode::IdempotencyConflict) => match field("approvedBy") {
            Some(approver) => format!(
                "{approver} approved this funding already; it is applied and nothing changed now"
            ),
            None => "nothing changed".to_owned(),
        },
        Some(ErrorCode::NotFound) => {
            "nothing by that id at this payment resource: check the id and --payment-resource"
                .to_owned()
        }
        Some(ErrorCode::ValidationFailed) => {
            "nothing changed: correct the value the message names and run it again".to_owned()
        }
        _ if error.retry_safe() => "nothing changed: run the same command again".to_owned(),
        _ => "see the payment resource's log for the trace id above".to_owned(),
    }
}

/// For `map_err`: a refusal of `what` by the payment resource at `url` as the command's failure,
/// what the service said, then the hint.
fn refused(what: String, url: &str) -> impl FnOnce(ClientError) -> anyhow::Error + '_ {
    move |error| {
        let trace = match &error {
            ClientError::Api { body, .. } if !body.trace_id.is_empty() => {
                format!(" (trace {})", body.trace_id)
            }
            _ => String::new(),
        };
        anyhow::anyhow!("{what}: {error}{trace}\nhint: {}", hint(&error, url))
    }
}

/// `dlock accounts limits`: the account's limits as a whole (an option left out is no limit of
/// that kind).
pub async fn set_limits(args: LimitsArgs) -> Result<()> {
    for (flag, value) in [
        ("--max-payout", args.max_payout_minor),
        ("--daily-outflow", args.daily_outflow_minor),
    ] {
        if value.is_some_and(|v| v <= 0) {
            bail!("{flag} must be a positive amount in minor units; leave it out for no limit");
        }
    }
    let payment = args.credentials.client(&args.payment_resource, "limits")?;
    // A fresh key: the body replaces the limits as a whole, so sending it again is harmless,
    // and a key derived from the values would replay an older answer after a change.
    let key = format!("limits-{}", Uuid::new_v4());
    let limits = payment
        .set_limits(
            &args.account_id,
            &key,
            &AccountLimitsRequest {
                max_payout_minor: args.max_payout_minor,
                daily_outflow_minor: args.daily_outflow_minor,
            },
        )
        .await
        .map_err(refused(
            format!("setting the limits of account {}", args.account_id),
            &args.payment_resource,
        ))?;
    let shown = |v: Option<i64>| v.map_or_else(|| "none".to_owned(), |v| v.to_string());
    println!(
        "account {}: max payout {}, daily outflow {} (set by {})",
        limits.account_id,
        shown(limits.max_payout_minor),
        shown(limits.daily_outflow_minor),
        limits.set_by
    );
    Ok(())
}

/// `dlock fundings …`.
pub async fn fundings_command(command: FundingsCommand) -> Result<()> {
    let args = match command {
        FundingsCommand::Approve(args) => args,
        FundingsCommand::List(args) => return list_fundings(args).await,
    };
    let payment = args
        .credentials
        .client(&args.payment_resource, "fundings")?;
    let approved = payment
        .approve_funding(
            args.funding_id,
            // The same approval again replays its answer and applies nothing twice.
            &format!("approve-{}", args.funding_id),
            &ApproveFundingRequest {},
        )
        .await
        .map_err(refused(
            format!("approving funding {}", args.funding_id),
            &args.payment_resource,
        ))?;
    println!(
        "funding {} applied: {} to account {} (reference {}), requested by {}, approved by {}; \
         balance {}",
        approved.funding_id,
        approved.amount_minor,
        approved.account_id,
        approved.reference,
        approved.requested_by,
        approved.approved_by,
        approved.balance_minor
    );
    Ok(())
}

/// `dlock fundings list`: a table (or the answer as JSON) of the fundings `--state` selects.
async fn list_fundings(args: ListFundingsArgs) -> Result<()> {
    let filter = match args.state {
        FundingsState::Pending => FundingsFilter::Pending,
        FundingsState::Applied => FundingsFilter::Applied,
        FundingsState::All => FundingsFilter::All,
    };
    let payment = args
        .credentials
        .client(&args.payment_resource, "fundings")?;
    let list = payment
        .list_fundings(Some(filter), args.limit)
        .await
        .map_err(refused(
            format!("listing the {} fundings", filter.as_str()),
            &args.payment_resource,
        ))?;
    match args.output {
        ListOutput::Json => println!("{}", serde_json::to_string_pretty(&list)?),
        ListOutput::Table => print!("{}", fundings_table(&list, filter)),
    }
    Ok(())
}

/// The table `dlock fundings list` prints: one line per funding, then what to do next.
pub fn fundings_table(list: &FundingList, filter: FundingsFilter) -> String {
    use std::fmt::Write as _;
    let mut out = format!(
        "{:<36}  {:<24} {:>16} {:<8} {:<16} {:<20} {:<16} {:<16}\n",
        "FUNDING",
        "ACCOUNT",
        "AMOUNT",
        "CURRENCY",
        "STATUS",
        "REQUESTED",
        "REQUESTED BY",
        "APPROVED BY"
    );
    for f in &list.items {
        let _ = writeln!(
            out,
            "{:<36}  {:<24} {:>16} {:<8} {:<16} {:<20} {:<16} {:<16}",
            f.funding_id,
            f.account_id,
            f.amount_minor,
            f.currency,
            f.status,
            f.requested_at.format("%Y-%m-%dT%H:%M:%SZ"),
            f.requested_by,
            f.approved_by.as_deref().unwrap_or("-"),
        );
    }
    if list.items.is_empty() {
        let _ = writeln!(out, "no {} fundings", filter.as_str());
    } else if list.items.iter().any(|f| f.approved_by.is_none()) {
        let _ = writeln!(
            out,
            "approve one as a treasury identity other than its requester: dlock fundings \
             approve <FUNDING>"
        );
    }
    if list.truncated {
        let _ = writeln!(
            out,
            "more fundings than these {}: raise --limit (at most 500)",
            list.items.len()
        );
    }
    out
}
