use std::collections::VecDeque;
use std::sync::Mutex;

use chrono::Utc;

use super::*;
use crate::error::ErrorBody;

const ID: &str = "7f9c0000-0000-4000-8000-000000000001";

fn id() -> Uuid {
    Uuid::parse_str(ID).unwrap_or_default()
}

fn api(status: u16, code: ErrorCode) -> ClientError {
    ClientError::Api {
        status,
        body: ErrorBody {
            code,
            message: "no".into(),
            retry_safe: false,
            retry_after_millis: None,
            details: None,
            trace_id: String::new(),
        },
    }
}

/// `503 OUTCOME_UNKNOWN`: the lock server sent the write to its store and heard nothing back.
fn unknown() -> ClientError {
    api(503, ErrorCode::OutcomeUnknown)
}

/// `503 NOT_LEADER`, retry-safe: nothing was sent to the store.
fn not_leader() -> ClientError {
    match api(503, ErrorCode::NotLeader) {
        ClientError::Api { status, mut body } => {
            body.retry_safe = true;
            ClientError::Api { status, body }
        }
        other => other,
    }
}

/// No answer after the request went out: a read timeout.
fn timed_out() -> ClientError {
    ClientError::Transport {
        url: "http://x".into(),
        message: "operation timed out".into(),
        connect: false,
        timeout: true,
    }
}

fn down() -> ClientError {
    ClientError::Transport {
        url: "http://x".into(),
        message: "connection refused".into(),
        connect: true,
        timeout: false,
    }
}

/// What L7 answers: the token holding the key, `None` for nobody, or a failure.
type Read = Result<Option<i64>, ClientError>;

/// Answers per step; records every call. L7 answers from `reads` in turn, then "held by 41";
/// L8 from `lock_answers` in turn (`None` is a success), then from `lock`.
#[derive(Default)]
struct Fake {
    calls: Mutex<Vec<String>>,
    reads: Mutex<VecDeque<Read>>,
    lock_answers: Mutex<VecDeque<Option<ClientError>>>,
    lock: Option<ClientError>,
    fence: Option<ClientError>,
    rail: Option<ClientError>,
}

impl Fake {
    /// L7 answers `reads` in turn; L8 answers `lock_answers` in turn.
    fn scripted(reads: Vec<Read>, lock_answers: Vec<Option<ClientError>>) -> Self {
        Self {
            reads: Mutex::new(reads.into()),
            lock_answers: Mutex::new(lock_answers.into()),
            ..Self::default()
        }
    }
    fn calls(&self) -> Vec<String> {
        self.calls.lock().map(|c| c.clone()).unwrap_or_default()
    }
    /// Records `call`, then answers with the step's configured failure, or else `ok`.
    fn answer<'a, T: Send + 'a>(
        &self,
        call: String,
        failure: &Option<ClientError>,
        ok: T,
    ) -> StepFuture<'a, T> {
        if let Ok(mut calls) = self.calls.lock() {
            calls.push(call);
        }
        let answer = failure.clone().map_or(Ok(ok), Err);
        Box::pin(async move { answer })
    }
}

impl RevokeSteps for Fake {
    fn read_lock<'a>(&'a self, key: &'a str) -> StepFuture<'a, LockInfo> {
        let read = self
            .reads
            .lock()
            .ok()
            .and_then(|mut r| r.pop_front())
            .unwrap_or(Ok(Some(41)));
        let (token, failure) = match read {
            Ok(token) => (token, None),
            Err(e) => (None, Some(e)),
        };
        let info = LockInfo {
            key: key.to_owned(),
            held: token.is_some(),
            owner_id: token.map(|_| "executor-7".to_owned()),
            fencing_token: token,
            ..LockInfo::default()
        };
        self.answer(format!("L7 {key}"), &failure, info)
    }
    fn revoke_lock<'a>(
        &'a self,
        key: &'a str,
        request: &'a RevokeRequest,
    ) -> StepFuture<'a, Revocation> {
        let call = format!("L8 {key} expected={:?}", request.expected_token);
        let failure = match self
            .lock_answers
            .lock()
            .ok()
            .and_then(|mut a| a.pop_front())
        {
            Some(scripted) => scripted,
            None => self.lock.clone(),
        };
        let revocation = Revocation {
            key: key.to_owned(),
            revoked_token: 41,
            revoked_owner_id: "executor-7".into(),
            new_token_floor: 42,
            revocation_id: id(),
            operator: request.operator.clone(),
            reason: request.reason.clone(),
            revoked_at: Utc::now(),
        };
        self.answer(call, &failure, revocation)
    }
    fn advance_fence<'a>(&'a self, call: FenceCall<'a>) -> StepFuture<'a, FenceResponse> {
        let FenceCall {
            account_id,
            idempotency_key,
            request,
        } = call;
        let call = format!(
            "fence {account_id} key={idempotency_key} floor={} id={}",
            request.floor, request.revocation_id
        );
        // The answer as the payment resource sends it (who made it included), read as the
        // client reads it.
        let fenced: FenceResponse = serde_json::from_value(serde_json::json!({
            "accountId": account_id,
            "previousFence": 3,
            "fence": request.floor,
            "revocationId": request.revocation_id,
            "operator": request.operator,
            "identity": "oncall",
        }))
        .unwrap_or_else(|e| panic!("a fence answer: {e}"));
        self.answer(call, &self.fence, fenced)
    }
    fn advance_high_water<'a>(
        &'a self,
        account_id: &'a str,
        request: &'a HighWaterRequest,
    ) -> StepFuture<'a, HighWater> {
        let call = format!(
            "high-water {account_id} floor={} id={:?}",
            request.floor, request.revocation_id
        );
        let raised = HighWater {
            account_id: account_id.to_owned(),
            previous_token: Some(3),
            highest_token: request.floor,
        };
        self.answer(call, &self.rail, raised)
    }
}

fn order(expected: Option<i64>) -> RevokeOrder {
    RevokeOrder::for_key(
        "payout:acct-17",
        "oncall",
        "worker wedged past lease",
        expected,
    )
    .unwrap_or_else(|e| panic!("{e}"))
}

/// The flow resumed from `progress` against steps that all answer; its report and the calls made.
async fn resume(progress: &Progress) -> (RevokeReport, Vec<String>) {
    let fake = Fake::default();
    let report = run(&fake, &order(None), Some(progress)).await;
    (report, fake.calls())
}

#[tokio::test]
async fn the_whole_flow_revokes_then_fences_both_points_with_a_stable_key() {
    let fake = Fake::default();
    let report = run(&fake, &order(Some(41)), None).await;
    assert_eq!(report.outcome, Outcome::Complete, "{report:?}");
    assert_eq!(
        fake.calls(),
        vec![
            "L7 payout:acct-17".to_owned(),
            "L8 payout:acct-17 expected=Some(41)".to_owned(),
            format!("fence acct-17 key=revoke-{ID} floor=42 id={ID}"),
            format!("high-water acct-17 floor=42 id=Some({ID})"),
        ]
    );
    let progress = report
        .progress
        .clone()
        .unwrap_or_else(|| panic!("no progress"));
    assert!(progress.is_complete());
    assert_eq!(progress.revoked_token, Some(41));
    assert_eq!(
        report.summary(),
        "revoked token 41, floor 42 at both fences"
    );
    assert!(
        report
            .lines()
            .last()
            .is_some_and(|l| l.starts_with("done:"))
    );
}

#[tokio::test]
async fn an_unanswered_fence_is_incomplete_and_the_resume_pushes_only_it() {
    let fake = Fake {
        rail: Some(api(503, ErrorCode::NotLeader)),
        ..Fake::default()
    };
    let report = run(&fake, &order(None), None).await;
    assert_eq!(report.outcome, Outcome::Incomplete);
    assert!(matches!(report.rail_high_water, FenceStep::Unavailable(_)));
    let progress = report.progress.unwrap_or_else(|| panic!("no progress"));
    assert!(progress.payment_fenced && !progress.rail_fenced);

    let (report, calls) = resume(&progress).await;
    assert_eq!(report.outcome, Outcome::Complete);
    assert_eq!(report.lock, LockStep::Resumed);
    assert_eq!(report.account_fence, FenceStep::AlreadyDone);
    assert_eq!(
        calls,
        [format!("high-water acct-17 floor=42 id=Some({ID})")]
    );
}

#[tokio::test]
async fn a_resumed_fence_reuses_the_recorded_floor_id_and_key() {
    let recorded = Progress {
        revocation_id: id(),
        new_token_floor: 99,
        revoked_token: None,
        payment_fenced: false,
        rail_fenced: true,
    };
    let (report, calls) = resume(&recorded).await;
    assert_eq!(report.outcome, Outcome::Complete);
    assert_eq!(
        calls,
        [format!("fence acct-17 key=revoke-{ID} floor=99 id={ID}")]
    );
}

#[tokio::test]
async fn a_4xx_fence_is_a_refusal_and_a_5xx_or_no_answer_is_retryable() {
    let fake = Fake {
        fence: Some(api(403, ErrorCode::Forbidden)),
        rail: Some(down()),
        ..Fake::default()
    };
    let report = run(&fake, &order(None), None).await;
    assert_eq!(report.outcome, Outcome::Refused);
    assert!(
        matches!(&report.account_fence, FenceStep::Refused(e) if e.status == Some(403)),
        "{report:?}"
    );
    assert!(matches!(report.rail_high_water, FenceStep::Unavailable(_)));
    assert!(
        report.summary().contains("refused at a fence"),
        "{}",
        report.summary()
    );
    assert_eq!(
        classify(&api(429, ErrorCode::LockContended)),
        Failure::Retryable
    );
    assert_eq!(classify(&api(500, ErrorCode::Internal)), Failure::Retryable);
    assert_eq!(classify(&api(409, ErrorCode::LockLost)), Failure::Refused);
    assert_eq!(classify(&down()), Failure::Retryable);
}

#[tokio::test]
async fn the_lock_servers_refusal_or_silence_fences_nothing() {
    for (failure, outcome) in [
        (api(409, ErrorCode::LockLost), Outcome::Refused),
        (down(), Outcome::Incomplete),
        // Retry-safe: the lock server sent nothing to its store. No read, no second L8.
        (not_leader(), Outcome::Incomplete),
    ] {
        let fake = Fake {
            lock: Some(failure),
            ..Fake::default()
        };
        let report = run(&fake, &order(Some(41)), None).await;
        assert_eq!(report.outcome, outcome);
        assert_eq!(report.progress, None);
        if outcome == Outcome::Incomplete {
            assert!(matches!(report.lock, LockStep::Unavailable(_)));
        }
        assert_eq!(
            fake.calls(),
            ["L7 payout:acct-17", "L8 payout:acct-17 expected=Some(41)"],
            "only the lock server was asked, once"
        );
    }
}

#[tokio::test]
async fn l8_names_the_grant_the_key_shows_and_any_other_is_refused_unsent() {
    // No token in the order: L8 carries the holder's.
    let fake = Fake::scripted(vec![Ok(Some(57))], vec![]);
    let report = run(&fake, &order(None), None).await;
    assert_eq!(report.outcome, Outcome::Complete);
    assert_eq!(fake.calls()[1], "L8 payout:acct-17 expected=Some(57)");

    for (read, expected, says) in [
        (Ok(Some(41)), Some(7), "held by token 41, not 7"),
        (Ok(None), Some(41), "nothing holds payout:acct-17"),
        (Ok(None), None, "nothing holds payout:acct-17"),
    ] {
        let fake = Fake::scripted(vec![read], vec![]);
        let report = run(&fake, &order(expected), None).await;
        assert_eq!(report.outcome, Outcome::Refused, "{report:?}");
        assert!(
            matches!(&report.lock, LockStep::Refused(e) if e.message.contains(says)),
            "{report:?}"
        );
        assert_eq!(fake.calls(), ["L7 payout:acct-17"], "no L8");
    }
    // The read failing sends nothing either, and says so: run again.
    let fake = Fake::scripted(vec![Err(down())], vec![]);
    let report = run(&fake, &order(None), None).await;
    assert_eq!(report.outcome, Outcome::Incomplete);
    assert!(
        matches!(&report.lock, LockStep::Unavailable(e) if e.message.starts_with("not sent")),
        "{report:?}"
    );
    assert_eq!(fake.calls(), ["L7 payout:acct-17"]);
}

/// L8's answer lost and the key read afterwards without the grant: the revocation took effect,
/// and the flow fences with the token after the revoked one, under an id of its own; never a
/// second L8, never a failure.
#[tokio::test]
async fn a_lost_l8_whose_grant_is_gone_goes_on_to_the_fences_with_the_token_after_it() {
    for (lost, now) in [(unknown(), None), (timed_out(), Some(60))] {
        let fake = Fake::scripted(vec![Ok(Some(41)), Ok(now)], vec![Some(lost)]);
        let report = run(&fake, &order(None), None).await;
        assert_eq!(report.outcome, Outcome::Complete, "{report:?}");
        let LockStep::Settled(settled) = &report.lock else {
            panic!("settled by the read: {report:?}");
        };
        assert_eq!((settled.revoked_token, settled.holder_token), (41, now));
        let progress = report
            .progress
            .clone()
            .unwrap_or_else(|| panic!("no floor"));
        assert_eq!(
            (progress.new_token_floor, progress.revoked_token),
            (42, Some(41))
        );
        let id = progress.revocation_id;
        assert_eq!(
            fake.calls(),
            [
                "L7 payout:acct-17".to_owned(),
                "L8 payout:acct-17 expected=Some(41)".to_owned(),
                "L7 payout:acct-17".to_owned(),
                format!("fence acct-17 key=revoke-{id} floor=42 id={id}"),
                format!("high-water acct-17 floor=42 id=Some({id})"),
            ]
        );
        let lines = report.lines().join("\n");
        assert!(
            lines.contains("was lost") && lines.contains("the revocation took effect"),
            "{lines}"
        );
    }
}

/// L8's answer lost while the key still shows the grant: nothing was revoked, and L8 is sent
/// again for that grant only; lost every time, the run ends retry-safe after `L8_SENDS_MAX`.
#[tokio::test]
async fn a_lost_l8_whose_grant_still_holds_is_sent_again_for_that_grant_only() {
    let fake = Fake::scripted(
        vec![Ok(Some(41)), Ok(Some(41))],
        vec![Some(unknown()), None],
    );
    let report = run(&fake, &order(None), None).await;
    assert_eq!(report.outcome, Outcome::Complete, "{report:?}");
    assert!(matches!(report.lock, LockStep::Revoked(_)));
    let l8 = "L8 payout:acct-17 expected=Some(41)";
    let calls = fake.calls();
    assert_eq!(
        calls[..4],
        ["L7 payout:acct-17", l8, "L7 payout:acct-17", l8]
    );
    assert_eq!(calls.len(), 6, "then both fences: {calls:?}");

    let fake = Fake {
        lock: Some(unknown()),
        ..Fake::default()
    };
    let report = run(&fake, &order(None), None).await;
    assert_eq!(report.outcome, Outcome::Incomplete, "{report:?}");
    assert!(
        matches!(&report.lock, LockStep::Unavailable(e) if e.message.contains("nothing was revoked")),
        "{report:?}"
    );
    let sent = fake.calls().iter().filter(|c| c.starts_with("L8")).count();
    assert_eq!(sent, L8_SENDS_MAX);
    assert_eq!(
        fake.calls().len(),
        2 * L8_SENDS_MAX + 1,
        "a read before each L8 and after the last"
    );
}

/// L8's answer lost and the key unreadable: the outcome is unknown, neither a failure nor a
/// second L8; the next run settles it by reading first and finishes either way.
#[tokio::test]
async fn a_lost_l8_with_the_key_unreadable_is_unknown_and_the_next_run_settles_it() {
    let fake = Fake::scripted(vec![Ok(Some(41)), Err(down())], vec![Some(unknown())]);
    let report = run(&fake, &order(None), None).await;
    assert_eq!(report.outcome, Outcome::Unknown, "{report:?}");
    assert_eq!(report.unsettled_token(), Some(41));
    assert_eq!(report.progress, None);
    assert_eq!(
        fake.calls(),
        [
            "L7 payout:acct-17",
            "L8 payout:acct-17 expected=Some(41)",
            "L7 payout:acct-17"
        ]
    );
    let summary = report.summary();
    assert!(
        summary.starts_with("outcome unknown") && summary.contains("GET /v1/locks/payout:acct-17"),
        "{summary}"
    );

    // The grant is gone when read again: fenced, no L8.
    let fake = Fake::scripted(vec![Ok(None)], vec![]);
    let report = settle_and_run(&fake, &order(None), 41).await;
    assert_eq!(report.outcome, Outcome::Complete, "{report:?}");
    assert!(matches!(report.lock, LockStep::Settled(_)));
    assert!(
        !fake.calls().iter().any(|c| c.starts_with("L8")),
        "{:?}",
        fake.calls()
    );

    // Still held by 41: L8 for 41 (and no other), then the fences.
    let fake = Fake::scripted(vec![Ok(Some(41))], vec![]);
    let report = settle_and_run(&fake, &order(None), 41).await;
    assert_eq!(report.outcome, Outcome::Complete, "{report:?}");
    assert!(matches!(report.lock, LockStep::Revoked(_)));
    assert_eq!(fake.calls()[1], "L8 payout:acct-17 expected=Some(41)");

    // Unreadable again: still unknown, still nothing sent.
    let fake = Fake::scripted(vec![Err(timed_out())], vec![]);
    let report = settle_and_run(&fake, &order(None), 41).await;
    assert_eq!(report.outcome, Outcome::Unknown);
    assert_eq!(fake.calls(), ["L7 payout:acct-17"]);
}

/// A key held at the token right after the one L8 was sent for got there without that
/// revocation (a revocation's floor lies between): refused, nothing fenced, since the floor
/// would fence that holder out.
#[tokio::test]
async fn a_lost_l8_with_the_key_held_at_the_next_token_is_refused_not_fenced() {
    let fake = Fake::scripted(vec![Ok(Some(41)), Ok(Some(42))], vec![Some(unknown())]);
    let report = run(&fake, &order(None), None).await;
    assert_eq!(report.outcome, Outcome::Refused, "{report:?}");
    assert_eq!(report.progress, None);
    assert!(
        matches!(&report.lock, LockStep::Refused(e) if e.message.contains("ended without this revocation")),
        "{report:?}"
    );
    assert_eq!(fake.calls().len(), 3, "{:?}", fake.calls());
}

#[tokio::test]
async fn an_order_the_contract_would_refuse_is_not_sent() {
    assert!(RevokeOrder::for_key("batch:payroll", "op", "long enough", None).is_err());
    assert!(RevokeOrder::for_key("payout:", "op", "long enough", None).is_err());
    assert!(RevokeOrder::for_key("payout:a", "op", "short", None).is_err());
    let fake = Fake::default();
    let bad = RevokeOrder {
        key: "payout:a/../x".into(),
        account_id: "a/../x".into(),
        ..order(None)
    };
    let report = run(&fake, &bad, None).await;
    assert_eq!(report.outcome, Outcome::Refused);
    assert!(fake.calls().is_empty());
}

#[test]
fn the_report_serializes_with_tagged_steps() {
    let report = RevokeReport {
        key: "payout:a".into(),
        account_id: "a".into(),
        outcome: Outcome::Incomplete,
        lock: LockStep::Resumed,
        progress: None,
        account_fence: FenceStep::AlreadyDone,
        rail_high_water: FenceStep::Unavailable(StepError {
            status: Some(503),
            code: None,
            message: "down".into(),
        }),
    };
    let json = serde_json::to_value(&report).unwrap_or_default();
    assert_eq!(json["lock"]["result"], "resumed");
    assert_eq!(json["railHighWater"]["result"], "unavailable");
    assert_eq!(json["railHighWater"]["status"], 503);
    assert_eq!(json["outcome"], "incomplete");

    let unknown = RevokeReport {
        outcome: Outcome::Unknown,
        lock: LockStep::Unknown(Unsettled {
            token: 41,
            lost: StepError::from(&unknown()),
            read: StepError::from(&down()),
        }),
        account_fence: FenceStep::Skipped,
        rail_high_water: FenceStep::Skipped,
        ..report
    };
    let json = serde_json::to_value(&unknown).unwrap_or_default();
    assert_eq!(json["lock"]["result"], "unknown");
    assert_eq!(json["lock"]["token"], 41);
    assert_eq!(json["lock"]["lost"]["code"], "OUTCOME_UNKNOWN");
    assert_eq!(json["outcome"], "unknown");
}
