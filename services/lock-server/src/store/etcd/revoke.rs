//! L8 on etcd: a revocation ends the grant and raises the token floor in one transaction.

use super::*;

impl EtcdStore {
    pub async fn revoke(&self, order: &RevokeOrder<'_>) -> StoreResult<Revocation> {
        let key = order.key;
        for _ in 0..TXN_ATTEMPTS_MAX {
            let Some(holder) = self.read_holder(key).await?.filter(|h| h.live) else {
                return Err(StoreError::NotHeld);
            };
            let token = holder.kv.create_revision();
            order.check_token(token, &holder.value.owner_id)?;
            let revocation_id = Uuid::new_v4();
            let revoked_at_ms = now_ms();
            let record = RevocationValue {
                key: key.to_owned(),
                revoked_token: token,
                revoked_owner_id: holder.value.owner_id.clone(),
                operator: order.operator.to_owned(),
                revoked_by: order.caller.map(str::to_owned),
                reason: order.reason.to_owned(),
                revoked_at_ms,
            };
            let txn = self.end_grant(
                key,
                holder.value.session_id,
                Compare::create_revision(self.k_lock(key), CompareOp::Equal, token),
                Some(TxnOp::put(
                    self.k_revocation(revocation_id),
                    encode(&record)?,
                    None,
                )),
            );
            let response = self.write(txn).await?;
            if !response.succeeded() {
                continue;
            }
            self.drop_lease(holder.value.lease);
            let floor = response.header().map(|h| h.revision()).unwrap_or_default();
            return Ok(order.revocation(Revoked {
                token,
                owner_id: holder.value.owner_id,
                new_token_floor: floor,
                revocation_id,
                revoked_at: millis(revoked_at_ms),
            }));
        }
        Err(StoreError::Backend(format!(
            "revoke of {key} lost {TXN_ATTEMPTS_MAX} races in a row"
        )))
    }
}
