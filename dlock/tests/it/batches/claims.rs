//! `POST /v1/batches/claim` on the payment resource on real PostgreSQL: items with mixed
//! outcomes, a duplicate in flight, whole-batch refusals, and the contract client's batching.

use dlock_contract::ErrorCode;
use dlock_contract::payment::PayoutState;
use dlock_contract::payment_client::{Fence, PaymentClient};
use dlock_contract::proof::payout_lock_key;
use dlock_server::proof::ProofKeys;
use serde_json::{Value, json};
use uuid::Uuid;

use super::{
    CLAIM_BATCH, OWNER, account_row, batch_text, claim_batch, claim_item, code_of, fields_of,
    items_of, payout_row, records_of, refused, single_claim,
};
use crate::payment::PayStack;

const KEYS: &str = "batch-key 0123456789abcdef0123456789abcdef-batches\n";

/// A payment resource that checks fencing-token proofs, and the keys to make them with (the
/// lock server's part, here).
struct Proven {
    stack: PayStack,
    keys: ProofKeys,
    _dir: tempfile::TempDir,
}

impl Proven {
    async fn start() -> Self {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let file = dir.path().join("proof-keys");
        std::fs::write(&file, KEYS).unwrap_or_else(|e| panic!("{e}"));
        let stack = PayStack::start_with(&[(
            "fencing.proof-keys-file",
            file.display().to_string().as_str(),
        )])
        .await;
        let keys = ProofKeys::from_text(KEYS).unwrap_or_else(|e| panic!("{e}"));
        Self {
            stack,
            keys,
            _dir: dir,
        }
    }

    /// The proof of a grant of `token` on `account`'s lock key.
    fn proof(&self, account: &str, token: i64) -> String {
        self.keys
            .sign(&payout_lock_key(account), token)
            .unwrap_or_else(|| panic!("no signing key"))
    }

    /// A funded EUR account `id`.
    async fn funded(&self, id: &str) {
        self.stack.account(id, "EUR").await;
        self.stack.fund(id, 10_000).await;
    }
}

/// One batch of claims with mixed outcomes on an account whose fence a holder t2 raised with a
/// single claim: the stale holder t1 (FENCED_OUT), t2 again on another payout (FENCED_OUT: a
/// claim needs `fence < token`, docs/contract.md#p2), the next holder t3 on a third payout (200),
/// an unknown payout (404), token 0 (400 INVALID_TOKEN) and another account (200), each with its own valid
/// proof. Each item is answered in the request's order as the single endpoint answers it, and
/// the refused ones change nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn claims_with_mixed_outcomes_are_each_answered_as_the_single_endpoint() {
    let proven = Proven::start().await;
    let stack = &proven.stack;
    for account in ["bm-a", "bm-b", "bm-c"] {
        proven.funded(account).await;
    }
    let raised = stack.payout("bm-a", 100, "EUR").await;
    let stale_payout = stack.payout("bm-a", 100, "EUR").await;
    let again_payout = stack.payout("bm-a", 100, "EUR").await;
    let newer_payout = stack.payout("bm-a", 100, "EUR").await;
    let other_payout = stack.payout("bm-b", 100, "EUR").await;
    let zero_payout = stack.payout("bm-c", 100, "EUR").await;
    let unknown = Uuid::new_v4();
    let (t1, t2, t3) = (stack.token(), stack.token(), stack.token());
    let (t_other, t_unknown) = (stack.token(), stack.token());

    // The holder t2 raises bm-a's fence with a single claim.
    let raise = claim_item(raised, t2, Some(&proven.proof("bm-a", t2)), "bm-raise");
    single_claim(stack, &raise)
        .await
        .expect("t2's single claim", 200, None);
    assert_eq!(account_row(stack, "bm-a"), format!("10000 100 {t2}"));

    let proof = |account: &str, token: i64| Some(proven.proof(account, token));
    let items = vec![
        claim_item(stale_payout, t1, proof("bm-a", t1).as_deref(), "bm-stale"),
        claim_item(again_payout, t2, proof("bm-a", t2).as_deref(), "bm-again"),
        claim_item(newer_payout, t3, proof("bm-a", t3).as_deref(), "bm-newer"),
        claim_item(
            unknown,
            t_unknown,
            proof("bm-a", t_unknown).as_deref(),
            "bm-unknown",
        ),
        claim_item(zero_payout, 0, proof("bm-c", 0).as_deref(), "bm-zero"),
        claim_item(
            other_payout,
            t_other,
            proof("bm-b", t_other).as_deref(),
            "bm-other",
        ),
    ];
    let refused_payouts = [stale_payout, again_payout, zero_payout];
    let untouched: Vec<String> = refused_payouts
        .iter()
        .map(|p| payout_row(stack, *p))
        .chain([account_row(stack, "bm-c")])
        .collect();
    assert_eq!(untouched[0], "PENDING 0 0");

    let answer = claim_batch(stack, &items).await;
    let answers = items_of("the mixed batch", &answer, items.len());
    refused("the stale holder t1", &answers[0], 409, "FENCED_OUT");
    refused("t2 on another payout", &answers[1], 409, "FENCED_OUT");
    for (n, payout, token) in [(2, newer_payout, t3), (5, other_payout, t_other)] {
        let (status, body) = &answers[n];
        assert_eq!(*status, 200, "item {n}: {body}");
        assert_eq!(
            (&body["payoutId"], &body["claimToken"], &body["state"]),
            (&json!(payout), &json!(token), &json!("CLAIMED")),
            "item {n}: {body}"
        );
    }
    refused("the unknown payout", &answers[3], 404, "NOT_FOUND");
    // As `X-Fencing-Token: 0` at the single endpoint (docs/contract.md#error-codes); the
    // batches section of docs/contract.md names VALIDATION_FAILED here instead.
    refused("token 0", &answers[4], 400, "INVALID_TOKEN");

    // The refused items changed nothing; the accepted ones claimed.
    let after: Vec<String> = refused_payouts
        .iter()
        .map(|p| payout_row(stack, *p))
        .chain([account_row(stack, "bm-c")])
        .collect();
    assert_eq!(after, untouched, "the refused items changed nothing");
    assert_eq!(
        account_row(stack, "bm-a"),
        format!("10000 200 {t3}"),
        "bm-a holds t2's and t3's claimed payouts, and t3's fence"
    );
    assert_eq!(account_row(stack, "bm-b"), format!("10000 100 {t_other}"));
    assert_eq!(payout_row(stack, newer_payout), format!("CLAIMED 1 {t3}"));
    assert_eq!(records_of(stack, newer_payout), "1");

    // Each item alone at its single endpoint: the same status, code and fields (a replay of the
    // same body for the accepted ones).
    for (n, (item, batch_answer)) in items.iter().zip(&answers).enumerate() {
        let single = single_claim(stack, item).await;
        let step = format!("item {n} ({})", item["idempotencyKey"]);
        assert_eq!(single.status, batch_answer.0, "{step}: {}", single.json);
        assert_eq!(single.content_type, crate::payment::JSON_TYPE, "{step}");
        assert_eq!(
            code_of(&single.json),
            code_of(&batch_answer.1),
            "{step}: code"
        );
        assert_eq!(
            fields_of(&single.json),
            fields_of(&batch_answer.1),
            "{step}: fields"
        );
        if single.status == 200 {
            assert!(single.replayed, "{step}: the batch's claim is replayed");
            assert_eq!(single.json, batch_answer.1, "{step}: the same body");
        }
    }

    // The same items in the opposite order: the answers follow the request's order.
    let reversed: Vec<Value> = items.iter().rev().cloned().collect();
    let again = claim_batch(stack, &reversed).await;
    let again = items_of("the reversed batch", &again, items.len());
    for (n, answer) in again.iter().enumerate() {
        let first = &answers[items.len() - 1 - n];
        assert_eq!(
            (answer.0, code_of(&answer.1)),
            (first.0, code_of(&first.1)),
            "reversed item {n}"
        );
        if answer.0 == 200 {
            assert_eq!(answer.1, first.1, "reversed item {n}: the replayed body");
        }
    }
    let after: Vec<String> = refused_payouts
        .iter()
        .map(|p| payout_row(stack, *p))
        .chain([account_row(stack, "bm-c")])
        .collect();
    assert_eq!(after, untouched);
    assert_eq!(account_row(stack, "bm-a"), format!("10000 200 {t3}"));
}

/// The identical claim twice in one batch is answered twice, with the same body, and claims
/// once: one attempt, one idempotency record. The single endpoint then replays that answer, as
/// it does for two identical single requests in flight (payment/group_commit.rs).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_duplicate_in_one_batch_is_answered_twice_and_claims_once() {
    let stack = PayStack::start().await;
    for account in ["bd-a", "bd-b"] {
        stack.account(account, "EUR").await;
        stack.fund(account, 10_000).await;
    }
    let payout = stack.payout("bd-a", 100, "EUR").await;
    let other = stack.payout("bd-b", 100, "EUR").await;
    let (token, other_token) = (stack.token(), stack.token());
    let item = claim_item(payout, token, None, "bd-dup");
    let items = [
        item.clone(),
        item.clone(),
        claim_item(other, other_token, None, "bd-other"),
    ];
    let answer = claim_batch(&stack, &items).await;
    let answers = items_of("the batch with a duplicate", &answer, 3);
    for (n, (status, body)) in answers.iter().enumerate() {
        assert_eq!(*status, 200, "item {n}: {body}");
    }
    assert_eq!(answers[0].1, answers[1].1, "the two get the same body");
    assert_eq!(answers[0].1["claimToken"], json!(token));
    assert_eq!(answers[0].1["attemptCount"], json!(1));
    assert_eq!(answers[2].1["payoutId"], json!(other));
    assert_eq!(
        (payout_row(&stack, payout), records_of(&stack, payout)),
        (format!("CLAIMED 1 {token}"), "1".to_owned()),
        "one claim, one record"
    );
    assert_eq!(account_row(&stack, "bd-a"), format!("10000 100 {token}"));
    let single = single_claim(&stack, &item).await;
    single.expect("the same claim alone", 200, None);
    assert!(
        single.replayed,
        "the single endpoint replays the batch's claim"
    );
    assert_eq!(single.json, answers[0].1);
    assert_eq!(
        (payout_row(&stack, payout), records_of(&stack, payout)),
        (format!("CLAIMED 1 {token}"), "1".to_owned())
    );
}

/// A body that is not a batch of claims (65 items, none, an unknown or missing field, a wrong
/// type) is refused as a whole and nothing in it runs; the same valid item alone is then
/// claimed (positive control).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_refused_batch_runs_none_of_its_items() {
    let stack = PayStack::start().await;
    stack.account("br-a", "EUR").await;
    stack.fund("br-a", 10_000).await;
    let first = stack.payout("br-a", 100, "EUR").await;
    let second = stack.payout("br-a", 100, "EUR").await;
    let token = stack.token();
    let valid = claim_item(first, token, None, "br-first");
    let next = claim_item(second, token, None, "br-second");
    let mut unknown_field = next.clone();
    unknown_field["bogus"] = json!(1);
    let mut missing = next.clone();
    if let Some(item) = missing.as_object_mut() {
        item.remove("idempotencyKey");
    }
    let mut wrong_type = next.clone();
    wrong_type["fencingToken"] = json!(token.to_string());
    let too_many: Vec<Value> = (0..65).map(|_| valid.clone()).collect();
    // Over the service's body limit (server.body-limit-bytes, 64 KiB by default): the batch
    // is refused whole, though its first item alone would be claimed.
    let mut oversize = next.clone();
    oversize["idempotencyKey"] = json!("k".repeat(70 * 1024));
    let before = [
        payout_row(&stack, first),
        payout_row(&stack, second),
        account_row(&stack, "br-a"),
        records_of(&stack, first),
        records_of(&stack, second),
    ];
    assert_eq!(before[0], "PENDING 0 0");
    let cases: Vec<(&str, String, Option<&str>)> = vec![
        (
            "65 items",
            json!({ "items": too_many }).to_string(),
            Some("items"),
        ),
        ("no item", r#"{"items": []}"#.to_owned(), Some("items")),
        (
            "a body over the service's limit",
            json!({ "items": [valid, oversize] }).to_string(),
            Some("body"),
        ),
        (
            "an unknown field in an item",
            json!({ "items": [valid, unknown_field] }).to_string(),
            None,
        ),
        (
            "an item without its idempotency key",
            json!({ "items": [valid, missing] }).to_string(),
            None,
        ),
        (
            "a token as a string",
            json!({ "items": [valid, wrong_type] }).to_string(),
            None,
        ),
        (
            "an unknown field beside the items",
            json!({ "items": [valid], "extra": true }).to_string(),
            None,
        ),
    ];
    for (step, body, field) in cases {
        let answer = batch_text(&stack, CLAIM_BATCH, &body).await;
        answer.expect(step, 400, Some("VALIDATION_FAILED"));
        if let Some(field) = field {
            assert!(
                answer.fields().iter().any(|f| f == field),
                "{step}: names {field}: {}",
                answer.json
            );
        }
        assert_eq!(
            [
                payout_row(&stack, first),
                payout_row(&stack, second),
                account_row(&stack, "br-a"),
                records_of(&stack, first),
                records_of(&stack, second),
            ],
            before,
            "{step}: nothing ran"
        );
    }
    // Positive control: the valid item alone in a batch claims.
    let answer = claim_batch(&stack, std::slice::from_ref(&valid)).await;
    let answers = items_of("the valid item alone", &answer, 1);
    assert_eq!(answers[0].0, 200, "{}", answers[0].1);
    assert_eq!(payout_row(&stack, first), format!("CLAIMED 1 {token}"));
    assert_eq!(records_of(&stack, first), "1");
    assert_eq!(payout_row(&stack, second), before[1]);
}

/// The contract client with batching on: concurrent claims of one client share batch requests,
/// and each call gets the single endpoint's result: a claim, a replay of the same claim, a
/// FENCED_OUT for a stale holder, NOT_FOUND for an unknown payout.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_clients_batching_gives_each_call_the_single_endpoints_result() {
    let stack = PayStack::start().await;
    let mut payouts = Vec::new();
    for account in ["bc-a", "bc-b", "bc-c", "bc-d"] {
        stack.account(account, "EUR").await;
        stack.fund(account, 10_000).await;
        payouts.push((account, stack.payout(account, 100, "EUR").await));
    }
    let stale_payout = stack.payout("bc-a", 100, "EUR").await;
    let stale = stack.token();
    let tokens: Vec<i64> = payouts.iter().map(|_| stack.token()).collect();
    let client = PaymentClient::new(&stack.url, OWNER)
        .unwrap_or_else(|e| panic!("{e}"))
        .with_batching(8);
    let keys: Vec<String> = payouts.iter().map(|(a, _)| format!("bc-{a}")).collect();
    let claims = payouts.iter().zip(&tokens).zip(&keys).map(|((p, t), k)| {
        let client = client.clone();
        async move {
            client
                .claim(p.1, Fence::new(k, *t, None), PayoutState::Pending)
                .await
        }
    });
    let results = futures::future::join_all(claims).await;
    for (((account, payout), token), result) in payouts.iter().zip(&tokens).zip(&results) {
        let claim = result.as_ref().unwrap_or_else(|e| panic!("{account}: {e}"));
        assert_eq!(
            (claim.payout_id, claim.claim_token, claim.state),
            (*payout, *token, PayoutState::Claimed),
            "{account}"
        );
        assert_eq!(payout_row(&stack, *payout), format!("CLAIMED 1 {token}"));
    }
    // bc-a's fence is its holder's token now; a stale holder, the same claim again and an
    // unknown payout, together.
    let (stale_answer, again, unknown) = tokio::join!(
        client.claim(
            stale_payout,
            Fence::new("bc-stale", stale, None),
            PayoutState::Pending
        ),
        client.claim(
            payouts[1].1,
            Fence::new(&keys[1], tokens[1], None),
            PayoutState::Pending
        ),
        client.claim(
            Uuid::new_v4(),
            Fence::new("bc-unknown", stack.token(), None),
            PayoutState::Pending
        ),
    );
    assert_eq!(
        stale_answer.err().and_then(|e| e.code()),
        Some(ErrorCode::FencedOut)
    );
    let again = again.unwrap_or_else(|e| panic!("the same claim again: {e}"));
    assert_eq!(again.claim_token, tokens[1]);
    assert_eq!(again.attempt_count, 1, "a replay, not a second attempt");
    assert_eq!(
        unknown.err().and_then(|e| e.code()),
        Some(ErrorCode::NotFound)
    );
    assert_eq!(payout_row(&stack, stale_payout), "PENDING 0 0");
}
