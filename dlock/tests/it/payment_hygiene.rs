//! Tests of the payment resource's and the rail proxy's audit identity, envelope gaps, retention
//! and ABANDONED.
//!
//! The payment resource runs in this process on a real port against real PostgreSQL
//! (`payment::PayStack`); the rail proxy against the real stub over HTTP (`rail::RailWorld`),
//! as a real `dlock serve rail-proxy` process where its own sweeper is the point.

use std::time::Duration;

use reqwest::Method;
use serde_json::{Value, json};
use uuid::Uuid;

use crate::conformance::assert_envelope;
use crate::harness::{eventually, port, post_json};
use crate::payment::{OPERATOR_TOKEN, PayStack};
use crate::rail::{RailWorld, submit};

/// The identity the payment resource's operator token authenticates as.
const OPERATOR_IDENTITY: &str = dlock_server::auth::DEFAULT_OPERATOR_IDENTITY;

/// paydb's answer to `select`, a `SELECT count(*)` with `params` bound to `$1`….
async fn count(pool: &sqlx::PgPool, select: &'static str, params: &[&str]) -> i64 {
    let query = params
        .iter()
        .fold(sqlx::query_as(select), |query, param| query.bind(*param));
    let (n,): (i64,) = query
        .fetch_one(pool)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    n
}

/// Asserts that paydb refused a statement with an error that says `says`; `what` names the
/// statement.
fn refused<T>(result: Result<T, sqlx::Error>, says: &str, what: &str) {
    assert!(
        result.is_err_and(|e| e.to_string().contains(says)),
        "{what}"
    );
}

/// Runs `statement` on `pool` with `payout` as its one parameter; paydb must refuse it, saying
/// `says`.
async fn refused_for(
    pool: &sqlx::PgPool,
    statement: &'static str,
    payout: Uuid,
    says: &str,
    what: &str,
) {
    let result = sqlx::query(statement).bind(payout).execute(pool).await;
    refused(result, says, what);
}

// ---------------------------------------------------------------------------------------------
// The idempotency sweeper racing a duplicate; an in-progress record is not NOT_LEADER
// ---------------------------------------------------------------------------------------------

/// The race, made to happen every time: the duplicate's `INSERT ... ON CONFLICT DO NOTHING` sees
/// the stored record, then (held there by a statement trigger on an advisory lock this test
/// owns) the record expires and the service's own sweeper deletes it, then the duplicate goes on
/// to read the record it conflicted with. Before the fix that read found nothing and the answer
/// was a 500; now the request runs fresh and answers as the first one did.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_sweeper_deleting_a_record_under_a_duplicate_gives_a_clean_answer() {
    let stack = PayStack::start_with(&[("payment.idempotency.sweep-interval-ms", "10")]).await;
    stack.account("acct-race", "EUR").await;
    let payout = Uuid::new_v4();
    let key = format!("create-{payout}");
    let body = json!({
        "payoutId": payout, "accountId": "acct-race", "amountMinor": 100,
        "currency": "EUR", "beneficiaryRef": "ben-race",
    });
    let first = stack.write("/v1/payouts", &key, None, &body).await;
    first.expect("create", 201, None);

    // A pause point between begin's insert and its read, owned by this test.
    stack.psql(
        "CREATE FUNCTION test_pause_after_insert() RETURNS trigger LANGUAGE plpgsql AS $$ \
         BEGIN PERFORM pg_advisory_xact_lock_shared(4242); RETURN NULL; END $$; \
         CREATE TRIGGER test_pause_after_insert AFTER INSERT ON idempotency_records \
         FOR EACH STATEMENT EXECUTE FUNCTION test_pause_after_insert();",
    );
    let mut gate = stack.pool.acquire().await.unwrap_or_else(|e| panic!("{e}"));
    sqlx::query("SELECT pg_advisory_lock(4242)")
        .execute(&mut *gate)
        .await
        .unwrap_or_else(|e| panic!("{e}"));

    let duplicate = tokio::spawn({
        let (url, key, body) = (stack.url.clone(), key.clone(), body.clone());
        async move {
            post_json(
                &format!("{url}/v1/payouts"),
                &[("x-owner-id", "worker-1"), ("x-idempotency-key", &key)],
                &body,
            )
            .await
        }
    });
    // The duplicate has conflicted with the live record and waits at the pause point.
    eventually(
        "the duplicate waits between its insert and its read",
        Duration::from_secs(10),
        || async {
            let select =
                "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted";
            (count(&stack.pool, select, &[]).await == 1).then_some(())
        },
    )
    .await;
    assert_eq!(
        stack.psql(&format!(
            "SELECT count(*) FROM idempotency_records WHERE idempotency_key = '{key}'"
        )),
        "1",
        "the record was there when the duplicate conflicted with it"
    );
    // The record expires, and the service's sweeper (every 10 ms) deletes it.
    stack.psql(&format!(
        "UPDATE idempotency_records SET first_seen_at = now() - interval '2 hours', \
         expires_at = now() - interval '1 hour' WHERE idempotency_key = '{key}'"
    ));
    eventually(
        "the sweeper deletes the record",
        Duration::from_secs(10),
        || async {
            let select = "SELECT count(*) FROM idempotency_records WHERE idempotency_key = $1";
            (count(&stack.pool, select, &[&key]).await == 0).then_some(())
        },
    )
    .await;
    sqlx::query("SELECT pg_advisory_unlock(4242)")
        .execute(&mut *gate)
        .await
        .unwrap_or_else(|e| panic!("{e}"));

    let (status, content_type, answer) = duplicate.await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(status, 201, "the duplicate ran fresh: {answer}");
    assert_eq!(content_type, crate::payment::JSON_TYPE);
    assert_eq!(answer["payoutId"], payout.to_string());
    assert_eq!(answer["state"], "PENDING");
    assert_eq!(
        stack.psql(&format!(
            "SELECT count(*), min(status) FROM idempotency_records WHERE idempotency_key = '{key}'"
        )),
        "1|succeeded",
        "the fresh run stored its answer"
    );
    assert_eq!(
        stack.psql("SELECT count(*) FROM payouts WHERE account_id = 'acct-race'"),
        "1"
    );
}

// ---------------------------------------------------------------------------------------------
// ABANDONED
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn a_payout_out_of_attempts_is_abandoned_by_the_claim_that_finds_it_so() {
    let (stack, payout) =
        PayStack::with_payout(&[("payment.payout.max-attempts", "2")], "acct-a").await;
    let (t0, t1, t2, t3) = (stack.token(), stack.token(), stack.token(), stack.token());
    // Positive control: claims up to the bound are claims.
    let c1 = stack.claim(payout, t1, "PENDING").await;
    assert_eq!(c1.expect("first claim", 200, None)["attemptCount"], 1);
    let c2 = stack.claim(payout, t2, "CLAIMED").await;
    assert_eq!(c2.expect("re-claim", 200, None)["attemptCount"], 2);
    assert_eq!(
        stack.psql("SELECT held_minor FROM accounts WHERE account_id = 'acct-a'"),
        "100"
    );
    // The third is refused and the payout is ABANDONED, its hold released, its fence advanced.
    let c3 = stack.claim(payout, t3, "CLAIMED").await;
    let body = c3.expect("out of attempts", 409, Some("PAYOUT_NOT_CLAIMABLE"));
    assert_eq!(body["details"]["state"], "ABANDONED", "{body}");
    assert_eq!(body["details"]["cause"], "attempts_exhausted");
    assert_eq!(body["retrySafe"], false);
    assert_eq!(stack.state_of(payout).await, "ABANDONED");
    assert_eq!(
        stack.psql("SELECT held_minor, fence FROM accounts WHERE account_id = 'acct-a'"),
        format!("0|{t3}")
    );
    assert_eq!(
        stack.psql(&format!(
            "SELECT cause, from_state, attempt_count, token, owner_id FROM payout_abandonments \
             WHERE payout_id = '{payout}'"
        )),
        format!("attempts_exhausted|CLAIMED|2|{t3}|worker-1")
    );
    // The identical request replays its answer; any later claim finds it terminal.
    let again = stack.claim(payout, t3, "CLAIMED").await;
    again.replays("out of attempts again", &c3);
    stack.not_claimable("terminal", payout, "CLAIMED").await;
    // A stale holder is fenced out, never told it abandoned anything.
    stack
        .claim(payout, t0, "CLAIMED")
        .await
        .expect("stale", 409, Some("FENCED_OUT"));
}

#[tokio::test]
async fn the_database_refuses_an_abandonment_without_its_record_or_after_the_rail() {
    let (stack, pending) = PayStack::with_payout(&[], "acct-g").await;
    refused_for(
        &stack.pool,
        "UPDATE payouts SET state = 'ABANDONED' WHERE payout_id = $1",
        pending,
        "payout_abandonments",
        "an abandonment without its record",
    )
    .await;
    // A payout whose attempt reached the rail proxy can never be abandoned, record or not.
    let submitted = stack.payout("acct-g", 100, "EUR").await;
    let token = stack.claimed(submitted).await;
    sqlx::query(
        "INSERT INTO rail_submission (submission_id, payout_id, account_id, presented_token, \
         idempotency_key) VALUES ($1, $2, 'acct-g', $3, 'k')",
    )
    .bind(Uuid::new_v4())
    .bind(submitted)
    .bind(token)
    .execute(&stack.pool)
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    let mut tx = stack.pool.begin().await.unwrap_or_else(|e| panic!("{e}"));
    let abandon: Result<(String,), _> = sqlx::query_as(
        "SELECT outcome FROM pay_abandon($1, $2, 'CLAIMED', 'cancelled', 'w', 'operator', \
         'alice', 'batch deleted by its owner')",
    )
    .bind(submitted)
    .bind(stack.token())
    .fetch_one(&mut *tx)
    .await;
    refused(
        abandon,
        "attempt at the rail",
        "abandoning a payout with an attempt at the rail",
    );
    drop(tx);
    assert_eq!(stack.state_of(submitted).await, "CLAIMED");
    assert_eq!(stack.state_of(pending).await, "PENDING");
}

#[tokio::test]
async fn an_operator_cancels_a_payout_under_a_fenced_token() {
    let (stack, payout) = PayStack::with_payout(&[], "acct-x").await;
    let path = format!("/v1/payouts/{payout}/cancel");
    let body = json!({
        "expectedState": "PENDING", "operator": "alice", "reason": "batch deleted by its owner",
    })
    .to_string();
    let headers = |token: i64, key: &str, auth: bool| {
        let mut h = vec![
            ("x-owner-id", "operator-cli".to_owned()),
            ("x-idempotency-key", key.to_owned()),
            ("x-fencing-token", token.to_string()),
        ];
        if auth {
            h.push(("authorization", format!("Bearer {OPERATOR_TOKEN}")));
        }
        h
    };
    // Not an operator: refused, nothing changes.
    stack
        .send(
            Method::POST,
            &path,
            &headers(stack.token(), "c-1", false),
            Some(&body),
        )
        .await
        .expect("no credential", 401, Some("UNAUTHENTICATED"));
    // Bad input: the envelope, nothing changes.
    let bad = json!({ "expectedState": "POSTED", "operator": "", "reason": "short" }).to_string();
    let answer = stack
        .send(
            Method::POST,
            &path,
            &headers(stack.token(), "c-2", true),
            Some(&bad),
        )
        .await;
    answer.expect("bad body", 400, Some("VALIDATION_FAILED"));
    let mut fields = answer.fields();
    fields.sort();
    assert_eq!(fields, ["expectedState", "operator", "reason"]);
    assert_eq!(stack.state_of(payout).await, "PENDING");

    let token = stack.token();
    // The cancel, and later its identical retry.
    let cancel_headers = headers(token, "c-3", true);
    let cancel = || stack.send(Method::POST, &path, &cancel_headers, Some(&body));
    let done = cancel().await;
    let d = done.expect("cancel", 200, None);
    assert_eq!(d["state"], "ABANDONED");
    assert_eq!(d["accountFence"], token);
    assert_eq!(d["identity"], OPERATOR_IDENTITY);
    assert_eq!(stack.state_of(payout).await, "ABANDONED");
    assert_eq!(
        stack.psql(&format!(
            "SELECT cause, from_state, operator, identity, owner_id FROM payout_abandonments \
             WHERE payout_id = '{payout}'"
        )),
        format!("cancelled|PENDING|alice|{OPERATOR_IDENTITY}|operator-cli")
    );
    cancel().await.replays("cancel again", &done);
    // A token at or below the fence cannot cancel anything.
    let other = stack.payout("acct-x", 100, "EUR").await;
    stack
        .send(
            Method::POST,
            &format!("/v1/payouts/{other}/cancel"),
            &headers(token, "c-4", true),
            Some(&body),
        )
        .await
        .expect("stale token", 409, Some("FENCED_OUT"));
    // A payout past the rail proxy is not cancellable: the state says so.
    let claimed = stack.payout("acct-x", 100, "EUR").await;
    stack.claimed(claimed).await;
    stack.rail_ack(claimed).await;
    let claimed_body = json!({
        "expectedState": "CLAIMED", "operator": "alice", "reason": "batch deleted by its owner",
    })
    .to_string();
    let refused = stack
        .send(
            Method::POST,
            &format!("/v1/payouts/{claimed}/cancel"),
            &headers(stack.token(), "c-5", true),
            Some(&claimed_body),
        )
        .await;
    let r = refused.expect("acked payout", 409, Some("PAYOUT_NOT_CLAIMABLE"));
    assert_eq!(r["details"]["state"], "RAIL_ACKED");
    assert_eq!(stack.state_of(claimed).await, "RAIL_ACKED");
}

// ---------------------------------------------------------------------------------------------
// The authenticated identity beside the typed-in operator
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn fence_advances_and_resolutions_record_the_authenticated_identity() {
    let stack = PayStack::funded("acct-i", 1_000).await;
    let floor = stack.token();
    let advance = json!({
        "floor": floor, "operator": "somebody-typed-this", "reason": "worker wedged past its lease",
        "revocationId": Uuid::new_v4(),
    });
    let a = stack
        .operator_write("/v1/accounts/acct-i/fence", "rev-1", &advance)
        .await;
    let a = a.expect("advance", 200, None);
    assert_eq!(a["operator"], "somebody-typed-this");
    assert_eq!(a["identity"], OPERATOR_IDENTITY);

    let payout = stack.payout("acct-i", 100, "EUR").await;
    stack.claimed(payout).await;
    stack.make_ambiguous(payout);
    let resolve =
        json!({ "outcome": "FAILED", "operator": "bob", "evidence": "not on the statement" });
    let r = stack
        .operator_write(&format!("/v1/payouts/{payout}/resolve"), "res-1", &resolve)
        .await;
    let r = r.expect("resolve", 200, None);
    assert_eq!(r["state"], "FAILED");
    assert_eq!(r["identity"], OPERATOR_IDENTITY);
    assert_eq!(
        stack.psql(
            "SELECT string_agg(action || ':' || operator || ':' || identity, ',' ORDER BY audit_id) \
             FROM audit_log"
        ),
        format!(
            "fence_advanced:somebody-typed-this:{OPERATOR_IDENTITY},ambiguous_resolved:bob:{OPERATOR_IDENTITY}"
        )
    );
    // The database keeps it that way: an audit row without an identity is refused.
    let refused = sqlx::query(
        "INSERT INTO audit_log (action, account_id, operator, owner_id, reason, previous_fence, \
         new_fence) VALUES ('fence_advanced', 'acct-i', 'x', 'y', 'no identity', 0, 0)",
    )
    .execute(&stack.pool)
    .await;
    assert!(refused.is_err(), "an unattributed audit row");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_rail_high_water_advance_records_the_authenticated_identity() {
    let (w, _, proxy) = RailWorld::with_proxy("acct-h").await;
    let (status, _, body) = post_json(
        &format!("{proxy}/v1/rail/high-water/acct-h"),
        &[
            ("x-owner-id", "ops-cli"),
            ("authorization", "Bearer test-operator"),
        ],
        &json!({"floor": 9, "operator": "typed-name", "reason": "worker wedged past its lease"}),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["identity"], OPERATOR_IDENTITY);
    assert_eq!(body["operator"], "typed-name");
    let (operator, identity, owner): (String, Option<String>, String) = sqlx::query_as(
        "SELECT operator, identity, owner_id FROM rail_fence_advances WHERE account_id = 'acct-h'",
    )
    .fetch_one(&w.pool)
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        (operator.as_str(), identity.as_deref(), owner.as_str()),
        ("typed-name", Some(OPERATOR_IDENTITY), "ops-cli")
    );
}

// ---------------------------------------------------------------------------------------------
// RAIL_AMBIGUOUS names no internal address
// ---------------------------------------------------------------------------------------------

fn assert_names_no_address(what: &str, body: &Value, addresses: &[&str]) {
    let text = body.to_string();
    for address in addresses {
        assert!(!text.contains(address), "{what} shows {address}: {text}");
    }
    assert!(
        !text.contains("127.0.0.1"),
        "{what} shows an address: {text}"
    );
    assert!(!text.contains("http://"), "{what} shows a URL: {text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn rail_ambiguous_answers_name_no_rail_address_and_say_to_reconcile() {
    let mut w = RailWorld::new().await;
    let slow = w.stub("slow", &[("rail.stub.latency-ms", "1500")]).await;
    let timing_out = w
        .proxy(&slow, &[("rail.proxy.read-timeout-ms", "200")])
        .await;
    // A rail that is not there at all: a port nobody listens on.
    let gone = format!("http://127.0.0.1:{}", port());
    let refused = w.proxy(&gone, &[]).await;
    w.account("acct-l", 100_000).await;

    let (p1, status, body) = w.submit_claimed(&timing_out, "acct-l", 1_000, 10).await;
    assert_eq!(status, 409, "{body}");
    assert_envelope("timeout", status, &body, "RAIL_AMBIGUOUS");
    assert_names_no_address("the timeout answer", &body, &[slow.as_str()]);
    assert!(
        body["message"]
            .as_str()
            .is_some_and(|m| m.contains("reconcile")),
        "{body}"
    );
    assert_eq!(
        body["details"]["reason"],
        "the rail did not answer within the read timeout"
    );
    assert_eq!(w.state(p1).await, "RAIL_AMBIGUOUS");

    let (p2, status, body) = w.submit_claimed(&refused, "acct-l", 1_000, 20).await;
    assert_eq!(status, 409, "{body}");
    assert_envelope("refused", status, &body, "RAIL_AMBIGUOUS");
    assert_names_no_address("the refused-connection answer", &body, &[gone.as_str()]);
    assert_eq!(
        body["details"]["reason"],
        "the connection to the rail failed"
    );
    // The replay is the same answer, byte for byte, and names nothing either.
    let (status, again) = submit(&refused, "acct-l", p2, 1_000, "20").await;
    assert_eq!((status, &again), (409, &body));
}

// ---------------------------------------------------------------------------------------------
// FENCED attempts have a retention
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn fenced_attempts_are_swept_after_their_retention_and_nothing_else_is() {
    let (w, stub) = RailWorld::with_stub("stub", &[]).await;
    let proxy_port = port();
    let _proxy = w.proxy_process(
        proxy_port,
        &stub,
        &[
            ("rail.proxy.fenced-retention-ms", "1000"),
            ("rail.proxy.sweep-interval-ms", "50"),
        ],
    );
    let proxy = format!("http://127.0.0.1:{proxy_port}");
    w.account("acct-f", 100_000).await;
    let (acked, status, body) = w.submit_claimed(&proxy, "acct-f", 1_000, 10).await;
    assert_eq!(status, 200, "{body}");
    // A stale writer below the high-water mark: FENCED, recorded.
    let other = w.claimed("acct-f", 1_000, 20).await;
    let (status, body) = submit(&proxy, "acct-f", other, 1_000, "5").await;
    assert_eq!(status, 409, "{body}");
    assert_envelope("stale", status, &body, "FENCED_OUT");
    assert_eq!(w.submissions(other).await, vec![("FENCED".to_owned(), 5)]);

    eventually(
        "the FENCED row is swept after its retention",
        Duration::from_secs(20),
        || async { w.submissions(other).await.is_empty().then_some(()) },
    )
    .await;
    // The one presented attempt of a payout is never swept, and paydb refuses to delete it.
    assert_eq!(w.submissions(acked).await, vec![("ACKED".to_owned(), 10)]);
    refused_for(
        &w.pool,
        "DELETE FROM rail_submission WHERE payout_id = $1",
        acked,
        "only FENCED rows",
        "deleting a presented attempt",
    )
    .await;
    assert_eq!(w.submissions(acked).await, vec![("ACKED".to_owned(), 10)]);
    // The legitimate holder of the payout whose stale attempt was swept still submits once.
    let (status, body) = submit(&proxy, "acct-f", other, 1_000, "20").await;
    assert_eq!(status, 200, "{body}");
}
