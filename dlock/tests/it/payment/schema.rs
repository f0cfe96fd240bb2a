//! The database refuses what no code path may do, whichever code path tries: these go around
//! the service, straight to paydb.

use super::PayStack;

fn refused(stack: &PayStack, what: &str, sql: &str) {
    let result = stack.pg().psql("paydb", sql);
    assert!(result.is_err(), "{what}: paydb accepted `{sql}`");
}

#[tokio::test]
async fn paydb_guards_transitions_fences_holds_and_the_ledger() {
    let stack = PayStack::funded("acct-g", 100).await;
    let payout = stack.payout("acct-g", 60, "EUR").await;
    let other = stack.payout("acct-g", 60, "EUR").await;
    let p = format!("'{payout}'");

    refused(
        &stack,
        "skip to POSTED",
        &format!("UPDATE payouts SET state = 'POSTED', rail_reference = 'x' WHERE payout_id = {p}"),
    );
    refused(
        &stack,
        "claim without a token",
        &format!("UPDATE payouts SET state = 'CLAIMED', attempt_count = 1 WHERE payout_id = {p}"),
    );
    refused(
        &stack,
        "claim without counting",
        &format!("UPDATE payouts SET state = 'CLAIMED', claim_token = 5 WHERE payout_id = {p}"),
    );
    refused(
        &stack,
        "change the amount",
        &format!("UPDATE payouts SET amount_minor = 1 WHERE payout_id = {p}"),
    );
    refused(
        &stack,
        "create half-way",
        "INSERT INTO payouts (payout_id, account_id, currency, amount_minor, beneficiary_ref, state, claim_token) VALUES (gen_random_uuid(), 'acct-g', 'EUR', 5, 'b', 'CLAIMED', 9)",
    );
    refused(
        &stack,
        "pay from a system account",
        "INSERT INTO payouts (payout_id, account_id, currency, amount_minor, beneficiary_ref) VALUES (gen_random_uuid(), 'funding-EUR', 'EUR', 5, 'b')",
    );
    refused(
        &stack,
        "pay in another currency",
        "INSERT INTO payouts (payout_id, account_id, currency, amount_minor, beneficiary_ref) VALUES (gen_random_uuid(), 'acct-g', 'USD', 5, 'b')",
    );
    refused(
        &stack,
        "zero amount",
        "INSERT INTO payouts (payout_id, account_id, currency, amount_minor, beneficiary_ref) VALUES (gen_random_uuid(), 'acct-g', 'EUR', 0, 'b')",
    );
    refused(
        &stack,
        "unknown currency",
        "INSERT INTO accounts (account_id, currency) VALUES ('acct-x', 'ABC')",
    );

    // The legal path works in SQL too, and the hold follows the state.
    stack.psql(&format!("UPDATE payouts SET state = 'CLAIMED', attempt_count = 1, claim_token = 5 WHERE payout_id = {p}"));
    assert_eq!(
        stack.psql("SELECT held_minor FROM accounts WHERE account_id = 'acct-g'"),
        "60"
    );
    refused(
        &stack,
        "re-claim with an older token",
        &format!(
            "UPDATE payouts SET state = 'CLAIMED', attempt_count = 2, claim_token = 4 WHERE payout_id = {p}"
        ),
    );
    // A second hold of 60 on a balance of 100 would leave available < 0.
    refused(
        &stack,
        "over-hold",
        &format!(
            "UPDATE payouts SET state = 'CLAIMED', attempt_count = 1, claim_token = 6 WHERE payout_id = '{other}'"
        ),
    );

    stack.psql("UPDATE accounts SET fence = 10 WHERE account_id = 'acct-g'");
    refused(
        &stack,
        "lower a fence",
        "UPDATE accounts SET fence = 9 WHERE account_id = 'acct-g'",
    );
    refused(
        &stack,
        "edit the ledger",
        "UPDATE ledger_entries SET amount_minor = 1",
    );
    refused(
        &stack,
        "delete from the ledger",
        "DELETE FROM ledger_entries",
    );
    refused(
        &stack,
        "an unbalanced posting",
        "INSERT INTO ledger_entries (entry_id, account_id, currency, direction, amount_minor, fence, kind, reference) VALUES (gen_random_uuid(), 'acct-g', 'EUR', 'CREDIT', 5, 0, 'funding', 'fund:lonely')",
    );
    refused(
        &stack,
        "the same posting twice",
        "INSERT INTO ledger_entries (entry_id, account_id, currency, direction, amount_minor, fence, kind, reference) SELECT gen_random_uuid(), account_id, currency, direction, amount_minor, fence, kind, reference FROM ledger_entries",
    );
    refused(
        &stack,
        "a customer below zero",
        "BEGIN; INSERT INTO ledger_entries (entry_id, account_id, currency, direction, amount_minor, fence, kind, reference) VALUES (gen_random_uuid(), 'acct-g', 'EUR', 'DEBIT', 500, 0, 'funding', 'fund:overdraw'), (gen_random_uuid(), 'funding-EUR', 'EUR', 'CREDIT', 500, 0, 'funding', 'fund:overdraw'); COMMIT;",
    );
    refused(
        &stack,
        "two live submissions",
        &format!(
            "INSERT INTO rail_submission (submission_id, payout_id, account_id, presented_token, idempotency_key) VALUES \
         (gen_random_uuid(), {p}, 'acct-g', 5, 'k'), (gen_random_uuid(), {p}, 'acct-g', 6, 'k')"
        ),
    );
    // A FENCED attempt does not block the legitimate one (docs/design.md#d-2).
    stack.psql(&format!(
        "INSERT INTO rail_submission (submission_id, payout_id, account_id, presented_token, idempotency_key, outcome, resolved_at) VALUES \
         (gen_random_uuid(), {p}, 'acct-g', 4, 'k', 'FENCED', clock_timestamp()), (gen_random_uuid(), {p}, 'acct-g', 5, 'k', 'unresolved', NULL)"
    ));
    refused(&stack, "rewrite the audit", "DELETE FROM audit_log");
    assert_eq!(
        stack.psql("SELECT balance_minor, held_minor FROM accounts WHERE account_id = 'acct-g'"),
        "100|60"
    );
}

/// A payout's id names its account for good: the payment resource keeps the account it proves a
/// payout's writes against (migrations/paydb/0038_baseline_guards.sql), so paydb never lets a
/// payout go, even one nothing else refers to yet.
#[tokio::test]
async fn a_payout_is_never_deleted() {
    let stack = PayStack::funded("acct-k", 100).await;
    let payout = stack.payout("acct-k", 60, "EUR").await;
    let count = format!("SELECT count(*) FROM payouts WHERE payout_id = '{payout}'");
    // The statement would match the payout: it is there, PENDING, with nothing pointing at it.
    assert_eq!(stack.psql(&count), "1");
    assert_eq!(
        stack.psql(&format!(
            "SELECT count(*) FROM rail_submission WHERE payout_id = '{payout}'"
        )),
        "0"
    );
    refused(
        &stack,
        "delete a payout",
        &format!("DELETE FROM payouts WHERE payout_id = '{payout}'"),
    );
    refused(&stack, "delete every payout", "DELETE FROM payouts");
    assert_eq!(stack.psql(&count), "1", "the payout is still there");
}
