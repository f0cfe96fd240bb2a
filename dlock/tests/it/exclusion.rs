//! Mutual exclusion under concurrency, on both backends and across two replicas.
//!
//! Sixteen clients cycle acquire → (renew) → release over four keys, alternating between two
//! lock-server replicas on one backend. Each client records, on this process's monotonic clock,
//! when a grant arrived and when its release was sent. The checker proves that per key no two
//! grant intervals overlap and that tokens strictly increase in grant order.

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use dlock_contract::ErrorCode;
use dlock_contract::session::LockSession;
use tokio::sync::Mutex;

use crate::harness::{Backend, LockStack, client, on_each_backend};

const CLIENTS: usize = 16;
const KEYS: usize = 4;
const CYCLES_PER_CLIENT: usize = 130;

#[derive(Debug, Clone)]
struct Held {
    token: i64,
    client: usize,
    granted: Instant,
    released: Instant,
}

/// Fails with a description of the first violation found.
fn check(history: &BTreeMap<String, Vec<Held>>) -> Result<usize, String> {
    let mut tokens = HashSet::new();
    let mut total = 0;
    for (key, grants) in history {
        let mut grants = grants.clone();
        grants.sort_by_key(|h| h.granted);
        for pair in grants.windows(2) {
            let (a, b) = (&pair[0], &pair[1]);
            if b.granted < a.released {
                return Err(format!(
                    "{key}: client {} was granted token {} while client {} still held token {}",
                    b.client, b.token, a.client, a.token
                ));
            }
            if b.token <= a.token {
                return Err(format!(
                    "{key}: token {} was granted after token {}",
                    b.token, a.token
                ));
            }
        }
        for g in &grants {
            if !tokens.insert(g.token) {
                return Err(format!("token {} was issued twice", g.token));
            }
        }
        total += grants.len();
    }
    Ok(total)
}

#[test]
fn the_checker_catches_overlap_and_reordered_tokens() {
    let t0 = Instant::now();
    // Two grants of one key: (token, granted ms, released ms) for client 0, then client 1.
    let history = |a: (i64, u64, u64), b: (i64, u64, u64)| {
        let held = |client, (token, granted, released): (i64, u64, u64)| Held {
            token,
            client,
            granted: t0 + Duration::from_millis(granted),
            released: t0 + Duration::from_millis(released),
        };
        BTreeMap::from([("k".to_owned(), vec![held(0, a), held(1, b)])])
    };
    let overlap = history((1, 0, 10), (2, 5, 20));
    assert!(check(&overlap).is_err());
    let reordered = history((5, 0, 10), (3, 11, 20));
    assert!(check(&reordered).is_err());
    let fine = history((3, 0, 10), (5, 10, 20));
    assert_eq!(check(&fine), Ok(2));
}

async fn run(backend: Backend) {
    let mut stack = LockStack::backend(backend, &[("lock.waiters.max-per-key", "64")]);
    let replicas = [stack.serve().await, stack.serve().await];
    let history: Arc<Mutex<BTreeMap<String, Vec<Held>>>> = Arc::default();
    let mut tasks = Vec::new();
    for c in 0..CLIENTS {
        let url = replicas[c % 2].clone();
        let history = history.clone();
        tasks.push(tokio::spawn(async move {
            let lock = client(&url, &format!("worker-{c}"));
            // Kept alive however long the run takes, as a worker's is.
            let session = LockSession::open(lock.clone(), 30_000)
                .await
                .unwrap_or_else(|e| panic!("session: {e}"));
            let session_id = session.id().await;
            let mut done = 0;
            let mut attempt = 0usize;
            while done < CYCLES_PER_CLIENT {
                attempt += 1;
                let key = format!("exclusion:{}", (c + attempt) % KEYS);
                // Half the clients wait server-side, half try and back off.
                let wait = if c % 2 == 0 { Some(5_000) } else { None };
                let grant = match lock.acquire(&key, session_id, Some(10_000), wait).await {
                    Ok(grant) => grant,
                    Err(e) if e.code() == Some(ErrorCode::LockContended) => {
                        tokio::time::sleep(Duration::from_millis(1 + (attempt % 3) as u64)).await;
                        continue;
                    }
                    Err(e) => panic!("acquire {key}: {e}"),
                };
                let granted = Instant::now();
                if done % 3 == 0 {
                    let renewed = lock
                        .renew(&key, session_id, grant.fencing_token, None)
                        .await
                        .unwrap_or_else(|e| panic!("renew: {e}"));
                    assert_eq!(renewed.fencing_token, grant.fencing_token);
                }
                let released = Instant::now();
                lock.release(&key, session_id, grant.fencing_token)
                    .await
                    .unwrap_or_else(|e| panic!("release: {e}"));
                history.lock().await.entry(key).or_default().push(Held {
                    token: grant.fencing_token,
                    client: c,
                    granted,
                    released,
                });
                done += 1;
            }
            session.close().await.unwrap_or_else(|e| panic!("{e}"));
        }));
    }
    for task in tasks {
        task.await.unwrap_or_else(|e| panic!("client task: {e}"));
    }
    let history = history.lock().await;
    let total = check(&history).unwrap_or_else(|violation| panic!("{backend:?}: {violation}"));
    assert_eq!(total, CLIENTS * CYCLES_PER_CLIENT);
    drop(stack);
}

on_each_backend!(run => no_two_grants_of_a_key_overlap_on_pg, no_two_grants_of_a_key_overlap_on_etcd);
