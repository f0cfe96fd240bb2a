//! Bodies of the rail-proxy surface (docs/contract.md#s3-5), shared by the proxy and its client,
//! and a typed client for it. Submit is the one hop with a hard zero: the client never retries it.

use std::time::Duration;

use chrono::{DateTime, Utc};
use reqwest::Method;
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::batch::Item as _;
use crate::client::{ClientError, Hop, http_client, send};
use crate::headers;
use crate::payment::FenceRequest;

// `POST /v1/rail/submissions`: the registered payout's order, as the rail is to pay it.
crate::payment::payout_order!(SubmissionRequest);

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct SubmissionResponse {
    pub submission_id: Uuid,
    pub payout_id: Uuid,
    pub presented_token: i64,
    pub outcome: String,
    pub rail_reference: String,
    #[serde(with = "crate::time::millis")]
    pub submitted_at: DateTime<Utc>,
    #[serde(with = "crate::time::millis")]
    pub resolved_at: DateTime<Utc>,
}

#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct HighWaterRequest {
    pub floor: i64,
    pub operator: String,
    pub reason: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub revocation_id: Option<Uuid>,
}

/// The rail proxy's half of a revocation (docs/design.md#d-3): the floor, operator, reason and
/// revocation id the payment resource's account fence gets.
impl From<FenceRequest> for HighWaterRequest {
    fn from(fence: FenceRequest) -> Self {
        let FenceRequest {
            floor,
            operator,
            reason,
            revocation_id,
        } = fence;
        HighWaterRequest {
            floor,
            operator,
            reason,
            revocation_id: Some(revocation_id),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct HighWater {
    pub account_id: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub previous_token: Option<i64>,
    pub highest_token: i64,
}

/// One transfer on the rail's statement.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct Transfer {
    pub client_ref: String,
    pub rail_reference: String,
    pub amount_minor: i64,
    pub currency: String,
    #[serde(with = "crate::time::millis")]
    pub accepted_at: DateTime<Utc>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Statement {
    pub transfers: Vec<Transfer>,
}

/// Connect timeout towards the proxy (docs/contract.md#s3-8: 1 s).
pub const SUBMIT_CONNECT_TIMEOUT: Duration = Duration::from_secs(1);
/// The submit's read timeout is the rail read timeout plus this.
pub const SUBMIT_READ_MARGIN: Duration = Duration::from_secs(2);

#[derive(Debug, Clone)]
pub struct RailClient {
    hop: Hop,
    submit_timeout: Duration,
}

crate::client::hop_client!(RailClient);

impl RailClient {
    /// `rail_read_timeout` is the proxy's own timeout towards the rail; this client waits that
    /// plus a margin, so that the proxy observes the outcome before its caller gives up.
    pub fn new(
        base: &str,
        owner_id: &str,
        rail_read_timeout: Duration,
    ) -> Result<Self, ClientError> {
        Self::with_http(base, owner_id, rail_read_timeout, http_client()?)
    }

    /// As [`Self::new`] with a shared HTTP client. The base goes through
    /// `DLOCK_SERVICE_ADDRESSES` ([`crate::address_map`]); a malformed map is an error.
    pub fn with_http(
        base: &str,
        owner_id: &str,
        rail_read_timeout: Duration,
        http: reqwest::Client,
    ) -> Result<Self, ClientError> {
        // The rail hop refuses a malformed address map rather than keep the address.
        crate::address_map::rewrite(base.trim_end_matches('/'))
            .map_err(crate::client::address_map_error)?;
        Ok(Self {
            hop: Hop::with_http(base, owner_id, http),
            submit_timeout: rail_read_timeout + SUBMIT_READ_MARGIN,
        })
    }

    /// Submits once, without a proof (a proxy without `fencing.proof-keys-file`). Never call it
    /// again for the same payout after any answer, or none.
    pub async fn submit(
        &self,
        token: i64,
        idempotency_key: &str,
        body: &SubmissionRequest,
    ) -> Result<SubmissionResponse, ClientError> {
        self.submit_proven(token, None, idempotency_key, body).await
    }

    /// Submits once with the grant's proof as `X-Fencing-Proof`. Never call it again for the
    /// same payout after any answer, or none.
    pub async fn submit_proven(
        &self,
        token: i64,
        proof: Option<&str>,
        idempotency_key: &str,
        body: &SubmissionRequest,
    ) -> Result<SubmissionResponse, ClientError> {
        if let Some(batches) = self.hop.batches() {
            let item = crate::batch::SubmitItem {
                fencing_token: token,
                fencing_proof: proof.map(str::to_owned),
                idempotency_key: idempotency_key.to_owned(),
                submission: body.clone(),
                traceparent: Some(self.hop.traceparent()),
            };
            let answer =
                crate::batch::call(&batches.submit, &self.hop, self.submit_timeout, item).await;
            return answer?.ok_or_else(|| ClientError::Protocol {
                url: crate::batch::SubmitItem::PATH.into(),
                message: "204 where a submission was expected".into(),
            });
        }
        let (url, req) = self.request(Method::POST, "/v1/rail/submissions", self.submit_timeout);
        let req = req
            .header(headers::FENCING_TOKEN, token.to_string())
            .header(headers::IDEMPOTENCY_KEY, idempotency_key)
            .json(body);
        let req = crate::payment_client::with_proof(req, proof);
        send(&url, req).await?.ok_or_else(|| ClientError::Protocol {
            url,
            message: "204 where a submission was expected".into(),
        })
    }

    /// docs/design.md#d-3: raises the account's high-water mark to a revocation floor (operator
    /// only).
    pub async fn advance_high_water(
        &self,
        account_id: &str,
        body: &HighWaterRequest,
    ) -> Result<HighWater, ClientError> {
        let path = format!("/v1/rail/high-water/{account_id}");
        let (url, req) = self.request(Method::POST, &path, crate::client::WRITE_TIMEOUT);
        send(&url, req.json(body))
            .await?
            .ok_or_else(|| ClientError::Protocol {
                url,
                message: "204 where a high-water mark was expected".into(),
            })
    }
}

/// Reads a rail's statement (the stub's `GET /statement`), optionally for one clientRef.
pub async fn read_statement(
    rail_url: &str,
    client_ref: Option<&str>,
) -> Result<Statement, ClientError> {
    let base = crate::address_map::rewrite(rail_url.trim_end_matches('/'))
        .map_err(crate::client::address_map_error)?;
    let http = http_client()?;
    let url = format!("{base}/statement");
    let mut req = http.get(&url).timeout(Duration::from_secs(30));
    if let Some(r) = client_ref {
        req = req.query(&[("clientRef", r)]);
    }
    send(&url, req).await?.ok_or_else(|| ClientError::Protocol {
        url,
        message: "204 where a statement was expected".into(),
    })
}
