-- lockdb 0015: lockdb's functions look rows up through their indexes, and never compile a
-- statement to machine code.
--
-- As paydb 0035 (migrations/paydb/0035_index_plans.sql) says for paydb: a function's statements
-- plan once per connection (migrations/lockdb/0014_generic_plans.sql), usually while the tables
-- are small, when the planner prices a sequential scan below index lookups; the acquire batch
-- then scanned `sessions` and `lock_waiters` whole. Every statement of lockdb's functions finds
-- its rows by key, so sequential scans are priced out and the plans use the indexes whatever the
-- tables' size. Pricing scans out can lift an estimated cost above `jit_above_cost`, and JIT
-- compilation costs about 50 ms an execution, so JIT is off for these statements too.
--
-- The settings are the functions', not the database's; a function replaced with `CREATE OR
-- REPLACE` loses them, and the it test generic_plans fails on any PL/pgSQL function without
-- them. Can run again.

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
