//! A typed async client for the lock server, with the per-hop timeouts of docs/contract.md#s3-8.
//!
//! It makes exactly one attempt per call. Retry policy belongs to the caller, because only the
//! caller knows whether a retry is safe for it: the error says what the server decided
//! (`ClientError::Api` carries the envelope with `retrySafe`) or that no answer came.

use std::time::Duration;

use reqwest::{Method, RequestBuilder, StatusCode};
use serde::Serialize;
use serde::de::DeserializeOwned;
use uuid::Uuid;

use crate::batch::Item as _;
use crate::error::{ErrorBody, ErrorCode};
use crate::headers;
use crate::lock::*;

/// Connect timeout for every lock-server hop.
pub const CONNECT_TIMEOUT: Duration = Duration::from_millis(500);
/// Read timeout for acquire, renew and release.
pub const WRITE_TIMEOUT: Duration = Duration::from_secs(2);
/// Read timeout for a heartbeat: a slow heartbeat is as bad as a lost lease.
pub const HEARTBEAT_TIMEOUT: Duration = Duration::from_secs(1);
/// Read timeout for advisory reads.
pub const READ_TIMEOUT: Duration = Duration::from_secs(1);

#[derive(Debug, Clone, thiserror::Error)]
pub enum ClientError {
    /// The server answered with the contract's envelope.
    #[error("{status} {}: {}", body.code, body.message)]
    Api { status: u16, body: ErrorBody },
    /// No usable answer came: connect failure, timeout, reset. The effect of a write is unknown.
    #[error("no answer from {url}: {message}")]
    Transport {
        url: String,
        message: String,
        connect: bool,
        timeout: bool,
    },
    /// An answer came that is not what the contract says it should be.
    #[error("unexpected answer from {url}: {message}")]
    Protocol { url: String, message: String },
}

impl ClientError {
    pub fn code(&self) -> Option<ErrorCode> {
        match self {
            ClientError::Api { body, .. } => Some(body.code),
            _ => None,
        }
    }

    /// Whether the server said nothing happened and the identical request may be sent again.
    pub fn retry_safe(&self) -> bool {
        match self {
            ClientError::Api { body, .. } => body.retry_safe,
            ClientError::Transport { connect, .. } => *connect,
            ClientError::Protocol { .. } => false,
        }
    }

    /// Whether a write may have taken effect although no success came back: the lock server's
    /// `503 OUTCOME_UNKNOWN` (it sent the write to its backend and heard nothing back), a
    /// `500 INTERNAL` (the contract's "the outcome is unknown"), or no answer at all after the
    /// request was sent. Such a write is never resent blindly: read the state it would have
    /// changed (L7 for a key) and act on that (docs/contract.md#outcome-unknown).
    pub fn outcome_unknown(&self) -> bool {
        match self {
            ClientError::Api { body, .. } => {
                matches!(body.code, ErrorCode::OutcomeUnknown | ErrorCode::Internal)
            }
            ClientError::Transport { connect, .. } => !*connect,
            ClientError::Protocol { .. } => false,
        }
    }

    pub fn retry_after(&self) -> Option<Duration> {
        match self {
            ClientError::Api { body, .. } => body.retry_after_millis.map(Duration::from_millis),
            _ => None,
        }
    }
}

/// Sends a request, decodes a 2xx body as `T` (or nothing for 204), and the envelope otherwise.
pub async fn send<T: DeserializeOwned>(
    url: &str,
    request: RequestBuilder,
) -> Result<Option<T>, ClientError> {
    send_marked(url, request).await.map(|(body, _)| body)
}

/// [`send`], and whether the answer came from a stored idempotency record
/// (`X-Idempotent-Replay: true`, docs/contract.md#idempotency-rules).
pub async fn send_marked<T: DeserializeOwned>(
    url: &str,
    request: RequestBuilder,
) -> Result<(Option<T>, bool), ClientError> {
    let response = request.send().await.map_err(|e| ClientError::Transport {
        url: url.to_owned(),
        message: e.to_string(),
        connect: e.is_connect(),
        timeout: e.is_timeout(),
    })?;
    let status = response.status();
    let replayed = response
        .headers()
        .get(crate::headers::IDEMPOTENT_REPLAY)
        .is_some_and(|v| v.as_bytes() == b"true");
    let bytes = response.bytes().await.map_err(|e| ClientError::Transport {
        url: url.to_owned(),
        message: format!("reading the body failed: {e}"),
        connect: false,
        timeout: e.is_timeout(),
    })?;
    if status == StatusCode::NO_CONTENT {
        return Ok((None, replayed));
    }
    if status.is_success() {
        return serde_json::from_slice(&bytes)
            .map(|body| (Some(body), replayed))
            .map_err(|e| ClientError::Protocol {
                url: url.to_owned(),
                message: format!("{status} body did not decode: {e}"),
            });
    }
    match serde_json::from_slice::<ErrorBody>(&bytes) {
        Ok(body) => Err(ClientError::Api {
            status: status.as_u16(),
            body,
        }),
        Err(_) => Err(ClientError::Protocol {
            url: url.to_owned(),
            message: format!(
                "{status} without the error envelope: {}",
                String::from_utf8_lossy(&bytes[..bytes.len().min(200)])
            ),
        }),
    }
}

/// A malformed `DLOCK_SERVICE_ADDRESSES` as a client error.
pub fn address_map_error(error: crate::address_map::AddressMapError) -> ClientError {
    ClientError::Protocol {
        url: String::new(),
        message: error.to_string(),
    }
}

pub(crate) fn expect_body<T>(url: &str, body: Option<T>) -> Result<T, ClientError> {
    body.ok_or_else(|| ClientError::Protocol {
        url: url.to_owned(),
        message: "204 where a body was expected".into(),
    })
}

/// Builds the shared HTTP client for dlock's hops.
/// HTTPS trusts the roots of `DLOCK_CA_FILE` when it is set, the system's otherwise.
pub fn http_client() -> Result<reqwest::Client, ClientError> {
    let tls = crate::tls::client_config(crate::tls::ca_file_from_env().as_deref()).map_err(
        |message| ClientError::Protocol {
            url: String::new(),
            message: format!("TLS for the HTTP client (DLOCK_CA_FILE): {message}"),
        },
    )?;
    reqwest::Client::builder()
        .use_preconfigured_tls(tls)
        .connect_timeout(CONNECT_TIMEOUT)
        // No hop of ours redirects; following one would re-send a write (a submit, a claim) to
        // wherever the Location points. A 3xx reaches the caller as the answer it is.
        .redirect(reqwest::redirect::Policy::none())
        .pool_max_idle_per_host(64)
        .tcp_nodelay(true)
        .build()
        .map_err(|e| ClientError::Protocol {
            url: String::new(),
            message: format!("the HTTP client could not be built: {e}"),
        })
}

/// What every dlock hop sends, whatever the service: the base URL (through
/// `DLOCK_SERVICE_ADDRESSES`, [`crate::address_map`]), `X-Owner-Id`, the trace's `traceparent`
/// and the bearer credential. [`LockClient`], [`crate::payment_client::PaymentClient`] and
/// [`crate::rail::RailClient`] are typed facades over one `Hop`.
#[derive(Debug, Clone)]
pub struct Hop {
    base: String,
    owner_id: String,
    http: reqwest::Client,
    trace_id: Option<String>,
    credential: Option<crate::auth::Credential>,
    /// When set, the steps that have a batch endpoint go through these queues
    /// ([`crate::batch`]).
    batches: Option<std::sync::Arc<crate::batch::Batches>>,
}

impl Hop {
    /// A hop on the shared HTTP client; a malformed `DLOCK_SERVICE_ADDRESSES` is an error here.
    pub fn new(base: &str, owner_id: &str) -> Result<Self, ClientError> {
        crate::address_map::from_env().map_err(address_map_error)?;
        Ok(Self::with_http(base, owner_id, http_client()?))
    }

    pub fn with_http(base: &str, owner_id: &str, http: reqwest::Client) -> Self {
        Self {
            base: crate::address_map::rewrite_or_keep(base.trim_end_matches('/')),
            owner_id: owner_id.to_owned(),
            http,
            trace_id: None,
            credential: None,
            batches: None,
        }
    }

    /// The same hop sending acquires, releases, claims, posts and submissions through batch
    /// requests of at most `max` items, shared by every clone ([`crate::batch`]); `max` 0 or 1
    /// sends each alone to its single endpoint, as before.
    pub fn with_batching(&self, max: usize) -> Self {
        Self {
            batches: (max > 1).then(|| crate::batch::Batches::new(max)),
            ..self.clone()
        }
    }

    /// The batch queues, when batching.
    pub(crate) fn batches(&self) -> Option<&crate::batch::Batches> {
        self.batches.as_deref()
    }

    /// The `traceparent` this hop's requests carry.
    pub(crate) fn traceparent(&self) -> String {
        crate::trace::outgoing_traceparent(self.trace_id.as_deref())
    }

    /// The same hop presenting `credential` on every call (`None`: none).
    pub fn with_credential(&self, credential: Option<crate::auth::Credential>) -> Self {
        Self {
            credential,
            ..self.clone()
        }
    }

    /// The same hop with every call in one trace (one payout is one trace).
    pub fn in_trace(&self, trace_id: &str) -> Self {
        Self {
            trace_id: Some(trace_id.to_owned()),
            ..self.clone()
        }
    }

    pub fn owner_id(&self) -> &str {
        &self.owner_id
    }

    pub fn base(&self) -> &str {
        &self.base
    }

    /// A request to `path` with the hop's headers and `timeout` as its read timeout.
    pub fn request(
        &self,
        method: Method,
        path: &str,
        timeout: Duration,
    ) -> (String, RequestBuilder) {
        self.request_traced(method, path, timeout, &self.traceparent())
    }

    /// [`Self::request`] carrying `traceparent` (a batch item's own, [`crate::batch`]) instead of
    /// the hop's.
    pub(crate) fn request_traced(
        &self,
        method: Method,
        path: &str,
        timeout: Duration,
        traceparent: &str,
    ) -> (String, RequestBuilder) {
        let url = format!("{}{path}", self.base);
        let mut builder = self
            .http
            .request(method, &url)
            .timeout(timeout)
            .header(headers::OWNER_ID, &self.owner_id)
            .header(headers::TRACEPARENT, traceparent);
        if let Some(credential) = &self.credential {
            builder = builder.header("authorization", credential.header_value());
        }
        (url, builder)
    }

    /// `body` as the request's JSON.
    pub fn json<B: Serialize>(builder: RequestBuilder, body: &B) -> RequestBuilder {
        match serde_json::to_vec(body) {
            Ok(bytes) => builder
                .header("content-type", crate::http::JSON_CONTENT_TYPE)
                .body(bytes),
            Err(_) => builder,
        }
    }
}

/// The methods every typed client has over its [`Hop`] (a field `hop`): the same client with a
/// credential, as the operator or in a trace, and what it sends to. `plain` adds `new` and
/// `with_http` for a client that is its hop alone.
macro_rules! hop_client {
    ($client:ident, plain) => {
        impl $client {
            /// `base` is the service's URL (`http://127.0.0.1:7070`); `owner_id` goes on every
            /// write. The base goes through `DLOCK_SERVICE_ADDRESSES` ([`crate::address_map`]); a
            /// malformed map is an error here.
            pub fn new(base: &str, owner_id: &str) -> Result<Self, $crate::client::ClientError> {
                Ok(Self {
                    hop: $crate::client::Hop::new(base, owner_id)?,
                })
            }

            pub fn with_http(base: &str, owner_id: &str, http: reqwest::Client) -> Self {
                Self {
                    hop: $crate::client::Hop::with_http(base, owner_id, http),
                }
            }
        }
        $crate::client::hop_client!($client);
    };
    ($client:ident) => {
        impl $client {
            /// A client that presents `credential` on every call (`None`: none).
            pub fn with_credential(&self, credential: Option<$crate::auth::Credential>) -> Self {
                let mut client = self.clone();
                client.hop = self.hop.with_credential(credential);
                client
            }

            /// A client that sends the operator credential, for the operator's calls.
            pub fn as_operator(&self, token: &str) -> Self {
                self.with_credential(Some($crate::auth::Credential::fixed(token)))
            }

            /// A client whose acquires, releases, claims, posts and submissions go through batch
            /// requests of at most `max` items (docs/contract.md#batches), shared by every clone
            /// of it; `max` 0 or 1 sends each to its single endpoint.
            pub fn with_batching(&self, max: usize) -> Self {
                let mut client = self.clone();
                client.hop = self.hop.with_batching(max);
                client
            }

            /// A client whose calls all belong to one trace (one payout is one trace).
            pub fn in_trace(&self, trace_id: &str) -> Self {
                let mut client = self.clone();
                client.hop = self.hop.in_trace(trace_id);
                client
            }

            pub fn owner_id(&self) -> &str {
                self.hop.owner_id()
            }

            pub fn base(&self) -> &str {
                self.hop.base()
            }

            fn request(
                &self,
                method: reqwest::Method,
                path: &str,
                timeout: std::time::Duration,
            ) -> (String, reqwest::RequestBuilder) {
                self.hop.request(method, path, timeout)
            }
        }
    };
}
pub(crate) use hop_client;

/// The lock server's client (docs/contract.md#s3-3).
#[derive(Debug, Clone)]
pub struct LockClient {
    hop: Hop,
}

hop_client!(LockClient, plain);

impl LockClient {
    fn json<B: Serialize>(builder: RequestBuilder, body: &B) -> RequestBuilder {
        Hop::json(builder, body)
    }

    /// L1.
    pub async fn create_session(&self, ttl_millis: Option<i64>) -> Result<Session, ClientError> {
        let (url, req) = self.request(Method::POST, "/v1/sessions", WRITE_TIMEOUT);
        let body = CreateSessionRequest {
            owner_id: None,
            ttl_millis,
        };
        expect_body(&url, send(&url, Self::json(req, &body)).await?)
    }

    /// L2.
    pub async fn heartbeat(&self, session_id: Uuid) -> Result<Heartbeat, ClientError> {
        let path = format!("/v1/sessions/{session_id}/heartbeat");
        let (url, req) = self.request(Method::POST, &path, HEARTBEAT_TIMEOUT);
        expect_body(&url, send(&url, req).await?)
    }

    /// L3: ends the session and releases every lock attached to it.
    pub async fn end_session(&self, session_id: Uuid) -> Result<(), ClientError> {
        let path = format!("/v1/sessions/{session_id}");
        let (url, req) = self.request(Method::DELETE, &path, WRITE_TIMEOUT);
        send::<serde_json::Value>(&url, req).await.map(|_| ())
    }

    /// L4. The read timeout grows by the server-side wait asked for.
    pub async fn acquire(
        &self,
        key: &str,
        session_id: Uuid,
        ttl_millis: Option<i64>,
        wait_millis: Option<i64>,
    ) -> Result<LockGrant, ClientError> {
        let wait = Duration::from_millis(wait_millis.unwrap_or(0).clamp(0, WAIT_MS_MAX) as u64);
        if let Some(batches) = self.hop.batches() {
            let item = crate::batch::AcquireItem {
                key: key.to_owned(),
                session_id,
                ttl_millis,
                wait_millis,
                traceparent: Some(self.hop.traceparent()),
            };
            let answer =
                crate::batch::call(&batches.acquire, &self.hop, WRITE_TIMEOUT + wait, item).await;
            return expect_body(crate::batch::AcquireItem::PATH, answer?);
        }
        let path = format!("/v1/locks/{key}/acquire");
        let (url, req) = self.request(Method::POST, &path, WRITE_TIMEOUT + wait);
        let body = AcquireRequest {
            session_id,
            ttl_millis,
            wait_millis,
        };
        expect_body(&url, send(&url, Self::json(req, &body)).await?)
    }

    /// L5: extends the grant; the token never changes.
    pub async fn renew(
        &self,
        key: &str,
        session_id: Uuid,
        token: i64,
        ttl_millis: Option<i64>,
    ) -> Result<LockGrant, ClientError> {
        let path = format!("/v1/locks/{key}/renew");
        let (url, req) = self.request(Method::POST, &path, WRITE_TIMEOUT);
        let req = req.header(headers::FENCING_TOKEN, token.to_string());
        let body = RenewRequest {
            session_id,
            ttl_millis,
        };
        expect_body(&url, send(&url, Self::json(req, &body)).await?)
    }

    /// L6: compare-and-delete on (key, token).
    pub async fn release(
        &self,
        key: &str,
        session_id: Uuid,
        token: i64,
    ) -> Result<(), ClientError> {
        if let Some(batches) = self.hop.batches() {
            let item = crate::batch::ReleaseItem {
                key: key.to_owned(),
                session_id,
                fencing_token: token,
                traceparent: Some(self.hop.traceparent()),
            };
            return crate::batch::call(&batches.release, &self.hop, WRITE_TIMEOUT, item)
                .await
                .map(|_| ());
        }
        let path = format!("/v1/locks/{key}");
        let (url, req) = self.request(Method::DELETE, &path, WRITE_TIMEOUT);
        let req = req.header(headers::FENCING_TOKEN, token.to_string());
        let body = ReleaseRequest { session_id };
        send::<serde_json::Value>(&url, Self::json(req, &body))
            .await
            .map(|_| ())
    }

    /// L7, advisory.
    pub async fn get(&self, key: &str) -> Result<LockInfo, ClientError> {
        let path = format!("/v1/locks/{key}");
        let (url, req) = self.request(Method::GET, &path, READ_TIMEOUT);
        expect_body(&url, send(&url, req).await?)
    }

    /// The token of the grant `session_id` holds on `key` now, if any (L7, advisory): what an
    /// acquire or release whose outcome is unknown is settled by. A key never seen is `None`.
    pub async fn held_by(&self, key: &str, session_id: Uuid) -> Result<Option<i64>, ClientError> {
        match self.get(key).await {
            Ok(info) if info.held && info.session_id == Some(session_id) => Ok(info.fencing_token),
            Ok(_) => Ok(None),
            Err(e) if e.code() == Some(ErrorCode::NotFound) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// The held-locks list, advisory.
    pub async fn held(&self, limit: Option<u32>) -> Result<HeldLocks, ClientError> {
        let (url, mut req) = self.request(Method::GET, "/v1/locks", READ_TIMEOUT);
        if let Some(limit) = limit {
            req = req.query(&[("limit", limit)]);
        }
        expect_body(&url, send(&url, req).await?)
    }

    /// L8.
    pub async fn revoke(
        &self,
        key: &str,
        operator: &str,
        reason: &str,
        expected_token: Option<i64>,
    ) -> Result<Revocation, ClientError> {
        let path = format!("/v1/locks/{key}/revoke");
        let (url, req) = self.request(Method::POST, &path, WRITE_TIMEOUT);
        let body = RevokeRequest {
            operator: operator.to_owned(),
            reason: reason.to_owned(),
            expected_token,
        };
        expect_body(&url, send(&url, Self::json(req, &body)).await?)
    }
}
