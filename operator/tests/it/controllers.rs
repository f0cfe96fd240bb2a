//! Each controller's conversation with the API server, through kube's mock service: the exact
//! method, path, field manager and body of every call, in order, and a timeout that catches a
//! call that never came (or one that should not have been made).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use dlock_contract::client::ClientError;
use dlock_contract::lock::{Revocation, RevokeRequest};
use dlock_contract::payment::FenceResponse;
use dlock_contract::rail::{HighWater, HighWaterRequest};
use dlock_contract::revoke::{FenceCall, RevokeSteps, StepFuture};
use dlock_executor::cancel::CancelReport;
use dlock_operator::build::lock::HeldLock;
use dlock_operator::controller::{self, Context};
use dlock_operator::metrics::Metrics;
use dlock_operator::services::{Cancel, HeldList, ServiceError, ServiceFuture, Services, Steps};
use dlock_operator::validate::RevocationTarget;
use http::{Method, Request, Response};
use kube::client::Body;
use serde_json::{Value, json};

use crate::fixtures::{self, NOW};

type Handle = tower_test::mock::Handle<Request<Body>, Response<Body>>;

const REVOCATION_ID: &str = "7f9c0000-0000-4000-8000-000000000001";

/// Calls the fake services received, in order.
#[derive(Default)]
struct FakeServices {
    calls: Mutex<Vec<(String, Value)>>,
    held: Vec<HeldLock>,
    truncated: bool,
    rail_down: bool,
    /// The token of the key's grant at the lock server (L7); 41, the fixture Lock's, when unset.
    live_token: Option<i64>,
    /// Nothing holds the key at the lock server.
    not_held: bool,
    /// L8 gets no answer.
    lock_down: bool,
}

impl FakeServices {
    fn record(&self, call: String, body: impl serde::Serialize) {
        let body = serde_json::to_value(body).unwrap();
        self.calls.lock().unwrap().push((call, body));
    }
    fn calls(&self) -> Vec<(String, Value)> {
        self.calls.lock().unwrap().clone()
    }
}

impl Services for FakeServices {
    fn payout_states<'a>(
        &'a self,
        url: &'a str,
        ids: &'a [String],
    ) -> ServiceFuture<'a, Vec<Option<String>>> {
        self.record(
            format!("GET {url}/v1/payouts/{{id}} x{}", ids.len()),
            json!(ids),
        );
        let states = ids
            .iter()
            .enumerate()
            .map(|(i, _)| {
                if i == 0 {
                    Some("POSTED".to_owned())
                } else {
                    Some("RAIL_AMBIGUOUS".to_owned())
                }
            })
            .collect();
        Box::pin(async move { Ok(states) })
    }
    fn held_locks<'a>(&'a self, url: &'a str) -> ServiceFuture<'a, HeldList> {
        self.record(format!("GET {url}/v1/locks"), Value::Null);
        Box::pin(async move {
            Ok(HeldList {
                items: self.held.clone(),
                truncated: self.truncated,
            })
        })
    }
    fn lock_grant<'a>(&'a self, url: &'a str, key: &'a str) -> ServiceFuture<'a, Option<i64>> {
        self.record(format!("GET {url}/v1/locks/{key}"), Value::Null);
        let grant = (!self.not_held).then(|| self.live_token.unwrap_or(41));
        Box::pin(async move { Ok(grant) })
    }
    fn revoke_steps<'a>(&'a self, target: &'a RevocationTarget) -> Result<Steps<'a>, ServiceError> {
        Ok(Box::new(FakeSteps {
            services: self,
            target,
        }))
    }
    fn cancel_unfinished<'a>(&'a self, cancel: Cancel<'a>) -> ServiceFuture<'a, CancelReport> {
        let Cancel {
            lock_server_url,
            payment_resource_url,
            payouts,
            reason,
        } = cancel;
        self.record(
            format!("CANCEL {lock_server_url} {payment_resource_url}"),
            json!({"payouts": payouts.iter().map(|(id, a)| format!("{id} {a}")).collect::<Vec<_>>(), "reason": reason}),
        );
        Box::pin(async move {
            Ok(CancelReport {
                abandoned: payouts.iter().map(|(id, _)| *id).collect(),
                ..Default::default()
            })
        })
    }
}

/// The revocation flow's calls against one target, recorded by the fake services.
struct FakeSteps<'a> {
    services: &'a FakeServices,
    target: &'a RevocationTarget,
}

impl FakeSteps<'_> {
    /// Records a POST to `path` of the service at `url`, and gives its answer.
    fn post<'a, T: Send + 'a>(
        &self,
        url: &str,
        path: String,
        request: impl serde::Serialize,
        answer: Result<T, ClientError>,
    ) -> StepFuture<'a, T> {
        self.services.record(format!("POST {url}{path}"), request);
        Box::pin(std::future::ready(answer))
    }
}

impl RevokeSteps for FakeSteps<'_> {
    fn revoke_lock<'a>(
        &'a self,
        key: &'a str,
        request: &'a RevokeRequest,
    ) -> StepFuture<'a, Revocation> {
        if self.services.lock_down {
            return self.post(
                &self.target.lock_server_url,
                format!("/v1/locks/{key}/revoke"),
                request,
                Err(ClientError::Transport {
                    url: self.target.lock_server_url.clone(),
                    message: "timed out".to_owned(),
                    connect: false,
                    timeout: true,
                }),
            );
        }
        self.post(
            &self.target.lock_server_url,
            format!("/v1/locks/{key}/revoke"),
            request,
            Ok(Revocation {
                key: key.to_owned(),
                revoked_token: request.expected_token.unwrap_or(41),
                revoked_owner_id: "executor-7".to_owned(),
                new_token_floor: 42,
                revocation_id: REVOCATION_ID.parse().unwrap(),
                operator: request.operator.clone(),
                reason: request.reason.clone(),
                revoked_at: chrono::Utc::now(),
            }),
        )
    }
    fn advance_fence<'a>(&'a self, call: FenceCall<'a>) -> StepFuture<'a, FenceResponse> {
        let (account, request) = (call.account_id, call.request);
        self.post(
            &self.target.payment_resource_url,
            format!("/v1/accounts/{account}/fence key={}", call.idempotency_key),
            request,
            Ok(FenceResponse {
                account_id: account.to_owned(),
                previous_fence: 3,
                fence: request.floor,
                revocation_id: request.revocation_id,
            }),
        )
    }
    fn advance_high_water<'a>(
        &'a self,
        account: &'a str,
        request: &'a HighWaterRequest,
    ) -> StepFuture<'a, HighWater> {
        let url = &self.target.rail_proxy_url;
        let answer = if self.services.rail_down {
            Err(ClientError::Transport {
                url: url.to_owned(),
                message: "connection refused".to_owned(),
                connect: true,
                timeout: false,
            })
        } else {
            Ok(HighWater {
                account_id: account.to_owned(),
                previous_token: Some(3),
                highest_token: request.floor,
            })
        };
        self.post(
            url,
            format!("/v1/rail/high-water/{account}"),
            request,
            answer,
        )
    }
}

/// Answers the namespace's object list of one kind (names only, as `list_metadata` asks).
fn reply_names(call: Call, plural: &str, names: &[&str]) {
    call.expect(Method::GET, &format!("{DLOCK}/{plural}"));
    let items: Vec<Value> = names
        .iter()
        .map(|n| {
            json!({
                "apiVersion": "meta.k8s.io/v1",
                "kind": "PartialObjectMetadata",
                "metadata": {"name": n, "namespace": "default"},
            })
        })
        .collect();
    call.reply(
        200,
        &json!({
            "apiVersion": "meta.k8s.io/v1",
            "kind": "PartialObjectMetadataList",
            "metadata": {},
            "items": items,
        }),
    );
}

/// The stack of the fixtures: one LockServer, PaymentResource and RailProxy in the namespace.
async fn answer_fence_targets(api: &mut ApiServerVerifier) {
    reply_names(api.next().await, "lockservers", &["lock-server"]);
    reply_names(api.next().await, "paymentresources", &["payment-resource"]);
    reply_names(api.next().await, "railproxies", &["rail-proxy"]);
}

/// The fake services, a context whose client talks to a mocked API server, and that server.
fn world(services: FakeServices) -> (Arc<FakeServices>, Arc<Context>, ApiServerVerifier) {
    let services = Arc::new(services);
    let (ctx, api) = context(services.clone());
    (services, ctx, api)
}

fn context(services: Arc<FakeServices>) -> (Arc<Context>, ApiServerVerifier) {
    let (mock, handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
    let client = kube::Client::new(mock, "default");
    let ctx = Context::new(
        client,
        services,
        fixtures::settings(),
        Arc::new(Metrics::default()),
        Box::new(|| NOW.to_owned()),
    );
    (Arc::new(ctx), ApiServerVerifier(handle))
}

/// One call the API server received.
struct Call {
    method: Method,
    path: String,
    query: String,
    content_type: String,
    body: Value,
    respond: tower_test::mock::SendResponse<Response<Body>>,
}

impl Call {
    fn expect(&self, method: Method, path: &str) {
        assert_eq!(
            (&self.method, self.path.as_str()),
            (&method, path),
            "query {}",
            self.query
        );
    }
    /// A server-side apply under the operator's one field manager.
    fn expect_apply(&self, path: &str) {
        self.expect(Method::PATCH, path);
        assert!(
            self.query.contains("fieldManager=dlock-operator") && self.query.contains("force=true"),
            "{path}: query {}",
            self.query
        );
        assert_eq!(self.content_type, "application/apply-patch+yaml", "{path}");
    }
    /// Sent under the field manager `manager` (one per owner of a set of fields).
    fn expect_field_manager(&self, manager: &str) {
        assert!(
            self.query.contains(&format!("fieldManager={manager}&"))
                || self.query.ends_with(&format!("fieldManager={manager}")),
            "{}",
            self.query
        );
    }
    /// The status conditions sent.
    fn conditions(&self) -> Vec<Value> {
        self.body["status"]["conditions"]
            .as_array()
            .unwrap()
            .clone()
    }
    fn reply(self, status: u16, body: &Value) {
        self.respond.send_response(
            Response::builder()
                .status(status)
                .body(Body::from(serde_json::to_vec(body).unwrap()))
                .unwrap(),
        );
    }
    /// Answers `200 OK` with `object`.
    fn answer(self, object: &impl serde::Serialize) {
        self.reply(200, &serde_json::to_value(object).unwrap());
    }
    /// Answers with the body it was sent, as an API server does for an apply.
    fn echo(self) {
        let body = self.body.clone();
        self.reply(200, &body);
    }
}

struct ApiServerVerifier(Handle);

impl ApiServerVerifier {
    /// The next call, which must be `method path`; unanswered.
    async fn expect(&mut self, method: Method, path: &str) -> Call {
        let call = self.next().await;
        call.expect(method, path);
        call
    }

    /// The next call, which must be a JSON patch of `path` (a finalizer added or removed);
    /// unanswered.
    async fn expect_json_patch(&mut self, path: &str) -> Call {
        let call = self.expect(Method::PATCH, path).await;
        assert_eq!(call.content_type, "application/json-patch+json", "{path}");
        call
    }

    /// The next call, which must be a server-side apply of `path`; unanswered.
    async fn expect_apply(&mut self, path: &str) -> Call {
        let call = self.next().await;
        call.expect_apply(path);
        call
    }

    /// The next calls, which must be server-side applies of a service's Service `name` (answered
    /// with the body it was sent) and then of its Deployment `name`, which is returned
    /// unanswered.
    async fn expect_service_and_deployment(&mut self, name: &str) -> Call {
        self.expect_apply(&format!("{NS}/services/{name}"))
            .await
            .echo();
        self.expect_apply(&format!("{APPS}/deployments/{name}"))
            .await
    }

    /// The next calls, which must be server-side applies of `paths` in order; each answered
    /// with the body it was sent.
    async fn echo_applies(&mut self, paths: impl IntoIterator<Item = String>) {
        for path in paths {
            self.expect_apply(&path).await.echo();
        }
    }

    /// The next call, which must be an Event with `reason` (and `type_`, when given); answered.
    async fn event(&mut self, reason: &str, type_: Option<&str>) {
        let call = self.expect(Method::POST, EVENTS).await;
        assert_eq!(call.body["reason"], reason, "{}", call.body);
        if let Some(type_) = type_ {
            assert_eq!(call.body["type"], type_, "{}", call.body);
        }
        call.echo();
    }

    async fn next(&mut self) -> Call {
        let (request, respond) =
            tokio::time::timeout(Duration::from_secs(1), self.0.next_request())
                .await
                .expect(
                    "an API call that never came (did the reconcile return early? see its result)",
                )
                .expect("the client went away (the reconcile returned early)");
        let method = request.method().clone();
        let path = request.uri().path().to_owned();
        let query = request.uri().query().unwrap_or("").to_owned();
        let content_type = request
            .headers()
            .get(http::header::CONTENT_TYPE)
            .map(|v| v.to_str().unwrap().to_owned())
            .unwrap_or_default();
        let bytes = request.into_body().collect_bytes().await.unwrap();
        let body = if bytes.is_empty() {
            Value::Null
        } else {
            serde_json::from_slice(&bytes).unwrap()
        };
        Call {
            method,
            path,
            query,
            content_type,
            body,
            respond,
        }
    }

    /// Asserts that no further call arrives.
    async fn done(mut self) {
        let extra = tokio::time::timeout(Duration::from_millis(200), self.0.next_request()).await;
        if let Ok(Some((request, _))) = extra {
            panic!("an unexpected call: {} {}", request.method(), request.uri());
        }
    }
}

/// The reconcile ended well, every call it made to the API server was expected, and it called no
/// service.
async fn ended_without_a_service_call(
    reconcile: tokio::task::JoinHandle<controller::Result<kube::runtime::controller::Action>>,
    api: ApiServerVerifier,
    services: &FakeServices,
) {
    reconcile.await.unwrap().unwrap();
    api.done().await;
    assert!(services.calls().is_empty());
}

const NS: &str = "/api/v1/namespaces/default";
const APPS: &str = "/apis/apps/v1/namespaces/default";
const POLICY: &str = "/apis/policy/v1/namespaces/default";
const DLOCK: &str = "/apis/dlock.io/v1alpha1/namespaces/default";
const NETWORKING: &str = "/apis/networking.k8s.io/v1/namespaces/default";
const EVENTS: &str = "/apis/events.k8s.io/v1/namespaces/default/events";

/// What a service gets applied after its Deployment: the PodDisruptionBudget, then the
/// NetworkPolicy of its ingress (executors, reconcilers and the operator only).
fn after_deployment(name: &str) -> [String; 2] {
    [
        format!("{POLICY}/poddisruptionbudgets/{name}"),
        format!("{NETWORKING}/networkpolicies/{name}"),
    ]
}

fn ready_deployment(mut body: Value, replicas: i64) -> Value {
    body["metadata"]["generation"] = json!(1);
    body["status"] = json!({
        "observedGeneration": 1,
        "replicas": replicas,
        "readyReplicas": replicas,
        "updatedReplicas": replicas,
        "availableReplicas": replicas,
    });
    body
}

fn condition(type_: &str, status: &str, reason: &str, message: &str) -> Value {
    json!({
        "type": type_, "status": status, "reason": reason, "message": message,
        "lastTransitionTime": NOW, "observedGeneration": 1,
    })
}

/// The lock a lock server holds in the mirror tests.
fn held_lock() -> HeldLock {
    HeldLock {
        key: "payout:acct-17".to_owned(),
        owner_id: "executor-7".to_owned(),
        fencing_token: 42,
        acquired_at: "2026-12-02T16:59:00Z".to_owned(),
        expires_at: "2026-12-02T17:00:10Z".to_owned(),
    }
}

/// A LockServer scaled to 3 replicas, last seen Ready with `ready_message`.
fn ready_lock_server(ready_message: &str) -> dlock_operator::crd::LockServer {
    let mut object = fixtures::lock_server();
    object.spec.service.replicas = Some(3);
    object.status = Some(dlock_operator::crd::WorkloadStatus {
        conditions: serde_json::from_value(json!([condition(
            "Ready",
            "True",
            "Available",
            ready_message
        )]))
        .unwrap(),
        ..Default::default()
    });
    object
}

/// Answers a [`ready_lock_server`]'s object applies, in order (service account, ConfigMap,
/// Service, Deployment with all 3 replicas ready, PodDisruptionBudget, NetworkPolicy), and returns
/// the status apply that follows, unanswered.
async fn answer_ready_lock_server_objects(api: &mut ApiServerVerifier) -> Call {
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
    let body = ready_deployment(call.body.clone(), 3);
    call.reply(200, &body);
    api.echo_applies(after_deployment("lock-server")).await;
    api.expect_apply(&format!("{DLOCK}/lockservers/lock-server/status"))
        .await
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
    let reconcile = tokio::spawn(controller::workloads::reconcile_lock_server(object, ctx));

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
    api.echo_applies(after_deployment("lock-server")).await;
    let call = api
        .expect_apply(&format!("{DLOCK}/lockservers/lock-server/status"))
        .await;
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
        held: vec![held_lock()],
        ..FakeServices::default()
    });
    let reconcile = tokio::spawn(controller::workloads::reconcile_lock_server(
        Arc::new(ready_lock_server("2/2 replicas ready")),
        ctx,
    ));
    let call = answer_ready_lock_server_objects(&mut api).await;
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
        json!({"holder": "executor-7", "token": 42, "acquiredAt": "2026-12-02T16:59:00Z",
               "expiresAt": "2026-12-02T17:00:10Z"})
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

/// Incident handling: `dlock.io/reconcile: paused` stops the controller from changing anything.
#[tokio::test]
async fn a_paused_object_gets_no_call_at_all() {
    let (services, ctx, api) = world(FakeServices::default());
    let reconcile = controller::workloads::reconcile_lock_server;
    reconcile_paused(fixtures::lock_server(), &ctx, "LockServer", reconcile).await;
    let reconcile = controller::payout_batch::reconcile_payout_batch;
    reconcile_paused(fixtures::payout_batch(), &ctx, "PayoutBatch", reconcile).await;
    let lock = fixtures::revoke_asked(fixtures::lock());
    reconcile_paused(lock, &ctx, "Lock", controller::lock::reconcile_lock).await;
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
    let reconcile = tokio::spawn(controller::workloads::reconcile_lock_server(
        object.clone(),
        ctx.clone(),
    ));
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
    let reconcile = tokio::spawn(controller::lock::reconcile_lock(
        Arc::new(lock.clone()),
        ctx.clone(),
    ));
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
    controller::lock::reconcile_lock(Arc::new(done), ctx)
        .await
        .unwrap();
    api.done().await;
    assert_eq!(services.calls().len(), 4);
}

/// L8 unanswered (it may have ended the grant): the live token it was sent for is recorded, and
/// the retry sends L8 for that token again without reading the key anew, so it never ends the
/// newer grant that took the key meanwhile.
#[tokio::test]
async fn an_unanswered_revoke_is_retried_for_the_same_grant_only() {
    let (services, ctx, mut api) = world(FakeServices {
        live_token: Some(57),
        lock_down: true,
        ..FakeServices::default()
    });
    let lock = fixtures::revoke_asked(fixtures::lock());
    let reconcile = tokio::spawn(controller::lock::reconcile_lock(
        Arc::new(lock.clone()),
        ctx,
    ));
    answer_fence_targets(&mut api).await;
    let call = api.next().await;
    let pinned = call.body["status"]["revocation"].clone();
    assert_eq!(
        (
            &pinned["outcome"],
            &pinned["revokedToken"],
            &pinned["revocationId"]
        ),
        (&json!("Incomplete"), &json!(57), &Value::Null),
        "{pinned}"
    );
    call.answer(&fixtures::lock());
    let error = reconcile.await.unwrap().unwrap_err();
    assert!(!error.is_permanent(), "{error}");
    assert_eq!(services.calls().len(), 2, "{:?}", services.calls());

    // The key has changed hands again (token 99); the retry revokes 57 or nothing.
    let (services, ctx, mut api) = world(FakeServices {
        live_token: Some(99),
        ..FakeServices::default()
    });
    let mut retry = lock;
    retry.status.as_mut().unwrap().revocation = Some(serde_json::from_value(pinned).unwrap());
    let reconcile = tokio::spawn(controller::lock::reconcile_lock(Arc::new(retry), ctx));
    answer_fence_targets(&mut api).await;
    let call = api.next().await;
    assert_eq!(call.body["status"]["revocation"]["outcome"], "Complete");
    assert_eq!(call.body["status"]["revocation"]["revokedToken"], 57);
    call.answer(&fixtures::lock());
    api.next().await.echo();
    reconcile.await.unwrap().unwrap();
    let calls = services.calls();
    assert_eq!(calls.len(), 3, "{calls:?}");
    assert!(
        calls[0].0.ends_with("/v1/locks/payout:acct-17/revoke"),
        "{calls:?}"
    );
    assert_eq!(calls[0].1["expectedToken"], 57);
}

/// A key nobody holds when the annotations are handled has no holder to fence out: refused and
/// recorded, with no L8 sent.
#[tokio::test]
async fn a_revoke_annotation_on_a_key_nobody_holds_now_is_refused_without_l8() {
    let (services, ctx, mut api) = world(FakeServices {
        not_held: true,
        ..FakeServices::default()
    });
    let lock = fixtures::revoke_asked(fixtures::lock());
    let reconcile = tokio::spawn(controller::lock::reconcile_lock(Arc::new(lock), ctx));
    answer_fence_targets(&mut api).await;
    let call = api.next().await;
    let revocation = &call.body["status"]["revocation"];
    assert_eq!(revocation["outcome"], "Refused");
    assert!(
        revocation["summary"]
            .as_str()
            .unwrap()
            .contains("nothing holds payout:acct-17"),
        "{revocation}"
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
    let reconcile = tokio::spawn(controller::lock::reconcile_lock(
        Arc::new(lock.clone()),
        ctx.clone(),
    ));
    answer_fence_targets(&mut api).await;
    let call = api.next().await;
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
    let reconcile = tokio::spawn(controller::lock::reconcile_lock(Arc::new(retry), ctx));
    answer_fence_targets(&mut api).await;
    let call = api.next().await;
    assert_eq!(call.body["status"]["revocation"]["outcome"], "Complete");
    call.answer(&fixtures::lock());
    api.next().await.echo();
    reconcile.await.unwrap().unwrap();
    let calls = services.calls();
    assert_eq!(calls.len(), 1, "{calls:?}");
    assert!(calls[0].0.ends_with("/v1/rail/high-water/acct-17"));
    assert_eq!(calls[0].1["floor"], 42);
}

/// A new batch first gets the finalizer, then its manifest ConfigMap and executor Job, then
/// `accepted: true` in status (from which on its payouts are immutable) and an Event.
#[tokio::test]
async fn a_new_payout_batch_gets_a_finalizer_then_its_manifest_and_executor_job() {
    let (_, ctx, mut api) = world(FakeServices::default());
    let batch = fixtures::payout_batch();
    let reconcile = tokio::spawn(controller::payout_batch::reconcile_payout_batch(
        Arc::new(batch.clone()),
        ctx.clone(),
    ));
    let call = api.expect_json_patch(BATCH).await;
    assert!(
        call.body.to_string().contains("dlock.io/executor-drained"),
        "{}",
        call.body
    );
    let mut with_finalizer = batch.clone();
    with_finalizer.metadata.finalizers = Some(vec!["dlock.io/executor-drained".to_owned()]);
    call.answer(&with_finalizer);
    reconcile.await.unwrap().unwrap();

    let reconcile = tokio::spawn(controller::payout_batch::reconcile_payout_batch(
        Arc::new(with_finalizer),
        ctx.clone(),
    ));
    let mut proxy = serde_json::to_value(fixtures::rail_proxy()).unwrap();
    proxy["spec"]["readTimeoutMs"] = json!(12_000);
    expect_manifest(&mut api, Some(proxy), "12000").await.echo();
    let call = api.expect(Method::GET, JOB).await;
    call.reply(404, &not_found());
    let call = api.expect_apply(JOB).await;
    // The worker count is the manifest's: a Job's pod template is immutable.
    let args = call.body["spec"]["template"]["spec"]["containers"][0]["args"].clone();
    assert!(!args.to_string().contains("--workers"), "{args}");
    let mut job = call.body.clone();
    job["status"] = json!({"active": 1});
    call.reply(200, &job);
    let call = api
        .expect_apply(&format!("{DLOCK}/payoutbatches/payroll-2026-12/status"))
        .await;
    assert_eq!(call.body["status"]["accepted"], true);
    assert_eq!(call.body["status"]["jobName"], "payroll-2026-12-executor");
    // Counts per state from paydb, and the ambiguous payouts by id (the executor's uuid5 ids).
    let second = dlock_executor::manifest::payout_id("payroll-2026-12", "emp-0002").to_string();
    assert_eq!(
        call.body["status"]["counts"],
        json!({"POSTED": 1, "RAIL_AMBIGUOUS": 1})
    );
    assert_eq!(call.body["status"]["ambiguous"], json!([second]));
    assert_eq!(call.body["status"]["ambiguousCount"], 1);
    assert_eq!(
        call.body["status"]["summary"],
        "1/2 POSTED, 1 RAIL_AMBIGUOUS"
    );
    // Still executing, and Degraded already: the ambiguous payout waits for a reconciliation,
    // named in the condition Argo CD shows.
    assert_eq!(call.body["status"]["conditions"][1]["status"], "True");
    let degraded = &call.body["status"]["conditions"][2];
    assert_eq!(
        (&degraded["type"], &degraded["status"], &degraded["reason"]),
        (&json!("Degraded"), &json!("True"), &json!("RailAmbiguous"))
    );
    assert!(
        degraded["message"].as_str().unwrap().contains(&second),
        "{degraded}"
    );
    assert_eq!(
        call.body["status"]["conditions"][3],
        json!({"type": "JobTemplateCurrent", "status": "True", "reason": "Current",
               "message": "", "lastTransitionTime": NOW, "observedGeneration": 1})
    );
    call.reply(
        200,
        &serde_json::to_value(fixtures::payout_batch()).unwrap(),
    );
    api.event("RailAmbiguous", Some("Warning")).await;
    reconcile.await.unwrap().unwrap();
    api.done().await;
}

const BATCH: &str = "/apis/dlock.io/v1alpha1/namespaces/default/payoutbatches/payroll-2026-12";
const JOB: &str = "/apis/batch/v1/namespaces/default/jobs/payroll-2026-12-executor";

/// The batch's RailProxy (`proxy`, or none by that name) says how long a submit may wait, and
/// the manifest ConfigMap carries that to the executor (`read_timeout_ms`). Returns the
/// manifest's apply, unanswered.
async fn expect_manifest(
    api: &mut ApiServerVerifier,
    proxy: Option<Value>,
    read_timeout_ms: &str,
) -> Call {
    let call = api
        .expect(Method::GET, &format!("{DLOCK}/railproxies/rail-proxy"))
        .await;
    match proxy {
        Some(proxy) => call.reply(200, &proxy),
        None => call.reply(404, &not_found()),
    }
    let call = api
        .expect_apply(&format!("{NS}/configmaps/payroll-2026-12-manifest"))
        .await;
    assert_eq!(
        call.body["data"]["rail-read-timeout-ms"], read_timeout_ms,
        "{}",
        call.body
    );
    call
}

/// What the API server answers a successful delete with.
fn success() -> Value {
    json!({"kind": "Status", "apiVersion": "v1", "status": "Success", "metadata": {}})
}

fn not_found() -> Value {
    json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "NotFound",
           "code": 404, "message": "not found", "metadata": {}})
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

/// A Job's pod template is immutable: a running batch whose workers change, or an operator
/// upgrade that changes the image, sends no Job patch (which would be refused with 422). The
/// manifest ConfigMap carries the new worker count; the outdated template is recorded in a
/// condition and an Event.
#[tokio::test]
async fn a_running_batch_keeps_its_job_when_workers_or_the_image_change() {
    let (_, ctx, mut api) = world(FakeServices::default());
    let mut batch = fixtures::payout_batch();
    batch.metadata.finalizers = Some(vec!["dlock.io/executor-drained".to_owned()]);
    let validated = dlock_operator::validate::payout_batch(&batch, &fixtures::settings()).unwrap();
    let mut running =
        serde_json::to_value(dlock_operator::build::job::executor_job(&validated)).unwrap();
    running["status"] = json!({"active": 1});
    let mut changed = batch.clone();
    changed.spec.workers = Some(3);
    changed.spec.image = Some("dlock:next".to_owned());
    changed.metadata.generation = Some(2);
    let reconcile = tokio::spawn(controller::payout_batch::reconcile_payout_batch(
        Arc::new(changed),
        ctx,
    ));
    // No RailProxy by that name: the executor waits the default read timeout.
    let call = expect_manifest(&mut api, None, "8000").await;
    assert!(
        call.body["data"]["payoutbatch.yaml"]
            .as_str()
            .unwrap()
            .contains("workers: 3"),
        "{}",
        call.body
    );
    call.echo();
    let call = api.expect(Method::GET, JOB).await;
    call.reply(200, &running);
    // No Job patch: the next call is the status.
    let call = api
        .expect_apply(&format!("{DLOCK}/payoutbatches/payroll-2026-12/status"))
        .await;
    let current = &call.body["status"]["conditions"][3];
    assert_eq!(current["type"], "JobTemplateCurrent");
    assert_eq!(current["status"], "False");
    assert_eq!(current["reason"], "Outdated");
    assert_eq!(call.body["status"]["conditions"][1]["status"], "True");
    call.reply(
        200,
        &serde_json::to_value(fixtures::payout_batch()).unwrap(),
    );
    api.event("JobTemplateOutdated", None).await;
    api.event("RailAmbiguous", Some("Warning")).await;
    reconcile.await.unwrap().unwrap();
    api.done().await;

    // Only the worker count changed: the template is the same, so it is current.
    let mut workers_only = batch.clone();
    workers_only.spec.workers = Some(3);
    let validated =
        dlock_operator::validate::payout_batch(&workers_only, &fixtures::settings()).unwrap();
    assert_eq!(
        dlock_operator::build::job::executor_job(&validated),
        serde_json::from_value(json!({
            "apiVersion": "batch/v1", "kind": "Job",
            "metadata": running["metadata"], "spec": running["spec"],
        }))
        .unwrap()
    );
}

/// Deleting a batch: the executor Job goes in the foreground first (its pods hold lock sessions
/// and claims outside Kubernetes), then the payouts that never reached the rail are cancelled
/// (ABANDONED), then the finalizer is removed.
#[tokio::test]
async fn deleting_a_payout_batch_drains_its_executor_before_the_finalizer_goes() {
    let (services, ctx, mut api) = world(FakeServices::default());
    let mut batch = fixtures::payout_batch();
    batch.metadata.finalizers = Some(vec!["dlock.io/executor-drained".to_owned()]);
    batch.metadata.deletion_timestamp = serde_json::from_value(json!(NOW)).unwrap();
    let reconcile = tokio::spawn(controller::payout_batch::reconcile_payout_batch(
        Arc::new(batch.clone()),
        ctx,
    ));
    let job_path = "/apis/batch/v1/namespaces/default/jobs/payroll-2026-12-executor";
    let call = api.expect(Method::DELETE, job_path).await;
    assert_eq!(call.body["propagationPolicy"], "Foreground");
    call.reply(200, &success());
    let call = api.expect(Method::GET, job_path).await;
    call.reply(404, &not_found());
    let call = api.expect(Method::POST, EVENTS).await;
    assert_eq!(call.body["reason"], "ExecutorDrained");
    // Only after the executor is gone: the cancel of every payout of the batch, under the
    // namespace's services.
    assert!(
        !services
            .calls()
            .iter()
            .any(|(c, _)| c.starts_with("CANCEL")),
        "nothing cancelled while the executor may run"
    );
    call.echo();
    let call = api.expect(Method::POST, EVENTS).await;
    assert_eq!(call.body["reason"], "PayoutsCancelled");
    let cancels: Vec<_> = services
        .calls()
        .into_iter()
        .filter(|(c, _)| c.starts_with("CANCEL"))
        .collect();
    assert_eq!(cancels.len(), 1, "{cancels:?}");
    assert_eq!(
        cancels[0].0,
        "CANCEL http://lock-server.default.svc:8080 http://payment-resource.default.svc:8080"
    );
    let first = dlock_executor::manifest::payout_id("payroll-2026-12", "emp-0001");
    assert_eq!(cancels[0].1["payouts"][0], format!("{first} acct-17"));
    assert_eq!(
        cancels[0].1["reason"],
        "the PayoutBatch default/payroll-2026-12 was deleted"
    );
    call.echo();
    let call = api.expect_json_patch(BATCH).await;
    assert!(call.body.to_string().contains("remove"), "{}", call.body);
    batch.metadata.finalizers = None;
    call.answer(&batch);
    reconcile.await.unwrap().unwrap();
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
    let error = dlock_operator::run::guarded(
        Arc::new(guard),
        ctx,
        "LockServer",
        controller::workloads::reconcile_lock_server,
    )
    .await
    .unwrap_err();
    assert!(error.is_permanent(), "{error}");
    api.done().await;
    assert!(services.calls().is_empty());
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
    let reconcile = tokio::spawn(controller::lock::reconcile_lock(Arc::new(lock), ctx));
    let call = api.next().await;
    assert_eq!(call.body["status"]["revocation"]["outcome"], "Refused");
    call.answer(&fixtures::lock());
    api.event("RevocationRefused", Some("Warning")).await;
    ended_without_a_service_call(reconcile, api, &services).await;
}

/// A scheduled Reconciliation becomes a CronJob, then a Ready status and an Event.
#[tokio::test]
async fn a_scheduled_reconciliation_gets_a_cron_job_and_a_ready_status() {
    let (_, ctx, mut api) = world(FakeServices::default());
    let object = fixtures::reconciliation(Some("0 * * * *"));
    let reconcile = tokio::spawn(controller::reconciliation::reconcile_reconciliation(
        Arc::new(object.clone()),
        ctx,
    ));
    let call = api
        .expect_apply("/apis/batch/v1/namespaces/default/cronjobs/hourly-reconcile")
        .await;
    assert_eq!(call.body["spec"]["concurrencyPolicy"], "Forbid");
    call.echo();
    let call = api.expect(Method::GET, &format!("{NS}/pods")).await;
    call.reply(200, &pod_list(vec![]));
    let call = api
        .expect_apply(&format!("{DLOCK}/reconciliations/hourly/status"))
        .await;
    assert_eq!(call.body["status"]["conditions"][0]["status"], "True");
    assert_eq!(call.body["status"]["lastRunJob"], "hourly-reconcile");
    call.answer(&object);
    api.event("Ready", None).await;
    reconcile.await.unwrap().unwrap();
    api.done().await;
}

/// The lock server lists at most so many held locks and says `truncated`: the listed keys are
/// mirrored, the LockServer gets `LocksMirrored: False` (and a Warning Event), and no Lock is
/// deleted — an unlisted key may well be held.
#[tokio::test]
async fn a_truncated_lock_list_deletes_no_lock_and_raises_a_condition() {
    let (services, ctx, mut api) = world(FakeServices {
        held: vec![held_lock()],
        truncated: true,
        ..FakeServices::default()
    });
    let reconcile = tokio::spawn(controller::workloads::reconcile_lock_server(
        Arc::new(ready_lock_server("3/3 replicas ready")),
        ctx,
    ));
    let call = answer_ready_lock_server_objects(&mut api).await;
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

/// A mirrored Lock nobody asked to revoke gets Ready once from the Lock controller, under its
/// own field manager and with none of the mirror's fields.
#[tokio::test]
async fn a_mirrored_lock_gets_ready_once_without_the_mirrors_fields() {
    let (ctx, mut api) = context(Arc::new(FakeServices::default()));
    let lock = fixtures::lock();
    let reconcile = tokio::spawn(controller::lock::reconcile_lock(
        Arc::new(lock.clone()),
        ctx.clone(),
    ));
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
    ready.status.as_mut().unwrap().conditions =
        serde_json::from_value(json!([condition("Ready", "True", "Available", "")])).unwrap();
    controller::lock::reconcile_lock(Arc::new(ready), ctx)
        .await
        .unwrap();
    api.done().await;
}

fn pod_list(items: Vec<Value>) -> Value {
    json!({"apiVersion": "v1", "kind": "PodList", "metadata": {}, "items": items})
}

/// A finished reconciler pod whose termination message is `message`.
fn reconciler_pod(name: &str, job: &str, exit_code: i32, finished: &str, message: &str) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": "default", "labels": {"job-name": job}},
        "status": {"phase": if exit_code == 0 { "Succeeded" } else { "Failed" },
            "containerStatuses": [{
                "name": "reconciler", "image": "dlock:test", "imageID": "", "ready": false,
                "restartCount": 0,
                "state": {"terminated": {"exitCode": exit_code, "finishedAt": finished,
                                         "message": message}},
            }]},
    })
}

/// Removing the schedule deletes the CronJob (no schedule keeps running in the background), runs
/// the reconciler once, and puts the findings the reconciler left as its termination message
/// into status: a critical one is Degraded. The run's findings are counted by class in the
/// operator's metrics.
#[tokio::test]
async fn a_removed_schedule_deletes_the_cron_job_and_the_findings_reach_status() {
    let (ctx, mut api) = context(Arc::new(FakeServices::default()));
    let object = fixtures::reconciliation(None);
    let reconcile = tokio::spawn(controller::reconciliation::reconcile_reconciliation(
        Arc::new(object.clone()),
        ctx.clone(),
    ));
    let call = api
        .expect(
            Method::DELETE,
            "/apis/batch/v1/namespaces/default/cronjobs/hourly-reconcile",
        )
        .await;
    assert_eq!(call.body["propagationPolicy"], "Background");
    call.reply(200, &success());
    api.event("ScheduleRemoved", None).await;
    let job_path = "/apis/batch/v1/namespaces/default/jobs/hourly-reconcile";
    let call = api.expect(Method::GET, job_path).await;
    call.reply(404, &not_found());
    let call = api.expect_apply(job_path).await;
    let container = &call.body["spec"]["template"]["spec"]["containers"][0];
    assert_eq!(
        container["terminationMessagePolicy"],
        "FallbackToLogsOnError"
    );
    assert!(
        container["env"]
            .as_array()
            .unwrap()
            .contains(&json!({"name": "DLOCK_TERMINATION_LOG", "value": "/dev/termination-log"}))
    );
    let mut job = call.body.clone();
    job["status"] = json!({"conditions": [{"type": "Failed", "status": "True",
                                           "message": "BackoffLimitExceeded"}]});
    call.reply(200, &job);
    let call = api.expect(Method::GET, &format!("{NS}/pods")).await;
    assert!(
        call.query
            .contains("app.kubernetes.io%2Fcomponent%3Dreconciler")
            && call.query.contains("dlock.io%2Finstance%3Dhourly"),
        "{}",
        call.query
    );
    let report = json!({"critical": 1, "warning": 0, "info": 2, "accountsChecked": 40,
        "payoutsChecked": 1000, "ambiguousFoundOnRail": 11, "ambiguousNotOnRail": 42,
        "doublePayments": 1, "transfersWithoutPayout": 3, "postedNotOnRail": 2,
        "releasedPaidOnRail": 1, "omitted": 1,
        "findings": ["critical double_payment payout-9: paid twice on the rail",
                     "info ambiguous_not_on_rail payout-3: not on the statement"]});
    call.reply(
        200,
        &pod_list(vec![
            reconciler_pod("old", "hourly-reconcile", 0, "2026-12-01T00:00:00Z", "{}"),
            reconciler_pod(
                "latest",
                "hourly-reconcile",
                2,
                "2026-12-02T17:00:00Z",
                &report.to_string(),
            ),
        ]),
    );
    let call = api
        .expect_apply(&format!("{DLOCK}/reconciliations/hourly/status"))
        .await;
    let status = &call.body["status"];
    assert_eq!(
        status["findings"],
        json!([
            "critical double_payment payout-9: paid twice on the rail",
            "info ambiguous_not_on_rail payout-3: not on the statement",
            "… 1 more (run `dlock reconcile` for all)",
        ])
    );
    let summary = "1 critical, 0 warning, 2 info; ambiguous payouts: 11 found on the rail, 42 \
                   not found; double payments: 1; transfers without a payout: 3; transfers \
                   differing from their payout: 0; posted payouts not on the rail: 2; released \
                   payouts paid on the rail: 1";
    assert_eq!(status["summary"], summary);
    assert_eq!(
        status["conditions"][2],
        condition("Degraded", "True", "CriticalFindings", summary)
    );
    assert_eq!(status["lastRunJob"], "hourly-reconcile");
    call.answer(&object);
    api.event("CriticalFindings", Some("Warning")).await;
    reconcile.await.unwrap().unwrap();
    api.done().await;
    let metrics = ctx.metrics.encode();
    for (class, count) in [
        ("rail_transfer_without_payout", 3),
        ("rail_transfer_differs_from_payout", 0),
        ("posted_payout_not_on_rail", 2),
        ("released_payout_paid_on_rail", 1),
        ("double_payment_on_rail", 1),
    ] {
        let sample =
            format!("dlock_operator_reconciliation_findings_total{{class=\"{class}\"}} {count}");
        assert!(
            metrics.lines().any(|l| l == sample),
            "{sample} in\n{metrics}"
        );
    }
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
    let reconcile = tokio::spawn(controller::workloads::reconcile_payment_resource(
        Arc::new(object),
        ctx,
    ));

    expect_proof_keys_create(&mut api)
        .await
        .reply(409, &already_exists("dlock-fencing-proof-keys"));
    let call = api
        .expect_apply(&format!("{NS}/configmaps/payment-resource"))
        .await;
    assert_eq!(
        call.body["data"]["config.toml"],
        "\"server.listen\" = \"0.0.0.0:8080\"\n\"auth.mode\" = \"none\"\n\"fencing.proof-keys-file\" = \"/etc/dlock/fencing-proof-keys/keys\"\n"
    );
    call.echo();
    let call = api.expect_service_and_deployment("payment-resource").await;
    let pod = &call.body["spec"]["template"]["spec"];
    assert_eq!(pod["automountServiceAccountToken"], false);
    assert!(pod.get("serviceAccountName").is_none());
    let body = ready_deployment(call.body.clone(), 3);
    call.reply(200, &body);
    api.echo_applies(after_deployment("payment-resource")).await;
    let call = api
        .expect_apply(&format!("{DLOCK}/paymentresources/payment-resource/status"))
        .await;
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
    let body = ready_deployment(call.body.clone(), 3);
    call.reply(200, &body);
    api.echo_applies(after_deployment("payment-resource")).await;
    api.expect_apply(&format!("{DLOCK}/paymentresources/payment-resource/status"))
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
    let reconcile = tokio::spawn(controller::workloads::reconcile_payment_resource(
        object.clone(),
        ctx,
    ));
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
    let reconcile = tokio::spawn(controller::workloads::reconcile_payment_resource(
        object, ctx,
    ));
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
    let reconcile = tokio::spawn(controller::workloads::reconcile_payment_resource(
        Arc::new(object),
        ctx,
    ));
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
    let reconcile = tokio::spawn(controller::workloads::reconcile_payment_resource(
        Arc::new(fixtures::payment_resource()),
        ctx,
    ));
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
    let degraded = &call.conditions()[2];
    assert_eq!(degraded["reason"], "ProofKeysFailed", "{degraded}");
    assert!(
        degraded["message"]
            .as_str()
            .unwrap()
            .contains("needs `create` on Secrets"),
        "{degraded}"
    );
    call.answer(&fixtures::payment_resource());
    api.event("ProofKeysFailed", Some("Warning")).await;
    let error = reconcile.await.unwrap().unwrap_err();
    assert!(
        matches!(error, controller::Error::ProofKeys { .. }),
        "{error}"
    );
    api.done().await;
}
