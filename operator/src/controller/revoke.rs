//! The forced revocation flow (D-3), shared by the Lock annotations and LockRevocation:
//! revoke the grant on the lock server, then push the new token floor to both enforcement points,
//! the payment resource's account fence and the rail proxy's high-water mark.
//!
//! It runs once per request: a result already recorded for the same request is completed (only
//! the fences still missing are pushed again, with the recorded floor and revocation id), never
//! started again, so a retry never revokes a second, newer holder.

use crate::crd::RevocationResult;
use crate::services::{FenceRequest, RevokeRequest, ServiceError, Services};
use crate::validate::RevocationTarget;

pub const COMPLETE: &str = "Complete";
pub const INCOMPLETE: &str = "Incomplete";
pub const REFUSED: &str = "Refused";

/// Whether `previous` already answers `request` for good.
pub fn is_settled(previous: Option<&RevocationResult>, request: &str) -> bool {
    previous
        .is_some_and(|p| p.request == request && (p.outcome == COMPLETE || p.outcome == REFUSED))
}

pub async fn run(
    services: &dyn Services,
    target: &RevocationTarget,
    request: &str,
    previous: Option<&RevocationResult>,
) -> Result<RevocationResult, ServiceError> {
    let resumed = previous.filter(|p| p.request == request && p.revocation_id.is_some());
    let (revocation_id, floor, revoked_token, mut payment_fenced, mut rail_fenced) = match resumed {
        Some(p) => (
            p.revocation_id.clone().unwrap_or_default(),
            p.new_token_floor.unwrap_or(0),
            p.revoked_token,
            p.payment_fenced,
            p.rail_fenced,
        ),
        None => {
            let revoke = RevokeRequest {
                operator: target.operator.clone(),
                reason: target.reason.clone(),
            };
            match services
                .revoke_lock(&target.lock_server_url, &target.key, &revoke)
                .await
            {
                Ok(r) => (
                    r.revocation_id,
                    r.new_token_floor,
                    Some(r.revoked_token),
                    false,
                    false,
                ),
                Err(ServiceError::Refused { status, body, .. }) => {
                    return Ok(RevocationResult {
                        request: request.to_owned(),
                        outcome: REFUSED.to_owned(),
                        summary: Some(format!("the lock server refused: HTTP {status}: {body}")),
                        ..RevocationResult::default()
                    });
                }
                Err(error) => return Err(error),
            }
        }
    };
    let fence = FenceRequest {
        floor,
        operator: target.operator.clone(),
        reason: target.reason.clone(),
        revocation_id: revocation_id.clone(),
    };
    let mut problems = Vec::new();
    if !payment_fenced {
        match services
            .fence_account(&target.payment_resource_url, &target.account_id, &fence)
            .await
        {
            Ok(()) => payment_fenced = true,
            Err(error) => problems.push(error.to_string()),
        }
    }
    if !rail_fenced {
        match services
            .raise_high_water(&target.rail_proxy_url, &target.account_id, &fence)
            .await
        {
            Ok(()) => rail_fenced = true,
            Err(error) => problems.push(error.to_string()),
        }
    }
    let complete = payment_fenced && rail_fenced;
    let summary = if complete {
        format!(
            "revoked token {}, floor {floor} at both fences",
            revoked_token.unwrap_or(0)
        )
    } else {
        format!(
            "floor {floor} not yet at every fence: {}",
            problems.join("; ")
        )
    };
    Ok(RevocationResult {
        request: request.to_owned(),
        outcome: if complete { COMPLETE } else { INCOMPLETE }.to_owned(),
        revocation_id: Some(revocation_id),
        revoked_token,
        new_token_floor: Some(floor),
        payment_fenced,
        rail_fenced,
        summary: Some(summary),
    })
}
