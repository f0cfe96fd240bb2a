//! lockdb and paydb over TLS: PostgreSQL with `ssl=on` and a certificate
//! generated here; the lock server, the payment resource and the rail proxy connect with
//! `sslmode=verify-full` and `sslrootcert=` in their URLs, and a CA that did not sign the server's
//! certificate stops a service at start with the reason.

use std::path::Path;

use crate::shared::accounts::open_account;
use dlock_contract::payment_client::PaymentClient;
use dlock_devstack::PgServer;
use dlock_devstack::certs::TestCa;

use crate::etcd_tls::{lock_cycle, refused_process, serve_process};

/// These services run without fencing-token proofs, said by name
/// (docs/threat-model.md#safe-defaults): the database connection is what this tests.
fn no_proofs() -> (&'static str, String) {
    ("fencing.insecure-no-proofs", "true".to_owned())
}

fn tls_url(pg: &PgServer, database: &str, ca: &Path) -> String {
    format!(
        "postgres://postgres@127.0.0.1:{}/{database}?sslmode=verify-full&sslrootcert={}",
        pg.port,
        ca.display()
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lockdb_and_paydb_work_over_verified_tls_and_a_wrong_ca_stops_the_service() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let ca = TestCa::new(dir.path(), "pg").unwrap_or_else(|e| panic!("{e:#}"));
    let server = ca.server("pg-server").unwrap_or_else(|e| panic!("{e:#}"));
    let pg = PgServer::start_tls(None, &server).unwrap_or_else(|e| panic!("{e:#}"));
    for db in ["lockdb", "paydb"] {
        pg.create_database(db).unwrap_or_else(|e| panic!("{e:#}"));
    }
    let lockdb = tls_url(&pg, "lockdb", &ca.ca_file);
    let paydb = tls_url(&pg, "paydb", &ca.ca_file);

    let logs = dir.path();
    let (_lock, lock_url) = serve_process(
        "lock-server",
        &[
            ("lock.backend", "pg".into()),
            ("lock.pg.url", lockdb.clone()),
            no_proofs(),
        ],
        &logs.join("lock-server.log"),
    );
    let (_payment, payment_url) = serve_process(
        "payment-resource",
        &[("payment.pg.url", paydb.clone()), no_proofs()],
        &logs.join("payment-resource.log"),
    );
    let (_stub, stub_url) = serve_process(
        "rail-stub",
        &[
            (
                "rail.stub.statement-path",
                logs.join("statement.jsonl").display().to_string(),
            ),
            ("auth.mode", "none".into()),
        ],
        &logs.join("rail-stub.log"),
    );
    let (_proxy, _) = serve_process(
        "rail-proxy",
        &[
            ("rail.proxy.pg.url", paydb.clone()),
            ("rail.proxy.rail-url", stub_url),
            no_proofs(),
        ],
        &logs.join("rail-proxy.log"),
    );

    // A lock cycle on lockdb and money-moving writes on paydb, over TLS.
    assert!(lock_cycle(&lock_url, "payout:pg-tls").await > 0);
    let payment = PaymentClient::new(&payment_url, "pg-tls").unwrap_or_else(|e| panic!("{e}"));
    open_account(&payment, "pg-tls", Some(12_345)).await;
    let balance = pg
        .psql(
            "paydb",
            "SELECT balance_minor FROM accounts WHERE account_id = 'pg-tls'",
        )
        .unwrap_or_else(|e| panic!("{e:#}"));
    assert_eq!(balance, "12345");

    // Every service's connections are encrypted (the server also accepts plain ones, so this
    // is what tells verify-full apart from a silent fallback).
    let encrypted = pg
        .psql(
            "postgres",
            "SELECT string_agg(DISTINCT a.application_name, ',' ORDER BY a.application_name) \
             FROM pg_stat_activity a JOIN pg_stat_ssl s USING (pid) \
             WHERE s.ssl AND a.application_name LIKE 'dlock-%'",
        )
        .unwrap_or_else(|e| panic!("{e:#}"));
    assert_eq!(
        encrypted, "dlock-lock-server,dlock-payment-resource,dlock-rail-proxy",
        "every service talks TLS to PostgreSQL"
    );
    let plain = pg
        .psql(
            "postgres",
            "SELECT count(*) FROM pg_stat_activity a JOIN pg_stat_ssl s USING (pid) \
             WHERE NOT s.ssl AND a.application_name LIKE 'dlock-%'",
        )
        .unwrap_or_else(|e| panic!("{e:#}"));
    assert_eq!(plain, "0", "no service connection is plain text");

    // Negative control: the same URLs with a CA that did not sign the server's certificate.
    let stranger =
        TestCa::new(&logs.join("stranger"), "stranger").unwrap_or_else(|e| panic!("{e:#}"));
    refused_process(
        "lock-server",
        &[
            ("lock.backend", "pg".into()),
            ("lock.pg.url", tls_url(&pg, "lockdb", &stranger.ca_file)),
            no_proofs(),
        ],
        &logs.join("lock-server-wrong-ca.log"),
        &["UnknownIssuer"],
    );
    refused_process(
        "payment-resource",
        &[
            ("payment.pg.url", tls_url(&pg, "paydb", &stranger.ca_file)),
            no_proofs(),
        ],
        &logs.join("payment-resource-wrong-ca.log"),
        &["UnknownIssuer"],
    );
}
