//! Grants on etcd: acquire, renew, release and the reads (L7, the held list).

use super::*;

impl EtcdStore {
    /// Reads a grant key and whether its session is still alive.
    pub(super) async fn holder(
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

    pub(super) fn grant_of(key: &str, token: i64, value: &GrantValue) -> LockGrant {
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
    pub(super) async fn clear_lapsed(&self, key: &str, holder: &Holder) -> StoreResult<()> {
        let unchanged =
            Compare::mod_revision(self.k_lock(key), CompareOp::Equal, holder.kv.mod_revision());
        let txn = self.end_grant(key, holder.value.session_id, unchanged, None);
        self.client().txn(txn).await.map_err(map_etcd)?;
        Ok(())
    }

    pub async fn try_acquire(&self, attempt: &Attempt<'_>) -> StoreResult<Acquire> {
        let claim = attempt.claim;
        let (key, session_id, owner_id) = (claim.key, claim.session_id, claim.owner_id);
        let (ttl_ms, ticket) = (attempt.ttl_ms, attempt.ticket);
        // How many of the attempts drew a token at or below the high-water (each withdrawn).
        let mut redrawn = 0;
        for _ in 0..TXN_ATTEMPTS_MAX {
            let lock = TxnOp::get(self.k_lock(key), None);
            let (_, reads) = self.read_session(session_id, owner_id, Some(lock)).await?;
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
                // With the high-water, the place goes only once the token may be answered: a
                // grant withdrawn keeps its place in the queue (see below).
                if self.high_water.is_none() {
                    then.push(TxnOp::delete(mine.as_str(), None));
                }
            }
            let response = self.write(Txn::new().when(when).and_then(then)).await?;
            if response.succeeded() {
                let token = response.header().map(|h| h.revision()).unwrap_or_default();
                if token <= 0 {
                    return Err(StoreError::Backend("etcd returned no revision".into()));
                }
                if let Some(high_water) = &self.high_water {
                    let verdict = self
                        .check_high_water(high_water, key, session_id, token, lease)
                        .await?;
                    if let high_water::Verdict::DrawAgain = verdict {
                        redrawn += 1;
                        continue;
                    }
                    if let Some(mine) = &mine
                        && let Err(e) = self.client().delete(mine.as_str(), None).await
                    {
                        // Its lease goes below, which deletes it too.
                        tracing::warn!(event = "etcd_waiter_left", key, error = %e,
                            "the place of a waiter just granted was not deleted; its lease is revoked");
                    }
                }
                if let Some(t) = ticket.and_then(|t| t.lease) {
                    self.drop_lease(t);
                }
                return Ok(Acquire::Granted(Self::grant_of(key, token, &value)));
            }
            self.drop_lease(lease);
        }
        if redrawn > 0 {
            // Every grant drawn was withdrawn before it was answered: nothing is held.
            return Err(StoreError::NotLeader(format!(
                "acquire of {key}: {redrawn} of {TXN_ATTEMPTS_MAX} grants drew a token at or \
                 below the high-water (concurrent grants recorded later revisions first, \
                 docs/design.md#d-12-etcd) and were withdrawn; nothing is held"
            )));
        }
        Err(StoreError::Backend(format!(
            "acquire of {key} lost {TXN_ATTEMPTS_MAX} races in a row"
        )))
    }

    /// The grant key of `key` and whether its session is alive, read on its own.
    pub(super) async fn read_holder(&self, key: &str) -> StoreResult<Option<Holder>> {
        let lock = self
            .client()
            .get(self.k_lock(key), None)
            .await
            .map_err(map_etcd)?;
        self.holder(lock.kvs().first(), None).await
    }

    /// The token of the live grant on `key`, for a LOCK_LOST body.
    pub(super) async fn live_token(&self, key: &str) -> StoreResult<Option<i64>> {
        let holder = self.read_holder(key).await?;
        Ok(holder.filter(|h| h.live).map(|h| h.kv.create_revision()))
    }

    pub async fn renew(&self, renewal: &Renewal<'_>) -> StoreResult<LockGrant> {
        let claim = renewal.claim;
        let (key, session_id, owner_id) = (claim.key, claim.session_id, claim.owner_id);
        let (token, ttl_ms) = (renewal.token, renewal.ttl_ms);
        let lock = TxnOp::get(self.k_lock(key), None);
        let (_, reads) = self.read_session(session_id, owner_id, Some(lock)).await?;
        let holder = self.holder(reads[2].first(), Some(session_id)).await?;
        // (key, token) names the grant; the caller must also be its owner (a token is public, so
        // anyone could name it). A non-owner is LOCK_LOST, the contract's code
        // (docs/contract.md#l6) for a non-holder.
        // So must its session: another session of the same owner is LOCK_LOST too, and gets no
        // fresh proof (lockdb's dlock_renew matches the session the same way).
        let Some(holder) = holder.filter(|h| {
            h.live
                && h.kv.create_revision() == token
                && h.value.owner_id == owner_id
                && h.value.session_id == session_id
        }) else {
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
        let response = self.write(txn).await?;
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
        let holder = self.read_holder(key).await?;
        // Compare-and-delete on (key, token), by the grant's owner only: another owner's grant
        // is left alone and the caller hears LOCK_LOST, as any non-holder does.
        let Some(holder) =
            holder.filter(|h| h.kv.create_revision() == token && h.value.owner_id == owner_id)
        else {
            return Err(StoreError::LockLost {
                stored_token: self.live_token(key).await?,
            });
        };
        let same_grant = Compare::create_revision(self.k_lock(key), CompareOp::Equal, token);
        let txn = self.end_grant(key, holder.value.session_id, same_grant, None);
        let response = self.write(txn).await?;
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
            .filter(|h| h.live)
            .map(|h| Self::grant_of(key, h.kv.create_revision(), &h.value));
        Ok(Some(lock_info(key, holder, waiter_count)))
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
        Ok(held_page(items, limit))
    }
}
