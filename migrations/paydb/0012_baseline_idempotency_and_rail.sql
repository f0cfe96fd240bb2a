-- paydb baseline, part 4 of 4 (after 0011): the idempotency records, the protected writes in one
-- call each, and the rail proxy's writes.

-- =============================================================================================
-- Idempotency records, and the protected writes in one call each
-- =============================================================================================

-- The first step of every idempotent write, in the write's own transaction.
-- A concurrent duplicate blocks on the primary key until the first transaction ends, then sees
-- its committed record: the effect runs once and every duplicate replays its answer. The wait is
-- bounded by `lock_timeout` for this statement only, so a stuck first request cannot pile up
-- duplicates forever.
--
-- The conflicting record is read under a key-share lock, which the sweeper's delete respects:
-- read with a plain SELECT, a record the sweeper deleted (it had expired) between the insert and
-- the read was found missing, a "replay" with no stored answer, which the service answered 500.
-- A record that vanished in between is simply gone: the insert is tried again and the request
-- runs fresh, as it would have a moment later. The loop is bounded; a record that keeps changing
-- under the request is reported as in progress (lock_not_available), which the caller may retry.
-- outcome: fresh | replay | conflict
CREATE FUNCTION pay_idempotency_begin(p_route text, p_key text, p_token bigint, p_owner_id text,
                                      p_payload_hash bytea, p_retention_ms bigint,
                                      p_wait_ms integer)
RETURNS TABLE (outcome text, response_status smallint, response_body bytea)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    r idempotency_records%ROWTYPE;
    inserted integer;
    found_it boolean;
BEGIN
    FOR attempt IN 1..3 LOOP
        PERFORM set_config('lock_timeout', p_wait_ms::text, true);
        INSERT INTO idempotency_records (route, idempotency_key, fencing_token, owner_id,
                                         payload_hash, status, expires_at)
        VALUES (p_route, p_key, p_token, p_owner_id, p_payload_hash, 'in_progress',
                clock_timestamp() + p_retention_ms * interval '1 millisecond')
        ON CONFLICT DO NOTHING;
        GET DIAGNOSTICS inserted = ROW_COUNT;
        IF inserted = 1 THEN
            PERFORM set_config('lock_timeout', '0', true);
            RETURN QUERY SELECT 'fresh'::text, NULL::smallint, NULL::bytea;
            RETURN;
        END IF;
        SELECT * INTO r FROM idempotency_records x
         WHERE x.route = p_route AND x.idempotency_key = p_key AND x.fencing_token = p_token
           FOR KEY SHARE;
        found_it := FOUND;
        PERFORM set_config('lock_timeout', '0', true);
        IF found_it THEN
            IF r.payload_hash <> p_payload_hash THEN
                RETURN QUERY SELECT 'conflict'::text, NULL::smallint, NULL::bytea;
            ELSE
                RETURN QUERY SELECT 'replay'::text, r.response_status, r.response_body;
            END IF;
            RETURN;
        END IF;
        -- Swept between the insert and the read: try again.
    END LOOP;
    RAISE EXCEPTION 'the idempotency record of % % kept changing; retry', p_route, p_key
        USING ERRCODE = 'lock_not_available';
END $$;

-- Deletes expired records, a bounded batch at a time. Returns how many went. It skips records a
-- request is reading (key-share locked by pay_idempotency_begin) instead of waiting for it; they
-- go on the next tick.
CREATE FUNCTION pay_idempotency_sweep(p_batch integer) RETURNS bigint
LANGUAGE sql AS $$
    WITH gone AS (
        DELETE FROM idempotency_records
         WHERE ctid IN (SELECT ctid FROM idempotency_records
                         WHERE expires_at < clock_timestamp() LIMIT p_batch
                           FOR UPDATE SKIP LOCKED)
        RETURNING 1)
    SELECT count(*) FROM gone;
$$;

-- One call per protected write, so that the idempotency record and the effect cost one round
-- trip.
--
-- P2 in one call: the request's idempotency record (pay_idempotency_begin) and, when the
-- request is fresh, pay_claim_bounded, in the caller's transaction. begin_outcome is fresh,
-- replay or conflict; the effect's columns are set only when fresh.
CREATE FUNCTION pay_claim_once(p_route text, p_key text, p_token bigint, p_owner_id text,
                               p_payload_hash bytea, p_retention_ms bigint, p_wait_ms integer,
                               p_payout_id uuid, p_expected_state text, p_max_attempts integer)
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
                                          p_owner_id) c;
END $$;

-- P3 in one call: the idempotency record, pay_post and, when posted, the posting's two entries
-- (DEBIT first, as the answer lists them) as a JSON array.
CREATE FUNCTION pay_post_once(p_route text, p_key text, p_token bigint, p_owner_id text,
                              p_payload_hash bytea, p_retention_ms bigint, p_wait_ms integer,
                              p_payout_id uuid, p_rail_reference text, p_submission_id uuid)
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
    SELECT * INTO r FROM pay_post(p_payout_id, p_token, p_rail_reference, p_submission_id);
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

-- =============================================================================================
-- The rail proxy's writes: admission (C3 §3.5 steps 1–3) and outcome recording, each one
-- transaction, so that no code path can forward without a durable intent and no token can
-- submit twice for an account.
-- =============================================================================================

-- Steps 1 to 3 of the admission order, in that order, in one transaction. The caller forwards to
-- the rail only when this returns 'admitted', and only after it has committed.
--
-- Idempotent replay (C3 §3.1, DESIGN D-7) is checked first: after the payout row lock, before
-- anything else is decided. The identical request retried by the same holder (same
-- X-Idempotency-Key, same X-Fencing-Token, same body) gets the first answer back ('replay': the
-- first attempt, its outcome and stored answer) and is never forwarded again; it is not a
-- duplicate attempt and does not page. The same key and token with another body is 'conflict'
-- (IDEMPOTENCY_CONFLICT), naming the attempt whose key and token it reused. A different token
-- for a payout that already has an attempt stays 'duplicate' (DUPLICATE_SUBMISSION) or 'fenced'
-- (FENCED_OUT): the token is part of the idempotency scope.
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

-- Stores the answer given for a resolved attempt, once: a replay returns exactly it. Called as a
-- statement of its own for every attempt the rail proxy answers, hence PL/pgSQL.
CREATE FUNCTION rail_store_answer(p_submission uuid, p_outcome text, p_status smallint,
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

-- Deletes FENCED rows resolved more than p_older_than_ms ago, a bounded batch at a time.
-- Returns how many went.
CREATE FUNCTION rail_sweep_fenced(p_older_than_ms bigint, p_batch integer) RETURNS bigint
LANGUAGE sql AS $$
    WITH gone AS (
        DELETE FROM rail_submission
         WHERE submission_id IN (
               SELECT r.submission_id FROM rail_submission r
                WHERE r.outcome = 'FENCED'
                  AND r.resolved_at < clock_timestamp() - p_older_than_ms * interval '1 millisecond'
                LIMIT p_batch FOR UPDATE SKIP LOCKED)
           AND outcome = 'FENCED'
        RETURNING 1)
    SELECT count(*) FROM gone;
$$;

-- D-3: raises an account's rail high-water mark to a revocation floor, so that every write with
-- the revoked token (or any older one) is fenced at the rail from now on. Attributed (operator
-- and identity) in rail_fence_advances.
CREATE FUNCTION rail_advance_high_water(p_account text, p_floor bigint, p_operator text,
                                        p_owner text, p_reason text, p_revocation uuid,
                                        p_identity text)
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
                                     identity, owner_id, reason, revocation_id)
    VALUES (p_account, v_previous, p_floor, v_new, p_operator, p_identity, p_owner, p_reason,
            p_revocation);
    RETURN QUERY SELECT v_previous, v_new;
END $$;

-- D-8: the rail proxy's recovery of a poisoned high-water mark. outcome: lowered | unchanged |
-- not_found.
CREATE FUNCTION rail_lower_high_water(p_account text, p_to bigint, p_operator text,
                                      p_identity text, p_owner text, p_reason text)
RETURNS TABLE (outcome text, previous_token bigint, highest_token bigint, recovery_id bigint)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    v_high bigint;
    v_id   bigint;
BEGIN
    PERFORM 1 FROM accounts a WHERE a.account_id = p_account;
    IF NOT FOUND THEN
        RETURN QUERY SELECT 'not_found'::text, NULL::bigint, NULL::bigint, NULL::bigint;
        RETURN;
    END IF;
    SELECT h.highest_token INTO v_high FROM rail_high_water h
    WHERE h.account_id = p_account FOR UPDATE;
    IF NOT FOUND OR v_high <= p_to THEN
        RETURN QUERY SELECT 'unchanged'::text, coalesce(v_high, 0), coalesce(v_high, 0), NULL::bigint;
        RETURN;
    END IF;
    INSERT INTO fence_recoveries (resource, account_id, previous_token, new_token, operator,
                                  identity, owner_id, reason)
    VALUES ('rail', p_account, v_high, p_to, p_operator, p_identity, p_owner, p_reason)
    RETURNING fence_recoveries.recovery_id INTO v_id;
    UPDATE rail_high_water h SET highest_token = p_to, updated_at = clock_timestamp()
    WHERE h.account_id = p_account;
    RETURN QUERY SELECT 'lowered'::text, v_high, p_to, v_id;
END $$;
