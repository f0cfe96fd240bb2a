//! A database built by the migrations this build's baseline squashed (the last generation of
//! migrations/<database>/retired.tsv) starts the services as it is: its migration rows are
//! rewritten to the baseline's, and the schema is already the baseline's. One that carries part
//! of a history, or exactly an older one (whose baseline was squashed in turn), is refused with
//! what to do and left alone.

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

/// A database with this build's schema whose migration rows are `history` (version, checksum,
/// description): what a database that applied the last retired history looks like (its schema is
/// the baseline's: `pg_dump --schema-only` of both was the same when the history was squashed),
/// and the migrations after the baseline, which a service applies again as the no-ops they then
/// are.
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
    record_history(&pool, history).await;
    pool
}

/// Replaces the database's migration rows with `history`'s.
async fn record_history(pool: &PgPool, history: &[squash::Retired]) {
    sqlx::query("DELETE FROM _sqlx_migrations")
        .execute(pool)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    for r in history {
        sqlx::query(
            "INSERT INTO _sqlx_migrations (version, description, success, checksum, \
             execution_time) VALUES ($1, $2, TRUE, $3, 1)",
        )
        .bind(r.version)
        .bind(&r.description)
        .bind(&r.checksum)
        .execute(pool)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    }
}

async fn rows(pool: &PgPool) -> Vec<(i64, Vec<u8>)> {
    sqlx::query_as("SELECT version, checksum FROM _sqlx_migrations ORDER BY version")
        .fetch_all(pool)
        .await
        .unwrap_or_else(|e| panic!("{e}"))
}

/// Starts `database` as a service does (adopt, then migrate) and checks that its migration rows
/// are this build's migrations (the baseline and those after it), each once.
async fn serves_with_this_builds_migrations(pg: &PgServer, database: &str, migrator: &Migrator) {
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
        "{database}: this build's rows, each once"
    );
    pool.close().await;
}

/// The retired histories of `database`, oldest first, each as the rows sqlx recorded.
fn generations(database: &str) -> Vec<Vec<squash::Retired>> {
    let generations: Vec<Vec<squash::Retired>> = squash::retired(database)
        .into_iter()
        .map(|g| g.migrations)
        .collect();
    assert!(
        generations.len() >= 2,
        "{database}: a first history and the one after it"
    );
    generations
}

/// Starts the database `name` of the server as a service starts `database` and returns why it
/// refused to.
async fn refusal(pg: &PgServer, name: &str, database: &str, migrator: &Migrator) -> String {
    settings(pg, name)
        .connect("dlock-test", migrator, database)
        .await
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default()
}

#[tokio::test]
async fn a_database_with_the_whole_last_retired_history_is_adopted_and_serves() {
    let pg = PgServer::start(None).unwrap_or_else(|e| panic!("{e:#}"));
    for (database, migrator) in databases() {
        let last = generations(database).pop().unwrap_or_default();
        let pool = database_recording(&pg, database, migrator, &last).await;
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

        serves_with_this_builds_migrations(&pg, database, migrator).await;
        // A second start finds nothing to adopt and nothing to apply.
        let again = squash::adopt(&pool, migrator, database).await;
        assert!(
            matches!(again, Ok(Adoption::NotNeeded)),
            "{database}: {again:?}"
        );
        serves_with_this_builds_migrations(&pg, database, migrator).await;
    }
}

#[tokio::test]
async fn a_database_with_part_of_a_retired_history_is_refused_and_left_alone() {
    let pg = PgServer::start(None).unwrap_or_else(|e| panic!("{e:#}"));
    for (database, migrator) in databases() {
        for (g, mut partial) in generations(database).into_iter().enumerate() {
            partial.pop();
            let name = format!("{database}_part_{g}");
            let pool = database_recording(&pg, &name, migrator, &partial).await;
            let before = rows(&pool).await;
            let message = refusal(&pg, &name, database, migrator).await;
            assert!(
                message.contains(database)
                    && message.contains("last release before the squash")
                    && message.contains("Nothing was changed"),
                "{name}: the refusal says what to do: {message}"
            );
            assert_eq!(rows(&pool).await, before, "{name}: nothing changed");
        }
    }
}

#[tokio::test]
async fn a_database_at_an_older_retired_history_is_refused_until_the_releases_carry_it_on() {
    let pg = PgServer::start(None).unwrap_or_else(|e| panic!("{e:#}"));
    for (database, migrator) in databases() {
        let generations = generations(database);
        let pool = database_recording(&pg, database, migrator, &generations[0]).await;
        // Each older history in turn, as the releases in between leave the database: the release
        // that still carries the baseline a history was squashed into adopts it and applies the
        // migrations after that baseline, which are the next history.
        let baseline_of = |history: &[squash::Retired]| -> Vec<i64> {
            history
                .iter()
                .take_while(|m| m.description.starts_with("baseline"))
                .map(|m| m.version)
                .collect()
        };
        let this_baseline: Vec<i64> = migrator
            .iter()
            .filter(|m| m.description.starts_with("baseline"))
            .map(|m| m.version)
            .collect();
        for (g, (older, next)) in generations.iter().zip(&generations[1..]).enumerate() {
            record_history(&pool, older).await;
            let carried = baseline_of(next);
            assert!(!carried.is_empty(), "{database}");
            // The release before each later squash, oldest first, this build's last.
            let releases: Vec<String> = generations[g + 2..]
                .iter()
                .map(|later| baseline_of(later))
                .chain([this_baseline.clone()])
                .map(|into| format!("the last release before the squash into versions {into:?}"))
                .collect();
            let before = rows(&pool).await;
            let message = refusal(&pg, database, database, migrator).await;
            assert!(
                message.contains(database)
                    && message.contains(&format!("still carries versions {carried:?}"))
                    && message.contains(&format!(
                        "Start {} against it once",
                        releases.join(", then ")
                    ))
                    && message.contains("Then start this one"),
                "{database} at versions {:?}: the refusal says what to do: {message}",
                older.first().map(|m| m.version)
            );
            assert_eq!(rows(&pool).await, before, "{database}: nothing changed");
        }
        // Positive control: the same database, the same schema, with the rows the release that
        // still carries the last retired baseline leaves (the last history): this one starts.
        record_history(&pool, generations.last().map_or(&[][..], |g| g)).await;
        serves_with_this_builds_migrations(&pg, database, migrator).await;
    }
}

#[tokio::test]
async fn a_new_database_gets_this_builds_migrations_and_no_retired_one() {
    let pg = PgServer::start(None).unwrap_or_else(|e| panic!("{e:#}"));
    for (database, migrator) in databases() {
        pg.create_database(database)
            .unwrap_or_else(|e| panic!("{e:#}"));
        serves_with_this_builds_migrations(&pg, database, migrator).await;
    }
}
