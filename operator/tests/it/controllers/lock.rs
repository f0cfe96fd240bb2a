//! The Lock controller: the revoke annotations run the revocation once per value (an L8 without a
//! known outcome settled by reading the key, refused without a call for a key nobody holds or
//! that names no account), and a mirrored Lock gets Ready.

use super::*;

/// Reconciles `lock` with the Lock controller, answers the fixtures' fence targets, and returns
/// the reconcile and the call that follows (the status apply), unanswered.
async fn revoke(
    lock: dlock_operator::crd::Lock,
    ctx: Arc<Context>,
    api: &mut ApiServerVerifier,
) -> (
    tokio::task::JoinHandle<controller::Result<kube::runtime::controller::Action>>,
    Call,
) {
    let reconcile = spawn_reconcile(reconcile_lock, lock, ctx);
    answer_fence_targets(api).await;
    (reconcile, api.next().await)
}

/// `kubectl annotate lock NAME dlock.io/revoke-reason=… dlock.io/revoked-by=…`: the lock server
/// revokes the key's live grant (read from it when the request is handled, not the mirror's
/// older token), both enforcement points get the new floor with the revocation id and the
/// operator's name, the result lands in status and an Event; the same annotation value never runs
/// again.
#[tokio::test]
async fn the_revoke_annotations_run_the_revocation_once_per_value() {
    // The mirror shows token 41; the key has changed hands since, to token 57.
    let (services, ctx, mut api) = world(FakeServices {
        live_token: Some(57),
        ..FakeServices::default()
    });
    let reason = "worker wedged past its lease";
    let lock = fixtures::with_annotations(
        fixtures::lock(),
        &[
            ("dlock.io/revoke-reason", reason),
            ("dlock.io/revoked-by", "oncall-ana"),
        ],
    );
    let reconcile = spawn_reconcile(reconcile_lock, lock.clone(), ctx.clone());
    answer_fence_targets(&mut api).await;
    let call = api
        .expect_apply(&format!("{DLOCK}/locks/payout-acct-17-0a1b2c3d/status"))
        .await;
    let revocation = call.body["status"]["revocation"].clone();
    assert_eq!(
        revocation,
        json!({
            "request": "oncall-ana: worker wedged past its lease",
            "outcome": "Complete",
            "revocationId": "7f9c0000-0000-4000-8000-000000000001",
            "revokedToken": 57,
            "newTokenFloor": 42,
            "paymentFenced": true,
            "railFenced": true,
            "summary": "revoked token 57, floor 42 at both fences",
        })
    );
    // Only the Lock controller's own fields, under its own field manager: the mirror's holder,
    // token and times are never sent (and so never overwritten from a cached copy).
    call.expect_field_manager("dlock-operator-lock-revoke");
    let mut fields: Vec<&str> = call.body["status"]
        .as_object()
        .unwrap()
        .keys()
        .map(String::as_str)
        .collect();
    fields.sort();
    assert_eq!(fields, ["conditions", "observedGeneration", "revocation"]);
    call.answer(&fixtures::lock());
    api.event("Revoked", Some("Normal")).await;
    reconcile.await.unwrap().unwrap();

    let fence = json!({
        "floor": 42, "operator": "oncall-ana", "reason": reason,
        "revocationId": "7f9c0000-0000-4000-8000-000000000001",
    });
    assert_eq!(
        services.calls(),
        vec![
            (
                "GET http://lock-server.default.svc:8080/v1/locks/payout:acct-17".to_owned(),
                Value::Null
            ),
            // The flow reads the key itself before L8: the grant it names must still hold it.
            (
                "GET http://lock-server.default.svc:8080/v1/locks/payout:acct-17".to_owned(),
                Value::Null
            ),
            (
                "POST http://lock-server.default.svc:8080/v1/locks/payout:acct-17/revoke"
                    .to_owned(),
                // The live grant's token guards L8: the holder now is revoked, and no other.
                json!({"operator": "oncall-ana", "reason": reason, "expectedToken": 57}),
            ),
            (
                format!(
                    "POST http://payment-resource.default.svc:8080/v1/accounts/acct-17/fence \
                     key=revoke-{REVOCATION_ID}"
                ),
                fence.clone()
            ),
            (
                "POST http://rail-proxy.default.svc:8080/v1/rail/high-water/acct-17".to_owned(),
                fence
            ),
        ]
    );

    // The same annotation value again (a resync, a restart): nothing is sent, nothing written.
    let mut done = lock;
    done.status.as_mut().unwrap().revocation = Some(serde_json::from_value(revocation).unwrap());
    reconcile_lock(Arc::new(done), ctx).await.unwrap();
    api.done().await;
    assert_eq!(services.calls().len(), 5);
}

/// L8 unanswered and the key unreadable afterwards (it may have ended the grant): recorded as
/// OutcomeUnknown with the token it was sent for, never as a failure, and retried. The retry
/// reads the key first: the grant is gone (a newer one, token 99, holds the key), so the
/// revocation took effect and the fences get the token after it; no L8 again, least of all for
/// the newer grant.
#[tokio::test]
async fn an_unanswered_revoke_is_settled_by_reading_the_key_never_resent_blindly() {
    let (services, ctx, mut api) = world(FakeServices {
        live_token: Some(57),
        lock_down: true,
        // The flow's own read before L8 answers; the one after it does not.
        reads_ok: Some(1),
        ..FakeServices::default()
    });
    let lock = fixtures::revoke_asked(fixtures::lock());
    let (reconcile, call) = revoke(lock.clone(), ctx, &mut api).await;
    let unknown = call.body["status"]["revocation"].clone();
    assert_outcome_unknown(&unknown, 57);
    let progressing = call
        .conditions()
        .into_iter()
        .find(|c| c["type"] == "Progressing")
        .unwrap();
    assert_eq!(
        (&progressing["status"], &progressing["reason"]),
        (&json!("True"), &json!("OutcomeUnknown")),
        "{progressing}"
    );
    call.answer(&fixtures::lock());
    api.event("RevocationOutcomeUnknown", Some("Warning")).await;
    let error = reconcile.await.unwrap().unwrap_err();
    assert!(!error.is_permanent(), "{error}");
    let calls: Vec<String> = services.calls().into_iter().map(|c| c.0).collect();
    let sent = calls.iter().filter(|c| c.ends_with("/revoke")).count();
    assert_eq!((calls.len(), sent), (4, 1), "{calls:?}");

    // The key has changed hands since (token 99): the retry reads it and fences 57 out.
    let (services, ctx, mut api) = world(FakeServices {
        live_token: Some(99),
        ..FakeServices::default()
    });
    let mut retry = lock;
    retry.status.as_mut().unwrap().revocation = Some(serde_json::from_value(unknown).unwrap());
    let (reconcile, call) = revoke(retry, ctx, &mut api).await;
    let revocation = &call.body["status"]["revocation"];
    assert_eq!(revocation["outcome"], "Complete", "{revocation}");
    assert_eq!(
        (&revocation["revokedToken"], &revocation["newTokenFloor"]),
        (&json!(57), &json!(58))
    );
    call.answer(&fixtures::lock());
    api.next().await.echo();
    reconcile.await.unwrap().unwrap();
    let calls = services.calls();
    assert_eq!(calls.len(), 3, "{calls:?}");
    assert!(
        calls[0].0.ends_with("/v1/locks/payout:acct-17"),
        "{calls:?}"
    );
    assert!(!calls.iter().any(|c| c.0.ends_with("/revoke")), "{calls:?}");
    assert_eq!(
        (&calls[1].1["floor"], &calls[2].1["floor"]),
        (&json!(58), &json!(58))
    );
}

/// A key nobody holds when the annotations are handled has no holder to fence out: refused and
/// recorded, with no L8 sent.
#[tokio::test]
async fn a_revoke_annotation_on_a_key_nobody_holds_now_is_refused_without_l8() {
    let (services, ctx, mut api) = world(FakeServices {
        not_held: true,
        ..FakeServices::default()
    });
    let (reconcile, call) = revoke(fixtures::revoke_asked(fixtures::lock()), ctx, &mut api).await;
    assert_refused(
        &call.body["status"]["revocation"],
        "nothing holds payout:acct-17",
    );
    call.answer(&fixtures::lock());
    api.event("RevocationRefused", Some("Warning")).await;
    reconcile.await.unwrap().unwrap();
    api.done().await;
    let calls: Vec<String> = services.calls().into_iter().map(|c| c.0).collect();
    assert_eq!(
        calls,
        ["GET http://lock-server.default.svc:8080/v1/locks/payout:acct-17"]
    );
}

/// A fence that did not answer leaves the revocation Incomplete: recorded, warned about, retried
/// with back-off, and the retry pushes only the missing fence with the same floor and id.
#[tokio::test]
async fn an_unreachable_rail_fence_is_retried_without_revoking_again() {
    let (_, ctx, mut api) = world(FakeServices {
        rail_down: true,
        ..FakeServices::default()
    });
    let lock = fixtures::revoke_asked(fixtures::lock());
    let (reconcile, call) = revoke(lock.clone(), ctx.clone(), &mut api).await;
    assert_eq!(call.body["status"]["revocation"]["outcome"], "Incomplete");
    assert_eq!(call.body["status"]["revocation"]["paymentFenced"], true);
    assert_eq!(call.body["status"]["revocation"]["railFenced"], false);
    let revocation = call.body["status"]["revocation"].clone();
    call.answer(&fixtures::lock());
    api.event("RevocationIncomplete", None).await;
    let error = reconcile.await.unwrap().unwrap_err();
    assert!(!error.is_permanent());

    let (services, ctx, mut api) = world(FakeServices::default());
    let mut retry = lock;
    retry.status.as_mut().unwrap().revocation = Some(serde_json::from_value(revocation).unwrap());
    let (reconcile, call) = revoke(retry, ctx, &mut api).await;
    assert_eq!(call.body["status"]["revocation"]["outcome"], "Complete");
    call.answer(&fixtures::lock());
    api.next().await.echo();
    reconcile.await.unwrap().unwrap();
    let calls = services.calls();
    assert_eq!(calls.len(), 1, "{calls:?}");
    assert!(calls[0].0.ends_with("/v1/rail/high-water/acct-17"));
    assert_eq!(calls[0].1["floor"], 42);
}

/// Only payout lock keys (`payout:{accountId}`) name an account to fence; revoking any other key
/// is refused before a single call, and recorded.
#[tokio::test]
async fn a_lock_that_names_no_account_is_refused_without_a_call() {
    let (services, ctx, mut api) = world(FakeServices::default());
    let mut lock = fixtures::lock();
    lock.spec.key = "batch:payroll".to_owned();
    lock.spec.account_id = String::new();
    let lock = fixtures::revoke_asked(lock);
    let reconcile = spawn_reconcile(reconcile_lock, lock, ctx);
    let call = api.next().await;
    assert_eq!(call.body["status"]["revocation"]["outcome"], "Refused");
    call.answer(&fixtures::lock());
    api.event("RevocationRefused", Some("Warning")).await;
    ended_without_a_service_call(reconcile, api, &services).await;
}

/// A mirrored Lock nobody asked to revoke gets Ready once from the Lock controller, under its
/// own field manager and with none of the mirror's fields.
#[tokio::test]
async fn a_mirrored_lock_gets_ready_once_without_the_mirrors_fields() {
    let (ctx, mut api) = context(Arc::new(FakeServices::default()));
    let lock = fixtures::lock();
    let reconcile = spawn_reconcile(reconcile_lock, lock.clone(), ctx.clone());
    let call = api
        .expect_apply(&format!("{DLOCK}/locks/payout-acct-17-0a1b2c3d/status"))
        .await;
    call.expect_field_manager("dlock-operator-lock-revoke");
    assert_eq!(
        call.body["status"],
        json!({"observedGeneration": 1, "conditions": [
            condition("Ready", "True", "Available", "mirrored from its lock server; no revocation asked"),
            condition("Progressing", "False", "Done", ""),
            condition("Degraded", "False", "Healthy", ""),
        ]})
    );
    call.answer(&lock);
    reconcile.await.unwrap().unwrap();
    let mut ready = lock;
    ready.status.as_mut().unwrap().reported.conditions =
        serde_json::from_value(json!([condition("Ready", "True", "Available", "")])).unwrap();
    reconcile_lock(Arc::new(ready), ctx).await.unwrap();
    api.done().await;
}
