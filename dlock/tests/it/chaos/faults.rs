//! Faults while batches run (each service killed, PostgreSQL or etcd restarted, a hostile rail, the
//! same batch run again): every batch finishes and nobody is paid twice.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn killing_each_service_mid_batch_pays_nobody_twice() {
    let mut chaos = Chaos::start(Backend::Pg, &[("rail.stub.latency-ms", "150")], 1_000);
    let batch = chaos.funded_batch("kill", 10, 150).await;
    let executors = chaos.two_executors(&batch, "kill");
    let mut faults = 0;
    for (n, target) in [Role::LockServer, Role::PaymentResource, Role::RailProxy]
        .into_iter()
        .enumerate()
    {
        let floor = 20 * (n + 1);
        chaos
            .progressed("the batch makes progress", floor, Duration::from_secs(60))
            .await;
        // The proxy dies with forwards in flight (the rail takes 150 ms each).
        chaos.restart(target);
        faults += 1;
    }
    let fenced = chaos.finish_all(executors);
    chaos
        .check(
            "SIGKILL lock server, payment, proxy",
            ("kill", 150),
            faults,
            fenced,
        )
        .await;
}

/// A backing server restarts (`restart`) once a batch of 120 payouts on 8 accounts has posted 30;
/// the batch finishes and nobody is paid twice.
async fn restart_mid_batch(
    backend: Backend,
    prefix: &str,
    scenario: &'static str,
    restart: impl FnOnce(&mut Chaos),
) {
    let mut chaos = Chaos::start(backend, &[("rail.stub.latency-ms", "20")], 1_000);
    let batch = chaos.funded_batch(prefix, 8, 120).await;
    let (a, a_log) = chaos.executor(&batch, &format!("executor-{prefix}"), &[]);
    chaos
        .progressed("the batch makes progress", 30, Duration::from_secs(60))
        .await;
    restart(&mut chaos);
    let fenced = chaos.finish(a, &a_log);
    chaos.check(scenario, (prefix, 120), 1, fenced).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_postgres_restart_mid_batch_pays_nobody_twice() {
    restart_mid_batch(Backend::Pg, "pgr", "PostgreSQL restart", |chaos| {
        chaos
            .pg
            .as_mut()
            .map(|pg| pg.restart())
            .unwrap_or_else(|| panic!("the stack runs PostgreSQL"))
            .unwrap_or_else(|e| panic!("{e:#}"));
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_etcd_restart_mid_batch_pays_nobody_twice() {
    restart_mid_batch(
        Backend::Etcd,
        "etcdr",
        "etcd restart (etcd backend)",
        |chaos| {
            let etcd = chaos
                .etcd
                .as_mut()
                .unwrap_or_else(|| panic!("the stack runs etcd"));
            etcd.stop();
            etcd.start_again().unwrap_or_else(|e| panic!("{e:#}"));
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_hostile_rail_mid_batch_pays_nobody_twice() {
    let chaos = Chaos::start(
        Backend::Pg,
        &[
            ("rail.stub.failure-rate", "0.2"),
            ("rail.stub.duplicate-ack-rate", "0.5"),
            ("rail.stub.latency-ms", "250"),
            ("rail.stub.latency-jitter-ms", "200"),
            ("rail.stub.hang-ms", "1500"),
        ],
        400,
    );
    let batch = chaos.funded_batch("hostile", 10, 150).await;
    let fenced = chaos.finish_all(chaos.two_executors(&batch, "hostile"));
    chaos
        .check("hostile rail", ("hostile", 150), 0, fenced)
        .await
        .left_ambiguous("a hostile rail leaves some payouts ambiguous");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn running_the_same_batch_again_pays_nobody_twice() {
    let chaos = Chaos::start(Backend::Pg, &[], 2_000);
    let batch = chaos.funded_batch("again", 5, 60).await;
    let (first, first_log) = chaos.executor(&batch, "executor-first", &[]);
    let mut fenced = chaos.finish(first, &first_log);
    assert_eq!(chaos.transfers().await, 60);
    // The same file again, as a re-applied or re-synced manifest would be: the ids come from the
    // batch name and item keys, so it finds every payout already settled and moves no money.
    let (second, second_log) = chaos.executor(&batch, "executor-second", &[]);
    fenced += chaos.finish(second, &second_log);
    assert_eq!(
        chaos.transfers().await,
        60,
        "the second run presented nothing to the rail"
    );
    chaos
        .check("same batch run twice", ("again", 60), 0, fenced)
        .await;
}
