//! `auth.mode = "tokenreview"` against a stand-in Kubernetes API: the caller is named by its
//! ServiceAccount, the answer is cached, and the service fails closed when the API does not
//! answer.

use super::*;

#[derive(Clone)]
struct FakeApi {
    reviews: Arc<AtomicUsize>,
    service_token: String,
}

/// The one Kubernetes API call dlock makes: a TokenReview, answered as the API server would.
async fn token_review(
    axum::extract::State(api): axum::extract::State<FakeApi>,
    headers: axum::http::HeaderMap,
    axum::Json(review): axum::Json<Value>,
) -> (axum::http::StatusCode, axum::Json<Value>) {
    api.reviews.fetch_add(1, Ordering::SeqCst);
    let caller = headers
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default();
    if caller != format!("Bearer {}", api.service_token) {
        return (axum::http::StatusCode::UNAUTHORIZED, axum::Json(json!({})));
    }
    let token = review["spec"]["token"].as_str().unwrap_or_default();
    let audiences = review["spec"]["audiences"].clone();
    let status = match token {
        "projected-executor-token" => json!({
            "authenticated": true,
            "user": {"username": "system:serviceaccount:payments:executor"},
            "audiences": audiences,
        }),
        "token-for-another-audience" => json!({
            "authenticated": true,
            "user": {"username": "system:serviceaccount:payments:executor"},
            "audiences": ["https://kubernetes.default.svc"],
        }),
        _ => json!({"authenticated": false, "error": "invalid bearer token"}),
    };
    (
        axum::http::StatusCode::CREATED,
        axum::Json(
            json!({"apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview", "status": status}),
        ),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokenreview_names_the_service_account_caches_the_answer_and_fails_closed() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let api = FakeApi {
        reviews: Arc::new(AtomicUsize::new(0)),
        service_token: "the-stub-s-own-service-account-token".into(),
    };
    let own_token = dir.path().join("sa-token");
    std::fs::write(&own_token, &api.service_token).unwrap_or_else(|e| panic!("{e}"));
    let (listener, api_addr) = loopback().await;
    let app = axum::Router::new()
        .route(
            "/apis/authentication.k8s.io/v1/tokenreviews",
            axum::routing::post(token_review),
        )
        .with_state(api.clone());
    let api_server = tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });

    let port = free_port().unwrap_or_else(|e| panic!("{e}"));
    let env = vec![
        ("server.listen".to_owned(), format!("127.0.0.1:{port}")),
        ("auth.mode".to_owned(), "tokenreview".to_owned()),
        (
            "auth.tokenreview.url".to_owned(),
            format!("http://{api_addr}"),
        ),
        ("auth.tokenreview.ca-file".to_owned(), String::new()),
        (
            "auth.tokenreview.token-file".to_owned(),
            own_token.display().to_string(),
        ),
        ("auth.tokenreview.audiences".to_owned(), "dlock".to_owned()),
        (
            "rail.stub.statement-path".to_owned(),
            dir.path().join("statement.jsonl").display().to_string(),
        ),
        // The review is under test here, not who may submit: the reviewed identity submits.
        (
            "rail.stub.submitter-identities".to_owned(),
            "system:serviceaccount:payments:executor".to_owned(),
        ),
    ];
    let _stub = serve("rail-stub", env, &dir.path().join("stub.log"));
    let url = format!("http://127.0.0.1:{port}");
    until_ready("the stub", port).await;
    let submit = |token: &'static str, n: u32| {
        let url = format!("{url}/submit");
        async move {
            let bearer = format!("Bearer {token}");
            let body = format!(r#"{{"clientRef":"tr-{n}","amountMinor":100,"currency":"EUR"}}"#);
            raw(
                Method::POST,
                &url,
                &[
                    ("content-type", "application/json"),
                    ("authorization", bearer.as_str()),
                ],
                Some(&body),
            )
            .await
        }
    };
    let first = submit("projected-executor-token", 1).await;
    assert_eq!(first.0, 200, "{}", first.2);
    let second = submit("projected-executor-token", 2).await;
    assert_eq!(second.0, 200, "{}", second.2);
    assert_eq!(
        api.reviews.load(Ordering::SeqCst),
        1,
        "the second call is answered from the cache"
    );

    assert_refused(
        "an unknown token",
        &submit("a-token-nobody-minted", 3).await,
        401,
        "UNAUTHENTICATED",
    );
    assert_refused(
        "a token for another audience",
        &submit("token-for-another-audience", 4).await,
        401,
        "UNAUTHENTICATED",
    );
    // The API server is gone: a token not in the cache cannot be checked, and is not let in.
    api_server.abort();
    let _ = api_server.await;
    assert_refused(
        "the API server is down",
        &submit("another-projected-token", 5).await,
        503,
        "AUTH_UNAVAILABLE",
    );
    let (_, _, statement) = raw(Method::GET, &format!("{url}/statement"), &[], None).await;
    let refs: Vec<&str> = statement["transfers"]
        .as_array()
        .map(|t| t.iter().filter_map(|t| t["clientRef"].as_str()).collect())
        .unwrap_or_default();
    assert_eq!(
        refs,
        ["tr-1", "tr-2"],
        "only the authenticated submits reached the rail"
    );
}
