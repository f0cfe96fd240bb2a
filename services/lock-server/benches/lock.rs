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
use dlock_devstack::{EtcdServer, PgServer};
use dlock_lock_server::store::{Acquire, Store};
use dlock_lock_server::{AppState, LockServerConfig, app, open_store};
use dlock_server::config::RawConfig;

#[derive(Clone, Copy, PartialEq)]
enum Path {
    Server,
    Raw,
}

struct Run {
    cycles: usize,
    elapsed: Duration,
    latencies: Vec<Duration>,
}

impl Run {
    fn per_second(&self) -> f64 {
        self.cycles as f64 / self.elapsed.as_secs_f64()
    }
    fn percentile(&self, p: f64) -> Duration {
        let mut sorted = self.latencies.clone();
        sorted.sort();
        if sorted.is_empty() {
            return Duration::ZERO;
        }
        let index = ((sorted.len() as f64 - 1.0) * p).round() as usize;
        sorted[index]
    }
}

fn config(env: &[(&str, String)]) -> LockServerConfig {
    let mut raw = RawConfig::from_pairs(env).unwrap_or_else(|e| panic!("{e}"));
    LockServerConfig::from_raw(&mut raw).unwrap_or_else(|e| panic!("{e}"))
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
                    while Instant::now() < deadline {
                        let t = Instant::now();
                        let grant = client
                            .acquire(&key, session.session_id, Some(10_000), None)
                            .await
                            .unwrap_or_else(|e| panic!("{e}"));
                        client
                            .release(&key, session.session_id, grant.fencing_token)
                            .await
                            .unwrap_or_else(|e| panic!("{e}"));
                        latencies.push(t.elapsed());
                    }
                }
                None => {
                    let session = store
                        .create_session(&owner, 60_000)
                        .await
                        .unwrap_or_else(|e| panic!("{e}"));
                    while Instant::now() < deadline {
                        let t = Instant::now();
                        let grant = match store
                            .try_acquire(&key, session.session_id, &owner, 10_000, None)
                            .await
                            .unwrap_or_else(|e| panic!("{e}"))
                        {
                            Acquire::Granted(g) => g,
                            Acquire::Contended(_) => panic!("{key} is held by nobody else"),
                        };
                        store
                            .release(&key, &owner, grant.fencing_token)
                            .await
                            .unwrap_or_else(|e| panic!("{e}"));
                        latencies.push(t.elapsed());
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
        cycles: latencies.len(),
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
        let t = Instant::now();
        step().await;
        times.push(t.elapsed());
    }
    times.sort();
    times[times.len() / 2].as_secs_f64() * 1000.0
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
        let t = Instant::now();
        let _: (i32,) = sqlx::query_as("SELECT 1")
            .fetch_one(&mut conn)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        one.push(t.elapsed());
    }
    one.sort();
    println!(
        "{:<52} {:>7.3} ms",
        "SELECT 1 on one connection",
        one[n / 2].as_secs_f64() * 1000.0
    );
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
        let t = Instant::now();
        let grant = match store
            .try_acquire(key, sid, owner, 10_000, None)
            .await
            .unwrap_or_else(|e| panic!("{e}"))
        {
            Acquire::Granted(g) => g,
            Acquire::Contended(_) => panic!("{key} is held by nobody else"),
        };
        acquire.push(t.elapsed());
        let t = Instant::now();
        store
            .release(key, owner, grant.fencing_token)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        release.push(t.elapsed());

        let t = Instant::now();
        let (outcome, token): (String, i64) = sqlx::query_as(sql_acquire)
            .bind(key)
            .bind(sid)
            .bind(owner)
            .bind(10_000i32)
            .fetch_one(&mut conn)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(outcome, "granted");
        acquire_conn.push(t.elapsed());
        let t = Instant::now();
        let (outcome,): (String,) = sqlx::query_as(sql_release)
            .bind(key)
            .bind(token)
            .bind(owner)
            .fetch_one(&mut conn)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(outcome, "released");
        release_conn.push(t.elapsed());

        let t = Instant::now();
        let grant = client
            .acquire(key, sid, Some(10_000), None)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        acquire_http.push(t.elapsed());
        let t = Instant::now();
        client
            .release(key, sid, grant.fencing_token)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        release_http.push(t.elapsed());
    }
    let median = |mut v: Vec<Duration>| {
        v.sort();
        v[v.len() / 2].as_secs_f64() * 1000.0
    };
    for (what, v) in [
        ("dlock_acquire through the pool", acquire),
        ("dlock_acquire on one connection", acquire_conn),
        ("acquire through the lock server (HTTP)", acquire_http),
        ("dlock_release through the pool", release),
        ("dlock_release on one connection", release_conn),
        ("release through the lock server (HTTP)", release_http),
    ] {
        println!("{what:<52} {:>7.3} ms", median(v));
    }
}

fn main() {
    let seconds = std::env::args()
        .skip_while(|a| a != "--seconds")
        .nth(1)
        .and_then(|s| s.parse::<u64>().ok())
        .unwrap_or(4);
    let run_for = Duration::from_secs(seconds);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap_or_else(|e| panic!("{e}"));
    let pg = PgServer::start(None).unwrap_or_else(|e| panic!("{e:#}"));
    pg.create_database("lockdb")
        .unwrap_or_else(|e| panic!("{e:#}"));
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
                for path in [Path::Server, Path::Raw] {
                    let target = (path == Path::Server).then(|| url.clone());
                    rows.push(cycles(store.clone(), target, clients, run_for).await);
                }
                let (server_run, raw_run) = (&rows[0], &rows[1]);
                let ms = |d: Duration| d.as_secs_f64() * 1000.0;
                println!(
                    "{:<7} {:>7} {:>14.0} {:>10.2} {:>10.2} {:>14.0} {:>10.2} {:>10.2} {:>8.2}",
                    name,
                    clients,
                    server_run.per_second(),
                    ms(server_run.percentile(0.50)),
                    ms(server_run.percentile(0.99)),
                    raw_run.per_second(),
                    ms(raw_run.percentile(0.50)),
                    ms(raw_run.percentile(0.99)),
                    server_run.per_second() / raw_run.per_second(),
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
