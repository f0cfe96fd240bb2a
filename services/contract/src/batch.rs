//! Batch endpoints (docs/contract.md#batches): one request carries the items of one step for
//! many payouts, and each item is answered exactly as the single endpoint answers it.
//!
//! An item is the single request it stands for, written as JSON: what the single request carries
//! in its path, its `X-Fencing-Token`, `X-Fencing-Proof`, `X-Idempotency-Key` and `traceparent`
//! headers and its body. The service turns each item back into that request ([`Item::single`])
//! and runs it through the same handler, so a batch cannot do or answer anything the single
//! endpoints would not. `X-Owner-Id` and the credential are the batch request's own and apply to
//! every item.
//!
//! On the client side, [`Batches`] lets concurrent calls of one step share a batch request. No
//! timer, so a lone call is never delayed and the batch size follows the load:
//! - an acquire (which may wait for a held lock) and a submit (which waits for the rail) never
//!   wait for the answer of a batch request already in flight: the calls that are ready
//!   together (the workers one answer woke) go in one request
//!   ([`crate::group_commit::GroupCommit::pipelined`]);
//! - a claim, a post and a release, each one bounded write, wait for the batch request of
//!   their step in flight, and the calls that came meanwhile go together in the next one.
//!
//! A batch of one item goes to the single endpoint as the single request it stands for
//! ([`send_single`]): a batch request carrying one item costs more than the request it wraps
//! (docs/benchmarks.md).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use http::Method;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::client::{ClientError, Hop, send};
use crate::error::ErrorBody;
use crate::group_commit::{GroupCommit, Observer};
use crate::headers;
use crate::lock::{AcquireRequest, LockGrant, ReleaseRequest};
use crate::payment::{
    ClaimRequest, ClaimResponse, PayoutState, PostRequest, PostResponse, RailOutcome,
};
use crate::rail::{SubmissionRequest, SubmissionResponse};

/// The most items one batch request may carry; more is `400 VALIDATION_FAILED` (field `items`)
/// and nothing is done.
pub const MAX_ITEMS: usize = 64;

/// A batch request's body.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct BatchRequest<T> {
    /// 1 to 64 items (`MAX_ITEMS`), answered in this order; none or more is `400
    /// VALIDATION_FAILED` for the whole request, and nothing runs.
    #[schema(min_items = 1, max_items = 64)]
    pub items: Vec<T>,
}

/// A batch request's answer (`200`): one answer per item, in the request's order.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct BatchAnswer {
    /// As many answers as the request has items.
    pub items: Vec<ItemAnswer>,
}

/// What the single endpoint answers for this item: its status and its body (the success body or
/// the error envelope; none for `204`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct ItemAnswer {
    /// The single endpoint's HTTP status for this item.
    pub status: u16,
    /// The single endpoint's body for this item: its success body, or its error envelope
    /// (`ErrorBody`); absent for `204`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub body: Option<serde_json::Value>,
}

/// The single request an item stands for.
#[derive(Debug, Clone, PartialEq)]
pub struct Single {
    pub method: Method,
    /// The path, each parameter percent-encoded: an item names a key or a payout, never a route.
    pub path: String,
    /// `X-Fencing-Token`, `X-Fencing-Proof`, `X-Idempotency-Key`, `traceparent`, as given.
    pub headers: Vec<(&'static str, String)>,
    pub body: serde_json::Value,
}

/// One step's item.
pub trait Item: Serialize + DeserializeOwned + Send + Sync + 'static {
    /// `POST` here takes a [`BatchRequest`] of this item.
    const PATH: &'static str;
    /// The single endpoint, as `METHOD /path/{param}`, for documents and messages.
    const SINGLE: &'static str;
    /// The single request this item stands for.
    fn single(&self) -> Single;
}

/// Percent-encodes everything but RFC 3986's unreserved characters, `:` and `@` (what a path
/// segment may hold as it is), so that a parameter stays one path segment whatever it holds
/// (`a/revoke` becomes `a%2Frevoke`, and the handler refuses it as a key), and a valid key
/// ([`crate::lock::KEY_PATTERN`]) is the path the single client sends for it.
pub fn path_segment(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for byte in text.bytes() {
        if byte.is_ascii_alphanumeric() || matches!(byte, b'-' | b'.' | b'_' | b'~' | b':' | b'@') {
            out.push(char::from(byte));
        } else {
            out.push_str(&format!("%{byte:02X}"));
        }
    }
    out
}

fn fenced_headers(
    token: i64,
    proof: Option<&str>,
    idempotency_key: Option<&str>,
    traceparent: Option<&str>,
) -> Vec<(&'static str, String)> {
    let mut out = vec![(headers::FENCING_TOKEN, token.to_string())];
    if let Some(proof) = proof {
        out.push((headers::FENCING_PROOF, proof.to_owned()));
    }
    if let Some(key) = idempotency_key {
        out.push((headers::IDEMPOTENCY_KEY, key.to_owned()));
    }
    if let Some(traceparent) = traceparent {
        out.push((headers::TRACEPARENT, traceparent.to_owned()));
    }
    out
}

fn to_value<T: Serialize>(body: &T) -> serde_json::Value {
    serde_json::to_value(body).unwrap_or(serde_json::Value::Null)
}

/// L4 for one key: `POST /v1/batches/acquire` on the lock server.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct AcquireItem {
    /// L4's `{key}`, percent-encoded into its path: a key holding `/` is this item's `400`.
    pub key: String,
    /// L4's body `sessionId`.
    pub session_id: Uuid,
    /// L4's body `ttlMillis`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttl_millis: Option<i64>,
    /// L4's body `waitMillis`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub wait_millis: Option<i64>,
    /// The item's own `traceparent`, so that it stays in its payout's trace.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub traceparent: Option<String>,
}

impl Item for AcquireItem {
    const PATH: &'static str = "/v1/batches/acquire";
    const SINGLE: &'static str = "POST /v1/locks/{key}/acquire";
    fn single(&self) -> Single {
        Single {
            method: Method::POST,
            path: format!("/v1/locks/{}/acquire", path_segment(&self.key)),
            headers: self
                .traceparent
                .iter()
                .map(|t| (headers::TRACEPARENT, t.clone()))
                .collect(),
            body: to_value(&AcquireRequest {
                session_id: self.session_id,
                ttl_millis: self.ttl_millis,
                wait_millis: self.wait_millis,
            }),
        }
    }
}

/// L6 for one grant: `POST /v1/batches/release` on the lock server.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ReleaseItem {
    /// L6's `{key}`, percent-encoded into its path: a key holding `/` is this item's `400`.
    pub key: String,
    /// L6's `sessionId`.
    pub session_id: Uuid,
    /// L6's `X-Fencing-Token`, as a JSON integer, checked as that header is: `0` or a
    /// negative one is this item's `400`.
    pub fencing_token: i64,
    /// The item's own `traceparent`, so that it stays in its payout's trace.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub traceparent: Option<String>,
}

impl Item for ReleaseItem {
    const PATH: &'static str = "/v1/batches/release";
    const SINGLE: &'static str = "DELETE /v1/locks/{key}";
    fn single(&self) -> Single {
        Single {
            method: Method::DELETE,
            path: format!("/v1/locks/{}", path_segment(&self.key)),
            headers: fenced_headers(self.fencing_token, None, None, self.traceparent.as_deref()),
            body: to_value(&ReleaseRequest {
                session_id: self.session_id,
            }),
        }
    }
}

/// P2 for one payout: `POST /v1/batches/claim` on the payment resource.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ClaimItem {
    /// P2's `{payoutId}`.
    pub payout_id: Uuid,
    /// P2's `X-Fencing-Token`, as a JSON integer, checked as that header is: `0` or a
    /// negative one is this item's `400`.
    pub fencing_token: i64,
    /// P2's `X-Fencing-Proof`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fencing_proof: Option<String>,
    /// P2's `X-Idempotency-Key`.
    pub idempotency_key: String,
    /// P2's body `expectedState`.
    pub expected_state: PayoutState,
    /// The item's own `traceparent`, so that it stays in its payout's trace.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub traceparent: Option<String>,
}

impl Item for ClaimItem {
    const PATH: &'static str = "/v1/batches/claim";
    const SINGLE: &'static str = "POST /v1/payouts/{payoutId}/claim";
    fn single(&self) -> Single {
        Single {
            method: Method::POST,
            path: format!("/v1/payouts/{}/claim", self.payout_id),
            headers: fenced_headers(
                self.fencing_token,
                self.fencing_proof.as_deref(),
                Some(&self.idempotency_key),
                self.traceparent.as_deref(),
            ),
            body: to_value(&ClaimRequest {
                expected_state: self.expected_state,
            }),
        }
    }
}

/// P3 for one payout: `POST /v1/batches/post` on the payment resource.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PostItem {
    /// P3's `{payoutId}`.
    pub payout_id: Uuid,
    /// P3's `X-Fencing-Token`, as a JSON integer, checked as that header is: `0` or a
    /// negative one is this item's `400`.
    pub fencing_token: i64,
    /// P3's `X-Fencing-Proof`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fencing_proof: Option<String>,
    /// P3's `X-Idempotency-Key`.
    pub idempotency_key: String,
    /// P3's body `railReference`.
    pub rail_reference: String,
    /// P3's body `submissionId`.
    pub submission_id: Uuid,
    /// P3's body `railOutcome`.
    pub rail_outcome: RailOutcome,
    /// The item's own `traceparent`, so that it stays in its payout's trace.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub traceparent: Option<String>,
}

impl Item for PostItem {
    const PATH: &'static str = "/v1/batches/post";
    const SINGLE: &'static str = "POST /v1/payouts/{payoutId}/post";
    fn single(&self) -> Single {
        Single {
            method: Method::POST,
            path: format!("/v1/payouts/{}/post", self.payout_id),
            headers: fenced_headers(
                self.fencing_token,
                self.fencing_proof.as_deref(),
                Some(&self.idempotency_key),
                self.traceparent.as_deref(),
            ),
            body: to_value(&PostRequest {
                rail_reference: self.rail_reference.clone(),
                submission_id: self.submission_id,
                rail_outcome: self.rail_outcome,
            }),
        }
    }
}

/// One submission: `POST /v1/batches/submit` on the rail proxy. Each is forwarded at most once,
/// exactly as `POST /v1/rail/submissions` would be; never send an item again after any answer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SubmitItem {
    /// The submission's `X-Fencing-Token`, as a JSON integer, checked as that header is: `0` or a
    /// negative one is this item's `400`.
    pub fencing_token: i64,
    /// The submission's `X-Fencing-Proof`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fencing_proof: Option<String>,
    /// The submission's `X-Idempotency-Key`.
    pub idempotency_key: String,
    /// The single request's body.
    pub submission: SubmissionRequest,
    /// The item's own `traceparent`, so that it stays in its payout's trace.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub traceparent: Option<String>,
}

impl Item for SubmitItem {
    const PATH: &'static str = "/v1/batches/submit";
    const SINGLE: &'static str = "POST /v1/rail/submissions";
    fn single(&self) -> Single {
        Single {
            method: Method::POST,
            path: "/v1/rail/submissions".into(),
            headers: fenced_headers(
                self.fencing_token,
                self.fencing_proof.as_deref(),
                Some(&self.idempotency_key),
                self.traceparent.as_deref(),
            ),
            body: to_value(&self.submission),
        }
    }
}

/// Sends `items` as one batch request on `hop` and reads each item's answer as the single
/// endpoint's: `Ok(None)` for a 204, the body as `T` for another 2xx, the envelope as
/// [`ClientError::Api`] otherwise. A batch that fails as a whole (no answer, or an error
/// envelope for the request) gives every item that error.
pub async fn send_batch<I: Item, T: DeserializeOwned>(
    hop: &Hop,
    items: &[I],
    timeout: Duration,
) -> Vec<Result<Option<T>, ClientError>> {
    let n = items.len();
    let (url, request) = hop.request(reqwest::Method::POST, I::PATH, timeout);
    /// [`BatchRequest`] over borrowed items.
    #[derive(Serialize)]
    struct Out<'a, I> {
        items: &'a [I],
    }
    let request = Hop::json(request, &Out { items });
    let answer = match send::<BatchAnswer>(&url, request).await {
        Ok(Some(answer)) if answer.items.len() == n => answer,
        Ok(other) => {
            let error = ClientError::Protocol {
                url,
                message: format!(
                    "a batch of {n} items answered {} answers",
                    other.map_or(0, |a| a.items.len())
                ),
            };
            return (0..n).map(|_| Err(error.clone())).collect();
        }
        Err(error) => return (0..n).map(|_| Err(error.clone())).collect(),
    };
    answer
        .items
        .into_iter()
        .map(|item| item_result(&url, item))
        .collect()
}

/// One item's answer as the single endpoint's result.
fn item_result<T: DeserializeOwned>(url: &str, item: ItemAnswer) -> Result<Option<T>, ClientError> {
    let protocol = |message: String| ClientError::Protocol {
        url: url.to_owned(),
        message,
    };
    match item.status {
        204 => Ok(None),
        200..=299 => {
            let body = item
                .body
                .ok_or_else(|| protocol(format!("item {} without a body", item.status)))?;
            serde_json::from_value(body)
                .map(Some)
                .map_err(|e| protocol(format!("item {} body did not decode: {e}", item.status)))
        }
        status => {
            let body = item
                .body
                .and_then(|b| serde_json::from_value::<ErrorBody>(b).ok())
                .ok_or_else(|| protocol(format!("item {status} without the error envelope")))?;
            Err(ClientError::Api { status, body })
        }
    }
}

type Answer<T> = Result<Option<T>, ClientError>;
type Queue<I, T> = GroupCommit<(Hop, Duration), I, Answer<T>>;

/// Sends `item` alone as the single request it stands for ([`Item::single`]) on `hop`, with
/// the item's own `traceparent`: what the single client sends for it, answered as the single
/// endpoint answers.
pub async fn send_single<I: Item, T: DeserializeOwned>(
    hop: &Hop,
    item: &I,
    timeout: Duration,
) -> Answer<T> {
    let Single {
        method,
        path,
        headers,
        body,
    } = item.single();
    let (traceparent, headers): (Vec<_>, Vec<_>) = headers
        .into_iter()
        .partition(|(name, _)| *name == headers::TRACEPARENT);
    let traceparent = match traceparent.into_iter().next() {
        Some((_, traceparent)) => traceparent,
        None => hop.traceparent(),
    };
    let (url, request) = hop.request_traced(method, &path, timeout, &traceparent);
    let request = headers.into_iter().fold(request, |request, (name, value)| {
        request.header(name, value)
    });
    send(&url, Hop::json(request, &body)).await
}

/// The one place a step's batch is sent: one item to its single endpoint, more in a batch
/// request.
fn run<I: Item, T: DeserializeOwned + Send + 'static>(
    (hop, timeout): (Hop, Duration),
    items: Vec<I>,
) -> Pin<Box<dyn Future<Output = Vec<Answer<T>>> + Send + 'static>> {
    Box::pin(async move {
        match <[I; 1]>::try_from(items) {
            Ok([item]) => vec![send_single(&hop, &item, timeout).await],
            Err(items) => send_batch(&hop, &items, timeout).await,
        }
    })
}

/// A client's items hold no keys: the service's own queues keep one payout and one account per
/// transaction, and a batch request may carry both holders of an account.
fn no_keys<I>(_: &I) -> Vec<String> {
    Vec::new()
}

/// Tells nobody: a client's batches are measured by the services they reach.
struct Unobserved;

impl Observer for Unobserved {
    fn queued(&self, _: usize) {}
    fn batch(&self, _: usize) {}
}

/// One client's batch queues, one per step, shared by every clone of the client (its traces and
/// credentials included). See the module's documentation.
pub struct Batches {
    pub(crate) acquire: Queue<AcquireItem, LockGrant>,
    pub(crate) release: Queue<ReleaseItem, ()>,
    pub(crate) claim: Queue<ClaimItem, ClaimResponse>,
    pub(crate) post: Queue<PostItem, PostResponse>,
    pub(crate) submit: Queue<SubmitItem, SubmissionResponse>,
}

impl std::fmt::Debug for Batches {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Batches")
    }
}

impl Batches {
    /// Queues whose batch requests carry at most `max` items (1 to [`MAX_ITEMS`]).
    pub fn new(max: usize) -> Arc<Self> {
        let max = max.clamp(1, MAX_ITEMS);
        Arc::new(Self {
            // An acquire may wait for a held lock and a submit for the rail: nothing queues
            // behind them.
            acquire: GroupCommit::new(max, no_keys, run, Arc::new(Unobserved)).pipelined(),
            submit: GroupCommit::new(max, no_keys, run, Arc::new(Unobserved)).pipelined(),
            // A claim, a post and a release are one bounded write each: the calls that come
            // while one is in flight go together in the next.
            release: GroupCommit::new(max, no_keys, run, Arc::new(Unobserved)),
            claim: GroupCommit::new(max, no_keys, run, Arc::new(Unobserved)),
            post: GroupCommit::new(max, no_keys, run, Arc::new(Unobserved)),
        })
    }
}

/// Queues `item` on `queue` and waits for its answer; `url` names the service in the error a
/// batch that died without answering gives.
pub(crate) async fn call<I: Item, T: Send + 'static>(
    queue: &Queue<I, T>,
    hop: &Hop,
    timeout: Duration,
    item: I,
) -> Answer<T> {
    match queue.submit((hop.clone(), timeout), item).await {
        Some(answer) => answer,
        None => Err(ClientError::Transport {
            url: format!("{}{}", hop.base(), I::PATH),
            message: "the batch carrying this request stopped without an answer".into(),
            connect: false,
            timeout: false,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A request as a real server received it.
    #[derive(Debug, Clone)]
    struct Received {
        method: Method,
        path: String,
        headers: http::HeaderMap,
        body: serde_json::Value,
    }

    type Log = Arc<std::sync::Mutex<Vec<Received>>>;

    /// Records every request and answers it as the lock server answers a release: `204`, or for
    /// a batch request one `204` item per item.
    async fn record(
        axum::extract::State(log): axum::extract::State<Log>,
        request: axum::extract::Request,
    ) -> axum::response::Response {
        use axum::response::IntoResponse as _;
        let (parts, body) = request.into_parts();
        let bytes = axum::body::to_bytes(body, 1 << 20)
            .await
            .unwrap_or_default();
        let body: serde_json::Value =
            serde_json::from_slice(&bytes).unwrap_or(serde_json::Value::Null);
        let items = body["items"].as_array().map_or(0, Vec::len);
        let batch = parts.uri.path().starts_with("/v1/batches/");
        log.lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(Received {
                method: parts.method,
                path: parts.uri.path().to_owned(),
                headers: parts.headers,
                body,
            });
        if !batch {
            return http::StatusCode::NO_CONTENT.into_response();
        }
        let answers = (0..items).map(|_| ItemAnswer {
            status: 204,
            body: None,
        });
        axum::Json(BatchAnswer {
            items: answers.collect(),
        })
        .into_response()
    }

    /// A real HTTP server on a free port that records what it receives: its base URL and log.
    async fn recording_server() -> (String, Log) {
        let log = Log::default();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .unwrap_or_else(|e| panic!("bind: {e}"));
        let address = listener
            .local_addr()
            .unwrap_or_else(|e| panic!("local address: {e}"));
        let app = axum::Router::new().fallback(record).with_state(log.clone());
        tokio::spawn(async move { axum::serve(listener, app).await });
        (format!("http://{address}"), log)
    }

    fn received(log: &Log) -> Vec<Received> {
        log.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    fn release_item(key: &str, token: i64) -> ReleaseItem {
        ReleaseItem {
            key: key.into(),
            session_id: Uuid::nil(),
            fencing_token: token,
            traceparent: None,
        }
    }

    /// A call the client's queue hands alone goes to the single endpoint as exactly the request
    /// the client sends without batching: method, path, headers (the traceparent in the same
    /// trace) and body.
    #[tokio::test]
    async fn a_batch_of_one_sends_the_single_request() {
        let (base, log) = recording_server().await;
        let http = crate::client::http_client().unwrap_or_else(|e| panic!("client: {e}"));
        let client = crate::client::LockClient::with_http(&base, "owner-1", http)
            .as_operator("secret")
            .in_trace("0af7651916cd43dd8448eb211c80319c");
        let session = Uuid::new_v4();
        client
            .release("payout:acct-1", session, 7)
            .await
            .unwrap_or_else(|e| panic!("single: {e}"));
        client
            .with_batching(8)
            .release("payout:acct-1", session, 7)
            .await
            .unwrap_or_else(|e| panic!("batching, alone: {e}"));
        let [single, alone] = <[Received; 2]>::try_from(received(&log))
            .unwrap_or_else(|r| panic!("two requests, got {r:?}"));
        assert_eq!(single.method, Method::DELETE);
        assert_eq!(single.path, "/v1/locks/payout:acct-1");
        assert_eq!(alone.method, single.method);
        assert_eq!(alone.path, single.path);
        assert_eq!(alone.body, single.body);
        let trace = |r: &Received| {
            let header = r.headers.get(headers::TRACEPARENT).map(|v| v.as_bytes());
            let text = String::from_utf8_lossy(header.unwrap_or_default()).into_owned();
            text.split('-').nth(1).map(str::to_owned)
        };
        assert_eq!(
            trace(&alone).as_deref(),
            Some("0af7651916cd43dd8448eb211c80319c")
        );
        assert_eq!(trace(&alone), trace(&single));
        let others = |r: &Received| {
            let mut headers = r.headers.clone();
            headers.remove(headers::TRACEPARENT);
            headers
        };
        assert_eq!(others(&alone), others(&single));
        assert_eq!(
            single
                .headers
                .get(headers::FENCING_TOKEN)
                .map(|v| v.as_bytes()),
            Some(&b"7"[..])
        );
    }

    /// Two or more items a queue hands together go as one batch request, each answered.
    #[tokio::test]
    async fn two_items_or_more_send_one_batch_request() {
        let (base, log) = recording_server().await;
        let http = crate::client::http_client().unwrap_or_else(|e| panic!("client: {e}"));
        let hop = Hop::with_http(&base, "owner-1", http);
        for n in [2, 3] {
            let items: Vec<_> = (1..=n).map(|t| release_item("payout:a", t)).collect();
            let answers =
                run::<ReleaseItem, ()>((hop.clone(), Duration::from_secs(2)), items).await;
            assert_eq!(answers.len(), n as usize);
            assert!(answers.iter().all(|a| matches!(a, Ok(None))), "{answers:?}");
        }
        let answers =
            run::<ReleaseItem, ()>((hop, Duration::from_secs(2)), vec![release_item("k", 1)]).await;
        assert!(matches!(answers[..], [Ok(None)]), "{answers:?}");
        let sent: Vec<_> = received(&log)
            .iter()
            .map(|r| {
                (
                    r.method.clone(),
                    r.path.clone(),
                    r.body["items"].as_array().map(Vec::len),
                )
            })
            .collect();
        assert_eq!(
            sent,
            [
                (Method::POST, ReleaseItem::PATH.to_owned(), Some(2)),
                (Method::POST, ReleaseItem::PATH.to_owned(), Some(3)),
                (Method::DELETE, "/v1/locks/k".to_owned(), None),
            ]
        );
    }

    /// utoipa takes only a literal for `max_items`: the documents the services serve (committed
    /// in docs/openapi/, kept equal to the services' by scripts/check-openapi) must say
    /// [`MAX_ITEMS`].
    #[test]
    fn the_api_documents_say_max_items() {
        for (name, text) in [
            (
                "lock-server",
                include_str!("../../../docs/openapi/lock-server.json"),
            ),
            (
                "payment-resource",
                include_str!("../../../docs/openapi/payment-resource.json"),
            ),
            (
                "rail-proxy",
                include_str!("../../../docs/openapi/rail-proxy.json"),
            ),
        ] {
            let document: serde_json::Value =
                serde_json::from_str(text).unwrap_or_else(|e| panic!("{name}: {e}"));
            let schemas = document["components"]["schemas"]
                .as_object()
                .unwrap_or_else(|| panic!("{name}: no schemas"));
            let batches: Vec<_> = schemas
                .iter()
                .filter(|(schema, _)| schema.starts_with("BatchRequest"))
                .collect();
            assert!(!batches.is_empty(), "{name} documents no batch");
            for (schema, body) in batches {
                assert_eq!(
                    body["properties"]["items"]["maxItems"].as_u64(),
                    Some(MAX_ITEMS as u64),
                    "{name}: {schema}"
                );
            }
        }
    }

    #[test]
    fn a_parameter_stays_one_path_segment() {
        assert_eq!(path_segment("payout:acct-1"), "payout:acct-1");
        assert_eq!(path_segment("a/revoke?x=1"), "a%2Frevoke%3Fx%3D1");
        assert_eq!(path_segment("é"), "%C3%A9");
        let item = AcquireItem {
            key: "k/revoke".into(),
            session_id: Uuid::nil(),
            ttl_millis: None,
            wait_millis: None,
            traceparent: None,
        };
        assert_eq!(item.single().path, "/v1/locks/k%2Frevoke/acquire");
    }

    #[test]
    fn an_item_carries_what_the_single_request_carries() {
        let item = ClaimItem {
            payout_id: Uuid::nil(),
            fencing_token: 7,
            fencing_proof: Some("k1.ab".into()),
            idempotency_key: "idem-1".into(),
            expected_state: PayoutState::Pending,
            traceparent: None,
        };
        let single = item.single();
        assert_eq!(single.method, Method::POST);
        assert_eq!(
            single.path,
            "/v1/payouts/00000000-0000-0000-0000-000000000000/claim"
        );
        assert_eq!(
            single.headers,
            vec![
                (headers::FENCING_TOKEN, "7".to_owned()),
                (headers::FENCING_PROOF, "k1.ab".to_owned()),
                (headers::IDEMPOTENCY_KEY, "idem-1".to_owned()),
            ]
        );
        assert_eq!(single.body, serde_json::json!({"expectedState": "PENDING"}));
    }

    #[test]
    fn item_answers_read_as_the_single_endpoints() {
        let ok = ItemAnswer {
            status: 204,
            body: None,
        };
        assert!(matches!(item_result::<()>("u", ok), Ok(None)));
        let refused = ItemAnswer {
            status: 409,
            body: Some(serde_json::json!({
                "code": "FENCED_OUT", "message": "m", "retrySafe": false, "traceId": "t"
            })),
        };
        let Err(error) = item_result::<()>("u", refused) else {
            panic!("a 409 item must be an error");
        };
        assert_eq!(error.code(), Some(crate::ErrorCode::FencedOut));
        let bare = ItemAnswer {
            status: 500,
            body: None,
        };
        assert!(matches!(
            item_result::<()>("u", bare),
            Err(ClientError::Protocol { .. })
        ));
    }
}
