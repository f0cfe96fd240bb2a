//! Who is calling: bearer credentials on every write of every service.
//!
//! `auth.mode` picks how a credential is checked:
//!
//! - `tokens`: a file of `<identity> <token>` lines (`auth.tokens-file`). In Kubernetes it is a
//!   Secret mounted as a file; the file is re-read when it changes, so a token is rotated by
//!   adding the new line, rolling the callers, then removing the old line. Tokens are kept only
//!   as SHA-256 digests and compared in constant time.
//! - `tokenreview`: the caller presents its projected service-account token and the service asks
//!   the Kubernetes API (`TokenReview`) who it is, with the audience `auth.tokenreview.audiences`.
//!   The identity is the service account's user name (`system:serviceaccount:<ns>:<name>`).
//!   Answers are cached for `auth.tokenreview.cache-ttl-ms`.
//! - `none`: nothing is checked (a laptop, the test suite). The service says so at start.
//!
//! Then, whatever the mode:
//!
//! - a request that needs a credential (every write; every read under `/v1/` but the OpenAPI
//!   document) and has none, or a wrong one, is `401 UNAUTHENTICATED` and reaches no handler;
//! - operator-only operations (revoke, fence advance, resolution, high-water floor) need an
//!   identity listed in `auth.operator-identities`, else `403 FORBIDDEN`;
//! - `X-Owner-Id` must be the identity itself or `<identity>/<worker>` (`auth.owner-binding`),
//!   else `403 FORBIDDEN`: a worker cannot write in another worker's name. Operators may name
//!   any owner, since a revocation acts on someone else's lock.

use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant, SystemTime};

use axum::Router;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, Method, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use crate::config::{ConfigError, RawConfig};
use crate::error::{ApiError, ErrorCode};
use crate::headers;

/// The operator identity when `auth.operator-identities` is not set.
pub const DEFAULT_OPERATOR_IDENTITY: &str = "operator";
/// The shortest token accepted in a tokens file: a guessable token is no credential.
pub const TOKEN_LEN_MIN: usize = 16;
/// How often a tokens file is looked at for a change.
const TOKENS_RECHECK_EVERY: Duration = Duration::from_secs(2);
/// A refused TokenReview is remembered this long at most, so a wrong token cannot make the
/// service ask the API server on every request.
const NEGATIVE_CACHE_MAX: Duration = Duration::from_secs(10);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AuthMode {
    None,
    Tokens,
    TokenReview,
}

impl AuthMode {
    pub fn as_str(self) -> &'static str {
        match self {
            AuthMode::None => "none",
            AuthMode::Tokens => "tokens",
            AuthMode::TokenReview => "tokenreview",
        }
    }
}

/// `auth.tokenreview.*`: how to reach the Kubernetes API.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenReviewSettings {
    /// `auth.tokenreview.url`: the API server.
    pub url: String,
    /// `auth.tokenreview.ca-file`: the API server's CA bundle.
    pub ca_file: Option<PathBuf>,
    /// `auth.tokenreview.token-file`: this service's own service-account token, which the API
    /// server wants on the TokenReview call (re-read on every miss: kubelet rotates it).
    pub token_file: PathBuf,
    /// `auth.tokenreview.audiences`: a presented token must be minted for one of these.
    pub audiences: Vec<String>,
    /// `auth.tokenreview.cache-ttl-ms`: how long a successful review is trusted.
    pub cache_ttl: Duration,
    /// `auth.tokenreview.cache-max`: reviews remembered at once.
    pub cache_max: usize,
    /// `auth.tokenreview.timeout-ms`: one TokenReview call.
    pub timeout: Duration,
}

/// `auth.*`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AuthSettings {
    pub mode: AuthMode,
    /// `auth.tokens-file`, for `tokens`.
    pub tokens_file: Option<PathBuf>,
    /// `auth.operator-identities`.
    pub operator_identities: Vec<String>,
    /// `auth.owner-binding`.
    pub owner_binding: bool,
    pub tokenreview: TokenReviewSettings,
}

const SA_DIR: &str = "/var/run/secrets/kubernetes.io/serviceaccount";

impl AuthSettings {
    pub fn from_raw(raw: &mut RawConfig) -> Result<Self, ConfigError> {
        let mode = match raw
            .choice("auth.mode", "none", &["none", "tokens", "tokenreview"])?
            .as_str()
        {
            "tokens" => AuthMode::Tokens,
            "tokenreview" => AuthMode::TokenReview,
            _ => AuthMode::None,
        };
        let tokens_file = raw.string_optional("auth.tokens-file")?.map(PathBuf::from);
        if mode == AuthMode::Tokens && tokens_file.is_none() {
            return Err(ConfigError {
                key: "auth.tokens-file".into(),
                origin: String::new(),
                message: "auth.mode = \"tokens\" needs the file of `<identity> <token>` lines"
                    .into(),
            });
        }
        let operator_identities =
            raw.string_list("auth.operator-identities", &[DEFAULT_OPERATOR_IDENTITY])?;
        let owner_binding = raw.boolean("auth.owner-binding", true)?;
        let url = raw.string("auth.tokenreview.url", "https://kubernetes.default.svc")?;
        let ca_file = raw.string("auth.tokenreview.ca-file", &format!("{SA_DIR}/ca.crt"))?;
        let token_file = raw.string("auth.tokenreview.token-file", &format!("{SA_DIR}/token"))?;
        let audiences = raw.string_list("auth.tokenreview.audiences", &["dlock"])?;
        let cache_ttl_ms = raw.integer("auth.tokenreview.cache-ttl-ms", 60_000, 0..=600_000)?;
        let cache_max = raw.integer("auth.tokenreview.cache-max", 10_000, 1..=1_000_000)?;
        let timeout_ms = raw.integer("auth.tokenreview.timeout-ms", 2_000, 100..=30_000)?;
        Ok(Self {
            mode,
            tokens_file,
            operator_identities,
            owner_binding,
            tokenreview: TokenReviewSettings {
                url: url.trim_end_matches('/').to_owned(),
                ca_file: (!ca_file.is_empty()).then(|| PathBuf::from(ca_file)),
                token_file: token_file.into(),
                audiences,
                cache_ttl: Duration::from_millis(cache_ttl_ms as u64),
                cache_max: cache_max as usize,
                timeout: Duration::from_millis(timeout_ms as u64),
            },
        })
    }
}

/// What an operator-only route does when `auth.mode` is `none` and no operator credential is
/// configured: the lock server keeps L8 open (a laptop has no credentials), the payment resource
/// and the rail proxy refuse, as they did before authentication existed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OperatorWithoutAuth {
    Open,
    Refused,
}

/// An authenticated caller.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity {
    pub name: String,
    pub operator: bool,
}

/// What the auth middleware found out about a request; every handler can read it.
#[derive(Debug, Clone)]
pub struct Caller {
    identity: Option<Identity>,
    operator: OperatorVerdict,
    /// Whether an `Authorization` header was sent at all.
    presented: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum OperatorVerdict {
    Allowed,
    Anonymous,
    NotOperator,
    Disabled,
}

impl Caller {
    pub fn identity(&self) -> Option<&Identity> {
        self.identity.as_ref()
    }

    /// `Ok` when the caller may run an operator-only operation (`what` names it in the error).
    pub fn require_operator(&self, what: &str) -> Result<(), ApiError> {
        let verdict = self.operator_verdict(what);
        if let Err(error) = &verdict {
            tracing::warn!(
                event = "operator_credential_refused",
                code = error.code.as_str(),
                operation = what,
                "an operator-only operation was refused"
            );
        }
        verdict
    }

    fn operator_verdict(&self, what: &str) -> Result<(), ApiError> {
        match self.operator {
            OperatorVerdict::Allowed => Ok(()),
            OperatorVerdict::Anonymous if self.presented => Err(ApiError::new(
                ErrorCode::Unauthenticated,
                format!(
                    "{what} needs the operator's credential, and the one presented \
                     authenticates nobody; nothing was changed"
                ),
            )),
            OperatorVerdict::Anonymous => Err(ApiError::new(
                ErrorCode::Unauthenticated,
                format!("{what} needs the operator's credential as Authorization: Bearer <token>"),
            )),
            OperatorVerdict::NotOperator => Err(ApiError::new(
                ErrorCode::Forbidden,
                format!(
                    "{what} is an operator operation and `{}` is not an operator identity \
                     (auth.operator-identities); nothing was changed",
                    self.identity.as_ref().map_or("", |i| i.name.as_str())
                ),
            )),
            OperatorVerdict::Disabled => Err(ApiError::new(
                ErrorCode::Forbidden,
                format!(
                    "{what} is disabled here: no operator credential is configured (set \
                     auth.mode and auth.tokens-file, or the service's operator token)"
                ),
            )),
        }
    }
}

/// Handlers take the caller as an extractor; the middleware of [`Authenticator::protect`] put
/// it there, so a missing one is a route wired without it.
impl<S: Send + Sync> axum::extract::FromRequestParts<S> for Caller {
    type Rejection = ApiError;

    async fn from_request_parts(
        parts: &mut axum::http::request::Parts,
        _state: &S,
    ) -> Result<Self, ApiError> {
        parts.extensions.get::<Caller>().cloned().ok_or_else(|| {
            ApiError::internal(
                "the auth middleware did not run for this route; this is a bug in the server",
            )
        })
    }
}

/// Checks credentials for one service. Cheap to clone.
#[derive(Clone)]
pub struct Authenticator {
    inner: Arc<Inner>,
}

struct Inner {
    mode: AuthMode,
    operators: BTreeSet<String>,
    owner_binding: bool,
    legacy_operator: Option<[u8; 32]>,
    without_auth: OperatorWithoutAuth,
    tokens: Option<TokenTable>,
    review: Option<TokenReviewer>,
}

impl std::fmt::Debug for Authenticator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Authenticator")
            .field("mode", &self.inner.mode.as_str())
            .field("operators", &self.inner.operators)
            .field("owner_binding", &self.inner.owner_binding)
            .finish_non_exhaustive()
    }
}

fn digest(token: &str) -> [u8; 32] {
    Sha256::digest(token.as_bytes()).into()
}

impl Authenticator {
    /// `legacy_operator_token` is a service's older single operator credential
    /// (`payment.operator.token`, `rail.proxy.operator-token`): it authenticates as the first
    /// operator identity, in every mode.
    pub fn new(
        settings: &AuthSettings,
        legacy_operator_token: Option<&str>,
        without_auth: OperatorWithoutAuth,
    ) -> Result<Self, ConfigError> {
        let tokens = match (settings.mode, &settings.tokens_file) {
            (AuthMode::Tokens, Some(path)) => {
                Some(TokenTable::load(path).map_err(|message| ConfigError {
                    key: "auth.tokens-file".into(),
                    origin: format!(" ({})", path.display()),
                    message,
                })?)
            }
            _ => None,
        };
        let review = (settings.mode == AuthMode::TokenReview)
            .then(|| TokenReviewer::new(&settings.tokenreview))
            .transpose()
            .map_err(|message| ConfigError {
                key: "auth.tokenreview.ca-file".into(),
                origin: String::new(),
                message,
            })?;
        Ok(Self {
            inner: Arc::new(Inner {
                mode: settings.mode,
                operators: settings.operator_identities.iter().cloned().collect(),
                owner_binding: settings.owner_binding,
                legacy_operator: legacy_operator_token.map(digest),
                without_auth,
                tokens,
                review,
            }),
        })
    }

    pub fn mode(&self) -> AuthMode {
        self.inner.mode
    }

    /// Logs, once at start, what is and is not checked.
    pub fn announce(&self, service: &str) {
        match self.inner.mode {
            AuthMode::None => tracing::warn!(
                event = "auth_disabled",
                service,
                "auth.mode is none: writes are accepted without a credential. Set auth.mode to \
                 tokens or tokenreview before this service moves real money"
            ),
            mode => tracing::info!(
                event = "auth_enabled",
                service,
                mode = mode.as_str(),
                operators = ?self.inner.operators,
                owner_binding = self.inner.owner_binding,
                "every write needs a credential"
            ),
        }
    }

    /// Wraps `router` so that every request passes the credential check first.
    pub fn protect<S: Clone + Send + Sync + 'static>(&self, router: Router<S>) -> Router<S> {
        router.layer(axum::middleware::from_fn_with_state(
            self.clone(),
            middleware,
        ))
    }

    fn legacy_operator_name(&self) -> String {
        self.inner
            .operators
            .iter()
            .next()
            .cloned()
            .unwrap_or_else(|| DEFAULT_OPERATOR_IDENTITY.to_owned())
    }

    /// Who presented `bearer`, if anyone. `Err` is an answer to send as is.
    async fn identify(&self, bearer: &str) -> Result<Option<String>, ApiError> {
        if let Some(legacy) = &self.inner.legacy_operator
            && bool::from(digest(bearer).ct_eq(legacy))
        {
            return Ok(Some(self.legacy_operator_name()));
        }
        match self.inner.mode {
            AuthMode::None => Ok(None),
            AuthMode::Tokens => Ok(self.inner.tokens.as_ref().and_then(|t| t.lookup(bearer))),
            AuthMode::TokenReview => match &self.inner.review {
                Some(review) => review.review(bearer).await,
                None => Ok(None),
            },
        }
    }

    /// The verdict for one request, from its method, path and headers.
    pub async fn check(
        &self,
        method: &Method,
        path: &str,
        headers: &HeaderMap,
    ) -> Result<Caller, ApiError> {
        let needs = self.inner.mode != AuthMode::None && needs_credential(method, path);
        let bearer = match bearer(headers) {
            Ok(bearer) => bearer,
            Err(error) if needs => return Err(error),
            Err(_) => None,
        };
        let name = match bearer {
            Some(token) => self.identify(token).await?,
            None => None,
        };
        if needs && name.is_none() {
            return Err(ApiError::new(
                ErrorCode::Unauthenticated,
                if bearer.is_some() {
                    "the credential presented is not valid here (unknown, expired, or minted for \
                     another audience); nothing was changed"
                } else {
                    "this request needs a credential: send Authorization: Bearer <token>"
                },
            ));
        }
        let identity = name.map(|name| Identity {
            operator: self.inner.operators.contains(&name),
            name,
        });
        if let Some(identity) = &identity
            && self.inner.owner_binding
            && !identity.operator
            && let Some(owner) = headers.get(headers::OWNER_ID)
        {
            let owner = owner.to_str().unwrap_or_default();
            let bound = owner == identity.name
                || owner
                    .strip_prefix(identity.name.as_str())
                    .is_some_and(|rest| rest.starts_with('/'));
            if !bound {
                return Err(ApiError::new(
                    ErrorCode::Forbidden,
                    format!(
                        "X-Owner-Id `{owner}` does not belong to the authenticated identity `{}`: \
                         use `{0}` or `{0}/<worker>`; nothing was changed",
                        identity.name
                    ),
                ));
            }
        }
        let operator = match &identity {
            Some(identity) if identity.operator => OperatorVerdict::Allowed,
            Some(_) => OperatorVerdict::NotOperator,
            None if self.inner.mode == AuthMode::None && self.inner.legacy_operator.is_none() => {
                match self.inner.without_auth {
                    OperatorWithoutAuth::Open => OperatorVerdict::Allowed,
                    OperatorWithoutAuth::Refused => OperatorVerdict::Disabled,
                }
            }
            None => OperatorVerdict::Anonymous,
        };
        Ok(Caller {
            identity,
            operator,
            presented: headers.contains_key(header::AUTHORIZATION),
        })
    }
}

/// Paths any client may read without a credential: probes, scrapes and the API document.
fn is_open_path(path: &str) -> bool {
    matches!(
        path,
        "/healthz" | "/readyz" | "/metrics" | "/v1/openapi.json"
    )
}

/// Every write, and every read under `/v1/` but the open paths.
pub fn needs_credential(method: &Method, path: &str) -> bool {
    if is_open_path(path) {
        return false;
    }
    let read = matches!(*method, Method::GET | Method::HEAD | Method::OPTIONS);
    !read || path.starts_with("/v1/")
}

/// The bearer token of `Authorization`, if one is sent. A malformed header is an error.
fn bearer(headers: &HeaderMap) -> Result<Option<&str>, ApiError> {
    let mut values = headers.get_all(header::AUTHORIZATION).iter();
    let Some(value) = values.next() else {
        return Ok(None);
    };
    let malformed = || {
        ApiError::new(
            ErrorCode::Unauthenticated,
            "Authorization must be exactly one `Bearer <token>` header",
        )
    };
    if values.next().is_some() {
        return Err(malformed());
    }
    let value = value.to_str().map_err(|_| malformed())?;
    let (scheme, token) = value.split_once(' ').ok_or_else(malformed)?;
    let token = token.trim();
    if !scheme.eq_ignore_ascii_case("bearer") || token.is_empty() {
        return Err(malformed());
    }
    Ok(Some(token))
}

async fn middleware(
    State(auth): State<Authenticator>,
    mut request: Request,
    next: Next,
) -> Response {
    let path = request.uri().path().to_owned();
    match auth.check(request.method(), &path, request.headers()).await {
        Ok(caller) => {
            request.extensions_mut().insert(caller);
            next.run(request).await
        }
        Err(error) => {
            tracing::warn!(
                event = "request_refused_by_auth",
                method = %request.method(),
                path,
                code = error.code.as_str(),
                "a request was refused before any handler ran"
            );
            error.into_response()
        }
    }
}

/// `auth.tokens-file`: identities and the digests of their tokens.
struct TokenTable {
    path: PathBuf,
    state: RwLock<TableState>,
    checked: Mutex<Instant>,
}

struct TableState {
    modified: Option<SystemTime>,
    entries: Vec<([u8; 32], String)>,
}

/// Parses `<identity> <token>` lines; `#` starts a comment. An identity may have several tokens
/// (rotation); a token may not belong to two identities.
pub fn parse_tokens_file(text: &str) -> Result<Vec<(String, String)>, String> {
    let mut entries: Vec<(String, String)> = Vec::new();
    for (number, line) in text.lines().enumerate() {
        let line = line.split('#').next().unwrap_or_default().trim();
        if line.is_empty() {
            continue;
        }
        let mut parts = line.split_whitespace();
        let (Some(identity), Some(token), None) = (parts.next(), parts.next(), parts.next()) else {
            return Err(format!(
                "line {}: expected `<identity> <token>`, two words",
                number + 1
            ));
        };
        if identity.len() > 64 {
            return Err(format!(
                "line {}: identity `{identity}` is longer than 64 characters (X-Owner-Id's limit)",
                number + 1
            ));
        }
        if token.len() < TOKEN_LEN_MIN || !token.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(format!(
                "line {}: the token of `{identity}` must be at least {TOKEN_LEN_MIN} printable \
                 characters (e.g. `openssl rand -hex 32`)",
                number + 1
            ));
        }
        if entries.iter().any(|(_, t)| t == token) {
            return Err(format!(
                "line {}: this token is already listed for another line; every token names one \
                 identity",
                number + 1
            ));
        }
        entries.push((identity.to_owned(), token.to_owned()));
    }
    Ok(entries)
}

impl TokenTable {
    fn read(path: &Path) -> Result<TableState, String> {
        let modified = std::fs::metadata(path).and_then(|m| m.modified()).ok();
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("cannot read the tokens file: {e}"))?;
        let entries = parse_tokens_file(&text)?
            .into_iter()
            .map(|(identity, token)| (digest(&token), identity))
            .collect::<Vec<_>>();
        if entries.is_empty() {
            return Err("the tokens file lists no `<identity> <token>` line".into());
        }
        Ok(TableState { modified, entries })
    }

    fn load(path: &Path) -> Result<Self, String> {
        Ok(Self {
            path: path.to_owned(),
            state: RwLock::new(Self::read(path)?),
            checked: Mutex::new(Instant::now()),
        })
    }

    fn maybe_reload(&self) {
        {
            let Ok(mut checked) = self.checked.lock() else {
                return;
            };
            if checked.elapsed() < TOKENS_RECHECK_EVERY {
                return;
            }
            *checked = Instant::now();
        }
        let modified = std::fs::metadata(&self.path)
            .and_then(|m| m.modified())
            .ok();
        let unchanged = self
            .state
            .read()
            .map(|s| s.modified == modified)
            .unwrap_or(true);
        if unchanged {
            return;
        }
        match Self::read(&self.path) {
            Ok(state) => {
                let identities = state.entries.len();
                if let Ok(mut current) = self.state.write() {
                    *current = state;
                }
                tracing::info!(
                    event = "auth_tokens_reloaded",
                    file = %self.path.display(),
                    tokens = identities,
                    "the tokens file changed and is now in force"
                );
            }
            Err(error) => tracing::error!(
                event = "auth_tokens_reload_failed",
                file = %self.path.display(),
                %error,
                "the tokens file changed but cannot be used; the previous tokens stay in force"
            ),
        }
    }

    fn lookup(&self, token: &str) -> Option<String> {
        self.maybe_reload();
        let presented = digest(token);
        let state = self.state.read().ok()?;
        // Every entry is compared, so the time taken says nothing about which one matched.
        let mut found = None;
        for (candidate, identity) in &state.entries {
            if bool::from(candidate.ct_eq(&presented)) {
                found = Some(identity.clone());
            }
        }
        found
    }
}

/// Token digest → (trusted until, identity or a remembered refusal).
type ReviewCache = HashMap<[u8; 32], (Instant, Option<String>)>;

/// Asks the Kubernetes API who holds a token.
struct TokenReviewer {
    settings: TokenReviewSettings,
    http: reqwest::Client,
    cache: Mutex<ReviewCache>,
}

#[derive(Deserialize)]
struct ReviewAnswer {
    #[serde(default)]
    status: ReviewStatus,
}

#[derive(Deserialize, Default)]
struct ReviewStatus {
    #[serde(default)]
    authenticated: bool,
    #[serde(default)]
    user: ReviewUser,
    #[serde(default)]
    audiences: Vec<String>,
    #[serde(default)]
    error: String,
}

#[derive(Deserialize, Default)]
struct ReviewUser {
    #[serde(default)]
    username: String,
}

impl TokenReviewer {
    fn new(settings: &TokenReviewSettings) -> Result<Self, String> {
        let tls = crate::tls::client_config(settings.ca_file.as_deref().filter(|p| p.exists()))?;
        let http = reqwest::Client::builder()
            .use_preconfigured_tls(tls)
            .timeout(settings.timeout)
            .build()
            .map_err(|e| format!("the TokenReview client could not be built: {e}"))?;
        Ok(Self {
            settings: settings.clone(),
            http,
            cache: Mutex::new(HashMap::new()),
        })
    }

    fn cached(&self, key: &[u8; 32]) -> Option<Option<String>> {
        let cache = self.cache.lock().ok()?;
        let (until, answer) = cache.get(key)?;
        (Instant::now() < *until).then(|| answer.clone())
    }

    fn remember(&self, key: [u8; 32], answer: Option<String>) {
        let ttl = if answer.is_some() {
            self.settings.cache_ttl
        } else {
            self.settings.cache_ttl.min(NEGATIVE_CACHE_MAX)
        };
        if ttl.is_zero() {
            return;
        }
        let Ok(mut cache) = self.cache.lock() else {
            return;
        };
        if cache.len() >= self.settings.cache_max {
            let now = Instant::now();
            cache.retain(|_, (until, _)| *until > now);
            if cache.len() >= self.settings.cache_max {
                cache.clear();
            }
        }
        cache.insert(key, (Instant::now() + ttl, answer));
    }

    async fn review(&self, token: &str) -> Result<Option<String>, ApiError> {
        let key = digest(token);
        if let Some(answer) = self.cached(&key) {
            return Ok(answer);
        }
        let unavailable = |why: String| {
            tracing::error!(event = "tokenreview_failed", error = %why, "a credential could not be checked");
            ApiError::new(
                ErrorCode::AuthUnavailable,
                format!(
                    "the credential could not be checked: {why}; nothing was changed, retry later"
                ),
            )
        };
        let own = std::fs::read_to_string(&self.settings.token_file).map_err(|e| {
            unavailable(format!(
                "this service's own service-account token {} is unreadable ({e})",
                self.settings.token_file.display()
            ))
        })?;
        let body = serde_json::json!({
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenReview",
            "spec": { "token": token, "audiences": self.settings.audiences },
        });
        let url = format!(
            "{}/apis/authentication.k8s.io/v1/tokenreviews",
            self.settings.url
        );
        let response = self
            .http
            .post(&url)
            .bearer_auth(own.trim())
            .json(&body)
            .send()
            .await
            .map_err(|e| unavailable(format!("the Kubernetes API did not answer ({e})")))?;
        let status = response.status();
        if !status.is_success() {
            return Err(unavailable(format!(
                "the Kubernetes API answered {status} to the TokenReview (does this service's \
                 account have `create` on tokenreviews, e.g. via system:auth-delegator?)"
            )));
        }
        let answer: ReviewAnswer = response
            .json()
            .await
            .map_err(|e| unavailable(format!("the TokenReview answer is not readable ({e})")))?;
        let review = answer.status;
        let audience_ok = self.settings.audiences.is_empty()
            || review
                .audiences
                .iter()
                .any(|a| self.settings.audiences.contains(a));
        let identity = (review.authenticated && audience_ok && !review.user.username.is_empty())
            .then_some(review.user.username);
        if identity.is_none() {
            tracing::debug!(
                event = "tokenreview_refused",
                error = review.error,
                "the Kubernetes API did not vouch for a presented token"
            );
        }
        self.remember(key, identity.clone());
        Ok(identity)
    }
}

/// A credential a client presents: fixed, or a file re-read as it changes (a projected
/// service-account token is rotated by kubelet; a Secret mount is updated in place).
#[derive(Clone)]
pub struct Credential {
    source: Arc<CredentialSource>,
}

enum CredentialSource {
    Fixed(String),
    File {
        path: PathBuf,
        current: Mutex<(Instant, String)>,
    },
}

/// A credential file is read again when its copy is older than this.
const CREDENTIAL_REREAD_EVERY: Duration = Duration::from_secs(30);

impl std::fmt::Debug for Credential {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.source.as_ref() {
            CredentialSource::Fixed(_) => f.write_str("Credential(fixed, redacted)"),
            CredentialSource::File { path, .. } => {
                write!(f, "Credential(file {}, redacted)", path.display())
            }
        }
    }
}

fn read_credential(path: &Path) -> Result<String, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read the credential file {}: {e}", path.display()))?;
    let token = text.trim().to_owned();
    if token.is_empty() || !token.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(format!(
            "the credential file {} must hold one token of printable characters",
            path.display()
        ));
    }
    Ok(token)
}

impl Credential {
    pub fn fixed(token: &str) -> Self {
        Self {
            source: Arc::new(CredentialSource::Fixed(token.trim().to_owned())),
        }
    }

    /// Reads the file now (so a wrong path fails at start) and again every 30 s.
    pub fn from_file(path: &Path) -> Result<Self, String> {
        let token = read_credential(path)?;
        Ok(Self {
            source: Arc::new(CredentialSource::File {
                path: path.to_owned(),
                current: Mutex::new((Instant::now(), token)),
            }),
        })
    }

    /// `DLOCK_CREDENTIAL_FILE` (preferred: it rotates) or `DLOCK_CREDENTIAL`; neither is `None`.
    pub fn from_env() -> Result<Option<Self>, String> {
        if let Some(path) = std::env::var_os("DLOCK_CREDENTIAL_FILE").filter(|v| !v.is_empty()) {
            return Self::from_file(Path::new(&path)).map(Some);
        }
        Ok(std::env::var("DLOCK_CREDENTIAL")
            .ok()
            .filter(|v| !v.trim().is_empty())
            .map(|v| Self::fixed(&v)))
    }

    /// The token to send now.
    pub fn token(&self) -> String {
        match self.source.as_ref() {
            CredentialSource::Fixed(token) => token.clone(),
            CredentialSource::File { path, current } => {
                let Ok(mut current) = current.lock() else {
                    return String::new();
                };
                if current.0.elapsed() >= CREDENTIAL_REREAD_EVERY {
                    match read_credential(path) {
                        Ok(token) => *current = (Instant::now(), token),
                        Err(error) => {
                            tracing::warn!(event = "credential_reread_failed", %error, "keeping the previous credential");
                            current.0 = Instant::now();
                        }
                    }
                }
                current.1.clone()
            }
        }
    }

    /// The `Authorization` header value.
    pub fn header_value(&self) -> String {
        format!("Bearer {}", self.token())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

    fn settings(dir: &Path, lines: &str) -> AuthSettings {
        let file = dir.join("tokens");
        std::fs::write(&file, lines).unwrap_or_else(|e| panic!("{e}"));
        let mut raw = RawConfig::from_pairs(&[
            ("auth.mode", "tokens".to_owned()),
            ("auth.tokens-file", file.display().to_string()),
        ])
        .unwrap_or_else(|e| panic!("{e}"));
        AuthSettings::from_raw(&mut raw).unwrap_or_else(|e| panic!("{e}"))
    }

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (name, value) in pairs {
            map.append(
                *name,
                HeaderValue::from_str(value).unwrap_or_else(|e| panic!("{e}")),
            );
        }
        map
    }

    #[tokio::test]
    async fn tokens_mode_names_the_caller_and_binds_the_owner() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let s = settings(
            dir.path(),
            "# who may write\nworker-a aaaaaaaaaaaaaaaaaaaa\noperator oooooooooooooooooooo\n",
        );
        let auth = Authenticator::new(&s, None, OperatorWithoutAuth::Refused)
            .unwrap_or_else(|e| panic!("{e}"));
        let post = Method::POST;
        let code = |r: Result<Caller, ApiError>| r.err().map(|e| e.code);

        assert_eq!(
            code(
                auth.check(&post, "/v1/locks/k/acquire", &headers(&[]))
                    .await
            ),
            Some(ErrorCode::Unauthenticated)
        );
        assert_eq!(
            code(
                auth.check(
                    &post,
                    "/v1/x",
                    &headers(&[("authorization", "Bearer wrongwrongwrongwrong")])
                )
                .await
            ),
            Some(ErrorCode::Unauthenticated)
        );
        assert_eq!(
            code(
                auth.check(
                    &post,
                    "/v1/x",
                    &headers(&[("authorization", "Basic aaaaaaaaaaaaaaaaaaaa")])
                )
                .await
            ),
            Some(ErrorCode::Unauthenticated)
        );
        let worker = [("authorization", "Bearer aaaaaaaaaaaaaaaaaaaa")];
        let caller = auth
            .check(&post, "/v1/x", &headers(&worker))
            .await
            .unwrap_or_else(|e| panic!("{e:?}"));
        assert_eq!(caller.identity().map(|i| i.name.as_str()), Some("worker-a"));
        assert_eq!(
            caller.require_operator("revoke").err().map(|e| e.code),
            Some(ErrorCode::Forbidden)
        );
        for (owner, ok) in [
            ("worker-a", true),
            ("worker-a/host-1", true),
            ("worker-ab", false),
            ("worker-b", false),
        ] {
            let h = headers(&[worker[0], ("x-owner-id", owner)]);
            assert_eq!(auth.check(&post, "/v1/x", &h).await.is_ok(), ok, "{owner}");
        }
        let op = headers(&[
            ("authorization", "Bearer oooooooooooooooooooo"),
            ("x-owner-id", "anyone"),
        ]);
        let caller = auth
            .check(&post, "/v1/x", &op)
            .await
            .unwrap_or_else(|e| panic!("{e:?}"));
        assert!(caller.require_operator("revoke").is_ok());
        // Probes and the API document stay open; reads under /v1/ do not.
        for (method, path, open) in [
            (Method::GET, "/healthz", true),
            (Method::GET, "/metrics", true),
            (Method::GET, "/v1/openapi.json", true),
            (Method::GET, "/v1/locks", false),
            (Method::GET, "/statement", true),
            (Method::POST, "/submit", false),
        ] {
            assert_eq!(
                auth.check(&method, path, &headers(&[])).await.is_ok(),
                open,
                "{method} {path}"
            );
        }
    }

    #[tokio::test]
    async fn none_mode_follows_the_operator_policy_and_the_legacy_token() {
        let s = AuthSettings::from_raw(
            &mut RawConfig::from_pairs(&[]).unwrap_or_else(|e| panic!("{e}")),
        )
        .unwrap_or_else(|e| panic!("{e}"));
        let open = Authenticator::new(&s, None, OperatorWithoutAuth::Open)
            .unwrap_or_else(|e| panic!("{e}"));
        let caller = open
            .check(&Method::POST, "/v1/x", &HeaderMap::new())
            .await
            .unwrap_or_else(|e| panic!("{e:?}"));
        assert!(caller.require_operator("revoke").is_ok());
        let refused = Authenticator::new(&s, None, OperatorWithoutAuth::Refused)
            .unwrap_or_else(|e| panic!("{e}"));
        let caller = refused
            .check(&Method::POST, "/v1/x", &HeaderMap::new())
            .await
            .unwrap_or_else(|e| panic!("{e:?}"));
        assert_eq!(
            caller.require_operator("x").err().map(|e| e.code),
            Some(ErrorCode::Forbidden)
        );
        let legacy = Authenticator::new(
            &s,
            Some("legacy-operator-token"),
            OperatorWithoutAuth::Refused,
        )
        .unwrap_or_else(|e| panic!("{e}"));
        let anonymous = legacy
            .check(&Method::POST, "/v1/x", &HeaderMap::new())
            .await
            .unwrap_or_else(|e| panic!("{e:?}"));
        assert_eq!(
            anonymous.require_operator("x").err().map(|e| e.code),
            Some(ErrorCode::Unauthenticated)
        );
        let op = legacy
            .check(
                &Method::POST,
                "/v1/x",
                &headers(&[("authorization", "Bearer legacy-operator-token")]),
            )
            .await
            .unwrap_or_else(|e| panic!("{e:?}"));
        assert!(op.require_operator("x").is_ok());
    }

    #[test]
    fn a_tokens_file_is_checked_line_by_line() {
        assert!(parse_tokens_file("a short").is_err());
        assert!(parse_tokens_file("a bbbbbbbbbbbbbbbbbbbb extra").is_err());
        assert!(
            parse_tokens_file("a bbbbbbbbbbbbbbbbbbbb\nc bbbbbbbbbbbbbbbbbbbb").is_err(),
            "one token, two identities"
        );
        let rotated = parse_tokens_file("a bbbbbbbbbbbbbbbbbbbb\na cccccccccccccccccccc # next")
            .unwrap_or_default();
        assert_eq!(rotated.len(), 2);
    }

    #[tokio::test]
    async fn a_changed_tokens_file_takes_effect_and_a_broken_one_does_not() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let s = settings(dir.path(), "w aaaaaaaaaaaaaaaaaaaa\n");
        let auth = Authenticator::new(&s, None, OperatorWithoutAuth::Refused)
            .unwrap_or_else(|e| panic!("{e}"));
        let file = dir.path().join("tokens");
        let force_recheck = |auth: &Authenticator| {
            if let Some(table) = &auth.inner.tokens
                && let Ok(mut checked) = table.checked.lock()
            {
                *checked = Instant::now() - TOKENS_RECHECK_EVERY - Duration::from_secs(1);
            }
        };
        let touch = |text: &str, offset: u64| {
            std::fs::write(&file, text).unwrap_or_else(|e| panic!("{e}"));
            std::fs::File::options()
                .write(true)
                .open(&file)
                .and_then(|f| f.set_modified(SystemTime::now() + Duration::from_secs(offset)))
                .unwrap_or_else(|e| panic!("{e}"));
        };
        touch("w bbbbbbbbbbbbbbbbbbbb\n", 5);
        force_recheck(&auth);
        assert_eq!(
            auth.identify("aaaaaaaaaaaaaaaaaaaa").await.ok().flatten(),
            None
        );
        assert_eq!(
            auth.identify("bbbbbbbbbbbbbbbbbbbb")
                .await
                .ok()
                .flatten()
                .as_deref(),
            Some("w")
        );
        touch("this is not a tokens file\n", 10);
        force_recheck(&auth);
        assert_eq!(
            auth.identify("bbbbbbbbbbbbbbbbbbbb")
                .await
                .ok()
                .flatten()
                .as_deref(),
            Some("w"),
            "a broken file keeps the previous tokens"
        );
    }
}
