//! The rail stub takes transfers from the rail proxy only: on the `dlock dev up` stack a
//! `POST /submit` without a credential, with a made-up one, or with another identity's (the
//! executor's, the treasury's, the operator's) is refused with the contract's envelope and
//! nothing reaches the statement, while a payout through the proxy, which presents its own
//! credential, is paid. A stub configured without `auth.mode` does not start.

use std::path::Path;

use reqwest::Method;
use serde_json::{Value, json};

use crate::auth::DevStack;
use crate::harness::raw;

const JSON: &str = "application/json; charset=utf-8";

/// The whole statement, and the transfers of `client_ref`; read without a credential.
async fn statement(stub: &str, client_ref: Option<&str>) -> Value {
    let url = match client_ref {
        Some(r) => format!("{stub}/statement?clientRef={r}"),
        None => format!("{stub}/statement"),
    };
    let (status, _, body) = raw(Method::GET, &url, &[], None).await;
    assert_eq!(status, 200, "the statement stays readable: {body}");
    body
}

fn transfers(statement: &Value) -> usize {
    statement["transfers"].as_array().map_or(0, Vec::len)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_the_rail_proxy_may_submit_to_the_rail_stub() {
    let stack = DevStack::with_account("acct-rail", 100_000).await;
    let stub = stack.url("railStub");
    let (executor, operator) = stack.credentials();
    let treasury = stack.token("treasury");
    let before = statement(&stub, None).await;

    let callers: Vec<(&str, Option<String>, u16, &str)> = vec![
        ("no credential", None, 401, "UNAUTHENTICATED"),
        (
            "a made-up credential",
            Some("not-a-token-of-this-stack".into()),
            401,
            "UNAUTHENTICATED",
        ),
        ("the executor", Some(executor), 403, "FORBIDDEN"),
        ("the treasury", Some(treasury), 403, "FORBIDDEN"),
        ("the operator", Some(operator), 403, "FORBIDDEN"),
    ];
    for (n, (who, token, status, code)) in callers.iter().enumerate() {
        let client_ref = format!("bypass-{n}");
        let body = format!(r#"{{"clientRef":"{client_ref}","amountMinor":100,"currency":"EUR"}}"#);
        let bearer = token.as_ref().map(|t| format!("Bearer {t}"));
        let mut headers = vec![("content-type", "application/json")];
        if let Some(bearer) = &bearer {
            headers.push(("authorization", bearer.as_str()));
        }
        let (got, content_type, answer) = raw(
            Method::POST,
            &format!("{stub}/submit"),
            &headers,
            Some(&body),
        )
        .await;
        assert_eq!(got, *status, "POST /submit with {who}: {answer}");
        assert_eq!(content_type, JSON, "POST /submit with {who}: content type");
        assert_eq!(answer["code"], *code, "POST /submit with {who}: {answer}");
        assert_eq!(answer["retrySafe"], json!(false), "{who}: {answer}");
        assert!(
            answer["message"].as_str().is_some_and(|m| !m.is_empty()),
            "{who}: the envelope says what happened: {answer}"
        );
        let taken = statement(&stub, Some(&client_ref)).await;
        assert_eq!(transfers(&taken), 0, "{who}: nothing was taken: {taken}");
    }
    assert_eq!(
        before,
        statement(&stub, None).await,
        "{} refused submits left the statement as it was",
        callers.len()
    );

    // Positive control: the same statement shows the payouts the proxy presented with its own
    // credential, and every one of them is paid.
    let (ok, output) = stack.run_batch("rail-auth", "acct-rail", 3).await;
    assert!(ok, "a batch through the proxy is paid: {output}");
    let after = statement(&stub, None).await;
    assert_eq!(
        transfers(&after),
        transfers(&before) + 3,
        "the proxy's submits reached the rail: {after}"
    );
    assert_eq!(stack.posted().await, 3, "{output}");
}

#[test]
fn a_rail_stub_without_auth_mode_does_not_start() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let statement = dir.path().join("statement.jsonl");
    crate::etcd_tls::refused_process(
        "rail-stub",
        &[("rail.stub.statement-path", statement.display().to_string())],
        &dir.path().join("stub.log"),
        &["auth.mode", "none", "rail.stub.submitter-identities"],
    );
    assert!(
        !Path::new(&statement).exists(),
        "a stub that did not start opened no statement"
    );
    // Positive control: the same configuration with auth off said by name serves.
    let (_stub, url) = crate::etcd_tls::serve_process(
        "rail-stub",
        &[
            ("rail.stub.statement-path", statement.display().to_string()),
            ("auth.mode", "none".into()),
        ],
        &dir.path().join("stub-none.log"),
    );
    assert!(url.starts_with("http://"), "{url}");
}
