//! The LockRevocation controller: which fences a revocation pushes, when it is refused without a
//! call, and an unfinished one completed after the lock is gone.

use super::*;

/// With several PaymentResources in the namespace the operator cannot tell which holds the
/// account: the revocation is refused before anything is sent, and says to name one.
#[tokio::test]
async fn a_revocation_with_several_payment_resources_is_refused_without_a_call() {
    let (services, ctx, mut api) = world(FakeServices::default());
    let lock = fixtures::revoke_asked(fixtures::lock());
    let reconcile = tokio::spawn(controller::lock::reconcile_lock(Arc::new(lock), ctx));
    reply_names(api.next().await, "lockservers", &["lock-server"]);
    reply_names(api.next().await, "paymentresources", &["pay-a", "pay-b"]);
    reply_names(api.next().await, "railproxies", &["rail"]);
    let call = api.next().await;
    let revocation = &call.body["status"]["revocation"];
    assert_eq!(revocation["outcome"], "Refused");
    assert!(
        revocation["summary"]
            .as_str()
            .unwrap()
            .contains("2 PaymentResources in the namespace (pay-a, pay-b)"),
        "{revocation}"
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
    let reconcile = tokio::spawn(controller::lock::reconcile_lock(Arc::new(lock), ctx));
    reply_names(api.next().await, "lockservers", &["lock-server"]);
    reply_names(api.next().await, "paymentresources", &["payments-eu"]);
    reply_names(api.next().await, "railproxies", &["rail-sepa"]);
    let call = api.next().await;
    assert_eq!(call.body["status"]["revocation"]["outcome"], "Complete");
    call.answer(&fixtures::lock());
    api.next().await.echo();
    reconcile.await.unwrap().unwrap();
    let calls: Vec<String> = services.calls().into_iter().map(|c| c.0).collect();
    // calls[0] and [1] are the lock server's: who holds the key, then L8.
    assert!(
        calls[2].starts_with("POST http://payments-eu.default.svc:8080/v1/accounts/acct-17/fence"),
        "{calls:?}"
    );
    assert_eq!(
        calls[3],
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
    let reconcile = tokio::spawn(controller::lock::reconcile_lock_revocation(
        Arc::new(object.clone()),
        ctx,
    ));
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
