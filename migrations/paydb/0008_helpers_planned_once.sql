-- Issue 14: two SQL functions on the payout path were parsed and planned on every call.
--
-- A LANGUAGE sql function whose body writes (or reads FROM a table) is not inlined into its
-- caller, and PostgreSQL (before 18) parses and plans such a body again on every call: its plan
-- lives in the calling expression's state, which lasts one statement of the caller. In PL/pgSQL
-- the same statements are planned once per connection and the plans are kept (lockdb 0006 did
-- the same for the lock server).
--
-- pay_write_payout_posting: every post (pay_post) and every resolution (pay_resolve).
-- rail_store_answer: every attempt the rail proxy answers, called as a statement of its own.
--
-- Same arguments, same result, same statements, same volatility (VOLATILE) and security
-- (INVOKER), so every caller is unchanged. Left as they are, because they are off the payout
-- path: pay_balance_shard (IMMUTABLE, one expression without FROM: inlined into the ledger
-- trigger's INSERT), pay_recovery_recorded (evaluated only when a fence is lowered),
-- pay_ensure_system_accounts (a currency's first account), pay_idempotency_sweep and
-- rail_sweep_fenced (background sweeps, one call per batch).

CREATE OR REPLACE FUNCTION pay_write_payout_posting(p payouts, p_fence bigint, p_kind text)
RETURNS void LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO ledger_entries (entry_id, account_id, currency, direction, amount_minor, fence,
                                kind, reference, payout_id)
    VALUES (gen_random_uuid(), p.account_id, p.currency, 'DEBIT', p.amount_minor, p_fence, p_kind,
            'payout:' || p.payout_id, p.payout_id),
           (gen_random_uuid(), 'rail-settlement-' || p.currency, p.currency, 'CREDIT',
            p.amount_minor, p_fence, p_kind, 'payout:' || p.payout_id, p.payout_id);
END $$;

CREATE OR REPLACE FUNCTION rail_store_answer(p_submission uuid, p_outcome text, p_status smallint,
                                             p_body bytea)
RETURNS boolean LANGUAGE plpgsql AS $$
DECLARE
    was_stored boolean;
BEGIN
    -- A data-modifying WITH must be a statement's top level, so the answer goes through INTO.
    WITH stored AS (
        UPDATE rail_submission r SET response_status = p_status, response_body = p_body
        WHERE r.submission_id = p_submission AND r.outcome = p_outcome
          AND r.response_status IS NULL
        RETURNING 1
    )
    SELECT EXISTS (SELECT 1 FROM stored) INTO was_stored;
    RETURN was_stored;
END $$;
