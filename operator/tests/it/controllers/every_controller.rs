//! What every controller does alike: a paused object gets no call, an invalid spec is reported
//! and waits for a change, transient errors back off, a malformed object fails alone.

use super::*;

/// Incident handling: `dlock.io/reconcile: paused` stops the controller from changing anything.
#[tokio::test]
async fn a_paused_object_gets_no_call_at_all() {
    let (services, ctx, api) = world(FakeServices::default());
    reconcile_paused(
        fixtures::lock_server(),
        &ctx,
        "LockServer",
        reconcile_lock_server,
    )
    .await;
    let batch = fixtures::payout_batch();
    reconcile_paused(batch, &ctx, "PayoutBatch", reconcile_payout_batch).await;
    let lock = fixtures::revoke_asked(fixtures::lock());
    reconcile_paused(lock, &ctx, "Lock", reconcile_lock).await;
    api.done().await;
    assert!(services.calls().is_empty());
}

/// Reconciles `object`, paused, as the operator's controllers run a reconcile: behind the
/// deserialize guard and the pause.
async fn reconcile_paused<K, F, Fut>(
    object: K,
    ctx: &Arc<Context>,
    kind: &'static str,
    reconcile: F,
) where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
    F: FnOnce(Arc<K>, Arc<Context>) -> Fut,
    Fut: Future<Output = Result<kube::runtime::controller::Action, controller::Error>>,
{
    let object = kube::core::DeserializeGuard(Ok(fixtures::paused(object)));
    dlock_operator::run::guarded(Arc::new(object), ctx.clone(), kind, reconcile)
        .await
        .unwrap();
}

/// An invalid spec is reported in status (Degraded) with a Warning Event, nothing is applied,
/// and the error is permanent: the controller waits for the spec to change.
#[tokio::test]
async fn an_invalid_spec_is_reported_and_waits_for_a_change() {
    let (_, ctx, mut api) = world(FakeServices::default());
    let mut object = fixtures::lock_server();
    object.spec.backend.etcd = fixtures::etcd_backend().etcd;
    let object = Arc::new(object);
    let reconcile = spawn_reconcile(reconcile_lock_server, object.clone(), ctx.clone());
    let call = api
        .expect_apply(&format!("{DLOCK}/lockservers/lock-server/status"))
        .await;
    assert_eq!(call.body["status"]["conditions"][2]["status"], "True");
    assert_eq!(
        call.body["status"]["conditions"][2]["reason"],
        "InvalidSpec"
    );
    call.answer(&fixtures::lock_server());
    let call = api.expect(Method::POST, EVENTS).await;
    assert_eq!(call.body["type"], "Warning");
    call.echo();
    let error = reconcile.await.unwrap().unwrap_err();
    assert!(error.is_permanent(), "{error}");
    assert_eq!(
        controller::error_policy(object, &error, ctx),
        kube::runtime::controller::Action::await_change()
    );
    api.done().await;
}

/// Transient errors back off, doubling per consecutive failure up to a ceiling.
#[tokio::test]
async fn transient_errors_back_off_exponentially() {
    let (ctx, _api) = context(Arc::new(FakeServices::default()));
    let object = Arc::new(fixtures::lock_server());
    let error = || {
        controller::Error::Service(ServiceError::Unavailable {
            service: "x",
            message: "down".to_owned(),
        })
    };
    let delays: Vec<_> = (0..3)
        .map(|_| controller::error_policy(object.clone(), &error(), ctx.clone()))
        .collect();
    assert_eq!(
        delays,
        vec![
            kube::runtime::controller::Action::requeue(Duration::from_secs(5)),
            kube::runtime::controller::Action::requeue(Duration::from_secs(10)),
            kube::runtime::controller::Action::requeue(Duration::from_secs(20)),
        ]
    );
}

/// One malformed object (here a LockServer whose backend type is not pg or etcd) fails only its
/// own reconcile, permanently until it changes, and never reaches the API or the services.
#[tokio::test]
async fn a_malformed_object_fails_alone_behind_the_deserialize_guard() {
    let (services, ctx, api) = world(FakeServices::default());
    let mut raw = serde_json::to_value(fixtures::lock_server()).unwrap();
    raw["spec"]["backend"]["type"] = json!("redis");
    let guard: kube::core::DeserializeGuard<dlock_operator::crd::LockServer> =
        serde_json::from_value(raw).unwrap();
    assert!(guard.0.is_err());
    let error =
        dlock_operator::run::guarded(Arc::new(guard), ctx, "LockServer", reconcile_lock_server)
            .await
            .unwrap_err();
    assert!(error.is_permanent(), "{error}");
    api.done().await;
    assert!(services.calls().is_empty());
}
