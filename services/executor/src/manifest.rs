//! The PayoutBatch manifest: the same YAML `kubectl apply -f` takes and `dlock run -f` runs.
//!
//! Every payout id and idempotency key is derived from the batch name and the item's key, never
//! from a clock or a uid: applying the same file again, or deleting and re-creating the batch,
//! names the same payouts, and the payment resource refuses to create them twice.

use std::collections::HashSet;

use anyhow::{Result, bail};
use dlock_contract::payment::{account_id_is_valid, currency_is_valid};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

/// The namespace of payout ids: `uuid5(NAMESPACE, "{batch}/{key}")`.
pub const PAYOUT_ID_NAMESPACE: Uuid = Uuid::from_u128(0x6c0c_6b1e_8a8e_4f5e_9d2a_d10c_0000_0001);

/// The most payouts one batch may list.
pub const PAYOUTS_PER_BATCH_MAX: usize = 100_000;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PayoutBatch {
    pub api_version: String,
    pub kind: String,
    pub metadata: Metadata,
    pub spec: BatchSpec,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Metadata {
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
}

/// The spec `dlock run` reads. Other fields of the PayoutBatch custom resource (`executor`,
/// `image`, the service names) belong to the operator and are ignored here, so the same file
/// serves both runners; `dlock run` takes its identity and credential from its own flags and
/// environment.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct BatchSpec {
    #[serde(default = "default_workers")]
    pub workers: u32,
    pub payouts: Vec<BatchItem>,
}

fn default_workers() -> u32 {
    4
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct BatchItem {
    pub key: String,
    pub account_id: String,
    pub amount_minor: i64,
    pub currency: String,
    pub beneficiary_ref: String,
}

/// One payout of a batch, with its derived identity.
#[derive(Debug, Clone, PartialEq)]
pub struct PlannedPayout {
    pub payout_id: Uuid,
    pub idempotency_key: String,
    pub item: BatchItem,
}

pub fn payout_id(batch: &str, key: &str) -> Uuid {
    Uuid::new_v5(&PAYOUT_ID_NAMESPACE, format!("{batch}/{key}").as_bytes())
}

/// The stable idempotency key of a payout, for its whole life.
pub fn idempotency_key(payout_id: Uuid) -> String {
    format!("payout-{payout_id}")
}

impl PayoutBatch {
    pub fn parse(text: &str) -> Result<Self> {
        let batch: PayoutBatch = serde_saphyr::from_str(text)
            .map_err(|e| anyhow::anyhow!("the manifest is not a PayoutBatch: {e}"))?;
        batch.validate()?;
        Ok(batch)
    }

    pub fn validate(&self) -> Result<()> {
        if self.api_version != "dlock.io/v1alpha1" || self.kind != "PayoutBatch" {
            bail!(
                "expected apiVersion dlock.io/v1alpha1 and kind PayoutBatch, got {} {}",
                self.api_version,
                self.kind
            );
        }
        let name = &self.metadata.name;
        if name.is_empty()
            || name.len() > 63
            || !name
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.')
        {
            bail!("metadata.name {name:?} must be a DNS-1123 name of at most 63 characters");
        }
        if !(1..=256).contains(&self.spec.workers) {
            bail!(
                "spec.workers must be between 1 and 256, got {}",
                self.spec.workers
            );
        }
        if self.spec.payouts.is_empty() || self.spec.payouts.len() > PAYOUTS_PER_BATCH_MAX {
            bail!(
                "spec.payouts must list 1 to {PAYOUTS_PER_BATCH_MAX} payouts, got {}",
                self.spec.payouts.len()
            );
        }
        let mut keys = HashSet::new();
        for (i, item) in self.spec.payouts.iter().enumerate() {
            let at = format!("spec.payouts[{i}]");
            if item.key.is_empty() || item.key.len() > 128 {
                bail!("{at}.key must be 1 to 128 characters");
            }
            if !keys.insert(item.key.as_str()) {
                bail!("{at}.key {:?} is used twice in the batch", item.key);
            }
            if !account_id_is_valid(&item.account_id) {
                bail!(
                    "{at}.accountId {:?} is not a valid account id",
                    item.account_id
                );
            }
            if item.amount_minor <= 0 {
                bail!("{at}.amountMinor must be a positive number of minor units");
            }
            if !currency_is_valid(&item.currency) {
                bail!("{at}.currency {:?} is not an ISO-4217 code", item.currency);
            }
            if item.beneficiary_ref.is_empty() || item.beneficiary_ref.len() > 128 {
                bail!("{at}.beneficiaryRef must be 1 to 128 characters");
            }
        }
        Ok(())
    }

    pub fn plan(&self) -> Vec<PlannedPayout> {
        self.spec
            .payouts
            .iter()
            .map(|item| {
                let payout_id = payout_id(&self.metadata.name, &item.key);
                PlannedPayout {
                    payout_id,
                    idempotency_key: idempotency_key(payout_id),
                    item: item.clone(),
                }
            })
            .collect()
    }
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

    #[test]
    fn ids_come_from_the_batch_name_and_item_key_only() {
        let a = PayoutBatch::parse(SAMPLE).unwrap_or_else(|e| panic!("{e}"));
        let b = PayoutBatch::parse(SAMPLE).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(a.plan(), b.plan(), "the same file names the same payouts");
        let plan = a.plan();
        assert_ne!(plan[0].payout_id, plan[1].payout_id);
        assert_eq!(plan[0].payout_id, payout_id("payroll-2026-12", "emp-0001"));
        assert_ne!(plan[0].payout_id, payout_id("payroll-2027-01", "emp-0001"));
        assert_eq!(
            plan[0].idempotency_key,
            format!("payout-{}", plan[0].payout_id)
        );
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
        let batch = PayoutBatch::parse(&with_operator_fields).unwrap_or_else(|e| panic!("{e}"));
        let plain = PayoutBatch::parse(SAMPLE).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(batch.plan(), plain.plan());
        assert_eq!(batch.spec.workers, 8);
    }

    #[test]
    fn bad_manifests_say_what_is_wrong() {
        let twice = SAMPLE.replace("emp-0002", "emp-0001");
        let err = PayoutBatch::parse(&twice)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(err.contains("used twice"), "{err}");
        let negative = SAMPLE.replace("amountMinor: 99", "amountMinor: -99");
        assert!(PayoutBatch::parse(&negative).is_err());
        let currency = SAMPLE.replace(
            "currency: EUR\n      beneficiaryRef: ben-0002",
            "currency: eur\n      beneficiaryRef: ben-0002",
        );
        assert!(PayoutBatch::parse(&currency).is_err());
        let kind = SAMPLE.replace("kind: PayoutBatch", "kind: Payout");
        assert!(PayoutBatch::parse(&kind).is_err());
    }
}
