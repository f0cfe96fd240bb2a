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
//!   Answers are cached for `auth.tokenreview.cache-ttl-ms`, within `cache-max` successes and
//!   `refused-cache-max` refusals (the least recently used goes first). Calls for tokens not in
//!   the cache are limited to `reviews-per-second` (with `review-burst`) and
//!   `reviews-in-flight-max` at once; a caller beyond that is `503 AUTH_UNAVAILABLE` with
//!   `retryAfterMillis` and `Retry-After`, and the API server is not asked.
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

use std::collections::BTreeSet;
use std::num::NonZeroUsize;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant, SystemTime};

use axum::Router;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, Method, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use lru::LruCache;
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
    /// `auth.tokenreview.cache-max`: successful reviews remembered at once; when full, the one
    /// used least recently is forgotten.
    pub cache_max: usize,
    /// `auth.tokenreview.refused-cache-max`: refusals remembered at once, apart from the
    /// successful reviews, so a flood of bad tokens can push out only other refusals.
    pub refused_cache_max: usize,
    /// `auth.tokenreview.timeout-ms`: one TokenReview call.
    pub timeout: Duration,
    /// `auth.tokenreview.reviews-per-second`: the steady rate of TokenReview calls.
    pub reviews_per_second: u32,
    /// `auth.tokenreview.review-burst`: calls allowed at once above the steady rate.
    pub review_burst: u32,
    /// `auth.tokenreview.reviews-in-flight-max`: TokenReview calls outstanding at once.
    pub reviews_in_flight_max: usize,
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
        let refused_cache_max =
            raw.integer("auth.tokenreview.refused-cache-max", 1_000, 1..=1_000_000)?;
        let timeout_ms = raw.integer("auth.tokenreview.timeout-ms", 2_000, 100..=30_000)?;
        let reviews_per_second =
            raw.integer("auth.tokenreview.reviews-per-second", 20, 1..=10_000)?;
        let review_burst = raw.integer("auth.tokenreview.review-burst", 50, 1..=100_000)?;
        let reviews_in_flight_max =
            raw.integer("auth.tokenreview.reviews-in-flight-max", 8, 1..=1_024)?;
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
                refused_cache_max: refused_cache_max as usize,
                timeout: Duration::from_millis(timeout_ms as u64),
                reviews_per_second: reviews_per_second as u32,
                review_burst: review_burst as u32,
                reviews_in_flight_max: reviews_in_flight_max as usize,
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

/// What the service remembers of earlier reviews, by token digest. Successful reviews and
/// refusals are kept apart, each within its own bound, and a full side forgets only its least
/// recently used entry: a flood of bad tokens pushes out other refusals, never a caller that
/// was let in, and no burst empties the cache as a whole.
struct ReviewCache {
    approved: LruCache<[u8; 32], (Instant, String)>,
    refused: LruCache<[u8; 32], Instant>,
    approved_ttl: Duration,
    refused_ttl: Duration,
}

impl ReviewCache {
    fn new(settings: &TokenReviewSettings) -> Self {
        let bound = |n: usize| NonZeroUsize::new(n).unwrap_or(NonZeroUsize::MIN);
        Self {
            approved: LruCache::new(bound(settings.cache_max)),
            refused: LruCache::new(bound(settings.refused_cache_max)),
            approved_ttl: settings.cache_ttl,
            refused_ttl: settings.cache_ttl.min(NEGATIVE_CACHE_MAX),
        }
    }

    /// `Some(Some(identity))`: trusted; `Some(None)`: a remembered refusal; `None`: not known
    /// (an expired answer is forgotten here).
    fn get(&mut self, key: &[u8; 32], now: Instant) -> Option<Option<String>> {
        if let Some((until, identity)) = self.approved.get(key) {
            if now < *until {
                return Some(Some(identity.clone()));
            }
            self.approved.pop(key);
        }
        if let Some(until) = self.refused.get(key) {
            if now < *until {
                return Some(None);
            }
            self.refused.pop(key);
        }
        None
    }

    /// Remembers an answer. `true` when another entry had to go to make room.
    fn put(&mut self, key: [u8; 32], answer: Option<String>, now: Instant) -> bool {
        let evicted = match answer {
            Some(identity) if !self.approved_ttl.is_zero() => {
                self.refused.pop(&key);
                self.approved
                    .push(key, (now + self.approved_ttl, identity))
                    .map(|(old, _)| old)
            }
            None if !self.refused_ttl.is_zero() => {
                self.approved.pop(&key);
                self.refused
                    .push(key, now + self.refused_ttl)
                    .map(|(old, _)| old)
            }
            _ => None,
        };
        evicted.is_some_and(|old| old != key)
    }

    fn len(&self) -> (usize, usize) {
        (self.approved.len(), self.refused.len())
    }
}

/// The steady rate and burst of TokenReview calls: `reviews-per-second` tokens a second, at
/// most `review-burst` saved up.
struct TokenBucket {
    per_second: f64,
    burst: f64,
    available: f64,
    at: Instant,
}

impl TokenBucket {
    fn new(per_second: u32, burst: u32, now: Instant) -> Self {
        let burst = f64::from(burst.max(1));
        Self {
            per_second: f64::from(per_second.max(1)),
            burst,
            available: burst,
            at: now,
        }
    }

    /// Takes one call's worth; `Err` is how long until the next one is there.
    fn take(&mut self, now: Instant) -> Result<(), Duration> {
        if now > self.at {
            let earned = now.duration_since(self.at).as_secs_f64() * self.per_second;
            self.available = (self.available + earned).min(self.burst);
            self.at = now;
        }
        if self.available >= 1.0 {
            self.available -= 1.0;
            Ok(())
        } else {
            Err(Duration::from_secs_f64(
                (1.0 - self.available) / self.per_second,
            ))
        }
    }
}

/// How long a caller waits for one of the `reviews-in-flight-max` slots before it is told to
/// come back: short, since the callers' own read timeouts are 1 to 3 s (C3 §3.8).
const REVIEW_SLOT_WAIT: Duration = Duration::from_millis(250);
/// The `retryAfterMillis` of a review that failed (the API server did not answer, or answered
/// something unusable).
const REVIEW_FAILED_RETRY_AFTER_MS: u64 = 1_000;
/// Throttled reviews are logged at most this often (the refusals themselves are each logged
/// as `request_refused_by_auth`).
const THROTTLE_LOG_EVERY: Duration = Duration::from_secs(10);

/// Asks the Kubernetes API who holds a token: answers are cached, calls are rate-limited and
/// bounded in number, so unknown tokens cannot turn into a flood of API calls.
struct TokenReviewer {
    settings: TokenReviewSettings,
    http: reqwest::Client,
    cache: Mutex<ReviewCache>,
    bucket: Mutex<TokenBucket>,
    slots: tokio::sync::Semaphore,
    /// When a throttled review was last logged, and how many were not logged since.
    throttle_log: Mutex<(Option<Instant>, u64)>,
}

/// Why a review was not even asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Throttle {
    /// `reviews-per-second` / `review-burst` used up.
    Rate,
    /// `reviews-in-flight-max` calls outstanding for longer than [`REVIEW_SLOT_WAIT`].
    InFlight,
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
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .map_err(|e| format!("the TokenReview client could not be built: {e}"))?;
        Ok(Self {
            settings: settings.clone(),
            http,
            cache: Mutex::new(ReviewCache::new(settings)),
            bucket: Mutex::new(TokenBucket::new(
                settings.reviews_per_second,
                settings.review_burst,
                Instant::now(),
            )),
            slots: tokio::sync::Semaphore::new(settings.reviews_in_flight_max.max(1)),
            throttle_log: Mutex::new((None, 0)),
        })
    }

    fn cached(&self, key: &[u8; 32]) -> Option<Option<String>> {
        self.cache.lock().ok()?.get(key, Instant::now())
    }

    fn remember(&self, key: [u8; 32], answer: Option<String>) {
        let Ok(mut cache) = self.cache.lock() else {
            return;
        };
        if cache.put(key, answer, Instant::now()) {
            let (approved, refused) = cache.len();
            tracing::debug!(
                event = "tokenreview_cache_evicted",
                approved,
                refused,
                "the review cache was full; its least recently used entry was forgotten"
            );
        }
    }

    /// The answer to a caller that was not checked because of a limit; nothing was asked.
    fn throttled(&self, why: Throttle, retry_after: Duration) -> ApiError {
        let now = Instant::now();
        if let Ok(mut log) = self.throttle_log.lock() {
            if log
                .0
                .is_none_or(|at| now.duration_since(at) >= THROTTLE_LOG_EVERY)
            {
                let limit = match why {
                    Throttle::Rate => "auth.tokenreview.reviews-per-second and review-burst",
                    Throttle::InFlight => "auth.tokenreview.reviews-in-flight-max",
                };
                tracing::warn!(
                    event = "tokenreview_throttled",
                    limit,
                    not_logged_since = log.1,
                    "credentials not in the review cache are arriving faster than the limits \
                     allow; the callers were answered 503 AUTH_UNAVAILABLE with retryAfterMillis. \
                     Raise the limit if these are real callers, look for a caller sending made-up \
                     tokens if not"
                );
                *log = (Some(now), 0);
            } else {
                log.1 += 1;
            }
        }
        let millis = u64::try_from(retry_after.as_millis())
            .unwrap_or(u64::MAX)
            .max(1);
        ApiError::new(
            ErrorCode::AuthUnavailable,
            "too many credentials are waiting to be checked right now, so this one was not; \
             nothing was changed. Retry after retryAfterMillis",
        )
        .with_retry_after_ms(millis)
    }

    /// Takes a rate token, or says how long until there is one.
    fn admit(&self) -> Result<(), ApiError> {
        let verdict = match self.bucket.lock() {
            Ok(mut bucket) => bucket.take(Instant::now()),
            Err(_) => Err(Duration::from_secs(1)),
        };
        verdict.map_err(|wait| self.throttled(Throttle::Rate, wait))
    }

    async fn review(&self, token: &str) -> Result<Option<String>, ApiError> {
        let key = digest(token);
        if let Some(answer) = self.cached(&key) {
            return Ok(answer);
        }
        self.admit()?;
        let _slot = match tokio::time::timeout(REVIEW_SLOT_WAIT, self.slots.acquire()).await {
            Ok(Ok(permit)) => permit,
            _ => return Err(self.throttled(Throttle::InFlight, REVIEW_SLOT_WAIT)),
        };
        // A caller with the same token may have had its answer while this one waited.
        if let Some(answer) = self.cached(&key) {
            return Ok(answer);
        }
        let identity = self.ask(token).await?;
        self.remember(key, identity.clone());
        Ok(identity)
    }

    /// One TokenReview call. What went wrong is logged for the operator, with the API server's
    /// address and the files involved; the caller hears only that it may retry.
    async fn ask(&self, token: &str) -> Result<Option<String>, ApiError> {
        let unavailable = |why: String| {
            tracing::warn!(
                event = "tokenreview_failed",
                api_server = %self.settings.url,
                token_file = %self.settings.token_file.display(),
                error = %why,
                "a credential could not be checked; the caller was answered 503 \
                 AUTH_UNAVAILABLE. Check that this service reaches the API server and that its \
                 service account may create tokenreviews"
            );
            ApiError::new(
                ErrorCode::AuthUnavailable,
                "the credential could not be checked: the identity provider (the Kubernetes \
                 TokenReview API) gave this service no usable answer; nothing was changed. \
                 Retry after retryAfterMillis; if it persists, ask the operator to look at this \
                 service's tokenreview_failed log lines (quote the traceId)",
            )
            .with_retry_after_ms(REVIEW_FAILED_RETRY_AFTER_MS)
        };
        let own = std::fs::read_to_string(&self.settings.token_file).map_err(|e| {
            unavailable(format!(
                "this service's own service-account token (auth.tokenreview.token-file) is \
                 unreadable: {e}"
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
            .map_err(|e| unavailable(format!("the Kubernetes API did not answer: {e}")))?;
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
            .map_err(|e| unavailable(format!("the TokenReview answer is not readable: {e}")))?;
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

    /// An authenticator in `tokenreview` mode against `url`, with its own token in `dir`.
    fn reviewing(dir: &Path, url: &str, extra: &[(&str, String)]) -> (Authenticator, PathBuf) {
        let own = dir.join("own-sa-token-0f3c");
        std::fs::write(&own, "this-service-s-own-token").unwrap_or_else(|e| panic!("{e}"));
        let mut pairs = vec![
            ("auth.mode", "tokenreview".to_owned()),
            ("auth.tokenreview.url", url.to_owned()),
            ("auth.tokenreview.ca-file", String::new()),
            ("auth.tokenreview.token-file", own.display().to_string()),
        ];
        pairs.extend(extra.iter().map(|(k, v)| (*k, v.clone())));
        let mut raw = RawConfig::from_pairs(&pairs).unwrap_or_else(|e| panic!("{e}"));
        let s = AuthSettings::from_raw(&mut raw).unwrap_or_else(|e| panic!("{e}"));
        let auth = Authenticator::new(&s, None, OperatorWithoutAuth::Refused)
            .unwrap_or_else(|e| panic!("{e}"));
        (auth, own)
    }

    fn reviewer(auth: &Authenticator) -> &TokenReviewer {
        auth.inner
            .review
            .as_ref()
            .unwrap_or_else(|| panic!("not in tokenreview mode"))
    }

    /// A TCP listener standing in for an API server that never answers usefully: it counts the
    /// connections (one per TokenReview call) and either drops them at once or holds them open.
    async fn silent_api(hold: bool) -> (String, Arc<std::sync::atomic::AtomicUsize>) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        let addr = listener.local_addr().unwrap_or_else(|e| panic!("{e}"));
        let calls = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counted = calls.clone();
        tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((stream, _)) = listener.accept().await {
                counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                if hold {
                    held.push(stream);
                }
            }
        });
        (format!("http://{addr}"), calls)
    }

    #[test]
    fn a_full_review_cache_forgets_its_least_recently_used_entry_only() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let (auth, _) = reviewing(
            dir.path(),
            "http://127.0.0.1:9",
            &[
                ("auth.tokenreview.cache-max", "2".to_owned()),
                ("auth.tokenreview.refused-cache-max", "2".to_owned()),
            ],
        );
        let review = reviewer(&auth);
        let (a, b, c) = (digest("token-a"), digest("token-b"), digest("token-c"));
        review.remember(a, Some("sa-a".into()));
        review.remember(b, Some("sa-b".into()));
        assert_eq!(review.cached(&a), Some(Some("sa-a".into())), "a is used");
        review.remember(c, Some("sa-c".into()));
        assert_eq!(review.cached(&a), Some(Some("sa-a".into())), "a stays");
        assert_eq!(review.cached(&b), None, "b, used least recently, went");
        assert_eq!(review.cached(&c), Some(Some("sa-c".into())));
        // A flood of refusals pushes out only refusals.
        for n in 0..100 {
            review.remember(digest(&format!("made-up-{n}")), None);
        }
        assert_eq!(review.cached(&a), Some(Some("sa-a".into())));
        assert_eq!(review.cached(&c), Some(Some("sa-c".into())));
        assert_eq!(review.cached(&digest("made-up-99")), Some(None));
        assert_eq!(review.cached(&digest("made-up-97")), None);
        // A token refused earlier and approved now is approved, and only once remembered.
        review.remember(digest("made-up-99"), Some("sa-late".into()));
        assert_eq!(
            review.cached(&digest("made-up-99")),
            Some(Some("sa-late".into()))
        );
        assert_eq!(
            review.cache.lock().map(|c| c.len()).unwrap_or_default(),
            (2, 1)
        );
    }

    #[test]
    fn review_answers_expire_and_refusals_sooner() {
        let settings = TokenReviewSettings {
            url: String::new(),
            ca_file: None,
            token_file: PathBuf::new(),
            audiences: vec![],
            cache_ttl: Duration::from_secs(60),
            cache_max: 10,
            refused_cache_max: 10,
            timeout: Duration::from_secs(1),
            reviews_per_second: 1,
            review_burst: 1,
            reviews_in_flight_max: 1,
        };
        let mut cache = ReviewCache::new(&settings);
        let t0 = Instant::now();
        let (ok, bad) = (digest("ok"), digest("bad"));
        assert!(!cache.put(ok, Some("sa".into()), t0));
        assert!(!cache.put(bad, None, t0));
        let at = |s: u64| t0 + Duration::from_secs(s);
        assert_eq!(cache.get(&ok, at(9)), Some(Some("sa".into())));
        assert_eq!(cache.get(&bad, at(9)), Some(None));
        assert_eq!(
            cache.get(&bad, at(11)),
            None,
            "a refusal lasts 10 s at most"
        );
        assert_eq!(cache.get(&ok, at(59)), Some(Some("sa".into())));
        assert_eq!(cache.get(&ok, at(61)), None);
        assert_eq!(cache.len(), (0, 0), "expired answers are forgotten");
        let off = ReviewCache::new(&TokenReviewSettings {
            cache_ttl: Duration::ZERO,
            ..settings
        });
        let mut off = off;
        off.put(ok, Some("sa".into()), t0);
        assert_eq!(off.get(&ok, t0), None, "cache-ttl-ms = 0 caches nothing");
    }

    #[test]
    fn the_token_bucket_refills_at_its_rate_up_to_its_burst() {
        let t0 = Instant::now();
        let mut bucket = TokenBucket::new(10, 3, t0);
        for _ in 0..3 {
            assert_eq!(bucket.take(t0), Ok(()));
        }
        let wait = bucket.take(t0).err().unwrap_or_default();
        assert!(
            wait > Duration::from_millis(90) && wait <= Duration::from_millis(100),
            "{wait:?}"
        );
        assert_eq!(bucket.take(t0 + Duration::from_millis(100)), Ok(()));
        assert!(bucket.take(t0 + Duration::from_millis(100)).is_err());
        // A long quiet spell saves up the burst, no more.
        let later = t0 + Duration::from_secs(60);
        for _ in 0..3 {
            assert_eq!(bucket.take(later), Ok(()));
        }
        assert!(bucket.take(later).is_err());
        // A clock reading from before the last one earns nothing and breaks nothing.
        assert!(bucket.take(t0).is_err());
    }

    fn unknown_bearer(n: usize) -> HeaderMap {
        headers(&[("authorization", &format!("Bearer made-up-token-{n:04}"))])
    }

    #[tokio::test]
    async fn unknown_tokens_beyond_the_rate_are_refused_without_asking_the_api_server() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let (url, calls) = silent_api(false).await;
        let (auth, own) = reviewing(
            dir.path(),
            &url,
            &[
                ("auth.tokenreview.reviews-per-second", "1".to_owned()),
                ("auth.tokenreview.review-burst", "3".to_owned()),
            ],
        );
        let mut answers = Vec::new();
        for n in 0..20 {
            answers.push(
                auth.check(&Method::POST, "/v1/x", &unknown_bearer(n))
                    .await
                    .err()
                    .unwrap_or_else(|| panic!("an unchecked token got in")),
            );
        }
        let asked = answers
            .iter()
            .filter(|e| e.message.contains("no usable answer"))
            .count();
        assert_eq!(calls.load(std::sync::atomic::Ordering::SeqCst), asked);
        // The burst, and one more only if this loop outlasted a second.
        assert!((3..=4).contains(&asked), "{asked} reviews were sent");
        let port = url.rsplit(':').next().unwrap_or_default();
        for (n, error) in answers.iter().enumerate() {
            assert_eq!(error.code, ErrorCode::AuthUnavailable, "{n}: {error}");
            assert_eq!(error.status.as_u16(), 503);
            let wait = error.retry_after_millis.unwrap_or_default();
            if n < 3 || error.message.contains("no usable answer") {
                assert_eq!(wait, REVIEW_FAILED_RETRY_AFTER_MS, "{n}: {error}");
                assert!(error.message.contains("no usable answer"), "{error}");
            } else {
                assert!(wait > 0 && wait <= 1_000, "{n}: {wait}");
                assert!(error.message.contains("too many credentials"), "{error}");
            }
            // What the operator needs is in the log; the caller sees no address and no file.
            for secret in [
                url.as_str(),
                "127.0.0.1",
                port,
                &own.display().to_string(),
                "own-sa-token",
            ] {
                assert!(!error.message.contains(secret), "{n}: {error}");
            }
            assert!(error.details.is_none());
        }
        // The refusals did not crowd out the cache: a remembered caller still gets in at once.
        reviewer(&auth).remember(digest("a-known-token"), Some("sa-known".into()));
        let known = auth
            .check(
                &Method::POST,
                "/v1/x",
                &headers(&[("authorization", "Bearer a-known-token")]),
            )
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(known.identity().map(|i| i.name.as_str()), Some("sa-known"));
    }

    #[tokio::test]
    async fn reviews_beyond_the_in_flight_bound_wait_briefly_then_are_told_to_retry() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let (url, calls) = silent_api(true).await;
        let (auth, _) = reviewing(
            dir.path(),
            &url,
            &[
                ("auth.tokenreview.reviews-in-flight-max", "1".to_owned()),
                ("auth.tokenreview.timeout-ms", "1000".to_owned()),
            ],
        );
        let first = tokio::spawn({
            let auth = auth.clone();
            async move {
                auth.check(&Method::POST, "/v1/x", &unknown_bearer(1))
                    .await
                    .err()
            }
        });
        while calls.load(std::sync::atomic::Ordering::SeqCst) == 0 {
            tokio::task::yield_now().await;
        }
        let started = Instant::now();
        let second = auth
            .check(&Method::POST, "/v1/x", &unknown_bearer(2))
            .await
            .err()
            .unwrap_or_else(|| panic!("an unchecked token got in"));
        let waited = started.elapsed();
        assert_eq!(second.code, ErrorCode::AuthUnavailable, "{second}");
        assert!(second.message.contains("too many credentials"), "{second}");
        assert_eq!(
            second.retry_after_millis,
            Some(REVIEW_SLOT_WAIT.as_millis() as u64)
        );
        assert!(
            waited >= REVIEW_SLOT_WAIT && waited < Duration::from_secs(2),
            "{waited:?}"
        );
        assert_eq!(
            calls.load(std::sync::atomic::Ordering::SeqCst),
            1,
            "the second review was never sent"
        );
        let first = first
            .await
            .unwrap_or_else(|e| panic!("{e}"))
            .unwrap_or_else(|| panic!("an unchecked token got in"));
        assert_eq!(first.code, ErrorCode::AuthUnavailable);
        assert!(first.message.contains("no usable answer"), "{first}");
    }

    #[tokio::test]
    async fn an_unreadable_own_token_is_logged_not_shown() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let (auth, own) = reviewing(dir.path(), "http://127.0.0.1:9", &[]);
        std::fs::remove_file(&own).unwrap_or_else(|e| panic!("{e}"));
        let error = auth
            .check(&Method::POST, "/v1/x", &unknown_bearer(7))
            .await
            .err()
            .unwrap_or_else(|| panic!("an unchecked token got in"));
        assert_eq!(error.code, ErrorCode::AuthUnavailable);
        for secret in ["own-sa-token", "127.0.0.1", "token-file", "/"] {
            assert!(!error.message.contains(secret), "{secret}: {error}");
        }
    }
}
