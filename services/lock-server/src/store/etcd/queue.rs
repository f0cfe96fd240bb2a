//! The waiter queue of a key on etcd: count, read (cleaning dead waiters), enqueue, dequeue.

use super::*;

impl EtcdStore {
    /// Live waiters, for a `waiterCount`. A read: waiters of dead sessions are left to the
    /// next acquire or enqueue of the key (or their lease).
    pub(super) async fn count_waiters(&self, key: &str) -> StoreResult<i64> {
        Ok(self.queue(key, false).await?.live.len() as i64)
    }

    /// The live waiters of `key`, oldest first. Waiters whose session is gone (expired or ended)
    /// are left out and, with `clean`, deleted: they would otherwise hold the head and fill the
    /// cap until their own lease lapsed.
    pub(super) async fn queue(&self, key: &str, clean: bool) -> StoreResult<Queue> {
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
        claim: Claim<'_>,
        bounds: QueueBounds,
    ) -> StoreResult<WaiterTicket> {
        let Claim {
            key, session_id, ..
        } = claim;
        let mut waiting = 0;
        for _ in 0..ENQUEUE_ATTEMPTS_MAX {
            self.read_session(session_id, claim.owner_id, None).await?;
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
            let lease = self.grant_lease(bounds.place_ms).await?;
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
            let response = match self.client().txn(txn).await {
                Ok(response) => response,
                Err(e) => {
                    // A place that was written lives on this lease: revoking it takes the place
                    // back (best effort; else it lapses with the lease).
                    self.drop_lease(lease);
                    return Err(map_etcd_sent(e));
                }
            };
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
}
