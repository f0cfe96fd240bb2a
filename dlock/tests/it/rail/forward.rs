//! Forward once (docs/contract.md#rail-step-3, #rail-step-4): the intent commits before anything
//! reaches the rail, a forward is never repeated, whatever the proxy, the database or the rail
//! does meanwhile (killed, stopped, down, hostile, redirecting).

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn paydb_down_before_the_intent_commits_is_rail_unavailable_and_nothing_reaches_the_rail() {
    let (mut w, stub, proxy) = RailWorld::with_proxy("acct-b").await;
    let payout = w.claimed("acct-b", 500, 7).await;
    w.pg_mut().kill();
    let (status, body) = submit(&proxy, "acct-b", payout, 500, "7").await;
    assert_eq!(status, 503, "{body}");
    assert_envelope("paydb down", status, &body, "RAIL_UNAVAILABLE");
    assert!(
        statement(&stub, payout).await.is_empty(),
        "nothing was presented to the rail"
    );
    w.pg_mut().start_again().unwrap_or_else(|e| panic!("{e:#}"));
    // Retry-safe: once paydb is back, the same request goes through, once.
    let (status, body) = eventually("the proxy reconnects", Duration::from_secs(20), || async {
        let (status, body) = submit(&proxy, "acct-b", payout, 500, "7").await;
        (status != 503).then_some((status, body))
    })
    .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(statement(&stub, payout).await.len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_proxy_killed_mid_forward_leaves_the_payout_ambiguous_and_never_forwards_again() {
    let (w, restartable, mut proxy) = RailWorld::with_restartable_proxy(&[]).await;
    let (url, stub) = (&restartable.url, &restartable.stub);
    w.account("acct-c", 10_000).await;
    let payout = w.claimed("acct-c", 700, 3).await;
    let client = dlock_contract::client::http_client().unwrap_or_else(|e| panic!("{e}"));
    let in_flight = tokio::spawn(submission(&client, url, "acct-c", payout, 700, "3").send());
    // Wait until the intent is committed and the forward is on its way, then kill the proxy.
    w.intent_committed(payout, 3).await;
    proxy.kill();
    let answer = in_flight.await.unwrap_or_else(|e| panic!("{e}"));
    assert!(answer.is_err(), "the caller got no answer: {answer:?}");
    assert_eq!(w.state(payout).await, "SUBMITTING");
    // After a restart the unresolved intent is declared ambiguous, never re-forwarded.
    let _proxy = w.restart(&restartable);
    w.quarantined(payout, 3, "acct-c").await;
    // The identical request is answered from the timed-out attempt; another token is a duplicate.
    let (status, body) = submit(url, "acct-c", payout, 700, "3").await;
    assert_eq!(status, 409);
    assert_envelope("replay after restart", status, &body, "RAIL_AMBIGUOUS");
    assert_eq!(body["details"]["outcome"], "TIMEOUT");
    let (status, body) = submit(url, "acct-c", payout, 700, "4").await;
    assert_eq!(status, 409);
    assert_envelope("after restart", status, &body, "DUPLICATE_SUBMISSION");
    // The rail may have taken the one attempt; it never sees a second.
    let transfers = statement(stub, payout).await;
    assert!(transfers.len() <= 1, "{transfers:?}");
}

/// A rollout stops a proxy with SIGTERM while a forward is in flight and its caller has already
/// hung up (a client timeout, or an executor killed in the same rollout): the proxy waits for the
/// rail's answer and records it before it exits, so the payout is RAIL_ACKED, not left SUBMITTING
/// to be timed out as RAIL_AMBIGUOUS.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_proxy_stopped_with_sigterm_records_the_forward_whose_caller_hung_up() {
    let (w, stub) = RailWorld::with_stub("stub", &[("rail.stub.latency-ms", "2000")]).await;
    let port = port();
    let url = format!("http://127.0.0.1:{port}");
    let mut proxy = w.proxy_process(port, &stub, &[("rail.proxy.read-timeout-ms", "6000")]);
    w.account("acct-t", 10_000).await;
    let payout = w.claimed("acct-t", 700, 3).await;
    // The caller gives up long before the rail answers, and is gone when the proxy is stopped.
    let client = dlock_contract::client::http_client().unwrap_or_else(|e| panic!("{e}"));
    let answer = submission(&client, &url, "acct-t", payout, 700, "3")
        .timeout(Duration::from_millis(300))
        .send()
        .await;
    assert!(
        answer.as_ref().is_err_and(reqwest::Error::is_timeout),
        "the caller timed out: {answer:?}"
    );
    w.intent_committed(payout, 3).await;
    // Positive control: the rail has not answered yet, so the answer is still to be recorded.
    assert_eq!(w.state(payout).await, "SUBMITTING");
    assert!(statement(&stub, payout).await.is_empty());
    proxy
        .signal(dlock_devstack::Signal::SIGTERM)
        .unwrap_or_else(|e| panic!("{e}"));
    let exit = proxy.wait_exit(Duration::from_secs(15));
    assert!(
        exit.is_some_and(|status| status.success()),
        "the proxy exits cleanly after draining: {exit:?}"
    );
    assert_eq!(w.submissions(payout).await, vec![("ACKED".to_owned(), 3)]);
    assert_eq!(w.state(payout).await, "RAIL_ACKED");
    assert_eq!(statement(&stub, payout).await.len(), 1);
}

/// A hostile rail (failures 0.3, every repeat accepted again, latency around the read timeout)
/// under many concurrent submissions, retries and stale tokens.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_hostile_rail_never_sees_two_transfers_for_one_payout() {
    let hostile = [
        ("rail.stub.failure-rate", "0.3"),
        ("rail.stub.duplicate-ack-rate", "1.0"),
        ("rail.stub.latency-ms", "150"),
        ("rail.stub.latency-jitter-ms", "200"),
        ("rail.stub.hang-ms", "1000"),
    ];
    let (mut w, stub) = RailWorld::with_stub("hostile", &hostile).await;
    let settings = [("rail.proxy.read-timeout-ms", "250")];
    let proxies = [
        w.proxy(&stub, &settings).await,
        w.proxy(&stub, &settings).await,
    ];
    const ACCOUNTS: usize = 10;
    const PER_ACCOUNT: usize = 12;
    // Accounts run in parallel; within an account each payout is one lock cycle: a claim with a
    // fresh token, then three concurrent submits with it (a retrying worker) and one with the
    // previous cycle's token (a stale worker), spread over both replicas.
    let world = Arc::new(w);
    let mut accounts = Vec::new();
    for a in 0..ACCOUNTS {
        let account = format!("hostile-{a}");
        world.account(&account, 1_000_000).await;
        let (world, proxies) = (world.clone(), proxies.clone());
        accounts.push(tokio::spawn(async move {
            let mut cycles = Vec::new();
            for i in 0..PER_ACCOUNT {
                let token = 100 + 2 * i as i64;
                let amount = 100 + i as i64;
                let payout = world.claimed(&account, amount, token).await;
                let mut attempts = Vec::new();
                for attempt in 0..4 {
                    let proxy = proxies[(i + attempt) % 2].clone();
                    let account = account.clone();
                    let presented = if attempt == 3 { token - 2 } else { token };
                    attempts.push(tokio::spawn(async move {
                        submit(&proxy, &account, payout, amount, &presented.to_string()).await
                    }));
                }
                let mut statuses = Vec::new();
                for attempt in attempts {
                    let (status, body) = attempt.await.unwrap_or_else(|e| panic!("{e}"));
                    assert!(
                        [200, 409, 422].contains(&status),
                        "unexpected {status} for {payout}: {body}"
                    );
                    // Identical retries replay one answer: every 200 names the same attempt.
                    statuses.push((status, body["submissionId"].as_str().map(str::to_owned)));
                }
                cycles.push((payout, statuses));
            }
            cycles
        }));
    }
    let mut answers: HashMap<Uuid, Vec<(u16, Option<String>)>> = HashMap::new();
    for task in accounts {
        for (payout, statuses) in task.await.unwrap_or_else(|e| panic!("{e}")) {
            answers.insert(payout, statuses);
        }
    }
    let w = world;
    let payouts: Vec<Uuid> = answers.keys().copied().collect();
    assert_eq!(payouts.len(), ACCOUNTS * PER_ACCOUNT);
    let mut acked = 0;
    let mut ambiguous = 0;
    for payout in &payouts {
        let transfers = statement(&stub, *payout).await;
        assert!(
            transfers.len() <= 1,
            "payout {payout} was paid {} times",
            transfers.len()
        );
        let presented: Vec<(String, i64)> = w
            .submissions(*payout)
            .await
            .into_iter()
            .filter(|(o, _)| o != "FENCED")
            .collect();
        assert_eq!(
            presented.len(),
            1,
            "{payout}: one presented attempt, got {presented:?}"
        );
        let state = w.state(*payout).await;
        let expected = match presented[0].0.as_str() {
            "ACKED" => "RAIL_ACKED",
            "TIMEOUT" => "RAIL_AMBIGUOUS",
            "REJECTED" => "FAILED",
            other => panic!("{payout}: outcome {other}"),
        };
        assert_eq!(
            state, expected,
            "{payout}: state matches the proxy's record"
        );
        if state == "RAIL_ACKED" {
            acked += 1;
            assert_eq!(
                transfers.len(),
                1,
                "{payout}: an ACKED payout is on the statement"
            );
        }
        if state == "RAIL_AMBIGUOUS" {
            ambiguous += 1;
        }
        let acked_ids: std::collections::HashSet<_> = answers[payout]
            .iter()
            .filter(|(s, _)| *s == 200)
            .map(|(_, id)| id.clone())
            .collect();
        assert!(
            acked_ids.len() <= 1,
            "{payout}: callers were told ACKED for {acked_ids:?}"
        );
    }
    assert!(
        acked > 0 && ambiguous > 0,
        "the run saw both outcomes: {acked} acked, {ambiguous} ambiguous"
    );
}

/// docs/contract.md#rail-step-4, forward once: a rail (or a gateway in front of it) that takes the
/// transfer and answers `307` must not see the transfer again. Following the redirect re-sends the
/// POST body, and a rail that takes repeats (duplicate-ack rate 1) would pay it once per hop.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_rail_that_redirects_after_taking_a_transfer_is_ambiguous_and_paid_once() {
    let redirecting = [
        ("rail.stub.redirect-rate", "1.0"),
        ("rail.stub.duplicate-ack-rate", "1.0"),
    ];
    let (mut w, stub) = RailWorld::with_stub("redirecting", &redirecting).await;
    let proxy = w.proxy(&stub, &[]).await;
    w.account("redirected", 10_000).await;
    let (payout, status, body) = w.submit_claimed(&proxy, "redirected", 700, 5).await;
    assert_envelope(
        "submit to a redirecting rail",
        status,
        &body,
        "RAIL_AMBIGUOUS",
    );
    assert_eq!(status, 409, "{body}");
    assert_eq!(w.state(payout).await, "RAIL_AMBIGUOUS");
    assert_eq!(
        w.submissions(payout).await,
        vec![("TIMEOUT".to_owned(), 5)],
        "one presented attempt, recorded as an unknown outcome"
    );
    let transfers = statement(&stub, payout).await;
    assert_eq!(
        transfers.len(),
        1,
        "the rail took the transfer once and was never asked again: {transfers:?}"
    );
}
