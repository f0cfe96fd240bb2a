//! SIGKILL of a lock-server process mid-run, then a restart: no grant is lost, and no token at or
//! below one already issued is ever issued again.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicUsize, Ordering};
use std::time::Duration;

use dlock_contract::ErrorCode;
use dlock_contract::client::ClientError;
use tokio::sync::Mutex;

use crate::harness::{Backend, LockStack, client, eventually, on_each_backend, port, session_kept};

const WORKERS: usize = 8;
const KILLS: usize = 2;

async fn run(backend: Backend) {
    let stack = LockStack::backend(backend, &[]);
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let log = dir.path().join("lock-server.log");
    let port = port();
    let url = format!("http://127.0.0.1:{port}");
    let mut process = stack.spawn_process(port, &log);

    // Grants that must survive every crash, on a long session.
    let keeper = client(&url, "keeper");
    let keep_session = keeper
        .create_session(Some(60_000))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let mut kept = BTreeMap::new();
    for i in 0..5 {
        let key = format!("crash:kept-{i}");
        let grant = keeper
            .acquire(&key, keep_session.session_id, Some(60_000), None)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        kept.insert(key, grant.fencing_token);
    }

    // Workers cycle through other keys the whole time, riding out the crashes.
    let highest_before_kill = Arc::new(AtomicI64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let cycles = Arc::new(AtomicUsize::new(0));
    let tokens: Arc<Mutex<Vec<(usize, i64)>>> = Arc::default();
    let epoch = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for w in 0..WORKERS {
        let (url, stop, cycles, tokens, epoch) = (
            url.clone(),
            stop.clone(),
            cycles.clone(),
            tokens.clone(),
            epoch.clone(),
        );
        tasks.push(tokio::spawn(async move {
            let lock = client(&url, &format!("crash-worker-{w}"));
            let mut session = None;
            while !stop.load(Ordering::SeqCst) {
                let Ok(sid) = session_kept(&lock, &mut session, 30_000).await else {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    continue;
                };
                let key = format!("crash:work-{}", w % 4);
                match lock.acquire(&key, sid, Some(10_000), Some(2_000)).await {
                    Ok(grant) => {
                        tokens
                            .lock()
                            .await
                            .push((epoch.load(Ordering::SeqCst), grant.fencing_token));
                        let _ = lock.release(&key, sid, grant.fencing_token).await;
                        cycles.fetch_add(1, Ordering::SeqCst);
                    }
                    Err(ClientError::Api { body, .. })
                        if matches!(
                            body.code,
                            ErrorCode::LockContended | ErrorCode::ContentionExceeded
                        ) => {}
                    Err(ClientError::Api { body, .. })
                        if matches!(
                            body.code,
                            ErrorCode::SessionUnknown | ErrorCode::SessionExpired
                        ) =>
                    {
                        session = None;
                    }
                    // The server is down or restarting; a grant may have been issued that we never
                    // heard of, which is exactly what the token check below must tolerate.
                    Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
                }
            }
        }));
    }

    for kill in 0..KILLS {
        let target = cycles.load(Ordering::SeqCst) + 150;
        eventually("workers make progress", Duration::from_secs(60), || async {
            (cycles.load(Ordering::SeqCst) >= target).then_some(())
        })
        .await;
        process.kill();
        let before = tokens
            .lock()
            .await
            .iter()
            .map(|(_, t)| *t)
            .max()
            .unwrap_or(0);
        highest_before_kill.store(before, Ordering::SeqCst);
        epoch.store(kill + 1, Ordering::SeqCst);
        process = stack.spawn_process(port, &log);
        // Every kept grant survived, with its token.
        for (key, token) in &kept {
            let info = keeper.get(key).await.unwrap_or_else(|e| panic!("{e}"));
            assert!(info.held, "{backend:?}: {key} was lost in the crash");
            assert_eq!(
                info.fencing_token,
                Some(*token),
                "{backend:?}: {key} changed token"
            );
            let renewed = keeper
                .renew(key, keep_session.session_id, *token, None)
                .await
                .unwrap_or_else(|e| panic!("{backend:?}: renew {key} after restart: {e}"));
            assert_eq!(renewed.fencing_token, *token);
        }
        // Every token issued after the restart exceeds every token seen before the kill.
        let target = cycles.load(Ordering::SeqCst) + 50;
        eventually("workers resume", Duration::from_secs(60), || async {
            (cycles.load(Ordering::SeqCst) >= target).then_some(())
        })
        .await;
        let tokens = tokens.lock().await;
        for (e, t) in tokens.iter().filter(|(e, _)| *e == kill + 1) {
            assert!(
                *t > before,
                "{backend:?}: after restart {e} token {t} is not above {before}"
            );
        }
    }
    stop.store(true, Ordering::SeqCst);
    for task in tasks {
        task.await.unwrap_or_else(|e| panic!("{e}"));
    }
    let all = tokens.lock().await;
    let mut seen = std::collections::HashSet::new();
    for (_, t) in all.iter() {
        assert!(seen.insert(*t), "{backend:?}: token {t} issued twice");
    }
    drop(process);
}

on_each_backend!(run => sigkill_and_restart_loses_no_grant_and_never_reissues_a_token_on_pg, sigkill_and_restart_loses_no_grant_and_never_reissues_a_token_on_etcd);
