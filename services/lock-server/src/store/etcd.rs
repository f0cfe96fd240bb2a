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
    TxnOp, TxnOpResponse,
};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use super::{
    Acquire, Contention, QueueBounds, StoreError, StoreResult, SweepRetention, WaiterTicket,
};
use crate::config::EtcdSettings;

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

fn gets(response: etcd_client::TxnResponse) -> Vec<Vec<KeyValue>> {
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
        Ok(Self {
            client,
            prefix,
            retention_s: (retention_ms + 999) / 1000,
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

    /// Several reads in one round trip, at one revision.
    async fn read(&self, ops: Vec<TxnOp>) -> StoreResult<Vec<Vec<KeyValue>>> {
        let response = self
            .client()
            .txn(Txn::new().and_then(ops))
            .await
            .map_err(map_etcd)?;
        Ok(gets(response))
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

    fn session_state(
        session: &[KeyValue],
        tombstone: &[KeyValue],
        owner_id: &str,
    ) -> StoreResult<SessionValue> {
        if let Some(kv) = session.first() {
            let value: SessionValue = decode(kv)?;
            if value.owner_id == owner_id {
                return Ok(value);
            }
            return Err(StoreError::SessionUnknown);
        }
        match tombstone.first() {
            Some(kv) if decode::<SessionValue>(kv)?.owner_id == owner_id => {
                Err(StoreError::SessionExpired)
            }
            _ => Err(StoreError::SessionUnknown),
        }
    }

    /// Reads a grant key and whether its session is still alive.
    async fn holder(
        &self,
        lock: Option<&KeyValue>,
        live_session: Option<Uuid>,
    ) -> StoreResult<Option<Holder>> {
        let Some(kv) = lock else {
            return Ok(None);
        };
        let value: GrantValue = decode(kv)?;
        let live = if Some(value.session_id) == live_session {
            true
        } else {
            let session = self
                .client()
                .get(
                    self.k_session(value.session_id),
                    Some(GetOptions::new().with_count_only()),
                )
                .await
                .map_err(map_etcd)?;
            session.count() > 0
        };
        Ok(Some(Holder {
            kv: kv.clone(),
            value,
            live,
        }))
    }

    fn grant_of(key: &str, token: i64, value: &GrantValue) -> LockGrant {
        LockGrant {
            key: key.to_owned(),
            owner_id: value.owner_id.clone(),
            session_id: value.session_id,
            fencing_token: token,
            acquired_at: millis(value.acquired_at_ms),
            expires_at: millis(value.expires_at_ms),
            fencing_proof: None,
        }
    }

    /// Deletes a lapsed grant key, if it is still the one that was read.
    async fn clear_lapsed(&self, key: &str, holder: &Holder) -> StoreResult<()> {
        let txn = Txn::new()
            .when([Compare::mod_revision(
                self.k_lock(key),
                CompareOp::Equal,
                holder.kv.mod_revision(),
            )])
            .and_then([
                TxnOp::delete(self.k_lock(key), None),
                TxnOp::delete(self.k_index(holder.value.session_id, key), None),
            ]);
        self.client().txn(txn).await.map_err(map_etcd)?;
        Ok(())
    }

    pub async fn create_session(&self, owner_id: &str, ttl_ms: i64) -> StoreResult<Session> {
        let session_id = Uuid::new_v4();
        let lease = self.grant_lease(ttl_ms).await?;
        let tombstone_lease = self.grant_lease(ttl_ms + self.retention_s * 1000).await?;
        let value = encode(&SessionValue {
            owner_id: owner_id.to_owned(),
            ttl_millis: ttl_ms,
        })?;
        let txn = Txn::new().and_then([
            TxnOp::put(
                self.k_session(session_id),
                value.clone(),
                Some(PutOptions::new().with_lease(lease)),
            ),
            TxnOp::put(
                self.k_tombstone(session_id),
                value,
                Some(PutOptions::new().with_lease(tombstone_lease)),
            ),
        ]);
        self.client().txn(txn).await.map_err(map_etcd)?;
        Ok(Session {
            session_id,
            owner_id: owner_id.to_owned(),
            ttl_millis: ttl_ms,
            expires_at: millis(now_ms() + ttl_ms),
        })
    }

    /// Renews a lease; its remaining TTL in seconds, 0 when the lease is gone.
    ///
    /// A session's lease lapses some hundreds of milliseconds before etcd reaps it and deletes
    /// its keys; a keep-alive in that gap waits for the revocation and then finds no lease.
    /// etcd answers that with TTL 0, which the client library turns into an error of its own
    /// ("lease not found"). That is the lapsed session, SESSION_EXPIRED, never a backend failure.
    async fn keep_alive(&self, lease: i64) -> StoreResult<i64> {
        let lost = |e: &etcd_client::Error| {
            matches!(e, etcd_client::Error::LeaseKeepAliveError(m) if m.contains("lease not found"))
                || matches!(e, etcd_client::Error::GRpcStatus(s) if s.message().contains("requested lease not found"))
        };
        let (mut keeper, mut stream) = match self.client().lease_keep_alive(lease).await {
            Ok(pair) => pair,
            Err(e) if lost(&e) => return Ok(0),
            Err(e) => return Err(map_etcd(e)),
        };
        keeper.keep_alive().await.map_err(map_etcd)?;
        let response = match stream.message().await {
            Ok(response) => response,
            Err(e) if lost(&e) => return Ok(0),
            Err(e) => return Err(map_etcd(e)),
        };
        Ok(response.map(|r| r.ttl()).unwrap_or(0))
    }

    pub async fn heartbeat(&self, session_id: Uuid, owner_id: &str) -> StoreResult<Heartbeat> {
        let reads = self
            .read(vec![
                TxnOp::get(self.k_session(session_id), None),
                TxnOp::get(self.k_tombstone(session_id), None),
                TxnOp::get(
                    self.k_index_prefix(session_id),
                    Some(GetOptions::new().with_prefix().with_count_only()),
                ),
            ])
            .await?;
        let (session, tombstone) = (&reads[0], &reads[1]);
        let value = Self::session_state(session, tombstone, owner_id)?;
        let lease = session.first().map(KeyValue::lease).unwrap_or_default();
        let tombstone_lease = tombstone.first().map(KeyValue::lease).unwrap_or_default();
        let (alive, _) = tokio::join!(self.keep_alive(lease), self.keep_alive(tombstone_lease));
        if alive? <= 0 {
            return Err(StoreError::SessionExpired);
        }
        let held = self
            .client()
            .get(
                self.k_index_prefix(session_id),
                Some(GetOptions::new().with_prefix().with_count_only()),
            )
            .await
            .map_err(map_etcd)?
            .count();
        let now = now_ms();
        Ok(Heartbeat {
            session_id,
            expires_at: millis(now + value.ttl_millis),
            server_time: millis(now),
            held_lock_count: held,
        })
    }

    pub async fn end_session(&self, session_id: Uuid, owner_id: &str) -> StoreResult<()> {
        let reads = self
            .read(vec![
                TxnOp::get(self.k_session(session_id), None),
                TxnOp::get(self.k_tombstone(session_id), None),
                TxnOp::get(
                    self.k_index_prefix(session_id),
                    Some(GetOptions::new().with_prefix().with_keys_only()),
                ),
            ])
            .await?;
        Self::session_state(&reads[0], &reads[1], owner_id)?;
        let index_prefix = self.k_index_prefix(session_id);
        for index in &reads[2] {
            let Some(key) = index
                .key_str()
                .ok()
                .and_then(|k| k.strip_prefix(&index_prefix))
            else {
                continue;
            };
            let lock = self
                .client()
                .get(self.k_lock(key), None)
                .await
                .map_err(map_etcd)?;
            if let Some(kv) = lock.kvs().first()
                && decode::<GrantValue>(kv)?.session_id == session_id
            {
                let txn = Txn::new()
                    .when([Compare::mod_revision(
                        self.k_lock(key),
                        CompareOp::Equal,
                        kv.mod_revision(),
                    )])
                    .and_then([TxnOp::delete(self.k_lock(key), None)]);
                self.client().txn(txn).await.map_err(map_etcd)?;
            }
        }
        let lease = reads[0].first().map(KeyValue::lease).unwrap_or_default();
        let tombstone_lease = reads[1].first().map(KeyValue::lease).unwrap_or_default();
        let txn = Txn::new().and_then([
            TxnOp::delete(self.k_session(session_id), None),
            TxnOp::delete(self.k_tombstone(session_id), None),
            TxnOp::delete(
                index_prefix.as_str(),
                Some(etcd_client::DeleteOptions::new().with_prefix()),
            ),
        ]);
        self.client().txn(txn).await.map_err(map_etcd)?;
        self.drop_lease(lease);
        self.drop_lease(tombstone_lease);
        Ok(())
    }

    pub async fn try_acquire(
        &self,
        key: &str,
        session_id: Uuid,
        owner_id: &str,
        ttl_ms: i64,
        ticket: Option<&WaiterTicket>,
    ) -> StoreResult<Acquire> {
        for _ in 0..TXN_ATTEMPTS_MAX {
            let reads = self
                .read(vec![
                    TxnOp::get(self.k_session(session_id), None),
                    TxnOp::get(self.k_tombstone(session_id), None),
                    TxnOp::get(self.k_lock(key), None),
                ])
                .await?;
            Self::session_state(&reads[0], &reads[1], owner_id)?;
            let holder = self.holder(reads[2].first(), Some(session_id)).await?;
            if let Some(holder) = &holder {
                if holder.live {
                    return Ok(Acquire::Contended(Contention {
                        holder_owner_id: Some(holder.value.owner_id.clone()),
                        expires_at: Some(millis(holder.value.expires_at_ms)),
                        waiter_count: self.count_waiters(key).await?,
                    }));
                }
                // The holder's session ended: the grant is over. Clear it and look again.
                self.clear_lapsed(key, holder).await?;
                continue;
            }
            // The head is the oldest waiter whose session is alive.
            let queue = self.queue(key, true).await?;
            let head = queue.live.first().map(|(name, _)| name.clone());
            let mine = ticket.map(|t| self.k_waiter(key, t.id));
            if head.is_some() && head != mine {
                return Ok(Acquire::Contended(Contention {
                    holder_owner_id: None,
                    expires_at: None,
                    waiter_count: queue.live.len() as i64,
                }));
            }
            let lease = self.grant_lease(ttl_ms).await?;
            let now = now_ms();
            let value = GrantValue {
                owner_id: owner_id.to_owned(),
                session_id,
                ttl_millis: ttl_ms,
                acquired_at_ms: now,
                expires_at_ms: now + ttl_ms,
                lease,
            };
            let with_lease = || Some(PutOptions::new().with_lease(lease));
            let mut when = vec![
                Compare::version(self.k_session(session_id), CompareOp::Greater, 0),
                Compare::create_revision(self.k_lock(key), CompareOp::Equal, 0),
            ];
            let mut then = vec![
                TxnOp::put(self.k_lock(key), encode(&value)?, with_lease()),
                TxnOp::put(self.k_index(session_id, key), Vec::new(), with_lease()),
                TxnOp::put(
                    self.k_seen(key),
                    encode(&SeenValue {
                        last_granted_at_ms: now,
                    })?,
                    None,
                ),
            ];
            if let Some(mine) = &mine {
                when.push(Compare::version(mine.as_str(), CompareOp::Greater, 0));
                then.push(TxnOp::delete(mine.as_str(), None));
            }
            let response = self
                .client()
                .txn(Txn::new().when(when).and_then(then))
                .await
                .map_err(map_etcd)?;
            if response.succeeded() {
                let token = response.header().map(|h| h.revision()).unwrap_or_default();
                if token <= 0 {
                    return Err(StoreError::Backend("etcd returned no revision".into()));
                }
                if let Some(t) = ticket.and_then(|t| t.lease) {
                    self.drop_lease(t);
                }
                return Ok(Acquire::Granted(Self::grant_of(key, token, &value)));
            }
            self.drop_lease(lease);
        }
        Err(StoreError::Backend(format!(
            "acquire of {key} lost {TXN_ATTEMPTS_MAX} races in a row"
        )))
    }

    /// Live waiters, for a `waiterCount`. A read: waiters of dead sessions are left to the
    /// next acquire or enqueue of the key (or their lease).
    async fn count_waiters(&self, key: &str) -> StoreResult<i64> {
        Ok(self.queue(key, false).await?.live.len() as i64)
    }

    /// The live waiters of `key`, oldest first. Waiters whose session is gone (expired or ended)
    /// are left out and, with `clean`, deleted: they would otherwise hold the head and fill the
    /// cap until their own lease lapsed.
    async fn queue(&self, key: &str, clean: bool) -> StoreResult<Queue> {
        let response = self
            .client()
            .get(
                self.k_waiters(key),
                Some(
                    GetOptions::new()
                        .with_prefix()
                        .with_sort(SortTarget::Create, SortOrder::Ascend),
                ),
            )
            .await
            .map_err(map_etcd)?;
        let revision = response.header().map(|h| h.revision()).unwrap_or_default();
        let mut waiters = Vec::with_capacity(response.kvs().len());
        for kv in response.kvs() {
            let (Ok(name), Ok(session)) = (kv.key_str(), kv.value_str()) else {
                continue;
            };
            // A value that is not a session id is not a waiter of ours: it never counts.
            if let Ok(session) = Uuid::parse_str(session) {
                waiters.push((name.to_owned(), session));
            }
        }
        let mut sessions: Vec<Uuid> = waiters.iter().map(|(_, s)| *s).collect();
        sessions.sort_unstable();
        sessions.dedup();
        let mut alive = std::collections::HashSet::new();
        for chunk in sessions.chunks(TXN_OPS_MAX) {
            let ops: Vec<TxnOp> = chunk
                .iter()
                .map(|s| {
                    TxnOp::get(
                        self.k_session(*s),
                        Some(GetOptions::new().with_count_only()),
                    )
                })
                .collect();
            let response = self
                .client()
                .txn(Txn::new().and_then(ops))
                .await
                .map_err(map_etcd)?;
            for (session, op) in chunk.iter().zip(response.op_responses()) {
                if let TxnOpResponse::Get(get) = op
                    && get.count() > 0
                {
                    alive.insert(*session);
                }
            }
        }
        let (live, dead): (Vec<_>, Vec<_>) = waiters
            .into_iter()
            .partition(|(_, session)| alive.contains(session));
        // A session never comes back, so its waiters can go unconditionally.
        for chunk in dead.chunks(TXN_OPS_MAX).filter(|_| clean) {
            let ops: Vec<TxnOp> = chunk
                .iter()
                .map(|(name, _)| TxnOp::delete(name.as_str(), None))
                .collect();
            self.client()
                .txn(Txn::new().and_then(ops))
                .await
                .map_err(map_etcd)?;
        }
        Ok(Queue { live, revision })
    }

    pub async fn enqueue(
        &self,
        key: &str,
        session_id: Uuid,
        owner_id: &str,
        deadline_ms: i64,
        bounds: QueueBounds,
    ) -> StoreResult<WaiterTicket> {
        let mut waiting = 0;
        for _ in 0..ENQUEUE_ATTEMPTS_MAX {
            let reads = self
                .read(vec![
                    TxnOp::get(self.k_session(session_id), None),
                    TxnOp::get(self.k_tombstone(session_id), None),
                ])
                .await?;
            Self::session_state(&reads[0], &reads[1], owner_id)?;
            let queue = self.queue(key, true).await?;
            waiting = queue.live.len() as i64;
            let mine = queue.live.iter().filter(|(_, s)| *s == session_id).count() as i64;
            if mine >= bounds.per_session {
                return Err(StoreError::SessionShareFull {
                    waiter_count: waiting,
                    share: bounds.per_session,
                });
            }
            if waiting >= bounds.per_key {
                return Err(StoreError::QueueFull {
                    waiter_count: waiting,
                });
            }
            let id = Uuid::new_v4();
            let lease = self.grant_lease(deadline_ms).await?;
            // Atomic against other enqueues: no waiter of this key was written since the queue
            // was counted (a waiter that left since only makes the count conservative), and the
            // session is still alive.
            let txn = Txn::new()
                .when([
                    Compare::version(self.k_session(session_id), CompareOp::Greater, 0),
                    Compare::mod_revision(self.k_waiters(key), CompareOp::Less, queue.revision + 1)
                        .with_prefix(),
                ])
                .and_then([TxnOp::put(
                    self.k_waiter(key, id),
                    session_id.to_string(),
                    Some(PutOptions::new().with_lease(lease)),
                )]);
            let response = self.client().txn(txn).await.map_err(map_etcd)?;
            if response.succeeded() {
                return Ok(WaiterTicket {
                    id,
                    key: key.to_owned(),
                    lease: Some(lease),
                });
            }
            self.drop_lease(lease);
        }
        // Nothing was written: the caller is told to back off, as for a full queue.
        tracing::warn!(
            event = "enqueue_lost_races",
            key,
            attempts = ENQUEUE_ATTEMPTS_MAX,
            "joining a waiter queue lost every race to other arrivals; the caller backs off"
        );
        Err(StoreError::QueueFull {
            waiter_count: waiting,
        })
    }

    pub async fn dequeue(&self, ticket: &WaiterTicket) -> StoreResult<()> {
        self.client()
            .delete(self.k_waiter(&ticket.key, ticket.id), None)
            .await
            .map_err(map_etcd)?;
        if let Some(lease) = ticket.lease {
            self.drop_lease(lease);
        }
        Ok(())
    }

    /// The token of the live grant on `key`, for a LOCK_LOST body.
    async fn live_token(&self, key: &str) -> StoreResult<Option<i64>> {
        let lock = self
            .client()
            .get(self.k_lock(key), None)
            .await
            .map_err(map_etcd)?;
        let holder = self.holder(lock.kvs().first(), None).await?;
        Ok(holder.filter(|h| h.live).map(|h| h.kv.create_revision()))
    }

    pub async fn renew(
        &self,
        key: &str,
        session_id: Uuid,
        owner_id: &str,
        token: i64,
        ttl_ms: Option<i64>,
    ) -> StoreResult<LockGrant> {
        let reads = self
            .read(vec![
                TxnOp::get(self.k_session(session_id), None),
                TxnOp::get(self.k_tombstone(session_id), None),
                TxnOp::get(self.k_lock(key), None),
            ])
            .await?;
        Self::session_state(&reads[0], &reads[1], owner_id)?;
        let holder = self.holder(reads[2].first(), Some(session_id)).await?;
        // (key, token) names the grant; the caller must also be its owner (a token is public, so
        // anyone could name it). A non-owner is LOCK_LOST, C3's code for a non-holder.
        let Some(holder) = holder
            .filter(|h| h.live && h.kv.create_revision() == token && h.value.owner_id == owner_id)
        else {
            return Err(StoreError::LockLost {
                stored_token: self.live_token(key).await?,
            });
        };
        let ttl_ms = ttl_ms.unwrap_or(holder.value.ttl_millis);
        let lease = self.grant_lease(ttl_ms).await?;
        let now = now_ms();
        let value = GrantValue {
            ttl_millis: ttl_ms,
            expires_at_ms: now + ttl_ms,
            lease,
            ..holder.value.clone()
        };
        let txn = Txn::new()
            .when([
                Compare::create_revision(self.k_lock(key), CompareOp::Equal, token),
                Compare::mod_revision(self.k_lock(key), CompareOp::Equal, holder.kv.mod_revision()),
                Compare::version(self.k_session(value.session_id), CompareOp::Greater, 0),
            ])
            .and_then([
                TxnOp::put(
                    self.k_lock(key),
                    encode(&value)?,
                    Some(PutOptions::new().with_lease(lease)),
                ),
                TxnOp::put(
                    self.k_index(value.session_id, key),
                    Vec::new(),
                    Some(PutOptions::new().with_lease(lease)),
                ),
            ]);
        let response = self.client().txn(txn).await.map_err(map_etcd)?;
        if !response.succeeded() {
            self.drop_lease(lease);
            return Err(StoreError::LockLost {
                stored_token: self.live_token(key).await?,
            });
        }
        self.drop_lease(holder.value.lease);
        Ok(Self::grant_of(key, token, &value))
    }

    pub async fn release(&self, key: &str, owner_id: &str, token: i64) -> StoreResult<()> {
        let lock = self
            .client()
            .get(self.k_lock(key), None)
            .await
            .map_err(map_etcd)?;
        let holder = self.holder(lock.kvs().first(), None).await?;
        // Compare-and-delete on (key, token), by the grant's owner only: another owner's grant
        // is left alone and the caller hears LOCK_LOST, as any non-holder does.
        let Some(holder) =
            holder.filter(|h| h.kv.create_revision() == token && h.value.owner_id == owner_id)
        else {
            return Err(StoreError::LockLost {
                stored_token: self.live_token(key).await?,
            });
        };
        let txn = Txn::new()
            .when([Compare::create_revision(
                self.k_lock(key),
                CompareOp::Equal,
                token,
            )])
            .and_then([
                TxnOp::delete(self.k_lock(key), None),
                TxnOp::delete(self.k_index(holder.value.session_id, key), None),
            ]);
        let response = self.client().txn(txn).await.map_err(map_etcd)?;
        if response.succeeded() {
            self.drop_lease(holder.value.lease);
        }
        if response.succeeded() && holder.live {
            Ok(())
        } else {
            Err(StoreError::LockLost {
                stored_token: self.live_token(key).await?,
            })
        }
    }

    pub async fn lock_info(&self, key: &str) -> StoreResult<Option<LockInfo>> {
        let reads = self.read(vec![TxnOp::get(self.k_lock(key), None)]).await?;
        let seen = self
            .client()
            .get(self.k_seen(key), Some(GetOptions::new().with_count_only()))
            .await
            .map_err(map_etcd)?
            .count()
            > 0;
        if !seen {
            return Ok(None);
        }
        let waiter_count = self.count_waiters(key).await?;
        let holder = self
            .holder(reads[0].first(), None)
            .await?
            .filter(|h| h.live);
        Ok(Some(match holder {
            Some(h) => LockInfo {
                key: key.to_owned(),
                held: true,
                owner_id: Some(h.value.owner_id.clone()),
                session_id: Some(h.value.session_id),
                fencing_token: Some(h.kv.create_revision()),
                acquired_at: Some(millis(h.value.acquired_at_ms)),
                expires_at: Some(millis(h.value.expires_at_ms)),
                waiter_count,
            },
            None => LockInfo {
                key: key.to_owned(),
                held: false,
                owner_id: None,
                session_id: None,
                fencing_token: None,
                acquired_at: None,
                expires_at: None,
                waiter_count,
            },
        }))
    }

    pub async fn held(&self, limit: i64) -> StoreResult<HeldLocks> {
        let lock_prefix = format!("{}/l/", self.prefix);
        let reads = self
            .read(vec![
                TxnOp::get(lock_prefix.as_str(), Some(GetOptions::new().with_prefix())),
                TxnOp::get(
                    format!("{}/s/", self.prefix),
                    Some(GetOptions::new().with_prefix().with_keys_only()),
                ),
            ])
            .await?;
        let live_sessions: std::collections::HashSet<String> = reads[1]
            .iter()
            .filter_map(|kv| kv.key_str().ok().map(str::to_owned))
            .collect();
        let mut items = Vec::new();
        for kv in &reads[0] {
            let value: GrantValue = decode(kv)?;
            if !live_sessions.contains(&self.k_session(value.session_id)) {
                continue;
            }
            let Some(key) = kv.key_str().ok().and_then(|k| k.strip_prefix(&lock_prefix)) else {
                continue;
            };
            items.push(Self::grant_of(key, kv.create_revision(), &value));
        }
        let truncated = items.len() as i64 > limit;
        items.truncate(limit as usize);
        Ok(HeldLocks { items, truncated })
    }

    pub async fn revoke(
        &self,
        key: &str,
        expected_token: Option<i64>,
        operator: &str,
        reason: &str,
        caller: Option<&str>,
    ) -> StoreResult<Revocation> {
        for _ in 0..TXN_ATTEMPTS_MAX {
            let lock = self
                .client()
                .get(self.k_lock(key), None)
                .await
                .map_err(map_etcd)?;
            let Some(holder) = self
                .holder(lock.kvs().first(), None)
                .await?
                .filter(|h| h.live)
            else {
                return Err(StoreError::NotHeld);
            };
            let token = holder.kv.create_revision();
            if let Some(expected) = expected_token
                && expected != token
            {
                return Err(StoreError::FencedOut {
                    expected,
                    stored: token,
                    owner_id: holder.value.owner_id.clone(),
                });
            }
            let revocation_id = Uuid::new_v4();
            let revoked_at_ms = now_ms();
            let record = RevocationValue {
                key: key.to_owned(),
                revoked_token: token,
                revoked_owner_id: holder.value.owner_id.clone(),
                operator: operator.to_owned(),
                revoked_by: caller.map(str::to_owned),
                reason: reason.to_owned(),
                revoked_at_ms,
            };
            let txn = Txn::new()
                .when([Compare::create_revision(
                    self.k_lock(key),
                    CompareOp::Equal,
                    token,
                )])
                .and_then([
                    TxnOp::delete(self.k_lock(key), None),
                    TxnOp::delete(self.k_index(holder.value.session_id, key), None),
                    TxnOp::put(self.k_revocation(revocation_id), encode(&record)?, None),
                ]);
            let response = self.client().txn(txn).await.map_err(map_etcd)?;
            if !response.succeeded() {
                continue;
            }
            self.drop_lease(holder.value.lease);
            let floor = response.header().map(|h| h.revision()).unwrap_or_default();
            return Ok(Revocation {
                key: key.to_owned(),
                revoked_token: token,
                revoked_owner_id: holder.value.owner_id,
                new_token_floor: floor,
                revocation_id,
                operator: operator.to_owned(),
                reason: reason.to_owned(),
                revoked_at: millis(revoked_at_ms),
            });
        }
        Err(StoreError::Backend(format!(
            "revoke of {key} lost {TXN_ATTEMPTS_MAX} races in a row"
        )))
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
