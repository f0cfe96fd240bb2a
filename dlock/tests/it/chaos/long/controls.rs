//! The positive controls of the long run, on the same stack after the checks: a payout
//! registered and never run is found lost, and a transfer the rail takes twice for one payout is
//! found paid twice, by the statement check and by the reconciler.

use std::time::Duration;

use dlock_contract::payment::CreatePayoutRequest;
use dlock_contract::payment_client::PaymentClient;
use dlock_executor::manifest::payout_id;

use super::checks::{on_rail_count, paid_twice, reconcile, settled_or_lost, statement_counts};
use super::stack::{Run, count};

/// Plants an unsettled payout and a double payment of the first of `posted`; says in `broken`
/// each the checks did not catch.
pub(super) async fn positive_controls(
    run: &Run,
    direct: &PaymentClient,
    posted: &[String],
    broken: &mut Vec<String>,
) {
    let pg = run.pg();
    let planted = payout_id("long-planted", "item-00000");
    direct
        .create_payout(
            &format!("register-{planted}"),
            &CreatePayoutRequest {
                payout_id: planted,
                account_id: "long-00".into(),
                amount_minor: 1_000,
                currency: "EUR".into(),
                beneficiary_ref: "ben-planted".into(),
            },
        )
        .await
        .unwrap_or_else(|e| panic!("registering the planted payout: {e}"));
    let (_, planted_lost) = settled_or_lost(pg, &[planted.to_string()]);
    if planted_lost.len() != 1 {
        broken.push(format!(
            "the planted unsettled payout was not found lost: {planted_lost:?}"
        ));
    }
    if let Some(victim) = posted.first() {
        let amount = count(
            pg,
            &format!("SELECT amount_minor FROM payouts WHERE payout_id = '{victim}'"),
        );
        let http = reqwest::Client::new();
        let mut tries = 0;
        // The stub takes a repeat of a clientRef again at its duplicate-ack rate.
        while on_rail_count(&run.stub.url(), victim).await < 2 && tries < 200 {
            tries += 1;
            let _ = http
                .post(format!("{}/submit", run.stub.url()))
                .json(&serde_json::json!({
                    "clientRef": victim,
                    "amountMinor": amount,
                    "currency": "EUR",
                }))
                .timeout(Duration::from_secs(5))
                .send()
                .await;
        }
        let found = paid_twice(&statement_counts(&run.stub.url()).await);
        let (planted_summary, planted_exit) =
            reconcile(&pg.url("paydb"), &run.stub.url(), &run.dir, "planted");
        println!(
            "  positive controls: planted unsettled payout found lost ({}); planted double payment \
             after {tries} repeats: paid twice {found:?}, reconciler {} double payments, exit {planted_exit:?}",
            planted_lost.len(),
            planted_summary.statement.double_payments
        );
        if found != vec![victim.clone()]
            || planted_summary.statement.double_payments == 0
            || planted_exit == Some(0)
        {
            broken.push(format!(
                "the planted double payment of {victim} was not caught: twice {found:?}, \
                 reconciler {}, exit {planted_exit:?}",
                planted_summary.summary()
            ));
        }
    } else {
        broken.push("no payout was POSTED".into());
    }
}
