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
    pub ambiguous_found_on_rail: usize,
    pub ambiguous_not_on_rail: usize,
    pub double_payments: usize,
    /// The statement against the ledger (`docs/design.md#reconciliation`): transfers without a
    /// payout, transfers differing from their payout, POSTED payouts not on the rail after the
    /// settlement window, FAILED or ABANDONED payouts the rail paid.
    pub transfers_without_payout: usize,
    pub transfers_differing_from_payout: usize,
    pub posted_not_on_rail: usize,
    pub released_paid_on_rail: usize,
    /// `"<severity> <kind> <subject>: <detail>"`, most severe first.
    pub findings: Vec<String>,
    /// Findings left out to stay within the termination message's size.
    pub omitted: usize,
}

impl ReconcileSummary {
    /// One line for people: the counts, the ambiguous payouts, the double payments and the
    /// statement's disagreements with the ledger.
    pub fn summary(&self) -> String {
        format!(
            "{} critical, {} warning, {} info; ambiguous payouts: {} found on the rail, {} not \
             found; double payments: {}; transfers without a payout: {}; transfers differing \
             from their payout: {}; posted payouts not on the rail: {}; released payouts paid on \
             the rail: {}",
            self.critical,
            self.warning,
            self.info,
            self.ambiguous_found_on_rail,
            self.ambiguous_not_on_rail,
            self.double_payments,
            self.transfers_without_payout,
            self.transfers_differing_from_payout,
            self.posted_not_on_rail,
            self.released_paid_on_rail
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
            double_payments: 1,
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
}
