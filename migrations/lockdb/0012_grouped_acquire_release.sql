-- lockdb 0012: acquires and releases grouped into one transaction (docs/design.md#group-commit).
--
-- The lock server queues the acquires (and, apart, the releases) that arrive while a transaction
-- of their kind runs and sends the next ones together (services/lock-server/src/store/pg_batch.rs,
-- `lock.pg.batch.max`). dlock_acquire_many and dlock_release_many take a batch as arrays, one
-- element per item, and make exactly the decisions dlock_acquire and dlock_release (0007) make for
-- each item alone; they answer one row per item, numbered from 1 in array order. A request alone
-- still goes through the per-row function.
--
-- * At most one item per key: the caller keeps a second request on a key for the next batch, and
--   both functions refuse a batch that names a key twice (an error: nothing is written).
-- * One clock for the batch, read once at its start, as each per-row function reads it once.
-- * Acquires take the per-key advisory lock of dlock_acquire (the one dlock_revoke takes too), for
--   every item whose session is live, in key order; then the row locks of the lapsed grants they
--   delete, in key order; a release takes the row locks of the grants it deletes in key order.
--   Two batches (two replicas) and a batch and a single request therefore never wait on each
--   other in a cycle. (dlock_sweep deletes lapsed grants in no particular order: should it and a
--   batch ever deadlock, PostgreSQL ends one of the two, and the lock server runs that batch's
--   items again one by one.)
-- * Every grant is an INSERT into `locks`, so the epoch trigger of 0009/0010 checks each grant
--   of a batch in the batch's transaction: the first grant on a new timeline moves the sequence
--   10^9 past the highest known token and any grant whose token was drawn below that floor draws
--   again. Each token is a nextval of fencing_token_seq drawn at the insert, in key order; no
--   token is drawn ahead or kept in the lock server.
--
-- Written to run again harmlessly (dlock/tests/it/squash.rs applies migrations twice).

DO $$
BEGIN
    CREATE TYPE dlock_item_result AS (
        item           integer,
        outcome        text,
        fencing_token  bigint,
        owner_id       text,
        session_id     uuid,
        acquired_at    timestamptz,
        expires_at     timestamptz,
        waiter_count   bigint,
        server_time    timestamptz
    );
EXCEPTION WHEN duplicate_object THEN NULL;
END $$;

CREATE OR REPLACE FUNCTION dlock_acquire_many(p_keys text[], p_sessions uuid[], p_owners text[],
                                              p_ttls integer[], p_waiters uuid[])
RETURNS SETOF dlock_item_result LANGUAGE plpgsql AS $$
DECLARE
    v_now     timestamptz := clock_timestamp();
    v_n       integer := coalesce(cardinality(p_keys), 0);
    v_states  text[];
    v_live    text[];
    v_heads   uuid[];
    v_granted text[];
    v_tokens  bigint[];
    v_expires timestamptz[];
    v_key     text;
    v_i       integer;
    v_at      integer;
    v_res     dlock_result;
BEGIN
    IF coalesce(cardinality(p_sessions), 0) <> v_n OR coalesce(cardinality(p_owners), 0) <> v_n
       OR coalesce(cardinality(p_ttls), 0) <> v_n OR coalesce(cardinality(p_waiters), 0) <> v_n THEN
        RAISE EXCEPTION 'dlock_acquire_many: the arrays of a batch have one element per item';
    END IF;
    IF (SELECT count(DISTINCT k) FROM unnest(p_keys) AS k) <> v_n THEN
        RAISE EXCEPTION 'dlock_acquire_many: a batch names each key at most once';
    END IF;

    -- Each item's session, as dlock_session_state (0007) judges it: an owner mismatch reads as
    -- unknown.
    v_states := ARRAY(SELECT CASE
                                 WHEN s.session_id IS NULL OR s.owner_id <> i.o THEN 'session_unknown'
                                 WHEN s.expires_at <= v_now THEN 'session_expired'
                                 ELSE 'live'
                             END
                      FROM unnest(p_sessions, p_owners) WITH ORDINALITY AS i(s, o, n)
                      LEFT JOIN sessions s ON s.session_id = i.s
                      ORDER BY i.n);
    v_live := ARRAY(SELECT i.k FROM unnest(p_keys, v_states) AS i(k, st)
                    WHERE i.st = 'live' ORDER BY i.k);

    -- One acquire of a key at a time, until commit, in key order (as dlock_acquire, 0007).
    FOREACH v_key IN ARRAY v_live LOOP
        PERFORM pg_advisory_xact_lock(hashtextextended('dlock_acquire:' || v_key, 0));
    END LOOP;

    -- The lapsed grants on the batch's keys are released here (their own TTL passed, or their
    -- session ended), their rows locked in key order first.
    PERFORM 1 FROM locks l
    WHERE l.lock_key = ANY (v_live)
      AND (l.expires_at <= v_now
           OR NOT EXISTS (SELECT 1 FROM sessions s
                          WHERE s.session_id = l.session_id AND s.expires_at > v_now))
    ORDER BY l.lock_key
    FOR UPDATE OF l;
    DELETE FROM locks l
    WHERE l.lock_key = ANY (v_live)
      AND (l.expires_at <= v_now
           OR NOT EXISTS (SELECT 1 FROM sessions s
                          WHERE s.session_id = l.session_id AND s.expires_at > v_now));

    -- The head of each key's live queue.
    v_heads := ARRAY(SELECT (SELECT w.waiter_id
                             FROM lock_waiters w JOIN sessions s ON s.session_id = w.session_id
                             WHERE w.lock_key = i.k AND w.deadline > v_now AND s.expires_at > v_now
                             ORDER BY w.position LIMIT 1)
                     FROM unnest(p_keys) WITH ORDINALITY AS i(k, n)
                     ORDER BY i.n);

    -- The grants: a live session first in line (the head when it waits, anyone when nobody
    -- waits), on a key no live grant holds. Inserted in key order, each drawing its token.
    WITH granted AS (
        INSERT INTO locks (lock_key, fencing_token, session_id, owner_id, ttl_ms, acquired_at,
                           expires_at)
        SELECT i.k, nextval('fencing_token_seq'), i.s, i.o, i.t, v_now,
               v_now + i.t * interval '1 millisecond'
        FROM unnest(p_keys, p_sessions, p_owners, p_ttls, p_waiters, v_states, v_heads)
             AS i(k, s, o, t, w, st, h)
        WHERE i.st = 'live' AND (i.h IS NULL OR i.h = i.w)
        ORDER BY i.k
        ON CONFLICT (lock_key) DO NOTHING
        RETURNING lock_key, fencing_token, expires_at
    )
    SELECT coalesce(array_agg(g.lock_key), '{}'), coalesce(array_agg(g.fencing_token), '{}'),
           coalesce(array_agg(g.expires_at), '{}')
    INTO v_granted, v_tokens, v_expires
    FROM granted g;

    -- A granted waiter leaves the queue; a grant records when its key was last granted (a sweep
    -- racing this upsert re-checks last_granted_at on the updated row and keeps it).
    DELETE FROM lock_waiters w
    USING unnest(p_keys, p_waiters) AS i(k, w)
    WHERE i.w IS NOT NULL AND i.k = ANY (v_granted) AND w.waiter_id = i.w;
    INSERT INTO lock_keys_seen (lock_key, first_seen_at, last_granted_at)
    SELECT k, v_now, v_now FROM unnest(v_granted) AS k ORDER BY k
    ON CONFLICT (lock_key) DO UPDATE SET last_granted_at = EXCLUDED.last_granted_at;

    -- One row per item, in item order (a loop: each function is called once per item).
    FOR v_i IN 1..v_n LOOP
        v_at := array_position(v_granted, p_keys[v_i]);
        IF v_states[v_i] <> 'live' THEN
            v_res := ROW(v_states[v_i], NULL, NULL, NULL, NULL, NULL, NULL, v_now)::dlock_result;
        ELSIF v_at IS NOT NULL THEN
            v_res := ROW('granted', v_tokens[v_at], p_owners[v_i], p_sessions[v_i], v_now,
                         v_expires[v_at], dlock_waiter_count(p_keys[v_i], v_now),
                         v_now)::dlock_result;
        ELSE
            v_res := dlock_holder(p_keys[v_i], 'contended', v_now);
        END IF;
        RETURN NEXT ROW(v_i, v_res.outcome, v_res.fencing_token, v_res.owner_id,
                        v_res.session_id, v_res.acquired_at, v_res.expires_at,
                        v_res.waiter_count, v_res.server_time)::dlock_item_result;
    END LOOP;
END $$;

CREATE OR REPLACE FUNCTION dlock_release_many(p_keys text[], p_tokens bigint[], p_owners text[])
RETURNS SETOF dlock_item_result LANGUAGE plpgsql AS $$
DECLARE
    v_now      timestamptz := clock_timestamp();
    v_n        integer := coalesce(cardinality(p_keys), 0);
    v_released text[];
    v_i        integer;
    v_res      dlock_result;
BEGIN
    IF coalesce(cardinality(p_tokens), 0) <> v_n OR coalesce(cardinality(p_owners), 0) <> v_n THEN
        RAISE EXCEPTION 'dlock_release_many: the arrays of a batch have one element per item';
    END IF;
    IF (SELECT count(DISTINCT k) FROM unnest(p_keys) AS k) <> v_n THEN
        RAISE EXCEPTION 'dlock_release_many: a batch names each key at most once';
    END IF;

    -- Compare-and-delete on (key, token), by the grant's owner only (dlock_release, 0007), the
    -- rows locked in key order first.
    PERFORM 1 FROM locks l
    JOIN unnest(p_keys, p_tokens, p_owners) AS i(k, t, o)
      ON l.lock_key = i.k AND l.fencing_token = i.t AND l.owner_id = i.o
    ORDER BY l.lock_key
    FOR UPDATE OF l;
    WITH deleted AS (
        DELETE FROM locks l
        USING unnest(p_keys, p_tokens, p_owners) AS i(k, t, o)
        WHERE l.lock_key = i.k AND l.fencing_token = i.t AND l.owner_id = i.o
        RETURNING l.lock_key,
                  l.expires_at > v_now
                  AND EXISTS (SELECT 1 FROM sessions s
                              WHERE s.session_id = l.session_id AND s.expires_at > v_now) AS live
    )
    SELECT coalesce(array_agg(d.lock_key) FILTER (WHERE d.live), '{}')
    INTO v_released FROM deleted d;

    -- Released when the grant deleted was live; otherwise LOCK_LOST with the key's live grant.
    FOR v_i IN 1..v_n LOOP
        IF p_keys[v_i] = ANY (v_released) THEN
            v_res := ROW('released', p_tokens[v_i], NULL, NULL, NULL, NULL, NULL,
                         v_now)::dlock_result;
        ELSE
            v_res := dlock_holder(p_keys[v_i], 'lock_lost', v_now);
        END IF;
        RETURN NEXT ROW(v_i, v_res.outcome, v_res.fencing_token, v_res.owner_id,
                        v_res.session_id, v_res.acquired_at, v_res.expires_at,
                        v_res.waiter_count, v_res.server_time)::dlock_item_result;
    END LOOP;
END $$;
