-- lockdb 0010: the epoch check before every token lockdb hands out or reports, not only before a
-- grant (docs/design.md#d-12).
--
-- 0009 runs the epoch check in a trigger on `locks`, so the sequence jumps past the gap on the
-- first grant of a new timeline. Two other readers of the sequence came before any grant:
--   * a revocation draws its `new_token_floor` from the sequence: on a new timeline before any
--     grant, that floor could equal a token the lost commits handed out, and would not fence its
--     holder out;
--   * `dlock recover paydb-epoch` raises paydb's fences to "the highest token the lock server has
--     issued": read from the sequence as it is, that is below tokens the lost commits issued when
--     lockdb went back too, and their holders would pass paydb's fences.
-- Both now run the same check first: dlock_epoch_advance() applies it (the jump, the record, the
-- warning) and returns the floor every token of this epoch is above; dlock_epoch_floor() returns
-- the highest token lockdb may ever have issued, after the check: the operator's floor.
-- Written to run again harmlessly (dlock/tests/it/squash.rs applies migrations twice).

CREATE OR REPLACE FUNCTION dlock_epoch_advance() RETURNS bigint LANGUAGE plpgsql AS $$
DECLARE
    v_timeline bigint := dlock_timeline();
    v_epoch    store_epoch;
    v_highest  bigint;
BEGIN
    SELECT * INTO v_epoch FROM store_epoch;
    IF v_epoch.timeline = v_timeline THEN
        RETURN v_epoch.floor;
    END IF;
    SELECT * INTO v_epoch FROM store_epoch FOR UPDATE;
    IF v_epoch.timeline <> v_timeline THEN
        SELECT GREATEST((SELECT last_value FROM fencing_token_seq),
                        (SELECT coalesce(max(fencing_token), 0) FROM locks),
                        (SELECT coalesce(max(new_token_floor), 0) FROM revocations),
                        v_epoch.floor)
          INTO v_highest;
        v_epoch.floor := v_highest + v_epoch.token_gap;
        PERFORM setval('fencing_token_seq', v_epoch.floor, true);
        UPDATE store_epoch
           SET timeline = v_timeline, floor = v_epoch.floor, since = clock_timestamp();
        INSERT INTO store_epoch_changes (from_timeline, to_timeline, highest_known, floor)
        VALUES (v_epoch.timeline, v_timeline, v_highest, v_epoch.floor);
        RAISE WARNING 'lockdb is on timeline % (tokens were issued on %): it may have lost '
                      'commits, so tokens continue above % (the highest known, %, plus the gap)',
                      v_timeline, v_epoch.timeline, v_epoch.floor, v_highest;
    END IF;
    RETURN v_epoch.floor;
END $$;

CREATE OR REPLACE FUNCTION dlock_epoch_guard() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    v_floor bigint;
BEGIN
    v_floor := dlock_epoch_advance();
    -- Drawn before the floor was set (by this grant or a concurrent one): draw again, above it.
    IF NEW.fencing_token <= v_floor THEN
        NEW.fencing_token := nextval('fencing_token_seq');
    END IF;
    RETURN NEW;
END $$;

-- The highest token lockdb may ever have issued, the lost commits' included: after the epoch
-- check, the sequence (every token of this epoch was drawn from it) or the epoch's floor (every
-- token of an earlier epoch, lost ones too, is below it), whichever is higher.
CREATE OR REPLACE FUNCTION dlock_epoch_floor() RETURNS bigint LANGUAGE plpgsql AS $$
DECLARE
    v_floor bigint := dlock_epoch_advance();
BEGIN
    RETURN GREATEST(v_floor, (SELECT last_value FROM fencing_token_seq));
END $$;

-- As in the baseline, with the epoch check before the floor is drawn.
CREATE OR REPLACE FUNCTION dlock_revoke(p_key text, p_expected bigint, p_operator text, p_reason text,
                             p_revocation uuid, p_caller text DEFAULT NULL)
RETURNS dlock_result LANGUAGE plpgsql AS $$
DECLARE
    v_now   timestamptz;
    v_lock  locks%ROWTYPE;
    v_floor bigint;
BEGIN
    -- The lock dlock_acquire holds until commit; the same key, the same hash.
    PERFORM pg_advisory_xact_lock(hashtextextended('dlock_acquire:' || p_key, 0));
    -- The clock is read once the key is ours: the wait may have been long.
    v_now := clock_timestamp();

    SELECT l.* INTO v_lock FROM locks l JOIN sessions s ON s.session_id = l.session_id
    WHERE l.lock_key = p_key AND l.expires_at > v_now AND s.expires_at > v_now
    FOR UPDATE OF l;
    IF v_lock.lock_key IS NULL THEN
        RETURN ROW('not_held', NULL, NULL, NULL, NULL, NULL, NULL, v_now)::dlock_result;
    END IF;
    IF p_expected IS NOT NULL AND p_expected <> v_lock.fencing_token THEN
        RETURN ROW('fenced_out', v_lock.fencing_token, v_lock.owner_id, v_lock.session_id,
                   v_lock.acquired_at, v_lock.expires_at, NULL, v_now)::dlock_result;
    END IF;
    DELETE FROM locks WHERE lock_key = p_key AND fencing_token = v_lock.fencing_token;
    -- On a new timeline the sequence may be below tokens the lost commits issued: move it past
    -- them first, so the floor fences their holders out too.
    PERFORM dlock_epoch_advance();
    v_floor := nextval('fencing_token_seq');
    INSERT INTO revocations (revocation_id, lock_key, revoked_token, revoked_owner_id,
                             new_token_floor, operator, reason, revoked_at, revoked_by)
    VALUES (p_revocation, p_key, v_lock.fencing_token, v_lock.owner_id, v_floor,
            p_operator, p_reason, v_now, p_caller);
    RETURN ROW('revoked', v_lock.fencing_token, v_lock.owner_id, v_lock.session_id,
               v_lock.acquired_at, NULL, v_floor, v_now)::dlock_result;
END $$;
