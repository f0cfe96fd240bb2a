use super::*;

/// The mirror keeps the Lock of a released key while a revocation on it is unfinished: L8
/// releases the key at once, and the Lock holds the recorded floor the fence retry needs.
#[test]
fn a_lock_with_an_unfinished_revocation_is_kept() {
    let mut lock = crate::crd::Lock::new(
        "payout-acct-17-0a1b2c3d",
        crate::crd::LockSpec {
            key: "payout:acct-17".to_owned(),
            lock_server: "lock-server".to_owned(),
            account_id: "acct-17".to_owned(),
        },
    );
    assert!(!revocation_unfinished(&lock), "nothing asked");
    lock.metadata.annotations = Some(std::collections::BTreeMap::from([
        (
            "dlock.io/revoke-reason".to_owned(),
            "worker wedged".to_owned(),
        ),
        ("dlock.io/revoked-by".to_owned(), "oncall".to_owned()),
    ]));
    assert!(revocation_unfinished(&lock), "asked, not run yet");
    let mut result = crate::crd::RevocationResult {
        request: "oncall: worker wedged".to_owned(),
        outcome: "Incomplete".to_owned(),
        ..Default::default()
    };
    lock.status = Some(LockStatus {
        revocation: Some(result.clone()),
        ..LockStatus::default()
    });
    assert!(revocation_unfinished(&lock), "a fence is missing");
    result.outcome = "Complete".to_owned();
    lock.status = Some(LockStatus {
        revocation: Some(result),
        ..LockStatus::default()
    });
    assert!(!revocation_unfinished(&lock), "settled: the Lock may go");
}

const NOW: &str = "2026-12-02T17:00:00Z";

#[test]
fn a_truncated_list_sets_locks_mirrored_false_and_a_complete_one_flips_it_back() {
    let ready = Conditions::ready("3/3").render(&[], Some(1), NOW);
    assert_eq!(mirror_conditions(&ready, false, 3, Some(1), NOW), None);
    let truncated =
        mirror_conditions(&ready, true, 1000, Some(1), NOW).unwrap_or_else(|| panic!("no change"));
    assert_eq!(truncated.len(), 4);
    assert_eq!(truncated[3].type_, LOCKS_MIRRORED);
    assert_eq!(
        (truncated[3].status.as_str(), truncated[3].reason.as_str()),
        ("False", "Truncated")
    );
    assert_eq!(
        mirror_conditions(&truncated, true, 1000, Some(1), NOW),
        None
    );
    let complete = mirror_conditions(&truncated, false, 2, Some(1), "later")
        .unwrap_or_else(|| panic!("no change"));
    assert_eq!(complete[3].status, "True");
    assert_eq!(complete[3].last_transition_time.as_deref(), Some("later"));
    // The workloads' own status keeps the condition.
    let status = workload_status(
        Some(1),
        &complete,
        &Applied {
            deployments: Vec::new(),
            url: String::new(),
            auth_disabled: false,
        },
        NOW,
    );
    assert!(status.reported.find(LOCKS_MIRRORED).is_some());
    assert_eq!(status.reported.conditions.len(), 4);
}

/// `AuthenticationDisabled` is True while `spec.auth.mode` is none and flips to False, kept,
/// once authentication is back on; a workload that never turned it off has no such condition.
#[test]
fn authentication_disabled_is_raised_and_flips_back() {
    let applied = |auth_disabled| Applied {
        deployments: Vec::new(),
        url: String::new(),
        auth_disabled,
    };
    let on = workload_status(Some(1), &[], &applied(false), NOW);
    assert!(on.reported.find(AUTHENTICATION_DISABLED).is_none());
    let off = workload_status(Some(2), &on.reported.conditions, &applied(true), NOW);
    let disabled = |s: &WorkloadStatus| {
        s.reported
            .find(AUTHENTICATION_DISABLED)
            .map(|c| (c.status.clone(), c.reason.clone()))
    };
    assert_eq!(
        disabled(&off),
        Some(("True".to_owned(), "AuthModeNone".to_owned()))
    );
    assert_eq!(off.reported.conditions.len(), 4);
    let back = workload_status(Some(3), &off.reported.conditions, &applied(false), "later");
    assert_eq!(
        disabled(&back),
        Some(("False".to_owned(), "TokenReview".to_owned()))
    );
    assert_eq!(
        back.reported.conditions.len(),
        4,
        "kept once, never duplicated"
    );
}
