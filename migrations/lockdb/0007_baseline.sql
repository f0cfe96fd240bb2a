-- lockdb: the sessions, grants and fencing tokens of the dlock lock server (backend `pg`).
--
-- Every rule that decides who holds a lock lives here, in functions that run in one transaction
-- each, against the database clock (clock_timestamp()). The lock server is a stateless HTTP
-- front: any number of replicas on one lockdb behave as one, because none of them decides
-- anything on its own.
--
-- This file is the whole schema. Versions 1 to 6 are the history it replaces (their files are in
-- git history; migrations/lockdb/retired.tsv lists them): a database that applied them is adopted
-- when a service starts, which rewrites its migration rows to this version in one transaction
-- (services/server/src/squash.rs). A change goes into a new migration, numbered from 8.

-- One global sequence for every key: a token identifies its grant on its own, tokens of different
-- keys are comparable, and a revocation floor is simply the next value. NO CYCLE, because a
-- sequence that wrapped around would issue a token below one already issued, and every fence
-- downstream would let the stale holder back in.
CREATE SEQUENCE fencing_token_seq AS bigint MINVALUE 1 START 1 NO CYCLE;

CREATE TABLE sessions (
    session_id  uuid PRIMARY KEY,
    -- The contract bounds owner ids to 64 characters; attribution must fit in a log line.
    owner_id    text NOT NULL CHECK (char_length(owner_id) BETWEEN 1 AND 64),
    -- The TTLs the contract allows. A session outside them is a bug in the server, not input.
    ttl_ms      integer NOT NULL CHECK (ttl_ms BETWEEN 1000 AND 60000),
    created_at  timestamptz NOT NULL DEFAULT clock_timestamp(),
    -- Past this instant (database clock) the session is dead and its locks are released. The row
    -- stays for the retention so that a late heartbeat hears SESSION_EXPIRED, not SESSION_UNKNOWN.
    expires_at  timestamptz NOT NULL
);
CREATE INDEX sessions_expires_at_idx ON sessions (expires_at);

CREATE TABLE locks (
    -- The key alphabet of the contract, enforced where the key is stored.
    lock_key      text PRIMARY KEY CHECK (lock_key ~ '^[a-zA-Z0-9:._-]{1,128}$'),
    -- Unique: a token names exactly one grant, which is what makes release a compare-and-delete
    -- on (key, token) and nothing else.
    fencing_token bigint NOT NULL UNIQUE CHECK (fencing_token > 0),
    -- A grant cannot outlive its session's row: ending a session deletes its grants.
    session_id    uuid NOT NULL REFERENCES sessions ON DELETE CASCADE,
    owner_id      text NOT NULL,
    ttl_ms        integer NOT NULL CHECK (ttl_ms BETWEEN 1000 AND 60000),
    acquired_at   timestamptz NOT NULL,
    expires_at    timestamptz NOT NULL,
    CHECK (expires_at > acquired_at)
);
CREATE INDEX locks_session_id_idx ON locks (session_id);

-- Keys ever granted, so that an advisory read (L7) can tell "never seen" (404) from "not held
-- now" (200, held=false). It takes no part in the token order, which comes from the one global
-- fencing_token_seq and is never reset, and it holds no revocation floor (that is the sequence
-- too, and the revocations table, which is not swept). So a row may go once its key has not been
-- granted for the retention and has no grant and no waiter (dlock_sweep): L7 answers 404 for it
-- again, and the next grant draws a token above every token issued before.
CREATE TABLE lock_keys_seen (
    lock_key        text PRIMARY KEY,
    first_seen_at   timestamptz NOT NULL DEFAULT clock_timestamp(),
    last_granted_at timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE INDEX lock_keys_seen_last_granted_at_idx ON lock_keys_seen (last_granted_at);

-- The FIFO queue of acquires waiting server-side (waitMillis > 0). It lives in the database, not
-- in a replica's memory, so that the order is one order whichever replica a waiter landed on.
CREATE TABLE lock_waiters (
    waiter_id  uuid PRIMARY KEY,
    lock_key   text NOT NULL,
    session_id uuid NOT NULL REFERENCES sessions ON DELETE CASCADE,
    -- Arrival order; the head of the queue is the lowest position.
    position   bigint GENERATED ALWAYS AS IDENTITY,
    -- A waiter whose replica died is skipped once this passes, and swept later.
    deadline   timestamptz NOT NULL
);
CREATE INDEX lock_waiters_key_position_idx ON lock_waiters (lock_key, position);
CREATE INDEX lock_waiters_key_session_idx ON lock_waiters (lock_key, session_id);

-- Every forced revocation, for the audit trail: who, why, which grant, and the floor it set.
CREATE TABLE revocations (
    revocation_id    uuid PRIMARY KEY,
    lock_key         text NOT NULL,
    revoked_token    bigint NOT NULL,
    revoked_owner_id text NOT NULL,
    -- The floor must exceed the revoked token, or the evicted holder would not be fenced out.
    new_token_floor  bigint NOT NULL CHECK (new_token_floor > revoked_token),
    -- Free text from the request body: anyone allowed to call L8 can write any name here.
    operator         text NOT NULL CHECK (char_length(operator) BETWEEN 1 AND 128),
    reason           text NOT NULL CHECK (char_length(reason) BETWEEN 8 AND 1024),
    revoked_at       timestamptz NOT NULL DEFAULT clock_timestamp(),
    -- The identity the caller's credential authenticated as; NULL when the lock server runs with
    -- auth.mode = none, where no credential was checked.
    revoked_by       text CHECK (revoked_by IS NULL OR char_length(revoked_by) BETWEEN 1 AND 512)
);

-- The helpers below are PL/pgSQL, not LANGUAGE sql: a SQL function whose body has a FROM clause
-- is not inlined into its caller, and PostgreSQL (before 18) parses and plans such a body again
-- on every call from PL/pgSQL. In PL/pgSQL the same queries are planned once per connection and
-- the plans are kept (0.75 ms of an acquire's 0.88 ms in the database were the parser and the
-- planner when they were SQL). STABLE: they read with the snapshot of the statement that calls
-- them.

-- Whether a session is alive now. An owner mismatch reads as unknown: a caller cannot probe or
-- use another owner's session.
CREATE FUNCTION dlock_session_state(p_session uuid, p_owner text, p_now timestamptz)
RETURNS text LANGUAGE plpgsql STABLE AS $$
BEGIN
    RETURN (SELECT CASE
                WHEN s.session_id IS NULL OR s.owner_id <> p_owner THEN 'session_unknown'
                WHEN s.expires_at <= p_now THEN 'session_expired'
                ELSE 'live'
            END
            FROM (SELECT 1) AS one
            LEFT JOIN sessions s ON s.session_id = p_session);
END $$;

-- The live waiters of a key: deadline not passed, session alive.
CREATE FUNCTION dlock_waiter_count(p_key text, p_now timestamptz)
RETURNS bigint LANGUAGE plpgsql STABLE AS $$
BEGIN
    RETURN (SELECT count(*) FROM lock_waiters w JOIN sessions s ON s.session_id = w.session_id
            WHERE w.lock_key = p_key AND w.deadline > p_now AND s.expires_at > p_now);
END $$;

-- The result row shared by the functions below.
CREATE TYPE dlock_result AS (
    outcome        text,
    fencing_token  bigint,
    owner_id       text,
    session_id     uuid,
    acquired_at    timestamptz,
    expires_at     timestamptz,
    waiter_count   bigint,
    server_time    timestamptz
);

-- The live grant on a key, if any, as a result row with the given outcome.
CREATE FUNCTION dlock_holder(p_key text, p_outcome text, p_now timestamptz)
RETURNS dlock_result LANGUAGE plpgsql STABLE AS $$
BEGIN
    RETURN (SELECT ROW(p_outcome, l.fencing_token, l.owner_id, l.session_id, l.acquired_at,
                       l.expires_at, dlock_waiter_count(p_key, p_now), p_now)::dlock_result
            FROM (SELECT 1) AS one
            LEFT JOIN (locks l JOIN sessions s ON s.session_id = l.session_id AND s.expires_at > p_now)
                   ON l.lock_key = p_key AND l.expires_at > p_now);
END $$;

-- L4, one attempt. Grants the key when no live grant holds it and the caller is first in line:
-- the head of the live queue when it waits (p_waiter), or anyone when nobody waits. Acquires of
-- one key serialize on an advisory lock held to commit, so the token is drawn only by the one
-- acquire that can insert, and the tokens of a key are issued in the order it is granted (the
-- mutual exclusion test once found a token going backwards without it). A grant records when its
-- key was last granted; a sweep racing this upsert re-checks last_granted_at and keeps the key.
CREATE FUNCTION dlock_acquire(p_key text, p_session uuid, p_owner text, p_ttl_ms integer, p_waiter uuid)
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
    -- A sweep racing this upsert re-checks last_granted_at on the updated row and keeps it.
    INSERT INTO lock_keys_seen (lock_key, first_seen_at, last_granted_at)
    VALUES (p_key, v_now, v_now)
    ON CONFLICT (lock_key) DO UPDATE SET last_granted_at = EXCLUDED.last_granted_at;
    RETURN ROW('granted', v_token, p_owner, p_session, v_now, v_expires,
               dlock_waiter_count(p_key, v_now), v_now)::dlock_result;
END $$;

-- Joins the FIFO queue of a key, unless the queue is at its cap (lock.waiters.max-per-key) or the
-- session already has its share of it (lock.waiters.max-per-session, default 1: a session that
-- already waits for a key gains nothing by waiting twice, since the key can be granted to it only
-- once; without the share one session could take every place and every other session would hear
-- CONTENTION_EXCEEDED). Over its share a session hears CONTENTION_EXCEEDED, C3's code for "the
-- caller's own budget for this key is exhausted". The advisory lock serializes enqueues per key
-- so both bounds are exact.
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

-- Renew (L5) and release (L6) are bound to the grant's owner. A fencing token is public (L7 and
-- GET /v1/locks show it to anyone), so matching a grant on (key, token) alone would let any
-- identity with a live session of its own extend or end another owner's grant. The
-- compare-and-delete on (key, token) stays exactly as the contract writes it; on top of it, the
-- caller's owner id (the X-Owner-Id the server has bound to the caller's credential) must be the
-- grant's owner. A caller who is not the owner hears LOCK_LOST (409), the code C3 gives a
-- non-holder on L5 and L6: it discloses nothing that L7 does not already show, and the remedy it
-- prescribes (re-acquire, get a token of your own) is the right one. Nothing is changed then.

-- L5. Extends a live grant, found by (key, token) and held by the caller; the token never changes.
CREATE FUNCTION dlock_renew(p_key text, p_session uuid, p_owner text, p_token bigint, p_ttl_ms integer)
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

-- L2. Extends a live session by its TTL.
CREATE FUNCTION dlock_heartbeat(p_session uuid, p_owner text)
RETURNS dlock_result LANGUAGE plpgsql AS $$
DECLARE
    v_now     timestamptz := clock_timestamp();
    v_expires timestamptz;
BEGIN
    UPDATE sessions SET expires_at = v_now + ttl_ms * interval '1 millisecond'
    WHERE session_id = p_session AND owner_id = p_owner AND expires_at > v_now
    RETURNING expires_at INTO v_expires;
    IF v_expires IS NULL THEN
        RETURN ROW(dlock_session_state(p_session, p_owner, v_now),
                   NULL, NULL, NULL, NULL, NULL, NULL, v_now)::dlock_result;
    END IF;
    RETURN ROW('live', NULL, p_owner, p_session, NULL, v_expires,
               (SELECT count(*) FROM locks WHERE session_id = p_session AND expires_at > v_now),
               v_now)::dlock_result;
END $$;

-- L3. Ends a live session; its grants and waiters go with it (ON DELETE CASCADE). An expired
-- session is left for the retention, so that it still answers SESSION_EXPIRED.
CREATE FUNCTION dlock_end_session(p_session uuid, p_owner text)
RETURNS text LANGUAGE plpgsql AS $$
DECLARE
    v_now timestamptz := clock_timestamp();
BEGIN
    DELETE FROM sessions
    WHERE session_id = p_session AND owner_id = p_owner AND expires_at > v_now;
    IF FOUND THEN
        RETURN 'ended';
    END IF;
    RETURN dlock_session_state(p_session, p_owner, v_now);
END $$;

-- L8. Ends the live grant on a key (only the expected one, when given) and takes a fresh token
-- as the new floor: greater than every token issued before, so the evicted holder's in-flight
-- writes are fenced out once the floor reaches the enforcement points. It takes the acquires'
-- advisory lock first: otherwise an acquire racing it could draw its token after the delete and
-- before the floor, wait on the uncommitted delete inside INSERT ... ON CONFLICT, and be granted
-- once the revocation committed, a live grant below newTokenFloor that the operator was told
-- could not exist. With it, an acquire of the key either committed before (and is the grant this
-- revokes or refuses) or draws its token after the floor. The authenticated caller is recorded
-- beside the free-text operator.
CREATE FUNCTION dlock_revoke(p_key text, p_expected bigint, p_operator text, p_reason text,
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
    v_floor := nextval('fencing_token_seq');
    INSERT INTO revocations (revocation_id, lock_key, revoked_token, revoked_owner_id,
                             new_token_floor, operator, reason, revoked_at, revoked_by)
    VALUES (p_revocation, p_key, v_lock.fencing_token, v_lock.owner_id, v_floor,
            p_operator, p_reason, v_now, p_caller);
    RETURN ROW('revoked', v_lock.fencing_token, v_lock.owner_id, v_lock.session_id,
               v_lock.acquired_at, NULL, v_floor, v_now)::dlock_result;
END $$;

-- Physical clean-up. Correctness never waits for it: every function above already treats a
-- lapsed grant as free and a lapsed session as dead. Keys not granted for
-- p_keys_seen_retention_ms that nobody holds or waits for go too (NULL: keep every key), at most
-- 10000 a call, so one sweep never holds a long transaction; the next tick takes the rest.
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
