-- paydb 0020: the fences and marks do not silently go back with paydb (docs/design.md#d-12).
--
-- paydb keeps the two enforcement points, `accounts.fence` and `rail_high_water`. A promoted
-- asynchronous replica, or a restore to a point in time, can lose acknowledged commits: a fence
-- would remember less than a stale holder was already refused by, and that holder's next write
-- would pass. Such a database is on a new PostgreSQL timeline, so the timeline is paydb's epoch,
-- recorded here. Every write statement on the fenced tables checks it in its own transaction
-- (statement-level triggers). On a new timeline:
--
-- * when the primary it was written on was replicating synchronously when last looked at (at most
--   a second before the last write: `synchronous_standby_names` set, `synchronous_commit` at least
--   `on`, a synchronous standby streaming), no acknowledged commit can be missing from the standby
--   that was promoted: the new epoch is taken and recorded, and the write goes on. No human.
-- * otherwise the write is refused (SQLSTATE DL012, which the services answer as 503 with a
--   message that says what to do), and so is every later one, until an operator has reconciled
--   and confirms with `dlock recover paydb-epoch`: pay_epoch_confirm() takes the epoch, raises every
--   fence and high-water mark to at least the token floor given (the highest token the lock
--   server has issued: lockdb's `fencing_token_seq` now), so every token issued before it is
--   fenced out and a claim needs a newer grant, and records who, why and what it raised.
--
-- Reads are not refused: they are advisory. A restore to a point in time of a database that was
-- replicating synchronously looks like a synchronous failover here and is taken without a human:
-- restoring paydb is an operator's act, who runs the recovery in any case (docs/design.md#d-12).
-- Written to run again harmlessly (dlock/tests/it/squash.rs applies migrations twice).

CREATE OR REPLACE FUNCTION pay_timeline() RETURNS bigint LANGUAGE sql VOLATILE AS $$
    SELECT ('x' || lpad(substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8), 16, '0'))::bit(64)::bigint
$$;

-- Without the pg_monitor role pg_stat_replication hides sync_state: then this says false, and a
-- failover waits for an operator, which is the safe side.
CREATE OR REPLACE FUNCTION pay_replicating_synchronously() RETURNS boolean LANGUAGE sql VOLATILE AS $$
    SELECT current_setting('synchronous_standby_names') <> ''
       AND current_setting('synchronous_commit') IN ('on', 'remote_write', 'remote_apply')
       AND EXISTS (SELECT 1 FROM pg_stat_replication
                   WHERE state = 'streaming' AND sync_state IN ('sync', 'quorum'))
$$;

CREATE TABLE IF NOT EXISTS pay_store_epoch (
    singleton   boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    timeline    bigint NOT NULL CHECK (timeline > 0),
    synchronous boolean NOT NULL,
    checked_at  timestamptz NOT NULL DEFAULT clock_timestamp()
);
INSERT INTO pay_store_epoch (timeline, synchronous)
VALUES (pay_timeline(), pay_replicating_synchronously())
ON CONFLICT DO NOTHING;

-- Every epoch taken, by the rule or by an operator: kept, never swept.
CREATE TABLE IF NOT EXISTS pay_store_epoch_changes (
    changed_at    timestamptz NOT NULL DEFAULT clock_timestamp(),
    from_timeline bigint NOT NULL,
    to_timeline   bigint NOT NULL,
    decided_by    text NOT NULL CHECK (decided_by IN ('synchronous', 'operator')),
    token_floor   bigint CHECK (token_floor IS NULL OR token_floor > 0),
    fences_raised integer,
    marks_raised  integer,
    operator      text CHECK (operator IS NULL OR char_length(operator) BETWEEN 1 AND 128),
    reason        text CHECK (reason IS NULL OR char_length(reason) BETWEEN 1 AND 1024),
    CHECK ((decided_by = 'operator') = (operator IS NOT NULL AND reason IS NOT NULL
                                        AND token_floor IS NOT NULL)),
    PRIMARY KEY (changed_at, to_timeline)
);

CREATE OR REPLACE FUNCTION pay_epoch_guard() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    v_timeline bigint := pay_timeline();
    v_epoch    pay_store_epoch;
BEGIN
    SELECT * INTO v_epoch FROM pay_store_epoch;
    IF v_epoch.timeline = v_timeline THEN
        -- Look at the replication again at most once a second, by whichever write gets the row.
        IF v_epoch.checked_at < clock_timestamp() - interval '1 second' THEN
            PERFORM 1 FROM pay_store_epoch FOR UPDATE SKIP LOCKED;
            IF FOUND THEN
                UPDATE pay_store_epoch
                   SET synchronous = pay_replicating_synchronously(), checked_at = clock_timestamp();
            END IF;
        END IF;
        RETURN NULL;
    END IF;
    SELECT * INTO v_epoch FROM pay_store_epoch FOR UPDATE;
    IF v_epoch.timeline = v_timeline THEN
        RETURN NULL;
    END IF;
    IF v_epoch.synchronous THEN
        UPDATE pay_store_epoch
           SET timeline = v_timeline, synchronous = pay_replicating_synchronously(),
               checked_at = clock_timestamp();
        INSERT INTO pay_store_epoch_changes (from_timeline, to_timeline, decided_by)
        VALUES (v_epoch.timeline, v_timeline, 'synchronous');
        RETURN NULL;
    END IF;
    RAISE EXCEPTION USING
        ERRCODE = 'DL012',
        MESSAGE = format('paydb is on timeline %s, its fences were written on timeline %s by a '
                         'primary that was not replicating synchronously, so acknowledged writes '
                         '(fences, high-water marks, postings) may be lost: nothing was written',
                         v_timeline, v_epoch.timeline),
        HINT = 'reconcile (dlock reconcile), then confirm with dlock recover paydb-epoch '
               '--token-floor <the highest token the lock server has issued> (docs/design.md#d-12)';
END $$;

CREATE OR REPLACE TRIGGER accounts_epoch_guard BEFORE UPDATE ON accounts
    FOR EACH STATEMENT EXECUTE FUNCTION pay_epoch_guard();
CREATE OR REPLACE TRIGGER payouts_epoch_guard BEFORE INSERT OR UPDATE ON payouts
    FOR EACH STATEMENT EXECUTE FUNCTION pay_epoch_guard();
CREATE OR REPLACE TRIGGER ledger_entries_epoch_guard BEFORE INSERT ON ledger_entries
    FOR EACH STATEMENT EXECUTE FUNCTION pay_epoch_guard();
CREATE OR REPLACE TRIGGER rail_high_water_epoch_guard BEFORE INSERT OR UPDATE ON rail_high_water
    FOR EACH STATEMENT EXECUTE FUNCTION pay_epoch_guard();

-- The operator's confirmation: takes the current timeline as paydb's epoch, raises every fence
-- and high-water mark below p_floor to it, and records it. Answers what it did; on the epoch it
-- already has, changes nothing and answers NULL counts.
CREATE OR REPLACE FUNCTION pay_epoch_confirm(p_floor bigint, p_operator text, p_reason text)
RETURNS TABLE (from_timeline bigint, to_timeline bigint, fences_raised integer,
               marks_raised integer)
LANGUAGE plpgsql AS $$
DECLARE
    v_timeline bigint := pay_timeline();
    v_epoch    pay_store_epoch;
    v_fences   integer;
    v_marks    integer;
BEGIN
    IF p_floor IS NULL OR p_floor <= 0 THEN
        RAISE EXCEPTION USING ERRCODE = '22023', MESSAGE = 'the token floor must be a token, > 0';
    END IF;
    SELECT * INTO v_epoch FROM pay_store_epoch FOR UPDATE;
    IF v_epoch.timeline = v_timeline THEN
        RETURN QUERY SELECT v_timeline, v_timeline, NULL::integer, NULL::integer;
        RETURN;
    END IF;
    UPDATE pay_store_epoch
       SET timeline = v_timeline, synchronous = pay_replicating_synchronously(),
           checked_at = clock_timestamp();
    UPDATE accounts SET fence = p_floor, updated_at = clock_timestamp()
     WHERE kind = 'customer' AND fence < p_floor;
    GET DIAGNOSTICS v_fences = ROW_COUNT;
    INSERT INTO rail_high_water (account_id, highest_token)
    SELECT account_id, p_floor FROM accounts WHERE kind = 'customer'
    ON CONFLICT (account_id) DO UPDATE SET highest_token = EXCLUDED.highest_token,
                                           updated_at = clock_timestamp()
     WHERE rail_high_water.highest_token < EXCLUDED.highest_token;
    GET DIAGNOSTICS v_marks = ROW_COUNT;
    INSERT INTO pay_store_epoch_changes (from_timeline, to_timeline, decided_by, token_floor,
                                         fences_raised, marks_raised, operator, reason)
    VALUES (v_epoch.timeline, v_timeline, 'operator', p_floor, v_fences, v_marks,
            trim(p_operator), trim(p_reason));
    RETURN QUERY SELECT v_epoch.timeline, v_timeline, v_fences, v_marks;
END $$;
