//! What the recovery-evidence tests share: fenced writes with a grant's proof, the grants a
//! lowering is tried with, the schema's refusal of a quiet lowering, the services as processes
//! and the operator's resolution of a RAIL_AMBIGUOUS payout.

use std::net::SocketAddr;

use dlock_contract::auth::Credential;
use dlock_contract::client::LockClient;
use dlock_contract::lock::LockGrant;
use dlock_devstack::ManagedChild;
use reqwest::Method;
use serde_json::{Value, json};
use uuid::Uuid;

use crate::conformance::assert_envelope;
use crate::harness::{hold, port, raw, release, serve_process, session};

pub(super) const OPERATOR_TOKEN: &str = "evidence-operator-credential-0123456789";

pub(super) async fn scalar(pool: &sqlx::PgPool, sql: &str) -> i64 {
    sqlx::query_scalar::<_, i64>(sqlx::AssertSqlSafe(sql.to_owned()))
        .fetch_one(pool)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"))
}

/// A fenced write on the dev stack: `bearer`'s credential as `owner`, with `token` and `proof`.
pub(super) async fn write(
    url: &str,
    bearer: &str,
    owner: &str,
    token: Option<(i64, &str)>,
    body: &Value,
) -> (u16, Value) {
    let bearer = format!("Bearer {bearer}");
    let key = format!("evidence-{}", Uuid::new_v4());
    let token_text = token.map(|(t, _)| t.to_string()).unwrap_or_default();
    let mut headers = vec![
        ("content-type", "application/json"),
        ("authorization", bearer.as_str()),
        ("x-owner-id", owner),
        ("x-idempotency-key", key.as_str()),
    ];
    if let Some((_, proof)) = token {
        headers.push(("x-fencing-token", token_text.as_str()));
        headers.push(("x-fencing-proof", proof));
    }
    let (status, _, body) = raw(Method::POST, url, &headers, Some(&body.to_string())).await;
    (status, body)
}

/// [`write`] with `grant`'s token and proof.
pub(super) async fn write_with(
    url: &str,
    bearer: &str,
    owner: &str,
    grant: &LockGrant,
    body: &Value,
) -> (u16, Value) {
    write(
        url,
        bearer,
        owner,
        Some((grant.fencing_token, &proof_of(grant))),
        body,
    )
    .await
}

pub(super) fn proof_of(grant: &LockGrant) -> String {
    grant
        .fencing_proof
        .clone()
        .unwrap_or_else(|| panic!("the grant carries its proof: {grant:?}"))
}

/// A lock client of `owner` on `lock` with the fixed `credential`.
pub(super) fn client_as(lock: &str, owner: &str, credential: &str) -> LockClient {
    LockClient::new(lock, owner)
        .unwrap_or_else(|e| panic!("{e}"))
        .with_credential(Some(Credential::fixed(credential)))
}

/// The executor `executor/w1`, its session, and two grants of `key` on it: A, released, then B,
/// held (above A).
pub(super) async fn released_then_held(
    lock: &str,
    executor: &str,
    key: &str,
) -> (LockClient, Uuid, LockGrant, LockGrant) {
    let worker = client_as(lock, "executor/w1", executor);
    let s1 = session(&worker, 60_000).await;
    let a = hold(&worker, key, s1, 60_000).await;
    release(&worker, key, s1, a.fencing_token).await;
    let b = hold(&worker, key, s1, 60_000).await;
    assert!(b.fencing_token > a.fencing_token);
    (worker, s1, a, b)
}

/// The operator's own grant of `key` (`ops-console`, a session of its own), with its client and
/// session.
pub(super) async fn operator_grant(
    lock: &str,
    operator: &str,
    key: &str,
) -> (LockClient, Uuid, LockGrant) {
    let ops = client_as(lock, "ops-console", operator);
    let ops_session = session(&ops, 60_000).await;
    let d = hold(&ops, key, ops_session, 60_000).await;
    (ops, ops_session, d)
}

/// A lowering presented with `presented`'s token under `highest`'s: `409 FENCED_OUT` naming both.
pub(super) fn assert_lowering_under(
    what: &str,
    status: u16,
    body: &Value,
    highest: &LockGrant,
    presented: &LockGrant,
) {
    assert_eq!(status, 409, "{what}: {body}");
    assert_envelope(what, status, body, "FENCED_OUT");
    assert_eq!(
        body["details"]["highestToken"],
        json!(highest.fencing_token),
        "{body}"
    );
    assert_eq!(
        body["details"]["presentedToken"],
        json!(presented.fencing_token)
    );
}

/// A mark of `account` (`column` of `table`, its lowerings recorded as `resource`), the CHECK
/// `check` that keeps it at or above the highest token admitted with a proof, and the `url` the
/// operator advances it at (`{url}/lower` lowers it).
pub(super) struct Mark<'a> {
    resource: &'static str,
    table: &'static str,
    column: &'static str,
    check: &'static str,
    account: &'a str,
    url: String,
}

impl<'a> Mark<'a> {
    /// The fence of `account` at the payment resource `payment`.
    pub(super) fn account_fence(payment: &str, account: &'a str) -> Self {
        Self {
            resource: "account",
            table: "accounts",
            column: "fence",
            check: "accounts_fence_covers_seen_check",
            account,
            url: format!("{payment}/v1/accounts/{account}/fence"),
        }
    }

    /// The high-water mark of `account` at the rail proxy `proxy`.
    pub(super) fn rail_high_water(proxy: &str, account: &'a str) -> Self {
        Self {
            resource: "rail",
            table: "rail_high_water",
            column: "highest_token",
            check: "rail_high_water_covers_seen_check",
            account,
            url: format!("{proxy}/v1/rail/high-water/{account}"),
        }
    }

    /// Where the operator lowers the mark.
    pub(super) fn lower_url(&self) -> String {
        format!("{}/lower", self.url)
    }

    /// The operator (`operator`'s credential, owner `ops-console`) advances the mark to
    /// `floor`, a revocation's floor for `reason`: asserts 200.
    pub(super) async fn advance_to_floor(&self, operator: &str, floor: i64, reason: &str) {
        let body = json!({ "floor": floor, "revocationId": Uuid::new_v4(), "operator": "jane.doe",
                           "reason": reason });
        let (status, body) = write(&self.url, operator, "ops-console", None, &body).await;
        assert_eq!(status, 200, "the {} advance: {body}", self.column);
    }

    /// The schema holds the rule whatever the code path: a lowering from B to A with its
    /// recovery row, in one transaction (what the mark's guard asks for), breaks the CHECK; the
    /// seen mark itself never goes down; and the mark stays at B.
    pub(super) async fn assert_schema_refuses_lowering(&self, pool: &sqlx::PgPool, b: i64, a: i64) {
        let Self {
            resource,
            table,
            column,
            account,
            check,
            ..
        } = self;
        let mut tx = pool.begin().await.unwrap_or_else(|e| panic!("{e}"));
        sqlx::query(
            "INSERT INTO fence_recoveries (resource, account_id, previous_token, new_token, \
             operator, identity, owner_id, reason) \
             VALUES ($1, $2, $3, $4, 'psql', 'psql', 'psql', 'a quiet lowering')",
        )
        .bind(resource)
        .bind(account)
        .bind(b)
        .bind(a)
        .execute(&mut *tx)
        .await
        .unwrap_or_else(|e| panic!("the recovery row: {e}"));
        let quiet = sqlx::query(sqlx::AssertSqlSafe(format!(
            "UPDATE {table} SET {column} = $1 WHERE account_id = $2"
        )))
        .bind(a)
        .bind(account)
        .execute(&mut *tx)
        .await;
        assert!(
            quiet.as_ref().is_err_and(|e| e.to_string().contains(check)),
            "a recorded {resource} lowering under B in SQL: {quiet:?}"
        );
        tx.rollback().await.unwrap_or_else(|e| panic!("{e}"));
        let down = sqlx::query(sqlx::AssertSqlSafe(format!(
            "UPDATE {table} SET max_seen_token = 0 WHERE account_id = $1"
        )))
        .bind(account)
        .execute(pool)
        .await;
        assert!(
            down.as_ref()
                .is_err_and(|e| e.to_string().contains("may not go down")),
            "the {resource} seen mark went down: {down:?}"
        );
        let mark: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
            "SELECT {column} FROM {table} WHERE account_id = $1"
        )))
        .bind(account)
        .fetch_one(pool)
        .await
        .unwrap_or_else(|e| panic!("{table}.{column}: {e}"));
        assert_eq!(mark, b, "the {resource} mark stays at B");
    }
}

/// `dlock serve {service}` on a free port with `pairs`; the process and its URL.
pub(super) fn process(
    dir: &std::path::Path,
    service: &str,
    name: &str,
    pairs: &[(&str, String)],
) -> (ManagedChild, String) {
    let listen: SocketAddr = ([127, 0, 0, 1], port()).into();
    let mut config: Vec<(String, String)> = vec![("server.listen".into(), listen.to_string())];
    // Without fencing-token proofs unless `pairs` gives `fencing.*` keys: said by name, as a
    // service requires (docs/threat-model.md#safe-defaults).
    if !pairs.iter().any(|(k, _)| k.starts_with("fencing.")) {
        config.push(("fencing.insecure-no-proofs".into(), "true".to_owned()));
    }
    config.extend(pairs.iter().map(|(k, v)| ((*k).to_owned(), v.clone())));
    let log = dir.join(format!("{name}.log"));
    (
        serve_process(service, listen, &config, &log),
        format!("http://{listen}"),
    )
}

/// The configuration of a rail proxy on `paydb` forwarding to `rail` with `read_ms` read
/// timeout and `margin_ms` before its sweeper takes a forward as unresolved.
pub(super) fn proxy_pairs(
    paydb: &str,
    rail: &str,
    read_ms: &str,
    margin_ms: &str,
) -> Vec<(&'static str, String)> {
    vec![
        ("rail.proxy.pg.url", paydb.to_owned()),
        ("rail.proxy.rail-url", rail.to_owned()),
        ("rail.proxy.operator-token", "test-operator".to_owned()),
        ("rail.proxy.read-timeout-ms", read_ms.to_owned()),
        ("rail.proxy.unresolved-margin-ms", margin_ms.to_owned()),
        ("rail.proxy.sweep-interval-ms", "50".to_owned()),
    ]
}

/// A payment resource on `paydb` with [`OPERATOR_TOKEN`], in `dir`: the process and its URL.
pub(super) fn payment_process(dir: &std::path::Path, paydb: &str) -> (ManagedChild, String) {
    process(
        dir,
        "payment-resource",
        "payment",
        &[
            ("payment.pg.url", paydb.to_owned()),
            ("payment.operator.token", OPERATOR_TOKEN.to_owned()),
        ],
    )
}

/// The operator's resolution of `payout` on `payment` with `body`: status and body.
pub(super) async fn resolve(payment: &str, payout: Uuid, body: Value) -> (u16, Value) {
    let key = format!("resolve-{}", Uuid::new_v4());
    let bearer = format!("Bearer {OPERATOR_TOKEN}");
    let (status, _, body) = raw(
        Method::POST,
        &format!("{payment}/v1/payouts/{payout}/resolve"),
        &[
            ("content-type", "application/json"),
            ("authorization", bearer.as_str()),
            ("x-owner-id", "operator-cli"),
            ("x-idempotency-key", key.as_str()),
        ],
        Some(&body.to_string()),
    )
    .await;
    (status, body)
}

/// A resolution POSTED under `reference`.
pub(super) fn posted(reference: &str) -> Value {
    json!({ "outcome": "POSTED", "railReference": reference, "operator": "bob",
            "evidence": "the rail statement of today" })
}

/// A resolution FAILED.
pub(super) fn failed() -> Value {
    json!({ "outcome": "FAILED", "operator": "bob", "evidence": "not on the rail statement" })
}

/// The resolutions audited in paydb.
pub(super) async fn resolutions_audited(pool: &sqlx::PgPool) -> i64 {
    scalar(
        pool,
        "SELECT count(*) FROM audit_log WHERE action = 'ambiguous_resolved'",
    )
    .await
}

/// A resolution refused as `400 VALIDATION_FAILED` naming `field`.
pub(super) fn assert_refused(what: &str, status: u16, body: &Value, field: &str) {
    assert_eq!(status, 400, "{what}: {body}");
    assert_envelope(what, status, body, "VALIDATION_FAILED");
    assert_eq!(
        body["details"]["fields"][0]["field"],
        json!(field),
        "{what}: {body}"
    );
}
