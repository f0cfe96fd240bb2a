-- Renew (L5) and release (L6) are bound to the grant's owner.
--
-- A fencing token is public: L7 and GET /v1/locks show it to anyone. Until now renew matched a
-- grant on (key, token) alone, and release deleted on (key, token) alone, so any identity with a
-- live session of its own could extend or end another owner's grant. The compare-and-delete on
-- (key, token) stays exactly as the contract writes it; on top of it, the caller's owner id (the
-- X-Owner-Id the server has bound to the caller's credential) must be the grant's owner.
--
-- A caller who is not the owner hears LOCK_LOST (409), the code C3 gives a non-holder on L5 and
-- L6: "the caller is no longer the holder". It is not a new code, it discloses nothing that L7 does
-- not already show, and the remedy it prescribes (re-acquire, get a token of your own) is the right
-- one for a caller who never held the grant. Nothing is changed in that case.

-- L5. Extends a live grant, found by (key, token) and held by the caller; the token never changes.
CREATE OR REPLACE FUNCTION dlock_renew(p_key text, p_session uuid, p_owner text, p_token bigint, p_ttl_ms integer)
RETURNS dlock_result LANGUAGE plpgsql AS $$
DECLARE
    v_now   timestamptz := clock_timestamp();
    v_state text := dlock_session_state(p_session, p_owner, v_now);
    v_row   dlock_result;
BEGIN
    IF v_state <> 'live' THEN
        RETURN ROW(v_state, NULL, NULL, NULL, NULL, NULL, NULL, v_now)::dlock_result;
    END IF;
    UPDATE locks l
    SET expires_at = v_now + COALESCE(p_ttl_ms, l.ttl_ms) * interval '1 millisecond',
        ttl_ms = COALESCE(p_ttl_ms, l.ttl_ms)
    FROM sessions s
    WHERE l.lock_key = p_key AND l.fencing_token = p_token AND l.expires_at > v_now
      AND l.owner_id = p_owner
      AND s.session_id = l.session_id AND s.expires_at > v_now
    RETURNING 'renewed', l.fencing_token, l.owner_id, l.session_id, l.acquired_at,
              l.expires_at, 0::bigint, v_now
    INTO v_row;
    IF v_row.outcome IS NULL THEN
        RETURN dlock_holder(p_key, 'lock_lost', v_now);
    END IF;
    v_row.waiter_count := dlock_waiter_count(p_key, v_now);
    RETURN v_row;
END $$;

-- L6. Compare-and-delete on (key, token), by the grant's owner only. Deleting a lapsed grant of
-- one's own is harmless, but the caller hears LOCK_LOST: it was no longer the holder. Another
-- owner's grant is left alone, live or not, and the caller hears LOCK_LOST too.
CREATE FUNCTION dlock_release(p_key text, p_token bigint, p_owner text)
RETURNS dlock_result LANGUAGE plpgsql AS $$
DECLARE
    v_now  timestamptz := clock_timestamp();
    v_live boolean;
BEGIN
    DELETE FROM locks l
    WHERE l.lock_key = p_key AND l.fencing_token = p_token AND l.owner_id = p_owner
    RETURNING l.expires_at > v_now
              AND EXISTS (SELECT 1 FROM sessions s
                          WHERE s.session_id = l.session_id AND s.expires_at > v_now)
    INTO v_live;
    IF v_live THEN
        RETURN ROW('released', p_token, NULL, NULL, NULL, NULL, NULL, v_now)::dlock_result;
    END IF;
    RETURN dlock_holder(p_key, 'lock_lost', v_now);
END $$;

-- The unbound release must not stay callable: a replica of an older build would keep the hole
-- open. Replicas of this build call the three-argument form only.
DROP FUNCTION dlock_release(text, bigint);
