//! Cancelling what is left of a batch (docs/contract.md#payout-states: PENDING | CLAIMED ──cancel
//! (batch deleted)──▶ ABANDONED), as the operator does when a PayoutBatch is deleted.
//!
//! Per account, under the canceller's own grant on `payout:{accountId}`: the grant's token is
//! above every token issued before it, so the cancel advances the account fence past any holder
//! that might still be working, and the payment resource refuses a payout that already reached
//! the rail (those are left to the executor's successors and to reconciliation).

use std::collections::BTreeMap;

use dlock_contract::client::{ClientError, LockClient};
use dlock_contract::payment::{CancelRequest, PayoutState};
use dlock_contract::payment_client::{Fence, PaymentClient};
use uuid::Uuid;

/// How long the canceller waits for a payout lock that a lapsing holder still has (a killed
/// executor's grant lives out its TTL); longer, and the caller retries.
const ACQUIRE_WAIT_MS: i64 = 25_000;
const LOCK_TTL_MS: i64 = 30_000;

/// What a cancel pass did, per payout.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct CancelReport {
    /// Now ABANDONED (by this pass or an earlier one).
    pub abandoned: Vec<Uuid>,
    /// Terminal, at the rail or ambiguous: not the canceller's to change.
    pub left: Vec<(Uuid, PayoutState)>,
    /// Never registered: nothing to cancel.
    pub unknown: Vec<Uuid>,
}

/// Cancels every payout of `payouts` (id, account) that is still PENDING or CLAIMED. Safe to
/// repeat: an ABANDONED payout is counted, not cancelled again. Fails on the first error a
/// retry might cure (the services unreachable, a lock held past the wait); what was cancelled
/// stays cancelled.
pub async fn cancel_unfinished(
    lock: &LockClient,
    payment: &PaymentClient,
    payouts: &[(Uuid, String)],
    operator: &str,
    reason: &str,
) -> Result<CancelReport, ClientError> {
    let mut by_account: BTreeMap<&str, Vec<Uuid>> = BTreeMap::new();
    for (id, account) in payouts {
        by_account.entry(account.as_str()).or_default().push(*id);
    }
    let mut report = CancelReport::default();
    let session = lock.create_session(Some(LOCK_TTL_MS)).await?;
    let outcome = async {
        for (account, ids) in &by_account {
            let mut open = Vec::new();
            for id in ids {
                match payment.get_payout(*id).await {
                    Ok(p) if matches!(p.state, PayoutState::Pending | PayoutState::Claimed) => {
                        open.push(*id);
                    }
                    Ok(p) if p.state == PayoutState::Abandoned => report.abandoned.push(*id),
                    Ok(p) => report.left.push((*id, p.state)),
                    Err(ClientError::Api { status: 404, .. }) => report.unknown.push(*id),
                    Err(e) => return Err(e),
                }
            }
            if open.is_empty() {
                continue;
            }
            let key = format!("payout:{account}");
            let grant = lock
                .acquire(
                    &key,
                    session.session_id,
                    Some(LOCK_TTL_MS),
                    Some(ACQUIRE_WAIT_MS),
                )
                .await?;
            let cancelled =
                cancel_under(payment, &grant, &open, operator, reason, &mut report).await;
            let _ = lock
                .release(&key, session.session_id, grant.fencing_token)
                .await;
            cancelled?;
        }
        Ok(())
    }
    .await;
    let _ = lock.end_session(session.session_id).await;
    outcome.map(|()| report)
}

async fn cancel_under(
    payment: &PaymentClient,
    grant: &dlock_contract::lock::LockGrant,
    open: &[Uuid],
    operator: &str,
    reason: &str,
    report: &mut CancelReport,
) -> Result<(), ClientError> {
    for id in open {
        // Re-read under the grant: the state to expect is the one no holder can change now.
        let payout = payment.get_payout(*id).await?;
        if !matches!(payout.state, PayoutState::Pending | PayoutState::Claimed) {
            report.left.push((*id, payout.state));
            continue;
        }
        let body = CancelRequest {
            expected_state: payout.state,
            operator: operator.to_owned(),
            reason: reason.to_owned(),
        };
        match payment
            .cancel(
                *id,
                Fence::new(
                    &format!("cancel-{id}-{}", grant.fencing_token),
                    grant.fencing_token,
                    grant.fencing_proof.as_deref(),
                ),
                &body,
            )
            .await
        {
            Ok(_) => report.abandoned.push(*id),
            // It reached the rail meanwhile (the database refuses): not ours to change.
            Err(ClientError::Api { status: 409, .. }) => {
                let state = payment.get_payout(*id).await?.state;
                if state == PayoutState::Abandoned {
                    report.abandoned.push(*id);
                } else {
                    report.left.push((*id, state));
                }
            }
            Err(e) => return Err(e),
        }
    }
    Ok(())
}
