//! `auth.mode = "tokenreview"`: the Kubernetes TokenReview client, its cache and its rate bounds.

use super::*;

/// What the service remembers of earlier reviews, by token digest. Successful reviews and
/// refusals are kept apart, each within its own bound, and a full side forgets only its least
/// recently used entry: a flood of bad tokens pushes out other refusals, never a caller that
/// was let in, and no burst empties the cache as a whole.
pub(super) struct ReviewCache {
    pub(super) approved: LruCache<[u8; 32], (Instant, String)>,
    pub(super) refused: LruCache<[u8; 32], Instant>,
    pub(super) approved_ttl: Duration,
    pub(super) refused_ttl: Duration,
}

impl ReviewCache {
    pub(super) fn new(settings: &TokenReviewSettings) -> Self {
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
    pub(super) fn get(&mut self, key: &[u8; 32], now: Instant) -> Option<Option<String>> {
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
    pub(super) fn put(&mut self, key: [u8; 32], answer: Option<String>, now: Instant) -> bool {
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

    pub(super) fn len(&self) -> (usize, usize) {
        (self.approved.len(), self.refused.len())
    }
}

/// The steady rate and burst of TokenReview calls: `reviews-per-second` tokens a second, at
/// most `review-burst` saved up.
pub(super) struct TokenBucket {
    pub(super) per_second: f64,
    pub(super) burst: f64,
    pub(super) available: f64,
    pub(super) at: Instant,
}

impl TokenBucket {
    pub(super) fn new(per_second: u32, burst: u32, now: Instant) -> Self {
        let burst = f64::from(burst.max(1));
        Self {
            per_second: f64::from(per_second.max(1)),
            burst,
            available: burst,
            at: now,
        }
    }

    /// Takes one call's worth; `Err` is how long until the next one is there.
    pub(super) fn take(&mut self, now: Instant) -> Result<(), Duration> {
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

/// Where a credential came from, for the per-source budgets: the TCP peer's address, an IPv6
/// address by its /64 (what one host is usually given), an IPv4-mapped one as IPv4. Without a
/// peer (a router served without connection info) every caller is the one unspecified source.
pub(super) fn source_key(peer: Option<IpAddr>) -> IpAddr {
    match peer.map(|ip| ip.to_canonical()) {
        Some(IpAddr::V6(v6)) => {
            let bits = u128::from(v6) & !((1u128 << 64) - 1);
            IpAddr::V6(std::net::Ipv6Addr::from(bits))
        }
        Some(ip) => ip,
        None => IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED),
    }
}

/// Every source address's own [`TokenBucket`], within `sources-max` addresses: a full table
/// forgets the address seen least recently (which comes back, if it does, with a full bucket;
/// the shared bucket still bounds what the API server sees).
pub(super) struct SourceBudgets {
    pub(super) buckets: LruCache<IpAddr, TokenBucket>,
    pub(super) per_second: u32,
    pub(super) burst: u32,
}

impl SourceBudgets {
    pub(super) fn new(settings: &TokenReviewSettings) -> Self {
        Self {
            buckets: LruCache::new(
                NonZeroUsize::new(settings.sources_max).unwrap_or(NonZeroUsize::MIN),
            ),
            per_second: settings.source_reviews_per_second,
            burst: settings.source_review_burst,
        }
    }

    /// Takes one call's worth from `source`'s bucket; `Err` is how long until there is one.
    pub(super) fn take(&mut self, source: IpAddr, now: Instant) -> Result<(), Duration> {
        let (per_second, burst) = (self.per_second, self.burst);
        self.buckets
            .get_or_insert_mut(source, || TokenBucket::new(per_second, burst, now))
            .take(now)
    }
}

/// How long a caller waits for one of the `reviews-in-flight-max` slots before it is told to
/// come back: short, since the callers' own read timeouts are 1 to 3 s (docs/contract.md#s3-8).
pub(super) const REVIEW_SLOT_WAIT: Duration = Duration::from_millis(250);
/// The `retryAfterMillis` of a review that failed (the API server did not answer, or answered
/// something unusable).
pub(super) const REVIEW_FAILED_RETRY_AFTER_MS: u64 = 1_000;
/// Throttled reviews are logged at most this often (the refusals themselves are each logged
/// as `request_refused_by_auth`).
pub(super) const THROTTLE_LOG_EVERY: Duration = Duration::from_secs(10);

/// Asks the Kubernetes API who holds a token: answers are cached, calls are rate-limited and
/// bounded in number, so unknown tokens cannot turn into a flood of API calls.
pub(super) struct TokenReviewer {
    pub(super) settings: TokenReviewSettings,
    pub(super) http: reqwest::Client,
    pub(super) cache: Mutex<ReviewCache>,
    pub(super) bucket: Mutex<TokenBucket>,
    /// Each source address's share of `bucket`, taken first.
    pub(super) sources: Mutex<SourceBudgets>,
    pub(super) slots: tokio::sync::Semaphore,
    /// When a throttled review was last logged, and how many were not logged since.
    pub(super) throttle_log: Mutex<(Option<Instant>, u64)>,
}

/// Why a review was not even asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Throttle {
    /// `reviews-per-second` / `review-burst` used up.
    Rate,
    /// The caller's source address used up `source-reviews-per-second` /
    /// `source-review-burst`.
    SourceRate,
    /// `reviews-in-flight-max` calls outstanding for longer than [`REVIEW_SLOT_WAIT`].
    InFlight,
}

#[derive(Deserialize)]
pub(super) struct ReviewAnswer {
    #[serde(default)]
    pub(super) status: ReviewStatus,
}

/// Every field may be missing (a refusal carries no user); missing is empty.
#[derive(Deserialize, Default)]
#[serde(default)]
pub(super) struct ReviewStatus {
    pub(super) authenticated: bool,
    pub(super) user: ReviewUser,
    pub(super) audiences: Vec<String>,
    pub(super) error: String,
}

#[derive(Deserialize, Default)]
#[serde(default)]
pub(super) struct ReviewUser {
    pub(super) username: String,
}

impl TokenReviewer {
    pub(super) fn new(settings: &TokenReviewSettings) -> Result<Self, String> {
        let tls =
            dlock_contract::tls::client_config(settings.ca_file.as_deref().filter(|p| p.exists()))?;
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
            sources: Mutex::new(SourceBudgets::new(settings)),
            slots: tokio::sync::Semaphore::new(settings.reviews_in_flight_max.max(1)),
            throttle_log: Mutex::new((None, 0)),
        })
    }

    pub(super) fn cached(&self, key: &[u8; 32]) -> Option<Option<String>> {
        self.cache.lock().ok()?.get(key, Instant::now())
    }

    pub(super) fn remember(&self, key: [u8; 32], answer: Option<String>) {
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
    pub(super) fn throttled(&self, why: Throttle, retry_after: Duration) -> ApiError {
        let now = Instant::now();
        if let Ok(mut log) = self.throttle_log.lock() {
            if log
                .0
                .is_none_or(|at| now.duration_since(at) >= THROTTLE_LOG_EVERY)
            {
                let limit = match why {
                    Throttle::Rate => "auth.tokenreview.reviews-per-second and review-burst",
                    Throttle::SourceRate => {
                        "auth.tokenreview.source-reviews-per-second and source-review-burst \
                         (one source address)"
                    }
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

    /// Takes a rate token, first from `source`'s own budget, then from the shared one, or says
    /// how long until there is one. The source pays first: a source whose budget is spent
    /// never takes from the shared bucket, so it cannot empty it for the others.
    pub(super) fn admit(&self, source: IpAddr) -> Result<(), ApiError> {
        let own = match self.sources.lock() {
            Ok(mut sources) => sources.take(source, Instant::now()),
            Err(_) => Err(Duration::from_secs(1)),
        };
        if let Err(wait) = own {
            return Err(self.throttled(Throttle::SourceRate, wait));
        }
        let verdict = match self.bucket.lock() {
            Ok(mut bucket) => bucket.take(Instant::now()),
            Err(_) => Err(Duration::from_secs(1)),
        };
        verdict.map_err(|wait| self.throttled(Throttle::Rate, wait))
    }

    pub(super) async fn review(
        &self,
        token: &str,
        peer: Option<IpAddr>,
    ) -> Result<Option<String>, ApiError> {
        let key = digest(token);
        if let Some(answer) = self.cached(&key) {
            return Ok(answer);
        }
        self.admit(source_key(peer))?;
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
    pub(super) async fn ask(&self, token: &str) -> Result<Option<String>, ApiError> {
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
