-- paydb 0021: the epoch recovery moves out of reach every payout the rail received but paydb lost
-- (docs/design.md#d-12).
--
-- An asynchronous promotion can lose a claim and the rail proxy's intent after the rail received
-- the payout: paydb shows it PENDING or CLAIMED with no attempt presented, and the next holder
-- would claim it and present it to the rail a second time. Raising the fences (0020) does not stop
-- that: the next holder's token is newer. So `dlock recover paydb-epoch` reads the rail's
-- statement and passes the payouts the rail holds; in the same transaction as the epoch
-- confirmation, each of them that paydb shows PENDING or CLAIMED with no attempt presented is
-- claimed under the recovery's token floor and quarantined RAIL_AMBIGUOUS (it holds its amount:
-- the money moved), for the operator's evidence-based resolution. Each one is recorded in
-- pay_epoch_quarantined. The three-argument pay_epoch_confirm, which took no statement, refuses.
-- Written to run again harmlessly (dlock/tests/it/squash.rs applies migrations twice).

INSERT INTO payout_transitions (from_state, to_state, actor)
VALUES ('CLAIMED', 'RAIL_AMBIGUOUS', 'epoch recovery: on the rail, no attempt left in paydb')
ON CONFLICT DO NOTHING;

-- CLAIMED -> RAIL_AMBIGUOUS only inside pay_epoch_confirm (which sets dlock.epoch_recovery for
-- its transaction): the rail proxy's own path goes through SUBMITTING.
CREATE OR REPLACE FUNCTION pay_payouts_quarantine_guard() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF current_setting('dlock.epoch_recovery', true) IS DISTINCT FROM 'on' THEN
        RAISE EXCEPTION 'payout % may go from CLAIMED to RAIL_AMBIGUOUS only in the epoch '
                        'recovery (dlock recover paydb-epoch)', OLD.payout_id
            USING ERRCODE = 'check_violation';
    END IF;
    RETURN NEW;
END $$;
CREATE OR REPLACE TRIGGER payouts_quarantine_guard BEFORE UPDATE OF state ON payouts
    FOR EACH ROW WHEN (OLD.state = 'CLAIMED' AND NEW.state = 'RAIL_AMBIGUOUS')
    EXECUTE FUNCTION pay_payouts_quarantine_guard();

-- Every payout the recovery quarantined, for the operator: kept, never swept.
CREATE TABLE IF NOT EXISTS pay_epoch_quarantined (
    payout_id      uuid PRIMARY KEY REFERENCES payouts,
    to_timeline    bigint NOT NULL,
    from_state     text NOT NULL CHECK (from_state IN ('PENDING', 'CLAIMED')),
    quarantined_at timestamptz NOT NULL DEFAULT clock_timestamp()
);

ALTER TABLE pay_store_epoch_changes ADD COLUMN IF NOT EXISTS quarantined integer;

CREATE OR REPLACE FUNCTION pay_epoch_confirm(p_floor bigint, p_operator text, p_reason text)
RETURNS TABLE (from_timeline bigint, to_timeline bigint, fences_raised integer,
               marks_raised integer)
LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION USING
        ERRCODE = '0A000',
        MESSAGE = 'pay_epoch_confirm needs the payouts on the rail''s statement: run '
                  '`dlock recover paydb-epoch --rail <the rail>`, which reads it';
END $$;

-- p_on_rail: the payouts the rail's statement holds (its clientRefs).
CREATE OR REPLACE FUNCTION pay_epoch_confirm(p_floor bigint, p_operator text, p_reason text,
                                             p_on_rail uuid[])
RETURNS TABLE (from_timeline bigint, to_timeline bigint, fences_raised integer,
               marks_raised integer, quarantined integer)
LANGUAGE plpgsql AS $$
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
