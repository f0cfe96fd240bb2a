//! Each controller's conversation with the API server, through kube's mock service: the exact
//! method, path, field manager and body of every call, in order, and a timeout that catches a
//! call that never came (or one that should not have been made).
//!
//! One file per controller, and one for what they all do alike; the fake services, the API
//! server verifier and the paths they share are here.

mod every_controller;
mod lock;
mod payout_batch;
mod reconciliation;
mod revocation;
mod workloads;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use dlock_contract::client::ClientError;
use dlock_contract::lock::{HeldLocks, LockGrant, LockInfo, Revocation, RevokeRequest};
use dlock_contract::payment::{FenceResponse, PayoutState};
use dlock_contract::rail::{HighWater, HighWaterRequest};
use dlock_contract::revoke::{FenceCall, RevokeSteps, StepFuture};
use dlock_executor::cancel::CancelReport;
use dlock_operator::controller::lock::{reconcile_lock, reconcile_lock_revocation};
use dlock_operator::controller::payout_batch::reconcile_payout_batch;
use dlock_operator::controller::reconciliation::reconcile_reconciliation;
use dlock_operator::controller::workloads::{reconcile_lock_server, reconcile_payment_resource};
use dlock_operator::controller::{self, Context};
use dlock_operator::metrics::Metrics;
use dlock_operator::services::{Cancel, ServiceError, ServiceFuture, Services, Steps};
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
    held: Vec<LockGrant>,
    truncated: bool,
    rail_down: bool,
    /// The token of the key's grant at the lock server (L7); 41, the fixture Lock's, when unset.
    live_token: Option<i64>,
    /// Nothing holds the key at the lock server.
    not_held: bool,
    /// L8 gets no answer.
    lock_down: bool,
    /// The revocation flow's reads of the key (L7) fail after this many.
    reads_ok: Option<usize>,
    /// The revocation flow's reads of the key so far.
    reads: AtomicUsize,
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
    ) -> ServiceFuture<'a, Vec<Option<PayoutState>>> {
        self.record(
            format!("GET {url}/v1/payouts/{{id}} x{}", ids.len()),
            json!(ids),
        );
        let states = ids
            .iter()
            .enumerate()
            .map(|(i, _)| {
                if i == 0 {
                    Some(PayoutState::Posted)
                } else {
                    Some(PayoutState::RailAmbiguous)
                }
            })
            .collect();
        Box::pin(async move { Ok(states) })
    }
    fn held_locks<'a>(&'a self, url: &'a str) -> ServiceFuture<'a, HeldLocks> {
        self.record(format!("GET {url}/v1/locks"), Value::Null);
        Box::pin(async move {
            Ok(HeldLocks {
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
    /// The key as [`FakeServices`] holds it (`live_token`, `not_held`); no answer once
    /// `reads_ok` reads have been made.
    fn read_lock<'a>(&'a self, key: &'a str) -> StepFuture<'a, LockInfo> {
        let url = &self.target.lock_server_url;
        let services = self.services;
        services.record(format!("GET {url}/v1/locks/{key}"), Value::Null);
        let n = services.reads.fetch_add(1, Ordering::SeqCst);
        if services.reads_ok.is_some_and(|ok| n >= ok) {
            return Box::pin(std::future::ready(Err(ClientError::Transport {
                url: url.clone(),
                message: "connection reset".to_owned(),
                connect: false,
                timeout: false,
            })));
        }
        let token = (!services.not_held).then(|| services.live_token.unwrap_or(41));
        Box::pin(std::future::ready(Ok(LockInfo {
            key: key.to_owned(),
            held: token.is_some(),
            owner_id: token.map(|_| "executor-7".to_owned()),
            session_id: None,
            fencing_token: token,
            acquired_at: None,
            expires_at: None,
            waiter_count: 0,
        })))
    }
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
                operator: request.operator.clone(),
                identity: "dlock-operator".to_owned(),
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

/// `result` (a revocation's result, as applied) is OutcomeUnknown for `token`, with no
/// revocation id: the answer was lost.
fn assert_outcome_unknown(result: &Value, token: i64) {
    assert_eq!(
        (
            &result["outcome"],
            &result["revokedToken"],
            &result["revocationId"]
        ),
        (&json!("OutcomeUnknown"), &json!(token), &Value::Null),
        "{result}"
    );
}

/// `revocation` (a revocation's result, as applied) is Refused, its summary saying `why`.
fn assert_refused(revocation: &Value, why: &str) {
    assert_eq!(revocation["outcome"], "Refused");
    assert!(
        revocation["summary"].as_str().unwrap().contains(why),
        "{revocation}"
    );
}

/// The stack of the fixtures: one LockServer, PaymentResource and RailProxy in the namespace.
async fn answer_fence_targets(api: &mut ApiServerVerifier) {
    answer_targets(api, &["payment-resource"], &["rail-proxy"]).await;
}

/// The namespace's objects a revocation looks its fences up in: the fixtures' LockServer, the
/// PaymentResources `payments` and the RailProxies `rails`, in the order the operator lists them.
async fn answer_targets(api: &mut ApiServerVerifier, payments: &[&str], rails: &[&str]) {
    reply_names(api.next().await, "lockservers", &["lock-server"]);
    reply_names(api.next().await, "paymentresources", payments);
    reply_names(api.next().await, "railproxies", rails);
}

/// Runs `reconcile` on `object` in the background, as the controller runtime would, while the
/// test answers its calls to the API server.
fn spawn_reconcile<K, F, Fut>(
    reconcile: F,
    object: impl Into<Arc<K>>,
    ctx: Arc<Context>,
) -> tokio::task::JoinHandle<Fut::Output>
where
    F: FnOnce(Arc<K>, Arc<Context>) -> Fut,
    Fut: Future + Send + 'static,
    Fut::Output: Send + 'static,
{
    tokio::spawn(reconcile(object.into(), ctx))
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
    /// The reason and message of the `Degraded` condition sent (the third).
    fn degraded(&self) -> (String, String) {
        let degraded = &self.body["status"]["conditions"][2];
        assert_eq!(degraded["type"], "Degraded", "{}", self.body);
        let text = |field: &str| degraded[field].as_str().unwrap().to_owned();
        (text("reason"), text("message"))
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

fn condition(type_: &str, status: &str, reason: &str, message: &str) -> Value {
    json!({
        "type": type_, "status": status, "reason": reason, "message": message,
        "lastTransitionTime": NOW, "observedGeneration": 1,
    })
}

/// What the API server answers a successful delete with.
fn success() -> Value {
    json!({"kind": "Status", "apiVersion": "v1", "status": "Success", "metadata": {}})
}

fn not_found() -> Value {
    json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "NotFound",
           "code": 404, "message": "not found", "metadata": {}})
}
