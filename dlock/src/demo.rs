//! `dlock demo`: the whole story in one command. It starts the local stack with the rail's
//! faults on, opens and funds forty accounts, runs a thousand-payout batch, prints the final
//! table and the reconciler's findings, and stops everything it started.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use clap::Args;
use dlock_contract::client::ClientError;
use dlock_contract::payment::{CreateAccountRequest, FundRequest};
use dlock_contract::payment_client::PaymentClient;
use dlock_executor::{Endpoints, PayoutBatch, RunOptions};

use crate::dev::{BackendArg, UpArgs, start_stack};

const DEMO_BATCH: &str = include_str!("demo-payoutbatch.yaml");
/// Accounts the demo batch pays from, and what each is funded with (minor units).
const ACCOUNTS: usize = 40;
const FUNDING_MINOR: i64 = 10_000_000;
/// acct-040 gets only this much, so that some of its payouts fail for insufficient funds.
const SHORT_FUNDING_MINOR: i64 = 400_000;

#[derive(Debug, Args)]
pub struct DemoArgs {
    /// Run another PayoutBatch instead of the built-in demo batch.
    #[arg(short = 'f', long = "file")]
    pub file: Option<PathBuf>,
    #[arg(long, value_enum, default_value = "pg")]
    pub backend: BackendArg,
    #[arg(long, default_value_t = 16)]
    pub workers: usize,
    #[arg(long, default_value_t = 10)]
    pub rail_latency_ms: u64,
    #[arg(long, default_value_t = 0.05)]
    pub rail_failure_rate: f64,
    #[arg(long, default_value_t = 0.5)]
    pub rail_duplicate_ack_rate: f64,
    #[arg(long, default_value_t = 1_500)]
    pub rail_read_timeout_ms: u64,
}

async fn open_accounts(payment: &PaymentClient, batch: &PayoutBatch) -> Result<()> {
    let mut accounts: Vec<(String, String)> = batch
        .spec
        .payouts
        .iter()
        .map(|p| (p.account_id.clone(), p.currency.clone()))
        .collect();
    accounts.sort();
    accounts.dedup();
    for (n, (account, currency)) in accounts.iter().enumerate() {
        let body = CreateAccountRequest {
            account_id: account.clone(),
            currency: currency.clone(),
        };
        payment
            .create_account(&format!("demo-open-{account}"), &body)
            .await
            .with_context(|| format!("opening {account}"))?;
        let amount = if n + 1 == ACCOUNTS.min(accounts.len()) {
            SHORT_FUNDING_MINOR
        } else {
            FUNDING_MINOR
        };
        let fund = FundRequest {
            amount_minor: amount,
            reference: format!("demo-seed-{account}"),
        };
        match payment
            .fund(account, &format!("demo-fund-{account}"), &fund)
            .await
        {
            Ok(_) => {}
            Err(ClientError::Api { body, .. })
                if body.code == dlock_contract::ErrorCode::IdempotencyConflict => {}
            Err(e) => return Err(e).with_context(|| format!("funding {account}")),
        }
    }
    eprintln!("demo: opened and funded {} accounts", accounts.len());
    Ok(())
}

pub async fn demo(args: DemoArgs) -> Result<std::process::ExitCode> {
    let batch = match &args.file {
        Some(file) => crate::jobs::read_batch(file)?,
        None => dlock_executor::manifest::parse(DEMO_BATCH).context("the built-in demo batch")?,
    };
    let up = UpArgs {
        backend: args.backend,
        rail_latency_ms: args.rail_latency_ms,
        rail_failure_rate: args.rail_failure_rate,
        rail_duplicate_ack_rate: args.rail_duplicate_ack_rate,
        rail_redirect_rate: 0.0,
        rail_read_timeout_ms: args.rail_read_timeout_ms,
        treasury_dual_approval_above: None,
        durable: false,
        pg_settings: Vec::new(),
        data_dir: None,
        detach: false,
        remove_data_dir: false,
    };
    eprintln!(
        "demo: starting the local stack (rail latency {} ms, failure rate {}, duplicate-ack rate {})",
        up.rail_latency_ms, up.rail_failure_rate, up.rail_duplicate_ack_rate
    );
    let (stack, line) = tokio::task::spawn_blocking(move || start_stack(&up)).await??;
    let result = run_demo(&args, &batch, &line).await;
    eprintln!("demo: stopping the stack");
    tokio::task::spawn_blocking(move || drop(stack)).await?;
    result
}

async fn run_demo(
    args: &DemoArgs,
    batch: &PayoutBatch,
    line: &crate::dev::UpLine,
) -> Result<std::process::ExitCode> {
    let (Some(payment_url), Some(rail_url), Some(stub_url)) = (
        line.payment_resource.clone(),
        line.rail_proxy.clone(),
        line.rail_stub.clone(),
    ) else {
        bail!("the local stack did not start every service");
    };
    let endpoints = Endpoints {
        lock_server: line.lock_server.clone(),
        payment_resource: payment_url.clone(),
        rail_proxy: rail_url,
    };
    // The stack checks credentials; the demo writes as the stack's executor identity.
    let credential = Some(dlock_contract::auth::Credential::fixed(
        &line.credentials.executor,
    ));
    let owner = format!("{}/dlock-demo", crate::dev::DEV_EXECUTOR_IDENTITY);
    // Accounts are opened and funded by the treasury, the only identity allowed to.
    let treasury = PaymentClient::new(
        &payment_url,
        &format!("{}/dlock-demo", crate::dev::DEV_TREASURY_IDENTITY),
    )?
    .with_credential(Some(dlock_contract::auth::Credential::fixed(
        &line.credentials.treasury,
    )));
    open_accounts(&treasury, batch).await?;
    let options = RunOptions {
        workers: args.workers,
        owner_id: owner.clone(),
        credential,
        // The payouts are registered by the registrar, the one role that may.
        registrar: Some((
            format!("{}/dlock-demo", crate::dev::DEV_REGISTRAR_IDENTITY),
            Some(dlock_contract::auth::Credential::fixed(
                &line.credentials.registrar,
            )),
        )),
        rail_read_timeout: Duration::from_millis(args.rail_read_timeout_ms),
        progress: true,
        ..RunOptions::default()
    };
    eprintln!(
        "demo: running {} payouts with {} workers",
        batch.spec.payouts.len(),
        options.workers
    );
    let report = dlock_executor::execute(batch, &endpoints, options).await?;
    println!("\n{}", report.table());
    let pool = dlock_executor::reconcile::connect(&line.paydb).await?;
    let findings = dlock_executor::reconcile::reconcile(
        &pool,
        &stub_url,
        Duration::from_millis(args.rail_read_timeout_ms + 2_000),
    )
    .await?;
    println!("reconciler:\n{}", findings.table());
    println!(
        "the rail statement holds {} transfers for {} payouts; double payments: {}",
        findings.transfers_on_statement, report.payouts, findings.statement.double_payments
    );
    // The stack stops with the demo: no metrics address to give, and the commands are for a
    // stack of one's own.
    print!("{}", crate::jobs::summary(&report, &[], None));
    println!(
        "the demo's stack stops now; to try these commands, start one whose rail quarantines \
         every payout: eval \"$(dlock dev up --detach --rail-redirect-rate 1)\" (README, \
         \"An ambiguous payout, resolved\"); each service serves /metrics"
    );
    Ok(if findings.critical() || !report.complete {
        std::process::ExitCode::from(2)
    } else {
        std::process::ExitCode::SUCCESS
    })
}
