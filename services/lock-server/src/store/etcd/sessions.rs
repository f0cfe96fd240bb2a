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
        keeper.keep_alive().await.map_err(map_etcd)?;
        let response = match stream.message().await {
            Ok(response) => response,
            Err(e) if lost(&e) => return Ok(0),
            Err(e) => return Err(map_etcd(e)),
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

    pub async fn end_session(&self, session_id: Uuid, owner_id: &str) -> StoreResult<()> {
        let index = TxnOp::get(
            self.k_index_prefix(session_id),
            Some(GetOptions::new().with_prefix().with_keys_only()),
        );
        let (_, reads) = self.read_session(session_id, owner_id, Some(index)).await?;
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
}
