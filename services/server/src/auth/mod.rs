//! Who is calling: bearer credentials on every write of every service. (What a client sends is
//! `dlock_contract::auth::Credential`.)
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
//!   `retryAfterMillis` and `Retry-After`, and the API server is not asked. Within that shared
//!   budget every source address (the TCP peer) has its own, `source-reviews-per-second` with
//!   `source-review-burst`, so a flood of made-up tokens from one address uses up only that
//!   address's budget and a caller from another address is still reviewed.
//! - `none`: nothing is checked (a laptop, the test suite). The service says so at start.
//!
//! Then, whatever the mode:
//!
//! - a request that needs a credential (every write; every read under `/v1/` but the OpenAPI
//!   document) and has none, or a wrong one, is `401 UNAUTHENTICATED` and reaches no handler;
//! - an authenticated identity needs a role the request allows ([`roles`]: treasury, registrar,
//!   executor, operator, reader; the one table is [`roles::WRITES`]), else `403 FORBIDDEN`
//!   before any handler runs: an identity with no role may do nothing but the probes;
//! - operator-only operations (revoke, fence advance, resolution, high-water floor) need an
//!   identity listed in `auth.operator-identities`, else `403 FORBIDDEN`;
//! - treasury operations (opening and funding an account: what creates money in the ledger)
//!   need an identity listed in `auth.treasury-identities`, else `403 FORBIDDEN`; no other
//!   identity, the operator's and the executor's included, may fund;
//! - `X-Owner-Id` must be the identity itself or `<identity>/<worker>` (`auth.owner-binding`),
//!   else `403 FORBIDDEN`: a worker cannot write in another worker's name. Operators may name
//!   any owner, since a revocation acts on someone else's lock.

use std::collections::BTreeSet;
use std::net::IpAddr;
use std::num::NonZeroUsize;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, Method, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use lru::LruCache;
use serde::Deserialize;
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use dlock_contract::error::{ApiError, ErrorCode};
use dlock_contract::headers;

use crate::config::{ConfigError, RawConfig};
use crate::watch::{Reload, Watched};

mod review;
pub mod roles;
#[cfg(test)]
mod tests;
mod tokens;

use review::*;
pub use roles::{Role, RoleMap, Roles};
pub use tokens::*;

/// The operator identity when `auth.operator-identities` is not set.
pub const DEFAULT_OPERATOR_IDENTITY: &str = "operator";
/// The treasury identity when `auth.treasury-identities` is not set.
pub const DEFAULT_TREASURY_IDENTITY: &str = "treasury";
/// The registrar identity when `auth.registrar-identities` is not set.
pub const DEFAULT_REGISTRAR_IDENTITY: &str = "registrar";
/// The executor identity when `auth.executor-identities` is not set.
pub const DEFAULT_EXECUTOR_IDENTITY: &str = "executor";
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
    /// `auth.tokenreview.source-reviews-per-second`: the steady rate of TokenReview calls for
    /// one source address (never above `reviews-per-second`).
    pub source_reviews_per_second: u32,
    /// `auth.tokenreview.source-review-burst`: one source address's burst (never above
    /// `review-burst`).
    pub source_review_burst: u32,
    /// `auth.tokenreview.sources-max`: source addresses whose budgets are remembered at once;
    /// when full, the one seen least recently is forgotten.
    pub sources_max: usize,
}

/// `auth.*`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AuthSettings {
    pub mode: AuthMode,
    /// `auth.tokens-file`, for `tokens`.
    pub tokens_file: Option<PathBuf>,
    /// `auth.operator-identities`.
    pub operator_identities: Vec<String>,
    /// `auth.treasury-identities`: who may open and fund accounts.
    pub treasury_identities: Vec<String>,
    /// `auth.registrar-identities`: who may register payouts.
    pub registrar_identities: Vec<String>,
    /// `auth.executor-identities`: who may run registered payouts.
    pub executor_identities: Vec<String>,
    /// `auth.reader-identities`: who may only read.
    pub reader_identities: Vec<String>,
    /// `auth.tokenreview.service-accounts`: the ServiceAccount allow-list, as the identities
    /// TokenReview names them and their roles.
    pub service_accounts: Vec<(String, Roles)>,
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
        let treasury_identities =
            raw.string_list("auth.treasury-identities", &[DEFAULT_TREASURY_IDENTITY])?;
        let registrar_identities =
            raw.string_list("auth.registrar-identities", &[DEFAULT_REGISTRAR_IDENTITY])?;
        let executor_identities =
            raw.string_list("auth.executor-identities", &[DEFAULT_EXECUTOR_IDENTITY])?;
        let reader_identities = raw.string_list("auth.reader-identities", &[])?;
        let service_accounts = raw
            .string_list("auth.tokenreview.service-accounts", &[])?
            .iter()
            .map(|entry| roles::parse_service_account(entry))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|message| ConfigError {
                key: "auth.tokenreview.service-accounts".into(),
                origin: String::new(),
                message,
            })?;
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
        let source_reviews_per_second =
            raw.integer("auth.tokenreview.source-reviews-per-second", 5, 1..=10_000)?;
        let source_review_burst =
            raw.integer("auth.tokenreview.source-review-burst", 10, 1..=100_000)?;
        let sources_max = raw.integer("auth.tokenreview.sources-max", 4_096, 1..=1_000_000)?;
        Ok(Self {
            mode,
            tokens_file,
            operator_identities,
            treasury_identities,
            registrar_identities,
            executor_identities,
            reader_identities,
            service_accounts,
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
                source_reviews_per_second: source_reviews_per_second.min(reviews_per_second) as u32,
                source_review_burst: source_review_burst.min(review_burst) as u32,
                sources_max: sources_max as usize,
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
    /// Listed in `auth.treasury-identities`.
    pub treasury: bool,
    /// Every role it holds ([`roles`]).
    pub roles: Roles,
}

/// What the auth middleware found out about a request; every handler can read it.
#[derive(Debug, Clone)]
pub struct Caller {
    identity: Option<Identity>,
    operator: RoleVerdict,
    /// Whether the caller may open and fund accounts: only a treasury identity, or anyone when
    /// `auth.mode` is `none` (nothing is checked then).
    treasury: RoleVerdict,
    /// Whether an `Authorization` header was sent at all.
    presented: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum RoleVerdict {
    Allowed,
    Anonymous,
    NotInRole,
    Disabled,
}

impl Caller {
    pub fn identity(&self) -> Option<&Identity> {
        self.identity.as_ref()
    }

    /// What the caller's credential authenticated as, recorded in the audit rows beside the
    /// typed-in operator; `anonymous` without one.
    pub fn audit_identity(&self) -> String {
        self.identity
            .as_ref()
            .map_or_else(|| "anonymous".to_owned(), |i| i.name.clone())
    }

    /// [`Self::require_operator`], then [`Self::audit_identity`]: who made an operator write.
    pub fn operator(&self, what: &str) -> Result<String, ApiError> {
        self.require_operator(what)?;
        Ok(self.audit_identity())
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

    /// `Ok` when the caller may run a treasury operation, opening or funding an account (`what`
    /// names it in the error); the identity it authenticated as, for the audit.
    pub fn require_treasury(&self, what: &str) -> Result<(), ApiError> {
        let verdict = match self.treasury {
            RoleVerdict::Allowed => Ok(()),
            RoleVerdict::NotInRole => Err(ApiError::new(
                ErrorCode::Forbidden,
                format!(
                    "{what} creates money in the ledger and `{}` is not a treasury identity \
                     (auth.treasury-identities); nothing was changed",
                    self.identity.as_ref().map_or("", |i| i.name.as_str())
                ),
            )),
            _ => Err(ApiError::new(
                ErrorCode::Unauthenticated,
                format!("{what} needs a treasury credential as Authorization: Bearer <token>"),
            )),
        };
        if let Err(error) = &verdict {
            tracing::warn!(
                event = "treasury_credential_refused",
                code = error.code.as_str(),
                operation = what,
                identity = self.identity.as_ref().map_or("", |i| i.name.as_str()),
                "a treasury operation was refused"
            );
        }
        verdict
    }

    fn operator_verdict(&self, what: &str) -> Result<(), ApiError> {
        match self.operator {
            RoleVerdict::Allowed => Ok(()),
            RoleVerdict::Anonymous if self.presented => Err(ApiError::new(
                ErrorCode::Unauthenticated,
                format!(
                    "{what} needs the operator's credential, and the one presented \
                     authenticates nobody; nothing was changed"
                ),
            )),
            RoleVerdict::Anonymous => Err(ApiError::new(
                ErrorCode::Unauthenticated,
                format!("{what} needs the operator's credential as Authorization: Bearer <token>"),
            )),
            RoleVerdict::NotInRole => Err(ApiError::new(
                ErrorCode::Forbidden,
                format!(
                    "{what} is an operator operation and `{}` is not an operator identity \
                     (auth.operator-identities); nothing was changed",
                    self.identity.as_ref().map_or("", |i| i.name.as_str())
                ),
            )),
            RoleVerdict::Disabled => Err(ApiError::new(
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
    /// Whether an identity needs a role for each request (every dlock service); off for the rail
    /// stub, which admits its own submitters ([`Self::without_roles`]).
    roles_enforced: bool,
}

struct Inner {
    mode: AuthMode,
    operators: BTreeSet<String>,
    /// Roles from the configured lists and the ServiceAccount allow-list; the tokens file's own
    /// column is added per lookup.
    roles: RoleMap,
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
        let mut roles = RoleMap::default();
        for (role, names) in [
            (Role::Operator, &settings.operator_identities),
            (Role::Treasury, &settings.treasury_identities),
            (Role::Registrar, &settings.registrar_identities),
            (Role::Executor, &settings.executor_identities),
            (Role::Reader, &settings.reader_identities),
        ] {
            for name in names {
                roles.grant(name, Roles::of(&[role]));
            }
        }
        for (identity, held) in &settings.service_accounts {
            roles.grant(identity, *held);
        }
        Ok(Self {
            roles_enforced: true,
            inner: Arc::new(Inner {
                mode: settings.mode,
                operators: settings.operator_identities.iter().cloned().collect(),
                roles,
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
                operators = ?self.inner.roles.holders(Role::Operator),
                treasury = ?self.inner.roles.holders(Role::Treasury),
                registrars = ?self.inner.roles.holders(Role::Registrar),
                executors = ?self.inner.roles.holders(Role::Executor),
                readers = ?self.inner.roles.holders(Role::Reader),
                roles_enforced = self.roles_enforced,
                owner_binding = self.inner.owner_binding,
                "every write needs a credential, and every identity a role"
            ),
        }
    }

    /// This authenticator without the role check: credentials are still checked, but any
    /// identity passes on to the handler, which decides (the rail stub's submitters).
    #[must_use]
    pub fn without_roles(mut self) -> Self {
        self.roles_enforced = false;
        self
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
    #[cfg(test)]
    async fn identify(
        &self,
        bearer: &str,
        peer: Option<IpAddr>,
    ) -> Result<Option<String>, ApiError> {
        Ok(self
            .identify_with_roles(bearer, peer)
            .await?
            .map(|(name, _)| name))
    }

    /// [`Self::identify`], with the roles the tokens file's line gives the identity (none in
    /// other modes).
    async fn identify_with_roles(
        &self,
        bearer: &str,
        peer: Option<IpAddr>,
    ) -> Result<Option<(String, Roles)>, ApiError> {
        if let Some(legacy) = &self.inner.legacy_operator
            && bool::from(digest(bearer).ct_eq(legacy))
        {
            return Ok(Some((
                self.legacy_operator_name(),
                Roles::of(&[Role::Operator]),
            )));
        }
        match self.inner.mode {
            AuthMode::None => Ok(None),
            AuthMode::Tokens => Ok(self.inner.tokens.as_ref().and_then(|t| t.lookup(bearer))),
            AuthMode::TokenReview => match &self.inner.review {
                Some(review) => Ok(review
                    .review(bearer, peer)
                    .await?
                    .map(|name| (name, Roles::NONE))),
                None => Ok(None),
            },
        }
    }

    /// The verdict for one request, from its method, path and headers, for a request from `peer`
    /// (the TCP peer's address; `None`: one unknown source address), whose TokenReviews are
    /// budgeted per source address.
    pub async fn check_from(
        &self,
        method: &Method,
        path: &str,
        headers: &HeaderMap,
        peer: Option<IpAddr>,
    ) -> Result<Caller, ApiError> {
        let needs = self.inner.mode != AuthMode::None && needs_credential(method, path);
        let bearer = match bearer(headers) {
            Ok(bearer) => bearer,
            Err(error) if needs => return Err(error),
            Err(_) => None,
        };
        let name = match bearer {
            Some(token) => self.identify_with_roles(token, peer).await?,
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
        let identity = name.map(|(name, from_file)| {
            let roles = self.inner.roles.roles_of(&name).union(from_file);
            Identity {
                operator: roles.contains(Role::Operator),
                treasury: roles.contains(Role::Treasury),
                roles,
                name,
            }
        });
        if let Some(identity) = &identity
            && needs
            && self.roles_enforced
        {
            let allowed = roles::roles_for(method, path);
            if !identity.roles.intersects(allowed) {
                tracing::warn!(
                    event = "role_refused",
                    identity = %identity.name,
                    held = %identity.roles.names(),
                    needed = %allowed.names(),
                    %method,
                    path,
                    "a request was refused: the identity holds no role this request allows"
                );
                let message = if identity.roles.is_empty() {
                    format!(
                        "`{}` holds no role here, so it may do nothing but the probes; name it in \
                         one of auth.<role>-identities, the tokens file's third column or \
                         auth.tokenreview.service-accounts; nothing was changed",
                        identity.name
                    )
                } else {
                    format!(
                        "{method} {path} needs one of the roles {} and `{}` holds {}; nothing was \
                         changed",
                        allowed.names(),
                        identity.name,
                        identity.roles.names()
                    )
                };
                return Err(ApiError::new(ErrorCode::Forbidden, message).with_details(
                    serde_json::json!({
                        "identity": identity.name,
                        "roles": identity.roles.iter().map(Role::as_str).collect::<Vec<_>>(),
                        "requiredRoles": allowed.iter().map(Role::as_str).collect::<Vec<_>>(),
                    }),
                ));
            }
        }
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
            Some(identity) if identity.operator => RoleVerdict::Allowed,
            Some(_) => RoleVerdict::NotInRole,
            None if self.inner.mode == AuthMode::None && self.inner.legacy_operator.is_none() => {
                match self.inner.without_auth {
                    OperatorWithoutAuth::Open => RoleVerdict::Allowed,
                    OperatorWithoutAuth::Refused => RoleVerdict::Disabled,
                }
            }
            None => RoleVerdict::Anonymous,
        };
        let treasury = match &identity {
            _ if self.inner.mode == AuthMode::None => RoleVerdict::Allowed,
            Some(identity) if identity.treasury => RoleVerdict::Allowed,
            Some(_) => RoleVerdict::NotInRole,
            None => RoleVerdict::Anonymous,
        };
        Ok(Caller {
            identity,
            operator,
            treasury,
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
    let peer = request
        .extensions()
        .get::<axum::extract::ConnectInfo<crate::http::PeerAddr>>()
        .map(|info| info.0.0.ip());
    match auth
        .check_from(request.method(), &path, request.headers(), peer)
        .await
    {
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
