//! Sessions on etcd: a session is a lease; its locks and index keys are attached to it.

use super::*;

impl EtcdStore {
    pub(super) fn session_state(
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
        self.write(txn).await?;
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
    pub(super) async fn keep_alive(&self, lease: i64) -> StoreResult<i64> {
        let lost = |e: &etcd_client::Error| {
            matches!(e, etcd_client::Error::LeaseKeepAliveError(m) if m.contains("lease not found"))
                || matches!(e, etcd_client::Error::GRpcStatus(s) if s.message().contains("requested lease not found"))
        };
        let (mut keeper, mut stream) = match self.client().lease_keep_alive(lease).await {
            Ok(pair) => pair,
            Err(e) if lost(&e) => return Ok(0),
            Err(e) => return Err(map_etcd(e)),
        };
        // Sent: from here a failure may hide a renewal that took effect.
        keeper.keep_alive().await.map_err(map_etcd_sent)?;
        let response = match stream.message().await {
            Ok(response) => response,
            Err(e) if lost(&e) => return Ok(0),
            Err(e) => return Err(map_etcd_sent(e)),
        };
        Ok(response.map(|r| r.ttl()).unwrap_or(0))
    }

    pub async fn heartbeat(&self, session_id: Uuid, owner_id: &str) -> StoreResult<Heartbeat> {
        let (value, reads) = self.read_session(session_id, owner_id, None).await?;
        let (session, tombstone) = (&reads[0], &reads[1]);
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

    /// L3 in one transaction: the session's key, its tombstone, its index and every grant key
    /// still the session's go at one revision, or nothing does. Each grant is guarded by the
    /// ModRevision it was read at, so a grant that lapsed and passed to another session since
    /// is never touched (the transaction fails, and everything is read again). A session whose
    /// grants do not fit one transaction (etcd's `--max-txn-ops`) still ends at once: a grant
    /// is live only while its session's key exists (`holder`), so the session's key goes in the
    /// first transaction with as many grants as fit, and the rest, dead with it, are cleared
    /// after.
    pub async fn end_session(&self, session_id: Uuid, owner_id: &str) -> StoreResult<()> {
        let index_prefix = self.k_index_prefix(session_id);
        for _ in 0..TXN_ATTEMPTS_MAX {
            let index = TxnOp::get(
                index_prefix.as_str(),
                Some(GetOptions::new().with_prefix().with_keys_only()),
            );
            let (_, reads) = self.read_session(session_id, owner_id, Some(index)).await?;
            let Some(session) = reads[0].first() else {
                return Err(StoreError::SessionUnknown);
            };
            let keys: Vec<String> = reads[2]
                .iter()
                .filter_map(|kv| kv.key_str().ok()?.strip_prefix(&index_prefix))
                .map(str::to_owned)
                .collect();
            // The grant keys, read at one revision; only those still this session's go.
            let mut grants: Vec<(String, i64, i64)> = Vec::new();
            for chunk in keys.chunks(TXN_OPS_MAX) {
                let ops = chunk
                    .iter()
                    .map(|k| TxnOp::get(self.k_lock(k), None))
                    .collect();
                for kv in self.read(ops).await?.iter().filter_map(|kvs| kvs.first()) {
                    let value: GrantValue = decode(kv)?;
                    if value.session_id == session_id {
                        grants.push((
                            kv.key_str().unwrap_or_default().to_owned(),
                            kv.mod_revision(),
                            value.lease,
                        ));
                    }
                }
            }
            // Compares and deletes share the budget with the session's own three operations.
            let first = grants.len().min(TXN_OPS_MAX - 3);
            let (now, later) = grants.split_at(first);
            let mut when = vec![Compare::mod_revision(
                self.k_session(session_id),
                CompareOp::Equal,
                session.mod_revision(),
            )];
            let mut then = vec![
                TxnOp::delete(self.k_session(session_id), None),
                TxnOp::delete(self.k_tombstone(session_id), None),
                TxnOp::delete(
                    index_prefix.as_str(),
                    Some(etcd_client::DeleteOptions::new().with_prefix()),
                ),
            ];
            for (lock, revision, _) in now {
                when.push(Compare::mod_revision(
                    lock.as_str(),
                    CompareOp::Equal,
                    *revision,
                ));
                then.push(TxnOp::delete(lock.as_str(), None));
            }
            let response = self.write(Txn::new().when(when).and_then(then)).await?;
            if !response.succeeded() {
                // The session or one of its grants changed since it was read: read again.
                continue;
            }
            // Dead with the session already; cleared so that they do not wait for their lease,
            // each only if it is still the one read (another session may hold the key by now).
            for chunk in later.chunks(TXN_OPS_MAX) {
                let txn = Txn::new()
                    .when(
                        chunk
                            .iter()
                            .map(|(lock, revision, _)| {
                                Compare::mod_revision(lock.as_str(), CompareOp::Equal, *revision)
                            })
                            .collect::<Vec<_>>(),
                    )
                    .and_then(
                        chunk
                            .iter()
                            .map(|(lock, _, _)| TxnOp::delete(lock.as_str(), None))
                            .collect::<Vec<_>>(),
                    );
                if let Err(e) = self.client().txn(txn).await {
                    tracing::debug!(event = "ended_session_grants_left", session_id = %session_id, error = %e, "grants of an ended session are left to their lease");
                    break;
                }
            }
            self.drop_lease(session.lease());
            if let Some(tombstone) = reads[1].first() {
                self.drop_lease(tombstone.lease());
            }
            for (_, _, lease) in &grants {
                self.drop_lease(*lease);
            }
            return Ok(());
        }
        Err(StoreError::Backend(format!(
            "ending session {session_id} lost {TXN_ATTEMPTS_MAX} races in a row"
        )))
    }
}
