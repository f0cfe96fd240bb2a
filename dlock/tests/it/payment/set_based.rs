//! The set path of a batch (migrations/paydb/0040_baseline_idempotency_and_rail.sql,
//! docs/design.md#group-commit) against real PostgreSQL: `pay_claim_many` and `pay_post_many`
//! decide a batch as the per-row functions decide its items one by one, and paydb refuses in a
//! statement of many rows, as the batch writes them (statement-level triggers on the ledger, row
//! triggers on accounts and payouts), what it refuses in a statement of one: a lowered fence, an
//! illegal transition, an unbalanced posting, an overdraw. Each refusal is tried in a statement
//! shaped like the batch's (several rows, `FROM unnest(...)` or a multi-row VALUES) and in a
//! statement of one row (the single path), and changes nothing; a legal statement of the same
//! shape is the positive control.

use serde_json::Value;
use sqlx::PgPool;
use uuid::Uuid;

use super::PayStack;

mod registrations;

const HASH: [u8; 32] = [1; 32];
const OTHER_HASH: [u8; 32] = [2; 32];

/// paydb refuses each `(what, sql)` of `cases` (run by psql, so a multi-statement transaction is
/// one call).
fn refused(stack: &PayStack, cases: &[(&str, &str)]) {
    for (what, sql) in cases {
        let result = stack.pg().psql("paydb", sql);
        assert!(result.is_err(), "{what}: paydb accepted `{sql}`");
    }
}

/// What the tables hold, without ids and times that differ from run to run: the accounts, the
/// payouts, the idempotency records, the ledger, the shards, the day's outflow and the
/// abandonments.
async fn snapshot(tx: &mut sqlx::PgConnection) -> Vec<String> {
    const QUERIES: &[&str] = &[
        "SELECT account_id || ' ' || balance_minor || ' ' || held_minor || ' ' || fence || ' ' \
         || max_seen_token FROM accounts ORDER BY account_id",
        "SELECT payout_id || ' ' || state || ' ' || attempt_count || ' ' \
         || coalesce(claim_token::text, '-') || ' ' || coalesce(rail_reference, '-') \
         FROM payouts ORDER BY payout_id",
        "SELECT route || ' ' || fencing_token || ' ' || status FROM idempotency_records \
         ORDER BY route, fencing_token",
        "SELECT reference || ' ' || direction || ' ' || account_id || ' ' || amount_minor || ' ' \
         || fence FROM ledger_entries ORDER BY reference, direction",
        "SELECT account_id || ' ' || shard || ' ' || balance_minor FROM account_balance_shards \
         ORDER BY account_id, shard",
        "SELECT account_id || ' ' || claimed_minor FROM account_daily_outflow ORDER BY account_id",
        "SELECT payout_id || ' ' || cause || ' ' || token FROM payout_abandonments \
         ORDER BY payout_id",
    ];
    crate::harness::text_rows(tx, QUERIES).await
}

/// An answer as JSON, without what a batch adds (item, error columns) and with the entries'
/// ids left out (they are random).
fn comparable(mut answer: Value) -> Value {
    if let Some(map) = answer.as_object_mut() {
        for key in ["item", "error_state", "error_message"] {
            map.remove(key);
        }
        if let Some(Value::String(entries)) = map.get("entries").cloned() {
            let mut entries: Value =
                serde_json::from_str(&entries).unwrap_or_else(|e| panic!("{entries}: {e}"));
            for entry in entries.as_array_mut().into_iter().flatten() {
                entry.as_object_mut().map(|e| e.remove("entryId"));
            }
            map.insert("entries".into(), entries);
        }
    }
    answer
}

/// One item of a batch.
struct Item {
    route: String,
    token: i64,
    hash: [u8; 32],
    payout: Uuid,
    /// Claims: the expected state. Posts: the rail reference.
    arg: String,
    submission: Uuid,
}

const MAX_ATTEMPTS: i32 = 2;

/// The batch through `pay_claim_many` (or `pay_post_many`) in a transaction that is rolled back:
/// the answers in item order, and what the tables then held.
async fn by_batch(pool: &PgPool, post: bool, items: &[Item]) -> (Vec<Value>, Vec<String>) {
    let routes: Vec<String> = items.iter().map(|i| i.route.clone()).collect();
    let tokens: Vec<i64> = items.iter().map(|i| i.token).collect();
    let hashes: Vec<Vec<u8>> = items.iter().map(|i| i.hash.to_vec()).collect();
    let payouts: Vec<Uuid> = items.iter().map(|i| i.payout).collect();
    let args: Vec<String> = items.iter().map(|i| i.arg.clone()).collect();
    let n = items.len();
    let keys = vec!["k".to_owned(); n];
    let owners = vec!["w".to_owned(); n];
    let retention = vec![3_600_000i64; n];
    let submissions: Vec<Uuid> = items.iter().map(|i| i.submission).collect();
    let mut tx = pool.begin().await.unwrap_or_else(|e| panic!("{e}"));
    let sql = if post {
        "SELECT row_to_json(c)::text FROM pay_post_many($1, $2, $3, $4, $5, $6, 2000, $7, $8, \
         $9, true) c ORDER BY c.item"
    } else {
        "SELECT row_to_json(c)::text FROM pay_claim_many($1, $2, $3, $4, $5, $6, 2000, $7, $8, \
         $10, true) c ORDER BY c.item"
    };
    let rows: Vec<(String,)> = sqlx::query_as(sql)
        .bind(&routes)
        .bind(&keys)
        .bind(&tokens)
        .bind(&owners)
        .bind(&hashes)
        .bind(&retention)
        .bind(&payouts)
        .bind(&args)
        .bind(&submissions)
        .bind(MAX_ATTEMPTS)
        .fetch_all(&mut *tx)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"));
    let answers = rows
        .into_iter()
        .map(|r| serde_json::from_str(&r.0).unwrap_or_else(|e| panic!("{e}")))
        .collect();
    let tables = snapshot(&mut tx).await;
    tx.rollback().await.unwrap_or_else(|e| panic!("{e}"));
    (answers, tables)
}

/// The same items through the per-row functions (`pay_claim_once`, `pay_post_once`), one by
/// one in 0016's order (by account, highest token first), each in a savepoint that an item that
/// raises rolls back alone (answered `error`); a transaction that is rolled back.
async fn one_by_one(pool: &PgPool, post: bool, items: &[Item]) -> (Vec<Value>, Vec<String>) {
    let mut tx = pool.begin().await.unwrap_or_else(|e| panic!("{e}"));
    let mut order: Vec<(String, i64, usize)> = Vec::new();
    for (n, item) in items.iter().enumerate() {
        let (account,): (String,) =
            sqlx::query_as("SELECT account_id FROM payouts WHERE payout_id = $1")
                .bind(item.payout)
                .fetch_one(&mut *tx)
                .await
                .unwrap_or_else(|e| panic!("{e}"));
        order.push((account, -item.token, n));
    }
    order.sort();
    let mut answers: Vec<Option<Value>> = items.iter().map(|_| None).collect();
    for (_, _, n) in order {
        let item = &items[n];
        sqlx::query("SAVEPOINT item")
            .execute(&mut *tx)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        let sql = if post {
            "SELECT row_to_json(c)::text FROM pay_post_once($1, 'k', $2, 'w', $3, 3600000, 2000, \
             $4, $5, $6, true) c"
        } else {
            "SELECT row_to_json(c)::text FROM pay_claim_once($1, 'k', $2, 'w', $3, 3600000, 2000, \
             $4, $5, $7, true) c"
        };
        let answer: Result<(String,), sqlx::Error> = sqlx::query_as(sql)
            .bind(&item.route)
            .bind(item.token)
            .bind(item.hash.to_vec())
            .bind(item.payout)
            .bind(&item.arg)
            .bind(item.submission)
            .bind(MAX_ATTEMPTS)
            .fetch_one(&mut *tx)
            .await;
        answers[n] = Some(match answer {
            Ok((text,)) => serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}")),
            Err(_) => {
                sqlx::query("ROLLBACK TO SAVEPOINT item")
                    .execute(&mut *tx)
                    .await
                    .unwrap_or_else(|e| panic!("{e}"));
                serde_json::json!({ "begin_outcome": "error" })
            }
        });
    }
    let tables = snapshot(&mut tx).await;
    tx.rollback().await.unwrap_or_else(|e| panic!("{e}"));
    (answers.into_iter().flatten().collect(), tables)
}

/// Each answer's `begin_outcome/outcome`, `-` for what it lacks.
fn outcomes(answers: &[Value]) -> Vec<String> {
    answers
        .iter()
        .map(|a| {
            format!(
                "{}/{}",
                a["begin_outcome"].as_str().unwrap_or("-"),
                a["outcome"].as_str().unwrap_or("-")
            )
        })
        .collect()
}

/// The batch's answers and the tables after it are the single path's. An `error` item of a
/// batch keeps only its begin_outcome for the comparison (the per-row reference does not read
/// the error's text).
fn compare(
    (batch, batch_tables): (Vec<Value>, Vec<String>),
    (single, single_tables): (Vec<Value>, Vec<String>),
) {
    assert_eq!(batch_tables, single_tables, "the tables after the batch");
    assert_eq!(batch.len(), single.len(), "one answer per item");
    for (n, (b, s)) in batch.into_iter().zip(single).enumerate() {
        let b = if b["begin_outcome"] == "error" {
            serde_json::json!({ "begin_outcome": "error" })
        } else {
            comparable(b)
        };
        assert_eq!(b, comparable(s), "item {}", n + 1);
    }
}

/// One funded EUR account per entry (`(account, balance)`) and a PENDING payout of `amount` on
/// each; the payouts.
async fn accounts(stack: &PayStack, accounts: &[(&str, i64)], amount: i64) -> Vec<Uuid> {
    let mut payouts = Vec::new();
    for (account, balance) in accounts {
        stack.account(account, "EUR").await;
        stack.fund(account, *balance).await;
        payouts.push(stack.payout(account, amount, "EUR").await);
    }
    payouts
}

/// The batch through the set path ([`by_batch`]) and through the per-row path ([`one_by_one`]).
async fn both_paths(
    pool: &PgPool,
    post: bool,
    items: &[Item],
) -> ((Vec<Value>, Vec<String>), (Vec<Value>, Vec<String>)) {
    (
        by_batch(pool, post, items).await,
        one_by_one(pool, post, items).await,
    )
}

fn claim(payout: Uuid, token: i64, expected: &str, hash: [u8; 32]) -> Item {
    Item {
        route: format!("claim {payout}"),
        token,
        hash,
        payout,
        arg: expected.into(),
        submission: Uuid::nil(),
    }
}

#[tokio::test]
async fn a_batch_of_claims_decides_as_the_per_row_functions_do() {
    let stack = PayStack::start().await;
    let p = accounts(
        &stack,
        &[
            ("sb-ok", 1_000),
            ("sb-poor", 50),
            ("sb-fenced", 1_000),
            ("sb-state", 1_000),
            ("sb-reclaim", 1_000),
            ("sb-spent", 1_000),
            ("sb-pair", 1_000),
            ("sb-replay", 1_000),
            ("sb-conflict", 1_000),
        ],
        100,
    )
    .await;
    let pair_second = stack.payout("sb-pair", 100, "EUR").await;
    stack.psql(&format!(
        "UPDATE accounts SET fence = 70 WHERE account_id = 'sb-fenced'; \
         UPDATE payouts SET state = 'CLAIMED', attempt_count = 1, claim_token = 10 WHERE payout_id = '{}'; \
         UPDATE payouts SET state = 'CLAIMED', attempt_count = 1, claim_token = 10 WHERE payout_id = '{}'; \
         UPDATE payouts SET state = 'CLAIMED', attempt_count = 2, claim_token = 11 WHERE payout_id = '{}'; \
         INSERT INTO idempotency_records (route, idempotency_key, fencing_token, owner_id, payload_hash, status, response_status, response_body, expires_at) VALUES \
           ('claim {}', 'k', 57, 'w', '\\x{}', 'succeeded', 200, 'first answer', clock_timestamp() + interval '1 hour'), \
           ('claim {}', 'k', 58, 'w', '\\x{}', 'succeeded', 200, 'first answer', clock_timestamp() + interval '1 hour')",
        p[4],
        p[5],
        p[5],
        p[7],
        hex(&HASH),
        p[8],
        hex(&HASH),
    ));
    let items = vec![
        claim(p[0], 50, "PENDING", HASH),        // claimed, by the set
        claim(p[1], 51, "PENDING", HASH),        // insufficient funds: FAILED
        claim(p[2], 52, "PENDING", HASH),        // fenced out (fence 70)
        claim(p[3], 53, "CLAIMED", HASH),        // not claimable
        claim(p[4], 54, "CLAIMED", HASH),        // a newer holder re-claims
        claim(p[5], 55, "CLAIMED", HASH),        // out of attempts: abandoned, one by one
        claim(p[6], 56, "PENDING", HASH),        // two of one account: one by one,
        claim(pair_second, 59, "PENDING", HASH), // the newer wins, the older is fenced out
        claim(p[7], 57, "PENDING", HASH),        // replay
        claim(p[8], 58, "PENDING", OTHER_HASH),  // conflict
    ];
    let (batch, single) = both_paths(&stack.pool, false, &items).await;
    assert_eq!(
        outcomes(&batch.0),
        [
            "fresh/claimed",
            "fresh/insufficient_funds",
            "fresh/fenced_out",
            "fresh/not_claimable",
            "fresh/claimed",
            "fresh/abandoned",
            "fresh/fenced_out",
            "fresh/claimed",
            "replay/-",
            "conflict/-",
        ],
        "the batch's outcomes"
    );
    compare(batch, single);

    // An account limit raises in the set path: the whole set is rolled back and every item goes
    // one by one, where only the item over its limit fails, as on the per-row path.
    stack.psql(
        "INSERT INTO account_limits (account_id, daily_outflow_minor, set_by) VALUES ('sb-ok', 50, 'treasury')",
    );
    let (batch, single) = both_paths(&stack.pool, false, &items).await;
    first_over_its_limit_alone(batch, single, (4, "claimed"));
}

/// The first item of a batch went over its account's limit: it failed alone (23514, a CHECK's
/// refusal), its `neighbour` got `outcome`, and answers and tables are the single path's.
fn first_over_its_limit_alone(
    (batch, batch_tables): (Vec<Value>, Vec<String>),
    single: (Vec<Value>, Vec<String>),
    (neighbour, outcome): (usize, &str),
) {
    assert_eq!(
        batch[0]["begin_outcome"], "error",
        "over the limit: {}",
        batch[0]
    );
    assert_eq!(batch[0]["error_state"], "23514");
    assert_eq!(batch[neighbour]["outcome"], outcome, "its neighbour");
    compare((batch, batch_tables), single);
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn post(payout: Uuid, token: i64, reference: &str) -> Item {
    let (submission, _) = super::rail_ids(payout);
    Item {
        route: format!("post {payout}"),
        token,
        hash: HASH,
        payout,
        arg: reference.into(),
        submission,
    }
}

#[tokio::test]
async fn a_batch_of_posts_decides_as_the_per_row_functions_do() {
    let stack = PayStack::start().await;
    let p = accounts(
        &stack,
        &[
            ("sp-ok", 1_000),
            ("sp-fenced", 1_000),
            ("sp-state", 1_000),
            ("sp-mismatch", 1_000),
            ("sp-pair", 1_000),
            ("sp-newer", 1_000),
        ],
        100,
    )
    .await;
    let pair_second = stack.payout("sp-pair", 100, "EUR").await;
    // Claimed under tokens 20..25, then acknowledged by the (simulated) rail; sp-state's stays
    // CLAIMED; sp-fenced's fence is raised past its holder's token.
    for (n, payout) in [p[0], p[1], p[2], p[3], p[4], pair_second, p[5]]
        .into_iter()
        .enumerate()
    {
        stack.psql(&format!(
            "UPDATE accounts SET fence = greatest(fence, {t}) WHERE account_id = (SELECT account_id FROM payouts WHERE payout_id = '{payout}'); \
             UPDATE payouts SET state = 'CLAIMED', attempt_count = 1, claim_token = {t} WHERE payout_id = '{payout}'",
            t = 20 + n
        ));
        if payout != p[2] {
            super::rail_ack(&stack.pool, payout).await;
        }
    }
    stack.psql("UPDATE accounts SET fence = 90 WHERE account_id = 'sp-fenced'");
    let reference = |payout: Uuid| super::rail_ids(payout).1;
    let items = vec![
        post(p[0], 20, &reference(p[0])),               // posted
        post(p[1], 21, &reference(p[1])),               // fenced out (fence 90)
        post(p[2], 22, &reference(p[2])),               // not claimable (CLAIMED)
        post(p[3], 23, "another-reference"),            // reference mismatch
        post(p[4], 24, &reference(p[4])),               // two of one account: one by one,
        post(pair_second, 25, &reference(pair_second)), // the newer posts, the older is fenced
        post(p[5], 40, &reference(p[5])),               // a later holder posts, the fence rises
    ];
    let (batch, single) = both_paths(&stack.pool, true, &items).await;
    let outcomes: Vec<&str> = batch
        .0
        .iter()
        .map(|a| a["outcome"].as_str().unwrap_or("-"))
        .collect();
    assert_eq!(
        outcomes,
        [
            "posted",
            "fenced_out",
            "not_claimable",
            "reference_mismatch",
            "fenced_out",
            "posted",
            "posted",
        ],
        "the batch's outcomes"
    );
    compare(batch, single);
}

/// Three accounts a, b, c of `prefix` with 100 each and a PENDING payout of 60 on each.
async fn three(stack: &PayStack, prefix: &str) -> Vec<Uuid> {
    let names = ["a", "b", "c"].map(|s| format!("{prefix}-{s}"));
    accounts(stack, &names.each_ref().map(|n| (n.as_str(), 100)), 60).await
}

#[tokio::test]
async fn a_lowered_fence_is_refused_in_a_statement_of_many_rows_and_of_one() {
    let stack = PayStack::start().await;
    three(&stack, "lf").await;
    let fences = || {
        stack.psql("SELECT string_agg(fence::text, ',' ORDER BY account_id) FROM accounts WHERE account_id LIKE 'lf-%'")
    };
    stack.psql("UPDATE accounts SET fence = 10 WHERE account_id LIKE 'lf-%'");
    refused(
        &stack,
        &[
            (
                "a batch-shaped statement lowering one fence of three",
                "UPDATE accounts a SET fence = u.fence FROM unnest(ARRAY['lf-a', 'lf-b', 'lf-c'], ARRAY[11, 9, 12]) AS u(account_id, fence) WHERE a.account_id = u.account_id",
            ),
            (
                "a single lowering",
                "UPDATE accounts SET fence = 9 WHERE account_id = 'lf-b'",
            ),
        ],
    );
    assert_eq!(fences(), "10,10,10", "nothing changed");
    // Positive controls: the same statement raising all three, and a lowering recorded as a
    // recovery in its own transaction.
    stack.psql("UPDATE accounts a SET fence = u.fence FROM unnest(ARRAY['lf-a', 'lf-b', 'lf-c'], ARRAY[11, 13, 12]) AS u(account_id, fence) WHERE a.account_id = u.account_id");
    assert_eq!(fences(), "11,13,12");
    stack.psql(
        "BEGIN; \
         INSERT INTO fence_recoveries (resource, account_id, previous_token, new_token, operator, identity, owner_id, reason) \
           VALUES ('account', 'lf-b', 13, 12, 'op', 'operator', 'op', 'a recorded recovery'); \
         UPDATE accounts SET fence = 12 WHERE account_id = 'lf-b'; COMMIT;",
    );
    assert_eq!(fences(), "11,12,12");
}

#[tokio::test]
async fn an_illegal_transition_is_refused_in_a_statement_of_many_rows_and_of_one() {
    let stack = PayStack::start().await;
    let p = three(&stack, "it").await;
    let states = || {
        stack.psql("SELECT string_agg(state || ':' || attempt_count || ':' || coalesce(claim_token::text, '-'), ',' ORDER BY account_id) FROM payouts WHERE account_id LIKE 'it-%'")
    };
    let batch = |states: [&str; 3], attempts: [i32; 3], tokens: [&str; 3]| {
        format!(
            "UPDATE payouts x SET state = u.state, attempt_count = u.attempts, claim_token = u.token \
             FROM unnest(ARRAY['{}', '{}', '{}']::uuid[], ARRAY['{}', '{}', '{}'], ARRAY[{}, {}, {}], ARRAY[{}, {}, {}]::bigint[]) \
               AS u(payout_id, state, attempts, token) WHERE x.payout_id = u.payout_id",
            p[0],
            p[1],
            p[2],
            states[0],
            states[1],
            states[2],
            attempts[0],
            attempts[1],
            attempts[2],
            tokens[0],
            tokens[1],
            tokens[2]
        )
    };
    refused(
        &stack,
        &[
            (
                "a batch-shaped claim with one payout skipping to SUBMITTING",
                &batch(
                    ["CLAIMED", "SUBMITTING", "CLAIMED"],
                    [1, 0, 1],
                    ["5", "8", "6"],
                ),
            ),
            (
                "a batch-shaped claim with one claim not counting its attempt",
                &batch(
                    ["CLAIMED", "CLAIMED", "CLAIMED"],
                    [1, 0, 1],
                    ["5", "7", "6"],
                ),
            ),
            (
                "a single payout skipping to POSTED",
                &format!(
                    "UPDATE payouts SET state = 'POSTED', rail_reference = 'x' WHERE payout_id = '{}'",
                    p[1]
                ),
            ),
            (
                "a batch-shaped statement changing one amount",
                &format!(
                    "UPDATE payouts SET amount_minor = CASE WHEN payout_id = '{}' THEN 1 ELSE amount_minor END WHERE account_id LIKE 'it-%'",
                    p[2]
                ),
            ),
        ],
    );
    assert_eq!(
        states(),
        "PENDING:0:-,PENDING:0:-,PENDING:0:-",
        "nothing changed"
    );
    // Positive control: the same statement with three legal claims.
    stack.psql(&batch(
        ["CLAIMED", "CLAIMED", "CLAIMED"],
        [1, 1, 1],
        ["5", "7", "6"],
    ));
    assert_eq!(states(), "CLAIMED:1:5,CLAIMED:1:7,CLAIMED:1:6");
    refused(
        &stack,
        &[(
            "a batch-shaped re-claim with one token older than its payout's claim",
            &batch(
                ["CLAIMED", "CLAIMED", "CLAIMED"],
                [2, 2, 2],
                ["8", "6", "9"],
            ),
        )],
    );
    assert_eq!(
        states(),
        "CLAIMED:1:5,CLAIMED:1:7,CLAIMED:1:6",
        "nothing changed"
    );
    assert_eq!(
        stack.psql("SELECT string_agg(held_minor::text, ',' ORDER BY account_id) FROM accounts WHERE account_id LIKE 'it-%'"),
        "60,60,60",
        "the holds followed"
    );
}

#[tokio::test]
async fn an_unbalanced_posting_is_refused_in_a_statement_of_many_rows_and_of_one() {
    let stack = PayStack::start().await;
    three(&stack, "ub").await;
    let ledger = || {
        stack.psql("SELECT count(*) || ' ' || (SELECT string_agg(balance_minor::text, ',' ORDER BY account_id) FROM accounts WHERE account_id LIKE 'ub-%') FROM ledger_entries")
    };
    let before = ledger();
    let entry = |account: &str, direction: &str, amount: i64, reference: &str| {
        format!(
            "(gen_random_uuid(), '{account}', 'EUR', '{direction}', {amount}, 0, 'funding', '{reference}')"
        )
    };
    let insert = "INSERT INTO ledger_entries (entry_id, account_id, currency, direction, amount_minor, fence, kind, reference) VALUES ";
    refused(
        &stack,
        &[
            (
                "two postings in one statement, the second unbalanced",
                &format!(
                    "{insert}{}, {}, {}, {}",
                    entry("ub-a", "CREDIT", 5, "fund:ub-1"),
                    entry("funding-EUR", "DEBIT", 5, "fund:ub-1"),
                    entry("ub-b", "CREDIT", 5, "fund:ub-2"),
                    entry("funding-EUR", "DEBIT", 4, "fund:ub-2"),
                ),
            ),
            (
                "a lone entry",
                &format!("{insert}{}", entry("ub-c", "CREDIT", 5, "fund:ub-3")),
            ),
            (
                "a posting split over two statements that does not balance at commit",
                &format!(
                    "BEGIN; {insert}{}; {insert}{}; COMMIT;",
                    entry("ub-c", "CREDIT", 5, "fund:ub-4"),
                    entry("funding-EUR", "DEBIT", 6, "fund:ub-4"),
                ),
            ),
        ],
    );
    assert_eq!(ledger(), before, "nothing written, no balance moved");
    // Positive controls: two balanced postings in one statement, and one split over two
    // statements of a transaction.
    stack.psql(&format!(
        "{insert}{}, {}, {}, {}",
        entry("ub-a", "CREDIT", 5, "fund:ub-5"),
        entry("funding-EUR", "DEBIT", 5, "fund:ub-5"),
        entry("ub-b", "CREDIT", 7, "fund:ub-6"),
        entry("funding-EUR", "DEBIT", 7, "fund:ub-6"),
    ));
    stack.psql(&format!(
        "BEGIN; {insert}{}; {insert}{}; COMMIT;",
        entry("ub-c", "CREDIT", 9, "fund:ub-7"),
        entry("funding-EUR", "DEBIT", 9, "fund:ub-7"),
    ));
    assert_eq!(
        stack.psql("SELECT string_agg(balance_minor::text, ',' ORDER BY account_id) FROM accounts WHERE account_id LIKE 'ub-%'"),
        "105,107,109"
    );
}

#[tokio::test]
async fn an_overdraw_is_refused_in_a_statement_of_many_rows_and_of_one() {
    let stack = PayStack::start().await;
    let p = three(&stack, "od").await;
    let second = stack.payout("od-b", 60, "EUR").await;
    let money = || {
        stack.psql("SELECT string_agg(balance_minor || '/' || held_minor, ',' ORDER BY account_id) FROM accounts WHERE account_id LIKE 'od-%'")
    };
    let insert = "INSERT INTO ledger_entries (entry_id, account_id, currency, direction, amount_minor, fence, kind, reference) VALUES ";
    refused(
        &stack,
        &[
            (
                "a batch-shaped debit of three accounts, one below zero",
                &format!(
                    "{insert}(gen_random_uuid(), 'od-a', 'EUR', 'DEBIT', 10, 0, 'funding', 'fund:od-1'), \
                     (gen_random_uuid(), 'funding-EUR', 'EUR', 'CREDIT', 10, 0, 'funding', 'fund:od-1'), \
                     (gen_random_uuid(), 'od-b', 'EUR', 'DEBIT', 101, 0, 'funding', 'fund:od-2'), \
                     (gen_random_uuid(), 'funding-EUR', 'EUR', 'CREDIT', 101, 0, 'funding', 'fund:od-2')"
                ),
            ),
            // Two claims of 60 on one account of 100 in one statement: the holds of the
            // statement together leave available below zero.
            (
                "a batch-shaped claim holding more than the balance",
                &format!(
                    "UPDATE payouts x SET state = 'CLAIMED', attempt_count = 1, claim_token = u.token \
                     FROM unnest(ARRAY['{}', '{}', '{}']::uuid[], ARRAY[5, 6, 7]::bigint[]) AS u(payout_id, token) \
                     WHERE x.payout_id = u.payout_id",
                    p[0], p[1], second
                ),
            ),
            (
                "a single debit below zero",
                &format!(
                    "{insert}(gen_random_uuid(), 'od-c', 'EUR', 'DEBIT', 101, 0, 'funding', 'fund:od-3'), \
                     (gen_random_uuid(), 'funding-EUR', 'EUR', 'CREDIT', 101, 0, 'funding', 'fund:od-3')"
                ),
            ),
        ],
    );
    assert_eq!(money(), "100/0,100/0,100/0", "nothing changed");
    // Positive control: the claims that fit, in one statement.
    stack.psql(&format!(
        "UPDATE payouts x SET state = 'CLAIMED', attempt_count = 1, claim_token = u.token \
         FROM unnest(ARRAY['{}', '{}', '{}']::uuid[], ARRAY[5, 6, 7]::bigint[]) AS u(payout_id, token) \
         WHERE x.payout_id = u.payout_id",
        p[0], p[1], p[2]
    ));
    assert_eq!(money(), "100/60,100/60,100/60");
}
