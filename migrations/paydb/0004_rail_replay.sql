-- Idempotent replay at the rail proxy (C3 §3.1, DESIGN D-7).
--
-- The identical request retried by the same holder (same X-Idempotency-Key, same X-Fencing-Token,
-- same body) gets the first answer back and is never forwarded again; it is not a duplicate
-- attempt and does not page. The same key and token with another body is IDEMPOTENCY_CONFLICT.
-- A different token for a payout that already has an attempt stays DUPLICATE_SUBMISSION (or
-- FENCED_OUT): the token is part of the idempotency scope.

-- SHA-256 of the canonical request (never the request itself: bodies name beneficiaries), and
-- the answer given for the attempt once it was resolved. Rows from before this migration have
-- neither: a retry of one is answered from its outcome.
ALTER TABLE rail_submission
    ADD COLUMN request_hash    bytea CHECK (octet_length(request_hash) = 32),
    ADD COLUMN response_status smallint CHECK (response_status BETWEEN 200 AND 599),
    ADD COLUMN response_body   bytea,
    ADD CHECK ((response_status IS NULL) = (response_body IS NULL)),
    -- An answer is stored only for a resolved attempt.
    ADD CHECK (response_status IS NULL OR outcome <> 'unresolved');
CREATE INDEX rail_submission_key_token_idx ON rail_submission (idempotency_key, presented_token);

DROP FUNCTION rail_admit(uuid, text, bigint, text, bigint, text, uuid);

-- 0002's admission with the replay check first: after the payout row lock, before anything else
-- is decided. outcome 'replay' returns the first attempt (its outcome and stored answer);
-- 'conflict' names the attempt whose key and token another body reused.
CREATE FUNCTION rail_admit(p_payout uuid, p_account text, p_amount bigint, p_currency text,
                           p_token bigint, p_key text, p_submission uuid, p_request text)
RETURNS TABLE (outcome text, highest_token bigint, resource_type text, state text,
               submission_id uuid, submission_outcome text, response_status smallint,
               response_body bytea)
LANGUAGE plpgsql AS $$
DECLARE
    v_payout   payouts%ROWTYPE;
    v_high     bigint;
    v_fence    bigint;
    v_existing rail_submission%ROWTYPE;
    v_same     rail_submission%ROWTYPE;
    v_hash     bytea := sha256(convert_to(p_request, 'UTF8'));
BEGIN
    -- The payout row lock serializes every submission of one payout.
    SELECT * INTO v_payout FROM payouts WHERE payout_id = p_payout FOR UPDATE;
    IF NOT FOUND THEN
        RETURN QUERY SELECT 'payout_unknown', NULL::bigint, NULL::text, NULL::text, NULL::uuid,
                            NULL::text, NULL::smallint, NULL::bytea;
        RETURN;
    END IF;

    -- Replay: an attempt presented under this very key and token. FENCED rows never reached
    -- the rail and are answered afresh (a stale token stays fenced).
    SELECT * INTO v_same FROM rail_submission r
    WHERE r.idempotency_key = p_key AND r.presented_token = p_token AND r.outcome <> 'FENCED'
    ORDER BY r.submitted_at LIMIT 1;
    IF v_same.submission_id IS NOT NULL AND v_same.request_hash IS NOT NULL THEN
        IF v_same.payout_id = p_payout AND v_same.request_hash = v_hash THEN
            RETURN QUERY SELECT 'replay', p_token, NULL::text, v_payout.state,
                                v_same.submission_id, v_same.outcome, v_same.response_status,
                                v_same.response_body;
        ELSE
            RETURN QUERY SELECT 'conflict', p_token, NULL::text, v_payout.state,
                                v_same.submission_id, v_same.outcome, NULL::smallint, NULL::bytea;
        END IF;
        RETURN;
    END IF;

    IF v_payout.account_id <> p_account OR v_payout.amount_minor <> p_amount
       OR v_payout.currency <> p_currency THEN
        RETURN QUERY SELECT 'mismatch', NULL::bigint, NULL::text, v_payout.state, NULL::uuid,
                            NULL::text, NULL::smallint, NULL::bytea;
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
        -- The same payout and token under another key (or an attempt from before replay was
        -- recorded) is a duplicate, not a stale writer. Either way nothing reaches the rail.
        IF v_existing.submission_id IS NOT NULL AND v_existing.presented_token = p_token THEN
            RETURN QUERY SELECT 'duplicate', v_high, NULL::text, v_payout.state,
                                v_existing.submission_id, v_existing.outcome, NULL::smallint,
                                NULL::bytea;
            RETURN;
        END IF;
        INSERT INTO rail_submission (submission_id, payout_id, account_id, presented_token,
                                     idempotency_key, outcome, resolved_at)
        VALUES (p_submission, p_payout, p_account, p_token, p_key, 'FENCED', clock_timestamp());
        RETURN QUERY SELECT 'fenced', v_high, 'rail', v_payout.state, p_submission, 'FENCED',
                            NULL::smallint, NULL::bytea;
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
                            'account', v_payout.state, p_submission, 'FENCED', NULL::smallint,
                            NULL::bytea;
        RETURN;
    END IF;

    -- Step 2: one presented attempt per payout, whatever the token (FR-18).
    IF v_existing.submission_id IS NOT NULL THEN
        RETURN QUERY SELECT 'duplicate', v_high, NULL::text, v_payout.state,
                            v_existing.submission_id, v_existing.outcome, NULL::smallint,
                            NULL::bytea;
        RETURN;
    END IF;
    -- Only a payout claimed with this very token may be submitted.
    IF v_payout.state <> 'CLAIMED' OR v_payout.claim_token <> p_token THEN
        RETURN QUERY SELECT 'not_claimable', v_high, NULL::text, v_payout.state, NULL::uuid,
                            NULL::text, NULL::smallint, NULL::bytea;
        RETURN;
    END IF;

    -- Step 3: the intent (with the request's hash), the advanced mark and the payout's
    -- SUBMITTING state commit together, before any network call.
    UPDATE rail_high_water h SET highest_token = p_token, updated_at = clock_timestamp()
    WHERE h.account_id = p_account;
    INSERT INTO rail_submission (submission_id, payout_id, account_id, presented_token,
                                 idempotency_key, request_hash)
    VALUES (p_submission, p_payout, p_account, p_token, p_key, v_hash);
    UPDATE payouts p SET state = 'SUBMITTING', submission_id = p_submission
    WHERE p.payout_id = p_payout;
    RETURN QUERY SELECT 'admitted', p_token, NULL::text, 'SUBMITTING', p_submission, 'unresolved',
                        NULL::smallint, NULL::bytea;
END $$;

-- Stores the answer given for a resolved attempt, once: a replay returns exactly it.
CREATE FUNCTION rail_store_answer(p_submission uuid, p_outcome text, p_status smallint,
                                  p_body bytea)
RETURNS boolean
LANGUAGE sql AS $$
    WITH stored AS (
        UPDATE rail_submission r SET response_status = p_status, response_body = p_body
        WHERE r.submission_id = p_submission AND r.outcome = p_outcome
          AND r.response_status IS NULL
        RETURNING 1
    )
    SELECT EXISTS (SELECT 1 FROM stored);
$$;
