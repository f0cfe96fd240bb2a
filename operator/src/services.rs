//! The dlock services' calls the operator makes, behind a small trait so that controller tests use
//! a fake. The real implementation is the contract's clients ([`ContractServices`]): the same
//! headers (`X-Owner-Id`, `X-Idempotency-Key`, `traceparent`), credential and timeouts as
//! `dlock run` and `dlock revoke`, and the address map of `DLOCK_SERVICE_ADDRESSES`.
//!
//! Lock keys and account ids reach a URL only after the contract's alphabet check
//! (`[a-zA-Z0-9:._-]`, all valid path characters): [`dlock_contract::revoke::run`] checks revoke
//! orders, held keys come from the lock server, payout ids are UUIDs.

use std::time::Duration;

use dlock_contract::auth::Credential;
use dlock_contract::client::{ClientError, LockClient};
use dlock_contract::lock::HeldLocks;
use dlock_contract::payment::PayoutState;
use dlock_contract::payment_client::PaymentClient;
use dlock_contract::rail::RailClient;
use dlock_contract::revoke::{RevokeClients, RevokeSteps};
use dlock_executor::cancel::CancelReport;
use futures::future::BoxFuture;

use crate::validate::RevocationTarget;

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

impl ServiceError {
    /// A contract client's error, classified as [`dlock_contract::revoke::classify`] does.
    pub fn from_client(service: &'static str, error: &ClientError) -> Self {
        match (error, dlock_contract::revoke::classify(error)) {
            (ClientError::Api { status, body }, dlock_contract::revoke::Failure::Refused) => {
                ServiceError::Refused {
                    service,
                    status: *status,
                    body: format!("{}: {}", body.code, body.message),
                }
            }
            _ => ServiceError::Unavailable {
                service,
                message: error.to_string(),
            },
        }
    }
}

/// The most held locks one list asks for (the lock server's maximum).
pub const HELD_LIST_LIMIT: u32 = 1_000;

/// The answer of one services call, as [`dlock_contract::revoke::StepFuture`] is of one
/// revocation step.
pub type ServiceFuture<'a, T> = BoxFuture<'a, Result<T, ServiceError>>;

/// One target's revocation steps.
pub type Steps<'a> = Box<dyn RevokeSteps + 'a>;

pub trait Services: Send + Sync {
    /// The states of the given payouts in paydb (`GET /v1/payouts/{id}`), in order; `None` for
    /// one not registered yet.
    fn payout_states<'a>(
        &'a self,
        payment_resource_url: &'a str,
        payout_ids: &'a [String],
    ) -> ServiceFuture<'a, Vec<Option<PayoutState>>>;
    /// The held-locks list (`GET /v1/locks`, at most [`HELD_LIST_LIMIT`]). When it is
    /// `truncated` the lock server holds more than it listed: the mirror must not treat an
    /// unlisted key as released.
    fn held_locks<'a>(&'a self, lock_server_url: &'a str) -> ServiceFuture<'a, HeldLocks>;
    /// The fencing token of the grant that holds `key` now (L7), `None` when nothing holds it.
    fn lock_grant<'a>(
        &'a self,
        lock_server_url: &'a str,
        key: &'a str,
    ) -> ServiceFuture<'a, Option<i64>>;
    /// The revocation flow's three calls (L8, the account fence, the high-water mark) against
    /// one target's services: the contract's own clients ([`RevokeClients`]) for real.
    fn revoke_steps<'a>(&'a self, target: &'a RevocationTarget) -> Result<Steps<'a>, ServiceError>;
    /// Cancels the payouts (id, account) still PENDING or CLAIMED, under the operator's own
    /// grant per account: they become ABANDONED (a deleted PayoutBatch).
    fn cancel_unfinished<'a>(&'a self, cancel: Cancel<'a>) -> ServiceFuture<'a, CancelReport>;
    /// Registers a batch's payouts (`manifest_yaml`, as the executor Job reads it) with the
    /// operator's credential: the operator is the registrar, the Job only runs them
    /// (docs/contract.md#roles). Idempotent: a payout registered before answers 201 again. The
    /// controller tests' stand-ins register nothing.
    fn register_batch<'a>(
        &'a self,
        payment_resource_url: &'a str,
        manifest_yaml: &'a str,
    ) -> ServiceFuture<'a, ()> {
        let _ = (payment_resource_url, manifest_yaml);
        Box::pin(async { Ok(()) })
    }
}

/// A deleted batch's cancel: its services, its payouts (id, account) and why.
#[derive(Clone, Copy, Debug)]
pub struct Cancel<'a> {
    pub lock_server_url: &'a str,
    pub payment_resource_url: &'a str,
    pub payouts: &'a [(uuid::Uuid, String)],
    pub reason: &'a str,
}

/// The real calls: the contract's clients with the operator's owner id and credential.
pub struct ContractServices {
    http: reqwest::Client,
    owner_id: String,
    credential: Option<Credential>,
}

/// The rail proxy's read timeout the high-water client assumes (only submits use it).
const RAIL_READ_TIMEOUT: Duration = Duration::from_secs(8);

impl ContractServices {
    /// Fails on a malformed `DLOCK_SERVICE_ADDRESSES` or TLS set-up, so the operator refuses to
    /// start instead of failing every call.
    pub fn new(owner_id: &str, credential: Option<Credential>) -> anyhow::Result<Self> {
        // HTTPS to the services needs the process's TLS provider (ring, as kube uses).
        dlock_contract::tls::install_crypto_provider();
        dlock_contract::address_map::from_env()?;
        let header = http::HeaderValue::from_str(owner_id);
        if dlock_contract::headers::check_owner_id("ownerId", owner_id).is_err() || header.is_err()
        {
            anyhow::bail!(
                "the operator's owner id {owner_id:?} is not a valid X-Owner-Id (1-64 characters)"
            );
        }
        Ok(Self {
            http: dlock_contract::client::http_client()?,
            owner_id: owner_id.to_owned(),
            credential,
        })
    }

    fn lock(&self, url: &str) -> LockClient {
        LockClient::with_http(url, &self.owner_id, self.http.clone())
            .with_credential(self.credential.clone())
    }

    fn payment(&self, url: &str) -> PaymentClient {
        PaymentClient::with_http(url, &self.owner_id, self.http.clone())
            .with_credential(self.credential.clone())
    }

    fn rail(&self, url: &str) -> Result<RailClient, ClientError> {
        Ok(
            RailClient::with_http(url, &self.owner_id, RAIL_READ_TIMEOUT, self.http.clone())?
                .with_credential(self.credential.clone()),
        )
    }
}

impl Services for ContractServices {
    fn payout_states<'a>(
        &'a self,
        payment_resource_url: &'a str,
        payout_ids: &'a [String],
    ) -> ServiceFuture<'a, Vec<Option<PayoutState>>> {
        Box::pin(async move {
            let client = self.payment(payment_resource_url);
            let mut states = Vec::with_capacity(payout_ids.len());
            for id in payout_ids {
                // A payout id is a UUID (the executor's uuid5); anything else is not registered.
                let Ok(uuid) = serde_json::from_value(serde_json::Value::String(id.clone())) else {
                    states.push(None);
                    continue;
                };
                match client.get_payout(uuid).await {
                    Ok(payout) => states.push(Some(payout.state)),
                    Err(ClientError::Api { status: 404, .. }) => states.push(None),
                    Err(error) => {
                        return Err(ServiceError::from_client("payment-resource", &error));
                    }
                }
            }
            Ok(states)
        })
    }

    fn held_locks<'a>(&'a self, lock_server_url: &'a str) -> ServiceFuture<'a, HeldLocks> {
        Box::pin(async move {
            self.lock(lock_server_url)
                .held(Some(HELD_LIST_LIMIT))
                .await
                .map_err(|e| ServiceError::from_client("lock-server", &e))
        })
    }

    fn lock_grant<'a>(
        &'a self,
        lock_server_url: &'a str,
        key: &'a str,
    ) -> ServiceFuture<'a, Option<i64>> {
        Box::pin(async move {
            match self.lock(lock_server_url).get(key).await {
                Ok(info) => Ok(info.fencing_token.filter(|_| info.held)),
                // A key never locked here, or not granted for the retention: nothing holds it.
                Err(ClientError::Api { status: 404, .. }) => Ok(None),
                Err(error) => Err(ServiceError::from_client("lock-server", &error)),
            }
        })
    }

    fn revoke_steps<'a>(&'a self, target: &'a RevocationTarget) -> Result<Steps<'a>, ServiceError> {
        Ok(Box::new(RevokeClients {
            lock: self.lock(&target.lock_server_url),
            payment: self.payment(&target.payment_resource_url),
            // Fails only on a malformed address map, which `new` has refused already.
            rail: self
                .rail(&target.rail_proxy_url)
                .map_err(|e| ServiceError::from_client("rail-proxy", &e))?,
        }))
    }

    fn register_batch<'a>(
        &'a self,
        payment_resource_url: &'a str,
        manifest_yaml: &'a str,
    ) -> ServiceFuture<'a, ()> {
        Box::pin(async move {
            let batch = dlock_executor::manifest::parse(manifest_yaml).map_err(|e| {
                ServiceError::Refused {
                    service: "payment-resource",
                    status: 400,
                    body: format!("the batch's manifest does not parse: {e:#}"),
                }
            })?;
            dlock_executor::register(&batch, &self.payment(payment_resource_url))
                .await
                .map_err(|e| match e.downcast_ref::<ClientError>() {
                    Some(client) => ServiceError::from_client("payment-resource", client),
                    None => ServiceError::Unavailable {
                        service: "payment-resource",
                        message: format!("{e:#}"),
                    },
                })
        })
    }

    fn cancel_unfinished<'a>(&'a self, cancel: Cancel<'a>) -> ServiceFuture<'a, CancelReport> {
        Box::pin(async move {
            dlock_executor::cancel::cancel_unfinished(
                &self.lock(cancel.lock_server_url),
                &self.payment(cancel.payment_resource_url),
                cancel.payouts,
                &self.owner_id,
                cancel.reason,
            )
            .await
            .map_err(|e| ServiceError::from_client("lock-server or payment-resource", &e))
        })
    }
}

/// Which of a namespace's dlock Services serve TLS, read from their objects' `spec.tls` (never
/// from a status, which anyone who may write it could point elsewhere), and the Secret whose
/// `ca.crt` a Job's pod trusts for them (docs/kubernetes.md#tls-between-pods).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct NamespaceTls {
    pub namespace: String,
    /// The Service names that serve HTTPS: each LockServer, PaymentResource and RailProxy with
    /// `spec.tls`, and a RailProxy's stub (`<name>-stub`), which serves with the proxy's Secret.
    pub https: std::collections::BTreeSet<String>,
    /// The first TLS Secret of the namespace by name; the namespace's service certificates are
    /// signed by one CA, so its `ca.crt` is every caller's trust.
    pub ca_secret: Option<String>,
}

impl NamespaceTls {
    /// From the objects' specs: each `(name, tls Secret, has a stub)`.
    pub fn from_specs<'a>(
        namespace: &str,
        services: impl IntoIterator<Item = (String, Option<&'a str>, bool)>,
    ) -> Self {
        let mut tls = Self {
            namespace: namespace.to_owned(),
            ..Self::default()
        };
        let mut secrets = std::collections::BTreeSet::new();
        for (name, secret, stub) in services {
            let Some(secret) = secret else { continue };
            secrets.insert(secret.to_owned());
            if stub {
                tls.https.insert(format!("{name}-stub"));
            }
            tls.https.insert(name);
        }
        tls.ca_secret = secrets.into_iter().next();
        tls
    }

    /// The LockServers, PaymentResources and RailProxies of `namespace`, listed now: their
    /// names by kind (in that order, each sorted) and their TLS.
    pub async fn read(
        client: &kube::Client,
        namespace: &str,
    ) -> Result<([Vec<String>; 3], Self), kube::Error> {
        use crate::crd::{LockServer, PaymentResource, RailProxy};
        use kube::api::{Api, ApiResource, DynamicObject, ListParams};
        use kube::{Resource, ResourceExt};
        let kinds = [
            ApiResource::erase::<LockServer>(&()),
            ApiResource::erase::<PaymentResource>(&()),
            ApiResource::erase::<RailProxy>(&()),
        ];
        let mut names: [Vec<String>; 3] = Default::default();
        let mut services: Vec<(String, Option<String>, bool)> = Vec::new();
        for (i, kind) in kinds.iter().enumerate() {
            let api: Api<DynamicObject> = Api::namespaced_with(client.clone(), namespace, kind);
            for object in api.list(&ListParams::default()).await? {
                let spec = &object.data["spec"];
                let tls = spec["tls"]["secretName"].as_str().map(str::to_owned);
                let stub = kind.kind == RailProxy::kind(&()) && !spec["stub"].is_null();
                names[i].push(object.name_any());
                services.push((object.name_any(), tls, stub));
            }
            names[i].sort();
        }
        let tls = Self::from_specs(
            namespace,
            services
                .iter()
                .map(|(name, tls, stub)| (name.clone(), tls.as_deref(), *stub)),
        );
        Ok((names, tls))
    }

    /// `url`, a URL [`crate::workload::service_url`] built for a Service of this namespace, as
    /// `https://` when that Service serves TLS; any other URL (a real rail's) as it is.
    pub fn secure(&self, url: &str) -> String {
        let Some((name, rest)) = url
            .strip_prefix("http://")
            .and_then(|rest| rest.split_once('.'))
        else {
            return url.to_owned();
        };
        let expected = format!("{}.svc:{}", self.namespace, crate::workload::PORT);
        match crate::workload::ServiceName::new(name) {
            Ok(service) if rest == expected && self.https.contains(name) => {
                crate::workload::service_url_with(&service, &self.namespace, true)
            }
            _ => url.to_owned(),
        }
    }
}

impl NamespaceTls {
    /// A batch's three service URLs as `https://` where those Services serve TLS, and the CA
    /// its executor then trusts.
    pub fn secure_batch(&self, batch: &mut crate::validate::ValidatedBatch) {
        for url in [
            &mut batch.lock_server_url,
            &mut batch.payment_resource_url,
            &mut batch.rail_proxy_url,
        ] {
            *url = self.secure(url);
        }
        let https = [
            &batch.lock_server_url,
            &batch.payment_resource_url,
            &batch.rail_proxy_url,
        ]
        .iter()
        .any(|url| url.starts_with("https://"));
        batch.ca_secret = if https { self.ca_secret.clone() } else { None };
    }

    /// A reconciliation's stub URL as `https://` when the stub serves TLS, and the CA its pod
    /// then trusts.
    pub fn secure_reconciliation(
        &self,
        reconciliation: &mut crate::validate::ValidatedReconciliation,
    ) {
        reconciliation.rail_url = self.secure(&reconciliation.rail_url);
        reconciliation.ca_secret = if reconciliation.rail_url.starts_with("https://") {
            self.ca_secret.clone()
        } else {
            None
        };
    }

    /// A revocation's three service URLs as `https://` where those Services serve TLS.
    pub fn secure_revocation(&self, target: &mut crate::validate::RevocationTarget) {
        for url in [
            &mut target.lock_server_url,
            &mut target.payment_resource_url,
            &mut target.rail_proxy_url,
        ] {
            *url = self.secure(url);
        }
    }
}
