use super::*;
use axum::http::HeaderValue;
use std::time::SystemTime;

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

/// A write by a caller presenting `h`.
async fn post(auth: &Authenticator, h: &HeaderMap) -> Result<Caller, ApiError> {
    auth.check_from(&Method::POST, "/v1/x", h, None).await
}

/// A write that must be let in.
async fn admitted(auth: &Authenticator, h: &HeaderMap) -> Caller {
    post(auth, h).await.unwrap_or_else(|e| panic!("{e:?}"))
}

/// A write that must be refused.
async fn refused(auth: &Authenticator, h: &HeaderMap) -> ApiError {
    post(auth, h)
        .await
        .err()
        .unwrap_or_else(|| panic!("an unchecked token got in"))
}

fn bearer(token: &str) -> HeaderMap {
    headers(&[("authorization", &format!("Bearer {token}"))])
}

/// What `identify` makes of a token: the identity's name, or `None`.
async fn identity_of(auth: &Authenticator, token: &str) -> Option<String> {
    auth.identify(token, None).await.ok().flatten()
}

#[tokio::test]
async fn tokens_mode_names_the_caller_and_binds_the_owner() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let s = settings(
        dir.path(),
        "# who may write\nworker-a aaaaaaaaaaaaaaaaaaaa executor\noperator oooooooooooooooooooo\n",
    );
    let auth = Authenticator::new(&s, None, OperatorWithoutAuth::Refused)
        .unwrap_or_else(|e| panic!("{e}"));
    for (path, refused) in [
        ("/v1/locks/k/acquire", headers(&[])),
        ("/v1/x", bearer("wrongwrongwrongwrong")),
        (
            "/v1/x",
            headers(&[("authorization", "Basic aaaaaaaaaaaaaaaaaaaa")]),
        ),
    ] {
        let answer = auth.check_from(&Method::POST, path, &refused, None).await;
        assert_eq!(
            answer.err().map(|e| e.code),
            Some(ErrorCode::Unauthenticated),
            "{refused:?}"
        );
    }
    let worker = [("authorization", "Bearer aaaaaaaaaaaaaaaaaaaa")];
    let caller = admitted(&auth, &headers(&worker)).await;
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
        assert_eq!(post(&auth, &h).await.is_ok(), ok, "{owner}");
    }
    let op = headers(&[
        ("authorization", "Bearer oooooooooooooooooooo"),
        ("x-owner-id", "anyone"),
    ]);
    assert!(
        admitted(&auth, &op)
            .await
            .require_operator("revoke")
            .is_ok()
    );
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
            auth.check_from(&method, path, &headers(&[]), None)
                .await
                .is_ok(),
            open,
            "{method} {path}"
        );
    }
}

#[tokio::test]
async fn none_mode_follows_the_operator_policy_and_the_legacy_token() {
    let s =
        AuthSettings::from_raw(&mut RawConfig::from_pairs(&[]).unwrap_or_else(|e| panic!("{e}")))
            .unwrap_or_else(|e| panic!("{e}"));
    let anyone = HeaderMap::new();
    let legacy_token = "legacy-operator-token";
    // Who may act as operator with no authentication: the policy, or the bearer of the legacy
    // token (anyone else is asked to authenticate).
    for (policy, legacy, h, operator) in [
        (OperatorWithoutAuth::Open, None, &anyone, Ok(())),
        (
            OperatorWithoutAuth::Refused,
            None,
            &anyone,
            Err(ErrorCode::Forbidden),
        ),
        (
            OperatorWithoutAuth::Refused,
            Some(legacy_token),
            &anyone,
            Err(ErrorCode::Unauthenticated),
        ),
        (
            OperatorWithoutAuth::Refused,
            Some(legacy_token),
            &bearer(legacy_token),
            Ok(()),
        ),
    ] {
        let auth = Authenticator::new(&s, legacy, policy).unwrap_or_else(|e| panic!("{e}"));
        let caller = admitted(&auth, h).await;
        assert_eq!(
            caller.require_operator("x").map_err(|e| e.code),
            operator,
            "{legacy:?} {h:?}"
        );
    }
}

/// The answer's code for `method path` by the holder of `token` (`None`: admitted).
async fn verdict(
    auth: &Authenticator,
    method: Method,
    path: &str,
    token: &str,
) -> Option<ErrorCode> {
    auth.check_from(&method, path, &bearer(token), None)
        .await
        .err()
        .map(|e| e.code)
}

#[tokio::test]
async fn an_identity_needs_a_role_the_request_allows_and_one_with_none_may_only_probe() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let file = dir.path().join("tokens");
    std::fs::write(
        &file,
        "nobody nnnnnnnnnnnnnnnnnnnn\n\
         reg rrrrrrrrrrrrrrrrrrrr registrar\n\
         executor eeeeeeeeeeeeeeeeeeee\n\
         auditor aaaaaaaaaaaaaaaaaaaa reader\n\
         treasury tttttttttttttttttttt\n",
    )
    .unwrap_or_else(|e| panic!("{e}"));
    let mut raw = RawConfig::from_pairs(&[
        ("auth.mode", "tokens".to_owned()),
        ("auth.tokens-file", file.display().to_string()),
    ])
    .unwrap_or_else(|e| panic!("{e}"));
    let s = AuthSettings::from_raw(&mut raw).unwrap_or_else(|e| panic!("{e}"));
    let auth = Authenticator::new(&s, None, OperatorWithoutAuth::Refused)
        .unwrap_or_else(|e| panic!("{e}"));
    let forbidden = Some(ErrorCode::Forbidden);
    // No role: every write and every read under /v1/ is 403; the probes stay open.
    for (method, path) in [
        (Method::POST, "/v1/payouts"),
        (Method::POST, "/v1/payouts/p/claim"),
        (Method::POST, "/v1/locks/k/acquire"),
        (Method::GET, "/v1/payouts/p"),
        (Method::GET, "/v1/locks"),
        (Method::POST, "/v1/unknown"),
    ] {
        assert_eq!(
            verdict(&auth, method.clone(), path, "nnnnnnnnnnnnnnnnnnnn").await,
            forbidden,
            "{method} {path}"
        );
    }
    for path in ["/healthz", "/readyz", "/metrics", "/v1/openapi.json"] {
        assert_eq!(
            verdict(&auth, Method::GET, path, "nnnnnnnnnnnnnnnnnnnn").await,
            None
        );
    }
    // Each role its own writes, and reads.
    for (token, method, path, expected) in [
        ("rrrrrrrrrrrrrrrrrrrr", Method::POST, "/v1/payouts", None),
        (
            "rrrrrrrrrrrrrrrrrrrr",
            Method::POST,
            "/v1/payouts/p/claim",
            forbidden,
        ),
        (
            "eeeeeeeeeeeeeeeeeeee",
            Method::POST,
            "/v1/payouts/p/claim",
            None,
        ),
        (
            "eeeeeeeeeeeeeeeeeeee",
            Method::POST,
            "/v1/rail/submissions",
            None,
        ),
        (
            "eeeeeeeeeeeeeeeeeeee",
            Method::POST,
            "/v1/payouts",
            forbidden,
        ),
        (
            "eeeeeeeeeeeeeeeeeeee",
            Method::POST,
            "/v1/accounts/a/fund",
            forbidden,
        ),
        (
            "eeeeeeeeeeeeeeeeeeee",
            Method::POST,
            "/v1/payouts/p/cancel",
            forbidden,
        ),
        ("eeeeeeeeeeeeeeeeeeee", Method::GET, "/v1/payouts/p", None),
        ("aaaaaaaaaaaaaaaaaaaa", Method::GET, "/v1/payouts/p", None),
        (
            "aaaaaaaaaaaaaaaaaaaa",
            Method::POST,
            "/v1/payouts",
            forbidden,
        ),
        (
            "aaaaaaaaaaaaaaaaaaaa",
            Method::POST,
            "/v1/locks/k/acquire",
            forbidden,
        ),
        (
            "tttttttttttttttttttt",
            Method::POST,
            "/v1/accounts/a/fund",
            None,
        ),
        (
            "tttttttttttttttttttt",
            Method::POST,
            "/v1/accounts/a/limits",
            None,
        ),
        (
            "tttttttttttttttttttt",
            Method::POST,
            "/v1/payouts",
            forbidden,
        ),
    ] {
        assert_eq!(
            verdict(&auth, method.clone(), path, token).await,
            expected,
            "{token} {method} {path}"
        );
    }
    let refusal = auth
        .check_from(
            &Method::POST,
            "/v1/payouts",
            &bearer("eeeeeeeeeeeeeeeeeeee"),
            None,
        )
        .await
        .err()
        .unwrap_or_else(|| panic!("the executor registered"));
    assert!(refusal.message.contains("registrar"), "{}", refusal.message);
    // The rail stub's authenticator checks credentials only; its handler admits submitters.
    let stub = auth.clone().without_roles();
    assert_eq!(
        verdict(&stub, Method::POST, "/submit", "nnnnnnnnnnnnnnnnnnnn").await,
        None
    );
}

#[test]
fn the_service_account_allow_list_gives_roles_and_a_bad_entry_stops_the_start() {
    let settings = |entries: &str| {
        let mut raw = RawConfig::from_pairs(&[
            ("auth.mode", "tokenreview".to_owned()),
            ("auth.tokenreview.service-accounts", entries.to_owned()),
        ])
        .unwrap_or_else(|e| panic!("{e}"));
        AuthSettings::from_raw(&mut raw)
    };
    let s = settings("payments/exec=executor, payments/ops=operator+reader")
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        s.service_accounts,
        vec![
            (
                "system:serviceaccount:payments:exec".to_owned(),
                Roles::of(&[Role::Executor])
            ),
            (
                "system:serviceaccount:payments:ops".to_owned(),
                Roles::of(&[Role::Operator, Role::Reader])
            ),
        ]
    );
    let error = settings("payments/exec=admin")
        .err()
        .unwrap_or_else(|| panic!("an unknown role was accepted"));
    assert_eq!(error.key, "auth.tokenreview.service-accounts");
}

#[test]
fn a_tokens_file_is_checked_line_by_line() {
    assert!(parse_tokens_file("a bbbbbbbbbbbbbbbbbbbb root").is_err());
    assert_eq!(
        parse_token_lines("a bbbbbbbbbbbbbbbbbbbb executor,registrar")
            .unwrap_or_default()
            .first()
            .map(|line| line.3),
        Some(Roles::of(&[Role::Executor, Role::Registrar]))
    );
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
        if let Some(table) = &auth.inner.tokens {
            table.0.look_now();
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
    assert_eq!(identity_of(&auth, "aaaaaaaaaaaaaaaaaaaa").await, None);
    assert_eq!(
        identity_of(&auth, "bbbbbbbbbbbbbbbbbbbb").await.as_deref(),
        Some("w")
    );
    touch("this is not a tokens file\n", 10);
    force_recheck(&auth);
    assert_eq!(
        identity_of(&auth, "bbbbbbbbbbbbbbbbbbbb").await.as_deref(),
        Some("w"),
        "a broken file keeps the previous tokens"
    );
}

/// An authenticator in `tokenreview` mode against `url` with `extra` `auth.tokenreview.*`
/// settings, its own token in a temporary directory (removed when the first value drops).
fn reviewing(url: &str, extra: &[(&str, &str)]) -> (tempfile::TempDir, Authenticator, PathBuf) {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let own = dir.path().join("own-sa-token-0f3c");
    std::fs::write(&own, "this-service-s-own-token").unwrap_or_else(|e| panic!("{e}"));
    let mut pairs = vec![
        ("auth.mode", "tokenreview".to_owned()),
        ("auth.tokenreview.url", url.to_owned()),
        ("auth.tokenreview.ca-file", String::new()),
        ("auth.tokenreview.token-file", own.display().to_string()),
        // The identity the tests' stand-in reviews admit, with a role so it is let in.
        ("auth.reader-identities", "sa-known".to_owned()),
    ];
    let extra: Vec<_> = extra
        .iter()
        .map(|(k, v)| (format!("auth.tokenreview.{k}"), (*v).to_owned()))
        .collect();
    pairs.extend(extra.iter().map(|(k, v)| (k.as_str(), v.clone())));
    let mut raw = RawConfig::from_pairs(&pairs).unwrap_or_else(|e| panic!("{e}"));
    let s = AuthSettings::from_raw(&mut raw).unwrap_or_else(|e| panic!("{e}"));
    let auth = Authenticator::new(&s, None, OperatorWithoutAuth::Refused)
        .unwrap_or_else(|e| panic!("{e}"));
    (dir, auth, own)
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
    let (_dir, auth, _) = reviewing(
        "http://127.0.0.1:9",
        &[("cache-max", "2"), ("refused-cache-max", "2")],
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

/// TokenReview settings with no API server: answers cached 60 s (10 of each), one review at a
/// time, a burst of one, one source.
fn review_settings() -> TokenReviewSettings {
    TokenReviewSettings {
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
        source_reviews_per_second: 1,
        source_review_burst: 1,
        sources_max: 1,
    }
}

#[test]
fn review_answers_expire_and_refusals_sooner() {
    let settings = review_settings();
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

#[test]
fn a_source_that_spent_its_budget_leaves_the_shared_one_to_the_others() {
    let settings = TokenReviewSettings {
        review_burst: 5,
        source_review_burst: 2,
        sources_max: 2,
        ..review_settings()
    };
    let review = TokenReviewer::new(&settings).unwrap_or_else(|e| panic!("{e}"));
    let flood = source_key(Some("127.0.0.2".parse().unwrap_or_else(|e| panic!("{e}"))));
    let caller = source_key(Some("127.0.0.1".parse().unwrap_or_else(|e| panic!("{e}"))));
    let admitted = (0..20).filter(|_| review.admit(flood).is_ok()).count();
    assert_eq!(
        admitted, 2,
        "the flooding source got its own burst, no more"
    );
    let refusal = review
        .admit(flood)
        .err()
        .unwrap_or_else(|| panic!("admitted"));
    assert_eq!(refusal.code, ErrorCode::AuthUnavailable);
    assert!(
        refusal
            .retry_after_millis
            .is_some_and(|ms| ms > 0 && ms <= 1_000)
    );
    assert!(
        review.admit(caller).is_ok(),
        "another source is still reviewed"
    );
    // The shared bucket stays the outer bound: 5 in all, however many sources ask.
    let third = source_key(Some("10.0.0.3".parse().unwrap_or_else(|e| panic!("{e}"))));
    assert_eq!(review.admit(third).map_err(|e| e.code), Ok(()));
    assert_eq!(review.admit(third).map_err(|e| e.code), Ok(()));
    assert!(
        review.admit(caller).is_err(),
        "the shared burst of 5 is spent"
    );
    // The table keeps `sources-max` addresses; the one seen least recently goes.
    let sources = review.sources.lock().unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(sources.buckets.len(), 2);
    assert!(!sources.buckets.contains(&flood));
}

#[test]
fn an_ipv6_source_is_its_64_and_a_mapped_ipv4_is_ipv4() {
    let key = |s: &str| source_key(Some(s.parse().unwrap_or_else(|e| panic!("{e}"))));
    assert_eq!(key("2001:db8:1:2:aaaa::1"), key("2001:db8:1:2:bbbb::2"));
    assert_ne!(key("2001:db8:1:2::1"), key("2001:db8:1:3::1"));
    assert_eq!(key("::ffff:10.1.2.3"), key("10.1.2.3"));
    assert_eq!(source_key(None), key("0.0.0.0"));
}

fn unknown_bearer(n: usize) -> HeaderMap {
    bearer(&format!("made-up-token-{n:04}"))
}

#[tokio::test]
async fn unknown_tokens_beyond_the_rate_are_refused_without_asking_the_api_server() {
    let (url, calls) = silent_api(false).await;
    let (_dir, auth, own) = reviewing(&url, &[("reviews-per-second", "1"), ("review-burst", "3")]);
    let mut answers = Vec::new();
    for n in 0..20 {
        answers.push(refused(&auth, &unknown_bearer(n)).await);
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
    let known = admitted(&auth, &bearer("a-known-token")).await;
    assert_eq!(known.identity().map(|i| i.name.as_str()), Some("sa-known"));
}

#[tokio::test]
async fn reviews_beyond_the_in_flight_bound_wait_briefly_then_are_told_to_retry() {
    let (url, calls) = silent_api(true).await;
    let (_dir, auth, _) = reviewing(
        &url,
        &[("reviews-in-flight-max", "1"), ("timeout-ms", "1000")],
    );
    let first = tokio::spawn({
        let auth = auth.clone();
        async move { post(&auth, &unknown_bearer(1)).await.err() }
    });
    while calls.load(std::sync::atomic::Ordering::SeqCst) == 0 {
        tokio::task::yield_now().await;
    }
    let started = Instant::now();
    let second = refused(&auth, &unknown_bearer(2)).await;
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
    let (_dir, auth, own) = reviewing("http://127.0.0.1:9", &[]);
    std::fs::remove_file(&own).unwrap_or_else(|e| panic!("{e}"));
    let error = refused(&auth, &unknown_bearer(7)).await;
    assert_eq!(error.code, ErrorCode::AuthUnavailable);
    for secret in ["own-sa-token", "127.0.0.1", "token-file", "/"] {
        assert!(!error.message.contains(secret), "{secret}: {error}");
    }
}
