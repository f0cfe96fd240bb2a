//! L8 on etcd: a revocation ends the grant and raises the token floor in one transaction.

use super::*;

impl EtcdStore {
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
}
