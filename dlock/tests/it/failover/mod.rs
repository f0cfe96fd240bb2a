//! PostgreSQL failing over under the services: a primary with a streaming standby
//! (services/devstack/src/pg_standby.rs), the primary SIGKILLed and the standby promoted, the
//! services reaching both by one multi-host URL (services/server/src/pg.rs) and following the
//! promotion on their own. docs/faults.md#postgresql-failover has the figures.

mod both_back;
mod pair;
mod scenario_a;
mod scenario_b;

use dlock_contract::ErrorCode;
use dlock_contract::client::{ClientError, LockClient};
use dlock_contract::payment::{ClaimResponse, CreatePayoutRequest, PayoutState};
use dlock_contract::payment_client::{Fence, PaymentClient};
use dlock_contract::rail::SubmissionRequest;
use dlock_devstack::PgServer;
use dlock_devstack::pg_standby::PgPair;
use dlock_executor::manifest::idempotency_key;
use uuid::Uuid;

use crate::harness::hold_and_release;

/// A knob of a long run: the variable `name` as a number, or `default`.
pub(crate) fn knob(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// A rail proxy's configuration on `paydb` forwarding to `rail` with `read_timeout_ms`, its
/// sweeper taking a forward as unresolved 500 ms past that, every 200 ms (the fault suites').
pub(crate) fn sweeping_proxy(
    paydb: String,
    rail: String,
    operator_token: &str,
    read_timeout_ms: u64,
) -> Vec<(&'static str, String)> {
    vec![
        ("rail.proxy.pg.url", paydb),
        ("rail.proxy.rail-url", rail),
        ("rail.proxy.operator-token", operator_token.to_owned()),
        ("rail.proxy.read-timeout-ms", read_timeout_ms.to_string()),
        ("rail.proxy.unresolved-margin-ms", "500".into()),
        ("rail.proxy.sweep-interval-ms", "200".into()),
    ]
}

/// The code of a refused call, `transport` when no answer came.
pub(crate) fn refusal_code(error: &ClientError) -> String {
    error
        .code()
        .map(|c| format!("{c:?}"))
        .unwrap_or_else(|| "transport".to_owned())
}

/// Whether `error` says the session is gone (unknown or expired): the caller needs a new one.
pub(crate) fn session_gone(error: &ClientError) -> bool {
    matches!(
        error.code(),
        Some(ErrorCode::SessionUnknown | ErrorCode::SessionExpired)
    )
}

/// The one number `sql` selects on `server`'s `db`.
pub(crate) fn number(server: &PgServer, db: &str, sql: &str) -> i64 {
    server
        .psql(db, sql)
        .unwrap_or_else(|e| panic!("{e:#}"))
        .parse()
        .unwrap_or_else(|e| panic!("{sql}: {e}"))
}

/// The last value of `server`'s lockdb fencing-token sequence.
pub(crate) fn last_token(server: &PgServer) -> i64 {
    number(server, "lockdb", "SELECT last_value FROM fencing_token_seq")
}

/// The primary SIGKILLed and the standby promoted.
pub(crate) fn fail_over(pair: &mut PgPair) {
    pair.kill_primary().unwrap_or_else(|e| panic!("{e:#}"));
    pair.promote().unwrap_or_else(|e| panic!("{e:#}"));
}

/// Payout `id` of 1 000 EUR minor units from `account` to `ben-0`.
pub(crate) fn payout(account: &str, id: Uuid) -> CreatePayoutRequest {
    CreatePayoutRequest {
        payout_id: id,
        account_id: account.into(),
        amount_minor: 1_000,
        currency: "EUR".into(),
        beneficiary_ref: "ben-0".into(),
    }
}

/// The rail submission of [`payout`]`(account, id)`.
pub(crate) fn submission(account: &str, id: Uuid) -> SubmissionRequest {
    SubmissionRequest {
        payout_id: id,
        account_id: account.into(),
        amount_minor: 1_000,
        currency: "EUR".into(),
        beneficiary_ref: "ben-0".into(),
    }
}

/// Registers [`payout`]`(account, id)` for each of `ids`.
pub(crate) async fn register(payment: &PaymentClient, account: &str, ids: &[Uuid]) {
    for id in ids {
        payment
            .create_payout(&format!("register-{id}"), &payout(account, *id))
            .await
            .unwrap_or_else(|e| panic!("{e}"));
    }
}

/// A claim of PENDING payout `id` with `token`.
pub(crate) async fn claim(
    payment: &PaymentClient,
    id: Uuid,
    token: i64,
) -> Result<ClaimResponse, ClientError> {
    payment
        .claim(
            id,
            Fence::new(&idempotency_key(id), token, None),
            PayoutState::Pending,
        )
        .await
}

/// A new session of `lock`'s, of 60 s.
pub(crate) async fn new_session(lock: &LockClient) -> Uuid {
    lock.create_session(Some(60_000))
        .await
        .unwrap_or_else(|e| panic!("{e}"))
        .session_id
}

/// `dlock recover paydb-epoch` with `args` (the databases, the rail, a floor), as the operator
/// `ops-on-call` runs it for `reason`: its output.
pub(crate) fn recover_paydb_epoch(args: &[&str], reason: &str) -> std::process::Output {
    std::process::Command::new(scenario_a::EXE)
        .args(["recover", "paydb-epoch"])
        .args(args)
        .args(["--operator", "ops-on-call", "--reason", reason])
        .output()
        .unwrap_or_else(|e| panic!("{e}"))
}

/// 40 grants on `session` (more than the 32 values a sequence logs ahead), each of its own key
/// `{prefix}-{i}` and released at once: their tokens.
pub(crate) async fn scratch_grants(lock: &LockClient, session: Uuid, prefix: &str) -> Vec<i64> {
    let mut tokens = Vec::new();
    for i in 0..40 {
        tokens.push(hold_and_release(lock, &format!("{prefix}-{i}"), session, 10_000, None).await);
    }
    tokens
}
