//! Bad input for every field of every write: 400 (VALIDATION_FAILED naming the field, or
//! INVALID_TOKEN for the token header), the envelope, the JSON content type, and nothing written.

use reqwest::Method;
use serde_json::{Value, json};
use uuid::Uuid;

use super::{OPERATOR_TOKEN, PayStack};

/// What paydb holds, read with psql.
fn snapshot(stack: &PayStack) -> String {
    stack.psql(
        "SELECT (SELECT count(*) FROM accounts), (SELECT count(*) FROM payouts), \
         (SELECT count(*) FROM ledger_entries), (SELECT count(*) FROM idempotency_records), \
         (SELECT count(*) FROM audit_log), \
         (SELECT string_agg(account_id || '=' || balance_minor || '/' || held_minor || '/' || fence, ',' ORDER BY account_id) FROM accounts), \
         (SELECT string_agg(payout_id || '=' || state || '/' || attempt_count, ',' ORDER BY payout_id) FROM payouts)",
    )
}

struct Case {
    name: String,
    path: String,
    headers: Vec<(&'static str, String)>,
    body: String,
    code: &'static str,
    field: Option<&'static str>,
}

fn headers(token: Option<&str>, operator: bool) -> Vec<(&'static str, String)> {
    let mut h = vec![
        ("x-owner-id", "worker-1".to_owned()),
        ("x-idempotency-key", "bad-input-key".to_owned()),
    ];
    if let Some(t) = token {
        h.push(("x-fencing-token", t.to_owned()));
    }
    if operator {
        h.push(("authorization", format!("Bearer {OPERATOR_TOKEN}")));
    }
    h
}

/// `base` with `field` set to `value` (or removed when `value` is None).
fn with(base: &Value, field: &str, value: Option<Value>) -> String {
    let mut body = base.clone();
    match value {
        Some(v) => body[field] = v,
        None => {
            if let Some(map) = body.as_object_mut() {
                map.remove(field);
            }
        }
    }
    body.to_string()
}

#[tokio::test]
async fn bad_input_is_refused_field_by_field_and_writes_nothing() {
    let stack =
        PayStack::funded_with(&[("server.body-limit-bytes", "4096")], "acct-b", 1_000).await;
    let payout = stack.payout("acct-b", 100, "EUR").await;
    let claimed = stack.payout("acct-b", 100, "EUR").await;
    let token = stack.claimed(claimed).await;

    let account = json!({ "accountId": "acct-new", "currency": "EUR" });
    let fund = json!({ "amountMinor": 10, "reference": "wire-new" });
    let create = json!({
        "payoutId": Uuid::new_v4(), "accountId": "acct-b", "amountMinor": 10,
        "currency": "EUR", "beneficiaryRef": "ben-new",
    });
    let claim = json!({ "expectedState": "PENDING" });
    let post = super::post_body(claimed);
    let fence = json!({ "floor": 5, "operator": "alice", "reason": "long enough reason", "revocationId": Uuid::new_v4() });
    let resolve = json!({ "outcome": "FAILED", "operator": "alice", "evidence": "statement" });
    let claim_path = format!("/v1/payouts/{payout}/claim");
    let post_path = format!("/v1/payouts/{claimed}/post");
    let resolve_path = format!("/v1/payouts/{claimed}/resolve");

    let mut cases: Vec<Case> = Vec::new();
    let mut add = |name: &str,
                   path: &str,
                   h: Vec<(&'static str, String)>,
                   body: String,
                   code: &'static str,
                   field: Option<&'static str>| {
        cases.push(Case {
            name: name.to_owned(),
            path: path.to_owned(),
            headers: h,
            body,
            code,
            field,
        });
    };
    let v = "VALIDATION_FAILED";
    // Accounts.
    for (value, why) in [
        (json!(""), "empty"),
        (json!("a b"), "space"),
        (json!("x".repeat(65)), "too long"),
        (json!("funding-EUR"), "system name"),
        (json!("rail-settlement-USD"), "system name"),
        (json!(7), "number"),
        (Value::Null, "null"),
    ] {
        add(
            &format!("account id {why}"),
            "/v1/accounts",
            headers(None, false),
            with(&account, "accountId", Some(value)),
            v,
            Some("accountId"),
        );
    }
    for (value, why) in [
        (json!("eur"), "lower case"),
        (json!("EURO"), "four letters"),
        (json!("ABC"), "not ISO"),
        (json!(978), "numeric"),
    ] {
        add(
            &format!("account currency {why}"),
            "/v1/accounts",
            headers(None, false),
            with(&account, "currency", Some(value)),
            v,
            Some("currency"),
        );
    }
    add(
        "account missing currency",
        "/v1/accounts",
        headers(None, false),
        with(&account, "currency", None),
        v,
        Some("currency"),
    );
    add(
        "account unknown field",
        "/v1/accounts",
        headers(None, false),
        with(&account, "balance", Some(json!(5))),
        v,
        Some("balance"),
    );
    add(
        "account without owner",
        "/v1/accounts",
        vec![("x-idempotency-key", "k".to_owned())],
        account.to_string(),
        v,
        Some("X-Owner-Id"),
    );
    add(
        "account without key",
        "/v1/accounts",
        vec![("x-owner-id", "w".to_owned())],
        account.to_string(),
        v,
        Some("X-Idempotency-Key"),
    );
    add(
        "account long owner",
        "/v1/accounts",
        vec![
            ("x-owner-id", "o".repeat(65)),
            ("x-idempotency-key", "k".to_owned()),
        ],
        account.to_string(),
        v,
        Some("X-Owner-Id"),
    );
    add(
        "account key with space",
        "/v1/accounts",
        vec![
            ("x-owner-id", "w".to_owned()),
            ("x-idempotency-key", "a b".to_owned()),
        ],
        account.to_string(),
        v,
        Some("X-Idempotency-Key"),
    );
    add(
        "account key too long",
        "/v1/accounts",
        vec![
            ("x-owner-id", "w".to_owned()),
            ("x-idempotency-key", "k".repeat(129)),
        ],
        account.to_string(),
        v,
        Some("X-Idempotency-Key"),
    );
    add(
        "not JSON",
        "/v1/accounts",
        headers(None, false),
        "{not json".to_owned(),
        v,
        Some("body"),
    );
    add(
        "JSON array",
        "/v1/accounts",
        headers(None, false),
        "[]".to_owned(),
        v,
        Some("body"),
    );
    add(
        "oversize body",
        "/v1/accounts",
        headers(None, false),
        with(&account, "accountId", Some(json!("x".repeat(8000)))),
        v,
        Some("body"),
    );
    // Funding.
    for (value, why) in [
        (json!(0), "zero"),
        (json!(-5), "negative"),
        (json!(1.5), "fraction"),
        (json!("10"), "string"),
        (json!(1_000_000_000_000_001_i64), "above the maximum"),
        (json!(9_223_372_036_854_775_808_u64), "above int64"),
    ] {
        add(
            &format!("fund amount {why}"),
            "/v1/accounts/acct-b/fund",
            headers(None, false),
            with(&fund, "amountMinor", Some(value)),
            v,
            Some("amountMinor"),
        );
    }
    for (value, why) in [
        (json!(""), "empty"),
        (json!("a b"), "space"),
        (json!("r".repeat(129)), "too long"),
    ] {
        add(
            &format!("fund reference {why}"),
            "/v1/accounts/acct-b/fund",
            headers(None, false),
            with(&fund, "reference", Some(value)),
            v,
            Some("reference"),
        );
    }
    add(
        "fund bad account path",
        "/v1/accounts/a%20b/fund",
        headers(None, false),
        fund.to_string(),
        v,
        Some("accountId"),
    );
    // Payouts.
    for (field, value, why) in [
        ("payoutId", json!("not-a-uuid"), "not a uuid"),
        ("payoutId", json!(5), "number"),
        ("accountId", json!("a/b"), "bad account"),
        ("amountMinor", json!(0), "zero amount"),
        ("amountMinor", json!(-1), "negative amount"),
        ("amountMinor", json!(10.25), "fractional amount"),
        ("currency", json!("XXX"), "unknown currency"),
        ("beneficiaryRef", json!(""), "empty beneficiary"),
        ("beneficiaryRef", json!("b".repeat(129)), "long beneficiary"),
        ("beneficiaryRef", json!(["b"]), "array beneficiary"),
    ] {
        add(
            &format!("payout {why}"),
            "/v1/payouts",
            headers(None, false),
            with(&create, field, Some(value)),
            v,
            Some(field),
        );
    }
    add(
        "payout missing amount",
        "/v1/payouts",
        headers(None, false),
        with(&create, "amountMinor", None),
        v,
        Some("amountMinor"),
    );
    add(
        "payout unknown field",
        "/v1/payouts",
        headers(None, false),
        with(&create, "state", Some(json!("POSTED"))),
        v,
        Some("state"),
    );
    // Claim.
    for (value, why) in [
        (json!("POSTED"), "a state it cannot claim from"),
        (json!("BOGUS"), "not a state"),
        (json!(1), "number"),
    ] {
        add(
            &format!("claim expectedState {why}"),
            &claim_path,
            headers(Some("5000"), false),
            with(&claim, "expectedState", Some(value)),
            v,
            Some("expectedState"),
        );
    }
    add(
        "claim missing expectedState",
        &claim_path,
        headers(Some("5000"), false),
        "{}".to_owned(),
        v,
        Some("expectedState"),
    );
    add(
        "claim bad payout id",
        "/v1/payouts/xyz/claim",
        headers(Some("5000"), false),
        claim.to_string(),
        v,
        Some("payoutId"),
    );
    for bad in ["0", "-1", "abc", "007", "9223372036854775808", "1.5"] {
        add(
            &format!("claim token {bad}"),
            &claim_path,
            headers(Some(bad), false),
            claim.to_string(),
            "INVALID_TOKEN",
            None,
        );
    }
    add(
        "claim without token",
        &claim_path,
        headers(None, false),
        claim.to_string(),
        "INVALID_TOKEN",
        None,
    );
    add(
        "claim without key",
        &claim_path,
        vec![
            ("x-owner-id", "w".to_owned()),
            ("x-fencing-token", "5000".to_owned()),
        ],
        claim.to_string(),
        v,
        Some("X-Idempotency-Key"),
    );
    // Post.
    for (field, value, why) in [
        ("railReference", json!(""), "empty reference"),
        ("submissionId", json!("nope"), "bad submission id"),
        ("railOutcome", json!("TIMEOUT"), "outcome other than ACKED"),
    ] {
        add(
            &format!("post {why}"),
            &post_path,
            headers(Some(&token.to_string()), false),
            with(&post, field, Some(value)),
            v,
            Some(field),
        );
    }
    add(
        "post missing submission",
        &post_path,
        headers(Some(&token.to_string()), false),
        with(&post, "submissionId", None),
        v,
        Some("submissionId"),
    );
    // Operator writes.
    for (field, value, why) in [
        ("floor", json!(0), "zero floor"),
        ("floor", json!("5"), "string floor"),
        ("operator", json!(""), "empty operator"),
        ("reason", json!("short"), "short reason"),
        ("revocationId", json!("r-1"), "bad revocation id"),
    ] {
        add(
            &format!("fence {why}"),
            "/v1/accounts/acct-b/fence",
            headers(None, true),
            with(&fence, field, Some(value)),
            v,
            Some(field),
        );
    }
    for (field, value, why) in [
        ("outcome", json!("ACKED"), "outcome not a resolution"),
        ("operator", json!(""), "empty operator"),
        ("evidence", json!(""), "empty evidence"),
        ("railReference", json!("a b"), "bad reference"),
    ] {
        add(
            &format!("resolve {why}"),
            &resolve_path,
            headers(None, true),
            with(&resolve, field, Some(value)),
            v,
            Some(field),
        );
    }

    let before = snapshot(&stack);
    for case in &cases {
        let answer = stack
            .send(Method::POST, &case.path, &case.headers, Some(&case.body))
            .await;
        answer.expect(&case.name, 400, Some(case.code));
        if let Some(field) = case.field {
            assert!(
                answer.fields().iter().any(|f| f == field),
                "{}: details.fields {:?} does not name {field}",
                case.name,
                answer.fields()
            );
        }
    }
    // The wrong content type and the list's query parameters.
    let text = stack
        .send(
            Method::POST,
            "/v1/accounts",
            &[
                ("x-owner-id", "w".to_owned()),
                ("x-idempotency-key", "k".to_owned()),
                ("content-type", "text/plain".to_owned()),
            ],
            None,
        )
        .await;
    text.expect("text/plain body", 400, Some(v));
    for (query, field) in [
        ("state=DONE", "state"),
        ("limit=0", "limit"),
        ("limit=501", "limit"),
        ("limit=ten", "limit"),
        ("cursor=zz", "cursor"),
        ("accountId=a%20b", "accountId"),
        ("color=red", "color"),
    ] {
        let answer = stack.get(&format!("/v1/payouts?{query}")).await;
        answer.expect(query, 400, Some(v));
        assert!(
            answer.fields().iter().any(|f| f == field),
            "{query}: {:?}",
            answer.fields()
        );
    }
    let after = snapshot(&stack);
    assert_eq!(before, after, "bad input changed paydb");
    assert!(cases.len() > 60, "{} cases", cases.len());
    // Positive control: one good write, and the same snapshot sees it.
    stack.account("acct-control", "EUR").await;
    assert_ne!(
        after,
        snapshot(&stack),
        "a new account changes what the snapshot reads"
    );
}
