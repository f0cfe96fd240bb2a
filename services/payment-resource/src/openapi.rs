//! The payment resource's OpenAPI document (docs/contract.md#s3-4), served at
//! `GET /v1/openapi.json`. Each operation documents the handler of its route in `routes/` (both
//! creates are `create`), the batches the batch route of their step (`dlock_server::batch`);
//! `scripts/check-openapi` checks that the committed `docs/openapi/payment-resource.json` is this
//! document.

#![allow(dead_code)]

use dlock_contract::batch::{BatchAnswer, BatchRequest, ClaimItem, PostItem};
use dlock_contract::error::ErrorBody;
use dlock_contract::openapi::BearerAuth;
use dlock_contract::payment::*;
use dlock_contract::proof::{FenceLowerRequest, FenceLowered};
use dlock_server::openapi::{
    BatchEndpoint, BatchEndpoints, Idempotent, Invalid, InvalidToken, NotFound, NotLeader,
    Unauthorized,
};
use utoipa::{IntoParams, OpenApi};

#[derive(OpenApi)]
#[openapi(
    info(title = "dlock payment resource", description = "Payouts, accounts and a double-entry ledger; fenced claims and postings."),
    paths(create_account, get_account, fund, set_limits, list_fundings, approve_funding, advance_fence, lower_fence, create_payout, list_payouts, get_payout, claim, post_payout, resolve, cancel, batch_claim, batch_post, healthz, readyz),
    modifiers(&BearerAuth, &BATCHES)
)]
pub struct ApiDoc;

/// The batch endpoints' owner header, security and refusals.
const BATCHES: BatchEndpoints = BatchEndpoints(&[
    BatchEndpoint::new("/v1/batches/claim", "claims", "P2's", NOT_LEADER),
    BatchEndpoint::new("/v1/batches/post", "postings", "P3's", NOT_LEADER),
]);
const NOT_LEADER: &str =
    "nothing ran. An item paydb does not take is that item's 503 NOT_LEADER, in its answer";

/// The payment resource's document.
pub fn document() -> utoipa::openapi::OpenApi {
    ApiDoc::openapi()
}

/// The headers of every write: who writes, and the key it runs once under.
#[derive(IntoParams)]
#[into_params(parameter_in = Header)]
struct Write {
    #[param(rename = "X-Owner-Id")]
    owner_id: String,
    #[param(rename = "X-Idempotency-Key")]
    idempotency_key: String,
}

/// The headers of a fenced write on a payout (P2, P3), before [`Write`]'s.
#[derive(IntoParams)]
#[into_params(parameter_in = Header)]
struct Fenced {
    /// decimal int64 > 0
    #[param(rename = "X-Fencing-Token")]
    fencing_token: String,
    /// the grant's fencingProof (`<key-id>.<hex>`); required when fencing.proof-keys-file is set, else INVALID_TOKEN
    #[param(rename = "X-Fencing-Proof")]
    fencing_proof: Option<String>,
}

/// Opens an account.
#[utoipa::path(post, path = "/v1/accounts", request_body = CreateAccountRequest,
    params(Write),
    security(("bearerAuth" = [])),
    responses((status = 201, body = Account), Invalid, Unauthorized, Idempotent, NotLeader))]
fn create_account() {}

/// P5: an account (advisory).
#[utoipa::path(get, path = "/v1/accounts/{accountId}", params(("accountId" = String, Path)),
    responses((status = 200, body = Account), Invalid, NotFound, NotLeader))]
fn get_account() {}

/// Funds an account.
#[utoipa::path(post, path = "/v1/accounts/{accountId}/fund", request_body = FundRequest,
    params(("accountId" = String, Path), Write),
    security(("bearerAuth" = [])),
    responses((status = 200, body = FundResponse), Invalid, Unauthorized, NotFound, Idempotent, NotLeader,
        (status = 202, description = "above auth.treasury.dual-approval-above, with what the same treasury identity funded on the account alone in the last 24 hours: recorded, not applied, until a second treasury identity approves it (docs/contract.md#dual-approval)", body = PendingFunding),
    ))]
fn fund() {}

/// Sets an account's limits: the largest single payout and the outflow per UTC day (treasury;
/// docs/contract.md#account-limits). paydb refuses a payout above them with LIMIT_EXCEEDED.
#[utoipa::path(post, path = "/v1/accounts/{accountId}/limits", request_body = AccountLimitsRequest,
    params(("accountId" = String, Path), Write),
    security(("bearerAuth" = [])),
    responses((status = 200, body = AccountLimits), Invalid, Unauthorized, NotFound, Idempotent, NotLeader))]
fn set_limits() {}

/// Lists the fundings that wait for a second treasury identity, or were approved by one
/// (treasury; a read, docs/contract.md#list-fundings), newest request first.
#[utoipa::path(get, path = "/v1/fundings",
    params(("state" = Option<FundingsFilter>, Query, description = "pending (the default), applied or all"),
           ("limit" = Option<i64>, Query, description = "1 to 500, default 100")),
    security(("bearerAuth" = [])),
    responses((status = 200, body = FundingList), Invalid, NotLeader,
        (status = 401, description = "UNAUTHENTICATED", body = ErrorBody),
        (status = 403, description = "FORBIDDEN: not a treasury identity", body = ErrorBody),
    ))]
fn list_fundings() {}

/// Applies a pending funding, once, by a second treasury identity (docs/contract.md#dual-approval).
#[utoipa::path(post, path = "/v1/fundings/{fundingId}/approve", request_body = ApproveFundingRequest,
    params(("fundingId" = String, Path), Write),
    security(("bearerAuth" = [])),
    responses((status = 200, body = ApprovedFunding), Invalid, Unauthorized, NotFound, Idempotent, NotLeader,
        (status = 403, description = "FORBIDDEN: not a treasury identity, or the identity that asked for the funding; nothing changed", body = ErrorBody),
        (status = 422, description = "IDEMPOTENCY_CONFLICT: already approved (details.approvedBy)", body = ErrorBody),
    ))]
fn approve_funding() {}

/// Advances an account's fence to a revocation floor (operator; docs/design.md#d-3).
#[utoipa::path(post, path = "/v1/accounts/{accountId}/fence", request_body = FenceRequest,
    params(("accountId" = String, Path), Write),
    security(("bearerAuth" = [])),
    responses((status = 200, body = FenceResponse), Invalid, Unauthorized, NotFound, Idempotent, NotLeader))]
fn advance_fence() {}

/// Lowers a fence poisoned by a forged token (docs/design.md#d-8) to the token of the operator's
/// own grant on `payout:{accountId}` (operator; needs fencing.proof-keys-file). Audited in
/// fence_recoveries.
#[utoipa::path(post, path = "/v1/accounts/{accountId}/fence/lower", request_body = FenceLowerRequest,
    params(("accountId" = String, Path),
           ("X-Fencing-Token" = String, Header, description = "the operator's grant on payout:{accountId}"),
           ("X-Fencing-Proof" = String, Header, description = "that grant's fencingProof"),
           Write),
    security(("bearerAuth" = [])),
    responses((status = 200, body = FenceLowered), InvalidToken, Unauthorized, NotFound, Idempotent, NotLeader,
        (status = 403, description = "FORBIDDEN (not an operator, or no proof keys)", body = ErrorBody),
        (status = 409, description = "FENCED_OUT: the token is below the highest token the account admitted with a proof (details.highestToken); nothing changed", body = ErrorBody),
    ))]
fn lower_fence() {}

/// Registers a payout.
#[utoipa::path(post, path = "/v1/payouts", request_body = CreatePayoutRequest,
    params(Write),
    security(("bearerAuth" = [])),
    responses((status = 201, body = Payout), Invalid, Unauthorized, Idempotent, NotLeader,
        (status = 404, description = "NOT_FOUND: account", body = ErrorBody),
        (status = 422, description = "IDEMPOTENCY_CONFLICT, or LIMIT_EXCEEDED: above the account's largest single payout (docs/contract.md#account-limits); nothing changed", body = ErrorBody),
    ))]
fn create_payout() {}

/// P1: lists payouts.
#[utoipa::path(get, path = "/v1/payouts",
    params(("state" = Option<PayoutState>, Query), ("accountId" = Option<String>, Query),
           ("limit" = Option<i64>, Query, description = "1 to 500, default 100"), ("cursor" = Option<String>, Query)),
    responses((status = 200, body = PayoutPage), Invalid, NotLeader))]
fn list_payouts() {}

/// P4: a payout (advisory).
#[utoipa::path(get, path = "/v1/payouts/{payoutId}", params(("payoutId" = String, Path)),
    responses((status = 200, body = Payout), Invalid, NotFound, NotLeader))]
fn get_payout() {}

/// P2: a fenced claim.
#[utoipa::path(post, path = "/v1/payouts/{payoutId}/claim", request_body = ClaimRequest,
    params(("payoutId" = String, Path), Fenced, Write),
    security(("bearerAuth" = [])),
    responses((status = 200, body = ClaimResponse), InvalidToken, Unauthorized, NotFound, Idempotent, NotLeader,
        (status = 409, description = "FENCED_OUT or PAYOUT_NOT_CLAIMABLE (also when the payout is out of attempts, payment.payout.max-attempts: it is then ABANDONED)", body = ErrorBody),
        (status = 422, description = "INSUFFICIENT_FUNDS, IDEMPOTENCY_CONFLICT, or LIMIT_EXCEEDED: above the account's largest single payout or its outflow for the UTC day (docs/contract.md#account-limits; nothing changed)", body = ErrorBody),
    ))]
fn claim() {}

/// P3: a fenced posting.
#[utoipa::path(post, path = "/v1/payouts/{payoutId}/post", request_body = PostRequest,
    params(("payoutId" = String, Path), Fenced, Write),
    security(("bearerAuth" = [])),
    responses((status = 200, body = PostResponse), InvalidToken, Unauthorized, NotFound, Idempotent, NotLeader,
        (status = 409, description = "FENCED_OUT or PAYOUT_NOT_CLAIMABLE", body = ErrorBody),
    ))]
fn post_payout() {}

/// Out-of-band resolution of a RAIL_AMBIGUOUS payout (operator).
///
/// It must agree with what the rail proxy recorded for the payout's attempt: POSTED names the
/// reference the rail acknowledged, FAILED is refused after an acknowledgement, POSTED after a
/// decline (400 VALIDATION_FAILED naming the field and both references; nothing changed).
#[utoipa::path(post, path = "/v1/payouts/{payoutId}/resolve", request_body = ResolveRequest,
    params(("payoutId" = String, Path), Write),
    security(("bearerAuth" = [])),
    responses((status = 200, body = ResolveResponse), Invalid, Unauthorized, NotFound, Idempotent, NotLeader,
        (status = 409, description = "PAYOUT_NOT_CLAIMABLE", body = ErrorBody),
    ))]
fn resolve() {}

/// Cancels a payout, PENDING | CLAIMED → ABANDONED (operator; a fenced write like a claim,
/// strict, the fence advances; docs/contract.md#cancel). Refused by paydb once an attempt
/// reached the rail proxy; recorded in payout_abandonments.
#[utoipa::path(post, path = "/v1/payouts/{payoutId}/cancel", request_body = CancelRequest,
    params(("payoutId" = String, Path), ("X-Fencing-Token" = String, Header, description = "a grant on payout:{accountId}, decimal int64 > 0"),
           ("X-Fencing-Proof" = Option<String>, Header, description = "the grant's fencingProof; required when fencing.proof-keys-file is set, else INVALID_TOKEN"),
           Write),
    security(("bearerAuth" = [])),
    responses((status = 200, body = Cancelled), InvalidToken, Unauthorized, NotFound, Idempotent, NotLeader,
        (status = 409, description = "FENCED_OUT or PAYOUT_NOT_CLAIMABLE", body = ErrorBody),
    ))]
fn cancel() {}

/// A batch of P2 claims (docs/contract.md#batches).
///
/// Each item is one payout's claim and is answered exactly as `POST /v1/payouts/{payoutId}/claim`
/// (P2) answers it: in the 200's `items`, in the request's order, the status and body P2 answers
/// for that item (its claim, or its error envelope). The items run concurrently, each through
/// P2's own checks, idempotency record and group commit; one item's refusal changes nothing for
/// its neighbours, and two items of one account are answered as two concurrent claims would be.
/// `X-Owner-Id` and the credential are the batch request's and apply to every item; the batch
/// needs P2's roles.
#[utoipa::path(post, path = "/v1/batches/claim", request_body = BatchRequest<ClaimItem>,
    responses((status = 200, description = "one answer per item, in the request's order: what P2 answers for it", body = BatchAnswer)))]
fn batch_claim() {}

/// A batch of P3 postings (docs/contract.md#batches).
///
/// Each item is one payout's posting and is answered exactly as `POST /v1/payouts/{payoutId}/post`
/// (P3) answers it: in the 200's `items`, in the request's order, the status and body P3 answers
/// for that item (its posting, or its error envelope). The items run concurrently, each through
/// P3's own checks, idempotency record and group commit; one item's refusal changes nothing for
/// its neighbours. `X-Owner-Id` and the credential are the batch request's and apply to every
/// item; the batch needs P3's roles.
#[utoipa::path(post, path = "/v1/batches/post", request_body = BatchRequest<PostItem>,
    responses((status = 200, description = "one answer per item, in the request's order: what P3 answers for it", body = BatchAnswer)))]
fn batch_post() {}

/// Process up.
#[utoipa::path(get, path = "/healthz", responses((status = 200, body = serde_json::Value)))]
fn healthz() {}

/// paydb takes writes.
#[utoipa::path(get, path = "/readyz", responses((status = 200, body = serde_json::Value), NotLeader))]
fn readyz() {}
