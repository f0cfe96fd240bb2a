//! Accounts opened at once: the first accounts of a currency also create its funding and
//! settlement accounts, and opens that race on them must each be answered, never 500
//! (migrations/paydb/0039_baseline_payment_writes.sql).

use futures::future::join_all;
use serde_json::json;

use super::PayStack;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_first_accounts_of_a_currency_opened_at_once_are_all_created() {
    let stack = PayStack::start().await;
    // Forty currencies, three first accounts each, all at once: the race on a currency's system
    // accounts is a matter of timing, so give it many chances.
    let currencies = [
        "AUD", "BGN", "BRL", "CAD", "CHF", "CLP", "CNY", "COP", "CZK", "DKK", "EGP", "GBP", "HKD",
        "IDR", "ILS", "INR", "ISK", "JPY", "KES", "KRW", "MAD", "MXN", "MYR", "NGN", "NOK", "NZD",
        "PEN", "PHP", "PKR", "PLN", "QAR", "RON", "RSD", "SAR", "SEK", "SGD", "THB", "TRY", "UAH",
        "ZAR",
    ];
    let opens = currencies
        .iter()
        .flat_map(|currency| (0..3).map(move |i| (format!("open-{currency}-{i}"), *currency)));
    let answers = join_all(opens.map(|(id, currency)| {
        let stack = &stack;
        async move {
            let body = json!({ "accountId": id, "currency": currency });
            let answer = stack
                .write("/v1/accounts", &format!("acct-{id}"), None, &body)
                .await;
            (id, answer)
        }
    }))
    .await;
    for (id, answer) in &answers {
        answer.expect(&format!("open {id}"), 201, None);
    }
    // Each currency has its two system accounts once, and every customer account is there.
    let list = currencies.map(|c| format!("'{c}'")).join(",");
    let rows = stack.psql(&format!(
        "SELECT kind || ':' || count(*) FROM accounts WHERE currency IN ({list}) \
         GROUP BY kind ORDER BY kind"
    ));
    assert_eq!(
        rows.split_whitespace().collect::<Vec<_>>(),
        ["customer:120", "funding:40", "settlement:40"],
        "every open created its account and each currency its system accounts once"
    );

    // The same id opened at once under different keys: one is created, the rest find it.
    let same = join_all((0..6).map(|i| {
        let stack = &stack;
        async move {
            let body = json!({ "accountId": "open-same", "currency": "HUF" });
            stack
                .write("/v1/accounts", &format!("acct-same-{i}"), None, &body)
                .await
        }
    }))
    .await;
    // An open of an account that exists (with its currency) answers it as created, 201.
    for (i, answer) in same.iter().enumerate() {
        answer.expect(&format!("open of open-same #{i}"), 201, None);
    }
    assert_eq!(
        stack.psql("SELECT count(*) FROM accounts WHERE account_id = 'open-same'"),
        "1"
    );
}
