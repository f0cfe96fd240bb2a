//! The operator's writes: advancing a fence to a revocation floor (docs/design.md#d-3) and
//! resolving an ambiguous payout, both behind the operator credential and both audited.

use reqwest::Method;
use serde_json::json;
use uuid::Uuid;

use super::PayStack;

#[tokio::test]
async fn fence_advance_needs_the_credential_and_fences_out_the_revoked_token() {
    let stack = PayStack::funded("acct-r", 1_000).await;
    let payout = stack.payout("acct-r", 100, "EUR").await;
    let revoked = stack.token();
    let floor = stack.token();
    let revocation = Uuid::new_v4();
    let body = json!({
        "floor": floor, "operator": "alice", "reason": "worker wedged past its lease",
        "revocationId": revocation,
    });
    let path = "/v1/accounts/acct-r/fence";
    let text = body.to_string();
    let headers = |auth: Option<&str>| {
        let mut h = vec![
            ("x-owner-id", "operator-cli".to_owned()),
            ("x-idempotency-key", "rev-1".to_owned()),
        ];
        if let Some(a) = auth {
            h.push(("authorization", a.to_owned()));
        }
        h
    };
    stack
        .send(Method::POST, path, &headers(None), Some(&text))
        .await
        .expect("no credential", 401, Some("UNAUTHENTICATED"));
    stack
        .send(
            Method::POST,
            path,
            &headers(Some("Bearer not-the-credential")),
            Some(&text),
        )
        .await
        .expect("wrong credential", 401, Some("UNAUTHENTICATED"));
    stack
        .send(Method::POST, path, &headers(Some("Basic abc")), Some(&text))
        .await
        .expect("other scheme", 401, Some("UNAUTHENTICATED"));
    assert_eq!(
        stack.psql("SELECT fence FROM accounts WHERE account_id = 'acct-r'"),
        "0"
    );

    let advanced = stack.operator_write(path, "rev-1", &body).await;
    let a = advanced.expect("advance", 200, None);
    assert_eq!(a["previousFence"], 0);
    assert_eq!(a["fence"], floor);
    assert_eq!(a["revocationId"], revocation.to_string());
    // A lower floor leaves the fence where it is: max(fence, floor).
    let lower = json!({ "floor": 1, "operator": "alice", "reason": "a late, lower floor", "revocationId": Uuid::new_v4() });
    let l = stack.operator_write(path, "rev-2", &lower).await;
    assert_eq!(l.expect("lower floor", 200, None)["fence"], floor);
    assert_eq!(
        stack.psql("SELECT action, operator, previous_fence, new_fence, revocation_id FROM audit_log ORDER BY audit_id LIMIT 1"),
        format!("fence_advanced|alice|0|{floor}|{revocation}")
    );
    assert_eq!(stack.psql("SELECT count(*) FROM audit_log"), "2");

    // Every write with the revoked token is now FENCED_OUT; the equal floor too (strict claim).
    let fenced = stack.claim(payout, revoked, "PENDING").await;
    let body = fenced.expect("revoked token", 409, Some("FENCED_OUT"));
    assert_eq!(body["details"]["highestToken"], floor);
    stack
        .operator_write("/v1/accounts/nobody/fence", "rev-3", &lower)
        .await
        .expect("unknown account", 404, Some("NOT_FOUND"));
    stack
        .claim(payout, stack.token(), "PENDING")
        .await
        .expect("the next holder", 200, None);
}

#[tokio::test]
async fn only_an_ambiguous_payout_is_resolved_and_posted_resolution_writes_two_rows() {
    let stack = PayStack::funded("acct-a", 1_000).await;
    let paid = stack.payout("acct-a", 200, "EUR").await;
    let unpaid = stack.payout("acct-a", 300, "EUR").await;
    let pending = stack.payout("acct-a", 50, "EUR").await;
    for id in [paid, unpaid] {
        stack.claimed(id).await;
        stack.make_ambiguous(id);
    }
    assert_eq!(
        stack.psql("SELECT held_minor FROM accounts WHERE account_id = 'acct-a'"),
        "500"
    );
    let posted = json!({ "outcome": "POSTED", "railReference": "rail-statement-77", "operator": "bob", "evidence": "found on the rail statement of 2 Dec" });

    let headers = vec![
        ("x-owner-id", "operator-cli".to_owned()),
        ("x-idempotency-key", "res-0".to_owned()),
    ];
    stack
        .send(
            Method::POST,
            &format!("/v1/payouts/{paid}/resolve"),
            &headers,
            Some(&posted.to_string()),
        )
        .await
        .expect("no credential", 401, Some("UNAUTHENTICATED"));
    stack
        .operator_write(&format!("/v1/payouts/{pending}/resolve"), "res-1", &posted)
        .await
        .expect("not ambiguous", 409, Some("PAYOUT_NOT_CLAIMABLE"));
    let no_reference = json!({ "outcome": "POSTED", "operator": "bob", "evidence": "statement" });
    let missing = stack
        .operator_write(
            &format!("/v1/payouts/{paid}/resolve"),
            "res-2",
            &no_reference,
        )
        .await;
    missing.expect(
        "POSTED without railReference",
        400,
        Some("VALIDATION_FAILED"),
    );
    assert_eq!(missing.fields(), vec!["railReference"]);

    let resolved = stack
        .operator_write(&format!("/v1/payouts/{paid}/resolve"), "res-3", &posted)
        .await;
    let r = resolved.expect("resolve POSTED", 200, None);
    assert_eq!(r["state"], "POSTED");
    assert_eq!(r["entries"].as_array().map(Vec::len), Some(2));
    assert_eq!(r["balanceMinor"], 800);
    let failed = json!({ "outcome": "FAILED", "operator": "bob", "evidence": "not on the statement after 3 days" });
    let f = stack
        .operator_write(&format!("/v1/payouts/{unpaid}/resolve"), "res-4", &failed)
        .await;
    let f = f.expect("resolve FAILED", 200, None);
    assert_eq!(f["state"], "FAILED");
    assert_eq!(f["entries"], json!([]));
    // The holds are gone; the ledger agrees with the balance.
    assert_eq!(
        stack.psql("SELECT balance_minor, held_minor FROM accounts WHERE account_id = 'acct-a'"),
        "800|0"
    );
    let a = stack.get("/v1/accounts/acct-a").await;
    assert_eq!(a.expect("P5", 200, None)["ledgerSumMinor"], 800);
    // Resolved once: resolving again is not claimable.
    stack
        .operator_write(&format!("/v1/payouts/{paid}/resolve"), "res-5", &posted)
        .await
        .expect("resolve twice", 409, Some("PAYOUT_NOT_CLAIMABLE"));
    assert_eq!(
        stack.psql("SELECT string_agg(outcome || ':' || operator, ',' ORDER BY audit_id) FROM audit_log WHERE action = 'ambiguous_resolved'"),
        "POSTED:bob,FAILED:bob"
    );
}

#[test]
fn the_service_refuses_to_start_with_fencing_disabled() {
    let env = [
        (
            "DLOCK_PAYMENT_PG_URL".to_owned(),
            "postgres://127.0.0.1:1/paydb".to_owned(),
        ),
        (
            "DLOCK_PAYMENT_FENCING_ENABLED".to_owned(),
            "false".to_owned(),
        ),
    ]
    .into_iter()
    .collect();
    let mut raw =
        dlock_server::config::RawConfig::from_parts(None, env).unwrap_or_else(|e| panic!("{e}"));
    let error = dlock_payment_resource::PaymentConfig::from_raw(&mut raw)
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(error.contains("payment.fencing.enabled"), "{error}");
}
