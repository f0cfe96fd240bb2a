//! Group commit of the rail proxy's records (docs/design.md#group-commit): the answers of
//! concurrent forwards are recorded together (`rail_record_many`), each its own, and a record
//! batch that fails records each answer alone. The gate is an attempt's row held while its
//! forward is at a slow rail, so that its record waits in paydb.

use super::*;

/// Four payouts of four accounts through a proxy in front of a rail that answers after 1.5 s:
/// the gate (the first) and the three under test.
async fn record_world(
    prefix: &'static str,
) -> (RailWorld, String, String, ManagedChild, Vec<Item>) {
    let (w, stub) = RailWorld::with_stub("stub", &[("rail.stub.latency-ms", "1500")]).await;
    let (proxy, process) = batching_proxy(&w, &stub, &[]);
    let mut items = Vec::new();
    for i in 0..4 {
        let account: &'static str = Box::leak(format!("{prefix}-{i}").into_boxed_str());
        w.account(account, 10_000).await;
        let token = 10 + i as i64;
        items.push(Item {
            account,
            payout: w.claimed(account, 100 * (i as i64 + 1), token).await,
            amount: 100 * (i as i64 + 1),
            token,
        });
    }
    (w, stub, proxy, process, items)
}

/// Sends the gate's submission, holds its attempt's row while its forward is at the slow rail so
/// that its record waits in paydb, sends `items` and waits until their records queue behind it
/// (each forward done), runs `then`, and lets the gate go.
async fn gated_records(
    w: &RailWorld,
    proxy: &str,
    gate: Item,
    items: &[Item],
    then: impl std::future::Future<Output = ()>,
) -> Gated {
    measured(proxy, "record", async {
        tokio::join!(gate.send(proxy), async {
            w.intent_committed(gate.payout, gate.token).await;
            let gate_conn = hold(w, Row::Attempt, gate.payout).await;
            waits_in(w, "rail_record").await;
            let (answers, ()) = tokio::join!(
                futures::future::join_all(items.iter().map(|item| item.send(proxy))),
                async {
                    batch_metrics(proxy).queued("record", items.len()).await;
                    then.await;
                    open(gate_conn).await;
                }
            );
            answers
        })
    })
    .await
}

/// The gate's record ran alone, then the three others' in batches of four items in all
/// (`batches`, as `why` says); each item, the gate first, answered ACKED under its own token,
/// recorded ACKED, and presented to the rail once.
async fn all_acked(w: &RailWorld, stub: &str, items: &[Item], gated: Gated, why: &str) {
    let ((status, body), answers, batches) = gated;
    assert_eq!(status, 200, "the gate: {body}");
    assert_eq!(batches, (2.0, 4.0), "{why}");
    let answers = [vec![(status, body)], answers].concat();
    for (item, (status, body)) in items.iter().zip(&answers) {
        let account = item.account;
        assert_eq!(*status, 200, "{account}: {body}");
        assert_eq!(body["outcome"], "ACKED", "{account}");
        assert_eq!(body["presentedToken"], item.token, "{account}");
        assert_eq!(w.state(item.payout).await, "RAIL_ACKED", "{account}");
        assert_eq!(
            w.submissions(item.payout).await,
            vec![("ACKED".to_owned(), item.token)],
            "{account}"
        );
        assert_eq!(statement(stub, item.payout).await.len(), 1, "{account}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_answers_of_concurrent_forwards_are_recorded_in_one_commit_each_its_own() {
    let (w, stub, proxy, _process, items) = record_world("gr").await;
    let gated = gated_records(&w, &proxy, items[0], &items[1..], async {}).await;
    all_acked(
        &w,
        &stub,
        &items,
        gated,
        "the gate's record alone, then the three together",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_aborted_record_batch_records_each_answer_alone_none_left_ambiguous() {
    let (w, stub, proxy, _process, items) = record_world("gx").await;
    // The last item's attempt is held from outside: the batch of three stops there, and dies
    // there; then each answer is recorded alone.
    let blocker = std::sync::Arc::new(tokio::sync::Mutex::new(None));
    let (gated, ()) = tokio::join!(
        gated_records(&w, &proxy, items[0], &items[1..], async {
            *blocker.lock().await = Some(hold(&w, Row::Attempt, items[3].payout).await);
        }),
        async {
            terminate_waiting(&w, "rail_record_many", "the record batch's backend").await;
            // Recorded alone, the held attempt's record waits for it: let it go.
            waits_in(&w, "rail_record").await;
            let held = blocker.lock().await.take();
            open(held.unwrap_or_else(|| panic!("the blocker was taken"))).await;
        }
    );
    all_acked(
        &w,
        &stub,
        &items,
        gated,
        "the gate's record alone, then the batch of three that was aborted",
    )
    .await;
}
