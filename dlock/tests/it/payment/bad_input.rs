//! Bad input for every field of every write: 400 (VALIDATION_FAILED naming the field, or
//! INVALID_TOKEN for the token header), the envelope, the JSON content type, and nothing written.

use dlock_contract::headers::{IDEMPOTENCY_KEY_LEN_MAX, OWNER_ID_LEN_MAX};
use dlock_contract::payment::{ACCOUNT_ID_LEN_MAX, REFERENCE_LEN_MAX};
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

const VALIDATION_FAILED: &str = "VALIDATION_FAILED";

/// The refused writes, in the order they are sent.
#[derive(Default)]
struct Cases(Vec<Case>);

impl Cases {
    /// `body` to `path` with `headers` is refused with `code`, the answer naming `field` if given.
    fn add(
        &mut self,
        name: &str,
        path: &str,
        headers: Vec<(&'static str, String)>,
        body: String,
        code: &'static str,
        field: Option<&'static str>,
    ) {
        self.0.push(Case {
            name: name.to_owned(),
            path: path.to_owned(),
            headers,
            body,
            code,
            field,
        });
    }

    /// `base` with `field` set to each bad value in turn (named `{what} {why}`): refused as
    /// VALIDATION_FAILED naming `field`.
    fn bad_values(
        &mut self,
        what: &str,
        path: &str,
        headers: &[(&'static str, String)],
        (base, field): (&Value, &'static str),
        values: impl IntoIterator<Item = (Value, &'static str)>,
    ) {
        for (value, why) in values {
            self.add(
                &format!("{what} {why}"),
                path,
                headers.to_vec(),
                with(base, field, Some(value)),
                VALIDATION_FAILED,
                Some(field),
            );
        }
    }

    /// [`Cases::bad_values`] for one bad value of each of several fields of `base`.
    fn bad_fields(
        &mut self,
        what: &str,
        path: &str,
        headers: &[(&'static str, String)],
        base: &Value,
        fields: impl IntoIterator<Item = (&'static str, Value, &'static str)>,
    ) {
        for (field, value, why) in fields {
            self.bad_values(what, path, headers, (base, field), [(value, why)]);
        }
    }
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

/// What the identifier rule refuses (1 to `max` characters, no spaces), each with why. Account
/// ids and references both follow it; they differ in `max` and in which other characters count.
fn bad_ids(max: usize) -> [(Value, &'static str); 3] {
    [
        (json!(""), "empty"),
        (json!("a b"), "space"),
        (json!("x".repeat(max + 1)), "too long"),
    ]
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

    let mut cases = Cases::default();
    let v = VALIDATION_FAILED;
    let plain = headers(None, false);
    let operator = headers(None, true);
    // Accounts.
    let accounts = "/v1/accounts";
    cases.bad_values(
        "account id",
        accounts,
        &plain,
        (&account, "accountId"),
        bad_ids(ACCOUNT_ID_LEN_MAX).into_iter().chain([
            (json!("funding-EUR"), "system name"),
            (json!("rail-settlement-USD"), "system name"),
            (json!(7), "number"),
            (Value::Null, "null"),
        ]),
    );
    cases.bad_values(
        "account currency",
        accounts,
        &plain,
        (&account, "currency"),
        [
            (json!("eur"), "lower case"),
            (json!("EURO"), "four letters"),
            (json!("ABC"), "not ISO"),
            (json!(978), "numeric"),
        ],
    );
    cases.add(
        "account missing currency",
        accounts,
        plain.clone(),
        with(&account, "currency", None),
        v,
        Some("currency"),
    );
    cases.bad_values(
        "account",
        accounts,
        &plain,
        (&account, "balance"),
        [(json!(5), "unknown field")],
    );
    let owner = |o: String| ("x-owner-id", o);
    let key = |k: String| ("x-idempotency-key", k);
    for (why, h, field) in [
        ("without owner", vec![key("k".into())], "X-Owner-Id"),
        ("without key", vec![owner("w".into())], "X-Idempotency-Key"),
        (
            "long owner",
            vec![owner("o".repeat(OWNER_ID_LEN_MAX + 1)), key("k".into())],
            "X-Owner-Id",
        ),
        (
            "key with space",
            vec![owner("w".into()), key("a b".into())],
            "X-Idempotency-Key",
        ),
        (
            "key too long",
            vec![
                owner("w".into()),
                key("k".repeat(IDEMPOTENCY_KEY_LEN_MAX + 1)),
            ],
            "X-Idempotency-Key",
        ),
    ] {
        cases.add(
            &format!("account {why}"),
            accounts,
            h,
            account.to_string(),
            v,
            Some(field),
        );
    }
    for (name, body) in [
        ("not JSON", "{not json".to_owned()),
        ("JSON array", "[]".to_owned()),
        (
            "oversize body",
            with(&account, "accountId", Some(json!("x".repeat(8000)))),
        ),
    ] {
        cases.add(name, accounts, plain.clone(), body, v, Some("body"));
    }
    // Funding.
    let fund_path = "/v1/accounts/acct-b/fund";
    cases.bad_values(
        "fund amount",
        fund_path,
        &plain,
        (&fund, "amountMinor"),
        [
            (json!(0), "zero"),
            (json!(-5), "negative"),
            (json!(1.5), "fraction"),
            (json!("10"), "string"),
            (json!(1_000_000_000_000_001_i64), "above the maximum"),
            (json!(9_223_372_036_854_775_808_u64), "above int64"),
        ],
    );
    cases.bad_values(
        "fund reference",
        fund_path,
        &plain,
        (&fund, "reference"),
        bad_ids(REFERENCE_LEN_MAX),
    );
    cases.add(
        "fund bad account path",
        "/v1/accounts/a%20b/fund",
        plain.clone(),
        fund.to_string(),
        v,
        Some("accountId"),
    );
    // Payouts.
    cases.bad_fields(
        "payout",
        "/v1/payouts",
        &plain,
        &create,
        [
            ("payoutId", json!("not-a-uuid"), "not a uuid"),
            ("payoutId", json!(5), "number"),
            ("accountId", json!("a/b"), "bad account"),
            ("amountMinor", json!(0), "zero amount"),
            ("amountMinor", json!(-1), "negative amount"),
            ("amountMinor", json!(10.25), "fractional amount"),
            ("currency", json!("XXX"), "unknown currency"),
        ],
    );
    cases.bad_values(
        "payout beneficiaryRef",
        "/v1/payouts",
        &plain,
        (&create, "beneficiaryRef"),
        bad_ids(REFERENCE_LEN_MAX)
            .into_iter()
            .chain([(json!(["b"]), "array")]),
    );
    cases.add(
        "payout missing amount",
        "/v1/payouts",
        plain.clone(),
        with(&create, "amountMinor", None),
        v,
        Some("amountMinor"),
    );
    cases.bad_values(
        "payout",
        "/v1/payouts",
        &plain,
        (&create, "state"),
        [(json!("POSTED"), "unknown field")],
    );
    // Claim.
    let claiming = headers(Some("5000"), false);
    cases.bad_values(
        "claim expectedState",
        &claim_path,
        &claiming,
        (&claim, "expectedState"),
        [
            (json!("POSTED"), "a state it cannot claim from"),
            (json!("BOGUS"), "not a state"),
            (json!(1), "number"),
        ],
    );
    cases.add(
        "claim missing expectedState",
        &claim_path,
        claiming.clone(),
        "{}".to_owned(),
        v,
        Some("expectedState"),
    );
    cases.add(
        "claim bad payout id",
        "/v1/payouts/xyz/claim",
        claiming,
        claim.to_string(),
        v,
        Some("payoutId"),
    );
    for bad in ["0", "-1", "abc", "007", "9223372036854775808", "1.5"] {
        cases.add(
            &format!("claim token {bad}"),
            &claim_path,
            headers(Some(bad), false),
            claim.to_string(),
            "INVALID_TOKEN",
            None,
        );
    }
    cases.add(
        "claim without token",
        &claim_path,
        plain.clone(),
        claim.to_string(),
        "INVALID_TOKEN",
        None,
    );
    cases.add(
        "claim without key",
        &claim_path,
        vec![owner("w".into()), ("x-fencing-token", "5000".to_owned())],
        claim.to_string(),
        v,
        Some("X-Idempotency-Key"),
    );
    // Post.
    let posting = headers(Some(&token.to_string()), false);
    cases.bad_fields(
        "post",
        &post_path,
        &posting,
        &post,
        [
            ("railReference", json!(""), "empty reference"),
            ("submissionId", json!("nope"), "bad submission id"),
            ("railOutcome", json!("TIMEOUT"), "outcome other than ACKED"),
        ],
    );
    cases.add(
        "post missing submission",
        &post_path,
        posting,
        with(&post, "submissionId", None),
        v,
        Some("submissionId"),
    );
    // Operator writes.
    for (what, path, base, fields) in [
        (
            "fence",
            "/v1/accounts/acct-b/fence",
            &fence,
            vec![
                ("floor", json!(0), "zero floor"),
                ("floor", json!("5"), "string floor"),
                ("operator", json!(""), "empty operator"),
                ("reason", json!("short"), "short reason"),
                ("revocationId", json!("r-1"), "bad revocation id"),
            ],
        ),
        (
            "resolve",
            &resolve_path,
            &resolve,
            vec![
                ("outcome", json!("ACKED"), "outcome not a resolution"),
                ("operator", json!(""), "empty operator"),
                ("evidence", json!(""), "empty evidence"),
                ("railReference", json!("a b"), "bad reference"),
            ],
        ),
    ] {
        cases.bad_fields(what, path, &operator, base, fields);
    }
    let cases = cases.0;

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
