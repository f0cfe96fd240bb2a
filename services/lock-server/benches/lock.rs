//! Acquire+release cycles through the lock server against the raw backend doing the same work
//! for the same guarantee (the same lockdb functions through sqlx, one request per transaction;
//! the same etcd transactions through etcd-client), on pg at 1, 16 and 64 concurrent clients
//! with `lock.pg.batch.max` 1 (one transaction per request) and 32 (group commit,
//! docs/design.md#group-commit), each beside the raw figure of the same run (the three paths in
//! two spells each, in the order raw, 1, 32, 32, 1, raw), and on etcd at 1 and 16. On pg it then
//! prints each path's capacity, its best cycles/s over the three client counts, beside raw's
//! best. PostgreSQL runs durable (`fsync=on`) unless `DLOCK_BENCH_PG=fast`.
//!
//! Then what one hop is made of, one client, p50 of many: an HTTP round trip to the server that
//! touches no backend, an acquire the server refuses before the backend (a POST with its JSON
//! both ways), a read of a lock's state through the server, one pooled `SELECT 1`, the same on a connection of its own (no pool: the
//! difference is the pool's checkout), and the lockdb acquire and release functions three ways
//! (a ping and the call on the pool's next connection, the same through the store's warm
//! connections of services/server/src/warm.rs, the call alone on one connection), beside the
//! server's acquire and release; and what lockdb's store-epoch check (the timeline
//! check of migrations/lockdb/0016_baseline.sql, a trigger on every grant) costs per acquire:
//! `dlock_acquire` + `dlock_release` in a server-side loop with the trigger and without it.
//!
//! `cargo bench -p dlock-lock-server --bench lock` (optionally `-- --seconds 5`).
//!
//! `-- --trace CALL [--batch N] [--seconds N]` runs instead one client's calls through the
//! server for a profiler to watch (docs/benchmarks.md#tracing-one-client): `cycle` (an acquire
//! and its release), `refused` (an acquire refused on validation), `read` (a held lock's state)
//! or `healthz`, with `lock.pg.batch.max` N (32 by default), for 10 s unless told. It prints
//! `pid N ready` once the server is up and its rate at the end.

use std::sync::Arc;
use std::time::{Duration, Instant};

use dlock_contract::client::LockClient;
use dlock_devstack::EtcdServer;
use dlock_devstack::bench::{Run, median_ms, postgres_bench, runtime, seconds_arg, timed};
use dlock_lock_server::store::{Acquire, Attempt, Claim, Store};
use dlock_lock_server::{AppState, LockServerConfig, app, open_store};
use dlock_server::config::RawConfig;
use uuid::Uuid;

/// The allocator `dlock` runs the services with (dlock/src/main.rs): the server measured here is
/// the one production runs.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn config(env: &[(&str, String)]) -> LockServerConfig {
    // Measured without fencing-token proofs, said by name (docs/threat-model.md#safe-defaults).
    let mut env = env.to_vec();
    env.push(("fencing.insecure-no-proofs", "true".to_owned()));
    let mut raw = RawConfig::from_pairs(&env).unwrap_or_else(|e| panic!("{e}"));
    LockServerConfig::from_raw(&mut raw).unwrap_or_else(|e| panic!("{e}"))
}

/// A grant of `key` to `owner` straight from the store; its fencing token.
async fn raw_acquire(store: &Store, key: &str, session_id: Uuid, owner: &str) -> i64 {
    let attempt = Attempt {
        claim: Claim {
            key,
            session_id,
            owner_id: owner,
        },
        ttl_ms: 10_000,
        ticket: None,
    };
    match store.try_acquire(&attempt).await {
        Ok(Acquire::Granted(g)) => g.fencing_token,
        Ok(Acquire::Contended(_)) => panic!("{key} is held by nobody else"),
        Err(e) => panic!("{e}"),
    }
}

async fn raw_release(store: &Store, key: &str, owner: &str, token: i64) {
    store
        .release(key, owner, token)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
}

async fn http_acquire(client: &LockClient, key: &str, session_id: Uuid) -> i64 {
    client
        .acquire(key, session_id, Some(10_000), None)
        .await
        .map(|grant| grant.fencing_token)
        .unwrap_or_else(|e| panic!("{e}"))
}

async fn http_release(client: &LockClient, key: &str, session_id: Uuid, token: i64) {
    client
        .release(key, session_id, token)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
}

async fn cycles(store: Store, url: Option<String>, clients: usize, run_for: Duration) -> Run {
    let deadline = Instant::now() + run_for;
    let started = Instant::now();
    let mut tasks = Vec::new();
    for c in 0..clients {
        let store = store.clone();
        let url = url.clone();
        tasks.push(tokio::spawn(async move {
            let owner = format!("bench-{c}");
            let key = format!("bench:{c}");
            let mut latencies = Vec::new();
            match url {
                Some(url) => {
                    let client = LockClient::new(&url, &owner).unwrap_or_else(|e| panic!("{e}"));
                    let session = client
                        .create_session(Some(60_000))
                        .await
                        .unwrap_or_else(|e| panic!("{e}"));
                    let sid = session.session_id;
                    while Instant::now() < deadline {
                        timed(&mut latencies, async {
                            let token = http_acquire(&client, &key, sid).await;
                            http_release(&client, &key, sid, token).await;
                        })
                        .await;
                    }
                }
                None => {
                    let session = store
                        .create_session(&owner, 60_000)
                        .await
                        .unwrap_or_else(|e| panic!("{e}"));
                    let sid = session.session_id;
                    while Instant::now() < deadline {
                        timed(&mut latencies, async {
                            let token = raw_acquire(&store, &key, sid, &owner).await;
                            raw_release(&store, &key, &owner, token).await;
                        })
                        .await;
                    }
                }
            }
            latencies
        }));
    }
    let mut latencies = Vec::new();
    for task in tasks {
        latencies.extend(task.await.unwrap_or_else(|e| panic!("{e}")));
    }
    Run {
        count: latencies.len(),
        elapsed: started.elapsed(),
        latencies,
    }
}

/// p50 of `n` sequential runs of `step`, in milliseconds.
async fn p50<F, Fut>(n: usize, mut step: F) -> f64
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let mut times = Vec::with_capacity(n);
    for _ in 0..n {
        timed(&mut times, step()).await;
    }
    median_ms(&times)
}

/// `query`'s row on the pool's next connection, pinged first, as the store's writes ran before
/// services/server/src/warm.rs.
async fn on_pool_next<'q, O>(
    pool: &sqlx::PgPool,
    query: sqlx::query::QueryAs<'q, sqlx::Postgres, O, sqlx::postgres::PgArguments>,
) -> O
where
    O: Send + Unpin + for<'r> sqlx::FromRow<'r, sqlx::postgres::PgRow>,
{
    use sqlx::Connection;
    let mut pooled = pool.acquire().await.unwrap_or_else(|e| panic!("{e}"));
    pooled.ping().await.unwrap_or_else(|e| panic!("{e}"));
    query
        .fetch_one(&mut *pooled)
        .await
        .unwrap_or_else(|e| panic!("{e}"))
}

/// What one hop on `pg` is made of, one client at a time.
async fn breakdown(store: &Store, pg_url: &str, url: &str) {
    use sqlx::Connection;
    let Store::Pg(pg) = store else { return };
    let pool = pg.pool().clone();
    let mut conn = sqlx::PgConnection::connect(pg_url)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let http = dlock_contract::client::http_client().unwrap_or_else(|e| panic!("{e}"));
    let client = LockClient::new(url, "bench-hop").unwrap_or_else(|e| panic!("{e}"));
    let session = client
        .create_session(Some(60_000))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let sid = session.session_id;
    let n = 1_000;
    let healthz = format!("{url}/healthz");
    let rows = [
        (
            "HTTP round trip, no backend (GET /healthz)",
            p50(n, || {
                let request = http.get(&healthz);
                async move {
                    let response = request.send().await.unwrap_or_else(|e| panic!("{e}"));
                    let _ = response.bytes().await;
                }
            })
            .await,
        ),
        (
            "an acquire refused by validation (HTTP, no backend)",
            p50(n, || {
                let client = &client;
                async move {
                    let refused = client.acquire("bench:hop", sid, Some(-5), None).await;
                    assert!(refused.is_err(), "a ttlMillis of -5 was accepted");
                }
            })
            .await,
        ),
        (
            "a lock's state through the server (one pooled read)",
            p50(n, || {
                let client = &client;
                async move {
                    client
                        .get("bench:0")
                        .await
                        .unwrap_or_else(|e| panic!("{e}"));
                }
            })
            .await,
        ),
        (
            "SELECT 1 through the pool",
            p50(n, || async {
                let _: (i32,) = sqlx::query_as("SELECT 1")
                    .fetch_one(&pool)
                    .await
                    .unwrap_or_else(|e| panic!("{e}"));
            })
            .await,
        ),
    ];
    for (what, ms) in rows {
        println!("{what:<52} {ms:>7.3} ms");
    }
    let mut one = Vec::with_capacity(n);
    for _ in 0..n {
        let select = sqlx::query_as("SELECT 1").fetch_one(&mut conn);
        let _: (i32,) = timed(&mut one, select)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
    }
    let one = median_ms(&one);
    println!("{:<52} {one:>7.3} ms", "SELECT 1 on one connection");
    // The lockdb functions, alternating acquire and release, measured apart.
    let key = "bench:hop";
    let owner = "bench-hop";
    let mut acquire = Vec::new();
    let mut release = Vec::new();
    let mut acquire_conn = Vec::new();
    let mut release_conn = Vec::new();
    let mut acquire_http = Vec::new();
    let mut acquire_pool = Vec::new();
    let mut release_pool = Vec::new();
    let mut release_http = Vec::new();
    let sql_acquire = "SELECT outcome, fencing_token FROM dlock_acquire($1, $2, $3, $4, NULL)";
    let sql_release = "SELECT outcome FROM dlock_release($1, $2, $3)";
    for _ in 0..n / 2 {
        let token = timed(&mut acquire, raw_acquire(store, key, sid, owner)).await;
        timed(&mut release, raw_release(store, key, owner, token)).await;

        // The same calls as the store makes, on a connection straight from the pool each time.
        let acquire_sql = sqlx::query_as(sql_acquire)
            .bind(key)
            .bind(sid)
            .bind(owner)
            .bind(10_000i32);
        let (outcome, token): (String, i64) =
            timed(&mut acquire_pool, on_pool_next(&pool, acquire_sql)).await;
        assert_eq!(outcome, "granted");
        let release_sql = sqlx::query_as(sql_release)
            .bind(key)
            .bind(token)
            .bind(owner);
        let (outcome,): (String,) =
            timed(&mut release_pool, on_pool_next(&pool, release_sql)).await;
        assert_eq!(outcome, "released");

        let (outcome, token): (String, i64) = timed(
            &mut acquire_conn,
            sqlx::query_as(sql_acquire)
                .bind(key)
                .bind(sid)
                .bind(owner)
                .bind(10_000i32)
                .fetch_one(&mut conn),
        )
        .await
        .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(outcome, "granted");
        let (outcome,): (String,) = timed(
            &mut release_conn,
            sqlx::query_as(sql_release)
                .bind(key)
                .bind(token)
                .bind(owner)
                .fetch_one(&mut conn),
        )
        .await
        .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(outcome, "released");

        let token = timed(&mut acquire_http, http_acquire(&client, key, sid)).await;
        timed(&mut release_http, http_release(&client, key, sid, token)).await;
    }
    for (what, v) in [
        (
            "dlock_acquire, pool's next connection, ping first",
            acquire_pool,
        ),
        ("dlock_acquire, the store's (warm, ping first)", acquire),
        ("dlock_acquire on one connection", acquire_conn),
        ("acquire through the lock server (HTTP)", acquire_http),
        (
            "dlock_release, pool's next connection, ping first",
            release_pool,
        ),
        ("dlock_release, the store's (warm, ping first)", release),
        ("dlock_release on one connection", release_conn),
        ("release through the lock server (HTTP)", release_http),
    ] {
        println!("{what:<52} {:>7.3} ms", median_ms(&v));
    }
}

/// The store-epoch check's cost per acquire: `dlock_acquire` + `dlock_release` of a key, `n`
/// times in one server-side loop (one transaction, so no commit is timed), with the epoch trigger
/// on `locks` enabled and disabled, alternating; and `dlock_epoch_advance()` alone.
async fn epoch_cost(pg_url: &str, session_id: Uuid) {
    use sqlx::Connection;
    let mut conn = sqlx::PgConnection::connect(pg_url)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let run = |sql: &'static str| sqlx::query(sql);
    // Each iteration on a key of its own: a grant deleted in the same transaction stays a dead
    // row until it ends, and one key's chain of dead rows would grow with every iteration.
    run(
        "CREATE OR REPLACE FUNCTION bench_acquire_release(p_session uuid, p_n integer)
         RETURNS double precision LANGUAGE plpgsql AS $$
         DECLARE
             v_start timestamptz := clock_timestamp();
             v_tag   text := md5(random()::text);
             v_key   text;
             v_row   dlock_result;
         BEGIN
             FOR i IN 1..p_n LOOP
                 v_key := 'bench:epoch:' || v_tag || ':' || i;
                 v_row := dlock_acquire(v_key, p_session, 'bench-hop', 10000, NULL);
                 IF v_row.outcome <> 'granted' THEN
                     RAISE EXCEPTION '% was not granted: %', v_key, v_row.outcome;
                 END IF;
                 PERFORM dlock_release(v_key, v_row.fencing_token, 'bench-hop');
             END LOOP;
             RETURN extract(epoch FROM clock_timestamp() - v_start) * 1e6 / p_n;
         END $$",
    )
    .execute(&mut conn)
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    run("CREATE OR REPLACE FUNCTION bench_epoch_advance(p_n integer)
         RETURNS double precision LANGUAGE plpgsql AS $$
         DECLARE v_start timestamptz := clock_timestamp();
         BEGIN
             FOR i IN 1..p_n LOOP PERFORM dlock_epoch_advance(); END LOOP;
             RETURN extract(epoch FROM clock_timestamp() - v_start) * 1e6 / p_n;
         END $$")
    .execute(&mut conn)
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    let (rounds, n) = (8, 2_000);
    // Warm: plans cached, the key's rows and pages in memory.
    loop_us(&mut conn, session_id, n).await;
    let (mut with, mut without) = (Vec::new(), Vec::new());
    for round in 0..rounds {
        // Which goes first alternates, so a drift of the machine weighs on both alike.
        for enabled in [round % 2 == 0, round % 2 != 0] {
            let sql = if enabled {
                "ALTER TABLE locks ENABLE TRIGGER locks_epoch_guard"
            } else {
                "ALTER TABLE locks DISABLE TRIGGER locks_epoch_guard"
            };
            run(sql)
                .execute(&mut conn)
                .await
                .unwrap_or_else(|e| panic!("{e}"));
            let us = loop_us(&mut conn, session_id, n).await;
            if enabled {
                with.push(us)
            } else {
                without.push(us)
            }
        }
    }
    run("ALTER TABLE locks ENABLE TRIGGER locks_epoch_guard")
        .execute(&mut conn)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let (advance,): (f64,) = sqlx::query_as("SELECT bench_epoch_advance(20000)")
        .fetch_one(&mut conn)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let (with, without) = (median(&mut with), median(&mut without));
    println!(
        "store-epoch check, {rounds} alternating rounds of {n} acquire+release in one server-side loop (median):"
    );
    println!(
        "{:<52} {with:>7.1} µs",
        "dlock_acquire + dlock_release, epoch trigger on"
    );
    println!(
        "{:<52} {without:>7.1} µs",
        "the same, epoch trigger disabled"
    );
    println!(
        "{:<52} {:>7.1} µs ({:.1} % of the pair)",
        "the epoch check per acquire (the difference)",
        with - without,
        (with - without) / with * 100.0
    );
    println!(
        "{:<52} {advance:>7.1} µs",
        "dlock_epoch_advance() alone, per call"
    );
}

/// Microseconds per acquire+release of `bench_acquire_release` over `n` iterations.
async fn loop_us(conn: &mut sqlx::PgConnection, session_id: Uuid, n: i32) -> f64 {
    let (us,): (f64,) = sqlx::query_as("SELECT bench_acquire_release($1, $2)")
        .bind(session_id)
        .bind(n)
        .fetch_one(conn)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    us
}

/// One lock server in this process on `env` (the store, its URL, its state, the server task).
async fn serve(env: &[(&str, String)]) -> (Store, String, AppState, tokio::task::JoinHandle<()>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let addr = listener.local_addr().unwrap_or_else(|e| panic!("{e}"));
    let mut env = env.to_vec();
    env.push(("server.listen", addr.to_string()));
    let config = config(&env);
    let store = open_store(&config)
        .await
        .unwrap_or_else(|e| panic!("{e:#}"));
    let state = AppState::new(store.clone(), Arc::new(config));
    let served = app(state.clone());
    let server = tokio::spawn(async move {
        let _ = dlock_server::http::serve(listener, served, std::future::pending()).await;
    });
    (store, format!("http://{addr}"), state, server)
}

/// (batches, acquires) of the group commit so far: the acquire batch histogram's count and sum.
fn acquire_batches(state: &AppState) -> (f64, f64) {
    let text = state.metrics.encode();
    let sample = |name: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.trim().parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    (
        sample("lock_batch_size_count{kind=\"acquire\"}"),
        sample("lock_batch_size_sum{kind=\"acquire\"}"),
    )
}

fn row(backend: &str, clients: usize, path: &str, run: &Run, raw: f64, batch: Option<f64>) {
    let (per_second, p50, p99) = run.summary();
    let batch = batch.map_or("-".to_owned(), |b| format!("{b:.2}"));
    println!(
        "{backend:<7} {clients:>7} {path:<10} {per_second:>10.0} {p50:>8.2} {p99:>8.2} {:>8.2} {batch:>10}",
        per_second / raw
    );
}

/// The value after `flag` on the command line.
fn arg(flag: &str) -> Option<String> {
    std::env::args().skip_while(|a| a != flag).nth(1)
}

/// `--trace CALL`: one client's calls through a server on `pg_env`, looped for `run_for`.
async fn trace(call: &str, pg_env: Vec<(&str, String)>, run_for: Duration) {
    let (_, url, _, server) = serve(&pg_env).await;
    let client = LockClient::new(&url, "bench-trace").unwrap_or_else(|e| panic!("{e}"));
    let http = dlock_contract::client::http_client().unwrap_or_else(|e| panic!("{e}"));
    let healthz = format!("{url}/healthz");
    let sid = client
        .create_session(Some(60_000))
        .await
        .unwrap_or_else(|e| panic!("{e}"))
        .session_id;
    let key = "bench:trace";
    if call == "read" {
        // Held for the run: the read is of a lock that exists.
        http_acquire(&client, key, sid).await;
    }
    eprintln!("pid {} ready", std::process::id());
    let call = call.to_owned();
    // On a worker of the runtime, as the bench's clients are (not on block_on's thread).
    let looped = tokio::spawn(async move {
        let started = Instant::now();
        let mut calls = 0u64;
        while started.elapsed() < run_for {
            match call.as_str() {
                "refused" => {
                    let refused = client.acquire(key, sid, Some(-5), None).await;
                    assert!(refused.is_err(), "a ttlMillis of -5 was accepted");
                }
                "read" => {
                    client.get(key).await.unwrap_or_else(|e| panic!("{e}"));
                }
                "healthz" => {
                    let response = http.get(&healthz).send().await;
                    let _ = response.unwrap_or_else(|e| panic!("{e}")).bytes().await;
                }
                _ => {
                    let token = http_acquire(&client, key, sid).await;
                    http_release(&client, key, sid, token).await;
                }
            }
            calls += 1;
        }
        let rate = calls as f64 / started.elapsed().as_secs_f64();
        eprintln!("{call}: {rate:.0} a second");
    });
    looped.await.unwrap_or_else(|e| panic!("{e}"));
    server.abort();
}

fn main() {
    let traced = arg("--trace");
    if let Some(call) = &traced
        && !["cycle", "refused", "read", "healthz"].contains(&call.as_str())
    {
        panic!("--trace: cycle, refused, read or healthz, got {call:?}");
    }
    let seconds = seconds_arg(if traced.is_some() { 10 } else { 4 });
    let run_for = Duration::from_secs(seconds);
    let runtime = runtime();
    let pg = postgres_bench("lockdb");
    let pg_env = |batch: &str| {
        vec![
            ("lock.backend", "pg".to_owned()),
            ("lock.pg.url", pg.url("lockdb")),
            ("lock.pg.pool-max", "32".to_owned()),
            ("lock.pg.batch.max", batch.to_owned()),
        ]
    };
    if let Some(call) = traced {
        let batch = arg("--batch").unwrap_or_else(|| "32".to_owned());
        runtime.block_on(trace(&call, pg_env(&batch), run_for));
        return;
    }
    let etcd = EtcdServer::start(None).unwrap_or_else(|e| panic!("{e:#}"));
    let etcd_env = vec![
        ("lock.backend", "etcd".to_owned()),
        ("lock.etcd.endpoints", etcd.endpoint()),
    ];
    println!(
        "PostgreSQL mode: {} (DLOCK_BENCH_PG=fast|durable)",
        pg.durability.name()
    );
    println!(
        "acquire+release cycles, {seconds} s per row, each client on its own key; ratio: \
         cycles/s over the raw backend's in the same run (raw: the same functions, one request \
         per transaction); mean batch: acquires per lockdb transaction"
    );
    println!(
        "{:<7} {:>7} {:<10} {:>10} {:>8} {:>8} {:>8} {:>10}",
        "backend", "clients", "path", "cyc/s", "p50 ms", "p99 ms", "ratio", "mean batch"
    );
    runtime.block_on(async {
        // pg: the per-row path (batch 1, whose store is also the raw backend) and group commit.
        let (raw_store, url_1, _, server_1) = serve(&pg_env("1")).await;
        let (_, url_32, state_32, server_32) = serve(&pg_env("32")).await;
        // Warm up: every pooled connection has planned the functions it calls (the set-based
        // ones cost 10-80 ms to plan the first time on a connection).
        cycles(raw_store.clone(), None, 64, Duration::from_millis(500)).await;
        for url in [&url_1, &url_32] {
            cycles(
                raw_store.clone(),
                Some(url.clone()),
                64,
                Duration::from_millis(1_000),
            )
            .await;
        }
        // The best cycles/s each path reached over the client counts: what the backend and the
        // server can carry, whatever the load a caller brings.
        let mut best = [0f64; 3];
        for clients in [1usize, 16, 64] {
            // Raw, batch 1, batch 32, then the same backwards: a drift of the machine (or of
            // lockdb's tables as they fill with dead rows) weighs on every path alike.
            let paths = [None, Some(url_1.clone()), Some(url_32.clone())];
            let mut runs: [Run; 3] = Default::default();
            let before = acquire_batches(&state_32);
            for i in [0usize, 1, 2, 2, 1, 0] {
                let run = cycles(raw_store.clone(), paths[i].clone(), clients, run_for / 2).await;
                runs[i].add(run);
            }
            let after = acquire_batches(&state_32);
            let mean = (after.1 - before.1) / (after.0 - before.0).max(1.0);
            for (best, run) in best.iter_mut().zip(&runs) {
                *best = best.max(run.per_second());
            }
            let [raw, one, grouped] = runs;
            let raw_rate = raw.per_second();
            row("pg", clients, "raw", &raw, raw_rate, None);
            row("pg", clients, "batch 1", &one, raw_rate, Some(1.0));
            row("pg", clients, "batch 32", &grouped, raw_rate, Some(mean));
        }
        println!(
            "pg capacity, the best cyc/s over 1, 16 and 64 clients: raw {:.0}, batch 1 {:.0} \
             ({:.2} of raw), batch 32 {:.0} ({:.2} of raw)",
            best[0],
            best[1],
            best[1] / best[0],
            best[2],
            best[2] / best[0]
        );
        println!("one hop on pg, one client, p50:");
        breakdown(&raw_store, &pg.url("lockdb"), &url_1).await;
        let session = raw_store
            .create_session("bench-hop", 60_000)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        epoch_cost(&pg.url("lockdb"), session.session_id).await;
        server_1.abort();
        server_32.abort();

        let (store, url, _, server) = serve(&etcd_env).await;
        cycles(
            store.clone(),
            Some(url.clone()),
            4,
            Duration::from_millis(300),
        )
        .await;
        for clients in [1usize, 16] {
            let raw = cycles(store.clone(), None, clients, run_for).await;
            let served = cycles(store.clone(), Some(url.clone()), clients, run_for).await;
            row("etcd", clients, "raw", &raw, raw.per_second(), None);
            row("etcd", clients, "server", &served, raw.per_second(), None);
        }
        server.abort();
    });
    drop(etcd);
    drop(pg);
}
