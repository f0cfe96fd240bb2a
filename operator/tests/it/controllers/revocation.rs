//! The LockRevocation controller: which fences a revocation pushes, when it is refused without a
//! call, an unfinished one completed after the lock is gone, and one whose L8 has no known
//! outcome requeued as such and completed once a read settles it.

use super::*;

/// With several PaymentResources in the namespace the operator cannot tell which holds the
/// account: the revocation is refused before anything is sent, and says to name one.
#[tokio::test]
async fn a_revocation_with_several_payment_resources_is_refused_without_a_call() {
    let (services, ctx, mut api) = world(FakeServices::default());
    let lock = fixtures::revoke_asked(fixtures::lock());
    let reconcile = spawn_reconcile(reconcile_lock, lock, ctx);
    answer_targets(&mut api, &["pay-a", "pay-b"], &["rail"]).await;
    let call = api.next().await;
    assert_refused(
        &call.body["status"]["revocation"],
        "2 PaymentResources in the namespace (pay-a, pay-b)",
    );
    call.answer(&fixtures::lock());
    api.next().await.echo();
    ended_without_a_service_call(reconcile, api, &services).await;
}

/// The fence targets are the namespace's own objects, whatever their names.
#[tokio::test]
async fn a_revocation_fences_the_namespaces_own_payment_resource_and_rail_proxy() {
    let (services, ctx, mut api) = world(FakeServices::default());
    let lock = fixtures::revoke_asked(fixtures::lock());
    let reconcile = spawn_reconcile(reconcile_lock, lock, ctx);
    answer_targets(&mut api, &["payments-eu"], &["rail-sepa"]).await;
    let call = api.next().await;
    assert_eq!(call.body["status"]["revocation"]["outcome"], "Complete");
    call.answer(&fixtures::lock());
    api.next().await.echo();
    reconcile.await.unwrap().unwrap();
    let calls: Vec<String> = services.calls().into_iter().map(|c| c.0).collect();
    // calls[0] to [2] are the lock server's: who holds the key (the controller's read, then the
    // flow's), then L8.
    assert!(
        calls[3].starts_with("POST http://payments-eu.default.svc:8080/v1/accounts/acct-17/fence"),
        "{calls:?}"
    );
    assert_eq!(
        calls[4],
        "POST http://rail-sepa.default.svc:8080/v1/rail/high-water/acct-17"
    );
}

/// A LockRevocation whose fences are not both done outlives the lock: L8 released the key (so the
/// mirror no longer lists it), nothing deletes the LockRevocation, and the retry pushes only the
/// missing fence with the recorded floor and revocation id, never L8 again.
#[tokio::test]
async fn an_unfinished_lock_revocation_completes_after_the_lock_is_gone() {
    use dlock_operator::crd::{
        LockRevocation, LockRevocationSpec, LockRevocationStatus, RevocationResult,
    };
    let (services, ctx, mut api) = world(FakeServices::default());
    let reason = "worker wedged past its lease";
    let object = LockRevocation {
        metadata: fixtures::meta("revoke-acct-17", "uid-revocation"),
        spec: LockRevocationSpec {
            key: "payout:acct-17".to_owned(),
            account_id: "acct-17".to_owned(),
            reason: reason.to_owned(),
            revoked_by: "oncall".to_owned(),
            expected_token: Some(41),
            lock_server: None,
            payment_resource: Some("payment-resource".to_owned()),
            rail_proxy: Some("rail-proxy".to_owned()),
        },
        status: Some(LockRevocationStatus {
            result: Some(RevocationResult {
                request: format!("oncall: {reason}"),
                outcome: "Incomplete".to_owned(),
                revocation_id: Some(REVOCATION_ID.to_owned()),
                revoked_token: Some(41),
                new_token_floor: Some(42),
                payment_fenced: true,
                rail_fenced: false,
                summary: None,
            }),
            ..LockRevocationStatus::default()
        }),
    };
    let reconcile = spawn_reconcile(reconcile_lock_revocation, object.clone(), ctx);
    // The targets are looked up (the named ones must exist); the lock itself is not (it is gone).
    answer_fence_targets(&mut api).await;
    let call = api
        .expect_apply(&format!("{DLOCK}/lockrevocations/revoke-acct-17/status"))
        .await;
    let result = &call.body["status"]["result"];
    assert_eq!(result["outcome"], "Complete");
    assert_eq!(
        (&result["newTokenFloor"], &result["revocationId"]),
        (&json!(42), &json!(REVOCATION_ID))
    );
    assert_eq!(
        (&result["paymentFenced"], &result["railFenced"]),
        (&json!(true), &json!(true))
    );
    call.answer(&object);
    api.event("Revoked", None).await;
    reconcile.await.unwrap().unwrap();
    // No DELETE of the LockRevocation, ever: the API server saw every call above.
    api.done().await;
    let calls = services.calls();
    assert_eq!(calls.len(), 1, "{calls:?}");
    assert_eq!(
        calls[0].0,
        "POST http://rail-proxy.default.svc:8080/v1/rail/high-water/acct-17"
    );
    assert_eq!(calls[0].1["floor"], 42);
    assert_eq!(calls[0].1["revocationId"], REVOCATION_ID);
}

/// L8's answer lost and the key unreadable afterwards: the LockRevocation is recorded as
/// OutcomeUnknown (Progressing, reason OutcomeUnknown; never Refused or Degraded) and requeued.
/// The retry reads the key before anything else; the grant gone, the revocation took effect and
/// completes with the floor after the revoked token, with no second L8.
#[tokio::test]
async fn a_lock_revocation_whose_l8_outcome_is_unknown_is_requeued_then_completes() {
    use dlock_operator::crd::{LockRevocation, LockRevocationSpec, LockRevocationStatus};
    let (services, ctx, mut api) = world(FakeServices {
        lock_down: true,
        reads_ok: Some(1),
        ..FakeServices::default()
    });
    let object = LockRevocation {
        metadata: fixtures::meta("revoke-acct-17", "uid-revocation"),
        spec: LockRevocationSpec {
            key: "payout:acct-17".to_owned(),
            account_id: "acct-17".to_owned(),
            reason: "worker wedged past its lease".to_owned(),
            revoked_by: "oncall".to_owned(),
            expected_token: Some(41),
            lock_server: None,
            payment_resource: None,
            rail_proxy: None,
        },
        status: None,
    };
    let path = format!("{DLOCK}/lockrevocations/revoke-acct-17/status");
    let reconcile = spawn_reconcile(reconcile_lock_revocation, object.clone(), ctx);
    answer_fence_targets(&mut api).await;
    let call = api.expect_apply(&path).await;
    let result = call.body["status"]["result"].clone();
    assert_outcome_unknown(&result, 41);
    assert!(
        result["summary"]
            .as_str()
            .unwrap()
            .contains("GET /v1/locks/payout:acct-17"),
        "says what to read: {result}"
    );
    let reasons: Vec<(Value, Value)> = call
        .conditions()
        .into_iter()
        .map(|c| (c["type"].clone(), c["status"].clone()))
        .collect();
    assert!(
        reasons.contains(&(json!("Progressing"), json!("True")))
            && reasons.contains(&(json!("Degraded"), json!("False"))),
        "{reasons:?}"
    );
    assert!(
        call.conditions()
            .iter()
            .any(|c| c["reason"] == "OutcomeUnknown"),
        "{:?}",
        call.conditions()
    );
    call.answer(&object);
    api.event("RevocationOutcomeUnknown", Some("Warning")).await;
    let error = reconcile.await.unwrap().unwrap_err();
    assert!(!error.is_permanent(), "requeued with back-off: {error}");
    let calls: Vec<String> = services.calls().into_iter().map(|c| c.0).collect();
    assert_eq!(calls.len(), 3, "read, L8, read; no fence: {calls:?}");

    // The retry: the key reads as not held (the lost L8 ended the grant).
    let (services, ctx, mut api) = world(FakeServices {
        not_held: true,
        ..FakeServices::default()
    });
    let mut retry = object.clone();
    retry.status = Some(LockRevocationStatus {
        result: Some(serde_json::from_value(result).unwrap()),
        ..LockRevocationStatus::default()
    });
    let reconcile = spawn_reconcile(reconcile_lock_revocation, retry, ctx);
    answer_fence_targets(&mut api).await;
    let call = api.expect_apply(&path).await;
    let result = &call.body["status"]["result"];
    assert_eq!(result["outcome"], "Complete", "{result}");
    assert_eq!(
        (&result["revokedToken"], &result["newTokenFloor"]),
        (&json!(41), &json!(42))
    );
    call.answer(&object);
    api.event("Revoked", Some("Normal")).await;
    reconcile.await.unwrap().unwrap();
    api.done().await;
    let calls: Vec<String> = services.calls().into_iter().map(|c| c.0).collect();
    assert_eq!(calls.len(), 3, "{calls:?}");
    assert!(calls[0].starts_with("GET "), "{calls:?}");
    assert!(
        !calls.iter().any(|c| c.ends_with("/revoke")),
        "no second L8: {calls:?}"
    );
}
