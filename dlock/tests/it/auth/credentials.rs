//! Credentials on the `dlock dev up` stack (every service with `auth.mode = "tokens"`): every
//! write needs one, and a refused request changes nothing in paydb, lockdb or the rail's
//! statement.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_the_dev_stack_every_write_needs_a_credential_and_a_refusal_changes_nothing() {
    let stack = DevStack::up().await;
    let (lock, payment, proxy) = stack.services();
    let stub = stack.url("railStub");
    let (executor, operator) = stack.credentials();

    // Some state to protect: an account with funds, opened by the treasury.
    open_account(&stack.treasury_payments(), "acct-a", Some(100_000)).await;
    let before = stack.snapshot().await;

    let session = "0195e3b4-0000-7000-8000-000000000001";
    let payout = "0195e3b4-0000-7000-8000-000000000002";
    let acquire = format!(r#"{{"sessionId":"{session}","ttlMillis":5000}}"#);
    let writes: Vec<(Method, String, String)> = vec![
        (
            Method::POST,
            format!("{lock}/v1/sessions"),
            r#"{"ttlMillis":10000}"#.into(),
        ),
        (
            Method::POST,
            format!("{lock}/v1/sessions/{session}/heartbeat"),
            String::new(),
        ),
        (
            Method::DELETE,
            format!("{lock}/v1/sessions/{session}"),
            String::new(),
        ),
        (
            Method::POST,
            format!("{lock}/v1/locks/payout:acct-a/acquire"),
            acquire.clone(),
        ),
        (
            Method::POST,
            format!("{lock}/v1/locks/payout:acct-a/renew"),
            acquire.clone(),
        ),
        (
            Method::DELETE,
            format!("{lock}/v1/locks/payout:acct-a"),
            acquire,
        ),
        (
            Method::POST,
            format!("{lock}/v1/locks/payout:acct-a/revoke"),
            r#"{"operator":"op","reason":"a paused worker holds it"}"#.into(),
        ),
        (Method::GET, format!("{lock}/v1/locks"), String::new()),
        (
            Method::POST,
            format!("{payment}/v1/accounts"),
            r#"{"accountId":"acct-z","currency":"EUR"}"#.into(),
        ),
        (
            Method::POST,
            format!("{payment}/v1/accounts/acct-a/fund"),
            r#"{"amountMinor":500,"reference":"more"}"#.into(),
        ),
        (
            Method::POST,
            format!("{payment}/v1/accounts/acct-a/fence"),
            format!(
                r#"{{"floor":99,"operator":"op","reason":"revoked","revocationId":"{session}"}}"#
            ),
        ),
        (
            Method::POST,
            format!("{payment}/v1/payouts"),
            format!(
                r#"{{"payoutId":"{payout}","accountId":"acct-a","amountMinor":100,"currency":"EUR","beneficiaryRef":"b"}}"#
            ),
        ),
        (
            Method::GET,
            format!("{payment}/v1/accounts/acct-a"),
            String::new(),
        ),
        (
            Method::POST,
            format!("{payment}/v1/payouts/{payout}/claim"),
            r#"{"expectedState":"PENDING"}"#.into(),
        ),
        (
            Method::POST,
            format!("{payment}/v1/payouts/{payout}/resolve"),
            r#"{"outcome":"FAILED","operator":"op","evidence":"statement"}"#.into(),
        ),
        (
            Method::POST,
            format!("{proxy}/v1/rail/submissions"),
            format!(
                r#"{{"payoutId":"{payout}","accountId":"acct-a","amountMinor":100,"currency":"EUR","beneficiaryRef":"b"}}"#
            ),
        ),
        (
            Method::POST,
            format!("{proxy}/v1/rail/high-water/acct-a"),
            r#"{"floor":99,"operator":"op","reason":"revoked"}"#.into(),
        ),
        (
            Method::POST,
            format!("{stub}/submit"),
            r#"{"clientRef":"x","amountMinor":100,"currency":"EUR"}"#.into(),
        ),
    ];
    let base = [
        ("content-type", "application/json"),
        ("x-owner-id", "executor/test"),
        ("idempotency-key", "auth-probe-0001"),
        ("x-fencing-token", "7"),
    ];
    let mut refused = 0;
    for (method, url, body) in &writes {
        let body = (!body.is_empty()).then_some(body.as_str());
        let step = format!("{method} {url}");
        let none = raw(method.clone(), url, &base, body).await;
        assert_refused(
            &format!("{step} without a credential"),
            &none,
            401,
            "UNAUTHENTICATED",
        );
        let wrong = [
            &base[..],
            &[("authorization", "Bearer not-a-token-of-this-stack")],
        ]
        .concat();
        let answer = raw(method.clone(), url, &wrong, body).await;
        assert_refused(
            &format!("{step} with a wrong credential"),
            &answer,
            401,
            "UNAUTHENTICATED",
        );
        let basic = [&base[..], &[("authorization", "Basic ZXhlY3V0b3I6eA==")]].concat();
        let answer = raw(method.clone(), url, &basic, body).await;
        assert_refused(
            &format!("{step} with Basic"),
            &answer,
            401,
            "UNAUTHENTICATED",
        );
        refused += 3;
    }

    // The executor identity may not write in another owner's name...
    let bearer = format!("Bearer {executor}");
    let foreign = [
        ("content-type", "application/json"),
        ("x-owner-id", "someone-else"),
        ("authorization", bearer.as_str()),
    ];
    for (method, url, body) in &writes[..2] {
        let body = (!body.is_empty()).then_some(body.as_str());
        let answer = raw(method.clone(), url, &foreign, body).await;
        forbidden(
            &format!("{method} {url} as a foreign owner"),
            &answer,
            &mut refused,
        );
    }
    // ...nor run an operator-only operation.
    let own = [
        ("content-type", "application/json"),
        ("x-owner-id", "executor/test"),
        ("idempotency-key", "auth-probe-0002"),
        ("authorization", bearer.as_str()),
    ];
    for (method, url, body) in writes.iter().filter(|(_, url, _)| {
        url.ends_with("/revoke")
            || url.ends_with("/fence")
            || url.ends_with("/resolve")
            || url.contains("/high-water/")
    }) {
        let answer = raw(method.clone(), url, &own, Some(body)).await;
        forbidden(
            &format!("{method} {url} as the executor"),
            &answer,
            &mut refused,
        );
    }
    // ...nor create money: opening and funding an account are the treasury's alone (the
    // treasury opened and funded acct-a above), and the operator is no treasury either.
    let operator_bearer = format!("Bearer {operator}");
    let minters = [
        ("executor", bearer.as_str(), "executor/test"),
        ("operator", operator_bearer.as_str(), "ops-console"),
    ];
    for (who, credential, owner) in minters {
        let mints = [
            (
                format!("{payment}/v1/accounts"),
                r#"{"accountId":"acct-minted","currency":"EUR"}"#,
            ),
            (
                format!("{payment}/v1/accounts/acct-a/fund"),
                r#"{"amountMinor":1000000000000000,"reference":"minted-1"}"#,
            ),
        ];
        for (url, body) in mints {
            let headers = [
                ("content-type", "application/json"),
                ("x-owner-id", owner),
                ("x-idempotency-key", "auth-probe-mint"),
                ("authorization", credential),
            ];
            let answer = raw(Method::POST, &url, &headers, Some(body)).await;
            forbidden(&format!("POST {url} as the {who}"), &answer, &mut refused);
        }
    }
    let after = stack.unchanged_since(&before, refused).await;
    assert!(refused >= 64, "{refused}");

    // Probes, scrapes and the statement stay open.
    for url in [
        format!("{lock}/healthz"),
        format!("{payment}/readyz"),
        format!("{stub}/statement"),
    ] {
        let (status, _, _) = raw(Method::GET, &url, &[], None).await;
        assert_eq!(status, 200, "{url}");
    }

    // The operator identity may name any owner and revoke; the executor, with credentials,
    // pays a whole batch through every hop (proxy → rail with the proxy's own credential).
    let op_bearer = format!("Bearer {operator}");
    let answer = raw(
        Method::POST,
        &format!("{proxy}/v1/rail/high-water/acct-a"),
        &[
            ("content-type", "application/json"),
            ("x-owner-id", "ops-console"),
            ("authorization", op_bearer.as_str()),
        ],
        Some(r#"{"floor":5,"operator":"op","reason":"an operator raises a floor"}"#),
    )
    .await;
    assert_eq!(answer.0, 200, "{}", answer.2);
    // Positive control: the snapshot that saw no change from the refused requests sees this
    // accepted one.
    assert_ne!(
        after,
        stack.snapshot().await,
        "an accepted write changes what the snapshot reads"
    );

    let (ok, output) = stack.run_batch("auth-batch", "acct-a", 12).await;
    assert!(
        ok,
        "dlock run with a credential finishes the batch: {output}"
    );
    assert_eq!(stack.posted().await, 12, "{output}");
}
