//! The workloads controller: a LockServer's and a PaymentResource's objects applied in order (the
//! namespace's proof keys before the Deployments that mount them), their status and Events, and
//! the lock server's held locks mirrored as Lock objects.

use super::*;

/// Answers a Deployment's apply (`call`) as rolled out, its 3 replicas ready.
fn answer_ready_deployment(call: Call) {
    let mut body = call.body.clone();
    body["metadata"]["generation"] = json!(1);
    body["status"] = json!({
        "observedGeneration": 1,
        "replicas": 3,
        "readyReplicas": 3,
        "updatedReplicas": 3,
        "availableReplicas": 3,
    });
    call.reply(200, &body);
}

/// Answers what the service `name` gets applied after its Deployment (the PodDisruptionBudget,
/// then the NetworkPolicy of its ingress: executors, reconcilers and the operator only), and
/// returns the status apply of its custom resource (of the plural `kind`) that follows,
/// unanswered.
async fn status_after_deployment(api: &mut ApiServerVerifier, kind: &str, name: &str) -> Call {
    api.echo_applies([
        format!("{POLICY}/poddisruptionbudgets/{name}"),
        format!("{NETWORKING}/networkpolicies/{name}"),
    ])
    .await;
    api.expect_apply(&format!("{DLOCK}/{kind}/{name}/status"))
        .await
}

/// A LockServer scaled to 3 replicas, last seen Ready with `ready_message`.
fn ready_lock_server(ready_message: &str) -> dlock_operator::crd::LockServer {
    let mut object = fixtures::lock_server();
    object.spec.service.replicas = Some(3);
    object.status = Some(dlock_operator::crd::WorkloadStatus {
        reported: dlock_operator::crd::Reported {
            conditions: serde_json::from_value(json!([condition(
                "Ready",
                "True",
                "Available",
                ready_message
            )]))
            .unwrap(),
            ..Default::default()
        },
        ..Default::default()
    });
    object
}

/// Reconciles a [`ready_lock_server`] whose Ready condition says `ready_message`: answers its
/// object applies, in order (service account, ConfigMap, Service, Deployment with all 3 replicas
/// ready, PodDisruptionBudget, NetworkPolicy), and returns the reconcile and the status apply that
/// follows, unanswered.
async fn reconcile_ready_lock_server(
    ctx: Arc<Context>,
    api: &mut ApiServerVerifier,
    ready_message: &str,
) -> (
    tokio::task::JoinHandle<controller::Result<kube::runtime::controller::Action>>,
    Call,
) {
    let reconcile = spawn_reconcile(reconcile_lock_server, ready_lock_server(ready_message), ctx);
    api.expect_apply(&format!("{NS}/serviceaccounts/dlock-service"))
        .await
        .echo();
    // The proof keys exist from the first reconcile: left as they are.
    expect_proof_keys_create(api)
        .await
        .reply(409, &already_exists("dlock-fencing-proof-keys"));
    for kind in ["configmaps", "services"] {
        api.expect_apply(&format!("{NS}/{kind}/lock-server"))
            .await
            .echo();
    }
    let call = api
        .expect_apply(&format!("{APPS}/deployments/lock-server"))
        .await;
    assert_eq!(
        call.body["spec"]["replicas"], 3,
        "the update reaches the Deployment"
    );
    answer_ready_deployment(call);
    let call = status_after_deployment(api, "lockservers", "lock-server").await;
    (reconcile, call)
}

/// Answers the mirror of one held lock: the Lock's apply (answered as generation 1), then its
/// status apply under the mirror's own field manager. Returns the Lock as applied and the status
/// sent.
async fn answer_lock_mirror(api: &mut ApiServerVerifier, name: &str) -> (Value, Value) {
    let call = api.expect_apply(&format!("{DLOCK}/locks/{name}")).await;
    let mut applied = call.body.clone();
    applied["metadata"]["generation"] = json!(1);
    call.reply(200, &applied);
    let call = api
        .expect_apply(&format!("{DLOCK}/locks/{name}/status"))
        .await;
    call.expect_field_manager("dlock-operator-lock-mirror");
    let status = call.body["status"].clone();
    call.reply(200, &applied);
    (applied, status)
}

#[tokio::test]
async fn a_new_lock_server_gets_its_objects_applied_then_a_rolling_out_status_and_an_event() {
    let (services, ctx, mut api) = world(FakeServices::default());
    let object = Arc::new(fixtures::lock_server());
    let expected_deployment = {
        let workload =
            dlock_operator::validate::lock_server(&object, &fixtures::settings()).unwrap();
        serde_json::to_value(dlock_operator::build::deployment::deployment(&workload)).unwrap()
    };
    let reconcile = spawn_reconcile(reconcile_lock_server, object, ctx);

    // The services' service account comes first, before any pod that runs as it.
    let call = api
        .expect_apply(&format!("{NS}/serviceaccounts/dlock-service"))
        .await;
    assert_eq!(call.body["kind"], "ServiceAccount");
    assert!(
        call.body["metadata"].get("ownerReferences").is_none(),
        "shared by the namespace's services: no owner"
    );
    call.echo();
    // Then the namespace's proof keys, before the Deployment that mounts them.
    let call = expect_proof_keys_create(&mut api).await;
    created_keys(&call);
    call.echo();
    let call = api
        .expect_apply(&format!("{NS}/configmaps/lock-server"))
        .await;
    assert_eq!(call.body["kind"], "ConfigMap");
    assert!(
        call.body["data"]["config.toml"]
            .as_str()
            .unwrap()
            .contains("\"auth.mode\" = \"tokenreview\""),
        "authentication is on by default"
    );
    call.echo();
    let call = api.expect_service_and_deployment("lock-server").await;
    assert_eq!(call.body, expected_deployment);
    call.echo();
    let call = status_after_deployment(&mut api, "lockservers", "lock-server").await;
    assert_eq!(
        call.body,
        json!({
            "apiVersion": "dlock.io/v1alpha1",
            "kind": "LockServer",
            "status": {
                "observedGeneration": 1,
                "conditions": [
                    condition("Ready", "False", "RollingOut", "0/2 replicas ready"),
                    condition("Progressing", "True", "RollingOut", "0/2 replicas ready"),
                    condition("Degraded", "False", "Healthy", ""),
                ],
                "readyReplicas": 0,
                "summary": "0/2",
                "url": "http://lock-server.default.svc:8080",
            },
        })
    );
    call.answer(&fixtures::lock_server());
    let call = api.expect(Method::POST, EVENTS).await;
    assert_eq!(call.body["reason"], "RollingOut");
    assert_eq!(call.body["type"], "Normal");
    assert_eq!(call.body["regarding"]["name"], "lock-server");
    call.echo();

    let action = reconcile.await.unwrap().unwrap();
    assert_eq!(
        action,
        kube::runtime::controller::Action::requeue(controller::RESYNC)
    );
    api.done().await;
    assert!(
        services.calls().is_empty(),
        "a lock server that is not ready is not mirrored"
    );
}

/// `kubectl get locks`: a ready lock server's held locks become Lock objects with their holder,
/// token and expiry in status, and Locks of released keys are deleted. A steady status raises no
/// Event (events only on transitions).
#[tokio::test]
async fn a_ready_lock_server_is_updated_without_an_event_and_mirrors_its_held_locks() {
    let (services, ctx, mut api) = world(FakeServices {
        held: vec![fixtures::held_lock()],
        ..FakeServices::default()
    });
    let (reconcile, call) = reconcile_ready_lock_server(ctx, &mut api, "2/2 replicas ready").await;
    assert_eq!(call.body["status"]["conditions"][0]["status"], "True");
    assert_eq!(call.body["status"]["summary"], "3/3");
    call.answer(&fixtures::lock_server());

    // The mirror.
    let name = dlock_operator::build::lock::lock_name("lock-server", "payout:acct-17");
    let (applied, status) = answer_lock_mirror(&mut api, &name).await;
    assert_eq!(
        applied["spec"],
        json!({"key": "payout:acct-17", "lockServer": "lock-server", "accountId": "acct-17"})
    );
    // Only the mirror's own fields: a revocation result or the conditions the Lock controller
    // wrote are never sent (and so never erased).
    assert_eq!(
        status,
        json!({"holder": "executor-7", "token": 42, "acquiredAt": "2026-12-02T16:59:00.250Z",
               "expiresAt": "2026-12-02T17:00:10.000Z"})
    );
    let call = api.expect(Method::GET, &format!("{DLOCK}/locks")).await;
    assert!(
        call.query
            .contains("labelSelector=dlock.io%2Flock-server%3Dlock-server"),
        "{}",
        call.query
    );
    let mut stale = serde_json::to_value(fixtures::lock()).unwrap();
    stale["metadata"]["name"] = json!("released-key-00000000");
    call.reply(200, &json!({"apiVersion": "dlock.io/v1alpha1", "kind": "LockList", "metadata": {}, "items": [applied, stale]}));
    let call = api
        .expect(
            Method::DELETE,
            &format!("{DLOCK}/locks/released-key-00000000"),
        )
        .await;
    call.reply(200, &success());

    reconcile.await.unwrap().unwrap();
    api.done().await;
    assert_eq!(services.calls().len(), 1);
}

fn already_exists(name: &str) -> Value {
    json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "AlreadyExists",
           "code": 409, "message": format!("secrets {name:?} already exists"), "metadata": {}})
}

/// The next call, which must create (POST, never apply nor patch) the namespace's fencing-proof
/// keys Secret; unanswered.
async fn expect_proof_keys_create(api: &mut ApiServerVerifier) -> Call {
    let call = api.expect(Method::POST, &format!("{NS}/secrets")).await;
    assert_eq!(call.body["kind"], "Secret", "{}", call.body);
    assert_eq!(call.body["metadata"]["name"], "dlock-fencing-proof-keys");
    assert!(
        call.body["metadata"].get("ownerReferences").is_none(),
        "shared by the namespace's services: no owner"
    );
    assert!(
        call.query.contains("fieldManager=dlock-operator"),
        "{}",
        call.query
    );
    call
}

/// The keys file a created proof-keys Secret holds, checked as the services check it.
fn created_keys(call: &Call) -> String {
    let keys = call.body["stringData"]["keys"].as_str().unwrap().to_owned();
    dlock_server::proof::parse_keys_file(&keys).unwrap();
    keys
}

/// The lock server lists at most so many held locks and says `truncated`: the listed keys are
/// mirrored, the LockServer gets `LocksMirrored: False` (and a Warning Event), and no Lock is
/// deleted — an unlisted key may well be held.
#[tokio::test]
async fn a_truncated_lock_list_deletes_no_lock_and_raises_a_condition() {
    let (services, ctx, mut api) = world(FakeServices {
        held: vec![fixtures::held_lock()],
        truncated: true,
        ..FakeServices::default()
    });
    let (reconcile, call) = reconcile_ready_lock_server(ctx, &mut api, "3/3 replicas ready").await;
    call.answer(&fixtures::lock_server());

    let name = dlock_operator::build::lock::lock_name("lock-server", "payout:acct-17");
    answer_lock_mirror(&mut api, &name).await;

    let call = api
        .expect_apply(&format!("{DLOCK}/lockservers/lock-server/status"))
        .await;
    let conditions = call.conditions();
    assert_eq!(conditions.len(), 4, "{conditions:?}");
    assert_eq!(conditions[0]["type"], "Ready");
    assert_eq!(conditions[3]["type"], "LocksMirrored");
    assert_eq!(conditions[3]["status"], "False");
    assert_eq!(conditions[3]["reason"], "Truncated");
    assert_eq!(
        call.body["status"]["summary"], "3/3",
        "the rest of status is kept"
    );
    call.answer(&fixtures::lock_server());
    api.event("LockMirrorTruncated", Some("Warning")).await;

    reconcile.await.unwrap().unwrap();
    // No list of Locks, no delete.
    api.done().await;
    assert_eq!(services.calls().len(), 1);
}

/// Authentication off must be explicit, and never quiet: `spec.auth.mode: none` is applied (no
/// service account, `auth.mode = "none"`), the status carries `AuthenticationDisabled=True` and
/// every reconcile publishes a Warning Event, not only the first.
#[tokio::test]
async fn a_payment_resource_without_authentication_is_applied_with_a_condition_and_a_warning() {
    let (_, ctx, mut api) = world(FakeServices::default());
    let mut object = fixtures::payment_resource();
    object.spec.service.auth = Some(dlock_operator::crd::ServiceAuth {
        mode: Some(dlock_operator::crd::AuthMode::None),
        treasury_service_accounts: None,
    });
    let reconcile = spawn_reconcile(reconcile_payment_resource, object, ctx);

    expect_proof_keys_create(&mut api)
        .await
        .reply(409, &already_exists("dlock-fencing-proof-keys"));
    let call = api
        .expect_apply(&format!("{NS}/configmaps/payment-resource"))
        .await;
    assert_eq!(
        call.body["data"]["config.toml"],
        "\"server.listen\" = \"0.0.0.0:8080\"\n\"auth.mode\" = \"none\"\n\"fencing.proof-keys-file\" = \"/etc/dlock/fencing-proof-keys/keys\"\n\"payment.pg.url-file\" = \"/etc/dlock/secrets/database-url/url\"\n\"payment.operator.token-file\" = \"/etc/dlock/secrets/operator-token/token\"\n"
    );
    call.echo();
    let call = api.expect_service_and_deployment("payment-resource").await;
    let pod = &call.body["spec"]["template"]["spec"];
    assert_eq!(pod["automountServiceAccountToken"], false);
    assert!(pod.get("serviceAccountName").is_none());
    answer_ready_deployment(call);
    let call = status_after_deployment(&mut api, "paymentresources", "payment-resource").await;
    let conditions = call.conditions();
    assert_eq!(conditions.len(), 4, "{conditions:?}");
    assert_eq!(
        conditions[3],
        condition(
            "AuthenticationDisabled",
            "True",
            "AuthModeNone",
            controller::workloads::AUTHENTICATION_DISABLED_MESSAGE
        )
    );
    call.reply(
        200,
        &serde_json::to_value(fixtures::payment_resource()).unwrap(),
    );
    let call = api.expect(Method::POST, EVENTS).await;
    assert_eq!(call.body["reason"], "Ready", "the Ready transition");
    call.echo();
    let call = api.expect(Method::POST, EVENTS).await;
    assert_eq!(call.body["reason"], "AuthenticationDisabled");
    assert_eq!(call.body["type"], "Warning");
    assert_eq!(call.body["regarding"]["name"], "payment-resource");
    call.echo();

    reconcile.await.unwrap().unwrap();
    api.done().await;
}

/// Answers a payment resource's applies after its proof keys (ConfigMap, Service, Deployment
/// ready with 3 replicas, PodDisruptionBudget, NetworkPolicy, status, the Ready Event) and
/// returns the Deployment's pod spec as applied.
async fn answer_ready_payment_resource(api: &mut ApiServerVerifier) -> Value {
    api.expect_apply(&format!("{NS}/configmaps/payment-resource"))
        .await
        .echo();
    let call = api.expect_service_and_deployment("payment-resource").await;
    let pod = call.body["spec"]["template"]["spec"].clone();
    answer_ready_deployment(call);
    status_after_deployment(api, "paymentresources", "payment-resource")
        .await
        .answer(&fixtures::payment_resource());
    api.event("Ready", Some("Normal")).await;
    pod
}

/// The volume of a pod spec that mounts the fencing-proof keys.
fn proof_keys_volume(pod: &Value) -> Value {
    pod["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == "fencing-proof-keys")
        .cloned()
        .unwrap_or(Value::Null)
}

/// Safe by default (docs/threat-model.md#safe-defaults): a workload that names no
/// `spec.fencingProofKeysSecret` gets the namespace's `dlock-fencing-proof-keys`, created (POST,
/// with fresh keys) before its Deployment, which mounts it. Once the Secret exists the operator
/// never replaces it: the next reconcile's create is answered AlreadyExists and no other call
/// touches a Secret (no apply, patch, update or read), so rotated keys stay as the platform
/// left them.
#[tokio::test]
async fn the_namespaces_proof_keys_are_created_when_missing_and_never_replaced() {
    let (_, ctx, mut api) = world(FakeServices::default());
    let object = Arc::new(fixtures::payment_resource());
    let reconcile = spawn_reconcile(reconcile_payment_resource, object.clone(), ctx);
    api.expect_apply(&format!("{NS}/serviceaccounts/dlock-service"))
        .await
        .echo();
    let call = expect_proof_keys_create(&mut api).await;
    let first = created_keys(&call);
    call.echo();
    let pod = answer_ready_payment_resource(&mut api).await;
    assert_eq!(
        proof_keys_volume(&pod),
        json!({"name": "fencing-proof-keys", "secret": {"secretName": "dlock-fencing-proof-keys"}})
    );
    reconcile.await.unwrap().unwrap();

    api.done().await;

    // Again (a resync, another service of the namespace, a new leader): the Secret exists.
    let (_, ctx, mut api) = world(FakeServices::default());
    let reconcile = spawn_reconcile(reconcile_payment_resource, object, ctx);
    api.expect_apply(&format!("{NS}/serviceaccounts/dlock-service"))
        .await
        .echo();
    let call = expect_proof_keys_create(&mut api).await;
    assert_ne!(created_keys(&call), first, "fresh keys for every create");
    call.reply(409, &already_exists("dlock-fencing-proof-keys"));
    let pod = answer_ready_payment_resource(&mut api).await;
    assert_eq!(
        proof_keys_volume(&pod)["secret"]["secretName"],
        "dlock-fencing-proof-keys"
    );
    reconcile.await.unwrap().unwrap();
    api.done().await;
}

/// A workload that names its own `spec.fencingProofKeysSecret` mounts that one, and the operator
/// makes no Secret for it.
#[tokio::test]
async fn a_named_proof_keys_secret_is_mounted_and_no_secret_is_created() {
    let (_, ctx, mut api) = world(FakeServices::default());
    let mut object = fixtures::payment_resource();
    object.spec.service.fencing_proof_keys_secret = Some(fixtures::secret("team-keys", "keys"));
    let reconcile = spawn_reconcile(reconcile_payment_resource, object, ctx);
    api.expect_apply(&format!("{NS}/serviceaccounts/dlock-service"))
        .await
        .echo();
    let pod = answer_ready_payment_resource(&mut api).await;
    assert_eq!(proof_keys_volume(&pod)["secret"]["secretName"], "team-keys");
    reconcile.await.unwrap().unwrap();
    api.done().await;
}

/// An operator that may not create Secrets (an older ClusterRole) stops before any Deployment:
/// no pod is rolled onto keys that do not exist. The failure is in the status and a Warning
/// Event, with what to do.
#[tokio::test]
async fn a_refused_proof_keys_create_stops_before_any_deployment() {
    let (_, ctx, mut api) = world(FakeServices::default());
    let reconcile = spawn_reconcile(
        reconcile_payment_resource,
        fixtures::payment_resource(),
        ctx,
    );
    api.expect_apply(&format!("{NS}/serviceaccounts/dlock-service"))
        .await
        .echo();
    expect_proof_keys_create(&mut api).await.reply(
        403,
        &json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "Forbidden",
                "code": 403, "message": "secrets is forbidden", "metadata": {}}),
    );
    let call = api
        .expect_apply(&format!("{DLOCK}/paymentresources/payment-resource/status"))
        .await;
    call.expect_field_manager("dlock-operator-failure");
    let (reason, message) = call.degraded();
    assert_eq!(reason, "ProofKeysFailed", "{message}");
    assert!(message.contains("needs `create` on Secrets"), "{message}");
    call.answer(&fixtures::payment_resource());
    api.event("ProofKeysFailed", Some("Warning")).await;
    let error = reconcile.await.unwrap().unwrap_err();
    assert!(
        matches!(error, controller::Error::ProofKeys { .. }),
        "{error}"
    );
    api.done().await;
}

/// A RailProxy whose spec dropped `stub` leaves no stub behind: each kind the stub had is listed
/// by the stub's labels, and what this RailProxy owns is deleted; an object with the same labels
/// that another owner made stays (the positive control of the owner check).
#[tokio::test]
async fn a_rail_proxy_without_its_stub_deletes_the_stubs_objects() {
    let (_, ctx, mut api) = world(FakeServices::default());
    let mut proxy = fixtures::rail_proxy();
    proxy.spec.stub = None;
    proxy.spec.rail_url = Some("https://rail.example".to_owned());
    let removal =
        tokio::spawn(
            async move { controller::workloads::remove_orphaned_stub(&proxy, &ctx).await },
        );
    let owned = |kind: &str, name: &str, uid: &str| {
        json!({"kind": kind, "metadata": {"name": name, "namespace": "default",
            "ownerReferences": [{"apiVersion": "dlock.io/v1alpha1", "kind": "RailProxy",
                "name": "rail-proxy", "uid": uid}]}})
    };
    let list = |items: Vec<Value>| json!({"kind": "List", "apiVersion": "v1", "metadata": {}, "items": items});
    for (collection, kind) in [
        (format!("{APPS}/deployments"), "Deployment"),
        (format!("{NS}/services"), "Service"),
        (format!("{NS}/configmaps"), "ConfigMap"),
        (
            format!("{POLICY}/poddisruptionbudgets"),
            "PodDisruptionBudget",
        ),
        (format!("{NETWORKING}/networkpolicies"), "NetworkPolicy"),
    ] {
        let call = api.expect(Method::GET, &collection).await;
        assert!(
            call.query.contains(
                "labelSelector=app.kubernetes.io%2Fcomponent%3Drail-stub%2Cdlock.io%2Finstance%3Drail-proxy"
            ),
            "{}",
            call.query
        );
        if kind == "Service" {
            // Same labels, another owner: listed, not deleted.
            call.reply(
                200,
                &list(vec![owned(kind, "rail-proxy-stub", "uid-someone-else")]),
            );
            continue;
        }
        call.reply(
            200,
            &list(vec![owned(kind, "rail-proxy-stub", "uid-rail-proxy")]),
        );
        let call = api
            .expect(Method::DELETE, &format!("{collection}/rail-proxy-stub"))
            .await;
        call.reply(200, &success());
    }
    assert_eq!(removal.await.unwrap().unwrap(), 4);
    api.done().await;
}
