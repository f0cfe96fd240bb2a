//! One client's calls through a lock server in this process, for a profiler to watch
//! (docs/benchmarks.md#tracing-one-client): a durable PostgreSQL and the server start, the process
//! prints `pid N ready` on stderr, loops for the given seconds and prints its rate.
//!
//! `cargo run --release -p dlock-lock-server --example one_client -- [BATCH] [SECONDS] [CALL]`
//!
//! - `BATCH`: `lock.pg.batch.max`, 32 (group commit, the default) or 1 (one transaction a
//!   request); 32 when left out.
//! - `SECONDS`: how long the loop runs, 10 when left out.
//! - `CALL`: `cycle` (an acquire and its release, the default), `refused` (an acquire the server
//!   refuses on validation: a POST with its JSON both ways, no backend), `read` (a lock's state,
//!   one pooled read) or `healthz` (a GET that touches no backend).

use std::sync::Arc;
use std::time::{Duration, Instant};

use dlock_contract::client::LockClient;
use dlock_lock_server::{AppState, LockServerConfig, app, open_store};
use dlock_server::config::RawConfig;

/// The allocator `dlock` runs the services with, as in the lock bench.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let batch = args.first().cloned().unwrap_or_else(|| "32".to_owned());
    let seconds: u64 = args.get(1).map_or(10, |s| {
        s.parse()
            .unwrap_or_else(|_| panic!("SECONDS: a whole number, got {s:?}"))
    });
    let call = args.get(2).cloned().unwrap_or_else(|| "cycle".to_owned());
    if !["cycle", "refused", "read", "healthz"].contains(&call.as_str()) {
        panic!("CALL: cycle, refused, read or healthz, got {call:?}");
    }
    let pg = dlock_devstack::bench::postgres_bench("lockdb");
    let runtime = dlock_devstack::bench::runtime();
    runtime.block_on(async {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        let addr = listener.local_addr().unwrap_or_else(|e| panic!("{e}"));
        let env = vec![
            ("lock.backend", "pg".to_owned()),
            ("lock.pg.url", pg.url("lockdb")),
            ("lock.pg.pool-max", "32".to_owned()),
            ("lock.pg.batch.max", batch.clone()),
            ("server.listen", addr.to_string()),
            // Measured without fencing-token proofs, as the lock bench is.
            ("fencing.insecure-no-proofs", "true".to_owned()),
        ];
        let mut raw = RawConfig::from_pairs(&env).unwrap_or_else(|e| panic!("{e}"));
        let config = LockServerConfig::from_raw(&mut raw).unwrap_or_else(|e| panic!("{e}"));
        let store = open_store(&config)
            .await
            .unwrap_or_else(|e| panic!("{e:#}"));
        let served = app(AppState::new(store, Arc::new(config)));
        tokio::spawn(async move {
            let _ = dlock_server::http::serve(listener, served, std::future::pending()).await;
        });
        let base = format!("http://{addr}");
        let client = LockClient::new(&base, "one-client").unwrap_or_else(|e| panic!("{e}"));
        let http = dlock_contract::client::http_client().unwrap_or_else(|e| panic!("{e}"));
        let session = client
            .create_session(Some(60_000))
            .await
            .unwrap_or_else(|e| panic!("{e}"))
            .session_id;
        if call == "read" {
            // Held for the run: the state read is of a lock that exists.
            client
                .acquire("one", session, Some(60_000), None)
                .await
                .unwrap_or_else(|e| panic!("{e}"));
        }
        eprintln!("pid {} ready", std::process::id());
        // On a worker of the runtime, as the bench's clients are (not on block_on's thread).
        let looped = tokio::spawn(async move {
            let started = Instant::now();
            let mut calls = 0u64;
            while started.elapsed() < Duration::from_secs(seconds) {
                match call.as_str() {
                    "refused" => {
                        let refused = client.acquire("", session, Some(10_000), None).await;
                        assert!(refused.is_err(), "an empty key is refused");
                    }
                    "read" => {
                        client.get("one").await.unwrap_or_else(|e| panic!("{e}"));
                    }
                    "healthz" => {
                        http.get(format!("{base}/healthz"))
                            .send()
                            .await
                            .and_then(reqwest::Response::error_for_status)
                            .unwrap_or_else(|e| panic!("{e}"));
                    }
                    _ => {
                        let grant = client
                            .acquire("one", session, Some(10_000), None)
                            .await
                            .unwrap_or_else(|e| panic!("{e}"));
                        client
                            .release("one", session, grant.fencing_token)
                            .await
                            .unwrap_or_else(|e| panic!("{e}"));
                    }
                }
                calls += 1;
            }
            let rate = calls as f64 / started.elapsed().as_secs_f64();
            eprintln!("{call}, lock.pg.batch.max {batch}: {rate:.0} a second");
        });
        looped.await.unwrap_or_else(|e| panic!("{e}"));
    });
}
