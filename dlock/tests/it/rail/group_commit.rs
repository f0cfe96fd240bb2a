//! Group commit of the rail proxy's admissions (docs/design.md#group-commit), against a real
//! `dlock serve rail-proxy` process on a real paydb and the rail stub: submissions that queue
//! while an admission runs are admitted together (`rail_admit_many`, one statement, one commit),
//! each still gets its own answer, and only the admitted ones reach the rail, once.
//!
//! A test makes a batch form for certain: from its own connection it holds the row lock of a
//! "gate" payout, sends that payout's submission, which runs alone and waits in paydb, then sends
//! the submissions under test, which queue in the proxy (the `rail_batch_queued` gauge says how
//! many), and only then lets the gate go. The `rail_batch_size` histogram shows the batches that
//! ran.

use sqlx::PgConnection;

use crate::harness::{BatchMetrics, hold_row, open};

use super::*;

mod records;

const WAIT: Duration = Duration::from_secs(20);

/// A proxy process in front of `stub`, batching admissions (its URL and the process).
fn batching_proxy(w: &RailWorld, stub: &str, settings: &[(&str, &str)]) -> (String, ManagedChild) {
    let port = port();
    let mut all = vec![("rail.batch.max", "16")];
    all.extend_from_slice(settings);
    let process = w.proxy_process(port, stub, &all);
    (format!("http://127.0.0.1:{port}"), process)
}

/// Which of a payout's rows in paydb a gate holds.
#[derive(Clone, Copy)]
enum Row {
    /// The payout's own row.
    Payout,
    /// Its attempt's row (its intent committed): that attempt's record waits for it.
    Attempt,
}

/// A connection in a transaction that holds `payout`'s `row` until [`open`] or until it is
/// dropped.
async fn hold(w: &RailWorld, row: Row, payout: Uuid) -> PgConnection {
    let (select_for_update, what) = match row {
        Row::Payout => (
            "SELECT payout_id FROM payouts WHERE payout_id = $1 FOR UPDATE",
            "exists",
        ),
        Row::Attempt => (
            "SELECT submission_id FROM rail_submission WHERE payout_id = $1 FOR UPDATE",
            "has its attempt",
        ),
    };
    let what = format!("{payout} {what}");
    hold_row(&w.pg().url("paydb"), select_for_update, payout, &what).await
}

/// Waits until a statement calling `function` waits for a lock in paydb; its backend's pid.
async fn waits_in(w: &RailWorld, function: &str) -> i32 {
    let pattern = format!("%{function}(%");
    eventually(&format!("{function} waits for a lock"), WAIT, || async {
        let pids: Vec<(i32,)> = sqlx::query_as(
            "SELECT pid FROM pg_stat_activity WHERE datname = 'paydb' \
             AND wait_event_type = 'Lock' AND query LIKE $1 AND pid <> pg_backend_pid()",
        )
        .bind(&pattern)
        .fetch_all(&w.pool)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
        pids.first().map(|p| p.0)
    })
    .await
}

/// Waits until a statement calling `function` waits for a lock in paydb, and ends its backend
/// (`what`), as a crash of its connection would.
async fn terminate_waiting(w: &RailWorld, function: &str, what: &str) {
    let pid = waits_in(w, function).await;
    let (terminated,): (bool,) = sqlx::query_as("SELECT pg_terminate_backend($1)")
        .bind(pid)
        .fetch_one(&w.pool)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(terminated, "{what} {pid}");
}

/// The proxy's group-commit metrics: `rail_batch_queued` and `rail_batch_size`, by kind
/// (`admit`, `record`).
fn batch_metrics(proxy: &str) -> BatchMetrics {
    BatchMetrics {
        url: proxy.to_owned(),
        prefix: "rail",
    }
}

/// One submission of a batch: its account, payout, amount and presented token.
#[derive(Clone, Copy)]
struct Item {
    account: &'static str,
    payout: Uuid,
    amount: i64,
    token: i64,
}

impl Item {
    async fn send(self, proxy: &str) -> (u16, Value) {
        submit(
            proxy,
            self.account,
            self.payout,
            self.amount,
            &self.token.to_string(),
        )
        .await
    }
}

/// The answers of [`gated`] and [`records::gated_records`]: the gate's, the items' in order, and
/// the batches that ran meanwhile ([`measured`]).
type Gated = ((u16, Value), Vec<(u16, Value)>, (f64, f64));

/// Runs `gating` (a gate and the submissions queued behind it, their answers) and adds the
/// batches of `kind` that ran meanwhile.
async fn measured(
    proxy: &str,
    kind: &str,
    gating: impl std::future::Future<Output = ((u16, Value), Vec<(u16, Value)>)>,
) -> Gated {
    let metrics = batch_metrics(proxy);
    let before = metrics.batches(kind).await;
    let (gate_answer, answers) = gating.await;
    (
        gate_answer,
        answers,
        metrics.batches_since(kind, before).await,
    )
}

/// Holds `gate`'s payout row, sends its submission, waits for it to wait in paydb, sends
/// `items`, waits until they queue behind it, lets the gate go and runs `after_queued`.
async fn gated(
    w: &RailWorld,
    proxy: &str,
    gate: Item,
    items: &[Item],
    after_queued: impl std::future::Future<Output = ()>,
) -> Gated {
    measured(proxy, "admit", async {
        let gate_conn = hold(w, Row::Payout, gate.payout).await;
        tokio::join!(gate.send(proxy), async {
            waits_in(w, "rail_admit").await;
            let (answers, ()) = tokio::join!(
                futures::future::join_all(items.iter().map(|item| item.send(proxy))),
                async {
                    batch_metrics(proxy).queued("admit", items.len()).await;
                    open(gate_conn).await;
                    after_queued.await;
                }
            );
            answers
        })
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_batch_with_mixed_outcomes_answers_each_and_forwards_only_the_admitted_once() {
    let (w, stub) = RailWorld::with_stub("stub", &[]).await;
    let (proxy, _process) = batching_proxy(&w, &stub, &[]);
    for account in ["gm-gate", "gm-a1", "gm-a2", "gm-a3", "gm-fenced", "gm-dup"] {
        w.account(account, 10_000).await;
    }
    // gm-fenced's mark is at 30 (a payout submitted under 30); its next payout, claimed with
    // 31, is presented with 29: FENCED_OUT.
    let (first, status, body) = w.submit_claimed(&proxy, "gm-fenced", 100, 30).await;
    assert_eq!(status, 200, "{body}");
    let fenced = Item {
        account: "gm-fenced",
        payout: w.claimed("gm-fenced", 200, 31).await,
        amount: 200,
        token: 29,
    };
    // gm-dup's payout was submitted under 40; presented again under 41: DUPLICATE_SUBMISSION.
    let (dup_payout, status, dup_first) = w.submit_claimed(&proxy, "gm-dup", 300, 40).await;
    assert_eq!(status, 200, "{dup_first}");
    let duplicate = Item {
        account: "gm-dup",
        payout: dup_payout,
        amount: 300,
        token: 41,
    };
    let mut admitted = Vec::new();
    for (i, account) in ["gm-a1", "gm-a2", "gm-a3"].into_iter().enumerate() {
        let token = 50 + i as i64;
        admitted.push(Item {
            account,
            payout: w.claimed(account, 400, token).await,
            amount: 400,
            token,
        });
    }
    let gate = Item {
        account: "gm-gate",
        payout: w.claimed("gm-gate", 500, 60).await,
        amount: 500,
        token: 60,
    };
    let duplicates_before = metric(&proxy, "rail_duplicate_attempted_total").await;
    let items = [admitted[0], fenced, admitted[1], duplicate, admitted[2]];
    let ((gate_status, gate_body), answers, batches) =
        gated(&w, &proxy, gate, &items, async {}).await;
    assert_eq!(gate_status, 200, "the gate: {gate_body}");
    assert_eq!(
        batches,
        (2.0, 6.0),
        "the gate alone, then the five in one batch"
    );

    // Each item its own answer.
    for (item, (status, body)) in items.iter().zip(&answers) {
        let account = item.account;
        if account.starts_with("gm-a") {
            assert_eq!(*status, 200, "{account}: {body}");
            assert_eq!(body["outcome"], "ACKED", "{account}");
            assert_eq!(body["presentedToken"], item.token, "{account}");
            assert_eq!(body["payoutId"], item.payout.to_string(), "{account}");
            assert_eq!(w.state(item.payout).await, "RAIL_ACKED", "{account}");
            assert_eq!(
                w.submissions(item.payout).await,
                vec![("ACKED".to_owned(), item.token)],
                "{account}"
            );
        }
    }
    let (status, body) = &answers[1];
    assert_envelope("fenced in a batch", *status, body, "FENCED_OUT");
    assert_eq!(
        (
            body["details"]["presentedToken"].as_i64(),
            body["details"]["highestToken"].as_i64()
        ),
        (Some(29), Some(30))
    );
    assert_eq!(
        w.submissions(fenced.payout).await,
        vec![("FENCED".to_owned(), 29)],
        "recorded as FENCED, as alone"
    );
    assert_eq!(w.state(fenced.payout).await, "CLAIMED");
    let (status, body) = &answers[3];
    assert_envelope(
        "duplicate in a batch",
        *status,
        body,
        "DUPLICATE_SUBMISSION",
    );
    assert_eq!(body["details"]["submissionId"], dup_first["submissionId"]);
    assert_eq!(
        metric(&proxy, "rail_duplicate_attempted_total").await - duplicates_before,
        1.0
    );
    assert_eq!(
        w.submissions(duplicate.payout).await,
        vec![("ACKED".to_owned(), 40)]
    );

    // The rail: each admitted payout once (the positive control that the statement shows a
    // batch's forwards), the fenced one never, the duplicate only its first.
    for item in &admitted {
        assert_eq!(
            statement(&stub, item.payout).await.len(),
            1,
            "{}",
            item.account
        );
    }
    assert_eq!(statement(&stub, gate.payout).await.len(), 1, "the gate");
    assert!(statement(&stub, fenced.payout).await.is_empty(), "fenced");
    assert_eq!(statement(&stub, duplicate.payout).await.len(), 1, "dup");
    assert_eq!(statement(&stub, first).await.len(), 1);
    // The fenced payout, presented by its holder: admitted alone and forwarded once.
    let (status, body) = submit(&proxy, "gm-fenced", fenced.payout, 200, "31").await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(statement(&stub, fenced.payout).await.len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_proxy_killed_after_a_batch_committed_leaves_its_payouts_ambiguous_never_forwarded_again()
{
    let (w, restartable, mut proxy) =
        RailWorld::with_restartable_proxy(&[("rail.batch.max", "16")]).await;
    let (url, stub) = (restartable.url.clone(), restartable.stub.clone());
    for account in ["gk-gate", "gk-1", "gk-2"] {
        w.account(account, 10_000).await;
    }
    let gate = w.claimed("gk-gate", 100, 5).await;
    let items = [
        ("gk-1", w.claimed("gk-1", 700, 6).await, 6),
        ("gk-2", w.claimed("gk-2", 800, 7).await, 7),
    ];
    let before = batch_metrics(&url).batches("admit").await;
    let gate_conn = hold(&w, Row::Payout, gate).await;
    let client = dlock_contract::client::http_client().unwrap_or_else(|e| panic!("{e}"));
    let gate_flight = tokio::spawn(submission(&client, &url, "gk-gate", gate, 100, "5").send());
    waits_in(&w, "rail_admit").await;
    let flights: Vec<_> = items
        .iter()
        .map(|(account, payout, token)| {
            let amount = if *account == "gk-1" { 700 } else { 800 };
            tokio::spawn(
                submission(&client, &url, account, *payout, amount, &token.to_string()).send(),
            )
        })
        .collect();
    batch_metrics(&url).queued("admit", 2).await;
    open(gate_conn).await;
    // Both intents committed (the forwards are on their way to the slow rail), in one batch.
    for (_, payout, token) in &items {
        w.intent_committed(*payout, *token).await;
    }
    assert_eq!(
        batch_metrics(&url).batches_since("admit", before).await,
        (2.0, 3.0),
        "the gate alone, then the two together"
    );
    proxy.kill();
    for flight in flights {
        let answer = flight.await.unwrap_or_else(|e| panic!("{e}"));
        assert!(answer.is_err(), "the caller got no answer: {answer:?}");
    }
    let _ = gate_flight.await;
    for (_, payout, _) in &items {
        assert_eq!(w.state(*payout).await, "SUBMITTING");
    }
    // After a restart the unresolved intents are declared ambiguous, never re-forwarded.
    let _proxy = w.restart(&restartable);
    for (account, payout, token) in &items {
        w.quarantined(*payout, *token, account).await;
    }
    // The identical requests, sent together, are answered from the timed-out attempts; a newer
    // token is a duplicate. None is forwarded.
    let amount = |account: &str| if account == "gk-1" { 700 } else { 800 };
    let url_ref = &url;
    let replays =
        futures::future::join_all(items.iter().map(|(account, payout, token)| async move {
            let token = token.to_string();
            submit(url_ref, account, *payout, amount(account), &token).await
        }))
        .await;
    for ((account, _, _), (status, body)) in items.iter().zip(&replays) {
        assert_eq!(*status, 409, "{account}: {body}");
        assert_envelope("replay after restart", *status, body, "RAIL_AMBIGUOUS");
    }
    for (account, payout, token) in &items {
        let (status, body) = submit(
            &url,
            account,
            *payout,
            amount(account),
            &(token + 10).to_string(),
        )
        .await;
        assert_envelope("after restart", status, &body, "DUPLICATE_SUBMISSION");
    }
    // The rail may have taken each one attempt; it never sees a second. (That a batch's
    // forwards show on the statement is a_batch_with_mixed_outcomes_…'s positive control.)
    for (_, payout, _) in &items {
        let transfers = statement(&stub, *payout).await;
        assert!(transfers.len() <= 1, "{transfers:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_aborted_batch_answers_every_item_503_retry_safe_and_writes_nothing() {
    let (w, stub) = RailWorld::with_stub("stub", &[]).await;
    let (proxy, _process) = batching_proxy(&w, &stub, &[]);
    for account in ["ga-gate", "ga-free", "ga-held"] {
        w.account(account, 10_000).await;
    }
    let gate = Item {
        account: "ga-gate",
        payout: w.claimed("ga-gate", 100, 5).await,
        amount: 100,
        token: 5,
    };
    let items = [
        Item {
            account: "ga-free",
            payout: w.claimed("ga-free", 200, 6).await,
            amount: 200,
            token: 6,
        },
        Item {
            account: "ga-held",
            payout: w.claimed("ga-held", 300, 7).await,
            amount: 300,
            token: 7,
        },
    ];
    // ga-held's payout row is held from outside: the batch stops there, and dies there.
    let blocker = hold(&w, Row::Payout, items[1].payout).await;
    let ((gate_status, gate_body), answers, batches) = gated(&w, &proxy, gate, &items, async {
        terminate_waiting(&w, "rail_admit_many", "the batch's backend").await;
    })
    .await;
    open(blocker).await;
    assert_eq!(gate_status, 200, "the gate: {gate_body}");
    assert_eq!(batches, (2.0, 3.0), "the gate, then the batch of two");
    for (item, (status, body)) in items.iter().zip(&answers) {
        let account = item.account;
        assert_eq!(*status, 503, "{account}: {body}");
        assert_envelope(account, *status, body, "RAIL_UNAVAILABLE");
        assert!(
            body["retryAfterMillis"].as_u64().is_some(),
            "{account}: retry-safe: {body}"
        );
        // Nothing of the batch was written or forwarded: no intent, no FENCED row, no mark.
        assert!(w.submissions(item.payout).await.is_empty(), "{account}");
        assert_eq!(w.state(item.payout).await, "CLAIMED", "{account}");
        let (mark,): (i64,) = sqlx::query_as(
            "SELECT count(*) FROM rail_high_water WHERE account_id = $1 AND highest_token > 0",
        )
        .bind(account)
        .fetch_one(&w.pool)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(mark, 0, "{account}: no mark moved");
        assert!(statement(&stub, item.payout).await.is_empty(), "{account}");
    }
    // Positive control: the same submissions again are admitted, written and forwarded once.
    for item in &items {
        let (status, body) = item.send(&proxy).await;
        assert_eq!(status, 200, "{} again: {body}", item.account);
        assert_eq!(
            w.submissions(item.payout).await,
            vec![("ACKED".to_owned(), item.token)]
        );
        assert_eq!(statement(&stub, item.payout).await.len(), 1);
    }
}

/// A world like [`RailWorld::new`]'s on a PostgreSQL with production's durability (each commit
/// waits for its WAL flush), where group commit is meant to pay.
async fn durable_world() -> RailWorld {
    RailWorld::with(dlock_devstack::Durability::Durable, 16).await
}

/// `clients` clients, each submitting `cycles` payouts one after the other through `proxy`, each
/// payout of an account of its own (claimed beforehand, so the claims are not measured):
/// (submissions per second, mean submission latency in ms).
async fn submit_cycles(
    w: &RailWorld,
    proxy: &str,
    run: &str,
    clients: usize,
    cycles: usize,
) -> (f64, f64) {
    // Accounts one at a time: pay_create_account's pay_ensure_system_accounts can fail a
    // concurrent creation with a unique violation (accounts_account_id_currency_key).
    for c in 0..clients {
        for i in 0..cycles {
            w.account(&format!("{run}-{c}-{i}"), 1_000).await;
        }
    }
    let payouts = futures::future::join_all((0..clients).map(|c| async move {
        let mut payouts = Vec::new();
        for i in 0..cycles {
            let account = format!("{run}-{c}-{i}");
            payouts.push((account.clone(), w.claimed(&account, 10, 1).await));
        }
        payouts
    }))
    .await;
    let started = std::time::Instant::now();
    let latencies = futures::future::join_all(payouts.iter().map(|payouts| async move {
        let mut spent = Duration::ZERO;
        for (account, payout) in payouts {
            let sent = std::time::Instant::now();
            let (status, body) = submit(proxy, account, *payout, 10, "1").await;
            spent += sent.elapsed();
            assert_eq!(status, 200, "{account}: {body}");
        }
        spent
    }))
    .await;
    let elapsed = started.elapsed().as_secs_f64();
    let total: Duration = latencies.iter().sum();
    let n = (clients * cycles) as f64;
    (n / elapsed, total.as_secs_f64() * 1_000.0 / n)
}

/// What group commit gives the rail proxy on durable PostgreSQL: 32 clients, each submitting 15
/// payouts (claimed beforehand, each of an account of its own) one after the other, through a
/// proxy process with `rail.batch.max` 16 and one with 1, twice each, alternating (printed, not
/// asserted). A measurement, not a test, so the suite leaves it out: `./scripts/test
/// --run-ignored only -E 'test(what_group_commit_gives_the_rail_proxy)' --no-capture`.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "a measurement (printed, not asserted); run it with --run-ignored only"]
async fn what_group_commit_gives_the_rail_proxy() {
    const CLIENTS: usize = 32;
    const CYCLES: usize = 15;
    let mut w = durable_world().await;
    let stub = w.stub("stub", &[]).await;
    let (batched, _batched) = batching_proxy(&w, &stub, &[("rail.proxy.pg.pool-max", "32")]);
    let port = port();
    let _single = w.proxy_process(
        port,
        &stub,
        &[("rail.batch.max", "1"), ("rail.proxy.pg.pool-max", "32")],
    );
    let single = format!("http://127.0.0.1:{port}");
    for round in 0..2 {
        for (name, proxy) in [("batch 16", &batched), ("batch 1", &single)] {
            let before = (
                batch_metrics(proxy).batches("admit").await,
                batch_metrics(proxy).batches("record").await,
            );
            let run = format!("m{round}-{}", name.replace(' ', ""));
            let (rate, latency) = submit_cycles(&w, proxy, &run, CLIENTS, CYCLES).await;
            let after = (
                batch_metrics(proxy).batches("admit").await,
                batch_metrics(proxy).batches("record").await,
            );
            let mean = |b: (f64, f64), a: (f64, f64)| {
                if a.0 > b.0 {
                    (a.1 - b.1) / (a.0 - b.0)
                } else {
                    1.0
                }
            };
            println!(
                "round {round}, {name}: {rate:.0} submissions/s, {latency:.2} ms mean; mean batch admit {:.1}, record {:.1}",
                mean(before.0, after.0),
                mean(before.1, after.1),
            );
        }
    }
}
