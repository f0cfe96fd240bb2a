//! The rail proxy's set path (migrations/paydb/0040_baseline_idempotency_and_rail.sql, docs/design.md#group-commit)
//! against real PostgreSQL: `rail_admit_set` and `rail_record_set` decide a batch as `rail_admit`
//! and `rail_record` decide its items one by one — the same answers and the same rows — over
//! every outcome an admission or a record can have; and `rail_admit_many` / `rail_record_many`
//! fall back to the items one by one when the set cannot take a batch, answering as before.
//!
//! Each comparison runs the batch and the items one by one from the same state, each in a
//! transaction that is rolled back, and compares what each answered and what the tables then
//! held.

use serde_json::Value;
use sqlx::PgConnection;
use uuid::Uuid;

use super::RailWorld;

/// One admission: the arguments of `rail_admit` after the payout.
#[derive(Clone)]
struct Admission {
    payout: Uuid,
    account: String,
    amount: i64,
    token: i64,
    key: String,
    submission: Uuid,
    request: String,
}

impl Admission {
    fn new(payout: Uuid, account: &str, amount: i64, token: i64, key: &str) -> Self {
        Self {
            payout,
            account: account.to_owned(),
            amount,
            token,
            key: key.to_owned(),
            submission: Uuid::new_v4(),
            request: format!("{{\"payout\":\"{payout}\",\"amount\":{amount}}}"),
        }
    }
}

/// What the rail's tables and the payouts hold, without times.
async fn snapshot(tx: &mut PgConnection) -> Vec<String> {
    const QUERIES: &[&str] = &[
        "SELECT submission_id || ' ' || payout_id || ' ' || account_id || ' ' || presented_token \
         || ' ' || idempotency_key || ' ' || outcome || ' ' \
         || coalesce(encode(request_hash, 'hex'), '-') || ' ' || coalesce(rail_reference, '-') \
         || ' ' || (resolved_at IS NULL) || ' ' || coalesce(late_outcome, '-') || ' ' \
         || coalesce(late_rail_reference, '-') FROM rail_submission ORDER BY submission_id",
        "SELECT account_id || ' ' || highest_token || ' ' || max_seen_token FROM rail_high_water \
         ORDER BY account_id",
        "SELECT payout_id || ' ' || state || ' ' || coalesce(submission_id::text, '-') || ' ' \
         || coalesce(rail_reference, '-') FROM payouts ORDER BY payout_id",
        "SELECT account_id || ' ' || balance_minor || ' ' || held_minor FROM accounts \
         ORDER BY account_id",
    ];
    crate::harness::text_rows(tx, QUERIES).await
}

/// An answer without what only a batch has (`item`, the error columns) and without the time
/// of a resolution made in this run.
fn comparable(json: &str) -> Value {
    let mut answer: Value =
        serde_json::from_str(json).unwrap_or_else(|e| panic!("an answer `{json}`: {e}"));
    if let Some(map) = answer.as_object_mut() {
        for key in ["item", "error_state", "error_message"] {
            map.remove(key);
        }
        // The time a record ran differs between two runs; whether the attempt is resolved not.
        if let Some(resolved) = map.get_mut("resolved_at") {
            *resolved = Value::Bool(!resolved.is_null());
        }
    }
    answer
}

async fn begin(w: &RailWorld) -> sqlx::Transaction<'static, sqlx::Postgres> {
    w.pool.begin().await.unwrap_or_else(|e| panic!("{e}"))
}

/// `function` (`rail_admit_set` or `rail_admit_many`) over `items` in one call: the answers in
/// item order and the tables after, rolled back; or what PostgreSQL answered if it refused the
/// call.
async fn try_admitted_together(
    w: &RailWorld,
    function: &str,
    items: &[Admission],
    proven: bool,
) -> Result<(Vec<Value>, Vec<String>), sqlx::Error> {
    let mut tx = begin(w).await;
    let sql = format!(
        "SELECT row_to_json(a)::text FROM {function}($1, $2, $3, $4, $5, $6, $7, $8, $9, $10) a \
         ORDER BY a.item"
    );
    let rows: Result<Vec<(String,)>, _> = sqlx::query_as(sqlx::AssertSqlSafe(sql))
        .bind(items.iter().map(|i| i.payout).collect::<Vec<_>>())
        .bind(items.iter().map(|i| i.account.clone()).collect::<Vec<_>>())
        .bind(items.iter().map(|i| i.amount).collect::<Vec<_>>())
        .bind(items.iter().map(|_| "EUR".to_owned()).collect::<Vec<_>>())
        .bind(items.iter().map(|_| "ben".to_owned()).collect::<Vec<_>>())
        .bind(items.iter().map(|i| i.token).collect::<Vec<_>>())
        .bind(items.iter().map(|i| i.key.clone()).collect::<Vec<_>>())
        .bind(items.iter().map(|i| i.submission).collect::<Vec<_>>())
        .bind(items.iter().map(|i| i.request.clone()).collect::<Vec<_>>())
        .bind(proven)
        .fetch_all(&mut *tx)
        .await;
    let answers = match rows {
        Ok(rows) => rows.iter().map(|r| comparable(&r.0)).collect(),
        Err(e) => {
            tx.rollback().await.unwrap_or_else(|e| panic!("{e}"));
            return Err(e);
        }
    };
    let tables = snapshot(&mut tx).await;
    tx.rollback().await.unwrap_or_else(|e| panic!("{e}"));
    Ok((answers, tables))
}

async fn admitted_together(
    w: &RailWorld,
    function: &str,
    items: &[Admission],
    proven: bool,
) -> (Vec<Value>, Vec<String>) {
    try_admitted_together(w, function, items, proven)
        .await
        .unwrap_or_else(|e| panic!("{function}: {e}"))
}

/// `rail_admit` over `items` one by one, in item order: the answers and the tables after,
/// rolled back.
async fn admitted_one_by_one(
    w: &RailWorld,
    items: &[Admission],
    proven: bool,
) -> (Vec<Value>, Vec<String>) {
    let mut tx = begin(w).await;
    let mut answers = Vec::new();
    for i in items {
        answers.push(admit_one(&mut tx, i, proven).await);
    }
    let tables = snapshot(&mut tx).await;
    tx.rollback().await.unwrap_or_else(|e| panic!("{e}"));
    (answers, tables)
}

/// `rail_admit` of one item on `conn`: its answer, [`comparable`].
async fn admit_one(conn: &mut PgConnection, item: &Admission, proven: bool) -> Value {
    let (json,): (String,) = sqlx::query_as(
        "SELECT row_to_json(a)::text \
         FROM rail_admit($1, $2, $3, 'EUR', 'ben', $4, $5, $6, $7, $8) a",
    )
    .bind(item.payout)
    .bind(&item.account)
    .bind(item.amount)
    .bind(item.token)
    .bind(&item.key)
    .bind(item.submission)
    .bind(&item.request)
    .bind(proven)
    .fetch_one(conn)
    .await
    .unwrap_or_else(|e| panic!("rail_admit: {e}"));
    comparable(&json)
}

/// `rail_record` of one attempt on `conn`: its answer, [`comparable`].
async fn record_one(
    conn: &mut PgConnection,
    submission: Uuid,
    outcome: &str,
    reference: Option<&str>,
) -> Value {
    let (json,): (String,) =
        sqlx::query_as("SELECT row_to_json(a)::text FROM rail_record($1, $2, $3) a")
            .bind(submission)
            .bind(outcome)
            .bind(reference)
            .fetch_one(conn)
            .await
            .unwrap_or_else(|e| panic!("rail_record: {e}"));
    comparable(&json)
}

/// A connection of its own from the pool: what runs on it is committed at once.
async fn connection(w: &RailWorld) -> sqlx::pool::PoolConnection<sqlx::Postgres> {
    w.pool.acquire().await.unwrap_or_else(|e| panic!("{e}"))
}

/// Admits `item` for good (committed), as an earlier submission would have; `rail_admit` must
/// answer `admitted`.
async fn admit_now(w: &RailWorld, item: &Admission) {
    let answer = admit_one(&mut *connection(w).await, item, true).await;
    assert_eq!(answer["outcome"], "admitted", "{answer}");
}

/// Records an attempt's rail answer for good (committed).
async fn record_now(w: &RailWorld, submission: Uuid, outcome: &str, reference: Option<&str>) {
    record_one(&mut *connection(w).await, submission, outcome, reference).await;
}

async fn pending(w: &RailWorld, account: &str, amount: i64) -> Uuid {
    let payout = Uuid::new_v4();
    let (outcome,): (String,) =
        sqlx::query_as("SELECT outcome FROM pay_create_payout($1, $2, $3, 'EUR', 'ben')")
            .bind(payout)
            .bind(account)
            .bind(amount)
            .fetch_one(&w.pool)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(outcome, "created");
    payout
}

/// A batch with one item of every outcome `rail_admit` has, each on its own payout, account and
/// key: the outcomes, in item order, and the items.
async fn every_admission(w: &RailWorld) -> (Vec<&'static str>, Vec<Admission>) {
    let mut items = Vec::new();
    let mut expected = Vec::new();
    for account in [
        "sb-new",
        "sb-proven",
        "sb-unknown",
        "sb-mismatch",
        "sb-rail",
        "sb-account",
        "sb-dup",
        "sb-again",
        "sb-pending",
        "sb-replay",
        "sb-conflict",
    ] {
        w.account(account, 10_000).await;
    }
    // Admitted: claimed with the token presented, nothing before it.
    let p = w.claimed("sb-new", 100, 5).await;
    items.push(Admission::new(p, "sb-new", 100, 5, "k-new"));
    expected.push("admitted");
    let p = w.claimed("sb-proven", 100, 9).await;
    items.push(Admission::new(p, "sb-proven", 100, 9, "k-proven"));
    expected.push("admitted");
    // No such payout.
    items.push(Admission::new(
        Uuid::new_v4(),
        "sb-unknown",
        100,
        5,
        "k-unknown",
    ));
    expected.push("payout_unknown");
    // Not the registered amount.
    let p = w.claimed("sb-mismatch", 100, 5).await;
    items.push(Admission::new(p, "sb-mismatch", 999, 5, "k-mismatch"));
    expected.push("mismatch");
    // At or below the account's mark: another payout was admitted under a newer token.
    let stale = w.claimed("sb-rail", 100, 7).await;
    let newer = w.claimed("sb-rail", 100, 10).await;
    admit_now(
        w,
        &Admission::new(newer, "sb-rail", 100, 10, "k-rail-newer"),
    )
    .await;
    items.push(Admission::new(stale, "sb-rail", 100, 7, "k-rail"));
    expected.push("fenced");
    // Below the account's fence: a newer holder claimed another payout, nothing submitted yet.
    let stale = w.claimed("sb-account", 100, 3).await;
    w.claimed("sb-account", 100, 8).await;
    items.push(Admission::new(stale, "sb-account", 100, 3, "k-account"));
    expected.push("fenced");
    // The same payout and token under another key.
    let p = w.claimed("sb-dup", 100, 4).await;
    admit_now(w, &Admission::new(p, "sb-dup", 100, 4, "k-dup-first")).await;
    items.push(Admission::new(p, "sb-dup", 100, 4, "k-dup"));
    expected.push("duplicate");
    // A payout already presented, again under a newer token: one attempt per payout.
    let p = w.claimed("sb-again", 100, 4).await;
    admit_now(w, &Admission::new(p, "sb-again", 100, 4, "k-again-first")).await;
    items.push(Admission::new(p, "sb-again", 100, 6, "k-again"));
    expected.push("duplicate");
    // Never claimed.
    let p = pending(w, "sb-pending", 100).await;
    items.push(Admission::new(p, "sb-pending", 100, 5, "k-pending"));
    expected.push("not_claimable");
    // The same key, token and request again; and the same key and token with another request.
    let p = w.claimed("sb-replay", 100, 5).await;
    let first = Admission::new(p, "sb-replay", 100, 5, "k-replay");
    admit_now(w, &first).await;
    record_now(w, first.submission, "ACKED", Some("ref-replay")).await;
    items.push(Admission {
        submission: Uuid::new_v4(),
        ..first
    });
    expected.push("replay");
    let p = w.claimed("sb-conflict", 100, 5).await;
    let first = Admission::new(p, "sb-conflict", 100, 5, "k-conflict");
    admit_now(w, &first).await;
    items.push(Admission {
        submission: Uuid::new_v4(),
        request: "{\"another\":\"request\"}".to_owned(),
        ..first
    });
    expected.push("conflict");
    (expected, items)
}

fn outcomes(answers: &[Value]) -> Vec<String> {
    answers
        .iter()
        .map(|a| a["outcome"].as_str().unwrap_or("?").to_owned())
        .collect()
}

#[tokio::test]
async fn a_batch_of_admissions_decides_as_rail_admit_does_one_by_one() {
    let w = RailWorld::new().await;
    let (expected, items) = every_admission(&w).await;
    for proven in [true, false] {
        let (set, set_tables) = admitted_together(&w, "rail_admit_set", &items, proven).await;
        let (single, single_tables) = admitted_one_by_one(&w, &items, proven).await;
        assert_eq!(
            outcomes(&single),
            expected,
            "one by one, every outcome is there (proven {proven})"
        );
        assert_eq!(set, single, "the answers (proven {proven})");
        assert_eq!(set_tables, single_tables, "the tables (proven {proven})");
        // The batch function takes the set path and answers the same.
        let (many, many_tables) = admitted_together(&w, "rail_admit_many", &items, proven).await;
        assert_eq!(many, single, "rail_admit_many's answers (proven {proven})");
        assert_eq!(many_tables, single_tables, "rail_admit_many's tables");
    }
}

#[tokio::test]
async fn a_batch_the_set_cannot_take_goes_one_by_one_and_answers_the_same() {
    let w = RailWorld::new().await;
    w.account("sb-shared", 10_000).await;
    w.account("sb-alone", 10_000).await;
    // Two items on one account: the set refuses the batch (it needs an account per item).
    let first = w.claimed("sb-shared", 100, 5).await;
    let second = w.claimed("sb-shared", 100, 6).await;
    let alone = w.claimed("sb-alone", 100, 5).await;
    let items = vec![
        Admission::new(first, "sb-shared", 100, 5, "k-first"),
        Admission::new(second, "sb-shared", 100, 6, "k-second"),
        Admission::new(alone, "sb-alone", 100, 5, "k-alone"),
    ];
    let refused = try_admitted_together(&w, "rail_admit_set", &items, true).await;
    assert!(
        refused.is_err(),
        "the set path refuses two items on one account: {refused:?}"
    );
    let (many, many_tables) = admitted_together(&w, "rail_admit_many", &items, true).await;
    let (single, single_tables) = admitted_one_by_one(&w, &items, true).await;
    assert_eq!(
        outcomes(&single),
        ["fenced", "admitted", "admitted"],
        "one by one: the older holder of the shared account is fenced by the newer"
    );
    assert_eq!(many, single, "the answers");
    assert_eq!(many_tables, single_tables, "the tables");
}

/// `function` (`rail_record_set` or `rail_record_many`) over `items` in one call, or
/// `rail_record` one by one when `function` is None: the answers and the tables after, rolled
/// back.
async fn recorded(
    w: &RailWorld,
    function: Option<&str>,
    items: &[(Uuid, &str, Option<&str>)],
) -> (Vec<Value>, Vec<String>) {
    let mut tx = begin(w).await;
    let mut answers = Vec::new();
    if let Some(function) = function {
        let sql =
            format!("SELECT row_to_json(a)::text FROM {function}($1, $2, $3) a ORDER BY a.item");
        let rows: Vec<(String,)> = sqlx::query_as(sqlx::AssertSqlSafe(sql))
            .bind(items.iter().map(|i| i.0).collect::<Vec<_>>())
            .bind(items.iter().map(|i| i.1.to_owned()).collect::<Vec<_>>())
            .bind(
                items
                    .iter()
                    .map(|i| i.2.map(str::to_owned))
                    .collect::<Vec<_>>(),
            )
            .fetch_all(&mut *tx)
            .await
            .unwrap_or_else(|e| panic!("{function}: {e}"));
        answers.extend(rows.iter().map(|r| comparable(&r.0)));
    } else {
        for &(submission, outcome, reference) in items {
            answers.push(record_one(&mut tx, submission, outcome, reference).await);
        }
    }
    let tables = snapshot(&mut tx).await;
    tx.rollback().await.unwrap_or_else(|e| panic!("{e}"));
    (answers, tables)
}

#[tokio::test]
async fn a_batch_of_records_decides_as_rail_record_does_one_by_one() {
    let w = RailWorld::new().await;
    let mut attempts = Vec::new();
    for (n, account) in ["sr-ack", "sr-reject", "sr-timeout", "sr-late", "sr-done"]
        .into_iter()
        .enumerate()
    {
        w.account(account, 10_000).await;
        let p = w.claimed(account, 100, 5).await;
        let item = Admission::new(p, account, 100, 5, &format!("k-record-{n}"));
        admit_now(&w, &item).await;
        attempts.push(item.submission);
    }
    // Resolved before the batch: one timed out (its rail answer comes late), one acknowledged.
    record_now(&w, attempts[3], "TIMEOUT", None).await;
    record_now(&w, attempts[4], "ACKED", Some("ref-done")).await;
    let items = vec![
        (attempts[0], "ACKED", Some("ref-ack")),
        (attempts[1], "REJECTED", None),
        (attempts[2], "TIMEOUT", None),
        (attempts[3], "ACKED", Some("ref-late")),
        (attempts[4], "REJECTED", None),
        (Uuid::new_v4(), "ACKED", Some("ref-unknown")),
    ];
    let (single, single_tables) = recorded(&w, None, &items).await;
    assert_eq!(
        outcomes(&single),
        ["ACKED", "REJECTED", "TIMEOUT", "TIMEOUT", "ACKED", "?"],
        "one by one, every case is there"
    );
    let (set, set_tables) = recorded(&w, Some("rail_record_set"), &items).await;
    assert_eq!(set, single, "the answers");
    assert_eq!(set_tables, single_tables, "the tables");
    let (many, many_tables) = recorded(&w, Some("rail_record_many"), &items).await;
    assert_eq!(many, single, "rail_record_many's answers");
    assert_eq!(many_tables, single_tables, "rail_record_many's tables");
    // Not a rail outcome: the set refuses the batch, and one by one only that item is an error.
    let mut poisoned = items[..2].to_vec();
    poisoned.push((attempts[2], "MAYBE", None));
    let (many, _) = recorded(&w, Some("rail_record_many"), &poisoned).await;
    assert_eq!(
        outcomes(&many),
        ["ACKED", "REJECTED", "error"],
        "the poisoned item fails alone: {many:?}"
    );
}
