//! Group commit of registrations (`POST /v1/payouts`, migrations/paydb/0040_baseline_idempotency_and_rail.sql):
//! the registrations that queue while one runs go into the next transaction together, and each
//! is answered as it would be alone. The gate is the account row held for update: a payout's
//! insert key-share locks its account, so the gate's registration waits in `pay_create_payout`.

use serde_json::{Value, json};
use uuid::Uuid;

use super::super::{Answer, PayStack};
use super::{code, stack_with};

impl PayStack {
    /// Registers `payout` on `account` under `key`, as a run does.
    async fn register(
        &self,
        key: &str,
        payout: Uuid,
        account: &str,
        amount: i64,
        currency: &str,
    ) -> Answer {
        let body = json!({
            "payoutId": payout, "accountId": account, "amountMinor": amount,
            "currency": currency, "beneficiaryRef": format!("ben-{payout}"),
        });
        self.write("/v1/payouts", key, None, &body).await
    }

    /// Registrations behind the gate's, whose account's row (`gate_account`) is held until
    /// `requests` queue.
    async fn registrations_gated<R: Future>(
        &self,
        gate_account: &str,
        requests: Vec<R>,
    ) -> (Answer, Vec<R::Output>, (f64, f64)) {
        let gate_tx = self.gate(gate_account).await;
        let gate = self.register("gate", Uuid::new_v4(), gate_account, 100, "EUR");
        let waits = self.waiting_in("pay_create_payout");
        self.gated(("register", waits), gate_tx, gate, requests)
            .await
    }

    /// How many idempotency records registrations under `key` left.
    fn registration_records(&self, key: &str) -> String {
        self.psql(&format!(
            "SELECT count(*) FROM idempotency_records \
             WHERE route = 'POST /v1/payouts' AND idempotency_key = '{key}'"
        ))
    }

    fn exists(&self, payout: Uuid) -> String {
        self.psql(&format!(
            "SELECT count(*) FROM payouts WHERE payout_id = '{payout}'"
        ))
    }
}

#[tokio::test]
async fn registrations_in_one_batch_each_get_their_own_answer() {
    let (stack, _) = stack_with(&["gg-gate", "gg-ok", "gg-limited"]).await;
    // gg-limited's largest single payout is 50: registering 100 raises in paydb's limit trigger.
    stack.psql("SELECT outcome FROM pay_set_limits('gg-limited', 50, NULL, 'test')");
    // An earlier registration, sent again identically (a replay) ...
    let earlier = Uuid::new_v4();
    let first = stack
        .register("gg-earlier", earlier, "gg-ok", 100, "EUR")
        .await;
    first.expect("the earlier registration", 201, None);
    // ... and another, whose key comes back with another payout (a conflict).
    stack
        .register("gg-reused", Uuid::new_v4(), "gg-ok", 100, "EUR")
        .await
        .expect("the registration whose key is reused", 201, None);
    let (fresh, conflicting, unknown, limited, wrong_currency) = (
        Uuid::new_v4(),
        Uuid::new_v4(),
        Uuid::new_v4(),
        Uuid::new_v4(),
        Uuid::new_v4(),
    );

    let (gate, answers, batches) = stack
        .registrations_gated(
            "gg-gate",
            vec![
                stack.register("gg-fresh", fresh, "gg-ok", 100, "EUR"),
                stack.register("gg-earlier", earlier, "gg-ok", 100, "EUR"),
                stack.register("gg-reused", conflicting, "gg-ok", 100, "EUR"),
                stack.register("gg-unknown", unknown, "gg-nobody", 100, "EUR"),
                stack.register("gg-limited", limited, "gg-limited", 100, "EUR"),
                stack.register("gg-currency", wrong_currency, "gg-ok", 100, "USD"),
            ],
        )
        .await;
    gate.expect("the gate's registration", 201, None);
    let [
        fresh_a,
        replay_a,
        conflict_a,
        unknown_a,
        limited_a,
        currency_a,
    ] = answers.as_slice()
    else {
        panic!("six answers, got {}", answers.len())
    };
    // One transaction took the six.
    assert_eq!(batches, (1.0, 6.0), "one batch of six");

    let body = fresh_a.expect("the fresh registration", 201, None);
    assert_eq!(body["payoutId"], Value::from(fresh.to_string()));
    assert_eq!(body["state"], Value::from("PENDING"));
    assert!(!fresh_a.replayed, "the fresh registration ran");
    replay_a.expect("the repeated registration", 201, None);
    replay_a.replays("the repeated registration", &first);
    conflict_a.expect("the reused key", 422, Some("IDEMPOTENCY_CONFLICT"));
    unknown_a.expect("the unknown account", 404, Some("NOT_FOUND"));
    limited_a.expect(
        "above the largest single payout",
        422,
        Some("LIMIT_EXCEEDED"),
    );
    currency_a.expect("another currency", 400, Some("VALIDATION_FAILED"));
    assert_eq!(code(currency_a), "VALIDATION_FAILED");

    // Each effect as its answer says. The fresh one and the refusals that are kept have their
    // record; what keeps nothing (404, LIMIT_EXCEEDED) left neither a payout nor a record.
    assert_eq!(stack.exists(fresh), "1");
    assert_eq!(stack.registration_records("gg-fresh"), "1");
    assert_eq!(stack.registration_records("gg-currency"), "1");
    for (step, payout, key) in [
        ("reused key", conflicting, "gg-reused"),
        ("unknown account", unknown, "gg-unknown"),
        ("over the limit", limited, "gg-limited"),
        ("other currency", wrong_currency, "gg-currency"),
    ] {
        assert_eq!(stack.exists(payout), "0", "{step}: no payout");
        if key != "gg-currency" && key != "gg-reused" {
            assert_eq!(stack.registration_records(key), "0", "{step}: no record");
        }
    }
    // Positive control: once the account exists, the same registration is made.
    stack.account("gg-nobody", "EUR").await;
    stack
        .register("gg-unknown", unknown, "gg-nobody", 100, "EUR")
        .await
        .expect("the unknown account's registration, retried", 201, None);
    assert_eq!(stack.exists(unknown), "1");
}

#[tokio::test]
async fn a_failed_batch_of_registrations_answers_every_item_503_and_writes_nothing() {
    let (stack, _) = stack_with(&["gh-gate", "gh-held", "gh-free"]).await;
    let held = stack.gate("gh-held").await;
    let (held_payout, free_payout) = (Uuid::new_v4(), Uuid::new_v4());
    let ((gate, answers, batches), ()) = tokio::join!(
        stack.registrations_gated(
            "gh-gate",
            vec![
                stack.register("gh-held", held_payout, "gh-held", 100, "EUR"),
                stack.register("gh-free", free_payout, "gh-free", 100, "EUR"),
            ],
        ),
        async {
            // Once the gate is open, the batch of the two waits on gh-held's row: its
            // connection dies there.
            let pid = stack.waiting_in("pay_create_many").await;
            stack.psql(&format!("SELECT pg_terminate_backend({pid})"));
        }
    );
    held.rollback().await.unwrap_or_else(|e| panic!("{e}"));
    gate.expect("the gate's registration", 201, None);
    assert_eq!(batches, (1.0, 2.0), "the two were one batch");
    for (step, answer) in [("held", &answers[0]), ("free", &answers[1])] {
        assert_eq!(answer.status, 503, "{step}: {}", answer.json);
        assert_eq!(code(answer), "NOT_LEADER", "{step}");
    }
    // Nothing of either was written: no payout, no record.
    for (key, payout) in [("gh-held", held_payout), ("gh-free", free_payout)] {
        assert_eq!(stack.exists(payout), "0", "{key}: no payout");
        assert_eq!(stack.registration_records(key), "0", "{key}: no record");
    }
    // Positive control: the same requests again are answered and written.
    for (key, payout) in [("gh-held", held_payout), ("gh-free", free_payout)] {
        stack
            .register(key, payout, key, 100, "EUR")
            .await
            .expect("retried", 201, None);
        assert_eq!(stack.exists(payout), "1", "{key}");
        assert_eq!(stack.registration_records(key), "1", "{key}");
    }
}
