//! A batch of registrations by the set (migrations/paydb/0040_baseline_idempotency_and_rail.sql) against real
//! PostgreSQL: `pay_create_many` decides a batch as the single path decides its items one by one
//! (`pay_idempotency_begin`, then `pay_create_payout`, an unknown account rolled back), writes
//! what that path writes, and writes it in one statement; an item that raises sends the batch
//! one by one, where it fails alone.

use serde_json::{Value, json};
use sqlx::PgPool;
use uuid::Uuid;

use super::{HASH, OTHER_HASH, PayStack, compare, first_over_its_limit_alone, hex, outcomes};

/// One registration of a batch.
struct Registration {
    key: &'static str,
    hash: [u8; 32],
    payout: Uuid,
    account: &'static str,
    amount: i64,
    currency: &'static str,
}

const ROUTE: &str = "POST /v1/payouts";

impl Registration {
    fn beneficiary(&self) -> String {
        format!("ben-{}", self.payout)
    }
}

/// The tables a registration writes, without times.
async fn tables(tx: &mut sqlx::PgConnection) -> Vec<String> {
    const QUERIES: &[&str] = &[
        "SELECT payout_id || ' ' || account_id || ' ' || amount_minor || ' ' || currency || ' ' \
         || beneficiary_ref || ' ' || state FROM payouts ORDER BY payout_id",
        "SELECT idempotency_key || ' ' || fencing_token || ' ' || status || ' ' \
         || encode(payload_hash, 'hex') FROM idempotency_records ORDER BY idempotency_key",
        "SELECT account_id || ' ' || balance_minor || ' ' || held_minor FROM accounts \
         ORDER BY account_id",
    ];
    crate::harness::text_rows(tx, QUERIES).await
}

/// The batch through `pay_create_many`, in a transaction that is rolled back: the answers, the
/// tables, and how many transactions wrote the payouts it created (one for the set; one per
/// payout one by one, each in a subtransaction of its own).
async fn by_batch(pool: &PgPool, items: &[Registration]) -> (Vec<Value>, Vec<String>, i64) {
    let n = items.len();
    let keys: Vec<&str> = items.iter().map(|i| i.key).collect();
    let hashes: Vec<Vec<u8>> = items.iter().map(|i| i.hash.to_vec()).collect();
    let payouts: Vec<Uuid> = items.iter().map(|i| i.payout).collect();
    let accounts: Vec<&str> = items.iter().map(|i| i.account).collect();
    let amounts: Vec<i64> = items.iter().map(|i| i.amount).collect();
    let currencies: Vec<&str> = items.iter().map(|i| i.currency).collect();
    let beneficiaries: Vec<String> = items.iter().map(Registration::beneficiary).collect();
    let mut tx = pool.begin().await.unwrap_or_else(|e| panic!("{e}"));
    let sql = "SELECT row_to_json(c)::text FROM pay_create_many($1, $2, $3, $4, $5, $6, 2000, \
               $7, $8, $9, $10, $11) c ORDER BY c.item";
    let rows: Vec<(String,)> = sqlx::query_as(sql)
        .bind(vec![ROUTE; n])
        .bind(&keys)
        .bind(vec![0i64; n])
        .bind(vec!["w"; n])
        .bind(&hashes)
        .bind(vec![3_600_000i64; n])
        .bind(&payouts)
        .bind(&accounts)
        .bind(&amounts)
        .bind(&currencies)
        .bind(&beneficiaries)
        .fetch_all(&mut *tx)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"));
    let answers: Vec<Value> = rows
        .into_iter()
        .map(|r| serde_json::from_str(&r.0).unwrap_or_else(|e| panic!("{e}")))
        .collect();
    let created: Vec<Uuid> = answers
        .iter()
        .zip(items)
        .filter(|(a, _)| a["outcome"] == "created")
        .map(|(_, i)| i.payout)
        .collect();
    let (writers,): (i64,) =
        sqlx::query_as("SELECT count(DISTINCT xmin::text) FROM payouts WHERE payout_id = ANY ($1)")
            .bind(&created)
            .fetch_one(&mut *tx)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
    let tables = tables(&mut tx).await;
    tx.rollback().await.unwrap_or_else(|e| panic!("{e}"));
    (answers, tables, writers)
}

/// The same items on the single path, by account then payout, each in a savepoint: the record
/// (`pay_idempotency_begin`) and, when fresh, the payout (`pay_create_payout`); an unknown
/// account rolls its item back (404), a raise rolls it back (`error`). Rolled back.
async fn one_by_one(pool: &PgPool, items: &[Registration]) -> (Vec<Value>, Vec<String>) {
    let mut tx = pool.begin().await.unwrap_or_else(|e| panic!("{e}"));
    let mut order: Vec<usize> = (0..items.len()).collect();
    order.sort_by_key(|&n| (items[n].account, items[n].payout, n));
    let mut answers: Vec<Value> = vec![Value::Null; items.len()];
    for n in order {
        let item = &items[n];
        let run = |sql: &'static str| sqlx::query_as::<_, (String,)>(sql);
        sqlx::query("SAVEPOINT item")
            .execute(&mut *tx)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        let (begun,) = run(
            "SELECT row_to_json(b)::text FROM pay_idempotency_begin($1, $2, 0, 'w', $3, 3600000, \
             2000) b",
        )
        .bind(ROUTE)
        .bind(item.key)
        .bind(item.hash.to_vec())
        .fetch_one(&mut *tx)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
        let mut begun: Value = serde_json::from_str(&begun).unwrap_or_else(|e| panic!("{e}"));
        let begin_outcome = begun["outcome"].take();
        let mut answer = json!({
            "begin_outcome": begin_outcome,
            "response_status": begun["response_status"],
            "response_body": begun["response_body"],
            "outcome": null,
        });
        if begin_outcome == "fresh" {
            let created = run("SELECT outcome FROM pay_create_payout($1, $2, $3, $4::char(3), $5)")
                .bind(item.payout)
                .bind(item.account)
                .bind(item.amount)
                .bind(item.currency)
                .bind(item.beneficiary())
                .fetch_one(&mut *tx)
                .await;
            match created {
                Ok((outcome,)) if outcome == "account_unknown" => {
                    answer = json!({ "begin_outcome": "not_found", "response_status": null,
                                     "response_body": null, "outcome": null });
                    rollback_to(&mut tx).await;
                }
                Ok((outcome,)) => answer["outcome"] = outcome.into(),
                Err(_) => {
                    answer = json!({ "begin_outcome": "error" });
                    rollback_to(&mut tx).await;
                }
            }
        }
        answers[n] = answer;
    }
    let tables = tables(&mut tx).await;
    tx.rollback().await.unwrap_or_else(|e| panic!("{e}"));
    (answers, tables)
}

async fn rollback_to(tx: &mut sqlx::PgConnection) {
    sqlx::query("ROLLBACK TO SAVEPOINT item")
        .execute(tx)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
}

fn registration(key: &'static str, account: &'static str, payout: Uuid) -> Registration {
    Registration {
        key,
        hash: HASH,
        payout,
        account,
        amount: 100,
        currency: "EUR",
    }
}

#[tokio::test]
async fn a_batch_of_registrations_decides_as_the_single_path_does_in_one_statement() {
    let stack = PayStack::start().await;
    for account in ["rs-a", "rs-b"] {
        stack.account(account, "EUR").await;
    }
    let existing = stack.payout("rs-a", 100, "EUR").await;
    let (system,): (String,) =
        sqlx::query_as("SELECT account_id FROM accounts WHERE kind <> 'customer' LIMIT 1")
            .fetch_one(&stack.pool)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
    let system: &'static str = Box::leak(system.into_boxed_str());
    stack.psql(&format!(
        "INSERT INTO idempotency_records (route, idempotency_key, fencing_token, owner_id, \
         payload_hash, status, response_status, response_body, expires_at) VALUES \
         ('{ROUTE}', 'rs-replay', 0, 'w', '\\x{h}', 'succeeded', 201, 'first answer', \
          clock_timestamp() + interval '1 hour'), \
         ('{ROUTE}', 'rs-conflict', 0, 'w', '\\x{h}', 'succeeded', 201, 'first answer', \
          clock_timestamp() + interval '1 hour')",
        h = hex(&HASH),
    ));
    let twice = Uuid::new_v4();
    let items = vec![
        registration("rs-fresh-a", "rs-a", Uuid::new_v4()), // created, by the set
        registration("rs-fresh-b", "rs-b", Uuid::new_v4()), // created, by the set
        registration("rs-fresh-c", "rs-b", Uuid::new_v4()), // created, by the set
        registration("rs-replay", "rs-a", Uuid::new_v4()),  // replay
        Registration {
            hash: OTHER_HASH,
            ..registration("rs-conflict", "rs-a", Uuid::new_v4())
        },
        registration("rs-exists", "rs-a", existing), // the same payout again
        Registration {
            amount: 7,
            ..registration("rs-other", "rs-b", existing)
        }, // conflict
        registration("rs-nobody", "rs-nobody", Uuid::new_v4()), // unknown account
        registration("rs-system", system, Uuid::new_v4()), // not a customer account
        Registration {
            currency: "USD",
            ..registration("rs-usd", "rs-b", Uuid::new_v4())
        },
        registration("rs-twice-1", "rs-b", twice), // one payout twice: one by one,
        registration("rs-twice-2", "rs-b", twice), // the second finds the first's
    ];
    let (batch, batch_tables, writers) = by_batch(&stack.pool, &items).await;
    let single = one_by_one(&stack.pool, &items).await;
    assert_eq!(
        outcomes(&batch),
        [
            "fresh/created",
            "fresh/created",
            "fresh/created",
            "replay/-",
            "conflict/-",
            "fresh/exists",
            "fresh/conflict",
            "not_found/-",
            "not_found/-",
            "fresh/currency_mismatch",
            "fresh/created",
            "fresh/exists",
        ],
        "the batch's outcomes"
    );
    assert_eq!(
        batch[3]["response_status"], 201,
        "the replay's stored answer"
    );
    compare((batch, batch_tables), single);
    // The set's three payouts and the one of the pair (one by one) come from two writers.
    assert_eq!(writers, 2, "the set wrote its payouts in one statement");

    // An account's largest single payout raises in the set's insert: the set is rolled back as
    // a whole and every item goes one by one, where only the item over the limit fails.
    stack.psql("SELECT outcome FROM pay_set_limits('rs-a', 50, NULL, 'test')");
    let (batch, batch_tables, writers) = by_batch(&stack.pool, &items).await;
    let single = one_by_one(&stack.pool, &items).await;
    first_over_its_limit_alone((batch, batch_tables), single, (1, "created"));
    // Positive control of the count: rs-fresh-b, rs-fresh-c and the pair's, one writer each.
    assert_eq!(
        writers, 3,
        "one by one: each created payout in its own subtransaction"
    );
}
