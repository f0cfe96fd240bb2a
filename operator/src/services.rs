//! The dlock services' HTTP calls the operator makes, behind a small trait so that controller
//! tests use a fake.

use std::time::Duration;

use futures::future::BoxFuture;
use serde::{Deserialize, Serialize};

use crate::build::lock::HeldLock;

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ServiceError {
    /// The service answered with an error the operator cannot fix by retrying (4xx).
    #[error("{service} refused: HTTP {status}: {body}")]
    Refused {
        service: &'static str,
        status: u16,
        body: String,
    },
    /// The service is unreachable or failed (5xx, timeout); retried with back-off.
    #[error("{service} unavailable: {message}")]
    Unavailable {
        service: &'static str,
        message: String,
    },
}

/// `POST /v1/locks/{key}/revoke` on the lock server (L8).
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct RevokeRequest {
    pub operator: String,
    pub reason: String,
}

#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Revocation {
    pub key: String,
    pub revoked_token: i64,
    pub revoked_owner_id: String,
    pub new_token_floor: i64,
    pub revocation_id: String,
}

/// The body of both fence advances (D-3): the payment resource's account fence and the rail
/// proxy's high-water mark.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct FenceRequest {
    pub floor: i64,
    pub operator: String,
    pub reason: String,
    pub revocation_id: String,
}

/// A payout's state in paydb (`GET /v1/payouts/{id}`); `None` when it is not registered yet.
pub type PayoutState = Option<String>;

pub trait Services: Send + Sync {
    /// The states of the given payouts, in order.
    fn payout_states<'a>(
        &'a self,
        payment_resource_url: &'a str,
        payout_ids: &'a [String],
    ) -> BoxFuture<'a, Result<Vec<PayoutState>, ServiceError>>;
    fn held_locks<'a>(
        &'a self,
        lock_server_url: &'a str,
    ) -> BoxFuture<'a, Result<Vec<HeldLock>, ServiceError>>;
    fn revoke_lock<'a>(
        &'a self,
        lock_server_url: &'a str,
        key: &'a str,
        request: &'a RevokeRequest,
    ) -> BoxFuture<'a, Result<Revocation, ServiceError>>;
    fn fence_account<'a>(
        &'a self,
        payment_resource_url: &'a str,
        account_id: &'a str,
        request: &'a FenceRequest,
    ) -> BoxFuture<'a, Result<(), ServiceError>>;
    fn raise_high_water<'a>(
        &'a self,
        rail_proxy_url: &'a str,
        account_id: &'a str,
        request: &'a FenceRequest,
    ) -> BoxFuture<'a, Result<(), ServiceError>>;
}

/// The real calls, with the operator token as `Authorization: Bearer …`.
pub struct HttpServices {
    http: reqwest::Client,
    operator_token: Option<String>,
}

/// Every call's budget: the operator never waits on a service longer than this.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

impl HttpServices {
    pub fn new(operator_token: Option<String>) -> anyhow::Result<Self> {
        // HTTPS to the services needs the process's TLS provider (ring, as kube uses).
        dlock_contract::tls::install_crypto_provider();
        let http = reqwest::Client::builder()
            .timeout(REQUEST_TIMEOUT)
            .build()?;
        Ok(Self {
            http,
            operator_token,
        })
    }

    fn request(&self, method: reqwest::Method, url: String) -> reqwest::RequestBuilder {
        let builder = self.http.request(method, url);
        match &self.operator_token {
            Some(token) => builder.bearer_auth(token),
            None => builder,
        }
    }

    async fn send<T: serde::de::DeserializeOwned>(
        service: &'static str,
        builder: reqwest::RequestBuilder,
    ) -> Result<T, ServiceError> {
        let unavailable = |e: reqwest::Error| ServiceError::Unavailable {
            service,
            message: e.to_string(),
        };
        let response = builder.send().await.map_err(unavailable)?;
        let status = response.status();
        if status.is_success() {
            return response.json::<T>().await.map_err(unavailable);
        }
        let body = response.text().await.unwrap_or_default();
        if status.is_client_error() {
            Err(ServiceError::Refused {
                service,
                status: status.as_u16(),
                body,
            })
        } else {
            Err(ServiceError::Unavailable {
                service,
                message: format!("HTTP {status}: {body}"),
            })
        }
    }
}

#[derive(Deserialize)]
struct HeldLocks {
    items: Vec<HeldLock>,
}

/// A path segment, percent-encoded (lock keys may hold `/` or `:`).
fn segment(value: &str) -> String {
    let mut out = String::new();
    for byte in value.bytes() {
        if byte.is_ascii_alphanumeric() || b"-._~".contains(&byte) {
            out.push(byte as char);
        } else {
            out.push_str(&format!("%{byte:02X}"));
        }
    }
    out
}

#[derive(Deserialize)]
struct PayoutView {
    state: String,
}

impl Services for HttpServices {
    fn payout_states<'a>(
        &'a self,
        payment_resource_url: &'a str,
        payout_ids: &'a [String],
    ) -> BoxFuture<'a, Result<Vec<PayoutState>, ServiceError>> {
        Box::pin(async move {
            let mut states = Vec::with_capacity(payout_ids.len());
            for id in payout_ids {
                let url = format!("{payment_resource_url}/v1/payouts/{}", segment(id));
                match Self::send::<PayoutView>(
                    "payment-resource",
                    self.request(reqwest::Method::GET, url),
                )
                .await
                {
                    Ok(view) => states.push(Some(view.state)),
                    Err(ServiceError::Refused { status: 404, .. }) => states.push(None),
                    Err(error) => return Err(error),
                }
            }
            Ok(states)
        })
    }

    fn held_locks<'a>(
        &'a self,
        lock_server_url: &'a str,
    ) -> BoxFuture<'a, Result<Vec<HeldLock>, ServiceError>> {
        Box::pin(async move {
            let url = format!("{lock_server_url}/v1/locks");
            let held: HeldLocks =
                Self::send("lock-server", self.request(reqwest::Method::GET, url)).await?;
            Ok(held.items)
        })
    }

    fn revoke_lock<'a>(
        &'a self,
        lock_server_url: &'a str,
        key: &'a str,
        request: &'a RevokeRequest,
    ) -> BoxFuture<'a, Result<Revocation, ServiceError>> {
        Box::pin(async move {
            let url = format!("{lock_server_url}/v1/locks/{}/revoke", segment(key));
            Self::send(
                "lock-server",
                self.request(reqwest::Method::POST, url).json(request),
            )
            .await
        })
    }

    fn fence_account<'a>(
        &'a self,
        payment_resource_url: &'a str,
        account_id: &'a str,
        request: &'a FenceRequest,
    ) -> BoxFuture<'a, Result<(), ServiceError>> {
        Box::pin(async move {
            let url = format!(
                "{payment_resource_url}/v1/accounts/{}/fence",
                segment(account_id)
            );
            Self::send::<serde_json::Value>(
                "payment-resource",
                self.request(reqwest::Method::POST, url).json(request),
            )
            .await
            .map(|_| ())
        })
    }

    fn raise_high_water<'a>(
        &'a self,
        rail_proxy_url: &'a str,
        account_id: &'a str,
        request: &'a FenceRequest,
    ) -> BoxFuture<'a, Result<(), ServiceError>> {
        Box::pin(async move {
            let url = format!(
                "{rail_proxy_url}/v1/rail/high-water/{}",
                segment(account_id)
            );
            Self::send::<serde_json::Value>(
                "rail-proxy",
                self.request(reqwest::Method::POST, url).json(request),
            )
            .await
            .map(|_| ())
        })
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn lock_keys_are_percent_encoded_as_one_path_segment() {
        assert_eq!(super::segment("payout:acct-17/x"), "payout%3Aacct-17%2Fx");
    }
}
