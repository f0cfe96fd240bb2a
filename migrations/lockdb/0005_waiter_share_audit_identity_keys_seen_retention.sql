-- Issue 13, items 11, 13 and 16 (the lock server's part).
--
-- 1. A session's share of a key's waiter queue (item 11). The cap of a key's queue
--    (lock.waiters.max-per-key) was the only bound, so one session could take every place with
--    concurrent waiting acquires and every other session heard CONTENTION_EXCEEDED. A session now
--    has at most p_session_cap live places in one key's queue (lock.waiters.max-per-session,
--    default 1: a session that already waits for a key gains nothing by waiting twice, since the
--    key can be granted to it only once). Over its share it hears CONTENTION_EXCEEDED, C3's code
--    for "the caller's own budget for this key is exhausted".
--
-- 2. Who revoked (item 13). `operator` is free text from the request body: anyone allowed to
--    call L8 can write any name there. The identity the auth layer authenticated is now stored
--    beside it (`revoked_by`); NULL when the lock server runs with auth.mode = none, where no
--    credential was checked.
--
-- 3. A retention for lock_keys_seen (item 16). The table only lets L7 tell "never seen" (404)
--    from "not held now" (200, held=false); it takes no part in the token order, which comes from
--    the one global fencing_token_seq (0001) and is never reset, and it holds no revocation floor
--    (that is the sequence too, and the revocations table, which is not swept). A row can go once
--    its key has not been granted for the retention, has no grant row and no waiter: L7 then
--    answers 404 for it again, and the next grant draws a token from the same sequence, above
--    every token issued before. So the row records when the key was last granted.
--
-- Older replicas keep working during a rollout: the new arguments have defaults, so a call with
-- the old argument list binds to the new function (the share defaults to 1, the caller to NULL,
-- and an old sweep sweeps no keys).

ALTER TABLE lock_keys_seen ADD COLUMN last_granted_at timestamptz;
UPDATE lock_keys_seen SET last_granted_at = first_seen_at;
ALTER TABLE lock_keys_seen ALTER COLUMN last_granted_at SET NOT NULL,
                           ALTER COLUMN last_granted_at SET DEFAULT clock_timestamp();
CREATE INDEX lock_keys_seen_last_granted_at_idx ON lock_keys_seen (last_granted_at);

ALTER TABLE revocations ADD COLUMN revoked_by text
    CHECK (revoked_by IS NULL OR char_length(revoked_by) BETWEEN 1 AND 512);

CREATE INDEX lock_waiters_key_session_idx ON lock_waiters (lock_key, session_id);

-- L4, one attempt: as in 0002, and a grant records when its key was last granted.
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

    -- One acquire of a key at a time, until commit (0002).
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
    -- A sweep racing this upsert re-checks last_granted_at on the updated row and keeps it.
    INSERT INTO lock_keys_seen (lock_key, first_seen_at, last_granted_at)
    VALUES (p_key, v_now, v_now)
    ON CONFLICT (lock_key) DO UPDATE SET last_granted_at = EXCLUDED.last_granted_at;
    RETURN ROW('granted', v_token, p_owner, p_session, v_now, v_expires,
               dlock_waiter_count(p_key, v_now), v_now)::dlock_result;
END $$;

-- Joins the FIFO queue of a key, unless the queue is at its cap or the session already has its
-- share of it. The advisory lock serializes enqueues per key so both bounds are exact.
DROP FUNCTION dlock_enqueue(text, uuid, text, uuid, integer, integer);
CREATE FUNCTION dlock_enqueue(p_key text, p_session uuid, p_owner text, p_waiter uuid,
                              p_deadline_ms integer, p_cap integer, p_session_cap integer DEFAULT 1)
RETURNS dlock_result LANGUAGE plpgsql AS $$
DECLARE
    v_now     timestamptz := clock_timestamp();
    v_state   text := dlock_session_state(p_session, p_owner, v_now);
    v_count   bigint;
    v_mine    bigint;
BEGIN
    IF v_state <> 'live' THEN
        RETURN ROW(v_state, NULL, NULL, NULL, NULL, NULL, NULL, v_now)::dlock_result;
    END IF;
    PERFORM pg_advisory_xact_lock(hashtextextended(p_key, 0));
    -- The clock is read again once the key is ours: the wait may have been long.
    v_now := clock_timestamp();
    SELECT count(*) INTO v_mine FROM lock_waiters w
    WHERE w.lock_key = p_key AND w.session_id = p_session AND w.deadline > v_now;
    IF v_mine >= p_session_cap THEN
        RETURN ROW('session_share', NULL, NULL, NULL, NULL, NULL,
                   dlock_waiter_count(p_key, v_now), v_now)::dlock_result;
    END IF;
    v_count := dlock_waiter_count(p_key, v_now);
    IF v_count >= p_cap THEN
        RETURN dlock_holder(p_key, 'queue_full', v_now);
    END IF;
    INSERT INTO lock_waiters (waiter_id, lock_key, session_id, deadline)
    VALUES (p_waiter, p_key, p_session, v_now + p_deadline_ms * interval '1 millisecond');
    RETURN ROW('queued', NULL, NULL, NULL, NULL, NULL, v_count + 1, v_now)::dlock_result;
END $$;

-- L8, as in 0004, and the authenticated caller is recorded beside the free-text operator.
DROP FUNCTION dlock_revoke(text, bigint, text, text, uuid);
CREATE FUNCTION dlock_revoke(p_key text, p_expected bigint, p_operator text, p_reason text,
                             p_revocation uuid, p_caller text DEFAULT NULL)
RETURNS dlock_result LANGUAGE plpgsql AS $$
DECLARE
    v_now   timestamptz;
    v_lock  locks%ROWTYPE;
    v_floor bigint;
BEGIN
    PERFORM pg_advisory_xact_lock(hashtextextended('dlock_acquire:' || p_key, 0));
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
                             new_token_floor, operator, reason, revoked_at, revoked_by)
    VALUES (p_revocation, p_key, v_lock.fencing_token, v_lock.owner_id, v_floor,
            p_operator, p_reason, v_now, p_caller);
    RETURN ROW('revoked', v_lock.fencing_token, v_lock.owner_id, v_lock.session_id,
               v_lock.acquired_at, NULL, v_floor, v_now)::dlock_result;
END $$;

-- Physical clean-up, as in 0001, plus the keys not granted for p_keys_seen_retention_ms that
-- nobody holds or waits for (NULL: keep every key). At most 10000 keys a call, so one sweep
-- never holds a long transaction; the next tick takes the rest.
DROP FUNCTION dlock_sweep(bigint);
CREATE FUNCTION dlock_sweep(p_retention_ms bigint, p_keys_seen_retention_ms bigint DEFAULT NULL)
RETURNS bigint LANGUAGE plpgsql AS $$
DECLARE
    v_now     timestamptz := clock_timestamp();
    v_removed bigint := 0;
    v_n       bigint;
BEGIN
    DELETE FROM locks l
    WHERE l.expires_at <= v_now
       OR NOT EXISTS (SELECT 1 FROM sessions s WHERE s.session_id = l.session_id AND s.expires_at > v_now);
    GET DIAGNOSTICS v_n = ROW_COUNT; v_removed := v_removed + v_n;
    DELETE FROM lock_waiters WHERE deadline <= v_now;
    GET DIAGNOSTICS v_n = ROW_COUNT; v_removed := v_removed + v_n;
    DELETE FROM sessions WHERE expires_at <= v_now - p_retention_ms * interval '1 millisecond';
    GET DIAGNOSTICS v_n = ROW_COUNT; v_removed := v_removed + v_n;
    IF p_keys_seen_retention_ms IS NOT NULL THEN
        DELETE FROM lock_keys_seen k
        WHERE k.lock_key IN (
            SELECT o.lock_key FROM lock_keys_seen o
            WHERE o.last_granted_at <= v_now - p_keys_seen_retention_ms * interval '1 millisecond'
              AND NOT EXISTS (SELECT 1 FROM locks l WHERE l.lock_key = o.lock_key)
              AND NOT EXISTS (SELECT 1 FROM lock_waiters w WHERE w.lock_key = o.lock_key)
            ORDER BY o.last_granted_at
            LIMIT 10000)
          -- Re-checked on the row as it is when the delete reaches it: a grant that committed
          -- in between moved last_granted_at, and the key stays.
          AND k.last_granted_at <= v_now - p_keys_seen_retention_ms * interval '1 millisecond';
        GET DIAGNOSTICS v_n = ROW_COUNT; v_removed := v_removed + v_n;
    END IF;
    RETURN v_removed;
END $$;
