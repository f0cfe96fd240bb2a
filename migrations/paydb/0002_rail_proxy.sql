-- The rail proxy's side of paydb: admission (C3 §3.5 steps 1–3) and outcome recording, each one
-- transaction, so that no code path can forward without a durable intent and no token can
-- submit twice for an account.

-- Steps 1 to 3 of the admission order, in that order, in one transaction. The caller forwards to
-- the rail only when this returns 'admitted', and only after it has committed.
CREATE FUNCTION rail_admit(p_payout uuid, p_account text, p_amount bigint, p_currency text,
                           p_token bigint, p_key text, p_submission uuid)
RETURNS TABLE (outcome text, highest_token bigint, resource_type text, state text,
               submission_id uuid, submission_outcome text)
LANGUAGE plpgsql AS $$
DECLARE
    v_payout   payouts%ROWTYPE;
    v_high     bigint;
    v_fence    bigint;
    v_existing rail_submission%ROWTYPE;
BEGIN
    -- The payout row lock serializes every submission of one payout.
    SELECT * INTO v_payout FROM payouts WHERE payout_id = p_payout FOR UPDATE;
    IF NOT FOUND THEN
        RETURN QUERY SELECT 'payout_unknown', NULL::bigint, NULL::text, NULL::text, NULL::uuid, NULL::text;
        RETURN;
    END IF;
    IF v_payout.account_id <> p_account OR v_payout.amount_minor <> p_amount
       OR v_payout.currency <> p_currency THEN
        RETURN QUERY SELECT 'mismatch', NULL::bigint, NULL::text, v_payout.state, NULL::uuid, NULL::text;
        RETURN;
    END IF;

    -- Step 1: the account's durable high-water mark, strict. The row lock serializes every
    -- submission of one account, whichever proxy replica it reached.
    INSERT INTO rail_high_water (account_id, highest_token) VALUES (p_account, 0)
    ON CONFLICT (account_id) DO NOTHING;
    SELECT h.highest_token INTO v_high FROM rail_high_water h
    WHERE h.account_id = p_account FOR UPDATE;
    SELECT * INTO v_existing FROM rail_submission r
    WHERE r.payout_id = p_payout AND r.outcome <> 'FENCED';
    IF p_token <= v_high THEN
        -- The same attempt sent again (same payout, same token) is a duplicate, not a stale
        -- writer: answer what it is. Either way nothing reaches the rail.
        IF v_existing.submission_id IS NOT NULL AND v_existing.presented_token = p_token THEN
            RETURN QUERY SELECT 'duplicate', v_high, NULL::text, v_payout.state,
                                v_existing.submission_id, v_existing.outcome;
            RETURN;
        END IF;
        INSERT INTO rail_submission (submission_id, payout_id, account_id, presented_token,
                                     idempotency_key, outcome, resolved_at)
        VALUES (p_submission, p_payout, p_account, p_token, p_key, 'FENCED', clock_timestamp());
        RETURN QUERY SELECT 'fenced', v_high, 'rail', v_payout.state, p_submission, 'FENCED';
        RETURN;
    END IF;
    -- A token below the account's fence or the payout's latest claim belongs to a holder that
    -- has been superseded, even if the newer holder has not submitted yet.
    SELECT a.fence INTO v_fence FROM accounts a WHERE a.account_id = p_account;
    IF p_token < v_fence OR p_token < coalesce(v_payout.claim_token, 0) THEN
        INSERT INTO rail_submission (submission_id, payout_id, account_id, presented_token,
                                     idempotency_key, outcome, resolved_at)
        VALUES (p_submission, p_payout, p_account, p_token, p_key, 'FENCED', clock_timestamp());
        RETURN QUERY SELECT 'fenced', greatest(v_fence, coalesce(v_payout.claim_token, 0)),
                            'account', v_payout.state, p_submission, 'FENCED';
        RETURN;
    END IF;

    -- Step 2: one presented attempt per payout, whatever the token (FR-18).
    IF v_existing.submission_id IS NOT NULL THEN
        RETURN QUERY SELECT 'duplicate', v_high, NULL::text, v_payout.state,
                            v_existing.submission_id, v_existing.outcome;
        RETURN;
    END IF;
    -- Only a payout claimed with this very token may be submitted.
    IF v_payout.state <> 'CLAIMED' OR v_payout.claim_token <> p_token THEN
        RETURN QUERY SELECT 'not_claimable', v_high, NULL::text, v_payout.state, NULL::uuid, NULL::text;
        RETURN;
    END IF;

    -- Step 3: the intent, the advanced mark and the payout's SUBMITTING state commit together,
    -- before any network call.
    UPDATE rail_high_water h SET highest_token = p_token, updated_at = clock_timestamp()
    WHERE h.account_id = p_account;
    INSERT INTO rail_submission (submission_id, payout_id, account_id, presented_token, idempotency_key)
    VALUES (p_submission, p_payout, p_account, p_token, p_key);
    UPDATE payouts p SET state = 'SUBMITTING', submission_id = p_submission
    WHERE p.payout_id = p_payout;
    RETURN QUERY SELECT 'admitted', p_token, NULL::text, 'SUBMITTING', p_submission, 'unresolved';
END $$;

-- Records the one outcome of a forwarded attempt and moves the payout with it: ACKED →
-- RAIL_ACKED, REJECTED → FAILED (the hold is released), TIMEOUT → RAIL_AMBIGUOUS (quarantine).
-- An attempt is resolved once; a late answer after the sweeper timed it out changes nothing.
CREATE FUNCTION rail_record(p_submission uuid, p_outcome text, p_reference text)
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

-- D-5: an intent still unresolved after the rail read timeout plus a margin belongs to a proxy
-- that died mid-flight. It becomes TIMEOUT and its payout RAIL_AMBIGUOUS; it is never forwarded
-- again. Returns the payouts it quarantined.
CREATE FUNCTION rail_expire_unresolved(p_older_than_ms bigint)
RETURNS TABLE (submission_id uuid, payout_id uuid)
LANGUAGE plpgsql AS $$
DECLARE
    v_row rail_submission%ROWTYPE;
BEGIN
    FOR v_row IN
        SELECT * FROM rail_submission r
        WHERE r.outcome = 'unresolved'
          AND r.submitted_at < clock_timestamp() - p_older_than_ms * interval '1 millisecond'
        FOR UPDATE SKIP LOCKED
    LOOP
        UPDATE rail_submission r SET outcome = 'TIMEOUT', resolved_at = clock_timestamp()
        WHERE r.submission_id = v_row.submission_id;
        UPDATE payouts p SET state = 'RAIL_AMBIGUOUS'
        WHERE p.payout_id = v_row.payout_id AND p.state = 'SUBMITTING';
        submission_id := v_row.submission_id;
        payout_id := v_row.payout_id;
        RETURN NEXT;
    END LOOP;
END $$;

-- D-3: every revocation floor pushed to the rail, attributed.
CREATE TABLE rail_fence_advances (
    advance_id     bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    account_id     text NOT NULL REFERENCES accounts,
    previous_token bigint NOT NULL,
    floor_token    bigint NOT NULL CHECK (floor_token > 0),
    -- The mark only ever rises: a floor below it leaves it where it was.
    new_token      bigint NOT NULL CHECK (new_token >= previous_token AND new_token >= floor_token),
    operator       text NOT NULL CHECK (char_length(operator) BETWEEN 1 AND 128),
    owner_id       text NOT NULL,
    reason         text NOT NULL CHECK (char_length(reason) BETWEEN 1 AND 4096),
    revocation_id  uuid,
    recorded_at    timestamptz NOT NULL DEFAULT clock_timestamp()
);

-- D-3: raises an account's rail high-water mark to a revocation floor, so that every write with
-- the revoked token (or any older one) is fenced at the rail from now on.
CREATE FUNCTION rail_advance_high_water(p_account text, p_floor bigint, p_operator text,
                                        p_owner text, p_reason text, p_revocation uuid)
RETURNS TABLE (previous_token bigint, new_token bigint)
LANGUAGE plpgsql AS $$
DECLARE
    v_previous bigint;
    v_new      bigint;
BEGIN
    INSERT INTO rail_high_water (account_id, highest_token) VALUES (p_account, 0)
    ON CONFLICT (account_id) DO NOTHING;
    SELECT h.highest_token INTO v_previous FROM rail_high_water h
    WHERE h.account_id = p_account FOR UPDATE;
    v_new := greatest(v_previous, p_floor);
    UPDATE rail_high_water h SET highest_token = v_new, updated_at = clock_timestamp()
    WHERE h.account_id = p_account;
    INSERT INTO rail_fence_advances (account_id, previous_token, floor_token, new_token, operator,
                                     owner_id, reason, revocation_id)
    VALUES (p_account, v_previous, p_floor, v_new, p_operator, p_owner, p_reason, p_revocation);
    RETURN QUERY SELECT v_previous, v_new;
END $$;
