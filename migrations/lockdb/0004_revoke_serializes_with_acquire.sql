-- A revocation serializes with the acquires of its key.
--
-- dlock_revoke deleted the live grant and then drew the new floor from fencing_token_seq, without
-- the per-key advisory lock that dlock_acquire takes (0002). An acquire that raced it could draw
-- its token after the delete and before the floor, wait on the uncommitted delete inside
-- INSERT ... ON CONFLICT, and be granted once the revocation committed: a live grant whose token is
-- below newTokenFloor, which every enforcement point raised to the floor then fences out, and
-- which the operator was told could not exist. The revocation now takes the same advisory lock
-- first, so an acquire of the key either committed before it (and is the grant it revokes or
-- refuses) or draws its token after the floor.

CREATE OR REPLACE FUNCTION dlock_revoke(p_key text, p_expected bigint, p_operator text, p_reason text,
                                        p_revocation uuid)
RETURNS dlock_result LANGUAGE plpgsql AS $$
DECLARE
    v_now   timestamptz;
    v_lock  locks%ROWTYPE;
    v_floor bigint;
BEGIN
    -- The lock dlock_acquire holds until commit (0002); the same key, the same hash.
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
    v_floor := nextval('fencing_token_seq');
    INSERT INTO revocations (revocation_id, lock_key, revoked_token, revoked_owner_id,
                             new_token_floor, operator, reason, revoked_at)
    VALUES (p_revocation, p_key, v_lock.fencing_token, v_lock.owner_id, v_floor,
            p_operator, p_reason, v_now);
    RETURN ROW('revoked', v_lock.fencing_token, v_lock.owner_id, v_lock.session_id,
               v_lock.acquired_at, NULL, v_floor, v_now)::dlock_result;
END $$;
