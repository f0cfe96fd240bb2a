-- Issue 13, items 15 and 16: the idempotency sweeper racing a duplicate, a retention for FENCED
-- attempts, and the ABANDONED state actually reached.

-- ---------------------------------------------------------------------------------------------
-- The idempotency record and its sweeper
-- ---------------------------------------------------------------------------------------------

-- 0001's begin read the conflicting record with a plain SELECT after `INSERT ... ON CONFLICT DO
-- NOTHING`. Between the two statements the sweeper could delete that record (it had expired),
-- and the SELECT found nothing: a "replay" with no stored answer, which the service answered 500.
-- Now the record is read under a key-share lock, which the sweeper's delete respects, and a
-- record that vanished in between is simply gone: the insert is tried again and the request runs
-- fresh, as it would have a moment later. The loop is bounded; a record that keeps changing under
-- the request is reported as in progress (lock_not_available), which the caller may retry.
CREATE OR REPLACE FUNCTION pay_idempotency_begin(p_route text, p_key text, p_token bigint,
                                                 p_owner_id text, p_payload_hash bytea,
                                                 p_retention_ms bigint, p_wait_ms integer)
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

-- The sweep skips records a request is reading (key-share locked above) instead of waiting for
-- it; they go on the next tick.
CREATE OR REPLACE FUNCTION pay_idempotency_sweep(p_batch integer) RETURNS bigint
LANGUAGE sql AS $$
    WITH gone AS (
        DELETE FROM idempotency_records
         WHERE ctid IN (SELECT ctid FROM idempotency_records
                         WHERE expires_at < clock_timestamp() LIMIT p_batch
                           FOR UPDATE SKIP LOCKED)
        RETURNING 1)
    SELECT count(*) FROM gone;
$$;

-- ---------------------------------------------------------------------------------------------
-- FENCED attempts: a retention and a sweep
-- ---------------------------------------------------------------------------------------------

-- A FENCED row records a stale writer refused before any rail call. It is evidence for the
-- incident it belongs to, and is kept for the retention (rail.proxy.fenced-retention-ms); nothing
-- decides anything from it (admission ignores FENCED rows, D-2). Every other row is the one
-- presented attempt of its payout (FR-18): deleting one would let the payout be submitted again,
-- so the database refuses it, whoever asks.
CREATE FUNCTION rail_submission_keep_attempts() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF OLD.outcome <> 'FENCED' THEN
        RAISE EXCEPTION 'rail_submission % (%) is the attempt of payout %; only FENCED rows may be deleted',
            OLD.submission_id, OLD.outcome, OLD.payout_id USING ERRCODE = 'check_violation';
    END IF;
    RETURN OLD;
END $$;
CREATE TRIGGER rail_submission_keep_attempts BEFORE DELETE ON rail_submission
    FOR EACH ROW EXECUTE FUNCTION rail_submission_keep_attempts();
-- TRUNCATE fires no row trigger: refuse it outright.
CREATE TRIGGER rail_submission_no_truncate BEFORE TRUNCATE ON rail_submission
    FOR EACH STATEMENT EXECUTE FUNCTION pay_append_only();

CREATE INDEX rail_submission_fenced_idx ON rail_submission (resolved_at) WHERE outcome = 'FENCED';

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

-- ---------------------------------------------------------------------------------------------
-- ABANDONED
-- ---------------------------------------------------------------------------------------------

-- Why a payout was abandoned, by whom, under which token. One row per payout: ABANDONED is
-- terminal.
CREATE TABLE payout_abandonments (
    payout_id      uuid PRIMARY KEY REFERENCES payouts,
    account_id     text NOT NULL REFERENCES accounts,
    -- attempts_exhausted: a claim found the payout out of attempts (payment.payout.max-attempts);
    -- cancelled: an operator cancelled it.
    cause          text NOT NULL CHECK (cause IN ('attempts_exhausted', 'cancelled')),
    from_state     text NOT NULL CHECK (from_state IN ('PENDING', 'CLAIMED')),
    attempt_count  integer NOT NULL CHECK (attempt_count >= 0),
    token          bigint NOT NULL CHECK (token > 0),
    owner_id       text NOT NULL CHECK (char_length(owner_id) BETWEEN 1 AND 64),
    -- The authenticated identity, when the caller had one; the operator's typed name for a cancel.
    identity       text CHECK (identity IS NULL OR char_length(identity) BETWEEN 1 AND 256),
    operator       text CHECK (operator IS NULL OR char_length(operator) BETWEEN 1 AND 128),
    reason         text NOT NULL CHECK (char_length(reason) BETWEEN 8 AND 4096),
    recorded_at    timestamptz NOT NULL DEFAULT clock_timestamp(),
    CHECK (cause <> 'cancelled' OR (identity IS NOT NULL AND operator IS NOT NULL))
);
CREATE TRIGGER payout_abandonments_append_only BEFORE UPDATE OR DELETE OR TRUNCATE
    ON payout_abandonments FOR EACH STATEMENT EXECUTE FUNCTION pay_append_only();

-- The transition table allows PENDING | CLAIMED -> ABANDONED. The database adds what makes it
-- safe: never once an attempt reached the rail proxy (a non-FENCED rail_submission row means the
-- money may have moved, and then only the rail's statement decides), and never without its
-- record in payout_abandonments, in the same transaction.
CREATE FUNCTION pay_payouts_abandon_guard() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF EXISTS (SELECT 1 FROM rail_submission r
               WHERE r.payout_id = NEW.payout_id AND r.outcome <> 'FENCED') THEN
        RAISE EXCEPTION 'payout % has an attempt at the rail and cannot be abandoned',
            NEW.payout_id USING ERRCODE = 'check_violation';
    END IF;
    IF NOT EXISTS (SELECT 1 FROM payout_abandonments a
                   WHERE a.payout_id = NEW.payout_id AND a.from_state = OLD.state) THEN
        RAISE EXCEPTION 'payout % is abandoned only with its payout_abandonments record',
            NEW.payout_id USING ERRCODE = 'check_violation';
    END IF;
    RETURN NEW;
END $$;
CREATE TRIGGER payouts_abandon_guard BEFORE UPDATE OF state ON payouts
    FOR EACH ROW WHEN (NEW.state = 'ABANDONED' AND OLD.state <> 'ABANDONED')
    EXECUTE FUNCTION pay_payouts_abandon_guard();

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
