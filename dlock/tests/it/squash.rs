//! A database built by the migrations a baseline squashed starts the services as it is: its
//! migration rows are rewritten to the baseline's, and the schema is already the
//! baseline's. One that carries part of that history is refused and left alone.

use std::time::Duration;

use dlock_devstack::PgServer;
use dlock_server::pg::PgSettings;
use dlock_server::squash::{self, Adoption};
use sqlx::PgPool;
use sqlx::migrate::Migrator;

/// The databases and the migrations the services apply to them.
fn databases() -> [(&'static str, &'static Migrator); 2] {
    [
        ("lockdb", &dlock_lock_server::store::pg::MIGRATOR),
        ("paydb", &dlock_rail_proxy::MIGRATOR),
    ]
}

fn settings(pg: &PgServer, database: &str) -> PgSettings {
    PgSettings {
        url: pg.url(database),
        pool_max: 2,
        acquire_timeout: Duration::from_secs(10),
        migrate: true,
        prefix: format!("test.{database}"),
    }
}

/// A database with the baseline's schema whose migration rows are `history` (version, checksum):
/// what a database that applied the retired migrations looks like (their schema is the
/// baseline's: `pg_dump --schema-only` of both was the same when the history was squashed).
async fn database_recording(
    pg: &PgServer,
    database: &str,
    migrator: &Migrator,
    history: &[squash::Retired],
) -> PgPool {
    pg.create_database(database)
        .unwrap_or_else(|e| panic!("{e:#}"));
    let pool = PgPool::connect(&pg.url(database))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    migrator
        .run(&pool)
        .await
        .unwrap_or_else(|e| panic!("{database}: {e}"));
    sqlx::query("DELETE FROM _sqlx_migrations")
        .execute(&pool)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    for r in history {
        sqlx::query(
            "INSERT INTO _sqlx_migrations (version, description, success, checksum, \
             execution_time) VALUES ($1, 'retired', TRUE, $2, 1)",
        )
        .bind(r.version)
        .bind(&r.checksum)
        .execute(&pool)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    }
    pool
}

async fn rows(pool: &PgPool) -> Vec<(i64, Vec<u8>)> {
    sqlx::query_as("SELECT version, checksum FROM _sqlx_migrations ORDER BY version")
        .fetch_all(pool)
        .await
        .unwrap_or_else(|e| panic!("{e}"))
}

/// Starts `database` as a service does (adopt, then migrate) and checks that its migration rows
/// are this build's migrations (the baseline, and nothing after it yet), each once.
async fn serves_with_the_baseline_alone(pg: &PgServer, database: &str, migrator: &Migrator) {
    let pool = settings(pg, database)
        .connect("dlock-test", migrator, database)
        .await
        .unwrap_or_else(|e| panic!("{database}: {e}"));
    let baseline: Vec<(i64, Vec<u8>)> = migrator
        .iter()
        .map(|m| (m.version, m.checksum.to_vec()))
        .collect();
    assert!(!baseline.is_empty(), "{database}: no migrations");
    assert_eq!(
        rows(&pool).await,
        baseline,
        "{database}: the baseline's rows alone"
    );
    pool.close().await;
}

#[tokio::test]
async fn a_database_with_the_whole_retired_history_is_adopted_and_serves() {
    let pg = PgServer::start(None).unwrap_or_else(|e| panic!("{e:#}"));
    for (database, migrator) in databases() {
        let retired = squash::retired(database);
        let pool = database_recording(&pg, database, migrator, &retired).await;
        // Positive control: as recorded, sqlx alone refuses the database (the retired versions
        // are missing from this build), which is what adoption exists to prevent. Through a
        // pool of its own: sqlx keeps its migration lock on a connection it failed on.
        let control = PgPool::connect(&pg.url(database))
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        let refused = migrator.run(&control).await.err();
        assert!(
            refused
                .as_ref()
                .is_some_and(|e| e.to_string().contains("missing")),
            "{database}: sqlx alone refuses: {refused:?}"
        );
        control.close().await;

        serves_with_the_baseline_alone(&pg, database, migrator).await;
        // A second start finds nothing to adopt and nothing to apply.
        let again = squash::adopt(&pool, migrator, database).await;
        assert!(
            matches!(again, Ok(Adoption::NotNeeded)),
            "{database}: {again:?}"
        );
        serves_with_the_baseline_alone(&pg, database, migrator).await;
    }
}

#[tokio::test]
async fn a_database_with_part_of_the_retired_history_is_refused_and_left_alone() {
    let pg = PgServer::start(None).unwrap_or_else(|e| panic!("{e:#}"));
    for (database, migrator) in databases() {
        let mut partial = squash::retired(database);
        partial.pop();
        let pool = database_recording(&pg, database, migrator, &partial).await;
        let before = rows(&pool).await;
        let refused = settings(&pg, database)
            .connect("dlock-test", migrator, database)
            .await
            .err();
        let message = refused.map(|e| e.to_string()).unwrap_or_default();
        assert!(
            message.contains(database) && message.contains("last release before the squash"),
            "{database}: the refusal says what to do: {message}"
        );
        assert_eq!(rows(&pool).await, before, "{database}: nothing changed");
    }
}

#[tokio::test]
async fn a_new_database_gets_the_baseline_alone() {
    let pg = PgServer::start(None).unwrap_or_else(|e| panic!("{e:#}"));
    for (database, migrator) in databases() {
        pg.create_database(database)
            .unwrap_or_else(|e| panic!("{e:#}"));
        serves_with_the_baseline_alone(&pg, database, migrator).await;
    }
}
