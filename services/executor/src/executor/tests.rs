use super::*;

#[test]
fn the_lock_ttl_covers_a_submit_that_waits_the_whole_read_timeout() {
    for read_ms in [100_u64, 8_000, 14_000, 120_000] {
        let ttl = lock_ttl_ms_for(Duration::from_millis(read_ms), 0.30);
        let deadline_ms = ttl as f64 * 0.70;
        let submit_ends_ms = (read_ms + 2_000) as f64;
        assert!(
            deadline_ms >= submit_ends_ms + 1_000.0,
            "read {read_ms} ms: ttl {ttl} ms leaves the post no time"
        );
        assert!(ttl >= 10_000);
    }
    assert_eq!(lock_ttl_ms_for(Duration::from_millis(8_000), 0.30), 15_715);
    // Two thirds of the session (what a heartbeat every third leaves) cover the lock.
    for lock in [10_000_i64, 15_715, 24_286] {
        assert!(session_ttl_ms_for(lock) * 2 / 3 >= lock, "{lock}");
    }
    assert_eq!(session_ttl_ms_for(1_000), 15_000);
    assert_eq!(session_ttl_ms_for(i64::MAX), i64::MAX);
    // Nonsense never panics.
    assert_eq!(lock_ttl_ms_for(Duration::MAX, 0.30), i64::MAX);
    assert!(lock_ttl_ms_for(Duration::ZERO, 1.5) >= 10_000);
}

fn api(status: u16, code: ErrorCode) -> ClientError {
    ClientError::Api {
        status,
        body: dlock_contract::ErrorBody {
            code,
            message: "test".into(),
            retry_safe: false,
            retry_after_millis: None,
            details: None,
            trace_id: String::new(),
        },
    }
}

#[test]
fn each_refusal_ends_the_cycle_as_the_table_says() {
    use CycleOutcome as O;
    use ErrorCode as C;
    use Step::*;
    const EVERY: &[Step] = &[Acquire, Claim, Submit, Post];
    // The lock server's steps and the payment resource's, whose backend may refuse a write.
    const NOT_LEADER: &[Step] = &[Acquire, Claim, Post];
    // The steps that present a fencing token and write paydb.
    const ON_PAYDB: &[Step] = &[Claim, Submit, Post];
    let transport = ClientError::Transport {
        url: "http://x".into(),
        message: "reset".into(),
        connect: false,
        timeout: true,
    };
    // Answers that end a cycle alike at every step that can get them.
    let alike = [
        (EVERY, transport, O::Unavailable),
        (NOT_LEADER, api(503, C::NotLeader), O::Unavailable),
        (ON_PAYDB, api(409, C::FencedOut), O::FencedOut),
        (ON_PAYDB, api(503, C::RecoveryRequired), O::RecoveryRequired),
    ];
    // The answers of one step's service.
    let table: Vec<(Step, ClientError, CycleOutcome)> = vec![
        (Acquire, api(409, C::LockContended), O::Contended),
        (Acquire, api(429, C::ContentionExceeded), O::Contended),
        (Claim, api(422, C::InsufficientFunds), O::Settled),
        (Claim, api(409, C::PayoutNotClaimable), O::Pending),
        (Submit, api(502, C::RailAmbiguous), O::Ambiguous),
        (Submit, api(422, C::ValidationFailed), O::Settled),
        (Submit, api(400, C::ValidationFailed), O::Unavailable),
        (Submit, api(409, C::DuplicateSubmission), O::Pending),
        (Submit, api(503, C::RailUnavailable), O::Unavailable),
        (Post, api(409, C::PayoutNotClaimable), O::Pending),
        (Post, api(422, C::InsufficientFunds), O::Unavailable),
    ];
    let alike = alike
        .iter()
        .flat_map(|(steps, e, want)| steps.iter().map(move |step| (*step, e.clone(), *want)));
    for (step, e, want) in table.into_iter().chain(alike) {
        assert_eq!(outcome_of(step, &e), want, "{step:?} answered {e}");
    }
}

#[test]
fn a_paydb_waiting_for_its_recovery_is_retried_after_a_growing_capped_back_off() {
    let waits: Vec<Duration> = (1..=12).map(recovery_backoff).collect();
    assert_eq!(waits[0], RECOVERY_BACKOFF_FIRST);
    for pair in waits.windows(2) {
        assert!(pair[1] >= pair[0], "{waits:?}");
    }
    assert_eq!(waits[11], RECOVERY_BACKOFF_MAX);
    assert_eq!(recovery_backoff(0), RECOVERY_BACKOFF_FIRST);
    assert_eq!(recovery_backoff(u32::MAX), RECOVERY_BACKOFF_MAX);
    // Far slower than the 20 to 50 ms an unavailable cycle waits: 10 refused cycles take over
    // half a minute, not half a second.
    let ten: Duration = (1..=10).map(recovery_backoff).sum();
    assert!(ten >= Duration::from_secs(30), "{ten:?}");
}

#[test]
fn the_report_names_the_payouts_paydb_refused_and_the_command_that_ends_it() {
    let id = Uuid::nil();
    let report = Report {
        payouts: 1,
        recovery_required: vec![id],
        ..Report::default()
    };
    let table = report.table();
    assert!(
        table.contains("RECOVERY_REQUIRED")
            && table.contains("dlock recover paydb-epoch")
            && table.contains(&id.to_string()),
        "{table}"
    );
    assert!(!Report::default().table().contains("RECOVERY_REQUIRED"));
}

/// `execute` runs on a thread of its own, yet dropping its future stops the run there: the lock
/// server here takes the run's first request (the session's) and never answers it, and the
/// connection must close when the caller drops the future, well before the client's own read
/// timeout ([`dlock_contract::client::WRITE_TIMEOUT`]) would close it.
#[tokio::test]
async fn dropping_execute_stops_the_run_on_its_own_thread() {
    use tokio::io::AsyncReadExt;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let url = format!(
        "http://{}",
        listener.local_addr().unwrap_or_else(|e| panic!("{e}"))
    );
    let batch = crate::manifest::parse(
        "apiVersion: dlock.io/v1alpha1\nkind: PayoutBatch\nmetadata:\n  name: b\nspec:\n  \
         payouts:\n    - key: p-1\n      accountId: acct-1\n      amountMinor: 100\n      \
         currency: EUR\n      beneficiaryRef: ben-1\n",
    )
    .unwrap_or_else(|e| panic!("{e:#}"));
    let endpoints = Endpoints {
        lock_server: url.clone(),
        payment_resource: url.clone(),
        rail_proxy: url,
    };
    let run = tokio::spawn(async move { execute(&batch, &endpoints, RunOptions::default()).await });
    // The run is under way: its session's request reached the lock server.
    let (mut socket, _) = listener.accept().await.unwrap_or_else(|e| panic!("{e}"));
    run.abort();
    let closed = tokio::time::timeout(dlock_contract::client::WRITE_TIMEOUT / 2, async {
        let mut buf = [0u8; 4096];
        while socket.read(&mut buf).await.unwrap_or(0) > 0 {}
    })
    .await;
    assert!(
        closed.is_ok(),
        "the connection stayed open after the caller dropped execute's future"
    );
}
