-- paydb 0035: paydb's functions look rows up through their indexes, and never compile a
-- statement to machine code.
--
-- A function's statements plan once per connection (migrations/paydb/0032_generic_plans.sql),
-- and a connection is usually opened while the tables are small: a new stack, a new replica.
-- For a table of a few pages the planner prices a sequential scan below index lookups, so the
-- generic plans of the batch functions scanned `payouts`, `rail_submission` and
-- `idempotency_records` whole, hashing them for joins with the batch's arrays, and kept doing so
-- as the tables grew (a new user's run of 1 500 payouts read 4.3 million rows that way). Every
-- one of these statements finds its rows by key, so with sequential scans priced out the plans
-- use the primary keys and unique indexes whatever the tables' size. A table with no index that
-- fits is still scanned: the setting prices scans, it does not forbid them.
--
-- Pricing scans out lifts some plans' estimated cost above `jit_above_cost`, and PostgreSQL then
-- compiles the statement with LLVM on every execution (about 50 ms each, measured on the store
-- epoch's one-row read); these are statements of a millisecond, so JIT is off for them.
--
-- Measured on a new user's run (1 500 payouts over 100 accounts at 32 workers, durable `dlock dev
-- up`, three runs alternated with three without): median 3.31 s against 3.99 s, and a fifth less
-- CPU over the run (docs/benchmarks.md).
--
-- As with 0032, the settings are the functions', not the database's, so a psql session's own
-- queries keep the defaults; a function replaced with `CREATE OR REPLACE` loses them, and the it
-- test generic_plans fails on any PL/pgSQL function without them. Can run again.

DO $$
DECLARE
    f regprocedure;
BEGIN
    FOR f IN SELECT p.oid::regprocedure
               FROM pg_proc p
               JOIN pg_language l ON l.oid = p.prolang
              WHERE p.pronamespace = 'public'::regnamespace
                AND l.lanname = 'plpgsql'
                AND p.prorettype <> 'trigger'::regtype
              ORDER BY 1 LOOP
        EXECUTE format('ALTER FUNCTION %s SET enable_seqscan = off', f);
        EXECUTE format('ALTER FUNCTION %s SET jit = off', f);
    END LOOP;
END $$;
