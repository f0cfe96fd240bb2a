//! A holder that lost its lock, by a pause while another took the account over or by a
//! revocation, is fenced: at the account and at the rail.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_paused_holder_is_fenced_after_another_takes_the_account_over() {
    let chaos = Chaos::start(Backend::Pg, &[("rail.stub.latency-ms", "20")], 2_000);
    // The scripted holder claims item-0000 of the batch, then sleeps past its lease.
    let batch = chaos.funded_batch("paused", 4, 80).await;
    let payout = register_one(&chaos, "paused-batch", "paused-00", 1_000).await;
    let holder = ScriptedHolder::claim(&chaos, "paused-00", payout, 1_000).await;
    let lock = LockClient::new(&chaos.lock().url(), "watcher").unwrap_or_else(|e| panic!("{e}"));
    eventually(
        "the paused holder's lease lapses",
        Duration::from_secs(15),
        || async { (!lock.get("payout:paused-00").await.ok()?.held).then_some(()) },
    )
    .await;
    // A real executor process is paused too, mid-run, while another takes its accounts over.
    let (stopped, stopped_log) = chaos.executor(
        &batch,
        "executor-stopped",
        &["--lock-ttl-ms", "1500", "--session-ttl-ms", "1500"],
    );
    chaos
        .progressed(
            "the first executor makes progress",
            5,
            Duration::from_secs(30),
        )
        .await;
    stopped
        .signal(Signal::SIGSTOP)
        .unwrap_or_else(|e| panic!("{e}"));
    let (taker, taker_log) = chaos.executor(&batch, "executor-taker", &[]);
    let mut fenced = chaos.finish(taker, &taker_log);
    stopped
        .signal(Signal::SIGCONT)
        .unwrap_or_else(|e| panic!("{e}"));
    fenced += chaos.finish(stopped, &stopped_log);
    // The taker re-claimed item-0000 under a newer token; the holder's every write is refused.
    fenced += holder.resume("paused-00", payout, 1_000).await;
    chaos
        .check("paused holder (expiry)", ("paused", 80), 2, fenced)
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn after_a_revocation_the_holder_is_fenced_at_the_account_and_at_the_rail() {
    let chaos = Chaos::start(Backend::Pg, &[], 2_000);
    chaos.accounts("revoked", 1, 1_000_000).await;
    let payout = register_one(&chaos, "revoked-batch", "revoked-00", 1_000).await;
    // A long lease: only the revocation can take it away.
    let holder = ScriptedHolder::claim(&chaos, "revoked-00", payout, 60_000).await;
    let output = std::process::Command::new(EXE)
        .args([
            "revoke",
            "payout:revoked-00",
            "--reason",
            "holder stuck in a GC pause",
            "--operator",
            "oncall",
        ])
        .args([
            "--lock-server",
            &chaos.lock().url(),
            "--payment-resource",
            &chaos.payment().url(),
        ])
        .args([
            "--rail-proxy",
            &chaos.proxy().url(),
            "--operator-token",
            OPERATOR_TOKEN,
        ])
        .output()
        .unwrap_or_else(|e| panic!("{e}"));
    let said = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "dlock revoke failed: {said}{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(said.contains("lock server: revoked token"), "{said}");
    assert!(
        said.contains("payment resource: account revoked-00 fence"),
        "{said}"
    );
    assert!(
        said.contains("rail proxy: account revoked-00 high-water"),
        "{said}"
    );
    assert!(said.contains("done"), "{said}");
    // Nobody else has written yet; the floor alone fences the holder everywhere.
    let fenced = holder.resume("revoked-00", payout, 1_000).await;
    // A new holder finishes the payout.
    let batch = chaos.batch("revoked-batch", "revoked", 1, 1);
    let (runner, log) = chaos.executor(&batch, "executor-after-revoke", &[]);
    let fenced = fenced + chaos.finish(runner, &log);
    chaos
        .check("paused holder (revocation)", ("revoked", 1), 1, fenced)
        .await;
}
