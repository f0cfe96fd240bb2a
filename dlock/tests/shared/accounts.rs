//! Accounts as the tests open them at the payment resource (the payouts bench of
//! dlock-executor includes this file too, so it may use only what that crate depends on).

use dlock_contract::payment::{CreateAccountRequest, FundRequest};
use dlock_contract::payment_client::PaymentClient;

/// Opens the EUR account `account` (key `open-{account}`) and, if `funds` is given, funds it
/// with that many minor units (key `fund-{account}`, reference `seed-{account}`).
pub async fn open_account(payment: &PaymentClient, account: &str, funds: Option<i64>) {
    let body = CreateAccountRequest {
        account_id: account.to_owned(),
        currency: "EUR".to_owned(),
    };
    payment
        .create_account(&format!("open-{account}"), &body)
        .await
        .unwrap_or_else(|e| panic!("opening {account}: {e}"));
    if let Some(amount_minor) = funds {
        let fund = FundRequest {
            amount_minor,
            reference: format!("seed-{account}"),
        };
        payment
            .fund(account, &format!("fund-{account}"), &fund)
            .await
            .unwrap_or_else(|e| panic!("funding {account}: {e}"));
    }
}
