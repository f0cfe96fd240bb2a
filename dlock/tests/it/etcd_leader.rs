//! A leader change under a batch: three etcd members on loopback, as
//! production runs them (TLS, client certificates, authentication on, the lock server's role
//! limited to its prefix: `etcd_tls::SecureEtcd`), the lock server with all three endpoints, a
//! batch of payouts through the real services; the leader is killed mid-batch (SIGKILL: no
//! leadership hand-over, a real election) and restarted later.
//! A probe client measures what clients see meanwhile: every refusal is `503 NOT_LEADER` with
//! `retryAfterMillis`, or `503 OUTCOME_UNKNOWN` (not retry-safe) for a write etcd may have
//! applied without answering in time (docs/contract.md#outcome-unknown); a grant held across
//! the election survives or is `LOCK_LOST` /
//! `SESSION_EXPIRED`, and never has a second holder. The chaos suite's invariant checker then
//! counts double payments on the rail's statement.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use dlock_contract::ErrorCode;
use dlock_devstack::certs::Validity;
use dlock_devstack::etcd_cluster::EtcdCluster;
use etcd_client::ConnectOptions;
use tokio::sync::Mutex;

use crate::chaos::Chaos;
use crate::etcd_tls::{SecureEtcd, tls_options};
use crate::harness::{Backend, client, eventually, hold, leading_member, session};

/// The member that leads now, by etcd's status API (asked of each member in turn, as `root`).
async fn leader(cluster: &EtcdCluster, admin: &ConnectOptions) -> usize {
    leading_member(cluster, Some(admin.clone()))
        .await
        .unwrap_or_else(|| panic!("no member says it leads"))
}

/// Sends `call` again after each `503 NOT_LEADER`, waiting its `retryAfterMillis`, as the
/// contract allows (nothing was changed); up to 40 times. Also after `503 OUTCOME_UNKNOWN`: the
/// calls here are ones whose repetition changes nothing more (a new session, a renew of the same
/// token, an acquire of a key another grant holds).
async fn past_not_leader<T, F, Fut>(mut call: F) -> Result<T, dlock_contract::client::ClientError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, dlock_contract::client::ClientError>>,
{
    let mut attempts = 0;
    loop {
        match call().await {
            Err(e) if e.code() == Some(ErrorCode::OutcomeUnknown) && attempts < 40 => {
                attempts += 1;
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) if e.code() == Some(ErrorCode::NotLeader) && attempts < 40 => {
                attempts += 1;
                let wait = e
                    .retry_after()
                    .unwrap_or_else(|| panic!("no retryAfterMillis: {e}"));
                tokio::time::sleep(wait.min(Duration::from_millis(500))).await;
            }
            other => return other,
        }
    }
}

#[derive(Default)]
struct Seen {
    cycles: AtomicUsize,
    /// Writes answered OUTCOME_UNKNOWN (sent to etcd, no answer in time).
    unknown: AtomicUsize,
    other_errors: Mutex<Vec<String>>,
    /// Each probe cycle: when it started, when it ended, whether it was refused (NOT_LEADER).
    events: Mutex<Vec<(Instant, Instant, bool)>>,
}

impl Seen {
    async fn refused_between(&self, from: Instant, to: Instant) -> usize {
        let events = self.events.lock().await;
        events
            .iter()
            .filter(|(_, end, refused)| *refused && *end >= from && *end < to)
            .count()
    }

    async fn cycles_started_after(&self, from: Instant) -> usize {
        let events = self.events.lock().await;
        events
            .iter()
            .filter(|(start, _, refused)| !refused && *start >= from)
            .count()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_leader_change_mid_batch_pays_nobody_twice() {
    let mut secure = SecureEtcd::start(3).await;
    // etcd's status API answers `root` (here by a client certificate with that CN).
    let root = secure
        .clients_ca
        .client("root-status", "root", Validity::Current)
        .unwrap_or_else(|e| panic!("{e:#}"));
    let admin = ConnectOptions::new().with_tls(tls_options(&secure.server_ca, &root));
    let mut pairs: Vec<(&'static str, String)> = secure
        .pairs()
        .into_iter()
        .filter(|(key, _)| *key != "lock.etcd.connect-timeout-ms")
        .collect();
    pairs.extend([
        ("lock.etcd.connect-timeout-ms", "500".to_owned()),
        // The default, written out: below the callers' 2 s write timeout.
        ("lock.etcd.request-timeout-ms", "1500".to_owned()),
    ]);
    let chaos = Chaos::start_on(
        Backend::Etcd,
        Some(pairs),
        &[("rail.stub.latency-ms", "20")],
        1_000,
    );
    let batch = chaos.funded_batch("lead", 8, 120).await;
    let (executor, log) = chaos.executor(&batch, "executor-lead", &[]);

    // A holder whose grant spans the election, and a probe doing whole cycles every 50 ms.
    let lock_url = chaos.lock().url();
    let holder = client(&lock_url, "holder");
    let held_session = session(&holder, 30_000).await;
    let held = hold(&holder, "probe:held", held_session, 30_000).await;

    let seen = Arc::new(Seen::default());
    let stop = Arc::new(AtomicBool::new(false));
    let probe = tokio::spawn({
        let (seen, stop, url) = (seen.clone(), stop.clone(), lock_url.clone());
        async move {
            let lock = client(&url, "probe");
            // A session the probe replaces every 30 s, well within its 60 s TTL: the probe
            // sends no heartbeats, and a session lapsing between an acquire and its release
            // would look like a grant lost in the election.
            let mut session: Option<(uuid::Uuid, Instant)> = None;
            let mut n = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let started = Instant::now();
                let result = async {
                    let id = match session {
                        Some((id, since)) if since.elapsed() < Duration::from_secs(30) => id,
                        _ => {
                            let s = lock.create_session(Some(60_000)).await?;
                            session = Some((s.session_id, Instant::now()));
                            s.session_id
                        }
                    };
                    // A key per cycle: a release refused mid-election leaves its grant to
                    // its TTL, which must not make the next cycle contend with itself.
                    let key = format!("probe:cycle-{}", n);
                    n += 1;
                    let grant = lock.acquire(&key, id, Some(5_000), None).await?;
                    lock.release(&key, id, grant.fencing_token).await
                }
                .await;
                match result {
                    Ok(()) => {
                        seen.cycles.fetch_add(1, Ordering::Relaxed);
                        seen.events
                            .lock()
                            .await
                            .push((started, Instant::now(), false));
                    }
                    Err(e) if e.code() == Some(ErrorCode::NotLeader) => {
                        assert!(e.retry_safe(), "NOT_LEADER is retry-safe: {e}");
                        assert!(
                            e.retry_after().is_some(),
                            "NOT_LEADER carries retryAfterMillis: {e}"
                        );
                        seen.events
                            .lock()
                            .await
                            .push((started, Instant::now(), true));
                    }
                    Err(e) if e.code() == Some(ErrorCode::OutcomeUnknown) => {
                        assert!(!e.retry_safe(), "OUTCOME_UNKNOWN is never retry-safe: {e}");
                        // Its key is this cycle's alone: an acquire that did take it is left
                        // to its TTL, a release that did not happen too.
                        seen.unknown.fetch_add(1, Ordering::Relaxed);
                    }
                    Err(e)
                        if matches!(
                            e.code(),
                            Some(ErrorCode::SessionExpired | ErrorCode::SessionUnknown)
                        ) =>
                    {
                        session = None;
                    }
                    Err(e) => seen.other_errors.lock().await.push(e.to_string()),
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    });

    chaos
        .progressed("the batch makes progress", 30, Duration::from_secs(60))
        .await;
    let old_leader = leader(&secure.cluster, &admin).await;
    let posted_at_kill = chaos.posted_count().await;
    let killed_at = Instant::now();
    secure.cluster.kill(old_leader);
    // The election is over for clients when a whole cycle succeeds after the kill.
    let cycles_at_kill = seen.cycles.load(Ordering::Relaxed);
    eventually(
        "a lock cycle succeeds after the leader's death",
        Duration::from_secs(30),
        || async { (seen.cycles.load(Ordering::Relaxed) > cycles_at_kill + 2).then_some(()) },
    )
    .await;
    let new_leader = leader(&secure.cluster, &admin).await;
    assert_ne!(new_leader, old_leader);

    // The grant held across the election: renewed with the same token, or ended as the
    // contract says; while it is renewed, nobody else gets the key.
    let contender = client(&lock_url, "contender");
    let contender_session = past_not_leader(|| contender.create_session(Some(10_000)))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let held_outcome = match past_not_leader(|| {
        holder.renew("probe:held", held_session, held.fencing_token, None)
    })
    .await
    {
        Ok(renewed) => {
            assert_eq!(renewed.fencing_token, held.fencing_token);
            let second = past_not_leader(|| {
                contender.acquire("probe:held", contender_session.session_id, None, None)
            })
            .await;
            assert_eq!(
                second.as_ref().err().and_then(|e| e.code()),
                Some(ErrorCode::LockContended),
                "a grant that survived the election has no second holder: {second:?}"
            );
            "survived (renewed, same token)"
        }
        Err(e) => {
            assert!(
                matches!(
                    e.code(),
                    Some(ErrorCode::LockLost | ErrorCode::SessionExpired)
                ),
                "a grant lost in the election is LOCK_LOST or SESSION_EXPIRED: {e}"
            );
            "ended (LOCK_LOST/SESSION_EXPIRED)"
        }
    };

    // What clients saw of the election: the first whole cycle begun after the kill ends when a
    // new leader commits it.
    let elected_at = {
        let events = seen.events.lock().await;
        events
            .iter()
            .filter(|(start, _, refused)| !refused && *start >= killed_at)
            .map(|(_, end, _)| *end)
            .min()
            .unwrap_or_else(|| panic!("no cycle succeeded after the kill"))
    };
    // Then two of three members serve, a quorum: clients must not be refused while the dead
    // member stays down (requests routed to it would be). Measured over at least 20 cycles,
    // from 1 s after the election (the lock server's check of its endpoints).
    let steady_from = elected_at + Duration::from_secs(1);
    eventually(
        "more payouts and 20 lock cycles with one member down",
        Duration::from_secs(60),
        || async {
            (chaos.posted_count().await >= posted_at_kill + 10
                && seen.cycles_started_after(steady_from).await >= 20)
                .then_some(())
        },
    )
    .await;
    let restarted_at = Instant::now();
    let refused_member_down = seen.refused_between(steady_from, restarted_at).await;
    // The old leader comes back as a follower while the batch goes on.
    secure
        .cluster
        .restart(old_leader)
        .unwrap_or_else(|e| panic!("{e:#}"));
    // Back as a follower, it gets requests again: none may be refused (a restarted member has
    // forgotten the lock server's etcd token, which the lock server must renew by itself).
    let back_from = Instant::now() + Duration::from_secs(1);
    eventually(
        "20 lock cycles with the old leader back",
        Duration::from_secs(60),
        || async { (seen.cycles_started_after(back_from).await >= 20).then_some(()) },
    )
    .await;
    let refused_member_back = seen.refused_between(back_from, Instant::now()).await;
    let fenced = chaos.finish(executor, &log);
    stop.store(true, Ordering::Relaxed);
    probe.await.unwrap_or_else(|e| panic!("probe: {e}"));

    let others = seen.other_errors.lock().await.clone();
    let refused_election = seen.refused_between(killed_at, steady_from).await;
    let refused_total = seen.refused_between(killed_at, Instant::now()).await;
    let cycles = seen.cycles.load(Ordering::Relaxed);
    let unknown = seen.unknown.load(Ordering::Relaxed);
    println!(
        "leader change: member {old_leader} killed, member {new_leader} leads; clients saw the \
         election for {} ms (first lock cycle begun after the kill to its commit); NOT_LEADER \
         refusals (retryAfterMillis set): {refused_election} during the election, \
         {refused_member_down} while the dead member stayed down, {refused_member_back} once \
         it was back, {refused_total} in all; {unknown} OUTCOME_UNKNOWN; \
         {cycles} probe cycles; held grant {held_outcome}",
        elected_at.duration_since(killed_at).as_millis(),
    );
    let figures = chaos
        .check("etcd leader killed (3 members)", ("lead", 120), 1, fenced)
        .await;
    assert_eq!(figures.payouts, 120);
    assert_eq!(
        refused_member_back, 0,
        "the restarted member serves the lock server again (its etcd token renewed)"
    );
    // The lock server's log sits beside the batch file; its internal errors name the cause.
    let internal: Vec<String> = std::fs::read_to_string(
        batch
            .parent()
            .unwrap_or_else(|| panic!("the batch file is in the chaos directory"))
            .join("lock-server.log"),
    )
    .unwrap_or_default()
    .lines()
    .filter(|line| line.contains("internal_error"))
    .map(str::to_owned)
    .collect();
    assert!(
        others.is_empty(),
        "during the election every refusal is NOT_LEADER or OUTCOME_UNKNOWN: {others:?}; the lock server's \
         internal errors: {internal:#?}"
    );
    assert_eq!(
        refused_member_down, 0,
        "with a quorum of two live members no request may be refused (routed to the dead one)"
    );
}
