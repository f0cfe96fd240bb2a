//! A typed async client for the payment resource, with the per-hop timeouts of
//! docs/contract.md#s3-8 (500 ms connect, 3 s read for writes, 1 s for advisory reads).
//!
//! Like [`crate::client::LockClient`] it makes exactly one attempt per call: a 409 means the
//! world moved on, and only the caller knows whether a retry is safe for it.

use std::time::Duration;

use reqwest::{Method, RequestBuilder};
use serde::Serialize;
use serde::de::DeserializeOwned;
use uuid::Uuid;

use crate::batch::Item as _;
use crate::client::{ClientError, Hop, expect_body, send, send_marked};
use crate::headers;
use crate::payment::*;

/// Read timeout for claim, post and the other writes.
pub const WRITE_TIMEOUT: Duration = Duration::from_secs(3);
/// Read timeout for advisory reads.
pub const READ_TIMEOUT: Duration = Duration::from_secs(1);

/// The headers that make a write idempotent and, for claim, post and cancel, fenced: the
/// grant's token and, when the service checks proofs, its proof.
#[derive(Debug, Clone, Copy)]
pub struct WriteHeaders<'a> {
    pub idempotency_key: &'a str,
    pub fencing_token: Option<i64>,
    pub fencing_proof: Option<&'a str>,
}

impl<'a> WriteHeaders<'a> {
    /// An idempotent write that no token fences.
    pub fn unfenced(idempotency_key: &'a str) -> Self {
        Self {
            idempotency_key,
            fencing_token: None,
            fencing_proof: None,
        }
    }

    /// An idempotent write fenced by `token` (with its `proof`, if any).
    pub fn fenced(idempotency_key: &'a str, token: i64, proof: Option<&'a str>) -> Self {
        Self {
            idempotency_key,
            fencing_token: Some(token),
            fencing_proof: proof,
        }
    }
}

/// What fences a claim, a post or a cancel: the write's idempotency key, the grant's token and,
/// when the service checks proofs, the grant's proof. Those writes take a `Fence`, not
/// [`WriteHeaders`], so a claim without a token does not compile.
#[derive(Debug, Clone, Copy)]
pub struct Fence<'a> {
    pub idempotency_key: &'a str,
    pub token: i64,
    pub proof: Option<&'a str>,
}

impl<'a> Fence<'a> {
    pub fn new(idempotency_key: &'a str, token: i64, proof: Option<&'a str>) -> Self {
        Self {
            idempotency_key,
            token,
            proof,
        }
    }
}

impl<'a> From<Fence<'a>> for WriteHeaders<'a> {
    fn from(fence: Fence<'a>) -> Self {
        WriteHeaders::fenced(fence.idempotency_key, fence.token, fence.proof)
    }
}

#[derive(Debug, Clone)]
pub struct PaymentClient {
    hop: Hop,
}

/// Adds `X-Fencing-Proof` when there is one.
pub(crate) fn with_proof(req: RequestBuilder, proof: Option<&str>) -> RequestBuilder {
    match proof {
        Some(proof) => req.header(headers::FENCING_PROOF, proof),
        None => req,
    }
}

crate::client::hop_client!(PaymentClient, plain);

/// The idempotent writes that no token fences, one row each: the method, the path's parameters,
/// its answer, its path and its body. Each method takes the path's parameters, then the
/// idempotency key, then the body, and POSTs the body once.
macro_rules! unfenced_writes {
    ($(
        $(#[$doc:meta])*
        fn $name:ident($($param:ident: $ty:ty),*) -> $answer:ty = $path:literal, $body:ty;
    )*) => {
        impl PaymentClient {
            $(
                $(#[$doc])*
                pub async fn $name(
                    &self,
                    $($param: $ty,)*
                    idempotency_key: &str,
                    body: &$body,
                ) -> Result<$answer, ClientError> {
                    let write = WriteHeaders::unfenced(idempotency_key);
                    self.write(&format!($path), write, body).await
                }
            )*
        }
    };
}

unfenced_writes! {
    fn create_account() -> Account = "/v1/accounts", CreateAccountRequest;
    /// A funding at or below the payment resource's `auth.treasury.dual-approval-above`; above
    /// it the answer is 202 with a pending funding: [`Self::request_funding`].
    fn fund(account_id: &str) -> FundResponse = "/v1/accounts/{account_id}/fund", FundRequest;
    /// A funding above `auth.treasury.dual-approval-above`: recorded, not applied
    /// (docs/contract.md#dual-approval).
    fn request_funding(account_id: &str) -> PendingFunding =
        "/v1/accounts/{account_id}/fund", FundRequest;
    /// A funding whichever the payment resource makes of it: applied, or pending a second
    /// treasury identity.
    fn fund_or_request(account_id: &str) -> Funded =
        "/v1/accounts/{account_id}/fund", FundRequest;
    /// Applies a pending funding: another treasury identity than the one that asked.
    fn approve_funding(funding_id: Uuid) -> ApprovedFunding =
        "/v1/fundings/{funding_id}/approve", ApproveFundingRequest;
    /// An account's limits, set by the treasury (docs/contract.md#account-limits).
    fn set_limits(account_id: &str) -> AccountLimits =
        "/v1/accounts/{account_id}/limits", AccountLimitsRequest;
    fn create_payout() -> Payout = "/v1/payouts", CreatePayoutRequest;
    /// docs/design.md#d-3: needs [`Self::as_operator`].
    fn advance_fence(account_id: &str) -> FenceResponse =
        "/v1/accounts/{account_id}/fence", FenceRequest;
    /// Out-of-band resolution of a RAIL_AMBIGUOUS payout: needs [`Self::as_operator`].
    fn resolve(payout_id: Uuid) -> ResolveResponse =
        "/v1/payouts/{payout_id}/resolve", ResolveRequest;
}

impl PaymentClient {
    /// POSTs `body` to `path` with the write's headers, once; the answer's body.
    async fn write<B: Serialize, R: DeserializeOwned>(
        &self,
        path: &str,
        write: impl Into<WriteHeaders<'_>>,
        body: &B,
    ) -> Result<R, ClientError> {
        self.write_marked(path, write, body).await.map(|(r, _)| r)
    }

    /// [`Self::write`], and whether the answer is a replay of a stored one.
    async fn write_marked<B: Serialize, R: DeserializeOwned>(
        &self,
        path: &str,
        write: impl Into<WriteHeaders<'_>>,
        body: &B,
    ) -> Result<(R, bool), ClientError> {
        let write = write.into();
        let (url, mut builder) = self.request(Method::POST, path, WRITE_TIMEOUT);
        builder = builder.header(headers::IDEMPOTENCY_KEY, write.idempotency_key);
        if let Some(token) = write.fencing_token {
            builder = builder.header(headers::FENCING_TOKEN, token.to_string());
        }
        let builder = with_proof(Hop::json(builder, body), write.fencing_proof);
        let (body, replayed) = send_marked(&url, builder).await?;
        Ok((expect_body(&url, body)?, replayed))
    }

    /// Registers a payout (docs/contract.md#create-payout) as [`Self::create_payout`] does, and
    /// says whether the answer is the replay of an earlier registration under the same key
    /// (`X-Idempotent-Replay`). A fresh answer is the payout as this call created it, PENDING; a
    /// replay is the payout as it was first registered, not as it is now.
    pub async fn register_payout(
        &self,
        idempotency_key: &str,
        body: &CreatePayoutRequest,
    ) -> Result<(Payout, bool), ClientError> {
        let write = WriteHeaders::unfenced(idempotency_key);
        self.write_marked("/v1/payouts", write, body).await
    }

    /// GETs `path`, advisory, once.
    async fn read<R: DeserializeOwned>(&self, path: &str) -> Result<R, ClientError> {
        let (url, req) = self.request(Method::GET, path, READ_TIMEOUT);
        expect_body(&url, send(&url, req).await?)
    }

    /// P1, advisory.
    pub async fn list_payouts(
        &self,
        state: Option<PayoutState>,
        account_id: Option<&str>,
        limit: Option<i64>,
        cursor: Option<&str>,
    ) -> Result<PayoutPage, ClientError> {
        let query = [
            ("state", state.map(|s| s.as_str().to_owned())),
            ("accountId", account_id.map(str::to_owned)),
            ("limit", limit.map(|n| n.to_string())),
            ("cursor", cursor.map(str::to_owned)),
        ];
        self.list("/v1/payouts", &query).await
    }

    /// The fundings that needed a second treasury identity (docs/contract.md#list-fundings):
    /// `state` absent lists the pending ones; needs a treasury credential.
    pub async fn list_fundings(
        &self,
        state: Option<FundingsFilter>,
        limit: Option<i64>,
    ) -> Result<FundingList, ClientError> {
        let query = [
            ("state", state.map(|s| s.as_str().to_owned())),
            ("limit", limit.map(|n| n.to_string())),
        ];
        self.list("/v1/fundings", &query).await
    }

    /// A list (P1, the fundings): `GET path` with the query parameters that are set.
    async fn list<T: DeserializeOwned>(
        &self,
        path: &str,
        query: &[(&str, Option<String>)],
    ) -> Result<T, ClientError> {
        let (url, mut req) = self.request(Method::GET, path, READ_TIMEOUT);
        let set: Vec<(&str, &String)> = query
            .iter()
            .filter_map(|(name, value)| value.as_ref().map(|v| (*name, v)))
            .collect();
        if !set.is_empty() {
            req = req.query(&set);
        }
        expect_body(&url, send(&url, req).await?)
    }

    /// P2, fenced by `fence`: the grant's token and, when the service checks proofs, its proof as
    /// `X-Fencing-Proof`.
    pub async fn claim(
        &self,
        payout_id: Uuid,
        fence: Fence<'_>,
        expected_state: PayoutState,
    ) -> Result<ClaimResponse, ClientError> {
        if let Some(batches) = self.hop.batches() {
            let item = crate::batch::ClaimItem {
                payout_id,
                fencing_token: fence.token,
                fencing_proof: fence.proof.map(str::to_owned),
                idempotency_key: fence.idempotency_key.to_owned(),
                expected_state,
                traceparent: Some(self.hop.traceparent()),
            };
            let answer = crate::batch::call(&batches.claim, &self.hop, WRITE_TIMEOUT, item).await;
            return expect_body(crate::batch::ClaimItem::PATH, answer?);
        }
        let body = ClaimRequest { expected_state };
        self.write(&format!("/v1/payouts/{payout_id}/claim"), fence, &body)
            .await
    }

    /// P3, fenced by `fence` as for [`Self::claim`].
    pub async fn post(
        &self,
        payout_id: Uuid,
        fence: Fence<'_>,
        rail_reference: &str,
        submission_id: Uuid,
    ) -> Result<PostResponse, ClientError> {
        if let Some(batches) = self.hop.batches() {
            let item = crate::batch::PostItem {
                payout_id,
                fencing_token: fence.token,
                fencing_proof: fence.proof.map(str::to_owned),
                idempotency_key: fence.idempotency_key.to_owned(),
                rail_reference: rail_reference.to_owned(),
                submission_id,
                rail_outcome: RailOutcome::Acked,
                traceparent: Some(self.hop.traceparent()),
            };
            let answer = crate::batch::call(&batches.post, &self.hop, WRITE_TIMEOUT, item).await;
            return expect_body(crate::batch::PostItem::PATH, answer?);
        }
        let body = PostRequest {
            rail_reference: rail_reference.to_owned(),
            submission_id,
            rail_outcome: RailOutcome::Acked,
        };
        self.write(&format!("/v1/payouts/{payout_id}/post"), fence, &body)
            .await
    }

    /// P4, advisory: never a basis for deciding that a submit is safe.
    pub async fn get_payout(&self, payout_id: Uuid) -> Result<Payout, ClientError> {
        self.read(&format!("/v1/payouts/{payout_id}")).await
    }

    /// P5, advisory.
    pub async fn get_account(&self, account_id: &str) -> Result<Account, ClientError> {
        self.read(&format!("/v1/accounts/{account_id}")).await
    }

    /// Cancels a payout that never reached the rail (PENDING or CLAIMED → ABANDONED): operator
    /// only, under the operator's own grant on `payout:{accountId}` and its proof.
    pub async fn cancel(
        &self,
        payout_id: Uuid,
        fence: Fence<'_>,
        body: &CancelRequest,
    ) -> Result<Cancelled, ClientError> {
        self.write(&format!("/v1/payouts/{payout_id}/cancel"), fence, body)
            .await
    }
}
