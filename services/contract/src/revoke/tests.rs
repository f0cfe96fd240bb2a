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

fn down() -> ClientError {
    ClientError::Transport {
        url: "http://x".into(),
        message: "connection refused".into(),
        connect: true,
        timeout: false,
    }
}

/// Answers per step; records every call.
#[derive(Default)]
struct Fake {
    calls: Mutex<Vec<String>>,
    lock: Option<ClientError>,
    fence: Option<ClientError>,
    rail: Option<ClientError>,
}

impl Fake {
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
    fn revoke_lock<'a>(
        &'a self,
        key: &'a str,
        request: &'a RevokeRequest,
    ) -> StepFuture<'a, Revocation> {
        let call = format!("L8 {key} expected={:?}", request.expected_token);
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
        self.answer(call, &self.lock, revocation)
    }
    fn advance_fence<'a>(&'a self, call: FenceCall<'a>) -> StepFuture<'a, FenceResponse> {
        let FenceCall {
            account_id,
            idempotency_key,
            request,
        } = call;
        let (fence, revocation_id) = (request.floor, request.revocation_id);
        let call =
            format!("fence {account_id} key={idempotency_key} floor={fence} id={revocation_id}");
        let account_id = account_id.to_owned();
        let fenced = FenceResponse {
            account_id,
            previous_fence: 3,
            fence,
            revocation_id,
        };
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
    ] {
        let fake = Fake {
            lock: Some(failure),
            ..Fake::default()
        };
        let report = run(&fake, &order(Some(7)), None).await;
        assert_eq!(report.outcome, outcome);
        assert_eq!(report.progress, None);
        if outcome == Outcome::Incomplete {
            assert!(matches!(report.lock, LockStep::Unavailable(_)));
        }
        assert_eq!(fake.calls().len(), 1, "only the lock server was asked");
    }
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
}
