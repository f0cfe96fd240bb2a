//! paydb's and lockdb's PL/pgSQL functions plan their statements once per connection, through
//! their indexes, without JIT: each one that is not a trigger function carries
//! `plan_cache_mode = force_generic_plan`, `enable_seqscan = off` and `jit = off` (why: the
//! headers of migrations/paydb/0037_baseline_tables.sql and migrations/lockdb/0016_baseline.sql).
//! A migration that replaces a function with `CREATE OR REPLACE` drops the settings; this test
//! finds such a function on databases migrated by the real services.

use dlock_devstack::stack::{LockBackend, Stack};

const EXE: &str = env!("CARGO_BIN_EXE_dlock");

/// The settings every such function carries, as `pg_proc.proconfig` lists them.
const SETTINGS: &str = "plan_cache_mode=force_generic_plan,enable_seqscan=off,jit=off";

/// The PL/pgSQL functions of `public` that are not trigger functions and lack one of
/// [`SETTINGS`].
fn without_generic_plans() -> String {
    format!(
        "SELECT p.oid::regprocedure FROM pg_proc p JOIN pg_language l ON l.oid = p.prolang \
          WHERE p.pronamespace = 'public'::regnamespace AND l.lanname = 'plpgsql' \
            AND p.prorettype <> 'trigger'::regtype \
            AND NOT coalesce(p.proconfig @> string_to_array('{SETTINGS}', ','), false) \
          ORDER BY 1"
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_function_of_paydb_and_lockdb_plans_its_statements_once() {
    let stack = Stack::builder(EXE).lock_backend(LockBackend::Pg).start();
    for (database, one_of_them) in [
        ("paydb", "pay_claim_many"),
        ("lockdb", "dlock_acquire_many"),
    ] {
        let psql = |sql: &str| {
            stack
                .pg()
                .psql(database, sql)
                .unwrap_or_else(|e| panic!("{database}: {e:#}"))
        };
        let missing = psql(&without_generic_plans());
        assert_eq!(
            missing.trim(),
            "",
            "{database}: functions without generic plans"
        );
        let configured = psql(&format!(
            "SELECT array_to_string(proconfig, ',') FROM pg_proc WHERE proname = '{one_of_them}'"
        ));
        assert_eq!(configured.trim(), SETTINGS, "{database}: {one_of_them}");
        // Positive control: a function replaced without the setting is found.
        let found = psql(&format!(
            "BEGIN; \
             CREATE FUNCTION generic_plans_probe(p integer) RETURNS integer LANGUAGE plpgsql \
                 AS $$ BEGIN RETURN p; END $$; \
             {}; \
             ROLLBACK",
            without_generic_plans()
        ));
        assert_eq!(
            found.trim(),
            "generic_plans_probe(integer)",
            "{database}: the check sees a function without the setting"
        );
    }
}
