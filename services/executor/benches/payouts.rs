//! End-to-end payouts/s: the executor moving a batch through the lock server, the payment
//! resource, the rail proxy and the rail stub (latency 0), at 1, 8 and 32 workers, over 100
//! accounts and over a single hot account — printed beside the lock server's own
//! acquire+release cycles/s on the same run. All four services run in this process on real
//! loopback ports against one throwaway PostgreSQL.
//!
//! `cargo bench -p dlock-executor --bench payouts` (optionally `-- --payouts 1200`).

use std::sync::Arc;
use std::time::{Duration, Instant};

use dlock_contract::client::LockClient;
use dlock_contract::config::RawConfig;
use dlock_contract::payment::{CreateAccountRequest, FundRequest};
use dlock_contract::payment_client::PaymentClient;
use dlock_devstack::PgServer;
use dlock_executor::manifest::{BatchItem, BatchSpec, Metadata, PayoutBatch};
use dlock_executor::{Endpoints, RunOptions};

fn raw(pairs: &[(&str, String)]) -> RawConfig {
    RawConfig::from_pairs(pairs).unwrap_or_else(|e| panic!("{e}"))
}

async fn bind() -> (tokio::net::TcpListener, String) {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let addr = l.local_addr().unwrap_or_else(|e| panic!("{e}"));
    (l, addr.to_string())
}

fn serve(l: tokio::net::TcpListener, app: axum::Router) {
    tokio::spawn(async move {
        let _ = dlock_contract::http::serve(l, app, std::future::pending()).await;
    });
}

async fn stack(pg: &PgServer, dir: &std::path::Path) -> Endpoints {
    let (l, lock_addr) = bind().await;
    let config = dlock_lock_server::LockServerConfig::from_raw(&mut raw(&[
        ("server.listen", lock_addr.clone()),
        ("lock.pg.url", pg.url("lockdb")),
        ("lock.pg.pool-max", "32".into()),
    ]))
    .unwrap_or_else(|e| panic!("{e}"));
    let store = dlock_lock_server::open_store(&config)
        .await
        .unwrap_or_else(|e| panic!("{e:#}"));
    serve(
        l,
        dlock_lock_server::app(dlock_lock_server::AppState::new(store, Arc::new(config))),
    );

    let (l, pay_addr) = bind().await;
    let config = dlock_payment_resource::PaymentConfig::from_raw(&mut raw(&[
        ("server.listen", pay_addr.clone()),
        ("payment.pg.url", pg.url("paydb")),
    ]))
    .unwrap_or_else(|e| panic!("{e}"));
    let store = dlock_payment_resource::open_store(&config)
        .await
        .unwrap_or_else(|e| panic!("{e:#}"));
    serve(
        l,
        dlock_payment_resource::app(dlock_payment_resource::AppState::new(
            store,
            Arc::new(config),
        )),
    );

    let (l, stub_addr) = bind().await;
    let config = dlock_rail_stub::RailStubConfig::from_raw(&mut raw(&[
        ("server.listen", stub_addr.clone()),
        (
            "rail.stub.statement-path",
            dir.join("statement.jsonl").display().to_string(),
        ),
    ]))
    .unwrap_or_else(|e| panic!("{e}"));
    let state = dlock_rail_stub::StubState::open(config).unwrap_or_else(|e| panic!("{e:#}"));
    serve(l, dlock_rail_stub::app(state));

    let (l, proxy_addr) = bind().await;
    let config = dlock_rail_proxy::RailProxyConfig::from_raw(&mut raw(&[
        ("server.listen", proxy_addr.clone()),
        ("rail.proxy.pg.url", pg.url("paydb")),
        ("rail.proxy.rail-url", format!("http://{stub_addr}")),
        ("rail.proxy.pg.pool-max", "32".into()),
    ]))
    .unwrap_or_else(|e| panic!("{e}"));
    let pool = dlock_rail_proxy::connect(&config)
        .await
        .unwrap_or_else(|e| panic!("{e:#}"));
    let state =
        dlock_rail_proxy::AppState::new(pool, Arc::new(config)).unwrap_or_else(|e| panic!("{e:#}"));
    serve(l, dlock_rail_proxy::app(state));

    Endpoints {
        lock_server: format!("http://{lock_addr}"),
        payment_resource: format!("http://{pay_addr}"),
        rail_proxy: format!("http://{proxy_addr}"),
    }
}

async fn accounts(payment: &PaymentClient, prefix: &str, n: usize) {
    for i in 0..n {
        let account = format!("{prefix}-{i:03}");
        let body = CreateAccountRequest {
            account_id: account.clone(),
            currency: "EUR".into(),
        };
        payment
            .create_account(&format!("open-{account}"), &body)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        let fund = FundRequest {
            amount_minor: 1_000_000_000,
            reference: format!("seed-{account}"),
        };
        payment
            .fund(&account, &format!("fund-{account}"), &fund)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
    }
}

fn batch(name: &str, prefix: &str, accounts: usize, payouts: usize) -> PayoutBatch {
    PayoutBatch {
        api_version: "dlock.io/v1alpha1".into(),
        kind: "PayoutBatch".into(),
        metadata: Metadata {
            name: name.into(),
            namespace: None,
        },
        spec: BatchSpec {
            workers: 1,
            payouts: (0..payouts)
                .map(|i| BatchItem {
                    key: format!("item-{i:05}"),
                    account_id: format!("{prefix}-{:03}", i % accounts),
                    amount_minor: 100 + i as i64,
                    currency: "EUR".into(),
                    beneficiary_ref: format!("ben-{i}"),
                })
                .collect(),
        },
    }
}

/// The lock server's own acquire+release cycles/s, 16 clients on their own keys, for scale.
async fn lock_cycles(url: &str, run_for: Duration) -> f64 {
    let deadline = Instant::now() + run_for;
    let mut tasks = Vec::new();
    for c in 0..16 {
        let client = LockClient::new(url, &format!("bench-{c}")).unwrap_or_else(|e| panic!("{e}"));
        tasks.push(tokio::spawn(async move {
            let s = client
                .create_session(Some(60_000))
                .await
                .unwrap_or_else(|e| panic!("{e}"));
            let mut n = 0usize;
            while Instant::now() < deadline {
                let key = format!("cycles:{c}");
                let g = client
                    .acquire(&key, s.session_id, None, None)
                    .await
                    .unwrap_or_else(|e| panic!("{e}"));
                client
                    .release(&key, s.session_id, g.fencing_token)
                    .await
                    .unwrap_or_else(|e| panic!("{e}"));
                n += 1;
            }
            n
        }));
    }
    let mut total = 0;
    for t in tasks {
        total += t.await.unwrap_or_else(|e| panic!("{e}"));
    }
    total as f64 / run_for.as_secs_f64()
}

fn main() {
    let payouts: usize = std::env::args()
        .skip_while(|a| a != "--payouts")
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(600);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap_or_else(|e| panic!("{e}"));
    let pg = PgServer::start(None).unwrap_or_else(|e| panic!("{e:#}"));
    pg.create_database("lockdb")
        .unwrap_or_else(|e| panic!("{e:#}"));
    pg.create_database("paydb")
        .unwrap_or_else(|e| panic!("{e:#}"));
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    runtime.block_on(async {
        let endpoints = stack(&pg, dir.path()).await;
        let payment = PaymentClient::new(&endpoints.payment_resource, "bench")
            .unwrap_or_else(|e| panic!("{e}"));
        let cycles = lock_cycles(&endpoints.lock_server, Duration::from_secs(3)).await;
        println!(
            "end-to-end payouts (acquire, re-read, claim, submit, post, release), rail latency 0"
        );
        println!(
            "lock server alone on this run: {cycles:.0} acquire+release cycles/s at 16 clients"
        );
        println!(
            "{:<14} {:>7} {:>8} {:>10} {:>12} {:>16}",
            "accounts", "workers", "payouts", "seconds", "payouts/s", "lock cycles/s"
        );
        for (label, accounts_n, n) in [
            ("100 accounts", 100usize, payouts),
            ("1 hot account", 1usize, payouts / 4),
        ] {
            for workers in [1usize, 8, 32] {
                let prefix = format!("b{}w{workers}", accounts_n);
                accounts(&payment, &prefix, accounts_n).await;
                let batch = batch(&format!("bench-{prefix}"), &prefix, accounts_n, n);
                // Register outside the timed run: it is a one-off per batch, not payout work.
                dlock_executor::register(&batch, &payment)
                    .await
                    .unwrap_or_else(|e| panic!("{e:#}"));
                let options = RunOptions {
                    workers,
                    owner_id: format!("bench-{prefix}"),
                    ..RunOptions::default()
                };
                let started = Instant::now();
                let report = dlock_executor::execute(&batch, &endpoints, options)
                    .await
                    .unwrap_or_else(|e| panic!("{e:#}"));
                let seconds = started.elapsed().as_secs_f64();
                assert!(report.complete, "the batch settled");
                assert_eq!(
                    report.states.get("POSTED").copied(),
                    Some(n),
                    "every payout posted"
                );
                println!(
                    "{:<14} {:>7} {:>8} {:>10.2} {:>12.0} {:>16.0}",
                    label,
                    workers,
                    n,
                    seconds,
                    n as f64 / seconds,
                    cycles
                );
            }
        }
    });
    drop(pg);
}
