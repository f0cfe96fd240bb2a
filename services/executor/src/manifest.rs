//! The PayoutBatch manifest `dlock run -f` reads. The types, the payout id derivation and the
//! validator are the contract's ([`dlock_contract::payout_batch`]), shared with the operator, so
//! the same file means the same payouts under both runners; this module only reads the YAML.

use anyhow::Result;

pub use dlock_contract::payout_batch::{
    BatchSpec, Metadata, PAYOUT_ID_NAMESPACE, PAYOUTS_PER_BATCH_MAX, PayoutBatch,
    PayoutItem as BatchItem, PlannedPayout, idempotency_key, payout_id,
};

/// Reads a PayoutBatch manifest and checks it, naming every problem found with its field.
pub fn parse(text: &str) -> Result<PayoutBatch> {
    let batch: PayoutBatch = serde_saphyr::from_str(text)
        .map_err(|e| anyhow::anyhow!("the manifest is not a PayoutBatch: {e}"))?;
    let problems = batch.validate();
    if !problems.is_empty() {
        anyhow::bail!(
            "the PayoutBatch cannot run: {}",
            dlock_contract::payout_batch::describe(&problems)
        );
    }
    Ok(batch)
}

#[cfg(test)]
mod tests {
    use super::*;

    const SAMPLE: &str = r#"
apiVersion: dlock.io/v1alpha1
kind: PayoutBatch
metadata:
  name: payroll-2026-12
spec:
  workers: 8
  payouts:
    - key: emp-0001
      accountId: acct-17
      amountMinor: 125000
      currency: EUR
      beneficiaryRef: ben-0001
    - key: emp-0002
      accountId: acct-17
      amountMinor: 99
      currency: EUR
      beneficiaryRef: ben-0002
"#;

    /// Reading the file plans each item as the contract derives it: from the batch name and the
    /// item's key only, the same on every read.
    #[test]
    fn ids_come_from_the_batch_name_and_item_key_only() {
        let read = || parse(SAMPLE).unwrap_or_else(|e| panic!("{e}")).plan();
        let plan = read();
        assert_eq!(plan, read(), "the same file names the same payouts");
        assert_eq!(plan.len(), 2);
        assert_ne!(plan[0].payout_id, plan[1].payout_id);
        for (planned, key) in plan.iter().zip(["emp-0001", "emp-0002"]) {
            assert_eq!(planned.payout_id, payout_id("payroll-2026-12", key));
            assert_ne!(planned.payout_id, payout_id("payroll-2027-01", key));
            assert_eq!(
                planned.idempotency_key,
                format!("payout-{}", planned.payout_id)
            );
        }
    }

    /// The operator's fields (the executor's credential, the image, the services) are the
    /// operator's business: the same file still runs under `dlock run -f`.
    #[test]
    fn the_operators_own_spec_fields_are_accepted_and_ignored() {
        let with_operator_fields = SAMPLE.replace(
            "spec:\n  workers: 8\n",
            "spec:\n  workers: 8\n  image: dlock:1\n  lockServer: locks\n  executor:\n    \
             identity: executor\n    credentialSecret: {name: executor-credential, key: token}\n",
        );
        assert_ne!(with_operator_fields, SAMPLE);
        let batch = parse(&with_operator_fields).unwrap_or_else(|e| panic!("{e}"));
        let plain = parse(SAMPLE).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(batch.plan(), plain.plan());
        assert_eq!(batch.spec.workers, 8);
    }

    #[test]
    fn bad_manifests_say_what_is_wrong() {
        let error = |text: &str| parse(text).err().map(|e| e.to_string()).unwrap_or_default();
        let twice = error(&SAMPLE.replace("emp-0002", "emp-0001"));
        assert!(
            twice.contains("spec.payouts[1].key: \"emp-0001\" is used twice"),
            "{twice}"
        );
        let negative = error(&SAMPLE.replace("amountMinor: 99", "amountMinor: -99"));
        assert!(
            negative.contains("spec.payouts[1].amountMinor"),
            "{negative}"
        );
        let both = error(
            &SAMPLE
                .replace("amountMinor: 99", "amountMinor: -99")
                .replace(
                    "currency: EUR\n      beneficiaryRef: ben-0002",
                    "currency: eur\n      beneficiaryRef: ben-0002",
                ),
        );
        assert!(
            both.contains("2 problems:"),
            "every problem at once: {both}"
        );
        assert!(both.contains("spec.payouts[1].currency"), "{both}");
        let kind = error(&SAMPLE.replace("kind: PayoutBatch", "kind: Payout"));
        assert!(kind.contains("kind: must be PayoutBatch"), "{kind}");
        let unknown = error(&SAMPLE.replace(
            "beneficiaryRef: ben-0002",
            "beneficiaryRef: ben-0002\n      memo: x",
        ));
        assert!(
            unknown.contains("memo"),
            "an unknown item field is named: {unknown}"
        );
    }
}
