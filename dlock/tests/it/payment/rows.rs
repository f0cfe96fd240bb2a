//! Every P-row and the writes around them, each answer checked for status, code, envelope and
//! content type.

use reqwest::Method;
use serde_json::{Value, json};
use uuid::Uuid;

use super::{PayStack, post_body};
use crate::harness::metric;

#[tokio::test]
async fn accounts_fund_payouts_claim_post_and_read_back() {
    let stack = PayStack::start().await;

    // POST /v1/accounts: 201, idempotent on the same body, conflict on a different one.
    let body = json!({ "accountId": "acct-1", "currency": "EUR" });
    let created = stack.write("/v1/accounts", "k-acct-1", None, &body).await;
    let account = created.expect("create account", 201, None);
    assert_eq!(account["balanceMinor"], 0);
    assert_eq!(account["fence"], 0);
    assert_eq!(account["kind"], "customer");
    stack
        .write("/v1/accounts", "k-acct-1b", None, &body)
        .await
        .expect("same account, other key", 201, None);
    stack
        .write(
            "/v1/accounts",
            "k-acct-1c",
            None,
            &json!({ "accountId": "acct-1", "currency": "USD" }),
        )
        .await
        .expect(
            "same account, other currency",
            422,
            Some("IDEMPOTENCY_CONFLICT"),
        );

    // Funding: two rows, CREDIT the customer and DEBIT the funding account.
    let fund = json!({ "amountMinor": 1_000, "reference": "wire-1" });
    let funded = stack
        .write("/v1/accounts/acct-1/fund", "k-fund-1", None, &fund)
        .await;
    let funded = funded.expect("fund", 200, None).clone();
    assert_eq!(funded["balanceMinor"], 1_000);
    legs(&funded, [("CREDIT", "acct-1"), ("DEBIT", "funding-EUR")]);
    // The same reference again (another key) changes nothing; with another amount it conflicts.
    let refund = json!({ "amountMinor": 5, "reference": "wire-1" });
    let system = json!({ "amountMinor": 5, "reference": "wire-9" });
    for (path, key, body, step, status, code) in [
        ("acct-1", "k-fund-1b", &fund, "same reference", 200, None),
        (
            "acct-1",
            "k-fund-1c",
            &refund,
            "reference re-used",
            422,
            Some("IDEMPOTENCY_CONFLICT"),
        ),
        (
            "nobody",
            "k-fund-2",
            &fund,
            "fund unknown account",
            404,
            Some("NOT_FOUND"),
        ),
        (
            "funding-EUR",
            "k-fund-3",
            &system,
            "fund a system account",
            400,
            Some("VALIDATION_FAILED"),
        ),
    ] {
        let path = format!("/v1/accounts/{path}/fund");
        stack
            .write(&path, key, None, body)
            .await
            .expect(step, status, code);
    }
    assert_eq!(stack.psql("SELECT count(*) FROM ledger_entries"), "2");

    // POST /v1/payouts: 201 PENDING; same id and body replays; same id, other body conflicts.
    let payout = Uuid::new_v4();
    let create = json!({
        "payoutId": payout, "accountId": "acct-1", "amountMinor": 300,
        "currency": "EUR", "beneficiaryRef": "ben-1",
    });
    let first = stack.write("/v1/payouts", "k-p1", None, &create).await;
    let p = first.expect("create payout", 201, None);
    assert_eq!(p["state"], "PENDING");
    assert_eq!(p["attemptCount"], 0);
    assert_eq!(p["submissions"], json!([]));
    let again = stack.write("/v1/payouts", "k-p1", None, &create).await;
    again.expect("replay", 201, None);
    again.replays("replay", &first);
    let mut other = create.clone();
    other["amountMinor"] = json!(301);
    let mut usd = create.clone();
    usd["payoutId"] = json!(Uuid::new_v4());
    usd["currency"] = json!("USD");
    let mut unknown = create.clone();
    unknown["payoutId"] = json!(Uuid::new_v4());
    unknown["accountId"] = json!("nobody");
    let conflict = Some("IDEMPOTENCY_CONFLICT");
    for (key, body, step, status, code) in [
        (
            "k-p1-other-key",
            &other,
            "same id, other body",
            422,
            conflict,
        ),
        ("k-p1", &other, "same key, other body", 422, conflict),
        (
            "k-p-usd",
            &usd,
            "currency of another account",
            400,
            Some("VALIDATION_FAILED"),
        ),
        (
            "k-p-unknown",
            &unknown,
            "unknown account",
            404,
            Some("NOT_FOUND"),
        ),
    ] {
        let answer = stack.write("/v1/payouts", key, None, body).await;
        answer.expect(step, status, code);
    }

    // P2 claim.
    let t1 = stack.token();
    let claimed = stack.claim(payout, t1, "PENDING").await;
    let c = claimed.expect("claim", 200, None);
    assert_eq!(c["state"], "CLAIMED");
    assert_eq!(c["claimToken"], t1);
    assert_eq!(c["accountFence"], t1);
    assert_eq!(c["attemptCount"], 1);
    assert_eq!(c["idempotencyKey"], format!("payout-{payout}"));
    assert_eq!(c["payoutId"], payout.to_string());
    // Claiming it again as PENDING under a newer token: not claimable (and nothing moves).
    let t2 = stack.token();
    stack.claim(payout, t2, "PENDING").await.expect(
        "claim a claimed payout",
        409,
        Some("PAYOUT_NOT_CLAIMABLE"),
    );
    // Post before the rail acknowledged it: not claimable. (Under t2: that answer is stored for
    // (key, t2) and would be replayed to a retry under t2.)
    stack
        .post(payout, t2)
        .await
        .expect("post before the ack", 409, Some("PAYOUT_NOT_CLAIMABLE"));
    let replay = stack.post(payout, t2).await;
    assert!(replay.replayed);
    assert_eq!(replay.status, 409);
    // The token header is checked before anything else.
    let no_token = stack
        .write(
            &format!("/v1/payouts/{payout}/claim"),
            "k-x",
            None,
            &json!({ "expectedState": "PENDING" }),
        )
        .await;
    no_token.expect("no token", 400, Some("INVALID_TOKEN"));

    // P4: the payout, with the submission the rail proxy recorded.
    sqlx::query(
        "INSERT INTO rail_submission (submission_id, payout_id, account_id, presented_token, \
         idempotency_key, outcome, rail_reference, resolved_at) \
         VALUES ($1, $2, 'acct-1', $3, $4, 'ACKED', $5, clock_timestamp())",
    )
    .bind(super::rail_ids(payout).0)
    .bind(payout)
    .bind(t2)
    .bind(format!("payout-{payout}"))
    .bind(super::rail_ids(payout).1)
    .execute(&stack.pool)
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    stack.rail_ack(payout).await;
    let read = stack.get(&format!("/v1/payouts/{payout}")).await;
    let p = read.expect("P4", 200, None);
    assert_eq!(p["state"], "RAIL_ACKED");
    assert_eq!(p["claimToken"], t1);
    assert_eq!(p["submissions"].as_array().map(Vec::len), Some(1), "{p}");
    assert_eq!(p["submissions"][0]["outcome"], "ACKED");
    assert_eq!(p["submissions"][0]["presentedToken"], t2);

    // P3 post: two balanced rows under the token, in one transaction.
    let posted = stack.post(payout, t1).await;
    let p = posted.expect("post", 200, None).clone();
    assert_eq!(p["state"], "POSTED");
    assert_eq!(p["balanceMinor"], 700);
    let entries = legs(&p, [("DEBIT", "acct-1"), ("CREDIT", "rail-settlement-EUR")]);
    for entry in &entries {
        assert_eq!(entry["amountMinor"], 300);
        assert_eq!(entry["fence"], t1);
    }
    // Posting a POSTED payout again under a newer token: not claimable, nothing written.
    stack
        .post(payout, stack.token())
        .await
        .expect("post twice", 409, Some("PAYOUT_NOT_CLAIMABLE"));
    assert_eq!(stack.psql("SELECT count(*) FROM ledger_entries"), "4");

    // P5: the balance and the recomputed ledger sum agree.
    let account = stack.get("/v1/accounts/acct-1").await;
    let a = account.expect("P5", 200, None);
    assert_eq!(a["balanceMinor"], 700);
    assert_eq!(a["ledgerSumMinor"], 700);
    assert_eq!(a["heldMinor"], 0);
    assert!(
        a["updatedAt"]
            .as_str()
            .is_some_and(|t| t.ends_with('Z') && t.len() == 24)
    );
    let settlement = stack.get("/v1/accounts/rail-settlement-EUR").await;
    assert_eq!(
        settlement.expect("settlement", 200, None)["balanceMinor"],
        300
    );
    stack
        .get("/v1/accounts/nobody")
        .await
        .expect("P5 unknown", 404, Some("NOT_FOUND"));
    stack
        .get(&format!("/v1/payouts/{}", Uuid::new_v4()))
        .await
        .expect("P4 unknown", 404, Some("NOT_FOUND"));
    stack
        .get("/v1/payouts/not-a-uuid")
        .await
        .expect("P4 bad id", 400, Some("VALIDATION_FAILED"));
    stack
        .claim(Uuid::new_v4(), stack.token(), "PENDING")
        .await
        .expect("claim unknown payout", 404, Some("NOT_FOUND"));
}

#[tokio::test]
async fn fenced_out_carries_the_five_details_the_log_event_and_the_counter() {
    let stack = PayStack::funded("acct-f", 1_000).await;
    let first = stack.payout("acct-f", 100, "EUR").await;
    let second = stack.payout("acct-f", 100, "EUR").await;
    let old = stack.token();
    let new = stack.claimed(first).await;

    // A stale holder claims: FENCED_OUT, resource account, nothing changed.
    let before = stack.psql(
        "SELECT state, attempt_count, coalesce(claim_token, 0) FROM payouts ORDER BY payout_id",
    );
    let fenced = stack.claim(second, old, "PENDING").await;
    let body = fenced.expect("stale claim", 409, Some("FENCED_OUT"));
    let details = &body["details"];
    assert_eq!(details["presentedToken"], old);
    assert_eq!(details["highestToken"], new);
    assert_eq!(details["resourceType"], "account");
    assert_eq!(details["resourceId"], "acct-f");
    assert_eq!(details["ownerId"], "worker-1");
    assert_eq!(body["retrySafe"], false);
    assert_eq!(
        before,
        stack.psql(
            "SELECT state, attempt_count, coalesce(claim_token, 0) FROM payouts ORDER BY payout_id"
        )
    );
    // The equal token is fenced too: a claim is strict.
    stack
        .claim(second, new, "PENDING")
        .await
        .expect("equal-token claim", 409, Some("FENCED_OUT"));

    // A stale post: FENCED_OUT, resource ledger, no entries.
    stack.rail_ack(first).await;
    let newest = stack.claimed(second).await;
    let stale_post = stack.post(first, new).await;
    let body = stale_post.expect("stale post", 409, Some("FENCED_OUT"));
    assert_eq!(body["details"]["resourceType"], "ledger");
    assert_eq!(body["details"]["resourceId"], first.to_string());
    assert_eq!(body["details"]["presentedToken"], new);
    assert_eq!(body["details"]["highestToken"], newest);
    assert_eq!(
        stack.psql("SELECT count(*) FROM ledger_entries WHERE kind = 'payout'"),
        "0"
    );
    assert_eq!(stack.state_of(first).await, "RAIL_ACKED");
    // A later holder may post what the claimer left acknowledged (fence <= token:
    // docs/design.md#d-1).
    stack
        .post(first, newest)
        .await
        .expect("later holder posts", 200, None);

    let metrics = stack.metrics().await;
    assert_eq!(
        metric(&metrics, "lock_fenced_out_total{resource=\"account\"}"),
        2.0
    );
    assert_eq!(
        metric(&metrics, "lock_fenced_out_total{resource=\"ledger\"}"),
        1.0
    );
}

#[tokio::test]
async fn recovery_reclaim_lists_pages_and_health() {
    let stack = PayStack::start().await;
    stack.account("acct-l", "EUR").await;
    stack.account("acct-m", "EUR").await;
    stack.fund("acct-l", 10_000).await;
    let mut ids = Vec::new();
    for _ in 0..5 {
        ids.push(stack.payout("acct-l", 10, "EUR").await);
    }
    let other = stack.payout("acct-m", 10, "EUR").await;

    // A recovery re-claim by a newer holder: CLAIMED -> CLAIMED, one more attempt, no new hold.
    let t1 = stack.token();
    stack
        .claim(ids[0], t1, "PENDING")
        .await
        .expect("claim", 200, None);
    let t2 = stack.token();
    let again = stack.claim(ids[0], t2, "CLAIMED").await;
    let body = again.expect("re-claim", 200, None);
    assert_eq!(body["attemptCount"], 2);
    assert_eq!(body["claimToken"], t2);
    assert_eq!(
        stack.psql("SELECT held_minor FROM accounts WHERE account_id = 'acct-l'"),
        "10"
    );

    // P1: filtered by state and account, paged with an opaque cursor, in creation order.
    let mut seen = Vec::new();
    let mut cursor: Option<String> = None;
    for page in 0..10 {
        let path = match &cursor {
            None => "/v1/payouts?state=PENDING&accountId=acct-l&limit=2".to_owned(),
            Some(c) => format!("/v1/payouts?state=PENDING&accountId=acct-l&limit=2&cursor={c}"),
        };
        let answer = stack.get(&path).await;
        let body = answer.expect("P1", 200, None).clone();
        let items = body["items"].as_array().cloned().unwrap_or_default();
        assert!(items.len() <= 2, "page {page}: {body}");
        for item in &items {
            assert_eq!(item["state"], "PENDING");
            assert_eq!(item["accountId"], "acct-l");
            assert_eq!(item["amountMinor"], 10);
            assert_eq!(item["currency"], "EUR");
            assert_eq!(item["attemptCount"], 0);
            seen.push(item["payoutId"].as_str().unwrap_or_default().to_owned());
        }
        match body["nextCursor"].as_str() {
            Some(c) => cursor = Some(c.to_owned()),
            None => break,
        }
    }
    let expected: Vec<String> = ids[1..].iter().map(Uuid::to_string).collect();
    assert_eq!(seen, expected);
    let all = stack.get("/v1/payouts").await;
    assert_eq!(
        all.expect("P1 unfiltered", 200, None)["items"]
            .as_array()
            .map(Vec::len),
        Some(6)
    );
    let claimed = stack.get("/v1/payouts?state=CLAIMED").await;
    let body = claimed.expect("P1 CLAIMED", 200, None);
    assert_eq!(body["items"][0]["payoutId"], ids[0].to_string());
    assert!(body.get("nextCursor").is_none());
    let m = stack.get("/v1/payouts?accountId=acct-m").await;
    assert_eq!(
        m.expect("P1 by account", 200, None)["items"][0]["payoutId"],
        other.to_string()
    );

    // Health, readiness, metrics, and the shared 404/405 envelopes.
    stack.get("/healthz").await.expect("healthz", 200, None);
    stack.get("/readyz").await.expect("readyz", 200, None);
    let metrics = stack.metrics().await;
    assert!(
        metrics.contains("idempotency_lookups_total{outcome=\"miss\"}"),
        "{metrics}"
    );
    assert!(
        metrics.contains("lock_fenced_out_total{resource=\"rail\"} 0"),
        "{metrics}"
    );
    stack
        .get("/v1/nothing-here")
        .await
        .expect("unknown route", 404, Some("NOT_FOUND"));
    stack
        .send(Method::DELETE, "/v1/payouts", &[], None)
        .await
        .expect("wrong method", 405, Some("METHOD_NOT_ALLOWED"));
    let _ = post_body;
}

/// The two ledger entries of `answer`, which must be `(direction, accountId)` in this order.
fn legs(answer: &Value, expected: [(&str, &str); 2]) -> Vec<Value> {
    let entries = answer["entries"].as_array().cloned().unwrap_or_default();
    assert_eq!(entries.len(), 2, "{answer}");
    for (entry, (direction, account)) in entries.iter().zip(expected) {
        assert_eq!(entry["direction"], direction, "{answer}");
        assert_eq!(entry["accountId"], account, "{answer}");
    }
    entries
}
