-- paydb 0014: the operator's recovery acts on evidence paydb holds, not on say-so.
--
-- 1. A fence is lowered (docs/design.md#fence-recovery) only to a token at or above the highest
--    token paydb has admitted for the account with a proof: accounts.max_seen_token, raised by
--    the fenced writes (claim, cancel, post) when the payment resource verified the token's
--    proof, and kept at or below the fence by a CHECK, so no code path, psql included, can lower
--    a fence under a token that was used. A fence raised by a revocation floor
--    (docs/design.md#d-3), which no holder presented, can still be lowered down to that mark: the
--    recovery after the lock server's store was restored and hands out tokens below the floor. A
--    submission at the rail proxy needs a payout claimed with the very same token, so a
--    submitted token has always passed a claim here first.
--
-- 2. A late answer of the rail is recorded: when the rail answers a forward after the attempt was
--    timed out (the sweeper made it TIMEOUT and its payout RAIL_AMBIGUOUS), the answer is kept on
--    the attempt (late_outcome, late_rail_reference), and the payout stays quarantined as before.
--
-- 3. A resolution of a RAIL_AMBIGUOUS payout must agree with what the rail proxy recorded for the
--    payout's attempt: POSTED names the reference the rail acknowledged (when one is recorded) and
--    is refused when the rail declined; FAILED is refused when the rail acknowledged.
--
-- Tokens presented before this migration are not known to have been proven: max_seen_token
-- starts at 0 and rises with the next proven write of the account.
--
-- Like 0013, this file can run again on a database that already has its changes (IF NOT EXISTS,
-- OR REPLACE, constraints dropped before they are added): a database whose migration rows were
-- rewritten to the baseline (services/server/src/squash.rs) applies it again.

-- =============================================================================================
-- 1. The highest proven token an account has admitted
-- =============================================================================================

ALTER TABLE accounts
    ADD COLUMN IF NOT EXISTS max_seen_token bigint NOT NULL DEFAULT 0
        CONSTRAINT accounts_max_seen_token_check CHECK (max_seen_token >= 0);
ALTER TABLE accounts DROP CONSTRAINT IF EXISTS accounts_fence_covers_seen_check;
-- A fence below a token that an account has admitted would re-admit the holders between the
-- two: a recovery may lower the fence to that token, never under it.
ALTER TABLE accounts
    ADD CONSTRAINT accounts_fence_covers_seen_check CHECK (fence >= max_seen_token);

-- The mark only rises, like the fence, and it has no recovery: it records what happened.
CREATE OR REPLACE FUNCTION pay_accounts_seen_guard() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.max_seen_token < OLD.max_seen_token THEN
        RAISE EXCEPTION 'accounts.max_seen_token of % may not go down (% -> %)',
            OLD.account_id, OLD.max_seen_token, NEW.max_seen_token
            USING ERRCODE = 'check_violation';
    END IF;
    RETURN NEW;
END $$;
DROP TRIGGER IF EXISTS accounts_seen_guard ON accounts;
-- The WHEN clause keeps the function off the claim and post path: it runs only for a lowering.
CREATE TRIGGER accounts_seen_guard BEFORE UPDATE OF max_seen_token ON accounts
    FOR EACH ROW WHEN (NEW.max_seen_token < OLD.max_seen_token)
    EXECUTE FUNCTION pay_accounts_seen_guard();

-- The fenced writes take one more parameter, p_proven: whether the payment resource verified the
-- token's proof (with proof keys configured, every fenced write is proven before it reaches
-- here). It defaults to false, so a caller that does not pass it (a replica of the previous
-- release during a rollout, a psql session) records nothing and is otherwise served as before.
DROP FUNCTION IF EXISTS pay_claim_once(text, text, bigint, text, bytea, bigint, integer, uuid,
                                       text, integer);
DROP FUNCTION IF EXISTS pay_post_once(text, text, bigint, text, bytea, bigint, integer, uuid, text,
                                      uuid);
DROP FUNCTION IF EXISTS pay_claim_bounded(uuid, bigint, text, integer, text);
DROP FUNCTION IF EXISTS pay_claim(uuid, bigint, text);
DROP FUNCTION IF EXISTS pay_abandon(uuid, bigint, text, text, text, text, text, text);
DROP FUNCTION IF EXISTS pay_post(uuid, bigint, text, uuid);

-- P2, as in 0011; a proven claim that passes the fence raises max_seen_token with it.
CREATE OR REPLACE FUNCTION pay_claim(p_payout_id uuid, p_token bigint, p_expected_state text,
                                     p_proven boolean DEFAULT false)
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

-- As in 0011; a proven cancel that passes the fence raises max_seen_token with it.
CREATE OR REPLACE FUNCTION pay_abandon(p_payout_id uuid, p_token bigint, p_expected_state text,
                                       p_cause text, p_owner_id text, p_identity text,
                                       p_operator text, p_reason text,
                                       p_proven boolean DEFAULT false)
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

-- As in 0011, passing p_proven on.
CREATE OR REPLACE FUNCTION pay_claim_bounded(p_payout_id uuid, p_token bigint,
                                             p_expected_state text, p_max_attempts integer,
                                             p_owner_id text, p_proven boolean DEFAULT false)
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
                             p.attempt_count), p_proven);
            RETURN QUERY SELECT gone.outcome, gone.state, gone.fence, gone.attempt_count,
                                p.claim_token, p.account_id, NULL::bigint, p.amount_minor;
            RETURN;
        END IF;
    END IF;
    RETURN QUERY SELECT * FROM pay_claim(p_payout_id, p_token, p_expected_state, p_proven);
END $$;

-- P3, as in 0011; a proven post raises max_seen_token to its token (a post admits
-- `fence <= token`, so the fence may already stand at it).
CREATE OR REPLACE FUNCTION pay_post(p_payout_id uuid, p_token bigint, p_rail_reference text,
                                    p_submission_id uuid, p_proven boolean DEFAULT false)
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

-- As in 0012, passing p_proven on.
CREATE OR REPLACE FUNCTION pay_claim_once(p_route text, p_key text, p_token bigint,
                                          p_owner_id text, p_payload_hash bytea,
                                          p_retention_ms bigint, p_wait_ms integer,
                                          p_payout_id uuid, p_expected_state text,
                                          p_max_attempts integer, p_proven boolean DEFAULT false)
RETURNS TABLE (begin_outcome text, response_status smallint, response_body bytea,
               outcome text, state text, fence bigint, attempt_count integer,
               claim_token bigint, account_id text, available_minor bigint, amount_minor bigint)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    b record;
BEGIN
    SELECT * INTO b FROM pay_idempotency_begin(p_route, p_key, p_token, p_owner_id,
                                               p_payload_hash, p_retention_ms, p_wait_ms);
    IF b.outcome <> 'fresh' THEN
        RETURN QUERY SELECT b.outcome, b.response_status, b.response_body, NULL::text, NULL::text,
                            NULL::bigint, NULL::integer, NULL::bigint, NULL::text, NULL::bigint,
                            NULL::bigint;
        RETURN;
    END IF;
    RETURN QUERY SELECT 'fresh'::text, NULL::smallint, NULL::bytea, c.*
                   FROM pay_claim_bounded(p_payout_id, p_token, p_expected_state, p_max_attempts,
                                          p_owner_id, p_proven) c;
END $$;

-- As in 0012, passing p_proven on.
CREATE OR REPLACE FUNCTION pay_post_once(p_route text, p_key text, p_token bigint,
                                         p_owner_id text, p_payload_hash bytea,
                                         p_retention_ms bigint, p_wait_ms integer,
                                         p_payout_id uuid, p_rail_reference text,
                                         p_submission_id uuid, p_proven boolean DEFAULT false)
RETURNS TABLE (begin_outcome text, response_status smallint, response_body bytea,
               outcome text, state text, fence bigint, account_id text, balance_minor bigint,
               entries text)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    b record;
    r record;
BEGIN
    SELECT * INTO b FROM pay_idempotency_begin(p_route, p_key, p_token, p_owner_id,
                                               p_payload_hash, p_retention_ms, p_wait_ms);
    IF b.outcome <> 'fresh' THEN
        RETURN QUERY SELECT b.outcome, b.response_status, b.response_body, NULL::text, NULL::text,
                            NULL::bigint, NULL::text, NULL::bigint, NULL::text;
        RETURN;
    END IF;
    SELECT * INTO r FROM pay_post(p_payout_id, p_token, p_rail_reference, p_submission_id,
                                  p_proven);
    RETURN QUERY SELECT 'fresh'::text, NULL::smallint, NULL::bytea, r.outcome, r.state, r.fence,
                        r.account_id, r.balance_minor,
                        CASE WHEN r.outcome = 'posted' THEN
                            (SELECT jsonb_agg(jsonb_build_object(
                                        'entryId', e.entry_id, 'accountId', e.account_id,
                                        'direction', e.direction, 'amountMinor', e.amount_minor,
                                        'fence', e.fence) ORDER BY e.direction DESC)
                               FROM ledger_entries e
                              WHERE e.reference = 'payout:' || p_payout_id)::text
                        END;
END $$;

-- The payment resource's recovery of a poisoned fence (docs/design.md#d-8), as in 0011, and now
-- never under max_seen_token. outcome: lowered | unchanged (the fence is already at or below
-- p_to: nothing to do, nothing recorded) | below_seen (p_to is below a proven token the account
-- admitted: nothing changed) | not_found. seen_token is the account's max_seen_token.
DROP FUNCTION IF EXISTS pay_lower_fence(text, bigint, text, text, text, text);
CREATE OR REPLACE FUNCTION pay_lower_fence(p_account text, p_to bigint, p_operator text,
                                           p_identity text, p_owner text, p_reason text)
RETURNS TABLE (outcome text, previous_fence bigint, fence bigint, recovery_id bigint,
               seen_token bigint)
LANGUAGE plpgsql AS $$
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
-- 2. The rail's late answer to an attempt that was timed out
-- =============================================================================================

ALTER TABLE rail_submission DROP CONSTRAINT IF EXISTS rail_submission_late_answer_check;
ALTER TABLE rail_submission
    ADD COLUMN IF NOT EXISTS late_outcome text
        CONSTRAINT rail_submission_late_outcome_check CHECK (late_outcome IN ('ACKED', 'REJECTED')),
    ADD COLUMN IF NOT EXISTS late_rail_reference text,
    ADD COLUMN IF NOT EXISTS late_at timestamptz,
    -- Only a timed-out attempt gets a late answer, once, with its time; an acknowledgement names
    -- the rail's reference, a refusal none.
    ADD CONSTRAINT rail_submission_late_answer_check CHECK (
        (late_outcome IS NULL) = (late_at IS NULL)
        AND (late_outcome IS NULL OR outcome = 'TIMEOUT')
        AND ((late_outcome IS NOT DISTINCT FROM 'ACKED') = (late_rail_reference IS NOT NULL)));

-- As in 0012; and when the attempt was already timed out (the sweeper resolved it while the
-- forward still waited for the rail), an ACKED or REJECTED answer is kept as the late answer.
-- The attempt keeps its TIMEOUT and the payout stays RAIL_AMBIGUOUS for the operator: the late
-- answer is the evidence a resolution is checked against (pay_resolve).
CREATE OR REPLACE FUNCTION rail_record(p_submission uuid, p_outcome text, p_reference text)
RETURNS TABLE (outcome text, payout_id uuid, rail_reference text, submitted_at timestamptz,
               resolved_at timestamptz)
LANGUAGE plpgsql AS $$
DECLARE
    v_row rail_submission%ROWTYPE;
BEGIN
    IF p_outcome NOT IN ('ACKED', 'REJECTED', 'TIMEOUT') THEN
        RAISE EXCEPTION 'an attempt resolves as ACKED, REJECTED or TIMEOUT, not %', p_outcome
            USING ERRCODE = 'check_violation';
    END IF;
    UPDATE rail_submission r
       SET outcome = p_outcome,
           rail_reference = CASE WHEN p_outcome = 'ACKED' THEN p_reference END,
           resolved_at = clock_timestamp()
     WHERE r.submission_id = p_submission AND r.outcome = 'unresolved'
    RETURNING * INTO v_row;
    IF v_row.submission_id IS NULL THEN
        IF p_outcome = 'REJECTED' OR (p_outcome = 'ACKED' AND p_reference IS NOT NULL) THEN
            UPDATE rail_submission r
               SET late_outcome = p_outcome,
                   late_rail_reference = CASE WHEN p_outcome = 'ACKED' THEN p_reference END,
                   late_at = clock_timestamp()
             WHERE r.submission_id = p_submission AND r.outcome = 'TIMEOUT'
               AND r.late_outcome IS NULL;
        END IF;
        SELECT * INTO v_row FROM rail_submission r WHERE r.submission_id = p_submission;
        RETURN QUERY SELECT v_row.outcome, v_row.payout_id, v_row.rail_reference,
                            v_row.submitted_at, v_row.resolved_at;
        RETURN;
    END IF;
    UPDATE payouts p
       SET state = CASE p_outcome WHEN 'ACKED' THEN 'RAIL_ACKED'
                                  WHEN 'REJECTED' THEN 'FAILED'
                                  ELSE 'RAIL_AMBIGUOUS' END,
           rail_reference = CASE WHEN p_outcome = 'ACKED' THEN p_reference ELSE p.rail_reference END
     WHERE p.payout_id = v_row.payout_id AND p.state = 'SUBMITTING';
    RETURN QUERY SELECT v_row.outcome, v_row.payout_id, v_row.rail_reference,
                        v_row.submitted_at, v_row.resolved_at;
END $$;

-- =============================================================================================
-- 3. A resolution checked against the rail proxy's record
-- =============================================================================================

-- Out-of-band resolution of a quarantined payout, attributed (operator and identity), as in
-- 0011, checked against what the rail proxy recorded for the payout's attempt (the one
-- non-FENCED rail_submission row): its outcome, or the rail's late answer after a timeout.
-- outcome: resolved | not_claimable | not_found |
--   reference_mismatch (POSTED under another reference than the one the rail acknowledged) |
--   rail_acked (FAILED, but the rail acknowledged the transfer) |
--   rail_rejected (POSTED, but the rail declined the transfer).
-- recorded_outcome and recorded_reference are the record the refusal stands on.
DROP FUNCTION IF EXISTS pay_resolve(uuid, text, text, text, text, text, text);
CREATE OR REPLACE FUNCTION pay_resolve(p_payout_id uuid, p_outcome text, p_rail_reference text,
                                       p_operator text, p_evidence text, p_owner_id text,
                                       p_identity text)
RETURNS TABLE (outcome text, state text, account_id text, balance_minor bigint,
               recorded_outcome text, recorded_reference text, submission_id uuid)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    p payouts%ROWTYPE;
    s rail_submission%ROWTYPE;
    v_balance bigint;
    v_acked text;
    v_rejected boolean;
    v_refusal text;
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
    -- The payout's attempt. The payout row lock serializes it with rail_admit; rail_record may
    -- still add a late answer after this read, which the next resolution would see.
    SELECT * INTO s FROM rail_submission r
     WHERE r.payout_id = p_payout_id AND r.outcome <> 'FENCED';
    v_acked := coalesce(CASE WHEN s.outcome = 'ACKED' THEN s.rail_reference END,
                        CASE WHEN s.late_outcome = 'ACKED' THEN s.late_rail_reference END,
                        p.rail_reference);
    v_rejected := s.outcome = 'REJECTED' OR s.late_outcome = 'REJECTED';
    IF p_outcome = 'POSTED' AND v_acked IS NOT NULL AND v_acked <> p_rail_reference THEN
        v_refusal := 'reference_mismatch';
    ELSIF p_outcome = 'POSTED' AND v_rejected THEN
        v_refusal := 'rail_rejected';
    ELSIF p_outcome = 'FAILED' AND v_acked IS NOT NULL THEN
        v_refusal := 'rail_acked';
    END IF;
    IF v_refusal IS NOT NULL THEN
        RETURN QUERY SELECT v_refusal, p.state, p.account_id, v_balance,
                            coalesce(s.late_outcome, s.outcome), v_acked, s.submission_id;
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
    RETURN QUERY SELECT 'resolved'::text, p_outcome, p.account_id, a.balance_minor,
                        coalesce(s.late_outcome, s.outcome), v_acked, s.submission_id
                   FROM accounts a WHERE a.account_id = p.account_id;
END $$;
