-- lockdb 0008: L5 renew is the holding session's alone.
--
-- dlock_renew of the baseline (0007) matched the grant on (key, token, owner) and checked only
-- that the caller's session was live, so another session of the same owner (a second worker
-- under one owner id, or an operator, who may name any owner) renewed the grant and received a
-- fresh proof of its token. The grant is now also matched on its session: a renew through any
-- other session is LOCK_LOST, as for any non-holder, and changes nothing. The etcd backend
-- checks the same (services/lock-server/src/store/etcd/locks.rs).
CREATE OR REPLACE FUNCTION dlock_renew(p_key text, p_session uuid, p_owner text, p_token bigint,
                                       p_ttl_ms integer)
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
      AND l.owner_id = p_owner AND l.session_id = p_session
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
