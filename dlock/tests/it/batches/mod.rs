//! The batch endpoints (docs/contract.md#batches) through the real services: claims on the
//! payment resource on real PostgreSQL (with fencing-token proofs where a test needs them),
//! acquires and releases on a real lock server, the roles on `dlock dev up`, and a whole batch of
//! payouts run by `dlock run --batch-max` against the dev stack. Batch requests go as raw HTTP
//! JSON, so the wire format itself is what is tested; each item's answer is compared with what
//! the single endpoint answers for the same request.

mod claims;
mod dev;
mod locks;

use reqwest::Method;
use serde_json::{Value, json};
use uuid::Uuid;

use crate::payment::{Answer, PayStack, fields_of};

const OWNER: &str = "worker-1";
const CLAIM_BATCH: &str = "/v1/batches/claim";

/// A claim item (docs/contract.md#batches): what `POST /v1/payouts/{payoutId}/claim` carries.
fn claim_item(payout: Uuid, token: i64, proof: Option<&str>, key: &str) -> Value {
    let mut item = json!({
        "payoutId": payout,
        "fencingToken": token,
        "idempotencyKey": key,
        "expectedState": "PENDING",
    });
    if let Some(proof) = proof {
        item["fencingProof"] = Value::from(proof);
    }
    item
}

/// `POST {path}` on the payment resource with `body` as its text, as [`OWNER`].
async fn batch_text(stack: &PayStack, path: &str, body: &str) -> Answer {
    stack
        .send(
            Method::POST,
            path,
            &[("x-owner-id", OWNER.to_owned())],
            Some(body),
        )
        .await
}

/// `POST /v1/batches/claim` of `items` on the payment resource.
async fn claim_batch(stack: &PayStack, items: &[Value]) -> Answer {
    batch_text(stack, CLAIM_BATCH, &json!({ "items": items }).to_string()).await
}

/// The single claim the item `item` stands for, sent to `POST /v1/payouts/{payoutId}/claim`.
async fn single_claim(stack: &PayStack, item: &Value) -> Answer {
    let text = |field: &str| match &item[field] {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    };
    let mut headers = vec![
        ("x-owner-id", OWNER.to_owned()),
        ("x-idempotency-key", text("idempotencyKey")),
        ("x-fencing-token", text("fencingToken")),
    ];
    if item.get("fencingProof").is_some() {
        headers.push(("x-fencing-proof", text("fencingProof")));
    }
    stack
        .send(
            Method::POST,
            &format!("/v1/payouts/{}/claim", text("payoutId")),
            &headers,
            Some(r#"{"expectedState":"PENDING"}"#),
        )
        .await
}

/// The answers of a 200 batch answer, one per item, each `(status, body)`.
fn items_of(step: &str, answer: &Answer, n: usize) -> Vec<(u16, Value)> {
    let body = answer.expect(step, 200, None);
    let items = body["items"]
        .as_array()
        .unwrap_or_else(|| panic!("{step}: no items in {body}"));
    assert_eq!(items.len(), n, "{step}: one answer per item: {body}");
    items
        .iter()
        .map(|item| {
            let status = item["status"]
                .as_u64()
                .and_then(|s| u16::try_from(s).ok())
                .unwrap_or_else(|| panic!("{step}: an item without a status: {item}"));
            (status, item.get("body").cloned().unwrap_or(Value::Null))
        })
        .collect()
}

/// The error code of an envelope (empty for none).
fn code_of(body: &Value) -> &str {
    body["code"].as_str().unwrap_or_default()
}

/// Asserts that an item's answer is an error envelope with `status` and `code`.
fn refused(step: &str, item: &(u16, Value), status: u16, code: &str) {
    assert_eq!(item.0, status, "{step}: {}", item.1);
    crate::conformance::assert_envelope(step, item.0, &item.1, code);
}

/// What paydb holds for a payout: state, attempts, claim token.
fn payout_row(stack: &PayStack, payout: Uuid) -> String {
    stack.psql(&format!(
        "SELECT state || ' ' || attempt_count || ' ' || coalesce(claim_token, 0) \
         FROM payouts WHERE payout_id = '{payout}'"
    ))
}

/// How many idempotency records paydb holds for writes on `payout`.
fn records_of(stack: &PayStack, payout: Uuid) -> String {
    stack.psql(&format!(
        "SELECT count(*) FROM idempotency_records WHERE route LIKE '%{payout}%'"
    ))
}

/// What paydb holds for an account: balance, holds, fence.
fn account_row(stack: &PayStack, account: &str) -> String {
    stack.psql(&format!(
        "SELECT balance_minor || ' ' || held_minor || ' ' || fence \
         FROM accounts WHERE account_id = '{account}'"
    ))
}
