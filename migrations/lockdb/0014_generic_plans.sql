-- lockdb 0014: lockdb's functions plan each statement once per connection (generic plans).
--
-- As paydb 0032 (migrations/paydb/0032_generic_plans.sql) says for paydb: under the default
-- plan_cache_mode (auto) a statement of a PL/pgSQL function with parameters is planned again for
-- its values on its first five runs and then on every run while the generic plan is not estimated
-- cheaper, which for the batch functions' statements over unnest() of array parameters it never
-- is. Every statement of lockdb's functions looks rows up by key (lock key, session, token) or
-- over the batch's own arrays, so one generic plan serves every call.
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
