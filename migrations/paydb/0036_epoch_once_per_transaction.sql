-- paydb 0036: the store epoch is checked once per transaction, not before every write statement.
--
-- The statement guards on accounts, payouts, ledger_entries and rail_high_water (0026,
-- pay_epoch_guard) compare the server's timeline with pay_store_epoch before each write
-- statement. A batch of the payment resource or the rail proxy writes several of these tables in
-- one transaction, so a new user's run of 1 500 payouts ran the check about 4 500 times, each a
-- PL/pgSQL call that reads the timeline and the one-row table (docs/design.md#d-12).
--
-- A transaction cannot outlive the primary it began on: a promotion or a restore ends every
-- session, and the server's timeline does not change under a running transaction. So once a
-- transaction has passed the check, every later write of the same transaction would pass it too.
-- The guard now marks its transaction when the check passes (a transaction-local setting,
-- `dlock.epoch_checked`, gone at commit or rollback; a savepoint rolled back takes it too) and
-- returns at once for the transaction's later statements. The first write of every transaction
-- still makes the full check, and a refusal (DL012) still refuses that write and its transaction.
--
-- The mark is a setting, not a secret: a session that sets it itself skips the check for its own
-- transaction, as `dlock.epoch_recovery` (0026) lets a session through the quarantine guard. Both
-- guard against a failover under honest writers, not against a client with paydb's credentials,
-- which can write the tables it guards anyway.
--
-- Can run again (OR REPLACE). A trigger function: it carries no SET clause (0032, 0035).

CREATE OR REPLACE FUNCTION pay_epoch_guard() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    v_timeline bigint;
    v_epoch    pay_store_epoch;
BEGIN
    IF current_setting('dlock.epoch_checked', true) = 'on' THEN
        RETURN NULL;
    END IF;
    v_timeline := pay_timeline();
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
        PERFORM set_config('dlock.epoch_checked', 'on', true);
        RETURN NULL;
    END IF;
    SELECT * INTO v_epoch FROM pay_store_epoch FOR UPDATE;
    IF v_epoch.timeline = v_timeline THEN
        PERFORM set_config('dlock.epoch_checked', 'on', true);
        RETURN NULL;
    END IF;
    IF v_epoch.synchronous THEN
        UPDATE pay_store_epoch
           SET timeline = v_timeline, synchronous = pay_replicating_synchronously(),
               checked_at = clock_timestamp();
        INSERT INTO pay_store_epoch_changes (from_timeline, to_timeline, decided_by)
        VALUES (v_epoch.timeline, v_timeline, 'synchronous');
        PERFORM set_config('dlock.epoch_checked', 'on', true);
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
