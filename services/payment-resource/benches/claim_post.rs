//! Claim+post pairs through the payment resource over HTTP against the same SQL issued directly
//! through sqlx (the store functions the service calls: idempotency record, paydb function,
//! stored answer, commit), at 1 and 16 concurrent clients.
//!
//! Each pair is one payout on its own account, as the executor locks `payout:{accountId}`: claim
//! under a fresh token, the simulated rail moves it to RAIL_ACKED in SQL (not timed: it is the
//! rail proxy's work), post under the same token. A round times all claims, acknowledges them in
//! one statement, then times all posts; pairs/s is pairs over the timed phases.
//!
//! `cargo bench -p dlock-payment-resource --bench claim_post` (optionally `-- --seconds 5`).
//! PostgreSQL runs with production's durability (fsync on) unless `DLOCK_BENCH_PG=fast`; the raw
//! commit rate of the same server at 1 and 32 updates per commit is printed first.

use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::{Duration, Instant};

use dlock_contract::payment::PayoutState;
use dlock_contract::payment_client::{Fence, PaymentClient};
use dlock_devstack::bench::{Baseline, Run, Via, postgres_bench, runtime, seconds_arg, timed};
use dlock_payment_resource::store::{Begin, ClaimOutcome, PayStore, PostOutcome, Scope, Tx};
use dlock_payment_resource::{AppState, PaymentConfig, app, open_store};
use dlock_server::config::RawConfig;
use uuid::Uuid;

/// Payouts per client per round.
const BATCH: usize = 40;

fn config(env: &[(&str, String)]) -> PaymentConfig {
    // Measured without fencing-token proofs, said by name (docs/threat-model.md#safe-defaults).
    let mut env = env.to_vec();
    env.push(("fencing.insecure-no-proofs", "true".to_owned()));
    let mut raw = RawConfig::from_pairs(&env).unwrap_or_else(|e| panic!("{e}"));
    PaymentConfig::from_raw(&mut raw).unwrap_or_else(|e| panic!("{e}"))
}

/// Accounts, funding and payouts for one round, in three statements (not timed).
async fn prepare(store: &PayStore, count: usize) -> Vec<Uuid> {
    let ids: Vec<String> = (0..count)
        .map(|_| format!("b-{}", Uuid::new_v4().simple()))
        .collect();
    let payouts: Vec<Uuid> = (0..count).map(|_| Uuid::new_v4()).collect();
    for sql in [
        "SELECT count(*) FROM unnest($1::text[]) id, LATERAL pay_create_account(id, 'EUR')",
        "SELECT count(*) FROM unnest($1::text[]) id, LATERAL pay_fund(id, 1000000, id)",
        "SELECT count(*) FROM unnest($1::text[], $2::uuid[]) t(id, pid), \
         LATERAL pay_create_payout(pid, id, 100, 'EUR', 'ben')",
    ] {
        sqlx::query(sql)
            .bind(&ids)
            .bind(&payouts)
            .execute(store.pool())
            .await
            .unwrap_or_else(|e| panic!("{e}"));
    }
    payouts
}

async fn rail_ack(store: &PayStore, payouts: &[Uuid]) {
    for sql in [
        "UPDATE payouts SET state = 'SUBMITTING', submission_id = payout_id \
         WHERE payout_id = ANY($1) AND state = 'CLAIMED'",
        "UPDATE payouts SET state = 'RAIL_ACKED', rail_reference = 'rail-' || payout_id \
         WHERE payout_id = ANY($1) AND state = 'SUBMITTING'",
    ] {
        sqlx::query(sql)
            .bind(payouts)
            .execute(store.pool())
            .await
            .unwrap_or_else(|e| panic!("{e}"));
    }
}

fn scope(route: String, key: &str, token: i64, body: &[u8]) -> Scope {
    use sha2::Digest;
    let mut hasher = sha2::Sha256::new();
    hasher.update(route.as_bytes());
    hasher.update(body);
    Scope {
        route,
        key: key.to_owned(),
        token,
        owner_id: "bench".to_owned(),
        payload_hash: hasher.finalize().into(),
        retention_ms: 3_600_000,
    }
}

/// A fresh idempotency record for `verb` on `payout` (the scope of a write that the service would
/// open), and its transaction.
async fn begin(store: &PayStore, payout: Uuid, token: i64, verb: &str, body: &[u8]) -> (Scope, Tx) {
    let route = format!("POST /v1/payouts/{payout}/{verb}");
    let scope = scope(route, &format!("payout-{payout}"), token, body);
    match store.begin(&scope, 2_000).await {
        Ok(Begin::Fresh(tx)) => (scope, tx),
        Ok(_) => panic!("a fresh key was not fresh"),
        Err(e) => panic!("{e}"),
    }
}

/// One write through the store, as the service does it: record, function, answer, commit.
async fn raw_claim(store: &PayStore, payout: Uuid, token: i64) {
    let (scope, mut tx) = begin(store, payout, token, "claim", b"PENDING").await;
    let row = PayStore::claim(&mut tx, payout, token, PayoutState::Pending, 20, "bench")
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(matches!(row, ClaimOutcome::Claimed { .. }), "{row:?}");
    let body = serde_json::to_vec(&serde_json::json!({ "payoutId": payout, "claimToken": token }))
        .unwrap_or_default();
    finish(store, tx, &scope, &body).await;
}

async fn raw_post(store: &PayStore, payout: Uuid, token: i64) {
    let (scope, mut tx) = begin(store, payout, token, "post", b"ACKED").await;
    let row = PayStore::post(&mut tx, payout, token, &format!("rail-{payout}"), payout)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(matches!(row, PostOutcome::Posted { .. }), "{row:?}");
    let entries = PayStore::entries(&mut tx, &format!("payout:{payout}"), true)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let body = serde_json::to_vec(&entries).unwrap_or_default();
    finish(store, tx, &scope, &body).await;
}

async fn finish(store: &PayStore, tx: Tx, scope: &Scope, body: &[u8]) {
    store
        .finish(tx, scope, 200, body)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
}

async fn phase(
    store: &PayStore,
    client: &Option<PaymentClient>,
    batch: &[(Uuid, i64)],
    post: bool,
) -> Vec<Duration> {
    let mut latencies = Vec::with_capacity(batch.len());
    for &(payout, token) in batch {
        let key = format!("payout-{payout}");
        let fence = Fence::new(&key, token, None);
        let write = async {
            match (client, post) {
                (Some(c), false) => {
                    c.claim(payout, fence, PayoutState::Pending)
                        .await
                        .unwrap_or_else(|e| panic!("claim: {e}"));
                }
                (Some(c), true) => {
                    c.post(payout, fence, &format!("rail-{payout}"), payout)
                        .await
                        .unwrap_or_else(|e| panic!("post: {e}"));
                }
                (None, false) => raw_claim(store, payout, token).await,
                (None, true) => raw_post(store, payout, token).await,
            }
        };
        timed(&mut latencies, write).await;
    }
    latencies
}

async fn pairs(
    store: PayStore,
    url: &str,
    path: Via,
    clients: usize,
    run_for: Duration,
    tokens: Arc<AtomicI64>,
) -> Run {
    let http: Vec<Option<PaymentClient>> = (0..clients)
        .map(|c| {
            (path == Via::Service).then(|| {
                PaymentClient::new(url, &format!("bench-{c}")).unwrap_or_else(|e| panic!("{e}"))
            })
        })
        .collect();
    let mut run = Run::default();
    while run.elapsed < run_for {
        let payouts = prepare(&store, clients * BATCH).await;
        let batches: Vec<Vec<(Uuid, i64)>> = payouts
            .chunks(BATCH)
            .map(|chunk| {
                chunk
                    .iter()
                    .map(|p| (*p, tokens.fetch_add(1, Ordering::SeqCst) + 1))
                    .collect()
            })
            .collect();
        let mut per_pair = vec![Duration::ZERO; payouts.len()];
        for post in [false, true] {
            if post {
                rail_ack(&store, &payouts).await;
            }
            let started = Instant::now();
            let tasks: Vec<_> = batches
                .iter()
                .zip(&http)
                .map(|(batch, client)| {
                    let (store, client, batch) = (store.clone(), client.clone(), batch.clone());
                    tokio::spawn(async move { phase(&store, &client, &batch, post).await })
                })
                .collect();
            for (c, task) in tasks.into_iter().enumerate() {
                let latencies = task.await.unwrap_or_else(|e| panic!("{e}"));
                for (i, l) in latencies.into_iter().enumerate() {
                    per_pair[c * BATCH + i] += l;
                }
            }
            run.elapsed += started.elapsed();
        }
        run.count += payouts.len();
        run.latencies.extend(per_pair);
    }
    run
}

fn main() {
    let seconds = seconds_arg(4);
    let run_for = Duration::from_secs(seconds);
    let runtime = runtime();
    let pg = postgres_bench("paydb");
    println!("{}", Baseline::measure(&pg, "paydb", 16, 32).describe(&pg));
    println!(
        "claim+post pairs, {seconds} s of timed phases per row, one account per payout, rail ack in SQL (untimed)"
    );
    println!(
        "{:>7} {:>15} {:>9} {:>9} {:>15} {:>9} {:>9} {:>15}",
        "clients",
        "service pairs/s",
        "p50 ms",
        "p99 ms",
        "raw pairs/s",
        "p50 ms",
        "p99 ms",
        "service/raw"
    );
    runtime.block_on(async {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        let addr = listener.local_addr().unwrap_or_else(|e| panic!("{e}"));
        let config = config(&[
            ("server.listen", addr.to_string()),
            ("payment.pg.url", pg.url("paydb")),
            ("payment.pg.pool-max", "32".to_owned()),
        ]);
        let store = open_store(&config)
            .await
            .unwrap_or_else(|e| panic!("{e:#}"));
        let state = AppState::new(store.clone(), Arc::new(config));
        let server = tokio::spawn(async move {
            let _ = dlock_server::http::serve(listener, app(state), std::future::pending()).await;
        });
        let url = format!("http://{addr}");
        let tokens = Arc::new(AtomicI64::new(1));
        let run = |path, clients, run_for| {
            pairs(store.clone(), &url, path, clients, run_for, tokens.clone())
        };
        // Warm up connections, caches and the plan cache.
        for path in [Via::Service, Via::Raw] {
            run(path, 4, Duration::from_millis(300)).await;
        }
        for clients in [1usize, 16] {
            let service = run(Via::Service, clients, run_for).await.summary();
            let raw = run(Via::Raw, clients, run_for).await.summary();
            println!(
                "{:>7} {:>15.0} {:>9.2} {:>9.2} {:>15.0} {:>9.2} {:>9.2} {:>15.2}",
                clients,
                service.0,
                service.1,
                service.2,
                raw.0,
                raw.1,
                raw.2,
                service.0 / raw.0,
            );
        }
        server.abort();
    });
    drop(pg);
}
