//! The pair itself: what a synchronous and an asynchronous promotion keep, and a service pool on
//! its multi-host URL following a promotion without a restart.

use std::time::{Duration, Instant};

use dlock_devstack::pg_standby::{PgPair, Replication};
use dlock_server::pg::PgSettings;

use super::fail_over;

static NO_MIGRATIONS: sqlx::migrate::Migrator = sqlx::migrate::Migrator::DEFAULT;

fn rows(server: &dlock_devstack::PgServer) -> String {
    server
        .psql("app", "SELECT string_agg(id::text, ',' ORDER BY id) FROM t")
        .unwrap_or_else(|e| panic!("{e:#}"))
}

fn pair(replication: Replication) -> PgPair {
    let pair = PgPair::start(replication).unwrap_or_else(|e| panic!("{e:#}"));
    pair.create_database("app")
        .unwrap_or_else(|e| panic!("{e:#}"));
    pair.primary
        .psql("app", "CREATE TABLE t (id int PRIMARY KEY)")
        .unwrap_or_else(|e| panic!("{e:#}"));
    pair
}

#[test]
fn a_synchronous_promotion_keeps_every_acknowledged_commit() {
    let mut pair = pair(Replication::Synchronous);
    for id in 1..=3 {
        pair.primary
            .psql("app", &format!("INSERT INTO t VALUES ({id})"))
            .unwrap_or_else(|e| panic!("{e:#}"));
    }
    // Replay paused: the commits were flushed on the standby (that is what the primary waited
    // for), not applied; the promotion applies them.
    pair.pause_replay().unwrap_or_else(|e| panic!("{e:#}"));
    pair.primary
        .psql("app", "INSERT INTO t VALUES (4)")
        .unwrap_or_else(|e| panic!("{e:#}"));
    fail_over(&mut pair);
    assert_eq!(rows(&pair.standby), "1,2,3,4");
    pair.standby
        .psql("app", "INSERT INTO t VALUES (5)")
        .unwrap_or_else(|e| panic!("the promoted standby takes writes: {e:#}"));
}

#[test]
fn an_asynchronous_promotion_after_a_cut_loses_what_the_primary_acknowledged_since() {
    let mut pair = pair(Replication::Asynchronous);
    pair.primary
        .psql("app", "INSERT INTO t VALUES (1)")
        .unwrap_or_else(|e| panic!("{e:#}"));
    // Positive control: before the cut, the standby gets the primary's commits.
    pair.caught_up().unwrap_or_else(|e| panic!("{e:#}"));
    assert_eq!(rows(&pair.standby), "1");
    pair.cut().unwrap_or_else(|e| panic!("{e:#}"));
    pair.primary
        .psql("app", "INSERT INTO t VALUES (2)")
        .unwrap_or_else(|e| panic!("{e:#}"));
    assert_eq!(rows(&pair.primary), "1,2", "the primary acknowledged 2");
    fail_over(&mut pair);
    assert_eq!(rows(&pair.standby), "1", "the promotion lost 2");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pool_on_the_multi_host_url_follows_the_promotion_without_a_restart() {
    let mut pair = pair(Replication::Synchronous);
    let settings = PgSettings {
        url: pair.url("app"),
        pool_max: 4,
        acquire_timeout: Duration::from_secs(2),
        migrate: false,
        prefix: "test.pg".to_owned(),
    };
    let pool = settings
        .connect("failover-test", &NO_MIGRATIONS, "app")
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let port = |pool: sqlx::PgPool| async move {
        sqlx::query_as::<_, (i32,)>("SELECT current_setting('port')::int")
            .fetch_one(&pool)
            .await
            .map(|(p,)| p as u16)
    };
    assert_eq!(
        port(pool.clone()).await.unwrap_or_else(|e| panic!("{e}")),
        pair.primary.port
    );
    sqlx::query("INSERT INTO t VALUES (1)")
        .execute(&pool)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    pair.kill_primary().unwrap_or_else(|e| panic!("{e:#}"));
    let killed = Instant::now();
    // Until the promotion nothing takes writes: the standby answers read-only or not at all.
    let refused = sqlx::query("INSERT INTO t VALUES (2)").execute(&pool).await;
    assert!(refused.is_err(), "a write with no primary: {refused:?}");
    pair.promote().unwrap_or_else(|e| panic!("{e:#}"));
    let promoted = Instant::now();
    let mut attempts = 0;
    loop {
        attempts += 1;
        match sqlx::query("INSERT INTO t VALUES (3)").execute(&pool).await {
            Ok(_) => break,
            Err(e) if promoted.elapsed() < Duration::from_secs(10) => {
                eprintln!("after the promotion: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(e) => panic!("the pool did not follow the promotion within 10 s: {e}"),
        }
    }
    assert_eq!(
        port(pool.clone()).await.unwrap_or_else(|e| panic!("{e}")),
        pair.standby.port
    );
    assert_eq!(rows(&pair.standby), "1,3");
    println!(
        "writes again {} ms after the promotion ({} ms after the kill), {attempts} attempts",
        promoted.elapsed().as_millis(),
        killed.elapsed().as_millis()
    );
}
