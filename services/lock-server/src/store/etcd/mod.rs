//! Backend `etcd`: sessions are leases, a grant is a key whose CreateRevision is its fencing
//! token, and every change is a transaction that compares before it writes.
//!
//! Layout under the prefix `P` (default `/dlock`):
//!
//! | key                  | value                          | lease                         |
//! |----------------------|--------------------------------|-------------------------------|
//! | `P/s/{session}`      | owner, TTL                     | the session's lease           |
//! | `P/t/{session}`      | owner (the expired-session tombstone) | TTL + retention        |
//! | `P/l/{key}`          | the grant                      | the grant's own lease         |
//! | `P/i/{session}/{key}`| (index of a session's grants)  | the grant's own lease         |
//! | `P/seen/{key}`       | when the key was last granted  | none (swept after `lock.keys-seen.retention`) |
//! | `P/w/{key}/{waiter}` | session (a FIFO waiter)        | the wait plus a margin        |
//! | `P/r/{revocation}`   | the revocation record          | none                          |
//!
//! A grant is live while its key exists (its own lease) and its session's key exists (the
//! session's lease): it ends at whichever lapses first, on etcd's clock. The token is the
//! revision of the put that created the key; a renew re-puts the value on a new lease, which
//! keeps the CreateRevision, so a renew never mints a second token. A lapsed grant's key is
//! deleted before a new grant is created, so a new holder always gets a new CreateRevision.
//! A revocation floor is the revision of the transaction that ended the grant: greater than every
//! revision, and so every token, before it.
//!
//! The waiter queue of a key is its `P/w/{key}/` keys in CreateRevision order. A waiter counts
//! (for the cap, the head, `waiterCount`) only while its session's key exists: a waiter of an
//! expired or ended session is skipped and deleted. Joining the queue is a transaction that
//! compares the whole `P/w/{key}/` range against the revision the queue was counted at, so two
//! enqueues cannot both pass the cap.
//!
//! `P/seen/{key}` only lets L7 tell "never seen" from "not held". Tokens never depend on it: a
//! token is a revision of the cluster, which only grows, so forgetting a key cannot make its next
//! token smaller than any before.

use chrono::{DateTime, TimeZone, Utc};
use dlock_contract::lock::{Heartbeat, HeldLocks, LockGrant, LockInfo, Revocation, Session};
use etcd_client::{
    Client, Compare, CompareOp, GetOptions, KeyValue, PutOptions, SortOrder, SortTarget, Txn,
    TxnOp, TxnOpResponse, TxnResponse,
};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use super::{
    Acquire, Attempt, Claim, Contention, QueueBounds, Renewal, RevokeOrder, Revoked, StoreError,
    StoreResult, SweepRetention, WaiterTicket, held_page, lock_info,
};
use crate::config::EtcdSettings;

mod high_water;
mod locks;
mod queue;
mod revoke;
mod sessions;

/// How often a transaction that lost a race is re-read and retried before giving up.
const TXN_ATTEMPTS_MAX: usize = 8;
/// Enqueues of one key race each other by design (each compares the whole queue); one wins
/// each round, so a burst of arrivals needs more rounds than a grant does.
const ENQUEUE_ATTEMPTS_MAX: usize = 32;
/// Operations in one etcd transaction (etcd's `--max-txn-ops` defaults to 128).
const TXN_OPS_MAX: usize = 100;
/// Keys of `P/seen/` read per page by the sweep.
const SWEEP_PAGE: i64 = 500;

#[derive(Clone)]
pub struct EtcdStore {
    /// Replaced whole when the TLS or password files are rotated (see `etcd_conn`).
    client: super::etcd_conn::ClientCell,
    prefix: String,
    retention_s: i64,
    /// `lock.etcd.high-water.url`: tokens are recorded in lockdb before they are answered
    /// (docs/design.md#d-12-etcd); none, and a restore of etcd is not detected.
    high_water: Option<std::sync::Arc<high_water::HighWater>>,
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct SessionValue {
    owner_id: String,
    ttl_millis: i64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct GrantValue {
    owner_id: String,
    session_id: Uuid,
    ttl_millis: i64,
    acquired_at_ms: i64,
    expires_at_ms: i64,
    lease: i64,
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct RevocationValue {
    key: String,
    revoked_token: i64,
    revoked_owner_id: String,
    operator: String,
    /// The identity the auth layer authenticated; none with `auth.mode = none`.
    revoked_by: Option<String>,
    reason: String,
    revoked_at_ms: i64,
}

fn map_etcd(error: etcd_client::Error) -> StoreError {
    use super::etcd_conn::{Failure, classify};
    let (failure, text) = classify(&error);
    match failure {
        // Refusals of the credentials are NOT_LEADER too (nothing was changed, and another
        // replica, or this one after a rotation, may succeed), with the cause in the log.
        Failure::Tls => StoreError::NotLeader(format!(
            "the TLS handshake with etcd failed (lock.etcd.ca-file, cert-file, key-file): {text}"
        )),
        Failure::Authentication => StoreError::NotLeader(format!(
            "etcd refused the lock server's user (lock.etcd.username, password-file): {text}"
        )),
        Failure::Permission => StoreError::NotLeader(format!(
            "etcd denies the lock server's user its prefix (lock.etcd.prefix): {text}"
        )),
        Failure::Unreachable => StoreError::NotLeader(format!(
            "etcd is unreachable or did not answer within lock.etcd.request-timeout-ms (a \
             leader election, a dead member): {text}"
        )),
        Failure::Other => match &error {
            etcd_client::Error::GRpcStatus(status)
                if ["no leader", "leader changed", "timed out"]
                    .iter()
                    .any(|m| status.message().contains(m)) =>
            {
                StoreError::NotLeader(format!(
                    "etcd cannot serve a linearizable write: {}",
                    status.message()
                ))
            }
            _ => StoreError::Backend(format!("etcd: {text}")),
        },
    }
}

/// Maps the failure of a transaction that writes: as [`map_etcd`], except where the request may
/// have reached etcd and been applied without its answer reaching us (our deadline,
/// `lock.etcd.request-timeout-ms`, passed; the connection broke under the request; etcd's own
/// "request timed out" or "leader changed", after which a proposal may still commit). That is
/// OUTCOME_UNKNOWN (docs/contract.md#outcome-unknown), never NOT_LEADER. A connection that could
/// not be opened, etcd's "no leader" (refused before proposing) and refused credentials sent
/// nothing that could apply: NOT_LEADER, as before.
fn map_etcd_sent(error: etcd_client::Error) -> StoreError {
    use super::etcd_conn::{Failure, classify};
    let (failure, text) = classify(&error);
    let not_connected = super::etcd_conn::sent_nothing(&text);
    let unknown = match failure {
        Failure::Unreachable => !not_connected,
        Failure::Other => matches!(
            &error,
            etcd_client::Error::GRpcStatus(status)
                if ["timed out", "leader changed"].iter().any(|m| status.message().contains(m))
        ),
        Failure::Tls | Failure::Authentication | Failure::Permission => false,
    };
    if unknown {
        StoreError::OutcomeUnknown(format!(
            "a write was sent to etcd and its answer never came (lock.etcd.request-timeout-ms, a \
             broken connection, a leader change): {text}"
        ))
    } else {
        map_etcd(error)
    }
}

fn decode<T: serde::de::DeserializeOwned>(kv: &KeyValue) -> StoreResult<T> {
    serde_json::from_slice(kv.value()).map_err(|e| {
        StoreError::Backend(format!(
            "etcd value under {:?} is not ours: {e}",
            kv.key_str().unwrap_or("?")
        ))
    })
}

fn encode<T: Serialize>(value: &T) -> StoreResult<Vec<u8>> {
    serde_json::to_vec(value).map_err(|e| StoreError::Backend(format!("encoding failed: {e}")))
}

fn millis(ms: i64) -> DateTime<Utc> {
    Utc.timestamp_millis_opt(ms).single().unwrap_or_default()
}

fn now_ms() -> i64 {
    Utc::now().timestamp_millis()
}

/// etcd leases count whole seconds; a TTL in milliseconds is rounded up, never down, so a grant
/// never lapses before the time it announced.
fn lease_seconds(ttl_ms: i64) -> i64 {
    (ttl_ms + 999) / 1000
}

fn gets(response: TxnResponse) -> Vec<Vec<KeyValue>> {
    response
        .op_responses()
        .into_iter()
        .filter_map(|op| match op {
            TxnOpResponse::Get(get) => Some(get.kvs().to_vec()),
            _ => None,
        })
        .collect()
}

/// `P/seen/{key}`: when the key was last granted (by the granting replica's clock).
#[derive(Debug, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct SeenValue {
    last_granted_at_ms: i64,
}

/// A key's waiter queue as read at one revision: the live waiters in FIFO order.
struct Queue {
    /// Waiter keys and their sessions, oldest first, sessions alive.
    live: Vec<(String, Uuid)>,
    /// The revision the queue was read at.
    revision: i64,
}

/// What a grant key says about its holder.
struct Holder {
    kv: KeyValue,
    value: GrantValue,
    live: bool,
}

impl EtcdStore {
    /// Connects (TLS, client certificate and user as configured), checks that the credentials
    /// may read and write the prefix, and keeps them current across rotations.
    pub async fn connect(settings: &EtcdSettings, retention_ms: i64) -> anyhow::Result<Self> {
        let prefix = settings.prefix.trim_end_matches('/').to_owned();
        let client = super::etcd_conn::connect(settings, &prefix).await?;
        let high_water = Self::open_high_water(settings, &client, &prefix).await?;
        Ok(Self {
            client,
            prefix,
            retention_s: (retention_ms + 999) / 1000,
            high_water: high_water.map(std::sync::Arc::new),
        })
    }

    fn k_session(&self, id: Uuid) -> String {
        format!("{}/s/{id}", self.prefix)
    }
    fn k_tombstone(&self, id: Uuid) -> String {
        format!("{}/t/{id}", self.prefix)
    }
    fn k_lock(&self, key: &str) -> String {
        format!("{}/l/{key}", self.prefix)
    }
    fn k_index(&self, session: Uuid, key: &str) -> String {
        format!("{}/i/{session}/{key}", self.prefix)
    }
    fn k_index_prefix(&self, session: Uuid) -> String {
        format!("{}/i/{session}/", self.prefix)
    }
    fn k_seen(&self, key: &str) -> String {
        format!("{}/seen/{key}", self.prefix)
    }
    fn k_waiters(&self, key: &str) -> String {
        format!("{}/w/{key}/", self.prefix)
    }
    fn k_waiter(&self, key: &str, id: Uuid) -> String {
        format!("{}/w/{key}/{id}", self.prefix)
    }
    fn k_revocation(&self, id: Uuid) -> String {
        format!("{}/r/{id}", self.prefix)
    }

    fn client(&self) -> Client {
        self.client.client()
    }

    /// A transaction that writes: a failure after it may have reached etcd is OUTCOME_UNKNOWN
    /// ([`map_etcd_sent`]).
    async fn write(&self, txn: Txn) -> StoreResult<TxnResponse> {
        self.client().txn(txn).await.map_err(map_etcd_sent)
    }

    /// Several reads in one round trip, at one revision.
    async fn read(&self, ops: Vec<TxnOp>) -> StoreResult<Vec<Vec<KeyValue>>> {
        let response = self
            .client()
            .txn(Txn::new().and_then(ops))
            .await
            .map_err(map_etcd)?;
        Ok(gets(response))
    }

    /// Reads the session, its tombstone and `also` in one round trip, and checks that the
    /// session is alive and the owner's. The answers come in that order: session, tombstone,
    /// then `also`.
    async fn read_session(
        &self,
        session_id: Uuid,
        owner_id: &str,
        also: Option<TxnOp>,
    ) -> StoreResult<(SessionValue, Vec<Vec<KeyValue>>)> {
        let mut ops = vec![
            TxnOp::get(self.k_session(session_id), None),
            TxnOp::get(self.k_tombstone(session_id), None),
        ];
        ops.extend(also);
        let reads = self.read(ops).await?;
        let value = Self::session_state(&reads[0], &reads[1], owner_id)?;
        Ok((value, reads))
    }

    /// Deletes the grant key of `key` and its index entry when `guard` holds, with `also`
    /// written in the same transaction.
    fn end_grant(&self, key: &str, session_id: Uuid, guard: Compare, also: Option<TxnOp>) -> Txn {
        let mut then = vec![
            TxnOp::delete(self.k_lock(key), None),
            TxnOp::delete(self.k_index(session_id, key), None),
        ];
        then.extend(also);
        Txn::new().when([guard]).and_then(then)
    }

    async fn grant_lease(&self, ttl_ms: i64) -> StoreResult<i64> {
        let lease = self
            .client()
            .lease_grant(lease_seconds(ttl_ms), None)
            .await
            .map_err(map_etcd)?;
        Ok(lease.id())
    }

    /// Revokes a lease nobody needs any more, off the request's path. A failure only means the
    /// lease lapses by its TTL instead.
    fn drop_lease(&self, lease: i64) {
        let mut client = self.client();
        tokio::spawn(async move {
            let _ = client.lease_revoke(lease).await;
        });
    }

    /// Ready when a linearizable read succeeds, which needs a leader and a quorum.
    pub async fn ready(&self) -> StoreResult<()> {
        self.client()
            .get(
                format!("{}/ready", self.prefix),
                Some(GetOptions::new().with_count_only()),
            )
            .await
            .map_err(map_etcd)?;
        Ok(())
    }

    /// Everything that lapses lives on a lease, but for `P/seen/{key}`: a key not granted for
    /// the retention, with no grant key and no waiter, is forgotten. The delete compares the
    /// seen key's ModRevision (a grant since re-wrote it) and the absence of a grant and of
    /// waiters, in one transaction.
    pub async fn sweep(&self, retention: &SweepRetention) -> StoreResult<u64> {
        let seen_prefix = format!("{}/seen/", self.prefix);
        let range_end = {
            let mut end = seen_prefix.clone().into_bytes();
            if let Some(last) = end.last_mut() {
                *last += 1;
            }
            end
        };
        let cutoff = now_ms() - retention.keys_seen_ms;
        let mut from = seen_prefix.clone().into_bytes();
        let mut removed = 0;
        loop {
            let page = self
                .client()
                .get(
                    from.clone(),
                    Some(
                        GetOptions::new()
                            .with_range(range_end.clone())
                            .with_limit(SWEEP_PAGE),
                    ),
                )
                .await
                .map_err(map_etcd)?;
            for kv in page.kvs() {
                // Written before the last-granted time was recorded: as old as can be.
                let last = serde_json::from_slice::<SeenValue>(kv.value())
                    .map(|v| v.last_granted_at_ms)
                    .unwrap_or(0);
                let Some(key) = kv.key_str().ok().and_then(|k| k.strip_prefix(&seen_prefix)) else {
                    continue;
                };
                if last > cutoff {
                    continue;
                }
                let txn = Txn::new()
                    .when([
                        Compare::mod_revision(kv.key(), CompareOp::Equal, kv.mod_revision()),
                        Compare::create_revision(self.k_lock(key), CompareOp::Equal, 0),
                        Compare::version(self.k_waiters(key), CompareOp::Equal, 0).with_prefix(),
                    ])
                    .and_then([TxnOp::delete(kv.key(), None)]);
                if self.client().txn(txn).await.map_err(map_etcd)?.succeeded() {
                    removed += 1;
                }
            }
            match page.kvs().last() {
                Some(last) if page.more() => {
                    from = last.key().to_vec();
                    from.push(0);
                }
                _ => break,
            }
        }
        Ok(removed)
    }
}
