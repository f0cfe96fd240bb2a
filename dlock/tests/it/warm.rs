//! The writes' warm connections (services/server/src/warm.rs) on a real PostgreSQL: the one that
//! came back last is handed out again, where the pool alone goes round its idle connections; one
//! out of the pool or unused for the warm time goes back to it, and so does one the pool has no
//! other to spare for its callers; a discarded one is closed and the others go back to the pool;
//! a statement dropped before its answer leaves the next user of its connection its own answer.

use std::time::Duration;

use dlock_devstack::PgServer;
use dlock_server::warm::Warm;
use sqlx::PgPool;

async fn backend(connection: &mut sqlx::PgConnection) -> i32 {
    sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(connection)
        .await
        .unwrap_or_else(|e| panic!("{e}"))
}

/// A pool of the services' options with three idle connections open, in the order opened.
async fn pool_of_three(pg: &PgServer) -> PgPool {
    let pool = dlock_server::pg::pool_options(8, Duration::from_secs(10))
        .connect(&pg.url("postgres"))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let mut open = Vec::new();
    for _ in 0..3 {
        open.push(pool.acquire().await.unwrap_or_else(|e| panic!("{e}")));
    }
    drop(open);
    pool
}

/// A PostgreSQL and warm connections of `keep` over [`pool_of_three`] on it.
async fn warm_of_three(keep: usize, warm_for: Duration) -> (PgServer, Warm) {
    let pg = PgServer::start(None).unwrap_or_else(|e| panic!("PostgreSQL: {e:#}"));
    let warm = Warm::with(pool_of_three(&pg).await, keep, warm_for);
    (pg, warm)
}

async fn warm_backend(warm: &Warm) -> i32 {
    let mut connection = warm.acquire().await.unwrap_or_else(|e| panic!("{e}"));
    backend(&mut connection).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_connection_that_came_back_last_is_handed_out_again() {
    let pg = PgServer::start(None).unwrap_or_else(|e| panic!("PostgreSQL: {e:#}"));
    let pool = pool_of_three(&pg).await;
    // Positive control: the pool alone hands out its idle connections first in, first out.
    let first = backend(&mut pool.acquire().await.unwrap_or_else(|e| panic!("{e}"))).await;
    let second = backend(&mut pool.acquire().await.unwrap_or_else(|e| panic!("{e}"))).await;
    assert_ne!(
        first, second,
        "the pool handed out the same connection twice in a row"
    );

    let warm = Warm::with(pool, 2, Duration::from_secs(60));
    let reused = warm_backend(&warm).await;
    for _ in 0..10 {
        assert_eq!(warm_backend(&warm).await, reused);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_out_of_the_pool_or_unused_for_the_warm_time_goes_back_to_it() {
    let warm_for = Duration::from_millis(500);
    let (_pg, warm) = warm_of_three(2, warm_for).await;
    let mut held = warm.acquire().await.unwrap_or_else(|e| panic!("{e}"));
    let first = backend(&mut held).await;
    // Out of the pool longer than the warm time: it goes back to the pool, not to the stack.
    tokio::time::sleep(warm_for * 2).await;
    drop(held);
    assert_ne!(warm_backend(&warm).await, first);

    let unused = warm_backend(&warm).await;
    // Positive control: back within the warm time, it is handed out again.
    assert_eq!(warm_backend(&warm).await, unused);
    // Unused for longer than the warm time: the next caller gets another from the pool.
    tokio::time::sleep(warm_for * 2).await;
    assert_ne!(warm_backend(&warm).await, unused);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_used_now_and_then_goes_back_once_out_for_the_warm_time() {
    let warm_for = Duration::from_millis(500);
    let (_pg, warm) = warm_of_three(2, warm_for).await;
    let first = warm_backend(&warm).await;
    // Never unused for the warm time, but out of the pool for longer than it.
    tokio::time::sleep(warm_for * 3 / 5).await;
    // Positive control: out for less than the warm time, it is handed out again.
    assert_eq!(warm_backend(&warm).await, first);
    tokio::time::sleep(warm_for * 3 / 5).await;
    assert_ne!(warm_backend(&warm).await, first);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_discarded_connection_is_closed_and_the_others_go_back_to_the_pool() {
    let (pg, warm) = warm_of_three(2, Duration::from_secs(60)).await;
    let (mut a, mut b) = (
        warm.acquire().await.unwrap_or_else(|e| panic!("{e}")),
        warm.acquire().await.unwrap_or_else(|e| panic!("{e}")),
    );
    let (pid_a, pid_b) = (backend(&mut a).await, backend(&mut b).await);
    drop(a);
    drop(b);
    let mut discarded = warm.acquire().await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        backend(&mut discarded).await,
        pid_b,
        "the last one back comes first"
    );
    discarded.discard();
    // The other one waiting went back to the pool: the next comes from the pool's front.
    let next = warm_backend(&warm).await;
    assert!(
        next != pid_a && next != pid_b,
        "{next} was one of the warm connections ({pid_a}, {pid_b})"
    );
    // The discarded connection's backend ends (its close runs on a task of its own).
    let gone = format!("SELECT count(*) FROM pg_stat_activity WHERE pid = {pid_b}");
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let count = pg
            .psql("postgres", &gone)
            .unwrap_or_else(|e| panic!("{e:#}"));
        if count.trim() == "0" {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "backend {pid_b} still runs 10 s after its connection was discarded"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Positive control: the query sees a backend that still runs.
    let alive = format!("SELECT count(*) FROM pg_stat_activity WHERE pid = {next}");
    let count = pg
        .psql("postgres", &alive)
        .unwrap_or_else(|e| panic!("{e:#}"));
    assert_eq!(count.trim(), "1");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_goes_back_to_a_pool_with_none_to_spare() {
    let pg = PgServer::start(None).unwrap_or_else(|e| panic!("PostgreSQL: {e:#}"));
    let pool = dlock_server::pg::pool_options(2, Duration::from_secs(30))
        .connect(&pg.url("postgres"))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let warm = Warm::with(pool.clone(), 1, Duration::from_secs(60));
    let (mut a, _b) = (
        warm.acquire().await.unwrap_or_else(|e| panic!("{e}")),
        warm.acquire().await.unwrap_or_else(|e| panic!("{e}")),
    );
    let pid_a = backend(&mut a).await;
    // Both of the pool's connections are out: a caller of the pool waits for one.
    drop(a);
    let waited = tokio::time::timeout(Duration::from_secs(10), pool.acquire()).await;
    let mut from_pool = waited
        .unwrap_or_else(|_| panic!("the pool's caller waited 10 s while a connection sat warm"))
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(backend(&mut from_pool).await, pid_a);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_statement_dropped_before_its_answer_does_not_confuse_the_next_user() {
    let (_pg, warm) = warm_of_three(1, Duration::from_secs(60)).await;
    let mut connection = warm.acquire().await.unwrap_or_else(|e| panic!("{e}"));
    let pid = backend(&mut connection).await;
    // The caller gives up while the statement runs (a client that went away, a timeout).
    let slow =
        sqlx::query_scalar::<_, i32>("SELECT 7 FROM pg_sleep(0.5)").fetch_one(&mut *connection);
    let gave_up = tokio::time::timeout(Duration::from_millis(50), slow).await;
    assert!(
        gave_up.is_err(),
        "the statement answered within 50 ms: {gave_up:?}"
    );
    drop(connection);
    // The next user gets that connection, its answer still unread, and its own answer.
    let mut next = warm.acquire().await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(backend(&mut next).await, pid, "not the same connection");
    let answer: i32 = sqlx::query_scalar("SELECT 42")
        .fetch_one(&mut *next)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(answer, 42);
}
