//! Group commit of claims and posts (docs/design.md#group-commit), through HTTP against real
//! PostgreSQL: requests of one kind that queue while a transaction of that kind runs go into the
//! next transaction together, and each still gets its own answer.
//!
//! A test makes a batch form for certain: it holds the row lock of a "gate" account from its own
//! connection, sends a claim (or post) on the gate's payout, which runs alone and waits on that
//! lock, then sends the requests under test, which queue (the `payment_batch_queued` gauge says
//! how many), and only then lets the gate go. The `payment_batch_size` histogram shows the batch
//! that ran.

use std::time::Duration;

use serde_json::Value;
use sqlx::{Postgres, Transaction};
use uuid::Uuid;

use super::{Answer, PayStack};
use crate::harness::{BatchMetrics, eventually};

mod registrations;

const WAIT: Duration = Duration::from_secs(20);

impl PayStack {
    /// Holds `account`'s row lock until the transaction ends.
    async fn gate(&self, account: &str) -> Transaction<'static, Postgres> {
        let mut tx = self.pool.begin().await.unwrap_or_else(|e| panic!("{e}"));
        sqlx::query("SELECT 1 FROM accounts WHERE account_id = $1 FOR UPDATE")
            .bind(account)
            .execute(&mut *tx)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        tx
    }

    /// The backends of paydb waiting for a lock in a statement that calls `function`.
    fn lock_waiters(&self, function: &str) -> Vec<i64> {
        self.waiters_on(&format!("{function}("))
    }

    /// The backends of paydb waiting for a lock in a statement whose text holds `text`.
    fn waiters_on(&self, text: &str) -> Vec<i64> {
        self.psql(&format!(
            "SELECT pid FROM pg_stat_activity WHERE datname = 'paydb' \
             AND wait_event_type = 'Lock' AND query LIKE '%{text}%'"
        ))
        .lines()
        .filter_map(|l| l.trim().parse().ok())
        .collect()
    }

    /// Waits until a statement calling `function` waits for a row lock; its backend's pid.
    async fn waiting_in(&self, function: &str) -> i64 {
        eventually(&format!("{function} waits for a lock"), WAIT, || async {
            self.lock_waiters(function).first().copied()
        })
        .await
    }

    /// Its group-commit metrics.
    fn batch_metrics(&self) -> BatchMetrics {
        BatchMetrics {
            url: self.url.clone(),
            prefix: "payment",
        }
    }

    /// Sends `gate`, a request that waits behind `gate_tx`, and once `gate_waits` says it waits,
    /// `requests`; commits `gate_tx` once they are all queued as `kind`. The answers of the gate
    /// and of the requests, and the batches of `kind` that ran after the gate
    /// ([`BatchMetrics::batches_since`]).
    async fn gated<G: Future, W: Future, R: Future>(
        &self,
        (kind, gate_waits): (&str, W),
        gate_tx: Transaction<'static, Postgres>,
        gate: G,
        requests: Vec<R>,
    ) -> (G::Output, Vec<R::Output>, (f64, f64)) {
        let metrics = self.batch_metrics();
        let (gate, (answers, before)) = tokio::join!(gate, async {
            gate_waits.await;
            let before = metrics.batches(kind).await;
            let n = requests.len();
            let (answers, ()) = tokio::join!(futures::future::join_all(requests), async {
                metrics.queued(kind, n).await;
                gate_tx.commit().await.unwrap_or_else(|e| panic!("{e}"));
            });
            (answers, before)
        });
        (gate, answers, metrics.batches_since(kind, before).await)
    }

    /// [`PayStack::gated`] claims of PENDING payouts (`(payout, token)` each of `claims`), behind
    /// a claim of `gate_payout`, whose account's row (`gate_account`) is held until they queue.
    async fn claims_gated(
        &self,
        (gate_account, gate_payout): (&str, Uuid),
        claims: &[(Uuid, i64)],
    ) -> (Answer, Vec<Answer>, (f64, f64)) {
        let gate_tx = self.gate(gate_account).await;
        let gate = self.claim(gate_payout, self.token(), "PENDING");
        let waits = self.waiting_in("pay_claim_once");
        let requests = claims
            .iter()
            .map(|&(payout, token)| self.claim(payout, token, "PENDING"))
            .collect();
        self.gated(("claim", waits), gate_tx, gate, requests).await
    }

    fn fence_of(&self, account: &str) -> String {
        self.psql(&format!(
            "SELECT fence FROM accounts WHERE account_id = '{account}'"
        ))
    }

    fn records_of(&self, payout: Uuid) -> String {
        self.psql(&format!(
            "SELECT count(*) FROM idempotency_records WHERE route LIKE '%{payout}%'"
        ))
    }
}

/// A stack with funded EUR accounts `accounts` and one PENDING payout of 100 on each.
async fn stack_with(accounts: &[&str]) -> (PayStack, Vec<Uuid>) {
    let stack = PayStack::start().await;
    let mut payouts = Vec::new();
    for account in accounts {
        stack.account(account, "EUR").await;
        stack.fund(account, 10_000).await;
        payouts.push(stack.payout(account, 100, "EUR").await);
    }
    (stack, payouts)
}

fn code(answer: &Answer) -> &str {
    answer.json["code"].as_str().unwrap_or_default()
}

#[tokio::test]
async fn claims_in_one_batch_each_get_their_own_answer() {
    let (stack, p) = stack_with(&["gc-gate", "gc-ok", "gc-fenced", "gc-replay"]).await;
    let (gate_payout, ok, fenced, replayed) = (p[0], p[1], p[2], p[3]);
    // gc-fenced's fence stands above the token its claim will present.
    let stale = stack.token();
    let other = stack.payout("gc-fenced", 100, "EUR").await;
    stack.claimed(other).await;
    // gc-replay's claim was answered before; the batch carries the identical request again.
    let replay_token = stack.token();
    let first = stack.claim(replayed, replay_token, "PENDING").await;
    first.expect("first claim", 200, None);
    let ok_token = stack.token();

    let (blocker, answers, batches) = stack
        .claims_gated(
            ("gc-gate", gate_payout),
            &[(ok, ok_token), (fenced, stale), (replayed, replay_token)],
        )
        .await;
    blocker.expect("the gate's claim", 200, None);
    let [ok_answer, fenced_answer, replay_answer] = answers.as_slice() else {
        panic!("three answers, got {}", answers.len())
    };
    assert_eq!(
        ok_answer.expect("accepted claim", 200, None)["claimToken"],
        Value::from(ok_token)
    );
    assert!(!ok_answer.replayed, "the accepted claim ran");
    fenced_answer.expect("stale claim", 409, Some("FENCED_OUT"));
    replay_answer.expect("repeated claim", 200, None);
    replay_answer.replays("repeated claim", &first);
    // One transaction ran the three.
    assert_eq!(batches, (1.0, 3.0), "one batch of three");
    // Each effect as its answer says: one claim, one refusal that changed nothing, no second
    // attempt for the replay.
    assert_eq!(stack.state_of(ok).await, "CLAIMED");
    assert_eq!(stack.state_of(fenced).await, "PENDING");
    assert_eq!(
        stack.psql(&format!(
            "SELECT attempt_count FROM payouts WHERE payout_id = '{replayed}'"
        )),
        "1"
    );
    assert_eq!(stack.fence_of("gc-ok"), ok_token.to_string());
}

#[tokio::test]
async fn a_stale_and_a_newer_holder_of_one_account_in_one_batch_leave_the_stale_one_fenced_out() {
    for newer_first in [false, true] {
        let (stack, p) = stack_with(&["gs-gate", "gs-acct"]).await;
        let second = stack.payout("gs-acct", 100, "EUR").await;
        let (stale, newer) = (stack.token(), stack.token());
        let gate = stack.gate("gs-gate").await;
        let gate_token = stack.token();
        let metrics = stack.batch_metrics();
        let (blocker, (stale_answer, newer_answer, before)) =
            tokio::join!(stack.claim(p[0], gate_token, "PENDING"), async {
                stack.waiting_in("pay_claim_once").await;
                let before = metrics.batches("claim").await;
                let stale_claim = async {
                    if newer_first {
                        metrics.queued("claim", 1).await;
                    }
                    stack.claim(p[1], stale, "PENDING").await
                };
                let newer_claim = async {
                    if !newer_first {
                        metrics.queued("claim", 1).await;
                    }
                    stack.claim(second, newer, "PENDING").await
                };
                let (stale_answer, newer_answer, ()) =
                    tokio::join!(stale_claim, newer_claim, async {
                        metrics.queued("claim", 2).await;
                        gate.commit().await.unwrap_or_else(|e| panic!("{e}"));
                    });
                (stale_answer, newer_answer, before)
            },);
        let step = if newer_first {
            "newer queued first"
        } else {
            "stale queued first"
        };
        blocker.expect(step, 200, None);
        newer_answer.expect(step, 200, None);
        stale_answer.expect(step, 409, Some("FENCED_OUT"));
        assert_eq!(stack.state_of(p[1]).await, "PENDING", "{step}");
        assert_eq!(stack.fence_of("gs-acct"), newer.to_string(), "{step}");
        assert_eq!(
            metrics.batches_since("claim", before).await,
            (1.0, 2.0),
            "{step}: one batch of the two"
        );
    }
}

#[tokio::test]
async fn a_duplicate_in_flight_is_answered_once() {
    let (stack, p) = stack_with(&["gd-gate", "gd-acct", "gd-other"]).await;
    let token = stack.token();
    let other_token = stack.token();
    let (blocker, answers, _) = stack
        .claims_gated(
            ("gd-gate", p[0]),
            &[(p[1], token), (p[1], token), (p[2], other_token)],
        )
        .await;
    let [one, two, other] = answers.as_slice() else {
        panic!("three answers, got {}", answers.len())
    };
    blocker.expect("the gate's claim", 200, None);
    other.expect("the other claim", 200, None);
    one.expect("first of the two", 200, None);
    two.expect("second of the two", 200, None);
    // The effect once: one attempt, one stored answer, and one of the two is its replay.
    assert_eq!(
        stack.psql(&format!(
            "SELECT attempt_count FROM payouts WHERE payout_id = '{}'",
            p[1]
        )),
        "1"
    );
    assert_eq!(stack.records_of(p[1]), "1");
    assert_eq!(
        [one.replayed, two.replayed].iter().filter(|r| **r).count(),
        1,
        "exactly one of the two is a replay"
    );
    let (ran, replay) = if one.replayed { (two, one) } else { (one, two) };
    replay.replays("the duplicate", ran);
}

#[tokio::test]
async fn a_failed_batch_answers_every_item_503_and_writes_nothing() {
    let (stack, p) = stack_with(&["gf-gate", "gf-held", "gf-free"]).await;
    let (held_token, free_token) = (stack.token(), stack.token());
    let held = stack.gate("gf-held").await;
    let claims = [(p[1], held_token), (p[2], free_token)];
    let ((blocker, answers, _), ()) =
        tokio::join!(stack.claims_gated(("gf-gate", p[0]), &claims), async {
            // Once the gate is open, the batch of the two waits on gf-held's row: its connection
            // dies there.
            let pid = stack.waiting_in("pay_claim_many").await;
            stack.psql(&format!("SELECT pg_terminate_backend({pid})"));
        });
    held.rollback().await.unwrap_or_else(|e| panic!("{e}"));
    blocker.expect("the gate's claim", 200, None);
    for (step, answer) in [("held", &answers[0]), ("free", &answers[1])] {
        assert_eq!(answer.status, 503, "{step}: {}", answer.json);
        assert_eq!(code(answer), "NOT_LEADER", "{step}");
    }
    // Nothing of either was written: no record, no claim, no fence.
    for (payout, account) in [(p[1], "gf-held"), (p[2], "gf-free")] {
        assert_eq!(stack.records_of(payout), "0", "{account}: no record");
        assert_eq!(stack.state_of(payout).await, "PENDING", "{account}");
        assert_eq!(stack.fence_of(account), "0", "{account}: fence");
    }
    // Positive control: the same requests again are answered and written.
    stack
        .claim(p[1], held_token, "PENDING")
        .await
        .expect("held, retried", 200, None);
    stack
        .claim(p[2], free_token, "PENDING")
        .await
        .expect("free, retried", 200, None);
    assert_eq!(stack.records_of(p[2]), "1");
    assert_eq!(stack.fence_of("gf-free"), free_token.to_string());
}

#[tokio::test]
async fn posts_in_one_batch_each_post_once_with_their_entries() {
    let (stack, p) = stack_with(&["gp-gate", "gp-a", "gp-b"]).await;
    let second_on_a = stack.payout("gp-a", 250, "EUR").await;
    let payouts = [p[0], p[1], second_on_a, p[2]];
    let mut tokens = Vec::new();
    for payout in payouts {
        tokens.push(stack.claimed(payout).await);
        stack.rail_ack(payout).await;
    }
    let (blocker, answers, batches) = stack
        .gated(
            ("post", stack.waiting_in("pay_post_once")),
            stack.gate("gp-gate").await,
            stack.post(payouts[0], tokens[0]),
            vec![
                // gp-a's newer holder posts both of its payouts (fence <= token).
                stack.post(payouts[1], tokens[2]),
                stack.post(payouts[2], tokens[2]),
                stack.post(payouts[3], tokens[3]),
            ],
        )
        .await;
    blocker.expect("the gate's post", 200, None);
    let [a1, a2, b] = answers.as_slice() else {
        panic!("three answers, got {}", answers.len())
    };
    for (step, answer, amount) in [("a1", a1, 100), ("a2", a2, 250), ("b", b, 100)] {
        let body = answer.expect(step, 200, None);
        let entries = body["entries"].as_array().cloned().unwrap_or_default();
        assert_eq!(entries.len(), 2, "{step}: two entries");
        for e in &entries {
            assert_eq!(e["amountMinor"], Value::from(amount), "{step}");
        }
    }
    assert_eq!(batches, (1.0, 3.0), "one batch of three");
    // Both of gp-a's payouts left its balance, once each.
    assert_eq!(
        stack.psql("SELECT balance_minor FROM accounts WHERE account_id = 'gp-a'"),
        (10_000 - 100 - 250).to_string()
    );
    assert_eq!(
        stack.psql("SELECT count(*) FROM ledger_entries WHERE kind = 'payout'"),
        "8"
    );
}

#[tokio::test]
async fn payout_reads_in_one_statement_each_get_their_own_payout() {
    let (stack, p) = stack_with(&["gr-a", "gr-b", "gr-c"]).await;
    let token = stack.claimed(p[1]).await;
    let unknown = Uuid::new_v4();
    // The gate: the payouts table locked, so the first read waits in its statement.
    let mut gate = stack.pool.begin().await.unwrap_or_else(|e| panic!("{e}"));
    sqlx::query("LOCK TABLE payouts IN ACCESS EXCLUSIVE MODE")
        .execute(&mut *gate)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let path = |id: Uuid| format!("/v1/payouts/{id}");
    let paths = [path(p[0]), path(p[1]), path(p[2]), path(unknown)];
    let first_read_waits = eventually("the first read waits", WAIT, || async {
        stack
            .waiters_on("LEFT JOIN rail_submission")
            .first()
            .copied()
    });
    let (blocker, answers, batches) = stack
        .gated(
            ("read", first_read_waits),
            gate,
            stack.get(&paths[0]),
            paths[1..].iter().map(|path| stack.get(path)).collect(),
        )
        .await;
    let [b, c, missing] = answers.as_slice() else {
        panic!("three answers, got {}", answers.len())
    };
    assert_eq!(
        blocker.expect("the gate's read", 200, None)["payoutId"],
        Value::from(p[0].to_string())
    );
    let b = b.expect("claimed payout", 200, None);
    assert_eq!(b["payoutId"], Value::from(p[1].to_string()));
    assert_eq!(
        (b["state"].as_str(), b["claimToken"].as_i64()),
        (Some("CLAIMED"), Some(token))
    );
    let c = c.expect("pending payout", 200, None);
    assert_eq!(c["payoutId"], Value::from(p[2].to_string()));
    assert_eq!(c["state"], Value::from("PENDING"));
    missing.expect("unknown payout", 404, Some("NOT_FOUND"));
    assert_eq!(batches, (1.0, 3.0), "one statement for the three reads");
}

#[tokio::test]
async fn an_item_that_raises_is_rolled_back_alone_and_answered_on_the_single_path() {
    let (stack, p) = stack_with(&["gl-gate", "gl-limited", "gl-ok"]).await;
    // gl-limited may send 50 a day: claiming its payout of 100 raises in paydb's limit trigger.
    stack.psql("SELECT outcome FROM pay_set_limits('gl-limited', NULL, 50, 'test')");
    let (limited_token, ok_token) = (stack.token(), stack.token());
    let (blocker, answers, batches) = stack
        .claims_gated(
            ("gl-gate", p[0]),
            &[(p[1], limited_token), (p[2], ok_token)],
        )
        .await;
    blocker.expect("the gate's claim", 200, None);
    answers[0].expect("the claim over the limit", 422, Some("LIMIT_EXCEEDED"));
    answers[1].expect("its neighbour", 200, None);
    assert_eq!(batches, (1.0, 2.0), "the two were one batch");
    // The limited claim changed nothing; its neighbour's claim committed.
    assert_eq!(stack.state_of(p[1]).await, "PENDING");
    assert_eq!(stack.fence_of("gl-limited"), "0");
    assert_eq!(stack.records_of(p[1]), "0");
    assert_eq!(stack.state_of(p[2]).await, "CLAIMED");
    assert_eq!(stack.fence_of("gl-ok"), ok_token.to_string());
}
