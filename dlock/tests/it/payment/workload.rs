//! A randomized concurrent workload: many workers claim, re-claim and post interleaved payouts
//! with fresh, stale and equal tokens, re-send requests with re-used keys, and a simulated rail
//! moves claimed payouts to RAIL_ACKED in SQL. Afterwards paydb must satisfy every invariant.

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex};

use futures::future::join_all;
use rand::{Rng, SeedableRng};
use serde_json::json;
use uuid::Uuid;

use super::{PayStack, simulate_rail};

const ACCOUNTS: usize = 4;
const PAYOUTS: usize = 60;
const WORKERS: usize = 8;
const STEPS_PER_WORKER: usize = 40;

/// Hands out tokens: fresh ones are even and increasing; stale ones are odd, below the current
/// value, and each used once, so every token names exactly one attempt.
#[derive(Default)]
struct Tokens {
    next: i64,
    stale_used: BTreeSet<i64>,
}

impl Tokens {
    fn fresh(&mut self) -> i64 {
        self.next += 2;
        self.next
    }

    fn stale(&mut self, rng: &mut impl Rng) -> i64 {
        for _ in 0..100 {
            let back = rng.random_range(1..=30i64);
            let t = (self.next - 2 * back).max(0) + 1;
            if self.stale_used.insert(t) {
                return t;
            }
        }
        self.fresh()
    }
}

#[derive(Default)]
struct Log {
    fenced_claim_tokens: Vec<i64>,
    fenced_post_tokens: Vec<i64>,
    claims_ok: HashMap<Uuid, usize>,
    replays: usize,
    fenced: usize,
    posted: usize,
}

async fn worker(
    stack: Arc<PayStack>,
    payouts: Arc<Vec<Uuid>>,
    tokens: Arc<Mutex<Tokens>>,
    log: Arc<Mutex<Log>>,
    seed: u64,
) {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    for _ in 0..STEPS_PER_WORKER {
        let payout = payouts[rng.random_range(0..payouts.len())];
        let read = stack.get(&format!("/v1/payouts/{payout}")).await;
        let state = read.json["state"].as_str().unwrap_or_default().to_owned();
        let stale = rng.random_bool(0.25);
        let token = {
            let mut t = tokens.lock().unwrap_or_else(|e| panic!("{e}"));
            if stale { t.stale(&mut rng) } else { t.fresh() }
        };
        let (answer, is_claim, token) = match state.as_str() {
            "PENDING" => (stack.claim(payout, token, "PENDING").await, true, token),
            "CLAIMED" if rng.random_bool(0.3) => {
                (stack.claim(payout, token, "CLAIMED").await, true, token)
            }
            "CLAIMED" => {
                simulate_rail(&stack.pool, payout).await;
                (stack.post(payout, token).await, false, token)
            }
            "RAIL_ACKED" => {
                // Sometimes the claimer itself posts, with the token of its claim.
                let claim_token = read.json["claimToken"].as_i64().unwrap_or(token);
                let token = if rng.random_bool(0.5) {
                    claim_token
                } else {
                    token
                };
                (stack.post(payout, token).await, false, token)
            }
            _ => continue,
        };
        let code = answer.json["code"].as_str().unwrap_or_default().to_owned();
        assert_eq!(answer.content_type, super::JSON_TYPE);
        match (answer.status, code.as_str()) {
            (200, _) if is_claim => {
                *log.lock()
                    .unwrap_or_else(|e| panic!("{e}"))
                    .claims_ok
                    .entry(payout)
                    .or_default() += 1;
            }
            (200, _) => log.lock().unwrap_or_else(|e| panic!("{e}")).posted += 1,
            (409, "FENCED_OUT") => {
                let details = &answer.json["details"];
                let presented = details["presentedToken"].as_i64().unwrap_or_default();
                let highest = details["highestToken"].as_i64().unwrap_or_default();
                assert!(highest >= presented, "{details}");
                assert_eq!(presented, token);
                let mut log = log.lock().unwrap_or_else(|e| panic!("{e}"));
                log.fenced += 1;
                if is_claim {
                    log.fenced_claim_tokens.push(presented);
                } else {
                    log.fenced_post_tokens.push(presented);
                }
            }
            (409, "PAYOUT_NOT_CLAIMABLE") | (422, "INSUFFICIENT_FUNDS") => {}
            other => panic!("unexpected answer {other:?}: {}", answer.json),
        }
        // A retry with the same key, token and body replays the answer byte for byte.
        if rng.random_bool(0.3) {
            let path = format!(
                "/v1/payouts/{payout}/{}",
                if is_claim { "claim" } else { "post" }
            );
            let body = if is_claim {
                let expected = if state == "PENDING" {
                    "PENDING"
                } else {
                    "CLAIMED"
                };
                json!({ "expectedState": expected })
            } else {
                super::post_body(payout)
            };
            let again = stack
                .write(&path, &format!("payout-{payout}"), Some(token), &body)
                .await;
            assert!(
                again.replayed,
                "retry of {path} was not a replay: {}",
                again.json
            );
            assert_eq!(again.status, answer.status);
            assert_eq!(again.bytes, answer.bytes, "replay of {path} differs");
            log.lock().unwrap_or_else(|e| panic!("{e}")).replays += 1;
        }
    }
}

#[tokio::test]
async fn a_randomized_concurrent_workload_keeps_every_invariant() {
    let stack = Arc::new(PayStack::start().await);
    let mut rng = rand::rngs::StdRng::seed_from_u64(0x00d1_0c4e);
    let accounts: Vec<String> = (0..ACCOUNTS).map(|i| format!("acct-w{i}")).collect();
    for account in &accounts {
        stack.account(account, "EUR").await;
        stack.fund(account, 3_000).await;
    }
    let mut payouts = Vec::new();
    for _ in 0..PAYOUTS {
        let account = &accounts[rng.random_range(0..ACCOUNTS)];
        payouts.push(
            stack
                .payout(account, rng.random_range(100..=1_500), "EUR")
                .await,
        );
    }
    let payouts = Arc::new(payouts);
    let tokens = Arc::new(Mutex::new(Tokens {
        next: 1_000,
        ..Tokens::default()
    }));
    let log = Arc::new(Mutex::new(Log::default()));
    join_all((0..WORKERS).map(|w| {
        tokio::spawn(worker(
            stack.clone(),
            payouts.clone(),
            tokens.clone(),
            log.clone(),
            17 + w as u64,
        ))
    }))
    .await
    .into_iter()
    .for_each(|r| r.unwrap_or_else(|e| panic!("worker: {e}")));
    let log = log.lock().unwrap_or_else(|e| panic!("{e}"));
    assert!(
        log.posted > 0 && log.fenced > 0 && log.replays > 0,
        "posted {} fenced {} replays {}",
        log.posted,
        log.fenced,
        log.replays
    );

    let q = |sql: &str| stack.psql(sql);
    // The ledger sum equals the balance on every account.
    assert_eq!(
        q(
            "SELECT count(*) FROM accounts a WHERE a.balance_minor + coalesce((SELECT sum(s.balance_minor) FROM account_balance_shards s WHERE s.account_id = a.account_id), 0) <> coalesce((SELECT sum(CASE WHEN e.direction = 'CREDIT' THEN e.amount_minor ELSE -e.amount_minor END) FROM ledger_entries e WHERE e.account_id = a.account_id), 0)"
        ),
        "0"
    );
    // Holds are exactly the held payouts, and no customer's available balance is negative.
    assert_eq!(
        q(
            "SELECT count(*) FROM accounts a WHERE a.held_minor <> coalesce((SELECT sum(p.amount_minor) FROM payouts p WHERE p.account_id = a.account_id AND p.state IN ('CLAIMED', 'SUBMITTING', 'RAIL_ACKED', 'RAIL_AMBIGUOUS')), 0)"
        ),
        "0"
    );
    assert_eq!(
        q(
            "SELECT count(*) FROM accounts WHERE kind = 'customer' AND (balance_minor < 0 OR balance_minor - held_minor < 0)"
        ),
        "0"
    );
    // Every POSTED payout has exactly two balanced entries (customer DEBIT, settlement CREDIT).
    assert_eq!(
        q(
            "SELECT count(*) FROM payouts p WHERE p.state = 'POSTED' AND (SELECT count(*) FROM ledger_entries e WHERE e.payout_id = p.payout_id AND e.amount_minor = p.amount_minor AND ((e.direction = 'DEBIT' AND e.account_id = p.account_id) OR (e.direction = 'CREDIT' AND e.account_id = 'rail-settlement-EUR'))) <> 2"
        ),
        "0"
    );
    // Nothing else has entries, and no payout was posted twice.
    assert_eq!(
        q(
            "SELECT count(*) FROM ledger_entries e JOIN payouts p USING (payout_id) WHERE p.state <> 'POSTED'"
        ),
        "0"
    );
    assert_eq!(
        q(
            "SELECT count(*) FROM (SELECT payout_id FROM ledger_entries WHERE payout_id IS NOT NULL GROUP BY payout_id HAVING count(*) <> 2) x"
        ),
        "0"
    );
    assert_eq!(
        q("SELECT count(*) FROM payouts WHERE state = 'POSTED'"),
        log.posted.to_string()
    );
    // Each posting was written under a token no lower than the payout's claim.
    assert_eq!(
        q(
            "SELECT count(*) FROM ledger_entries e JOIN payouts p USING (payout_id) WHERE e.fence < p.claim_token"
        ),
        "0"
    );
    // Every fenced-out write changed nothing: its token is on no payout and no entry. With no
    // token the list is NULL, which matches nothing (not 0: a funding entry's fence is 0).
    let list = |tokens: &[i64]| {
        if tokens.is_empty() {
            "NULL".to_owned()
        } else {
            tokens
                .iter()
                .map(i64::to_string)
                .collect::<Vec<_>>()
                .join(",")
        }
    };
    assert_eq!(
        q(&format!(
            "SELECT count(*) FROM payouts WHERE claim_token IN ({})",
            list(&log.fenced_claim_tokens)
        )),
        "0"
    );
    assert_eq!(
        q(&format!(
            "SELECT count(*) FROM ledger_entries WHERE fence IN ({})",
            list(&log.fenced_post_tokens)
        )),
        "0"
    );
    // A claim counts once per admitted claim; the settlement and funding accounts mirror it all.
    for (payout, ok) in log.claims_ok.iter() {
        let attempts: usize = q(&format!(
            "SELECT attempt_count FROM payouts WHERE payout_id = '{payout}'"
        ))
        .parse()
        .unwrap_or(usize::MAX);
        let failed = q(&format!(
            "SELECT state = 'FAILED' FROM payouts WHERE payout_id = '{payout}'"
        )) == "t";
        assert!(
            attempts == *ok || failed,
            "{payout}: {attempts} attempts, {ok} admitted claims"
        );
    }
    assert_eq!(
        q("SELECT balance_minor FROM accounts WHERE account_id = 'funding-EUR'"),
        (-(ACCOUNTS as i64) * 3_000).to_string()
    );
    assert_eq!(
        // The settlement balance is the row's plus its shards' (paydb 0007).
        q(
            "SELECT a.balance_minor + coalesce((SELECT sum(s.balance_minor) FROM account_balance_shards s WHERE s.account_id = a.account_id), 0) FROM accounts a WHERE account_id = 'rail-settlement-EUR'"
        ),
        q("SELECT coalesce(sum(amount_minor), 0) FROM payouts WHERE state = 'POSTED'")
    );
}
