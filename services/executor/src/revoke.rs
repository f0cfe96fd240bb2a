//! Forced revocation (D-3): end the grant at the lock server (L8), then push the new token floor
//! to both enforcement points for the account behind the key, so that every write with the
//! revoked token is FENCED_OUT at once — not only after the next holder writes.

use anyhow::{Context, Result, bail};
use dlock_contract::client::LockClient;
use dlock_contract::lock::Revocation;
use dlock_contract::payment::{FenceRequest, FenceResponse};
use dlock_contract::payment_client::PaymentClient;
use dlock_contract::rail::{HighWater, HighWaterRequest, RailClient};
use serde::Serialize;

#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct RevocationReport {
    pub revocation: Revocation,
    pub account_id: String,
    pub account_fence: FenceResponse,
    pub rail_high_water: HighWater,
}

/// `payout:{accountId}` → the account.
pub fn account_of(key: &str) -> Result<&str> {
    match key.strip_prefix("payout:") {
        Some(account) if !account.is_empty() => Ok(account),
        _ => bail!("{key} is not a payout lock key (payout:{{accountId}}); nothing to fence"),
    }
}

/// Runs the whole flow, reporting each step through `step`.
pub async fn revoke(
    lock: &LockClient,
    payment: &PaymentClient,
    rail: &RailClient,
    key: &str,
    operator: &str,
    reason: &str,
    mut step: impl FnMut(&str),
) -> Result<RevocationReport> {
    let account_id = account_of(key)?.to_owned();
    let revocation = lock
        .revoke(key, operator, reason, None)
        .await
        .with_context(|| format!("revoking {key} at the lock server"))?;
    step(&format!(
        "lock server: revoked token {} of {}; new token floor {} (revocation {})",
        revocation.revoked_token,
        revocation.revoked_owner_id,
        revocation.new_token_floor,
        revocation.revocation_id
    ));
    let fence = FenceRequest {
        floor: revocation.new_token_floor,
        operator: operator.to_owned(),
        reason: reason.to_owned(),
        revocation_id: revocation.revocation_id,
    };
    let key_for_fence = format!("revoke-{}", revocation.revocation_id);
    let account_fence = payment
        .advance_fence(&account_id, &key_for_fence, &fence)
        .await
        .with_context(|| format!("pushing the floor to the payment resource for {account_id}"))?;
    step(&format!(
        "payment resource: account {account_id} fence {} -> {}",
        account_fence.previous_fence, account_fence.fence
    ));
    let rail_high_water = rail
        .advance_high_water(
            &account_id,
            &HighWaterRequest {
                floor: revocation.new_token_floor,
                operator: operator.to_owned(),
                reason: reason.to_owned(),
                revocation_id: Some(revocation.revocation_id),
            },
        )
        .await
        .with_context(|| format!("pushing the floor to the rail proxy for {account_id}"))?;
    step(&format!(
        "rail proxy: account {account_id} high-water {} -> {}",
        rail_high_water.previous_token.unwrap_or_default(),
        rail_high_water.highest_token
    ));
    step(
        "done: every write with the revoked token is now FENCED_OUT at the account and at the rail",
    );
    Ok(RevocationReport {
        revocation,
        account_id,
        account_fence,
        rail_high_water,
    })
}
