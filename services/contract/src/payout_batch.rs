//! The PayoutBatch, once: the manifest `dlock run -f` runs, the payouts of the custom resource the
//! operator runs, the payout id derivation, and the one validator both runners call.
//!
//! Every payout id and idempotency key is derived from the batch name and the item's key, never
//! from a clock or a uid: applying the same file again, or deleting and re-creating the batch,
//! names the same payouts, and the payment resource refuses to create them twice.
//!
//! The single-field rules are the payment resource's own ([`crate::payment`]): a batch that passes
//! here is not refused later for an account id, an amount, a currency or a reference.

use std::collections::HashSet;

use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::payment::{
    ACCOUNT_ID_RULE, AMOUNT_MINOR_MAX, CreatePayoutRequest, REFERENCE_LEN_MAX, account_id_is_valid,
    currency_is_valid, reference_is_valid,
};

pub const API_VERSION: &str = "dlock.io/v1alpha1";
pub const KIND: &str = "PayoutBatch";

/// The namespace of payout ids: `uuid5(NAMESPACE, "{batch}/{key}")`.
pub const PAYOUT_ID_NAMESPACE: Uuid = Uuid::from_u128(0x6c0c_6b1e_8a8e_4f5e_9d2a_d10c_0000_0001);

/// The most payouts one batch may list (a custom resource has its own, smaller limit).
pub const PAYOUTS_PER_BATCH_MAX: usize = 100_000;
/// Concurrent workers of the executor: the default and the most.
pub const WORKERS_DEFAULT: u32 = 4;
pub const WORKERS_MAX: u32 = 256;
/// The most calls of one step the executor sends in one batch request
/// (docs/contract.md#batches): the default (1 turns batching off: one request per payout per
/// step), and the most, a batch request's own limit ([`crate::batch::MAX_ITEMS`]).
pub const BATCH_MAX_DEFAULT: u32 = 32;
pub const BATCH_MAX_MAX: u32 = crate::batch::MAX_ITEMS as u32;
/// The longest item key.
pub const KEY_LEN_MAX: usize = 128;
/// The longest batch name.
pub const NAME_LEN_MAX: usize = 63;

/// The payout id of the item `key` of the batch `batch`.
pub fn payout_id(batch: &str, key: &str) -> Uuid {
    Uuid::new_v5(&PAYOUT_ID_NAMESPACE, format!("{batch}/{key}").as_bytes())
}

/// The stable idempotency key of a payout, for its whole life.
pub fn idempotency_key(payout_id: Uuid) -> String {
    format!("payout-{payout_id}")
}

// One payout of a batch. (No doc comment: the CRD schema would carry it as the items'
// description.) The schema carries `validate`'s rules for each field, from the same constants: the
// lengths, the alphabets' patterns, the amount range, the currencies; and the key's length in bytes,
// as `validate` counts it (a schema's `maxLength` counts characters), as a CEL rule. So the API
// server refuses every item `validate` would, naming its field; only the keys' uniqueness is
// the list's (`x-kubernetes-list-map-keys`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schemars", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PayoutItem {
    /// Unique within the batch.
    #[cfg_attr(feature = "schemars", schemars(length(min = 1, max = KEY_LEN_MAX)))]
    #[cfg_attr(feature = "schemars", schemars(extend("x-kubernetes-validations" = [{
        "rule": key_bytes_rule(),
        "message": format!("must be 1 to {KEY_LEN_MAX} bytes"),
    }])))]
    pub key: String,
    #[cfg_attr(feature = "schemars", schemars(length(min = 1, max = crate::payment::ACCOUNT_ID_LEN_MAX)))]
    #[cfg_attr(
        feature = "schemars",
        schemars(pattern(crate::payment::ACCOUNT_ID_PATTERN))
    )]
    pub account_id: String,
    #[cfg_attr(feature = "schemars", schemars(range(min = 1, max = AMOUNT_MINOR_MAX)))]
    pub amount_minor: i64,
    #[cfg_attr(feature = "schemars", schemars(extend("enum" = crate::payment::CURRENCIES.as_slice())))]
    pub currency: String,
    #[cfg_attr(feature = "schemars", schemars(length(min = 1, max = REFERENCE_LEN_MAX)))]
    #[cfg_attr(
        feature = "schemars",
        schemars(pattern(crate::payment::REFERENCE_PATTERN))
    )]
    pub beneficiary_ref: String,
}

/// The CEL rule of an item key's length in bytes, the way [`PayoutBatch::validate`] counts it.
pub fn key_bytes_rule() -> String {
    format!("size(bytes(self)) <= {KEY_LEN_MAX}")
}

/// The manifest: the same YAML `kubectl apply -f` takes and `dlock run -f` runs, and the one the
/// operator writes into the executor Job's ConfigMap.
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

/// The spec the executor reads. Other fields of the PayoutBatch custom resource (`executor`,
/// `image`, the service names) belong to the operator and are ignored here, so the same file
/// serves both runners; `dlock run` takes its identity and credential from its own flags and
/// environment.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct BatchSpec {
    #[serde(default = "default_workers")]
    pub workers: u32,
    /// The executor sends each step's concurrent calls as batch requests of up to this many
    /// items (docs/contract.md#batches), 32 ([`BATCH_MAX_DEFAULT`]) when absent; 1 sends one
    /// request per payout per step. `dlock run --batch-max` overrides it.
    #[serde(default = "default_batch_max")]
    pub batch_max: u32,
    pub payouts: Vec<PayoutItem>,
}

fn default_workers() -> u32 {
    WORKERS_DEFAULT
}

fn default_batch_max() -> u32 {
    BATCH_MAX_DEFAULT
}

/// One payout of a batch, with its derived identity.
#[derive(Debug, Clone, PartialEq)]
pub struct PlannedPayout {
    pub payout_id: Uuid,
    pub idempotency_key: String,
    pub item: PayoutItem,
}

impl PlannedPayout {
    /// The body that registers this payout at the payment resource.
    pub fn registration(&self) -> CreatePayoutRequest {
        CreatePayoutRequest {
            payout_id: self.payout_id,
            account_id: self.item.account_id.clone(),
            amount_minor: self.item.amount_minor,
            currency: self.item.currency.clone(),
            beneficiary_ref: self.item.beneficiary_ref.clone(),
        }
    }

    /// The body of this payout's rail submission: the payout the rail proxy checks it against.
    pub fn submission(&self) -> crate::rail::SubmissionRequest {
        crate::rail::SubmissionRequest {
            payout_id: self.payout_id,
            account_id: self.item.account_id.clone(),
            amount_minor: self.item.amount_minor,
            currency: self.item.currency.clone(),
            beneficiary_ref: self.item.beneficiary_ref.clone(),
        }
    }
}

/// One thing wrong with a batch: where (`spec.payouts[3].amountMinor`) and what.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {message}")]
pub struct Problem {
    pub field: String,
    pub message: String,
}

impl Problem {
    fn new(field: impl Into<String>, message: impl Into<String>) -> Self {
        Problem {
            field: field.into(),
            message: message.into(),
        }
    }
}

/// Every problem of `problems`, one per line, for a person to fix in one go.
pub fn describe(problems: &[Problem]) -> String {
    match problems {
        [one] => one.to_string(),
        many => {
            let mut text = format!("{} problems:", many.len());
            for problem in many {
                text.push_str(&format!("\n  {problem}"));
            }
            text
        }
    }
}

/// Whether `name` may name a batch: 1 to 63 of `[a-z0-9.-]`.
fn name_is_valid(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= NAME_LEN_MAX
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.')
}

impl PayoutBatch {
    /// The manifest of the batch `name` in `namespace`, with the default batch size
    /// ([`BATCH_MAX_DEFAULT`]; set `spec.batch_max` for another).
    pub fn new(
        name: &str,
        namespace: Option<&str>,
        workers: u32,
        payouts: Vec<PayoutItem>,
    ) -> Self {
        PayoutBatch {
            api_version: API_VERSION.to_owned(),
            kind: KIND.to_owned(),
            metadata: Metadata {
                name: name.to_owned(),
                namespace: namespace.map(str::to_owned),
            },
            spec: BatchSpec {
                workers,
                batch_max: BATCH_MAX_DEFAULT,
                payouts,
            },
        }
    }

    /// Every problem of the batch, in the order of the manifest; empty when it may run.
    pub fn validate(&self) -> Vec<Problem> {
        let mut problems = Vec::new();
        if self.api_version != API_VERSION {
            problems.push(Problem::new(
                "apiVersion",
                format!("must be {API_VERSION}, got {:?}", self.api_version),
            ));
        }
        if self.kind != KIND {
            problems.push(Problem::new(
                "kind",
                format!("must be {KIND}, got {:?}", self.kind),
            ));
        }
        let name = &self.metadata.name;
        if !name_is_valid(name) {
            problems.push(Problem::new(
                "metadata.name",
                format!("{name:?} must be a DNS-1123 name of at most {NAME_LEN_MAX} characters"),
            ));
        }
        let workers = self.spec.workers;
        if !(1..=WORKERS_MAX).contains(&workers) {
            problems.push(Problem::new(
                "spec.workers",
                format!("must be 1 to {WORKERS_MAX}, got {workers}"),
            ));
        }
        let batch_max = self.spec.batch_max;
        if !(1..=BATCH_MAX_MAX).contains(&batch_max) {
            problems.push(Problem::new(
                "spec.batchMax",
                format!("must be 1 to {BATCH_MAX_MAX}, got {batch_max}"),
            ));
        }
        let payouts = &self.spec.payouts;
        if payouts.is_empty() || payouts.len() > PAYOUTS_PER_BATCH_MAX {
            problems.push(Problem::new(
                "spec.payouts",
                format!(
                    "must list 1 to {PAYOUTS_PER_BATCH_MAX} payouts, got {}",
                    payouts.len()
                ),
            ));
        }
        let mut keys = HashSet::new();
        for (i, item) in payouts.iter().enumerate() {
            item_problems(
                &format!("spec.payouts[{i}]"),
                item,
                &mut keys,
                &mut problems,
            );
        }
        problems
    }

    /// The payouts with their derived ids and idempotency keys.
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

fn item_problems<'a>(
    at: &str,
    item: &'a PayoutItem,
    keys: &mut HashSet<&'a str>,
    problems: &mut Vec<Problem>,
) {
    let mut problem = |field: &str, message: String| {
        problems.push(Problem::new(format!("{at}.{field}"), message));
    };
    if item.key.is_empty() || item.key.len() > KEY_LEN_MAX {
        problem("key", format!("must be 1 to {KEY_LEN_MAX} characters"));
    } else if !keys.insert(item.key.as_str()) {
        problem(
            "key",
            format!(
                "{:?} is used twice; keys are unique within a batch",
                item.key
            ),
        );
    }
    if !account_id_is_valid(&item.account_id) {
        problem(
            "accountId",
            format!("{:?} {ACCOUNT_ID_RULE}", item.account_id),
        );
    }
    if !(1..=AMOUNT_MINOR_MAX).contains(&item.amount_minor) {
        problem(
            "amountMinor",
            format!(
                "must be a number of minor units from 1 to {AMOUNT_MINOR_MAX}, got {}",
                item.amount_minor
            ),
        );
    }
    if !currency_is_valid(&item.currency) {
        problem(
            "currency",
            format!(
                "{:?} is not an active ISO 4217 code such as EUR",
                item.currency
            ),
        );
    }
    if !reference_is_valid(&item.beneficiary_ref) {
        problem(
            "beneficiaryRef",
            format!("must be 1 to {REFERENCE_LEN_MAX} visible ASCII characters without spaces"),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::payment::ACCOUNT_ID_LEN_MAX;

    fn item(key: &str) -> PayoutItem {
        PayoutItem {
            key: key.to_owned(),
            account_id: "acct-17".to_owned(),
            amount_minor: 125_000,
            currency: "EUR".to_owned(),
            beneficiary_ref: format!("ben-{key}"),
        }
    }

    fn batch(items: Vec<PayoutItem>) -> PayoutBatch {
        PayoutBatch::new("payroll-2026-12", None, 8, items)
    }

    #[test]
    fn ids_come_from_the_batch_name_and_item_key_only() {
        let a = batch(vec![item("emp-0001"), item("emp-0002")]);
        assert_eq!(
            a.plan(),
            a.clone().plan(),
            "the same batch names the same payouts"
        );
        let plan = a.plan();
        assert_ne!(plan[0].payout_id, plan[1].payout_id);
        assert_eq!(plan[0].payout_id, payout_id("payroll-2026-12", "emp-0001"));
        assert_ne!(plan[0].payout_id, payout_id("payroll-2027-01", "emp-0001"));
        assert_eq!(
            plan[0].idempotency_key,
            format!("payout-{}", plan[0].payout_id)
        );
    }

    #[test]
    fn a_valid_batch_has_no_problems() {
        assert_eq!(
            batch(vec![item("emp-0001"), item("emp-0002")]).validate(),
            []
        );
    }

    /// Every problem is reported at once, each with its path, in the order of the manifest.
    #[test]
    fn every_problem_is_reported_with_its_field() {
        let mut bad = batch(vec![item("emp-0001"), item("emp-0001"), item("emp-0003")]);
        bad.kind = "Payout".to_owned();
        bad.metadata.name = "Payroll".to_owned();
        bad.spec.workers = 0;
        bad.spec.batch_max = BATCH_MAX_MAX + 1;
        bad.spec.payouts[2].account_id = "a/b".to_owned();
        bad.spec.payouts[2].amount_minor = AMOUNT_MINOR_MAX + 1;
        bad.spec.payouts[2].currency = "eur".to_owned();
        bad.spec.payouts[2].beneficiary_ref = "ben 3".to_owned();
        let problems = bad.validate();
        let fields: Vec<&str> = problems.iter().map(|p| p.field.as_str()).collect();
        assert_eq!(
            fields,
            [
                "kind",
                "metadata.name",
                "spec.workers",
                "spec.batchMax",
                "spec.payouts[1].key",
                "spec.payouts[2].accountId",
                "spec.payouts[2].amountMinor",
                "spec.payouts[2].currency",
                "spec.payouts[2].beneficiaryRef",
            ]
        );
        assert!(
            problems[4].message.contains("used twice"),
            "{}",
            problems[4]
        );
        assert!(
            problems[5].message.contains(ACCOUNT_ID_RULE),
            "{}",
            problems[5]
        );
        let text = describe(&problems);
        assert!(
            text.starts_with("9 problems:\n  kind: must be PayoutBatch"),
            "{text}"
        );
    }

    #[test]
    fn the_rules_are_the_payment_resources() {
        let mut at_limits = item("k");
        at_limits.account_id = "a".repeat(ACCOUNT_ID_LEN_MAX);
        at_limits.amount_minor = AMOUNT_MINOR_MAX;
        at_limits.beneficiary_ref = "b".repeat(REFERENCE_LEN_MAX);
        at_limits.key = "k".repeat(KEY_LEN_MAX);
        assert_eq!(batch(vec![at_limits.clone()]).validate(), []);
        for broken in [
            PayoutItem {
                account_id: "a".repeat(ACCOUNT_ID_LEN_MAX + 1),
                ..at_limits.clone()
            },
            PayoutItem {
                amount_minor: 0,
                ..at_limits.clone()
            },
            PayoutItem {
                currency: "XXX".to_owned(),
                ..at_limits.clone()
            },
            PayoutItem {
                beneficiary_ref: String::new(),
                ..at_limits.clone()
            },
            PayoutItem {
                key: "k".repeat(KEY_LEN_MAX + 1),
                ..at_limits.clone()
            },
        ] {
            assert_eq!(
                batch(vec![broken.clone()]).validate().len(),
                1,
                "{broken:?}"
            );
        }
        assert_eq!(batch(Vec::new()).validate()[0].field, "spec.payouts");
    }

    /// `spec.batchMax` is 1 to a batch request's limit, 32 when absent, and named when outside.
    #[test]
    fn batch_max_is_one_to_a_batch_requests_limit_and_32_when_absent() {
        assert_eq!(BATCH_MAX_MAX as usize, crate::batch::MAX_ITEMS);
        let read = |spec: &str| -> PayoutBatch {
            let text = format!(
                r#"{{"apiVersion": "{API_VERSION}", "kind": "{KIND}", "metadata": {{"name": "b"}},
                    "spec": {{{spec}"payouts": [{{"key": "k", "accountId": "acct-1",
                    "amountMinor": 1, "currency": "EUR", "beneficiaryRef": "ben-1"}}]}}}}"#
            );
            serde_json::from_str(&text).unwrap_or_else(|e| panic!("{spec:?}: {e}"))
        };
        let absent = read("");
        assert_eq!(absent.spec.batch_max, BATCH_MAX_DEFAULT);
        assert_eq!(absent.spec.batch_max, 32);
        assert_eq!(absent.validate(), []);
        assert_eq!(read(r#""batchMax": 8, "#).spec.batch_max, 8);
        for fits in [1, BATCH_MAX_MAX] {
            let mut b = batch(vec![item("k")]);
            b.spec.batch_max = fits;
            assert_eq!(b.validate(), [], "batchMax {fits}");
        }
        for outside in [0, BATCH_MAX_MAX + 1] {
            let problems = read(&format!(r#""batchMax": {outside}, "#)).validate();
            assert_eq!(
                problems,
                [Problem::new(
                    "spec.batchMax",
                    format!("must be 1 to 64, got {outside}")
                )]
            );
        }
    }
}
