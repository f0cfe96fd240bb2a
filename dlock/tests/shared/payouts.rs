//! Payouts as the tests write them: a PayoutBatch manifest, and one payout registered at the
//! payment resource.

use dlock_contract::payment::CreatePayoutRequest;
use dlock_contract::payment_client::PaymentClient;
use uuid::Uuid;

/// One item of a PayoutBatch (in EUR).
pub struct Item {
    pub key: String,
    pub account: String,
    pub amount_minor: i64,
    pub beneficiary_ref: String,
}

impl Item {
    /// Item `i` of a batch on `account`, under `key`: `base + i` minor units to `ben-{i}`.
    pub fn numbered(i: usize, key: String, account: &str, base: i64) -> Self {
        Self {
            key,
            account: account.to_owned(),
            amount_minor: base + i as i64,
            beneficiary_ref: format!("ben-{i}"),
        }
    }
}

/// `n` items keyed `item-{i}` (`i` zero-padded to `width` digits), each [`Item::numbered`] with
/// a base of 1 000, over the accounts `{prefix}-00`, `{prefix}-01`, … (`accounts` of them) in
/// turn.
#[allow(dead_code)] // the it suite's; the k8s suite includes this file too
pub fn spread(n: usize, width: usize, prefix: &str, accounts: usize) -> impl Iterator<Item = Item> {
    (0..n).map(move |i| {
        let account = format!("{prefix}-{:02}", i % accounts);
        Item::numbered(i, format!("item-{i:0width$}"), &account, 1_000)
    })
}

/// The PayoutBatch manifest `name`, run by `workers` workers, of `items`.
pub fn batch_manifest(name: &str, workers: usize, items: impl IntoIterator<Item = Item>) -> String {
    let mut yaml = format!(
        "apiVersion: dlock.io/v1alpha1\nkind: PayoutBatch\nmetadata:\n  name: {name}\nspec:\n  workers: {workers}\n  payouts:\n"
    );
    for item in items {
        yaml.push_str(&format!(
            "    - key: {}\n      accountId: {}\n      amountMinor: {}\n      currency: EUR\n      beneficiaryRef: {}\n",
            item.key, item.account, item.amount_minor, item.beneficiary_ref
        ));
    }
    yaml
}

/// A new PENDING payout of `amount_minor` EUR on `account`; its id.
pub async fn register_payout(
    client: &PaymentClient,
    account: &str,
    amount_minor: i64,
    beneficiary_ref: &str,
) -> Uuid {
    let id = Uuid::new_v4();
    client
        .create_payout(
            &format!("create-{id}"),
            &CreatePayoutRequest {
                payout_id: id,
                account_id: account.to_owned(),
                amount_minor,
                currency: "EUR".to_owned(),
                beneficiary_ref: beneficiary_ref.to_owned(),
            },
        )
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    id
}
