//! The high-water of the tokens answered, kept in lockdb, outside etcd
//! (docs/design.md#d-12-etcd).
//!
//! A token on etcd is a revision, and a restore of etcd takes the revision back: the grants that
//! follow would get tokens the lock server already answered. Every grant's token is recorded in
//! lockdb (`dlock_etcd_high_water`, migrations/lockdb/0016_baseline.sql) before it is
//! answered, and answered only if it is above every token recorded before it. Records are ordered
//! by lockdb's row lock, so the tokens answered, by every replica, only grow: none is answered
//! twice, whatever etcd did. A token at or below the high-water is withdrawn (its grant deleted);
//! if etcd's revision is then below the high-water, etcd went back (a revision already issued
//! is ahead of it) and the acquire is refused until it passes; otherwise a concurrent grant of a
//! later revision recorded first, and the acquire draws a new revision.

use dlock_server::pg::PgSettings;
use sqlx::PgPool;

use crate::metrics::EtcdMetrics;

use super::*;

/// lockdb's record of the highest token answered under one prefix.
pub(super) struct HighWater {
    pool: PgPool,
    /// The row: the etcd prefix (`lock.etcd.prefix`).
    name: String,
    /// Tokens waiting for the next record, which takes them together (group commit).
    pending: std::sync::Mutex<Pending>,
    /// The refusals while etcd is behind, for `/metrics`.
    metrics: EtcdMetrics,
}

/// The tokens of grants made while a record is in flight, and whether one is.
#[derive(Default)]
struct Pending {
    waiting: Vec<(i64, tokio::sync::oneshot::Sender<Result<i64, String>>)>,
    flushing: bool,
}

/// What the high-water says of a grant just created.
pub(super) enum Verdict {
    /// Above every token answered before: answer it.
    Answer,
    /// Withdrawn: a concurrent grant of a later revision recorded first; draw again.
    DrawAgain,
}

impl HighWater {
    /// Opens lockdb (applying its migrations, as the pg backend does) and reads the high-water.
    pub(super) async fn open(settings: &PgSettings, name: &str) -> anyhow::Result<(Self, i64)> {
        let pool = settings
            .connect("dlock-lock-server", &crate::store::pg::MIGRATOR, "lockdb")
            .await?;
        let high_water: Option<i64> =
            sqlx::query_scalar("SELECT token FROM etcd_high_water WHERE name = $1")
                .bind(name)
                .fetch_optional(&pool)
                .await
                .map_err(|e| {
                    anyhow::anyhow!(
                        "reading the high-water of the etcd tokens from lockdb \
                         (lock.etcd.high-water.url) failed: {e}"
                    )
                })?;
        let high_water = high_water.unwrap_or(0);
        let store = Self {
            pool,
            name: name.to_owned(),
            pending: Default::default(),
            metrics: EtcdMetrics::default(),
        };
        Ok((store, high_water))
    }

    /// Records `token`; the bound it must be above to be answered: the high-water before the
    /// record that took it.
    ///
    /// Tokens granted while a record is in flight wait and go together in the next one, which
    /// records their highest (group commit, as the pg backend's, docs/design.md#group-commit):
    /// every token of a record that is above the high-water before it may be answered, as long as
    /// no other token of the same record equals it (two equal tokens in one record can only come
    /// from two etcd histories, a restore between them: neither is answered). So each answered
    /// token is above every token of every earlier record, and distinct from those of its own:
    /// none is answered twice. The record runs in a task of its own, so a request that goes away
    /// cannot stop the others' answers.
    async fn record(self: &std::sync::Arc<Self>, token: i64) -> Result<i64, String> {
        let (answer, answered) = tokio::sync::oneshot::channel();
        let start = {
            let mut pending = self
                .pending
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            pending.waiting.push((token, answer));
            !std::mem::replace(&mut pending.flushing, true)
        };
        if start {
            tokio::spawn(self.clone().flush());
        }
        answered
            .await
            .map_err(|_| "the record of the high-water ended without an answer".to_owned())?
    }

    /// Records the waiting tokens, a batch at a time, until none wait.
    async fn flush(self: std::sync::Arc<Self>) {
        loop {
            let batch = {
                let mut pending = self
                    .pending
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
                if pending.waiting.is_empty() {
                    pending.flushing = false;
                    return;
                }
                std::mem::take(&mut pending.waiting)
            };
            let highest = batch.iter().map(|(t, _)| *t).max().unwrap_or_default();
            let recorded: Result<i64, String> =
                sqlx::query_scalar("SELECT dlock_etcd_high_water($1, $2)")
                    .bind(&self.name)
                    .bind(highest)
                    .fetch_one(&self.pool)
                    .await
                    .map_err(|e| e.to_string());
            let tokens: Vec<i64> = batch.iter().map(|(t, _)| *t).collect();
            let answers = match recorded {
                Ok(before) => bounds(&tokens, before).into_iter().map(Ok).collect(),
                Err(e) => vec![Err(e); tokens.len()],
            };
            for ((_, answer), bound) in batch.into_iter().zip(answers) {
                let _ = answer.send(bound);
            }
        }
    }
}

/// The bound each token of one record must be above to be answered, the record having found the
/// high-water at `before`: `before`, or for a token that occurs twice in the record, the token
/// itself (so neither is answered).
fn bounds(tokens: &[i64], before: i64) -> Vec<i64> {
    let mut sorted = tokens.to_vec();
    sorted.sort_unstable();
    tokens
        .iter()
        .map(|&token| {
            let same =
                sorted.partition_point(|t| *t <= token) - sorted.partition_point(|t| *t < token);
            if same > 1 { before.max(token) } else { before }
        })
        .collect()
}

/// The refusal of every acquire while etcd's revision is below the tokens already answered, and
/// what the operator does about it, in the log.
pub(super) fn revision_behind(prefix: &str, revision: i64, high_water: i64) -> StoreError {
    tracing::error!(
        event = "etcd_revision_went_back",
        prefix,
        etcd_revision = revision,
        high_water,
        "etcd's revision went back below the tokens already issued (etcd was restored to an \
         older revision): acquires are refused until it passes {high_water}. Restore with \
         `etcdutl snapshot restore --bump-revision` past {high_water} (a bump of at least {} and \
         --mark-compacted), or write to etcd until its revision passes {high_water} \
         (docs/runbook.md#etcd-restored-from-a-backup)",
        high_water - revision + 1
    );
    StoreError::RevisionBehind {
        revision,
        high_water,
    }
}

impl EtcdStore {
    /// The refusals while etcd is behind its high-water, when it keeps one.
    pub fn etcd_metrics(&self) -> Option<EtcdMetrics> {
        self.high_water.as_ref().map(|h| h.metrics.clone())
    }

    /// Opens the high-water when `lock.etcd.high-water.url` is set, and says at start whether a
    /// restore of etcd is detected.
    pub(super) async fn open_high_water(
        settings: &EtcdSettings,
        client: &super::super::etcd_conn::ClientCell,
        prefix: &str,
    ) -> anyhow::Result<Option<HighWater>> {
        let Some(pg) = &settings.high_water else {
            tracing::warn!(
                event = "etcd_restore_not_detected",
                prefix,
                "lock.etcd.high-water.url is not set: if etcd is restored to an older revision \
                 (a snapshot, an older data directory), this lock server will answer tokens it \
                 already answered, and only the resources' fences stop their writes. Set \
                 lock.etcd.high-water.url to a lockdb to detect it (docs/design.md#d-12-etcd)"
            );
            return Ok(None);
        };
        let (high_water, recorded) = HighWater::open(pg, prefix).await?;
        let revision = client
            .client()
            .get(
                format!("{prefix}/ready"),
                Some(GetOptions::new().with_count_only()),
            )
            .await
            .ok()
            .and_then(|r| r.header().map(|h| h.revision()));
        match revision {
            Some(revision) if revision < recorded => {
                high_water.metrics.behind(revision, recorded);
                let _ = revision_behind(prefix, revision, recorded);
            }
            _ => tracing::info!(
                event = "etcd_high_water",
                prefix,
                high_water = recorded,
                etcd_revision = revision,
                "tokens are recorded in lockdb before they are answered; a restore of etcd to \
                 an older revision is detected"
            ),
        }
        Ok(Some(high_water))
    }

    /// Records the token of the grant of `key` just created (its lease `lease`) and says whether
    /// it may be answered. A grant that may not is deleted first: nothing is held afterwards.
    pub(super) async fn check_high_water(
        &self,
        high_water: &std::sync::Arc<HighWater>,
        key: &str,
        session_id: Uuid,
        token: i64,
        lease: i64,
    ) -> StoreResult<Verdict> {
        let previous = match high_water.record(token).await {
            Ok(previous) => previous,
            Err(e) => {
                // The record may have been made (the high-water raised to this token, which only
                // makes it stricter); the grant goes either way, so nothing was granted.
                self.withdraw(key, session_id, token, lease).await?;
                return Err(StoreError::NotLeader(format!(
                    "lockdb (lock.etcd.high-water.url) did not record the token before it was \
                     answered, so the grant was withdrawn: {e}"
                )));
            }
        };
        if token > previous {
            high_water.metrics.caught_up();
            return Ok(Verdict::Answer);
        }
        let revision = self.withdraw(key, session_id, token, lease).await?;
        if revision < previous {
            // etcd's revision after the withdrawal is below a revision already answered: etcd
            // went back.
            high_water.metrics.refused(revision, previous);
            return Err(revision_behind(&self.prefix, revision, previous));
        }
        tracing::debug!(
            event = "etcd_token_redrawn",
            token,
            high_water = previous,
            "a grant of a later revision recorded first; the acquire draws a new revision"
        );
        Ok(Verdict::DrawAgain)
    }

    /// Deletes the grant of `key` with `token`, never answered; etcd's revision afterwards.
    async fn withdraw(
        &self,
        key: &str,
        session_id: Uuid,
        token: i64,
        lease: i64,
    ) -> StoreResult<i64> {
        let same_grant = Compare::create_revision(self.k_lock(key), CompareOp::Equal, token);
        let txn = self.end_grant(key, session_id, same_grant, None);
        // Whatever failed, the grant may still be there (until its lease lapses): never
        // NOT_LEADER, which promises that nothing was changed.
        let response = self.client().txn(txn).await.map_err(|e| {
            StoreError::OutcomeUnknown(format!(
                "the grant of {key} was created but its token may not be answered, and \
                 withdrawing it failed (it lapses with its lease): {e}"
            ))
        })?;
        self.drop_lease(lease);
        Ok(response.header().map(|h| h.revision()).unwrap_or_default())
    }
}

#[cfg(test)]
mod tests {
    use super::bounds;

    /// Which tokens of one record are answered: those above the bound.
    fn answered(tokens: &[i64], before: i64) -> Vec<i64> {
        tokens
            .iter()
            .zip(bounds(tokens, before))
            .filter(|(token, bound)| *token > bound)
            .map(|(token, _)| *token)
            .collect()
    }

    #[test]
    fn a_record_answers_its_tokens_above_the_high_water_and_never_one_twice() {
        // Out of revision order within the record: all above the high-water, all answered.
        assert_eq!(answered(&[12, 10, 11], 9), [12, 10, 11]);
        // At or below the high-water: withdrawn.
        assert_eq!(answered(&[12, 9, 7], 9), [12]);
        // The same token twice (two etcd histories in one record): neither.
        assert_eq!(answered(&[15, 13, 15, 14], 9), [13, 14]);
        assert_eq!(answered(&[], 9), Vec::<i64>::new());
    }
}
