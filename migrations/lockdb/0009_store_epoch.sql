-- lockdb 0009: tokens never repeat when lockdb goes back in time (docs/design.md#d-12).
--
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
-- Written to run again harmlessly (as every migration after a baseline: dlock/tests/it/squash.rs
-- applies them twice).
--
-- pg_walfile_name() names the WAL file of a position on the timeline the server inserts on now;
-- its first eight hex digits are that timeline. It is cheap (no disk read) and answers only on a
-- primary, which is the only place a grant can be inserted.

CREATE OR REPLACE FUNCTION dlock_timeline() RETURNS bigint LANGUAGE sql VOLATILE AS $$
    SELECT ('x' || lpad(substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8), 16, '0'))::bit(64)::bigint
$$;

CREATE TABLE IF NOT EXISTS store_epoch (
    singleton  boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    -- The timeline tokens were last issued on.
    timeline   bigint NOT NULL CHECK (timeline > 0),
    -- Every token issued on this timeline is above this (0 on the first).
    floor      bigint NOT NULL DEFAULT 0 CHECK (floor >= 0),
    -- How far past the highest known token a new epoch starts.
    token_gap  bigint NOT NULL DEFAULT 1000000000 CHECK (token_gap BETWEEN 1 AND 1000000000000),
    since      timestamptz NOT NULL DEFAULT clock_timestamp()
);
INSERT INTO store_epoch (timeline) VALUES (dlock_timeline()) ON CONFLICT DO NOTHING;

-- Each new epoch, for the operator and the tests: kept, never swept.
CREATE TABLE IF NOT EXISTS store_epoch_changes (
    changed_at      timestamptz NOT NULL DEFAULT clock_timestamp(),
    from_timeline   bigint NOT NULL,
    to_timeline     bigint NOT NULL,
    -- The highest token the database knew of (sequence, grants, revocation floors) and the floor
    -- every later token is above.
    highest_known   bigint NOT NULL,
    floor           bigint NOT NULL,
    PRIMARY KEY (changed_at, to_timeline)
);

CREATE OR REPLACE FUNCTION dlock_epoch_guard() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    v_timeline bigint := dlock_timeline();
    v_epoch    store_epoch;
    v_highest  bigint;
BEGIN
    SELECT * INTO v_epoch FROM store_epoch;
    -- The common case: same epoch, and a token drawn after its floor was set.
    IF v_epoch.timeline = v_timeline AND NEW.fencing_token > v_epoch.floor THEN
        RETURN NEW;
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
    -- Drawn before the floor was set (by this grant or a concurrent one): draw again, above it.
    IF NEW.fencing_token <= v_epoch.floor THEN
        NEW.fencing_token := nextval('fencing_token_seq');
    END IF;
    RETURN NEW;
END $$;

CREATE OR REPLACE TRIGGER locks_epoch_guard BEFORE INSERT ON locks
    FOR EACH ROW EXECUTE FUNCTION dlock_epoch_guard();
