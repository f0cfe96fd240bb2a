//! The reconciler (FR-26): a detective control off the payout path. It reads paydb and the
//! rail's statement and reports; it never repairs. Resolving an ambiguous payout is an
//! attributed human action (`dlock resolve`), never automatic.

use std::collections::HashMap;
use std::time::Duration;

use anyhow::{Context, Result};
use dlock_contract::rail::read_statement;
use serde::Serialize;
use sqlx::PgPool;
use uuid::Uuid;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Severity {
    Info,
    Warning,
    Critical,
}

#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Finding {
    pub severity: Severity,
    pub kind: &'static str,
    pub subject: String,
    pub detail: String,
}

#[derive(Debug, Clone, Default, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Findings {
    pub findings: Vec<Finding>,
    pub accounts_checked: usize,
    pub payouts_checked: usize,
    pub transfers_on_statement: usize,
    pub ambiguous_found_on_rail: usize,
    pub ambiguous_not_on_rail: usize,
    pub double_payments: usize,
}

impl Findings {
    pub fn critical(&self) -> bool {
        self.findings
            .iter()
            .any(|f| f.severity == Severity::Critical)
    }

    pub fn table(&self) -> String {
        let mut out = format!(
            "reconciled {} accounts, {} payouts, {} transfers on the rail statement\n",
            self.accounts_checked, self.payouts_checked, self.transfers_on_statement
        );
        out.push_str(&format!(
            "ambiguous payouts: {} found on the rail, {} not found; double payments: {}\n",
            self.ambiguous_found_on_rail, self.ambiguous_not_on_rail, self.double_payments
        ));
        if self.findings.is_empty() {
            out.push_str("no findings\n");
        }
        // Every warning and critical finding; the informational ones up to a screenful.
        let shown_info = 10;
        let info_total = self
            .findings
            .iter()
            .filter(|f| f.severity == Severity::Info)
            .count();
        let mut info_seen = 0;
        for f in &self.findings {
            if f.severity == Severity::Info {
                info_seen += 1;
                if info_seen > shown_info {
                    continue;
                }
            }
            out.push_str(&format!(
                "{:<8} {:<32} {:<40} {}\n",
                format!("{:?}", f.severity).to_lowercase(),
                f.kind,
                f.subject,
                f.detail
            ));
        }
        if info_total > shown_info {
            out.push_str(&format!(
                "... and {} more informational findings (--json lists them all)\n",
                info_total - shown_info
            ));
        }
        out
    }
}

pub async fn connect(paydb_url: &str) -> Result<PgPool> {
    dlock_server::pg::pool_options(2, Duration::from_secs(1))
        .connect(paydb_url)
        .await
        .context("connecting to paydb")
}

/// Runs every check once. `unresolved_budget` is the rail read timeout plus margin.
pub async fn reconcile(
    pool: &PgPool,
    rail_url: &str,
    unresolved_budget: Duration,
) -> Result<Findings> {
    let mut out = Findings::default();
    let add = |out: &mut Findings, severity, kind, subject: String, detail: String| {
        out.findings.push(Finding {
            severity,
            kind,
            subject,
            detail,
        });
    };

    let accounts: Vec<(String, String, i64, i64, i64)> = sqlx::query_as(
        // A settlement account's balance is its row's plus the sum of its
        // `account_balance_shards` rows.
        "SELECT a.account_id, a.kind,
                (a.balance_minor + coalesce((SELECT sum(s.balance_minor) FROM account_balance_shards s
                                             WHERE s.account_id = a.account_id), 0))::bigint,
                a.held_minor,
                coalesce(sum(CASE e.direction WHEN 'CREDIT' THEN e.amount_minor ELSE -e.amount_minor END), 0)::bigint
         FROM accounts a LEFT JOIN ledger_entries e ON e.account_id = a.account_id
         GROUP BY a.account_id, a.kind, a.balance_minor, a.held_minor",
    )
    .fetch_all(pool)
    .await
    .context("reading accounts")?;
    out.accounts_checked = accounts.len();
    for (account, kind, balance, held, sum) in &accounts {
        if balance != sum {
            add(
                &mut out,
                Severity::Critical,
                "ledger_sum_differs_from_balance",
                account.clone(),
                format!("balance {balance}, ledger sum {sum}"),
            );
        }
        if kind == "customer" && balance - held < 0 {
            add(
                &mut out,
                Severity::Critical,
                "negative_available_balance",
                account.clone(),
                format!("balance {balance}, held {held}"),
            );
        }
    }

    let posted: Vec<(Uuid, i64, i64, i64, i64)> = sqlx::query_as(
        "SELECT p.payout_id, p.amount_minor,
                count(e.entry_id),
                coalesce(sum(e.amount_minor) FILTER (WHERE e.direction = 'DEBIT' AND e.account_id = p.account_id), 0)::bigint,
                coalesce(sum(e.amount_minor) FILTER (WHERE e.direction = 'CREDIT'), 0)::bigint
         FROM payouts p LEFT JOIN ledger_entries e ON e.payout_id = p.payout_id
         WHERE p.state = 'POSTED' GROUP BY p.payout_id, p.amount_minor",
    )
    .fetch_all(pool)
    .await
    .context("reading posted payouts")?;
    for (payout, amount, rows, debit, credit) in &posted {
        if *rows != 2 || debit != amount || credit != amount {
            add(
                &mut out,
                Severity::Critical,
                "posted_without_two_balanced_entries",
                payout.to_string(),
                format!("{rows} entries, debit {debit}, credit {credit}, amount {amount}"),
            );
        }
    }

    let acked: Vec<(Uuid, Uuid, String)> = sqlx::query_as(
        "SELECT r.submission_id, p.payout_id, p.state FROM rail_submission r JOIN payouts p ON p.payout_id = r.payout_id
         WHERE r.outcome = 'ACKED' AND p.state NOT IN ('RAIL_ACKED', 'POSTED')",
    )
    .fetch_all(pool)
    .await
    .context("reading acknowledged submissions")?;
    for (submission, payout, state) in &acked {
        add(
            &mut out,
            Severity::Warning,
            "acked_submission_payout_not_acked",
            payout.to_string(),
            format!("submission {submission} is ACKED, payout is {state}"),
        );
    }

    let unresolved: Vec<(Uuid, Uuid)> = sqlx::query_as(
        "SELECT submission_id, payout_id FROM rail_submission
         WHERE outcome = 'unresolved' AND submitted_at < clock_timestamp() - $1 * interval '1 millisecond'",
    )
    .bind(unresolved_budget.as_millis() as i64)
    .fetch_all(pool)
    .await
    .context("reading unresolved intents")?;
    for (submission, payout) in &unresolved {
        add(
            &mut out,
            Severity::Warning,
            "unresolved_intent_past_budget",
            payout.to_string(),
            format!(
                "submission {submission} has had no outcome for longer than {} ms",
                unresolved_budget.as_millis()
            ),
        );
    }

    let statement = read_statement(rail_url, None)
        .await
        .context("reading the rail statement")?;
    out.transfers_on_statement = statement.transfers.len();
    let mut by_ref: HashMap<&str, Vec<&str>> = HashMap::new();
    for t in &statement.transfers {
        by_ref
            .entry(t.client_ref.as_str())
            .or_default()
            .push(t.rail_reference.as_str());
    }
    for (client_ref, references) in &by_ref {
        if references.len() > 1 {
            out.double_payments += 1;
            add(
                &mut out,
                Severity::Critical,
                "double_payment_on_rail",
                (*client_ref).to_owned(),
                format!("{} transfers: {}", references.len(), references.join(", ")),
            );
        }
    }

    let ambiguous: Vec<(Uuid,)> = sqlx::query_as(
        "SELECT payout_id FROM payouts WHERE state = 'RAIL_AMBIGUOUS' ORDER BY payout_id",
    )
    .fetch_all(pool)
    .await
    .context("reading ambiguous payouts")?;
    for (payout,) in &ambiguous {
        match by_ref.get(payout.to_string().as_str()) {
            Some(references) => {
                out.ambiguous_found_on_rail += 1;
                add(
                    &mut out,
                    Severity::Info,
                    "ambiguous_found_on_rail",
                    payout.to_string(),
                    format!(
                        "the rail has it as {}: resolve with dlock resolve --posted --rail-reference {}",
                        references.join(", "),
                        references[0]
                    ),
                );
            }
            None => {
                out.ambiguous_not_on_rail += 1;
                add(&mut out, Severity::Info, "ambiguous_not_on_rail", payout.to_string(), "not on the rail statement: after the rail's settlement window, resolve with dlock resolve --failed".into());
            }
        }
    }
    let (payouts,): (i64,) = sqlx::query_as("SELECT count(*) FROM payouts")
        .fetch_one(pool)
        .await?;
    out.payouts_checked = payouts as usize;
    out.findings
        .sort_by(|a, b| b.severity.cmp(&a.severity).then(a.kind.cmp(b.kind)));
    Ok(out)
}
