-- lockdb: the sessions, grants and fencing tokens of the dlock lock server (backend `pg`), and
-- the high-water mark of the tokens a lock server on etcd answered.
--
-- Every rule that decides who holds a lock lives here, in functions that run in one transaction
-- each, against the database clock (clock_timestamp()). The lock server is a stateless HTTP
-- front: any number of replicas on one lockdb behave as one, because none of them decides
-- anything on its own.
--
-- This file is the whole schema. It replaces three histories, all in git history and listed in
-- migrations/lockdb/retired.tsv: versions 13 to 15 (the second baseline and the migrations after
-- it), versions 7 to 12, which that second baseline had replaced, and versions 1 to 6, which the
-- first baseline had replaced. A database whose migration rows are exactly versions 13 to 15 is
-- adopted when a service starts, which rewrites them to this version in one transaction; one at
-- an older history is refused with what to do (services/server/src/squash.rs). A change goes
-- into a new migration after this one, written to run again harmlessly.
--
-- Every PL/pgSQL function here that is not a trigger function carries three settings (SET on
-- the function; the statements it runs, the functions it calls and the triggers its writes fire
-- run under them; a psql session's own queries keep the defaults):
--
-- - plan_cache_mode = force_generic_plan: each statement is planned once per connection. Under
--   the default (auto) a statement with parameters is planned again for its values on its first
--   five runs and then on every run while the generic plan is not estimated cheaper, which for
--   the batch functions' statements over unnest() of array parameters it never is. Every
--   statement here looks rows up by key (lock key, session, token) or over the batch's own
--   arrays, so one generic plan serves every call.
-- - enable_seqscan = off: those plans are made once, usually while the tables are small, when
--   the planner prices a sequential scan below index lookups (the acquire batch then scanned
--   `sessions` and `lock_waiters` whole). With scans priced out the plans use the indexes
--   whatever the tables' size.
-- - jit = off: pricing scans out can lift an estimated cost above `jit_above_cost`, and JIT
--   compilation costs about 50 ms an execution, for statements of a millisecond.
--
-- `CREATE OR REPLACE FUNCTION` drops a function's SET clauses, so a later migration that replaces
-- one of these functions says them again; dlock/tests/it/generic_plans.rs fails on any PL/pgSQL
-- function without them.

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
RETURNS text LANGUAGE plpgsql STABLE
SET plan_cache_mode = force_generic_plan SET enable_seqscan = off SET jit = off AS $$
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
RETURNS bigint LANGUAGE plpgsql STABLE
SET plan_cache_mode = force_generic_plan SET enable_seqscan = off SET jit = off AS $$
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
RETURNS dlock_result LANGUAGE plpgsql STABLE
SET plan_cache_mode = force_generic_plan SET enable_seqscan = off SET jit = off AS $$
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
RETURNS dlock_result LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan SET enable_seqscan = off SET jit = off AS $$
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
-- CONTENTION_EXCEEDED). Over its share a session hears CONTENTION_EXCEEDED, the contract's code
-- for "the caller's own budget for this key is exhausted" (docs/contract.md#error-codes). The
-- advisory lock serializes enqueues per key so both bounds are exact.
CREATE FUNCTION dlock_enqueue(p_key text, p_session uuid, p_owner text, p_waiter uuid,
                              p_deadline_ms integer, p_cap integer, p_session_cap integer DEFAULT 1)
RETURNS dlock_result LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan SET enable_seqscan = off SET jit = off AS $$
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
-- grant's owner. A caller who is not the owner hears LOCK_LOST (409), the code the contract
-- gives a non-holder on L5 and L6 (docs/contract.md#error-codes): it discloses nothing that L7
-- does not already show, and the remedy it prescribes (re-acquire, get a token of your own) is
-- the right one. Nothing is changed then.

-- L5. Extends a live grant, found by (key, token) and held by the caller; the token never changes.
-- The grant is matched on its session too, not only on its owner: otherwise another session of
-- the same owner (a second worker under one owner id, or an operator, who may name any owner)
-- would renew it and receive a fresh proof of its token. A renew through any other session is
-- LOCK_LOST, as for any non-holder, and changes nothing. The etcd backend checks the same
-- (services/lock-server/src/store/etcd/locks.rs).
CREATE FUNCTION dlock_renew(p_key text, p_session uuid, p_owner text, p_token bigint,
                            p_ttl_ms integer)
RETURNS dlock_result LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan SET enable_seqscan = off SET jit = off AS $$
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

-- L6. Compare-and-delete on (key, token), by the grant's owner only. Deleting a lapsed grant of
-- one's own is harmless, but the caller hears LOCK_LOST: it was no longer the holder. Another
-- owner's grant is left alone, live or not, and the caller hears LOCK_LOST too.
CREATE FUNCTION dlock_release(p_key text, p_token bigint, p_owner text)
RETURNS dlock_result LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan SET enable_seqscan = off SET jit = off AS $$
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
RETURNS dlock_result LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan SET enable_seqscan = off SET jit = off AS $$
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
RETURNS text LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan SET enable_seqscan = off SET jit = off AS $$
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
-- On a new timeline (below, docs/design.md#d-12) the floor is drawn after the epoch check: the
-- sequence may be below tokens the lost commits issued, and a floor equal to one of them would
-- not fence its holder out.
CREATE FUNCTION dlock_revoke(p_key text, p_expected bigint, p_operator text, p_reason text,
                             p_revocation uuid, p_caller text DEFAULT NULL)
RETURNS dlock_result LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan SET enable_seqscan = off SET jit = off AS $$
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

-- Physical clean-up. Correctness never waits for it: every function above already treats a
-- lapsed grant as free and a lapsed session as dead. Keys not granted for
-- p_keys_seen_retention_ms that nobody holds or waits for go too (NULL: keep every key), at most
-- 10000 a call, so one sweep never holds a long transaction; the next tick takes the rest.
CREATE FUNCTION dlock_sweep(p_retention_ms bigint, p_keys_seen_retention_ms bigint DEFAULT NULL)
RETURNS bigint LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan SET enable_seqscan = off SET jit = off AS $$
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

-- =============================================================================================
-- Tokens never repeat when lockdb goes back in time (docs/design.md#d-12)
-- =============================================================================================

-- A promoted asynchronous replica, or a restore to a point in time, can lose acknowledged
-- commits: the grants they made and the token sequence's advance with them. Its next token would
-- be one already handed to a holder who may still be writing with it. Such a database is always
-- on a new PostgreSQL timeline (a promotion or a point-in-time recovery ends recovery on a new
-- one), so the timeline is lockdb's epoch. The epoch it last issued tokens in is recorded here;
-- every grant checks it in its own transaction (a trigger on `locks`, so every path that inserts
-- a grant is covered), and the first grant on a new timeline moves the sequence `token_gap` past
-- the highest token this database still knows of, records the change, and takes its token above
-- it. The gap is the bound on how many tokens the lost commits can have held: the default, 10^9,
-- is far above what any replication lag can hold at any grant rate PostgreSQL can sustain, and
-- 2^53 (the largest integer a JSON double keeps exact) still leaves room for millions of epochs.
-- A failover that lost nothing (a synchronous standby) moves the sequence too: harmless, tokens
-- only have to grow, and nobody has to tell the two apart.
--
-- The same check runs before every other token lockdb hands out or reports, not only before a
-- grant, since two readers of the sequence can come before any grant on a new timeline:
--   * a revocation draws its `new_token_floor` from the sequence: that floor could equal a token
--     the lost commits handed out, and would not fence its holder out;
--   * `dlock recover paydb-epoch` raises paydb's fences to "the highest token the lock server has
--     issued": read from the sequence as it is, that is below tokens the lost commits issued when
--     lockdb went back too, and their holders would pass paydb's fences.
-- dlock_epoch_advance() applies the check (the jump, the record, the warning) and returns the
-- floor every token of this epoch is above; dlock_epoch_floor() returns the highest token lockdb
-- may ever have issued, after the check: the operator's floor.
--
-- pg_walfile_name() names the WAL file of a position on the timeline the server inserts on now;
-- its first eight hex digits are that timeline. It is cheap (no disk read) and answers only on a
-- primary, which is the only place a grant can be inserted.

CREATE FUNCTION dlock_timeline() RETURNS bigint LANGUAGE sql VOLATILE AS $$
    SELECT ('x' || lpad(substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8), 16, '0'))::bit(64)::bigint
$$;

CREATE TABLE store_epoch (
    singleton  boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    -- The timeline tokens were last issued on.
    timeline   bigint NOT NULL CHECK (timeline > 0),
    -- Every token issued on this timeline is above this (0 on the first).
    floor      bigint NOT NULL DEFAULT 0 CHECK (floor >= 0),
    -- How far past the highest known token a new epoch starts.
    token_gap  bigint NOT NULL DEFAULT 1000000000 CHECK (token_gap BETWEEN 1 AND 1000000000000),
    since      timestamptz NOT NULL DEFAULT clock_timestamp()
);
INSERT INTO store_epoch (timeline) VALUES (dlock_timeline());

-- Each new epoch, for the operator and the tests: kept, never swept.
CREATE TABLE store_epoch_changes (
    changed_at      timestamptz NOT NULL DEFAULT clock_timestamp(),
    from_timeline   bigint NOT NULL,
    to_timeline     bigint NOT NULL,
    -- The highest token the database knew of (sequence, grants, revocation floors) and the floor
    -- every later token is above.
    highest_known   bigint NOT NULL,
    floor           bigint NOT NULL,
    PRIMARY KEY (changed_at, to_timeline)
);

CREATE FUNCTION dlock_epoch_advance() RETURNS bigint LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan SET enable_seqscan = off SET jit = off AS $$
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

CREATE FUNCTION dlock_epoch_guard() RETURNS trigger LANGUAGE plpgsql AS $$
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

CREATE TRIGGER locks_epoch_guard BEFORE INSERT ON locks
    FOR EACH ROW EXECUTE FUNCTION dlock_epoch_guard();

-- The highest token lockdb may ever have issued, the lost commits' included: after the epoch
-- check, the sequence (every token of this epoch was drawn from it) or the epoch's floor (every
-- token of an earlier epoch, lost ones too, is below it), whichever is higher.
CREATE FUNCTION dlock_epoch_floor() RETURNS bigint LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan SET enable_seqscan = off SET jit = off AS $$
DECLARE
    v_floor bigint := dlock_epoch_advance();
BEGIN
    RETURN GREATEST(v_floor, (SELECT last_value FROM fencing_token_seq));
END $$;

-- =============================================================================================
-- Acquires and releases grouped into one transaction (docs/design.md#group-commit)
-- =============================================================================================

-- The lock server queues the acquires (and, apart, the releases) that arrive while a transaction
-- of their kind runs and sends the next ones together (services/lock-server/src/store/pg_batch.rs,
-- `lock.pg.batch.max`). dlock_acquire_many and dlock_release_many take a batch as arrays, one
-- element per item, and make exactly the decisions dlock_acquire and dlock_release (above) make
-- for each item alone; they answer one row per item, numbered from 1 in array order. A request
-- alone still goes through the per-row function.
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
-- * Every grant is an INSERT into `locks`, so the epoch trigger (locks_epoch_guard) checks each
--   grant of a batch in the batch's transaction: the first grant on a new timeline moves the
--   sequence 10^9 past the highest known token and any grant whose token was drawn below that
--   floor draws again. Each token is a nextval of fencing_token_seq drawn at the insert, in key
--   order; no token is drawn ahead or kept in the lock server.

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

CREATE FUNCTION dlock_acquire_many(p_keys text[], p_sessions uuid[], p_owners text[],
                                   p_ttls integer[], p_waiters uuid[])
RETURNS SETOF dlock_item_result LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan SET enable_seqscan = off SET jit = off AS $$
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

    -- Each item's session, as dlock_session_state judges it: an owner mismatch reads as
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

    -- One acquire of a key at a time, until commit, in key order (as dlock_acquire).
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

CREATE FUNCTION dlock_release_many(p_keys text[], p_tokens bigint[], p_owners text[])
RETURNS SETOF dlock_item_result LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan SET enable_seqscan = off SET jit = off AS $$
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

    -- Compare-and-delete on (key, token), by the grant's owner only (dlock_release), the
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

-- =============================================================================================
-- The highest fencing token a lock server on etcd has answered, kept outside etcd
-- (docs/design.md#d-12-etcd)
-- =============================================================================================

-- On etcd a token is the revision of the grant's create. A restore of etcd (a snapshot, an older
-- data directory put back) takes the revision back, and with it anything kept in etcd, so the
-- tokens etcd hands out next may be ones the lock server already answered. With
-- `lock.etcd.high-water.url` set, every replica records each token here before answering it and
-- answers it only if it is above every token recorded before; `name` is the etcd prefix
-- (`lock.etcd.prefix`), one row per key space. Used by no lock server on PostgreSQL.

CREATE TABLE etcd_high_water (
    name       text PRIMARY KEY,
    token      bigint NOT NULL CHECK (token >= 0),
    updated_at timestamptz NOT NULL DEFAULT clock_timestamp()
);

-- Records `p_token` as answered under `p_name` if it is above the high-water, and returns the
-- high-water as it was before (0 for a name never seen). The row lock orders every replica's
-- records, so a caller that gets back less than its token knows that its token is above every
-- token any replica recorded before; one that gets back as much or more must not answer its
-- token (a restore of etcd, or a concurrent grant that recorded a later revision first).
CREATE FUNCTION dlock_etcd_high_water(p_name text, p_token bigint)
RETURNS bigint LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan SET enable_seqscan = off SET jit = off AS $$
DECLARE
    v_previous bigint;
BEGIN
    SELECT token INTO v_previous FROM etcd_high_water WHERE name = p_name FOR UPDATE;
    IF NOT FOUND THEN
        INSERT INTO etcd_high_water (name, token) VALUES (p_name, p_token)
        ON CONFLICT (name) DO NOTHING;
        IF FOUND THEN
            RETURN 0;
        END IF;
        SELECT token INTO v_previous FROM etcd_high_water WHERE name = p_name FOR UPDATE;
    END IF;
    IF p_token > v_previous THEN
        UPDATE etcd_high_water SET token = p_token, updated_at = clock_timestamp()
        WHERE name = p_name;
    END IF;
    RETURN v_previous;
END
$$;
