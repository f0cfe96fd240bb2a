//! Acquire+release cycles through the lock server against the raw backend doing the same work
//! for the same guarantee (the same lockdb functions through sqlx; the same etcd transactions
//! through etcd-client), at 1 and 16 concurrent clients, on pg and etcd.
//!
//! `cargo bench -p dlock-lock-server --bench lock` (optionally `-- --seconds 5`).

use std::sync::Arc;
use std::time::{Duration, Instant};

use dlock_contract::client::LockClient;
use dlock_contract::config::RawConfig;
use dlock_devstack::{EtcdServer, PgServer};
use dlock_lock_server::store::{Acquire, Store};
use dlock_lock_server::{AppState, LockServerConfig, app, open_store};

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
                    dlock_contract::http::serve(listener, app(state), std::future::pending()).await;
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
            server.abort();
        }
    });
    drop(etcd);
    drop(pg);
}
