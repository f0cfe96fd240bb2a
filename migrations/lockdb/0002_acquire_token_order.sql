-- Tokens of one key are issued in the order the key is granted.
--
-- The first dlock_acquire drew its token inside INSERT ... ON CONFLICT DO NOTHING. When two
-- acquires of one key raced, PostgreSQL could retry the losing insert later with the token it had
-- already drawn, and grant it after a newer token had been granted and released on the key: a
-- token going backwards, which every fence downstream would take for a stale holder. The mutual
-- exclusion test found it. Acquires of one key now serialize on an advisory lock held to commit,
-- so the token is drawn only by the one acquire that can insert.

-- L4, one attempt. Grants the key when no live grant holds it and the caller is first in line:
-- the head of the live queue when it waits (p_waiter), or anyone when nobody waits.
CREATE OR REPLACE FUNCTION dlock_acquire(p_key text, p_session uuid, p_owner text, p_ttl_ms integer, p_waiter uuid)
RETURNS dlock_result LANGUAGE plpgsql AS $$
DECLARE
    v_now     timestamptz := clock_timestamp();
    v_state   text := dlock_session_state(p_session, p_owner, v_now);
    v_head    uuid;
    v_token   bigint;
    v_expires timestamptz;
BEGIN
    IF v_state <> 'live' THEN
        RETURN ROW(v_state, NULL, NULL, NULL, NULL, NULL, NULL, v_now)::dlock_result;
    END IF;

    -- One acquire of a key at a time, until commit. Without it, INSERT ... ON CONFLICT could
    -- draw its token, lose a race, and retry the same insert later with that older token —
    -- after a newer token had already been granted and released on the key.
    PERFORM pg_advisory_xact_lock(hashtextextended('dlock_acquire:' || p_key, 0));

    -- A lapsed grant is released here: its own TTL passed, or its session ended.
    DELETE FROM locks l
    WHERE l.lock_key = p_key
      AND (l.expires_at <= v_now
           OR NOT EXISTS (SELECT 1 FROM sessions s
                          WHERE s.session_id = l.session_id AND s.expires_at > v_now));

    SELECT w.waiter_id INTO v_head
    FROM lock_waiters w JOIN sessions s ON s.session_id = w.session_id
    WHERE w.lock_key = p_key AND w.deadline > v_now AND s.expires_at > v_now
    ORDER BY w.position LIMIT 1;
    IF v_head IS NOT NULL AND v_head IS DISTINCT FROM p_waiter THEN
        RETURN dlock_holder(p_key, 'contended', v_now);
    END IF;

    INSERT INTO locks (lock_key, fencing_token, session_id, owner_id, ttl_ms, acquired_at, expires_at)
    VALUES (p_key, nextval('fencing_token_seq'), p_session, p_owner, p_ttl_ms, v_now,
            v_now + p_ttl_ms * interval '1 millisecond')
    ON CONFLICT (lock_key) DO NOTHING
    RETURNING fencing_token, expires_at INTO v_token, v_expires;
    IF v_token IS NULL THEN
        RETURN dlock_holder(p_key, 'contended', v_now);
    END IF;

    IF p_waiter IS NOT NULL THEN
        DELETE FROM lock_waiters WHERE waiter_id = p_waiter;
    END IF;
    INSERT INTO lock_keys_seen (lock_key) VALUES (p_key) ON CONFLICT DO NOTHING;
    RETURN ROW('granted', v_token, p_owner, p_session, v_now, v_expires,
               dlock_waiter_count(p_key, v_now), v_now)::dlock_result;
END $$;

