//! The reconciler's summary: what `dlock reconcile --termination-log` leaves as a Kubernetes
//! termination message, and what the operator reads back into a Reconciliation's status. One
//! type for both sides, so the writer and the reader cannot drift apart.

use serde::{Deserialize, Serialize};

/// The kubelet keeps at most this many bytes of a termination message.
pub const TERMINATION_MESSAGE_MAX: usize = 4096;

/// The counts, and the findings most severe first, one line each, as many as fit in
/// [`TERMINATION_MESSAGE_MAX`] bytes of JSON. Fields missing on the wire read as zero or empty.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct ReconcileSummary {
    pub critical: usize,
    pub warning: usize,
    pub info: usize,
    pub accounts_checked: usize,
    pub payouts_checked: usize,
    // The rail's statement against paydb, as the reconciler counted it.
    #[serde(flatten)]
    pub statement: StatementCounts,
    /// `"<severity> <kind> <subject>: <detail>"`, most severe first.
    pub findings: Vec<String>,
    /// Findings left out to stay within the termination message's size.
    pub omitted: usize,
}

/// What the reconciler found comparing the rail's statement with paydb
/// (`docs/design.md#reconciliation`), flattened into its report and into [`ReconcileSummary`].
/// Fields missing on the wire read as zero.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct StatementCounts {
    pub ambiguous_found_on_rail: usize,
    pub ambiguous_not_on_rail: usize,
    pub double_payments: usize,
    /// Statement lines with no payout in paydb, or whose payout never went to the rail proxy:
    /// money left with no record of why.
    pub transfers_without_payout: usize,
    /// Statement lines whose amount or currency is not their payout's, and POSTED payouts whose
    /// rail reference is not among their payout's lines.
    pub transfers_differing_from_payout: usize,
    /// POSTED payouts, posted longer ago than the settlement window, with no line on the statement.
    pub posted_not_on_rail: usize,
    /// FAILED or ABANDONED payouts (their hold released) with a line on the statement.
    pub released_paid_on_rail: usize,
}

impl ReconcileSummary {
    /// One line for people: the counts, the ambiguous payouts, the double payments and the
    /// statement's disagreements with the ledger.
    pub fn summary(&self) -> String {
        let s = &self.statement;
        format!(
            "{} critical, {} warning, {} info; ambiguous payouts: {} found on the rail, {} not \
             found; double payments: {}; transfers without a payout: {}; transfers differing \
             from their payout: {}; posted payouts not on the rail: {}; released payouts paid on \
             the rail: {}",
            self.critical,
            self.warning,
            self.info,
            s.ambiguous_found_on_rail,
            s.ambiguous_not_on_rail,
            s.double_payments,
            s.transfers_without_payout,
            s.transfers_differing_from_payout,
            s.posted_not_on_rail,
            s.released_paid_on_rail
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_summary_survives_the_round_trip_and_missing_fields_read_as_zero() {
        let summary = ReconcileSummary {
            critical: 1,
            statement: StatementCounts {
                double_payments: 1,
                ..StatementCounts::default()
            },
            findings: vec!["critical double_payment p1: paid twice".into()],
            ..ReconcileSummary::default()
        };
        let text = serde_json::to_string(&summary).unwrap_or_default();
        let back: ReconcileSummary = serde_json::from_str(&text).unwrap_or_default();
        assert_eq!(back, summary);
        let sparse: ReconcileSummary =
            serde_json::from_str(r#"{"critical":2}"#).unwrap_or_default();
        assert_eq!((sparse.critical, sparse.warning), (2, 0));
        assert!(summary.summary().contains("double payments: 1"));
    }

    /// The statement's counts are top-level fields of the termination message, in the order the
    /// reader and people expect, as they were before they were one flattened [`StatementCounts`].
    #[test]
    fn the_statement_counts_write_at_the_top_level() {
        let summary = ReconcileSummary {
            critical: 1,
            statement: StatementCounts {
                ambiguous_found_on_rail: 2,
                released_paid_on_rail: 3,
                ..StatementCounts::default()
            },
            findings: vec!["critical x y: z".into()],
            ..ReconcileSummary::default()
        };
        assert_eq!(
            serde_json::to_string(&summary).unwrap_or_default(),
            concat!(
                r#"{"critical":1,"warning":0,"info":0,"accountsChecked":0,"payoutsChecked":0,"#,
                r#""ambiguousFoundOnRail":2,"ambiguousNotOnRail":0,"doublePayments":0,"#,
                r#""transfersWithoutPayout":0,"transfersDifferingFromPayout":0,"#,
                r#""postedNotOnRail":0,"releasedPaidOnRail":3,"findings":["critical x y: z"],"#,
                r#""omitted":0}"#
            )
        );
    }
}
