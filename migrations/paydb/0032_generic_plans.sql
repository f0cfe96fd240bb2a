-- paydb 0032: paydb's functions plan each statement once per connection (generic plans).
--
-- A statement of a PL/pgSQL function is planned through PostgreSQL's plan cache. Under the
-- default plan_cache_mode (auto) a statement with parameters is planned again for its values on
-- each of its first five runs, and then on every run for as long as the generic plan is not
-- estimated cheaper; for the batch functions' statements over unnest() of array parameters it
-- never is. Planning was then the largest single share of paydb's CPU: a profile of a new user's
-- `dlock run -f` of 1 500 payouts (perf, durable `dlock dev up`) put 18 % of PostgreSQL's time in
-- the planner and 11 % in starting executors. Every statement of these functions looks rows up by
-- key (payout, account, submission, idempotency key) or over the batch's own arrays, so the plan
-- does not depend on the values: one generic plan serves every call.
--
-- The setting travels with each function that is not a trigger function (SET on the function);
-- the statements it runs, the functions it calls and the triggers its writes fire plan under it.
-- It is the function's, not the database's: a psql session's own queries keep the default.
-- `CREATE OR REPLACE FUNCTION` drops a function's SET clauses, so a later migration that replaces
-- one of these functions says it again, and the schema test of dlock/tests/it/generic_plans.rs
-- fails on any PL/pgSQL function without it.
--
-- Can run again (ALTER FUNCTION ... SET is idempotent).

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
        EXECUTE format('ALTER FUNCTION %s SET plan_cache_mode = force_generic_plan', f);
    END LOOP;
END $$;
