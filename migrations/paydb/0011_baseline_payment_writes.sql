-- paydb baseline, part 3 of 4 (after 0010): the payment resource's writes.

-- =============================================================================================
-- The payment resource's writes. Each runs inside the caller's transaction (together with its
-- idempotency record) and takes its row locks in one order, payout -> customer account ->
-- system account, so two writes never deadlock.
--
-- The ones on the payout path are PL/pgSQL even where one SQL statement would do: a
-- LANGUAGE sql function whose body writes (or reads FROM a table) is not inlined into its
-- caller, and PostgreSQL (before 18) parses and plans such a body again on every call, its plan
-- living only as long as one statement of the caller. PL/pgSQL plans the same statements once
-- per connection and keeps them. The LANGUAGE sql functions here are off that path:
-- pay_balance_shard (inlined), pay_recovery_recorded (evaluated only when a fence is lowered),
-- pay_ensure_system_accounts (a currency's first account), pay_idempotency_sweep and
-- rail_sweep_fenced (background sweeps, one call per batch).
-- =============================================================================================

-- The system accounts of a currency, created with its first customer account.
CREATE FUNCTION pay_ensure_system_accounts(p_currency char(3)) RETURNS void
LANGUAGE sql AS $$
    INSERT INTO accounts (account_id, currency, kind) VALUES
        ('funding-' || p_currency, p_currency, 'funding'),
        ('rail-settlement-' || p_currency, p_currency, 'settlement')
    ON CONFLICT (account_id) DO NOTHING;
$$;

-- outcome: created | exists | conflict
CREATE FUNCTION pay_create_account(p_account_id text, p_currency char(3))
RETURNS TABLE (outcome text, currency char(3))
LANGUAGE plpgsql AS $$
DECLARE
    existing accounts%ROWTYPE;
BEGIN
    INSERT INTO accounts (account_id, currency, kind) VALUES (p_account_id, p_currency, 'customer')
    ON CONFLICT (account_id) DO NOTHING;
    IF FOUND THEN
        PERFORM pay_ensure_system_accounts(p_currency);
        RETURN QUERY SELECT 'created'::text, p_currency;
        RETURN;
    END IF;
    SELECT * INTO existing FROM accounts a WHERE a.account_id = p_account_id;
    IF existing.currency = p_currency AND existing.kind = 'customer' THEN
        RETURN QUERY SELECT 'exists'::text, existing.currency;
    ELSE
        RETURN QUERY SELECT 'conflict'::text, existing.currency;
    END IF;
END $$;

-- outcome: funded | exists | conflict | not_found | not_customer
CREATE FUNCTION pay_fund(p_account_id text, p_amount bigint, p_reference text)
RETURNS TABLE (outcome text, balance_minor bigint)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    acct accounts%ROWTYPE;
    posting text := 'fund:' || p_reference;
    prior ledger_entries%ROWTYPE;
BEGIN
    SELECT * INTO acct FROM accounts a WHERE a.account_id = p_account_id FOR UPDATE;
    IF NOT FOUND THEN
        RETURN QUERY SELECT 'not_found'::text, NULL::bigint;
        RETURN;
    END IF;
    IF acct.kind <> 'customer' THEN
        RETURN QUERY SELECT 'not_customer'::text, acct.balance_minor;
        RETURN;
    END IF;
    SELECT * INTO prior FROM ledger_entries e
     WHERE e.reference = posting AND e.direction = 'CREDIT';
    IF FOUND THEN
        IF prior.account_id = p_account_id AND prior.amount_minor = p_amount THEN
            RETURN QUERY SELECT 'exists'::text, acct.balance_minor;
        ELSE
            RETURN QUERY SELECT 'conflict'::text, acct.balance_minor;
        END IF;
        RETURN;
    END IF;
    INSERT INTO ledger_entries (entry_id, account_id, currency, direction, amount_minor, fence,
                                kind, reference)
    VALUES (gen_random_uuid(), p_account_id, acct.currency, 'CREDIT', p_amount, 0, 'funding', posting),
           (gen_random_uuid(), 'funding-' || acct.currency, acct.currency, 'DEBIT', p_amount, 0,
            'funding', posting);
    RETURN QUERY SELECT 'funded'::text, a.balance_minor FROM accounts a
                  WHERE a.account_id = p_account_id;
END $$;

-- outcome: created | exists | conflict | account_unknown | currency_mismatch
CREATE FUNCTION pay_create_payout(p_payout_id uuid, p_account_id text, p_amount bigint,
                                  p_currency char(3), p_beneficiary_ref text)
RETURNS TABLE (outcome text)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    acct accounts%ROWTYPE;
    existing payouts%ROWTYPE;
BEGIN
    SELECT * INTO existing FROM payouts p WHERE p.payout_id = p_payout_id;
    IF NOT FOUND THEN
        SELECT * INTO acct FROM accounts a WHERE a.account_id = p_account_id;
        IF NOT FOUND OR acct.kind <> 'customer' THEN
            RETURN QUERY SELECT 'account_unknown'::text;
            RETURN;
        END IF;
        IF acct.currency <> p_currency THEN
            RETURN QUERY SELECT 'currency_mismatch'::text;
            RETURN;
        END IF;
        INSERT INTO payouts (payout_id, account_id, currency, amount_minor, beneficiary_ref)
        VALUES (p_payout_id, p_account_id, p_currency, p_amount, p_beneficiary_ref)
        ON CONFLICT (payout_id) DO NOTHING;
        IF FOUND THEN
            RETURN QUERY SELECT 'created'::text;
            RETURN;
        END IF;
        SELECT * INTO existing FROM payouts p WHERE p.payout_id = p_payout_id;
    END IF;
    IF existing.account_id = p_account_id AND existing.amount_minor = p_amount
       AND existing.currency = p_currency AND existing.beneficiary_ref = p_beneficiary_ref THEN
        RETURN QUERY SELECT 'exists'::text;
    ELSE
        RETURN QUERY SELECT 'conflict'::text;
    END IF;
END $$;

-- P2. outcome: claimed | fenced_out | not_claimable | insufficient_funds | not_found
-- `fence` is the account's fence after the call (the stored fence that won, when fenced out).
CREATE FUNCTION pay_claim(p_payout_id uuid, p_token bigint, p_expected_state text)
RETURNS TABLE (outcome text, state text, fence bigint, attempt_count integer,
               claim_token bigint, account_id text, available_minor bigint, amount_minor bigint)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    p payouts%ROWTYPE;
    acct accounts%ROWTYPE;
    available bigint;
BEGIN
    SELECT * INTO p FROM payouts x WHERE x.payout_id = p_payout_id FOR UPDATE;
    IF NOT FOUND THEN
        RETURN QUERY SELECT 'not_found'::text, NULL::text, NULL::bigint, NULL::integer,
                            NULL::bigint, NULL::text, NULL::bigint, NULL::bigint;
        RETURN;
    END IF;
    SELECT * INTO acct FROM accounts a WHERE a.account_id = p.account_id FOR UPDATE;
    -- Strict: a claim admits only a token above every token seen for the account (D-1).
    IF acct.fence >= p_token THEN
        RETURN QUERY SELECT 'fenced_out'::text, p.state, acct.fence, p.attempt_count,
                            p.claim_token, p.account_id, NULL::bigint, p.amount_minor;
        RETURN;
    END IF;
    IF p.state <> p_expected_state OR p_expected_state NOT IN ('PENDING', 'CLAIMED') THEN
        RETURN QUERY SELECT 'not_claimable'::text, p.state, acct.fence, p.attempt_count,
                            p.claim_token, p.account_id, NULL::bigint, p.amount_minor;
        RETURN;
    END IF;
    -- The fence advances whatever the claim decides: the holder's write was admitted.
    UPDATE accounts a SET fence = p_token WHERE a.account_id = p.account_id AND a.fence < p_token;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'fence of % moved under a row lock', p.account_id;
    END IF;
    available := acct.balance_minor - acct.held_minor;
    IF p.state = 'PENDING' AND available < p.amount_minor THEN
        UPDATE payouts x SET state = 'FAILED' WHERE x.payout_id = p_payout_id;
        RETURN QUERY SELECT 'insufficient_funds'::text, 'FAILED'::text, p_token, p.attempt_count,
                            p.claim_token, p.account_id, available, p.amount_minor;
        RETURN;
    END IF;
    -- A re-claim (CLAIMED -> CLAIMED) already holds its amount; the hold is not taken twice.
    UPDATE payouts x SET state = 'CLAIMED', attempt_count = x.attempt_count + 1,
                         claim_token = p_token
     WHERE x.payout_id = p_payout_id AND x.state = p_expected_state;
    RETURN QUERY SELECT 'claimed'::text, 'CLAIMED'::text, p_token, p.attempt_count + 1, p_token,
                        p.account_id, available, p.amount_minor;
END $$;

-- Abandons a payout under a fenced token, as a claim would: strict (`fence < token`), the fence
-- advances, the state must be the expected one. Runs under the payout's and the account's row
-- locks, in the caller's transaction.
-- outcome: abandoned | fenced_out | not_claimable | not_found
CREATE FUNCTION pay_abandon(p_payout_id uuid, p_token bigint, p_expected_state text,
                            p_cause text, p_owner_id text, p_identity text, p_operator text,
                            p_reason text)
RETURNS TABLE (outcome text, state text, fence bigint, attempt_count integer, account_id text)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    p payouts%ROWTYPE;
    acct accounts%ROWTYPE;
BEGIN
    SELECT * INTO p FROM payouts x WHERE x.payout_id = p_payout_id FOR UPDATE;
    IF NOT FOUND THEN
        RETURN QUERY SELECT 'not_found'::text, NULL::text, NULL::bigint, NULL::integer, NULL::text;
        RETURN;
    END IF;
    SELECT * INTO acct FROM accounts a WHERE a.account_id = p.account_id FOR UPDATE;
    IF acct.fence >= p_token THEN
        RETURN QUERY SELECT 'fenced_out'::text, p.state, acct.fence, p.attempt_count, p.account_id;
        RETURN;
    END IF;
    IF p.state <> p_expected_state OR p_expected_state NOT IN ('PENDING', 'CLAIMED') THEN
        RETURN QUERY SELECT 'not_claimable'::text, p.state, acct.fence, p.attempt_count,
                            p.account_id;
        RETURN;
    END IF;
    UPDATE accounts a SET fence = p_token WHERE a.account_id = p.account_id AND a.fence < p_token;
    INSERT INTO payout_abandonments (payout_id, account_id, cause, from_state, attempt_count,
                                     token, owner_id, identity, operator, reason)
    VALUES (p_payout_id, p.account_id, p_cause, p.state, p.attempt_count, p_token, p_owner_id,
            p_identity, p_operator, p_reason);
    -- The hold of a CLAIMED payout is released by the holds trigger.
    UPDATE payouts x SET state = 'ABANDONED'
     WHERE x.payout_id = p_payout_id AND x.state = p_expected_state;
    RETURN QUERY SELECT 'abandoned'::text, 'ABANDONED'::text, p_token, p.attempt_count,
                        p.account_id;
END $$;

-- P2 with a bound on attempts: a claim that finds the payout already claimed p_max_attempts
-- times abandons it instead (same fence and state checks, same row locks), so a payout that
-- keeps losing its holders before it reaches the rail stops being retried. Otherwise exactly
-- pay_claim. outcome: pay_claim's, or abandoned.
CREATE FUNCTION pay_claim_bounded(p_payout_id uuid, p_token bigint, p_expected_state text,
                                  p_max_attempts integer, p_owner_id text)
RETURNS TABLE (outcome text, state text, fence bigint, attempt_count integer,
               claim_token bigint, account_id text, available_minor bigint, amount_minor bigint)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    p payouts%ROWTYPE;
    fence_now bigint;
    gone record;
BEGIN
    SELECT * INTO p FROM payouts x WHERE x.payout_id = p_payout_id FOR UPDATE;
    IF FOUND AND p.state = p_expected_state AND p.attempt_count >= p_max_attempts THEN
        SELECT a.fence INTO fence_now FROM accounts a WHERE a.account_id = p.account_id FOR UPDATE;
        IF fence_now < p_token THEN
            SELECT * INTO gone FROM pay_abandon(
                p_payout_id, p_token, p_expected_state, 'attempts_exhausted', p_owner_id, NULL,
                NULL, format('claimed %s times, the most payment.payout.max-attempts allows',
                             p.attempt_count));
            RETURN QUERY SELECT gone.outcome, gone.state, gone.fence, gone.attempt_count,
                                p.claim_token, p.account_id, NULL::bigint, p.amount_minor;
            RETURN;
        END IF;
    END IF;
    RETURN QUERY SELECT * FROM pay_claim(p_payout_id, p_token, p_expected_state);
END $$;

-- The two rows of a payout posting, inside a fenced post or an operator resolution. On the
-- payout path (every post and every resolution), hence PL/pgSQL.
CREATE FUNCTION pay_write_payout_posting(p payouts, p_fence bigint, p_kind text)
RETURNS void LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO ledger_entries (entry_id, account_id, currency, direction, amount_minor, fence,
                                kind, reference, payout_id)
    VALUES (gen_random_uuid(), p.account_id, p.currency, 'DEBIT', p.amount_minor, p_fence, p_kind,
            'payout:' || p.payout_id, p.payout_id),
           (gen_random_uuid(), 'rail-settlement-' || p.currency, p.currency, 'CREDIT',
            p.amount_minor, p_fence, p_kind, 'payout:' || p.payout_id, p.payout_id);
END $$;

-- P3. outcome: posted | fenced_out | not_claimable | reference_mismatch | not_found
CREATE FUNCTION pay_post(p_payout_id uuid, p_token bigint, p_rail_reference text,
                         p_submission_id uuid)
RETURNS TABLE (outcome text, state text, fence bigint, account_id text, balance_minor bigint)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    p payouts%ROWTYPE;
    acct accounts%ROWTYPE;
BEGIN
    SELECT * INTO p FROM payouts x WHERE x.payout_id = p_payout_id FOR UPDATE;
    IF NOT FOUND THEN
        RETURN QUERY SELECT 'not_found'::text, NULL::text, NULL::bigint, NULL::text, NULL::bigint;
        RETURN;
    END IF;
    SELECT * INTO acct FROM accounts a WHERE a.account_id = p.account_id FOR UPDATE;
    -- The claimer or a later holder may post: fence <= token (D-1).
    IF acct.fence > p_token THEN
        RETURN QUERY SELECT 'fenced_out'::text, p.state, acct.fence, p.account_id,
                            acct.balance_minor;
        RETURN;
    END IF;
    IF p.state <> 'RAIL_ACKED' THEN
        RETURN QUERY SELECT 'not_claimable'::text, p.state, acct.fence, p.account_id,
                            acct.balance_minor;
        RETURN;
    END IF;
    IF (p.rail_reference IS NOT NULL AND p.rail_reference <> p_rail_reference)
       OR (p.submission_id IS NOT NULL AND p.submission_id <> p_submission_id) THEN
        RETURN QUERY SELECT 'reference_mismatch'::text, p.state, acct.fence, p.account_id,
                            acct.balance_minor;
        RETURN;
    END IF;
    UPDATE accounts a SET fence = p_token WHERE a.account_id = p.account_id AND a.fence < p_token;
    -- The hold is released (trigger) before the debit lands, so available never dips below 0.
    UPDATE payouts x SET state = 'POSTED', rail_reference = p_rail_reference,
                         submission_id = p_submission_id
     WHERE x.payout_id = p_payout_id AND x.state = 'RAIL_ACKED';
    PERFORM pay_write_payout_posting(p, p_token, 'payout');
    RETURN QUERY SELECT 'posted'::text, 'POSTED'::text, greatest(acct.fence, p_token), p.account_id,
                        a.balance_minor FROM accounts a WHERE a.account_id = p.account_id;
END $$;

-- Out-of-band resolution of a quarantined payout, attributed (operator and identity).
-- outcome: resolved | not_claimable | not_found
CREATE FUNCTION pay_resolve(p_payout_id uuid, p_outcome text, p_rail_reference text,
                            p_operator text, p_evidence text, p_owner_id text, p_identity text)
RETURNS TABLE (outcome text, state text, account_id text, balance_minor bigint)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    p payouts%ROWTYPE;
BEGIN
    SELECT * INTO p FROM payouts x WHERE x.payout_id = p_payout_id FOR UPDATE;
    IF NOT FOUND THEN
        RETURN QUERY SELECT 'not_found'::text, NULL::text, NULL::text, NULL::bigint;
        RETURN;
    END IF;
    PERFORM 1 FROM accounts a WHERE a.account_id = p.account_id FOR UPDATE;
    IF p.state <> 'RAIL_AMBIGUOUS' THEN
        RETURN QUERY SELECT 'not_claimable'::text, p.state, p.account_id,
                            (SELECT a.balance_minor FROM accounts a WHERE a.account_id = p.account_id);
        RETURN;
    END IF;
    UPDATE payouts x SET state = p_outcome,
                         rail_reference = coalesce(p_rail_reference, x.rail_reference)
     WHERE x.payout_id = p_payout_id AND x.state = 'RAIL_AMBIGUOUS';
    IF p_outcome = 'POSTED' THEN
        PERFORM pay_write_payout_posting(p, p.claim_token, 'resolution');
    END IF;
    INSERT INTO audit_log (action, account_id, payout_id, operator, identity, owner_id, reason,
                           outcome, rail_reference)
    VALUES ('ambiguous_resolved', p.account_id, p_payout_id, p_operator, p_identity, p_owner_id,
            p_evidence, p_outcome, p_rail_reference);
    RETURN QUERY SELECT 'resolved'::text, p_outcome, p.account_id, a.balance_minor
                   FROM accounts a WHERE a.account_id = p.account_id;
END $$;

-- D-3: raises an account's fence to a revocation floor, attributed (operator and identity).
-- outcome: advanced | not_found
CREATE FUNCTION pay_advance_fence(p_account_id text, p_floor bigint, p_operator text,
                                  p_reason text, p_revocation_id uuid, p_owner_id text,
                                  p_identity text)
RETURNS TABLE (outcome text, previous_fence bigint, fence bigint)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    acct accounts%ROWTYPE;
    advanced bigint;
BEGIN
    SELECT * INTO acct FROM accounts a WHERE a.account_id = p_account_id FOR UPDATE;
    IF NOT FOUND THEN
        RETURN QUERY SELECT 'not_found'::text, NULL::bigint, NULL::bigint;
        RETURN;
    END IF;
    advanced := greatest(acct.fence, p_floor);
    UPDATE accounts a SET fence = advanced WHERE a.account_id = p_account_id;
    INSERT INTO audit_log (action, account_id, operator, identity, owner_id, reason,
                           revocation_id, previous_fence, new_fence)
    VALUES ('fence_advanced', p_account_id, p_operator, p_identity, p_owner_id, p_reason,
            p_revocation_id, acct.fence, advanced);
    RETURN QUERY SELECT 'advanced'::text, acct.fence, advanced;
END $$;

-- D-8: the payment resource's recovery of a poisoned fence. outcome: lowered | unchanged (the
-- fence is already at or below p_to: nothing to do, nothing recorded) | not_found.
CREATE FUNCTION pay_lower_fence(p_account text, p_to bigint, p_operator text, p_identity text,
                                p_owner text, p_reason text)
RETURNS TABLE (outcome text, previous_fence bigint, fence bigint, recovery_id bigint)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    acct accounts%ROWTYPE;
    v_id bigint;
BEGIN
    SELECT * INTO acct FROM accounts a WHERE a.account_id = p_account FOR UPDATE;
    IF NOT FOUND THEN
        RETURN QUERY SELECT 'not_found'::text, NULL::bigint, NULL::bigint, NULL::bigint;
        RETURN;
    END IF;
    IF acct.fence <= p_to THEN
        RETURN QUERY SELECT 'unchanged'::text, acct.fence, acct.fence, NULL::bigint;
        RETURN;
    END IF;
    INSERT INTO fence_recoveries (resource, account_id, previous_token, new_token, operator,
                                  identity, owner_id, reason)
    VALUES ('account', p_account, acct.fence, p_to, p_operator, p_identity, p_owner, p_reason)
    RETURNING fence_recoveries.recovery_id INTO v_id;
    UPDATE accounts a SET fence = p_to WHERE a.account_id = p_account;
    RETURN QUERY SELECT 'lowered'::text, acct.fence, p_to, v_id;
END $$;
