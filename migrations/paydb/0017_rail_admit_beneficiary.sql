-- paydb 0017: the rail proxy admits only the payout as it was registered.
--
-- rail_admit compared a submission's account, amount and currency with the payout's row but not
-- its beneficiary, so a holder of a valid claim could send the payout's money to another
-- beneficiary through the proxy. It now takes the submission's beneficiaryRef (p_beneficiary)
-- and refuses ('mismatch') a submission whose account, amount, currency or beneficiary differs
-- from the payout's, naming the fields that differ (docs/contract.md#s3-5); nothing is recorded
-- and no mark moves. The rest of the function is 0012's, unchanged.
--
-- Like 0013 and 0014, this file can run again on a database that already has its changes (the
-- old signature dropped IF EXISTS, the new one CREATE OR REPLACE).

DROP FUNCTION IF EXISTS rail_admit(uuid, text, bigint, text, bigint, text, uuid, text);

CREATE OR REPLACE FUNCTION rail_admit(p_payout uuid, p_account text, p_amount bigint,
                                      p_currency text, p_beneficiary text, p_token bigint,
                                      p_key text, p_submission uuid, p_request text)
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
    v_differs  text;
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

    -- What reaches the rail is the registered payout: its account, amount, currency and
    -- beneficiary. A submission that differs in any of them is refused before any mark moves;
    -- resource_type names the fields that differ, in the contract's spelling.
    v_differs := array_to_string(ARRAY[
        CASE WHEN v_payout.account_id <> p_account THEN 'accountId' END,
        CASE WHEN v_payout.amount_minor <> p_amount THEN 'amountMinor' END,
        CASE WHEN v_payout.currency <> p_currency THEN 'currency' END,
        CASE WHEN v_payout.beneficiary_ref <> p_beneficiary THEN 'beneficiaryRef' END], ',');
    IF v_differs <> '' THEN
        RETURN QUERY SELECT 'mismatch', NULL::bigint, v_differs, v_payout.state, NULL::uuid,
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

    -- Step 2: one presented attempt per payout, whatever the token (docs/contract.md#rail-step-2).
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
