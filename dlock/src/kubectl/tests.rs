use super::*;

fn condition(type_: &str, status: &str, reason: &str) -> Condition {
    Condition {
        type_: type_.into(),
        status: status.into(),
        reason: reason.into(),
        message: format!("{type_} is {status}"),
        last_transition_time: None,
        observed_generation: None,
    }
}

/// A status's conditions, as the operator reports them.
fn reported<const N: usize>(conditions: [Condition; N]) -> Reported {
    Reported::new(Some(1), conditions.into())
}

#[test]
fn durations_read_as_kubectl_writes_them() {
    assert_eq!(parse_duration("90s"), Ok(Duration::from_secs(90)));
    assert_eq!(parse_duration("2m"), Ok(Duration::from_secs(120)));
    assert_eq!(parse_duration("1m30s"), Ok(Duration::from_secs(90)));
    assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
    assert_eq!(parse_duration("45"), Ok(Duration::from_secs(45)));
    for bad in ["", "s", "10x", "1.5s", "-3s"] {
        assert!(parse_duration(bad).is_err(), "{bad}");
    }
}

#[test]
fn tables_have_upper_case_headers_and_aligned_columns() {
    let text = table(
        &["kind", "name", "message"],
        &[
            vec![
                "LockServer".into(),
                "lock-server".into(),
                "all 2 ready".into(),
            ],
            vec!["RailProxy".into(), "rp".into(), String::new()],
        ],
    );
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines[0], "KIND         NAME          MESSAGE");
    assert_eq!(lines[1], "LockServer   lock-server   all 2 ready");
    assert_eq!(lines[2], "RailProxy    rp            <none>");
}

#[test]
fn a_degraded_resource_explains_itself_with_the_degraded_reason() {
    let view = resource_view(
        "PayoutBatch",
        "b".into(),
        reported([
            condition("Ready", "True", "Completed"),
            condition("Degraded", "True", "RailAmbiguous"),
        ]),
    );
    assert_eq!(
        (view.ready.as_str(), view.degraded.as_str()),
        ("True", "True")
    );
    assert_eq!(view.reason, "RailAmbiguous");
    let view = resource_view(
        "LockServer",
        "l".into(),
        reported([condition("Ready", "True", "Available")]),
    );
    assert_eq!(
        (view.degraded.as_str(), view.reason.as_str()),
        ("False", "Available")
    );
    let view = resource_view("RailProxy", "r".into(), Reported::default());
    assert_eq!((view.ready.as_str(), view.reason.as_str()), ("Unknown", ""));
}

#[test]
fn revocation_names_and_steps() {
    assert_eq!(
        revocation_prefix("payout:Acct_17"),
        "revoke-payout-acct-17-"
    );
    let mut result = RevocationResult {
        request: "r".into(),
        outcome: "Incomplete".into(),
        revocation_id: Some("id".into()),
        revoked_token: Some(41),
        new_token_floor: Some(42),
        payment_fenced: true,
        rail_fenced: false,
        summary: Some("rail proxy unreachable".into()),
    };
    let first = revocation_steps(None, &result, "acct-17");
    assert_eq!(first.len(), 3, "{first:?}");
    assert!(first[0].contains("token 41") && first[0].contains("floor 42"));
    assert!(first[1].starts_with("payment resource"));
    assert!(first[2].starts_with("incomplete"));
    let before = result.clone();
    result.rail_fenced = true;
    result.outcome = "Complete".into();
    let next = revocation_steps(Some(&before), &result, "acct-17");
    assert_eq!(
        next,
        vec!["rail proxy: high-water mark of acct-17 advanced to 42".to_owned()]
    );
}

#[test]
fn a_batch_phase_follows_its_conditions_and_job() {
    let failed = JobView {
        name: "j".into(),
        state: "Failed".into(),
        active: 0,
        succeeded: 0,
        failed: 1,
        message: None,
    };
    assert_eq!(batch_phase(&Reported::default(), None), "Pending");
    assert_eq!(
        batch_phase(
            &reported([condition("Progressing", "True", "Executing")]),
            None
        ),
        "Running"
    );
    assert_eq!(
        batch_phase(&reported([condition("Ready", "True", "Completed")]), None),
        "Succeeded"
    );
    let degraded = reported([condition("Degraded", "True", "ExecutorFailed")]);
    assert_eq!(batch_phase(&degraded, Some(&failed)), "Failed");
    assert_eq!(batch_phase(&degraded, None), "Degraded");
}

#[test]
fn a_lock_shows_in_json_as_the_operator_mirrors_it() {
    let mut lock = Lock::new(
        "lock-server-payout-acct-17",
        LockSpec {
            key: "payout:acct-17".into(),
            lock_server: "lock-server".into(),
            account_id: "acct-17".into(),
        },
    );
    lock.status = Some(LockStatus {
        holder: Some("executor/w1".into()),
        token: Some(41),
        acquired_at: Some("2026-12-04T10:00:00Z".into()),
        expires_at: Some("2026-12-04T10:00:10Z".into()),
        ..LockStatus::default()
    });
    let view = serde_json::to_value(lock_view(&lock)).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        view,
        serde_json::json!({
            "name": "lock-server-payout-acct-17",
            "key": "payout:acct-17",
            "lockServer": "lock-server",
            "accountId": "acct-17",
            "holder": "executor/w1",
            "token": 41,
            "acquiredAt": "2026-12-04T10:00:00Z",
            "expiresAt": "2026-12-04T10:00:10Z",
        })
    );
}
