-- paydb baseline, part 3 of 4 (after 0038): the payment resource's writes.

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
--
-- The fenced writes (claim, cancel, post) take p_proven: whether the payment resource verified
-- the token's proof (with proof keys configured, every fenced write is proven before it reaches
-- here). A proven write that passes the fence raises accounts.max_seen_token with it. It
-- defaults to false, so a caller that does not pass it (a psql session) records nothing and is
-- otherwise served the same.
-- =============================================================================================

-- The system accounts of a currency, created with its first customer account. Without a
-- conflict target, because every unique constraint of accounts must arbitrate: with
-- ON CONFLICT (account_id) the insert was still checked against (account_id, currency) and
-- (account_id, currency, kind), and when two transactions opened the first two customer
-- accounts of a currency at once the second one's insert of the same system accounts raised a
-- unique violation (an open answered 500) instead of doing nothing. pay_create_account's own
-- insert has the same shape (two opens of one new id at once), and no conflict target either.
CREATE FUNCTION pay_ensure_system_accounts(p_currency char(3)) RETURNS void
LANGUAGE sql AS $$
    INSERT INTO accounts (account_id, currency, kind) VALUES
        ('funding-' || p_currency, p_currency, 'funding'),
        ('rail-settlement-' || p_currency, p_currency, 'settlement')
    ON CONFLICT DO NOTHING;
$$;

-- outcome: created | exists | conflict
CREATE FUNCTION pay_create_account(p_account_id text, p_currency char(3))
RETURNS TABLE (outcome text, currency char(3))
LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan SET enable_seqscan = off SET jit = off AS $$
DECLARE
    existing accounts%ROWTYPE;
BEGIN
    INSERT INTO accounts (account_id, currency, kind) VALUES (p_account_id, p_currency, 'customer')
    ON CONFLICT DO NOTHING;
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
LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan SET enable_seqscan = off SET jit = off AS $$
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
LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan SET enable_seqscan = off SET jit = off AS $$
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
CREATE FUNCTION pay_claim(p_payout_id uuid, p_token bigint, p_expected_state text,
                          p_proven boolean DEFAULT false)
RETURNS TABLE (outcome text, state text, fence bigint, attempt_count integer,
               claim_token bigint, account_id text, available_minor bigint, amount_minor bigint)
LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan SET enable_seqscan = off SET jit = off AS $$
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
    -- Strict: a claim admits only a token above every token seen for the account
    -- (docs/design.md#d-1).
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
    UPDATE accounts a SET fence = p_token,
                          max_seen_token = CASE WHEN p_proven THEN p_token
                                                ELSE a.max_seen_token END
     WHERE a.account_id = p.account_id AND a.fence < p_token;
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
                            p_cause text, p_owner_id text, p_identity text,
                            p_operator text, p_reason text,
                            p_proven boolean DEFAULT false)
RETURNS TABLE (outcome text, state text, fence bigint, attempt_count integer, account_id text)
LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan SET enable_seqscan = off SET jit = off AS $$
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
    UPDATE accounts a SET fence = p_token,
                          max_seen_token = CASE WHEN p_proven THEN p_token
                                                ELSE a.max_seen_token END
     WHERE a.account_id = p.account_id AND a.fence < p_token;
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
CREATE FUNCTION pay_claim_bounded(p_payout_id uuid, p_token bigint,
                                  p_expected_state text, p_max_attempts integer,
                                  p_owner_id text, p_proven boolean DEFAULT false)
RETURNS TABLE (outcome text, state text, fence bigint, attempt_count integer,
               claim_token bigint, account_id text, available_minor bigint, amount_minor bigint)
LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan SET enable_seqscan = off SET jit = off AS $$
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
                             p.attempt_count), p_proven);
            RETURN QUERY SELECT gone.outcome, gone.state, gone.fence, gone.attempt_count,
                                p.claim_token, p.account_id, NULL::bigint, p.amount_minor;
            RETURN;
        END IF;
    END IF;
    RETURN QUERY SELECT * FROM pay_claim(p_payout_id, p_token, p_expected_state, p_proven);
END $$;

-- The two rows of a payout posting, inside a fenced post or an operator resolution. On the
-- payout path (every post and every resolution), hence PL/pgSQL.
CREATE FUNCTION pay_write_payout_posting(p payouts, p_fence bigint, p_kind text)
RETURNS void LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan SET enable_seqscan = off SET jit = off AS $$
BEGIN
    INSERT INTO ledger_entries (entry_id, account_id, currency, direction, amount_minor, fence,
                                kind, reference, payout_id)
    VALUES (gen_random_uuid(), p.account_id, p.currency, 'DEBIT', p.amount_minor, p_fence, p_kind,
            'payout:' || p.payout_id, p.payout_id),
           (gen_random_uuid(), 'rail-settlement-' || p.currency, p.currency, 'CREDIT',
            p.amount_minor, p_fence, p_kind, 'payout:' || p.payout_id, p.payout_id);
END $$;

-- P3. outcome: posted | fenced_out | not_claimable | reference_mismatch | not_found
-- A proven post raises max_seen_token to its token (a post admits `fence <= token`, so the fence
-- may already stand at it).
CREATE FUNCTION pay_post(p_payout_id uuid, p_token bigint, p_rail_reference text,
                         p_submission_id uuid, p_proven boolean DEFAULT false)
RETURNS TABLE (outcome text, state text, fence bigint, account_id text, balance_minor bigint)
LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan SET enable_seqscan = off SET jit = off AS $$
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
    -- The claimer or a later holder may post: fence <= token (docs/design.md#d-1).
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
    UPDATE accounts a SET fence = greatest(a.fence, p_token),
                          max_seen_token = CASE WHEN p_proven
                                                THEN greatest(a.max_seen_token, p_token)
                                                ELSE a.max_seen_token END
     WHERE a.account_id = p.account_id
       AND (a.fence < p_token OR (p_proven AND a.max_seen_token < p_token));
    -- The hold is released (trigger) before the debit lands, so available never dips below 0.
    UPDATE payouts x SET state = 'POSTED', rail_reference = p_rail_reference,
                         submission_id = p_submission_id
     WHERE x.payout_id = p_payout_id AND x.state = 'RAIL_ACKED';
    PERFORM pay_write_payout_posting(p, p_token, 'payout');
    RETURN QUERY SELECT 'posted'::text, 'POSTED'::text, greatest(acct.fence, p_token), p.account_id,
                        a.balance_minor FROM accounts a WHERE a.account_id = p.account_id;
END $$;

-- Out-of-band resolution of a quarantined payout, attributed (operator and identity), checked
-- against the evidence paydb holds (docs/contract.md#resolve-evidence): what the rail proxy
-- recorded for the payout's attempt (the one non-FENCED rail_submission row), its outcome or the
-- rail's late answer after a timeout, and, for an attempt whose outcome nobody recorded (a
-- timeout, a reset, a proxy that died) or a payout the store-epoch recovery quarantined, the
-- reconciler's findings: FAILED needs an absent finding read at least the settlement window
-- after the attempt was submitted (and no present finding); POSTED needs a present finding
-- under the same reference. A POSTED resolution's reference is refused when the rail
-- acknowledged it for another payout, another payout holds it, or a resolution recorded it for
-- another payout (resolution_references).
-- outcome: resolved | not_claimable | not_found |
--   reference_mismatch (POSTED under another reference than the one the rail acknowledged) |
--   rail_acked (FAILED, but the rail acknowledged the transfer) |
--   rail_rejected (POSTED, but the rail declined the transfer) |
--   reference_taken (POSTED under a reference the rail acknowledged for, or a resolution
--     recorded for, another payout) |
--   no_absent_finding (FAILED of an attempt nobody recorded, without an absent finding read the
--     settlement window after the attempt, or with a present finding) |
--   no_present_finding (POSTED of an attempt nobody recorded, without a present finding under
--     that reference).
-- recorded_outcome and recorded_reference are the record the refusal stands on.
CREATE FUNCTION pay_resolve(p_payout_id uuid, p_outcome text, p_rail_reference text,
                            p_operator text, p_evidence text, p_owner_id text,
                            p_identity text)
RETURNS TABLE (outcome text, state text, account_id text, balance_minor bigint,
               recorded_outcome text, recorded_reference text, submission_id uuid)
LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan SET enable_seqscan = off SET jit = off AS $$
#variable_conflict use_column
DECLARE
    p payouts%ROWTYPE;
    s rail_submission%ROWTYPE;
    v_balance bigint;
    v_acked text;
    v_rejected boolean;
    v_refusal text;
    v_found text;
BEGIN
    SELECT * INTO p FROM payouts x WHERE x.payout_id = p_payout_id FOR UPDATE;
    IF NOT FOUND THEN
        RETURN QUERY SELECT 'not_found'::text, NULL::text, NULL::text, NULL::bigint, NULL::text,
                            NULL::text, NULL::uuid;
        RETURN;
    END IF;
    SELECT a.balance_minor INTO v_balance FROM accounts a WHERE a.account_id = p.account_id
       FOR UPDATE;
    IF p.state <> 'RAIL_AMBIGUOUS' THEN
        RETURN QUERY SELECT 'not_claimable'::text, p.state, p.account_id, v_balance, NULL::text,
                            NULL::text, NULL::uuid;
        RETURN;
    END IF;
    SELECT * INTO s FROM rail_submission r
     WHERE r.payout_id = p_payout_id AND r.outcome <> 'FENCED';
    v_acked := coalesce(CASE WHEN s.outcome = 'ACKED' THEN s.rail_reference END,
                        CASE WHEN s.late_outcome = 'ACKED' THEN s.late_rail_reference END,
                        p.rail_reference);
    v_rejected := coalesce(s.outcome = 'REJECTED' OR s.late_outcome = 'REJECTED', false);
    -- The latest present finding's reference, for the refusal's message.
    SELECT f.rail_reference INTO v_found FROM reconcile_findings f
     WHERE f.payout_id = p_payout_id AND f.verdict = 'present'
     ORDER BY f.finding_id DESC LIMIT 1;
    IF p_outcome = 'POSTED' AND v_acked IS NOT NULL AND v_acked <> p_rail_reference THEN
        v_refusal := 'reference_mismatch';
    ELSIF p_outcome = 'POSTED' AND v_rejected THEN
        v_refusal := 'rail_rejected';
    ELSIF p_outcome = 'FAILED' AND v_acked IS NOT NULL THEN
        v_refusal := 'rail_acked';
    ELSIF p_outcome = 'POSTED' AND (
            EXISTS (SELECT 1 FROM payouts o
                     WHERE o.rail_reference = p_rail_reference AND o.payout_id <> p_payout_id)
            OR EXISTS (SELECT 1 FROM rail_submission r
                        WHERE r.payout_id <> p_payout_id
                          AND (r.rail_reference = p_rail_reference
                               OR r.late_rail_reference = p_rail_reference))
            OR EXISTS (SELECT 1 FROM resolution_references q
                        WHERE q.rail_reference = p_rail_reference
                          AND q.payout_id <> p_payout_id)) THEN
        v_refusal := 'reference_taken';
    ELSIF (s.submission_id IS NOT NULL AND v_acked IS NULL AND NOT v_rejected)
          OR EXISTS (SELECT 1 FROM pay_epoch_quarantined q WHERE q.payout_id = p_payout_id) THEN
        -- The proxy recorded the attempt but nobody recorded the rail's answer, or the
        -- store-epoch recovery quarantined the payout because the rail has it while paydb lost
        -- its attempt: the reconciler's finding decides.
        IF p_outcome = 'FAILED' AND (v_found IS NOT NULL OR NOT EXISTS (
                SELECT 1 FROM reconcile_findings f
                 WHERE f.payout_id = p_payout_id AND f.verdict = 'absent'
                   AND f.statement_read_at >= coalesce(s.submitted_at, p.updated_at)
                                              + f.settlement_window_ms * interval '1 millisecond'))
        THEN
            v_refusal := 'no_absent_finding';
        ELSIF p_outcome = 'POSTED' AND NOT EXISTS (
                SELECT 1 FROM reconcile_findings f
                 WHERE f.payout_id = p_payout_id AND f.verdict = 'present'
                   AND f.rail_reference = p_rail_reference) THEN
            v_refusal := 'no_present_finding';
        END IF;
    END IF;
    IF v_refusal IS NOT NULL THEN
        RETURN QUERY SELECT v_refusal, p.state, p.account_id, v_balance,
                            coalesce(s.late_outcome, s.outcome),
                            CASE WHEN v_refusal IN ('no_absent_finding', 'no_present_finding')
                                 THEN v_found ELSE v_acked END,
                            s.submission_id;
        RETURN;
    END IF;
    UPDATE payouts x SET state = p_outcome,
                         rail_reference = coalesce(p_rail_reference, x.rail_reference)
     WHERE x.payout_id = p_payout_id AND x.state = 'RAIL_AMBIGUOUS';
    IF p_outcome = 'POSTED' THEN
        -- Unique by reference: two resolutions racing for one reference, one of them fails.
        INSERT INTO resolution_references (rail_reference, payout_id)
        VALUES (p_rail_reference, p_payout_id);
        PERFORM pay_write_payout_posting(p, p.claim_token, 'resolution');
    END IF;
    INSERT INTO audit_log (action, account_id, payout_id, operator, identity, owner_id, reason,
                           outcome, rail_reference)
    VALUES ('ambiguous_resolved', p.account_id, p_payout_id, p_operator, p_identity, p_owner_id,
            p_evidence, p_outcome, p_rail_reference);
    RETURN QUERY SELECT 'resolved'::text, p_outcome, p.account_id, a.balance_minor,
                        coalesce(s.late_outcome, s.outcome), v_acked, s.submission_id
                   FROM accounts a WHERE a.account_id = p.account_id;
END $$;

-- The reconciler's record of one classification. A payout that is no longer RAIL_AMBIGUOUS
-- records nothing (finding_id NULL): it was resolved meanwhile.
CREATE FUNCTION pay_record_finding(p_payout_id uuid, p_rail_reference text,
                                   p_statement_read_at timestamptz,
                                   p_settlement_window_ms bigint)
RETURNS bigint LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan SET enable_seqscan = off SET jit = off AS $$
DECLARE
    v_id bigint;
BEGIN
    INSERT INTO reconcile_findings (payout_id, verdict, rail_reference, statement_read_at,
                                    settlement_window_ms)
    SELECT p.payout_id, CASE WHEN p_rail_reference IS NULL THEN 'absent' ELSE 'present' END,
           p_rail_reference, p_statement_read_at, p_settlement_window_ms
      FROM payouts p WHERE p.payout_id = p_payout_id AND p.state = 'RAIL_AMBIGUOUS'
    RETURNING finding_id INTO v_id;
    RETURN v_id;
END $$;

-- docs/design.md#d-3: raises an account's fence to a revocation floor, attributed (operator and
-- identity). outcome: advanced | not_found
CREATE FUNCTION pay_advance_fence(p_account_id text, p_floor bigint, p_operator text,
                                  p_reason text, p_revocation_id uuid, p_owner_id text,
                                  p_identity text)
RETURNS TABLE (outcome text, previous_fence bigint, fence bigint)
LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan SET enable_seqscan = off SET jit = off AS $$
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

-- The payment resource's recovery of a poisoned fence (docs/design.md#d-8), never under
-- max_seen_token. outcome: lowered | unchanged (the fence is already at or below p_to: nothing
-- to do, nothing recorded) | below_seen (p_to is below a proven token the account admitted:
-- nothing changed) | not_found. seen_token is the account's max_seen_token.
CREATE FUNCTION pay_lower_fence(p_account text, p_to bigint, p_operator text,
                                p_identity text, p_owner text, p_reason text)
RETURNS TABLE (outcome text, previous_fence bigint, fence bigint, recovery_id bigint,
               seen_token bigint)
LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan SET enable_seqscan = off SET jit = off AS $$
#variable_conflict use_column
DECLARE
    acct accounts%ROWTYPE;
    v_id bigint;
BEGIN
    SELECT * INTO acct FROM accounts a WHERE a.account_id = p_account FOR UPDATE;
    IF NOT FOUND THEN
        RETURN QUERY SELECT 'not_found'::text, NULL::bigint, NULL::bigint, NULL::bigint,
                            NULL::bigint;
        RETURN;
    END IF;
    IF acct.fence <= p_to THEN
        RETURN QUERY SELECT 'unchanged'::text, acct.fence, acct.fence, NULL::bigint,
                            acct.max_seen_token;
        RETURN;
    END IF;
    IF p_to < acct.max_seen_token THEN
        RETURN QUERY SELECT 'below_seen'::text, acct.fence, acct.fence, NULL::bigint,
                            acct.max_seen_token;
        RETURN;
    END IF;
    INSERT INTO fence_recoveries (resource, account_id, previous_token, new_token, operator,
                                  identity, owner_id, reason)
    VALUES ('account', p_account, acct.fence, p_to, p_operator, p_identity, p_owner, p_reason)
    RETURNING fence_recoveries.recovery_id INTO v_id;
    UPDATE accounts a SET fence = p_to WHERE a.account_id = p_account;
    RETURN QUERY SELECT 'lowered'::text, acct.fence, p_to, v_id, acct.max_seen_token;
END $$;

-- =============================================================================================
-- An account's limits, and fundings (docs/contract.md#account-limits,
-- docs/contract.md#dual-approval)
-- =============================================================================================

-- Sets (or clears, with NULL) an account's limits; `outcome`: set | not_found | not_customer.
CREATE FUNCTION pay_set_limits(p_account_id text, p_max_payout bigint,
                               p_daily_outflow bigint, p_identity text)
RETURNS TABLE (outcome text, max_payout_minor bigint, daily_outflow_minor bigint,
               set_by text, updated_at timestamptz)
LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan SET enable_seqscan = off SET jit = off AS $$
#variable_conflict use_column
DECLARE
    acct accounts%ROWTYPE;
BEGIN
    SELECT * INTO acct FROM accounts a WHERE a.account_id = p_account_id FOR UPDATE;
    IF NOT FOUND THEN
        RETURN QUERY SELECT 'not_found'::text, NULL::bigint, NULL::bigint, NULL::text,
                            NULL::timestamptz;
        RETURN;
    END IF;
    IF acct.kind <> 'customer' THEN
        RETURN QUERY SELECT 'not_customer'::text, NULL::bigint, NULL::bigint, NULL::text,
                            NULL::timestamptz;
        RETURN;
    END IF;
    RETURN QUERY
    INSERT INTO account_limits AS l (account_id, max_payout_minor, daily_outflow_minor, set_by)
    VALUES (p_account_id, p_max_payout, p_daily_outflow, p_identity)
    ON CONFLICT (account_id) DO UPDATE
        SET max_payout_minor = EXCLUDED.max_payout_minor,
            daily_outflow_minor = EXCLUDED.daily_outflow_minor,
            set_by = EXCLUDED.set_by,
            updated_at = clock_timestamp()
    RETURNING 'set'::text, l.max_payout_minor, l.daily_outflow_minor, l.set_by, l.updated_at;
END $$;

-- A treasury identity's funding (`POST /v1/accounts/{accountId}/fund`), applied or recorded for a
-- second approval, decided here under the account row lock: two fundings of one account are
-- decided one after the other, and the second sees the first. p_threshold is the payment
-- resource's auth.treasury.dual-approval-above (NULL: every funding applies at once). The
-- threshold applies to what one treasury identity funds on an account on its own word in a
-- rolling 24 hours, not to one funding alone: the funding is added to what the same identity
-- funded there in the 24 hours before (direct_fundings) and recorded in pending_fundings for a
-- second treasury identity when the sum would pass the threshold, so T, T, T... from one
-- identity does not apply at once. A funding a second identity approved does not count: two
-- people saw it.
-- `outcome`:
--   funded       applied now (ledger pair, direct_fundings row);
--   exists       the reference was applied before with this account and amount (nothing new);
--   pending      recorded now in pending_fundings, or found there with this account and amount
--                (approved_by says whether a second identity applied it since);
--   conflict     the reference names another funding; not_found; not_customer.
-- window_minor is what p_identity funded on the account alone in the 24 hours before, without
-- this funding.
CREATE FUNCTION pay_fund_as(p_funding_id uuid, p_account_id text, p_amount bigint,
                            p_reference text, p_identity text, p_threshold bigint)
RETURNS TABLE (outcome text, balance_minor bigint, funding_id uuid, requested_by text,
               approved_by text, window_minor bigint)
LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan SET enable_seqscan = off SET jit = off AS $$
#variable_conflict use_column
DECLARE
    acct accounts%ROWTYPE;
    prior pending_fundings%ROWTYPE;
    v_window numeric;
    funded record;
BEGIN
    SELECT * INTO acct FROM accounts a WHERE a.account_id = p_account_id FOR UPDATE;
    IF NOT FOUND THEN
        RETURN QUERY SELECT 'not_found'::text, NULL::bigint, NULL::uuid, NULL::text, NULL::text,
                            NULL::bigint;
        RETURN;
    END IF;
    IF acct.kind <> 'customer' THEN
        RETURN QUERY SELECT 'not_customer'::text, NULL::bigint, NULL::uuid, NULL::text,
                            NULL::text, NULL::bigint;
        RETURN;
    END IF;
    -- A reference that waits (or waited) for a second approval answers as it is.
    SELECT * INTO prior FROM pending_fundings f WHERE f.reference = p_reference;
    IF FOUND THEN
        IF prior.account_id = p_account_id AND prior.amount_minor = p_amount THEN
            RETURN QUERY SELECT 'pending'::text, acct.balance_minor, prior.funding_id,
                                prior.requested_by, prior.approved_by, NULL::bigint;
        ELSE
            RETURN QUERY SELECT 'conflict'::text, NULL::bigint, prior.funding_id, NULL::text,
                                NULL::text, NULL::bigint;
        END IF;
        RETURN;
    END IF;
    -- A reference applied before: pay_fund answers exists or conflict and writes nothing.
    IF EXISTS (SELECT 1 FROM ledger_entries e WHERE e.reference = 'fund:' || p_reference) THEN
        SELECT * INTO funded FROM pay_fund(p_account_id, p_amount, p_reference);
        RETURN QUERY SELECT funded.outcome, funded.balance_minor, NULL::uuid, NULL::text,
                            NULL::text, NULL::bigint;
        RETURN;
    END IF;
    -- The sum is read after the row lock was granted, so it includes every funding of the
    -- account that committed before (read committed: each statement sees what committed).
    SELECT coalesce(sum(d.amount_minor), 0) INTO v_window FROM direct_fundings d
     WHERE d.account_id = p_account_id AND d.funded_by = p_identity
       AND d.funded_at > clock_timestamp() - interval '24 hours';
    IF p_threshold IS NOT NULL AND v_window + p_amount > p_threshold THEN
        INSERT INTO pending_fundings (funding_id, account_id, amount_minor, reference,
                                      requested_by)
        VALUES (p_funding_id, p_account_id, p_amount, p_reference, p_identity);
        RETURN QUERY SELECT 'pending'::text, acct.balance_minor, p_funding_id, p_identity,
                            NULL::text, least(v_window, 9223372036854775807)::bigint;
        RETURN;
    END IF;
    SELECT * INTO funded FROM pay_fund(p_account_id, p_amount, p_reference);
    IF funded.outcome <> 'funded' THEN
        RAISE EXCEPTION 'funding % of % did not apply: pay_fund answered %', p_reference,
            p_account_id, funded.outcome USING ERRCODE = 'check_violation';
    END IF;
    INSERT INTO direct_fundings (reference, account_id, amount_minor, funded_by)
    VALUES (p_reference, p_account_id, p_amount, p_identity);
    RETURN QUERY SELECT 'funded'::text, funded.balance_minor, NULL::uuid, NULL::text, NULL::text,
                        least(v_window, 9223372036854775807)::bigint;
END $$;

-- Records a funding that waits for a second approval. `outcome`: pending (recorded now) |
-- exists (the same account, amount and reference already wait, or were approved) | conflict (the
-- reference names another funding, pending or applied) | not_found | not_customer.
CREATE FUNCTION pay_request_funding(p_funding_id uuid, p_account_id text,
                                    p_amount bigint, p_reference text,
                                    p_identity text)
RETURNS TABLE (outcome text, funding_id uuid, requested_by text, approved_by text)
LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan SET enable_seqscan = off SET jit = off AS $$
#variable_conflict use_column
DECLARE
    acct accounts%ROWTYPE;
    prior pending_fundings%ROWTYPE;
BEGIN
    SELECT * INTO acct FROM accounts a WHERE a.account_id = p_account_id FOR UPDATE;
    IF NOT FOUND THEN
        RETURN QUERY SELECT 'not_found'::text, NULL::uuid, NULL::text, NULL::text;
        RETURN;
    END IF;
    IF acct.kind <> 'customer' THEN
        RETURN QUERY SELECT 'not_customer'::text, NULL::uuid, NULL::text, NULL::text;
        RETURN;
    END IF;
    SELECT * INTO prior FROM pending_fundings f WHERE f.reference = p_reference;
    IF FOUND THEN
        IF prior.account_id = p_account_id AND prior.amount_minor = p_amount THEN
            RETURN QUERY SELECT 'exists'::text, prior.funding_id, prior.requested_by,
                                prior.approved_by;
        ELSE
            RETURN QUERY SELECT 'conflict'::text, prior.funding_id, NULL::text, NULL::text;
        END IF;
        RETURN;
    END IF;
    IF EXISTS (SELECT 1 FROM ledger_entries e WHERE e.reference = 'fund:' || p_reference) THEN
        RETURN QUERY SELECT 'conflict'::text, NULL::uuid, NULL::text, NULL::text;
        RETURN;
    END IF;
    INSERT INTO pending_fundings (funding_id, account_id, amount_minor, reference, requested_by)
    VALUES (p_funding_id, p_account_id, p_amount, p_reference, p_identity);
    RETURN QUERY SELECT 'pending'::text, p_funding_id, p_identity, NULL::text;
END $$;

-- The second approval (`POST /v1/fundings/{fundingId}/approve`): marks the funding approved by
-- p_identity (only if it is still pending and p_identity is not its requester: one conditional
-- update) and applies it with pay_fund in the same transaction. `outcome`: approved | not_found
-- (no such funding of this account) | same_identity | already_approved (by `approved_by`). A
-- pay_fund that does not fund raises, so an approval never stands without its funding.
CREATE FUNCTION pay_approve_funding(p_funding_id uuid, p_identity text)
RETURNS TABLE (outcome text, account_id text, amount_minor bigint, reference text,
               requested_by text, approved_by text, balance_minor bigint)
LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan SET enable_seqscan = off SET jit = off AS $$
#variable_conflict use_column
DECLARE
    f pending_fundings%ROWTYPE;
    funded record;
BEGIN
    UPDATE pending_fundings x SET approved_by = p_identity, approved_at = clock_timestamp()
     WHERE x.funding_id = p_funding_id
       AND x.approved_by IS NULL AND x.requested_by <> p_identity
    RETURNING * INTO f;
    IF NOT FOUND THEN
        SELECT * INTO f FROM pending_fundings x WHERE x.funding_id = p_funding_id;
        IF NOT FOUND THEN
            RETURN QUERY SELECT 'not_found'::text, NULL::text, NULL::bigint, NULL::text,
                                NULL::text, NULL::text, NULL::bigint;
        ELSIF f.approved_by IS NOT NULL THEN
            RETURN QUERY SELECT 'already_approved'::text, f.account_id, f.amount_minor,
                                f.reference, f.requested_by, f.approved_by, NULL::bigint;
        ELSE
            RETURN QUERY SELECT 'same_identity'::text, f.account_id, f.amount_minor,
                                f.reference, f.requested_by, NULL::text, NULL::bigint;
        END IF;
        RETURN;
    END IF;
    SELECT * INTO funded FROM pay_fund(f.account_id, f.amount_minor, f.reference);
    IF funded.outcome <> 'funded' THEN
        RAISE EXCEPTION 'approved funding % did not apply: pay_fund answered %', p_funding_id,
            funded.outcome USING ERRCODE = 'check_violation';
    END IF;
    RETURN QUERY SELECT 'approved'::text, f.account_id, f.amount_minor, f.reference,
                        f.requested_by, f.approved_by, funded.balance_minor;
END $$;

-- =============================================================================================
-- The operator's confirmation of a new store epoch (docs/design.md#d-12)
-- =============================================================================================

-- `dlock recover paydb-epoch`, after the operator has reconciled: takes the current timeline as
-- paydb's epoch, raises every fence and high-water mark below p_floor (the highest token the
-- lock server has issued: lockdb's dlock_epoch_floor()) to it, so every token issued before it
-- is fenced out and a claim needs a newer grant, and records who, why and what it raised.
--
-- Raising the fences does not stop a payout the rail received but paydb lost (an asynchronous
-- promotion can lose a claim and the rail proxy's intent after the rail received the payout:
-- paydb shows it PENDING or CLAIMED with no attempt presented, and the next holder, whose token is
-- newer, would present it to the rail a second time). So the recovery reads the rail's statement
-- and passes the payouts the rail holds (p_on_rail, their clientRefs); in the same transaction,
-- each of them that paydb shows PENDING or CLAIMED with no attempt presented is claimed under the
-- token floor and quarantined RAIL_AMBIGUOUS (it holds its amount: the money moved), for the
-- operator's evidence-based resolution, and recorded in pay_epoch_quarantined. Answers what it
-- did; on the epoch it already has, changes nothing and answers NULL counts.
CREATE FUNCTION pay_epoch_confirm(p_floor bigint, p_operator text, p_reason text,
                                  p_on_rail uuid[])
RETURNS TABLE (from_timeline bigint, to_timeline bigint, fences_raised integer,
               marks_raised integer, quarantined integer)
LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan SET enable_seqscan = off SET jit = off AS $$
DECLARE
    v_timeline    bigint := pay_timeline();
    v_epoch       pay_store_epoch;
    v_fences      integer;
    v_marks       integer;
    v_quarantined integer;
BEGIN
    IF p_floor IS NULL OR p_floor <= 0 THEN
        RAISE EXCEPTION USING ERRCODE = '22023', MESSAGE = 'the token floor must be a token, > 0';
    END IF;
    IF p_on_rail IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = 'the payouts on the rail''s statement are needed (an empty list if none)';
    END IF;
    SELECT * INTO v_epoch FROM pay_store_epoch FOR UPDATE;
    IF v_epoch.timeline = v_timeline THEN
        RETURN QUERY SELECT v_timeline, v_timeline, NULL::integer, NULL::integer, NULL::integer;
        RETURN;
    END IF;
    UPDATE pay_store_epoch
       SET timeline = v_timeline, synchronous = pay_replicating_synchronously(),
           checked_at = clock_timestamp();
    UPDATE accounts SET fence = p_floor, updated_at = clock_timestamp()
     WHERE kind = 'customer' AND fence < p_floor;
    GET DIAGNOSTICS v_fences = ROW_COUNT;
    INSERT INTO rail_high_water (account_id, highest_token)
    SELECT account_id, p_floor FROM accounts WHERE kind = 'customer'
    ON CONFLICT (account_id) DO UPDATE SET highest_token = EXCLUDED.highest_token,
                                           updated_at = clock_timestamp()
     WHERE rail_high_water.highest_token < EXCLUDED.highest_token;
    GET DIAGNOSTICS v_marks = ROW_COUNT;

    -- On the rail, not presented here: quarantined. A PENDING one is claimed first, under the
    -- floor (above every token issued before), because a quarantined payout carries a claim.
    PERFORM set_config('dlock.epoch_recovery', 'on', true);
    INSERT INTO pay_epoch_quarantined (payout_id, to_timeline, from_state)
    SELECT p.payout_id, v_timeline, p.state FROM payouts p
     WHERE p.payout_id = ANY(p_on_rail) AND p.state IN ('PENDING', 'CLAIMED')
       AND NOT EXISTS (SELECT 1 FROM rail_submission r
                        WHERE r.payout_id = p.payout_id AND r.outcome <> 'FENCED')
    ON CONFLICT (payout_id) DO NOTHING;
    GET DIAGNOSTICS v_quarantined = ROW_COUNT;
    UPDATE payouts p
       SET state = 'CLAIMED', attempt_count = p.attempt_count + 1, claim_token = p_floor
      FROM pay_epoch_quarantined q
     WHERE q.payout_id = p.payout_id AND q.to_timeline = v_timeline AND p.state = 'PENDING';
    UPDATE payouts p SET state = 'RAIL_AMBIGUOUS'
      FROM pay_epoch_quarantined q
     WHERE q.payout_id = p.payout_id AND q.to_timeline = v_timeline AND p.state = 'CLAIMED';
    PERFORM set_config('dlock.epoch_recovery', 'off', true);

    INSERT INTO pay_store_epoch_changes (from_timeline, to_timeline, decided_by, token_floor,
                                         fences_raised, marks_raised, operator, reason,
                                         quarantined)
    VALUES (v_epoch.timeline, v_timeline, 'operator', p_floor, v_fences, v_marks,
            trim(p_operator), trim(p_reason), v_quarantined);
    RETURN QUERY SELECT v_epoch.timeline, v_timeline, v_fences, v_marks, v_quarantined;
END $$;

-- Without the rail's statement the confirmation refuses.
CREATE FUNCTION pay_epoch_confirm(p_floor bigint, p_operator text, p_reason text)
RETURNS TABLE (from_timeline bigint, to_timeline bigint, fences_raised integer,
               marks_raised integer)
LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan SET enable_seqscan = off SET jit = off AS $$
BEGIN
    RAISE EXCEPTION USING
        ERRCODE = '0A000',
        MESSAGE = 'pay_epoch_confirm needs the payouts on the rail''s statement: run '
                  '`dlock recover paydb-epoch --rail <the rail>`, which reads it';
END $$;
