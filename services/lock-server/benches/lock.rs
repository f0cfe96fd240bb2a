//! Acquire+release cycles through the lock server against the raw backend doing the same work
//! for the same guarantee (the same lockdb functions through sqlx; the same etcd transactions
//! through etcd-client), at 1 and 16 concurrent clients, on pg and etcd.
//!
//! Then what one hop is made of, one client, p50 of many: an HTTP round trip to the server that
//! touches no backend, one pooled `SELECT 1`, the same on a connection of its own (no pool: the
//! difference is the pool's checkout), and the lockdb acquire and release functions both ways,
//! beside the server's acquire and release.
//!
//! `cargo bench -p dlock-lock-server --bench lock` (optionally `-- --seconds 5`).

use std::sync::Arc;
use std::time::{Duration, Instant};

use dlock_contract::client::LockClient;
use dlock_devstack::EtcdServer;
use dlock_devstack::bench::{Run, Via, median_ms, postgres, runtime, seconds_arg, timed};
use dlock_lock_server::store::{Acquire, Attempt, Claim, Store};
use dlock_lock_server::{AppState, LockServerConfig, app, open_store};
use dlock_server::config::RawConfig;
use uuid::Uuid;

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
    let n = 2_000;
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
    let mut release_http = Vec::new();
    let sql_acquire = "SELECT outcome, fencing_token FROM dlock_acquire($1, $2, $3, $4, NULL)";
    let sql_release = "SELECT outcome FROM dlock_release($1, $2, $3)";
    for _ in 0..n / 2 {
        let token = timed(&mut acquire, raw_acquire(store, key, sid, owner)).await;
        timed(&mut release, raw_release(store, key, owner, token)).await;

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
        ("dlock_acquire through the pool", acquire),
        ("dlock_acquire on one connection", acquire_conn),
        ("acquire through the lock server (HTTP)", acquire_http),
        ("dlock_release through the pool", release),
        ("dlock_release on one connection", release_conn),
        ("release through the lock server (HTTP)", release_http),
    ] {
        println!("{what:<52} {:>7.3} ms", median_ms(&v));
    }
}

fn main() {
    let seconds = seconds_arg(4);
    let run_for = Duration::from_secs(seconds);
    let runtime = runtime();
    let pg = postgres("lockdb");
    let etcd = EtcdServer::start(None).unwrap_or_else(|e| panic!("{e:#}"));
    let backends = [
        (
            "pg",
            vec![
                ("lock.backend", "pg".to_owned()),
                ("lock.pg.url", pg.url("lockdb")),
                ("lock.pg.pool-max", "32".to_owned()),
            ],
        ),
        (
            "etcd",
            vec![
                ("lock.backend", "etcd".to_owned()),
                ("lock.etcd.endpoints", etcd.endpoint()),
            ],
        ),
    ];
    println!("acquire+release cycles, {seconds} s per row, each client on its own key");
    println!(
        "{:<7} {:>7} {:>14} {:>10} {:>10} {:>14} {:>10} {:>10} {:>8}",
        "backend",
        "clients",
        "server cyc/s",
        "p50 ms",
        "p99 ms",
        "raw cyc/s",
        "p50 ms",
        "p99 ms",
        "ratio"
    );
    runtime.block_on(async {
        for (name, env) in backends {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
                .await
                .unwrap_or_else(|e| panic!("{e}"));
            let addr = listener.local_addr().unwrap_or_else(|e| panic!("{e}"));
            let mut env = env;
            env.push(("server.listen", addr.to_string()));
            let config = config(&env);
            let store = open_store(&config)
                .await
                .unwrap_or_else(|e| panic!("{e:#}"));
            let state = AppState::new(store.clone(), Arc::new(config));
            let server = tokio::spawn(async move {
                let _ =
                    dlock_server::http::serve(listener, app(state), std::future::pending()).await;
            });
            let url = format!("http://{addr}");
            // Warm up connections and caches.
            cycles(
                store.clone(),
                Some(url.clone()),
                4,
                Duration::from_millis(300),
            )
            .await;
            for clients in [1usize, 16] {
                let mut rows = Vec::new();
                for path in [Via::Service, Via::Raw] {
                    let target = (path == Via::Service).then(|| url.clone());
                    rows.push(cycles(store.clone(), target, clients, run_for).await);
                }
                let (server, raw) = (rows[0].summary(), rows[1].summary());
                println!(
                    "{:<7} {:>7} {:>14.0} {:>10.2} {:>10.2} {:>14.0} {:>10.2} {:>10.2} {:>8.2}",
                    name,
                    clients,
                    server.0,
                    server.1,
                    server.2,
                    raw.0,
                    raw.1,
                    raw.2,
                    server.0 / raw.0,
                );
            }
            if name == "pg" {
                println!("one hop on pg, one client, p50:");
                breakdown(&store, &pg.url("lockdb"), &url).await;
            }
            server.abort();
        }
    });
    drop(etcd);
    drop(pg);
}
