//! Tests of the lock server's waiter queue ([`queue`]), its audit identity ([`identity`]) and its
//! retention of the keys seen ([`retention`]), each on both backends. What they share is here:
//! the error code of a call, a client of each backend's store, a held key revoked.

mod identity;
mod queue;
mod retention;

use std::time::{Duration, Instant};

use dlock_contract::ErrorCode;
use dlock_contract::client::{ClientError, LockClient};
use serde_json::{Value, json};
use uuid::Uuid;

use crate::harness::{
    BOTH, Backend, LockStack, client, etcd_under, eventually, hold, on_both_backends, party, port,
    post_json, release, session,
};

const JSON: &str = "application/json; charset=utf-8";

fn code<T: std::fmt::Debug>(result: &Result<T, ClientError>) -> Option<ErrorCode> {
    result.as_ref().err().and_then(ClientError::code)
}

async fn lockdb(stack: &LockStack) -> sqlx::PgPool {
    let url = stack
        .pg()
        .map(|p| p.url("lockdb"))
        .unwrap_or_else(|| panic!("no pg"));
    sqlx::PgPool::connect(&url)
        .await
        .unwrap_or_else(|e| panic!("{e}"))
}

async fn etcd(stack: &LockStack) -> etcd_client::Client {
    let endpoint = stack
        .etcd()
        .map(|e| e.endpoint())
        .unwrap_or_else(|| panic!("no etcd"));
    etcd_client::Client::connect([endpoint], None)
        .await
        .unwrap_or_else(|e| panic!("{e}"))
}
/// `client` holds `key` on `session` for 60 s, then revokes it as `operator` for `reason`.
async fn held_then_revoked(
    client: &LockClient,
    key: &str,
    session: Uuid,
    (operator, reason): (&str, &str),
) -> dlock_contract::lock::Revocation {
    hold(client, key, session, 60_000).await;
    client
        .revoke(key, operator, reason, None)
        .await
        .unwrap_or_else(|e| panic!("{e}"))
}
