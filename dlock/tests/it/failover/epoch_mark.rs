//! paydb checks its store epoch once per transaction (migrations/paydb/0036_epoch_once_per_transaction.sql):
//! the first guarded write of a transaction compares the timeline and marks the transaction, its
//! later writes pass on the mark, and the mark ends with the transaction, so the next
//! transaction's first write is checked again. Run on a real PostgreSQL migrated as the services
//! migrate it; the timeline change is written into `pay_store_epoch` as a promotion would leave it
//! (the failover scenarios in this folder make real ones).

use dlock_devstack::PgServer;
use sqlx::Connection;

/// `dlock.epoch_checked` as the session sees it now ("" when no transaction set it).
async fn mark(conn: &mut sqlx::PgConnection) -> String {
    sqlx::query_scalar::<_, Option<String>>("SELECT current_setting('dlock.epoch_checked', true)")
        .fetch_one(conn)
        .await
        .unwrap_or_else(|e| panic!("{e}"))
        .unwrap_or_default()
}

/// A guarded write that touches no row: the statement guard runs all the same.
const WRITE: &str = "UPDATE accounts SET updated_at = updated_at WHERE account_id = 'none'";

/// pay_store_epoch as a promotion of an asynchronous standby leaves it for the new primary: the
/// fences were written on another timeline, by a primary that was not replicating synchronously.
const OTHER_TIMELINE: &str =
    "UPDATE pay_store_epoch SET timeline = timeline + 1, synchronous = false";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_store_epoch_is_checked_by_the_first_write_of_every_transaction() {
    let pg = PgServer::start(None).unwrap_or_else(|e| panic!("{e:#}"));
    pg.create_database("paydb")
        .unwrap_or_else(|e| panic!("{e:#}"));
    let mut conn = sqlx::PgConnection::connect(&pg.url("paydb"))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    dlock_payment_resource::store::MIGRATOR
        .run(&mut conn)
        .await
        .unwrap_or_else(|e| panic!("{e}"));

    // A write marks its transaction; commit ends the mark.
    let mut tx = conn.begin().await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(mark(&mut tx).await, "", "no mark before the first write");
    sqlx::query(WRITE)
        .execute(&mut *tx)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        mark(&mut tx).await,
        "on",
        "the first write marks its transaction"
    );
    tx.commit().await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        mark(&mut conn).await,
        "",
        "the mark ends with its transaction"
    );

    // Within a marked transaction, later writes pass without a check: the epoch row says another
    // timeline, and the second write still goes through.
    let mut tx = conn.begin().await.unwrap_or_else(|e| panic!("{e}"));
    sqlx::query(WRITE)
        .execute(&mut *tx)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    sqlx::query(OTHER_TIMELINE)
        .execute(&mut *tx)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    sqlx::query(WRITE)
        .execute(&mut *tx)
        .await
        .unwrap_or_else(|e| panic!("the marked transaction's second write: {e}"));
    tx.commit().await.unwrap_or_else(|e| panic!("{e}"));

    // The next transaction's first write is checked, and refused: the mark did not outlive the
    // transaction that set it. The refusal is the guard's own (DL012), so the check ran.
    let refused = sqlx::query(WRITE)
        .execute(&mut conn)
        .await
        .expect_err("a write on a timeline the fences were not written on is refused");
    let code = refused
        .as_database_error()
        .and_then(|e| e.code())
        .map(|c| c.into_owned());
    assert_eq!(code.as_deref(), Some("DL012"), "{refused}");
    assert_eq!(mark(&mut conn).await, "", "a refused write leaves no mark");

    // A savepoint rolled back takes its mark with it: the write after it is checked again.
    let mut tx = conn.begin().await.unwrap_or_else(|e| panic!("{e}"));
    sqlx::query("UPDATE pay_store_epoch SET timeline = pay_timeline()")
        .execute(&mut *tx)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let mut savepoint = tx.begin().await.unwrap_or_else(|e| panic!("{e}"));
    sqlx::query(WRITE)
        .execute(&mut *savepoint)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(mark(&mut savepoint).await, "on");
    savepoint.rollback().await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(mark(&mut tx).await, "", "rolled back with its savepoint");
    sqlx::query(OTHER_TIMELINE)
        .execute(&mut *tx)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let refused = sqlx::query(WRITE)
        .execute(&mut *tx)
        .await
        .expect_err("checked again after the savepoint's rollback");
    assert!(
        refused.to_string().contains("paydb is on timeline"),
        "{refused}"
    );
}
