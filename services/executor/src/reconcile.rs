//! The reconciler (docs/design.md#reconciliation): a detective control off the payout path. It
//! reads paydb and the rail's statement and reports; it never repairs. Resolving an ambiguous
//! payout is an attributed human action (`dlock resolve`), never automatic.

use std::collections::HashMap;
use std::time::Duration;

use anyhow::{Context, Result};
use dlock_contract::rail::read_statement;
use dlock_contract::reconcile::StatementCounts;
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
    // The statement against paydb, counted as the termination summary carries the counts.
    #[serde(flatten)]
    pub statement: StatementCounts,
}

/// What a run compares against.
#[derive(Debug, Clone, Copy)]
pub struct Options {
    /// An unresolved intent older than this is reported (the rail read timeout plus margin).
    pub unresolved_budget: Duration,
    /// How long after its posting a payout may still be missing from the rail's statement (a
    /// real rail's statement lags; the stub's does not).
    pub settlement_window: Duration,
}

/// The settlement window when none is given: one hour.
pub const DEFAULT_SETTLEMENT_WINDOW: Duration = Duration::from_secs(3_600);

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
        let s = &self.statement;
        out.push_str(&format!(
            "ambiguous payouts: {} found on the rail, {} not found; double payments: {}\n",
            s.ambiguous_found_on_rail, s.ambiguous_not_on_rail, s.double_payments
        ));
        out.push_str(&format!(
            "rail against ledger: {} transfers without a payout, {} differing from their payout; \
             {} posted payouts not on the rail; {} failed or abandoned payouts paid on the rail\n",
            s.transfers_without_payout,
            s.transfers_differing_from_payout,
            s.posted_not_on_rail,
            s.released_paid_on_rail
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
                "{:<8} {:<34} {:<40} {}\n",
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

/// A transfer on the statement with no payout in paydb, or whose payout has no attempt (and
/// was not quarantined by the store-epoch recovery, which lost the attempt).
pub const KIND_TRANSFER_WITHOUT_PAYOUT: &str = "rail_transfer_without_payout";
/// A statement line whose amount, currency or reference is not its payout's.
pub const KIND_TRANSFER_DIFFERS: &str = "rail_transfer_differs_from_payout";
/// A POSTED payout missing from the statement after the settlement window.
pub const KIND_POSTED_NOT_ON_RAIL: &str = "posted_payout_not_on_rail";
/// A FAILED or ABANDONED payout (its hold released) that the rail paid.
pub const KIND_RELEASED_PAID_ON_RAIL: &str = "released_payout_paid_on_rail";

pub async fn connect(paydb_url: &str) -> Result<PgPool> {
    dlock_server::pg::pool_options(2, Duration::from_secs(1))
        .connect(paydb_url)
        .await
        .context("connecting to paydb")
}

/// Runs every check once with the default settlement window. `unresolved_budget` is the rail
/// read timeout plus margin.
pub async fn reconcile(
    pool: &PgPool,
    rail_url: &str,
    unresolved_budget: Duration,
) -> Result<Findings> {
    let options = Options {
        unresolved_budget,
        settlement_window: DEFAULT_SETTLEMENT_WINDOW,
    };
    reconcile_with(pool, rail_url, &options).await
}

/// Runs every check once.
pub async fn reconcile_with(pool: &PgPool, rail_url: &str, options: &Options) -> Result<Findings> {
    let unresolved_budget = options.unresolved_budget;
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

    // Read before the statement: a payout is POSTED only after the rail acknowledged it, so
    // every payout read here was on the statement before it is read.
    let settled: Vec<(Uuid, String)> = sqlx::query_as(
        "SELECT payout_id, rail_reference FROM payouts
         WHERE state = 'POSTED' AND updated_at < clock_timestamp() - $1 * interval '1 millisecond'
         ORDER BY payout_id",
    )
    .bind(options.settlement_window.as_millis() as i64)
    .fetch_all(pool)
    .await
    .context("reading posted payouts past the settlement window")?;

    // paydb's clock before the statement is read: an absent finding says the statement read
    // after this moment lacked the payout (docs/contract.md#resolve-evidence).
    let (statement_read_at,): (chrono::DateTime<chrono::Utc>,) =
        sqlx::query_as("SELECT clock_timestamp()")
            .fetch_one(pool)
            .await
            .context("reading paydb's clock")?;
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
            out.statement.double_payments += 1;
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
        let found = by_ref.get(payout.to_string().as_str());
        // Recorded in paydb: a resolution of an attempt nobody recorded stands on it.
        sqlx::query("SELECT pay_record_finding($1, $2, $3, $4)")
            .bind(payout)
            .bind(found.map(|references| references[0].to_owned()))
            .bind(statement_read_at)
            .bind(options.settlement_window.as_millis() as i64)
            .execute(pool)
            .await
            .with_context(|| format!("recording the finding of payout {payout} in paydb"))?;
        match found {
            Some(references) => {
                out.statement.ambiguous_found_on_rail += 1;
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
                out.statement.ambiguous_not_on_rail += 1;
                add(&mut out, Severity::Info, "ambiguous_not_on_rail", payout.to_string(), "not on the rail statement: after the rail's settlement window, resolve with dlock resolve --failed".into());
            }
        }
    }
    compare_with_ledger(pool, &statement.transfers, &settled, &mut out).await?;

    let (payouts,): (i64,) = sqlx::query_as("SELECT count(*) FROM payouts")
        .fetch_one(pool)
        .await?;
    out.payouts_checked = payouts as usize;
    out.findings
        .sort_by(|a, b| b.severity.cmp(&a.severity).then(a.kind.cmp(b.kind)));
    Ok(out)
}

/// What paydb holds of a payout named on the statement.
#[derive(sqlx::FromRow)]
struct Payout {
    payout_id: Uuid,
    state: String,
    amount_minor: i64,
    currency: String,
    rail_reference: Option<String>,
    /// An attempt that may have reached the rail (any outcome but FENCED).
    presented: bool,
    /// Quarantined by the store-epoch recovery (`pay_epoch_quarantined`,
    /// migrations/paydb/0039_baseline_payment_writes.sql): the rail had it and paydb had lost its
    /// attempt, so its lines are matched to it by their clientRef alone.
    epoch_quarantined: bool,
}

/// The statement against the ledger, line by line (read after the statement, so every payout
/// and attempt behind a line is visible), and the POSTED payouts past the settlement window
/// (read before it) against the statement. Each line whose payout is known and released is
/// reported once, as such; the other checks apply to the rest.
async fn compare_with_ledger(
    pool: &PgPool,
    transfers: &[dlock_contract::rail::Transfer],
    settled: &[(Uuid, String)],
    out: &mut Findings,
) -> Result<()> {
    let mut add = |severity, kind, subject: String, detail: String| {
        out.findings.push(Finding {
            severity,
            kind,
            subject,
            detail,
        });
    };
    let ids: Vec<Uuid> = transfers
        .iter()
        .filter_map(|t| Uuid::parse_str(&t.client_ref).ok())
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .collect();
    let payouts: HashMap<Uuid, Payout> = sqlx::query_as::<_, Payout>(
        "SELECT p.payout_id, p.state, p.amount_minor, p.currency::text AS currency, p.rail_reference,
                EXISTS (SELECT 1 FROM rail_submission r
                        WHERE r.payout_id = p.payout_id AND r.outcome <> 'FENCED') AS presented,
                EXISTS (SELECT 1 FROM pay_epoch_quarantined q
                        WHERE q.payout_id = p.payout_id) AS epoch_quarantined
         FROM payouts p WHERE p.payout_id = ANY($1)",
    )
    .bind(&ids)
    .fetch_all(pool)
    .await
    .context("reading the payouts the statement names")?
    .into_iter()
    .map(|p| (p.payout_id, p))
    .collect();

    let mut lines: HashMap<&str, Vec<&dlock_contract::rail::Transfer>> = HashMap::new();
    for t in transfers {
        lines.entry(t.client_ref.as_str()).or_default().push(t);
    }
    let mut client_refs: Vec<&str> = lines.keys().copied().collect();
    client_refs.sort_unstable();
    let (mut orphans, mut differing, mut released) = (0, 0, 0);
    for client_ref in client_refs {
        let on_rail = &lines[client_ref];
        let references = || {
            on_rail
                .iter()
                .map(|t| format!("{} ({} {})", t.rail_reference, t.amount_minor, t.currency))
                .collect::<Vec<_>>()
                .join(", ")
        };
        let payout = Uuid::parse_str(client_ref)
            .ok()
            .and_then(|id| payouts.get(&id));
        let Some(payout) = payout else {
            orphans += on_rail.len();
            // Whatever the rail was sent; no control characters reach a terminal.
            let subject = client_ref
                .chars()
                .map(|c| if c.is_control() { '?' } else { c })
                .collect();
            add(
                Severity::Critical,
                KIND_TRANSFER_WITHOUT_PAYOUT,
                subject,
                format!(
                    "on the rail as {}, but paydb has no payout of this id: money left with no record",
                    references()
                ),
            );
            continue;
        };
        if payout.state == "FAILED" || payout.state == "ABANDONED" {
            released += 1;
            add(
                Severity::Critical,
                KIND_RELEASED_PAID_ON_RAIL,
                client_ref.to_owned(),
                format!(
                    "the payout is {} and its hold was released, but the rail paid it as {}",
                    payout.state,
                    references()
                ),
            );
            continue;
        }
        // A payout the store-epoch recovery quarantined has no attempt because paydb lost it,
        // not because it never went to the rail proxy: the recovery found it on this statement
        // by its clientRef. Its lines are its own, classified once, as the ambiguous payout it
        // is (or as whatever its resolution made it), never as money with no record.
        if !payout.presented && !payout.epoch_quarantined {
            orphans += on_rail.len();
            add(
                Severity::Critical,
                KIND_TRANSFER_WITHOUT_PAYOUT,
                client_ref.to_owned(),
                format!(
                    "on the rail as {}, but the payout is {} and never went to the rail proxy: \
                     no recorded attempt",
                    references(),
                    payout.state
                ),
            );
        }
        // A line and its payout that disagree: counted and reported the same way, whichever
        // side shows it.
        let mut differs = |detail: String| {
            differing += 1;
            add(
                Severity::Critical,
                KIND_TRANSFER_DIFFERS,
                client_ref.to_owned(),
                detail,
            );
        };
        for t in on_rail {
            if t.amount_minor != payout.amount_minor || t.currency != payout.currency {
                differs(format!(
                    "the rail took {} {} as {}; the payout is {} {} ({})",
                    t.amount_minor,
                    t.currency,
                    t.rail_reference,
                    payout.amount_minor,
                    payout.currency,
                    payout.state
                ));
            }
        }
        if payout.state == "POSTED"
            && let Some(reference) = &payout.rail_reference
            && !on_rail.iter().any(|t| &t.rail_reference == reference)
        {
            differs(format!(
                "the payout is POSTED as {reference}, which is not on the rail; the rail has it as {}",
                references()
            ));
        }
    }

    let mut missing = 0;
    for (payout, reference) in settled {
        if !lines.contains_key(payout.to_string().as_str()) {
            missing += 1;
            add(
                Severity::Critical,
                KIND_POSTED_NOT_ON_RAIL,
                payout.to_string(),
                format!(
                    "POSTED as {reference}, but the rail's statement has no transfer for it after \
                     the settlement window: the ledger says paid, the rail did not pay"
                ),
            );
        }
    }
    out.statement.transfers_without_payout = orphans;
    out.statement.transfers_differing_from_payout = differing;
    out.statement.posted_not_on_rail = missing;
    out.statement.released_paid_on_rail = released;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `dlock reconcile --json` writes the statement's counts as top-level fields, after the
    /// transfers on the statement, as it did before they were one flattened [`StatementCounts`].
    #[test]
    fn the_report_writes_the_statement_counts_at_the_top_level() {
        let mut findings = Findings {
            transfers_on_statement: 4,
            ..Findings::default()
        };
        findings.statement.double_payments = 1;
        findings.statement.posted_not_on_rail = 2;
        assert_eq!(
            serde_json::to_string(&findings).unwrap_or_default(),
            concat!(
                r#"{"findings":[],"accountsChecked":0,"payoutsChecked":0,"transfersOnStatement":4,"#,
                r#""ambiguousFoundOnRail":0,"ambiguousNotOnRail":0,"doublePayments":1,"#,
                r#""transfersWithoutPayout":0,"transfersDifferingFromPayout":0,"#,
                r#""postedNotOnRail":2,"releasedPaidOnRail":0}"#
            )
        );
    }
}
