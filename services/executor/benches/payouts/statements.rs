//! Where PostgreSQL's time goes, statement by statement (pg_stat_statements, loaded by the
//! bench's own throwaway server). Tracking every nested statement costs PostgreSQL CPU on each
//! of them, so the timed table runs with tracking off and one extra run, with it on, gives the
//! breakdown (and shows what the tracking itself costs).

use dlock_devstack::PgServer;

fn run(pg: &PgServer, db: &str, sql: &str) {
    pg.psql(db, sql).unwrap_or_else(|e| panic!("{e:#}"));
}

/// Loads the extension, tracking nothing until [`track`] says otherwise.
pub fn enable(pg: &mut PgServer) {
    run(
        pg,
        "postgres",
        "ALTER SYSTEM SET shared_preload_libraries = 'pg_stat_statements'",
    );
    pg.restart().unwrap_or_else(|e| panic!("{e:#}"));
    track(pg, "none");
    for db in ["paydb", "lockdb"] {
        run(pg, db, "CREATE EXTENSION IF NOT EXISTS pg_stat_statements");
    }
}

/// `none`, `top` or `all` (the statements inside functions too); pooled connections take
/// it at their next statement.
pub fn track(pg: &PgServer, what: &str) {
    run(
        pg,
        "postgres",
        &format!("ALTER SYSTEM SET pg_stat_statements.track = '{what}'"),
    );
    run(pg, "postgres", "SELECT pg_reload_conf()");
}

pub async fn reset(pool: &sqlx::PgPool) {
    sqlx::query("SELECT pg_stat_statements_reset()")
        .execute(pool)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
}

/// The statements that took the most time since [`reset`], per payout.
pub async fn top(pool: &sqlx::PgPool, payouts: usize) -> String {
    let rows: Vec<(bool, i64, f64, String)> = sqlx::query_as(
        "SELECT s.toplevel, s.calls, s.total_exec_time, \
                left(regexp_replace(s.query, '\\s+', ' ', 'g'), 140) \
         FROM pg_stat_statements s JOIN pg_database d ON d.oid = s.dbid \
         WHERE d.datname IN ('paydb', 'lockdb') \
         ORDER BY s.total_exec_time DESC LIMIT 80",
    )
    .fetch_all(pool)
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    let mut out = format!(
        "{:<5} {:>8} {:>10} {:>9}  statement\n",
        "level", "calls/p", "ms/payout", "ms/call"
    );
    for (toplevel, calls, total, query) in rows {
        out.push_str(&format!(
            "{:<5} {:>8.2} {:>10.3} {:>9.3}  {}\n",
            if toplevel { "top" } else { "inner" },
            calls as f64 / payouts as f64,
            total / payouts as f64,
            total / calls.max(1) as f64,
            query
        ));
    }
    out
}

/// Rows read by sequential scans so far, per table of paydb and lockdb (PostgreSQL's own
/// per-table statistics). A table read whole on a payout's path shows here with a count that
/// grows with the table.
pub fn seq_rows(pg: &PgServer) -> std::collections::BTreeMap<String, i64> {
    let mut rows = std::collections::BTreeMap::new();
    for db in ["paydb", "lockdb"] {
        let out = pg
            .psql(db, "SELECT relname, seq_tup_read FROM pg_stat_user_tables")
            .unwrap_or_else(|e| panic!("{e:#}"));
        for line in out.lines() {
            if let Some((table, n)) = line.split_once('|')
                && let Ok(n) = n.trim().parse()
            {
                rows.insert(format!("{db}.{table}"), n);
            }
        }
    }
    rows
}
