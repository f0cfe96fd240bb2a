//! `dlock accounts`: create and fund the accounts a batch pays from.

use super::*;

#[derive(Debug, Subcommand)]
pub enum AccountsCommand {
    /// Opens each account a PayoutBatch pays from (if it is not open yet) and funds it with what
    /// the batch pays from it, or with --amount-minor. The same command again funds nobody twice:
    /// the funding's idempotency key and reference derive from the batch, account and amount.
    /// It writes as `<identity>/accounts` with the treasury's credential: only an identity the
    /// payment resource lists in `auth.treasury-identities` may open and fund accounts.
    Fund(FundArgs),
    /// Sets an account's limits as a whole, as a treasury identity: the largest single payout
    /// and the most its claims may take in one UTC day, in minor units; an option left out is
    /// no limit of that kind. paydb refuses a payout over them with 422 LIMIT_EXCEEDED.
    Limits(LimitsArgs),
}

/// The treasury's credential: opening and funding accounts creates money, so it is never the
/// executor's (`DLOCK_CREDENTIAL`).
#[derive(Debug, Args)]
pub struct TreasuryCredentialArgs {
    /// The treasury identity the credential authenticates as; the owner id sent is
    /// `<identity>/accounts`.
    #[arg(long = "identity", env = "DLOCK_TREASURY_IDENTITY")]
    pub identity: Option<String>,
    /// A file holding the treasury's bearer token (re-read as it rotates).
    /// `DLOCK_TREASURY_CREDENTIAL` passes the token itself.
    #[arg(long = "credential-file", env = "DLOCK_TREASURY_CREDENTIAL_FILE")]
    pub credential_file: Option<PathBuf>,
}

impl TreasuryCredentialArgs {
    /// A client of the payment resource at `url` as the treasury identity, with owner id
    /// `<identity>/<purpose>` (`dlock-<purpose>` without an identity), presenting
    /// `--credential-file`, else `DLOCK_TREASURY_CREDENTIAL`.
    pub fn client(&self, url: &str, purpose: &str) -> Result<PaymentClient> {
        let owner = match &self.identity {
            Some(identity) => format!("{identity}/{purpose}"),
            None => format!("dlock-{purpose}"),
        };
        let client = PaymentClient::new(url, &owner)?;
        let credential = credential_of(
            self.credential_file.as_deref(),
            "DLOCK_TREASURY_CREDENTIAL_FILE",
            "DLOCK_TREASURY_CREDENTIAL",
        )?;
        Ok(client.with_credential(credential))
    }
}

#[derive(Debug, Args)]
pub struct FundArgs {
    /// The PayoutBatch manifest whose accounts to open and fund.
    #[arg(short = 'f', long = "file")]
    pub file: PathBuf,
    /// Fund each account with this many minor units instead of what the batch pays from it.
    #[arg(long)]
    pub amount_minor: Option<i64>,
    #[arg(long, env = "DLOCK_PAYMENT_RESOURCE")]
    pub payment_resource: String,
    #[command(flatten)]
    pub credentials: TreasuryCredentialArgs,
}

/// One account of a batch: what it pays in total, in which currency.
#[derive(Debug, PartialEq, Eq)]
pub struct Funding {
    pub account_id: String,
    pub currency: String,
    pub amount_minor: i64,
    /// The idempotency key and the funding reference, from the batch, account and amount.
    pub key: String,
}

/// The accounts `batch` pays from, each with what the batch pays from it (or `amount_minor`).
pub fn fundings(batch: &PayoutBatch, amount_minor: Option<i64>) -> Result<Vec<Funding>> {
    let mut totals: std::collections::BTreeMap<&str, (&str, i64)> = Default::default();
    for item in &batch.spec.payouts {
        let entry = totals
            .entry(item.account_id.as_str())
            .or_insert((item.currency.as_str(), 0));
        if entry.0 != item.currency {
            bail!(
                "account {} is paid in {} and {} in this batch; an account has one currency",
                item.account_id,
                entry.0,
                item.currency
            );
        }
        entry.1 = entry.1.saturating_add(item.amount_minor);
    }
    Ok(totals
        .into_iter()
        .map(|(account, (currency, total))| {
            let amount = amount_minor.unwrap_or(total);
            let name = format!(
                "dlock accounts fund/{}/{account}/{currency}/{amount}",
                batch.metadata.name
            );
            Funding {
                account_id: account.to_owned(),
                currency: currency.to_owned(),
                amount_minor: amount,
                key: format!(
                    "fund-{}",
                    Uuid::new_v5(&Uuid::NAMESPACE_URL, name.as_bytes())
                ),
            }
        })
        .collect())
}

pub async fn accounts(command: AccountsCommand) -> Result<()> {
    let args = match command {
        AccountsCommand::Fund(args) => args,
        AccountsCommand::Limits(args) => return set_limits(args).await,
    };
    if args.amount_minor.is_some_and(|a| a <= 0) {
        bail!("--amount-minor must be positive");
    }
    let batch = read_batch(&args.file)?;
    let fundings = fundings(&batch, args.amount_minor)?;
    let payment = args
        .credentials
        .client(&args.payment_resource, "accounts")?;
    println!(
        "{:<24} {:<8} {:>14} {:>14} {:>14}",
        "account", "currency", "funded", "balance", "available"
    );
    for funding in &fundings {
        let account = &funding.account_id;
        payment
            .create_account(
                &format!("open-{account}"),
                &CreateAccountRequest {
                    account_id: account.clone(),
                    currency: funding.currency.clone(),
                },
            )
            .await
            .with_context(|| format!("opening account {account}"))?;
        let funded = payment
            .fund_or_request(
                account,
                &funding.key,
                &FundRequest {
                    amount_minor: funding.amount_minor,
                    reference: funding.key.clone(),
                },
            )
            .await
            .with_context(|| {
                format!(
                    "funding account {account} with {} {}",
                    funding.amount_minor, funding.currency
                )
            })?;
        if let Funded::Pending(pending) = &funded {
            // Above auth.treasury.dual-approval-above (docs/contract.md#dual-approval).
            eprintln!(
                "account {account}: the funding of {} {} waits for a second treasury identity \
                 ({}, as {}); another treasury identity approves it with `dlock fundings \
                 approve {}`",
                funding.amount_minor,
                funding.currency,
                pending.status,
                pending.requested_by,
                pending.funding_id
            );
        }
        let now = payment
            .get_account(account)
            .await
            .with_context(|| format!("reading account {account}"))?;
        println!(
            "{:<24} {:<8} {:>14} {:>14} {:>14}",
            account, now.currency, funding.amount_minor, now.balance_minor, now.available_minor
        );
    }
    eprintln!(
        "funded {} account(s) for batch {} (the same command again funds nobody twice)",
        fundings.len(),
        batch.metadata.name
    );
    Ok(())
}
