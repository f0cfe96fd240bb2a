//! Validate: each raw custom resource becomes a validated value with resolved defaults, the only
//! input of the builders. An error here is permanent: the controller records it in a condition and
//! waits for the spec to change.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::{Resource, ResourceExt};

use crate::build::job::ValidatedBatch;
use crate::crd::{
    BackendType, CloudSql, LockRevocation, LockServer, PaymentResource, PayoutBatch, RailProxy,
};
use crate::workload::{
    CLOUD_SQL_PROXY_IMAGE, Component, PORT, SecretEnv,
    TERMINATION_GRACE_ABOVE_READ_TIMEOUT_SECONDS, TERMINATION_GRACE_SECONDS_DEFAULT, ValidCloudSql,
    Workload, service_url, toml_string,
};

/// The rail proxy's read timeout when the spec names none (the service's own default).
pub const READ_TIMEOUT_MS_DEFAULT: i64 = 8_000;
pub const REPLICAS_DEFAULT: i32 = 2;
pub const WORKERS_DEFAULT: i32 = 4;

/// What the operator knows that the spec does not say.
#[derive(Clone, Debug, PartialEq)]
pub struct Settings {
    /// The `dlock` image every pod runs when the spec names none.
    pub image: String,
}

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{field}: {message}")]
pub struct Invalid {
    pub field: String,
    pub message: String,
}

fn invalid(field: &str, message: impl Into<String>) -> Invalid {
    Invalid {
        field: field.to_owned(),
        message: message.into(),
    }
}

fn namespace_of<K: Resource>(object: &K) -> Result<String, Invalid> {
    object
        .meta()
        .namespace
        .clone()
        .ok_or_else(|| invalid("metadata.namespace", "the object has no namespace"))
}

fn owner_of<K: Resource<DynamicType = ()>>(object: &K) -> Result<OwnerReference, Invalid> {
    object
        .controller_owner_ref(&())
        .ok_or_else(|| invalid("metadata", "the object has no name or uid yet"))
}

fn cloud_sql(spec: Option<&CloudSql>) -> Option<ValidCloudSql> {
    spec.map(|c| ValidCloudSql {
        instance_connection_name: c.instance_connection_name.clone(),
        image: c
            .image
            .clone()
            .unwrap_or_else(|| CLOUD_SQL_PROXY_IMAGE.to_owned()),
    })
}

fn replicas(spec: Option<i32>) -> Result<i32, Invalid> {
    let replicas = spec.unwrap_or(REPLICAS_DEFAULT);
    if !(1..=16).contains(&replicas) {
        return Err(invalid("spec.replicas", "must be 1 to 16"));
    }
    Ok(replicas)
}

fn config(lines: &[(&str, String)]) -> String {
    let mut text = String::new();
    for (key, value) in lines {
        text.push_str(&format!("{} = {value}\n", toml_string(key)));
    }
    text
}

fn listen() -> String {
    toml_string(&format!("0.0.0.0:{PORT}"))
}

pub fn lock_server(object: &LockServer, settings: &Settings) -> Result<Workload, Invalid> {
    let spec = &object.spec;
    let name = object.name_any();
    let mut lines = vec![("server.listen", listen())];
    let mut secret_env = Vec::new();
    let mut etcd_tls_secret = None;
    match spec.backend.type_ {
        BackendType::Pg => {
            let pg = spec.backend.pg.as_ref().ok_or_else(|| {
                invalid(
                    "spec.backend.pg",
                    "is required when spec.backend.type is pg",
                )
            })?;
            if spec.backend.etcd.is_some() {
                return Err(invalid(
                    "spec.backend.etcd",
                    "must be absent when type is pg",
                ));
            }
            lines.push(("lock.backend", toml_string("pg")));
            secret_env.push(SecretEnv {
                name: "DLOCK_LOCK_PG_URL".to_owned(),
                secret: pg.url_secret.clone(),
            });
        }
        BackendType::Etcd => {
            let etcd = spec.backend.etcd.as_ref().ok_or_else(|| {
                invalid(
                    "spec.backend.etcd",
                    "is required when spec.backend.type is etcd",
                )
            })?;
            if spec.backend.pg.is_some() {
                return Err(invalid(
                    "spec.backend.pg",
                    "must be absent when type is etcd",
                ));
            }
            if etcd.endpoints.is_empty() {
                return Err(invalid(
                    "spec.backend.etcd.endpoints",
                    "must name an endpoint",
                ));
            }
            lines.push(("lock.backend", toml_string("etcd")));
            let endpoints = toml::Value::Array(
                etcd.endpoints
                    .iter()
                    .map(|e| toml::Value::String(e.clone()))
                    .collect(),
            );
            lines.push(("lock.etcd.endpoints", endpoints.to_string()));
            etcd_tls_secret = etcd.tls_secret.clone();
        }
    }
    Ok(Workload {
        namespace: namespace_of(object)?,
        component: Component::LockServer,
        instance: name.clone(),
        image: spec.image.clone().unwrap_or_else(|| settings.image.clone()),
        replicas: replicas(spec.replicas)?,
        config_toml: config(&lines),
        secret_env,
        termination_grace_period_seconds: TERMINATION_GRACE_SECONDS_DEFAULT,
        cloud_sql: cloud_sql(spec.cloud_sql.as_ref()),
        data_volume: false,
        etcd_tls_secret,
        owner: owner_of(object)?,
        name,
    })
}

pub fn payment_resource(
    object: &PaymentResource,
    settings: &Settings,
) -> Result<Workload, Invalid> {
    let spec = &object.spec;
    let name = object.name_any();
    let mut secret_env = vec![SecretEnv {
        name: "DLOCK_PAYMENT_PG_URL".to_owned(),
        secret: spec.database_url_secret.clone(),
    }];
    if let Some(token) = &spec.operator_token_secret {
        secret_env.push(SecretEnv {
            name: "DLOCK_PAYMENT_OPERATOR_TOKEN".to_owned(),
            secret: token.clone(),
        });
    }
    Ok(Workload {
        namespace: namespace_of(object)?,
        component: Component::PaymentResource,
        instance: name.clone(),
        image: spec.image.clone().unwrap_or_else(|| settings.image.clone()),
        replicas: replicas(spec.replicas)?,
        config_toml: config(&[("server.listen", listen())]),
        secret_env,
        termination_grace_period_seconds: TERMINATION_GRACE_SECONDS_DEFAULT,
        cloud_sql: cloud_sql(spec.cloud_sql.as_ref()),
        data_volume: false,
        etcd_tls_secret: None,
        owner: owner_of(object)?,
        name,
    })
}

/// The rail proxy and, when `spec.stub` is set, the rail stub (`<name>-stub`).
#[derive(Clone, Debug, PartialEq)]
pub struct ValidatedRail {
    pub proxy: Workload,
    pub stub: Option<Workload>,
}

pub fn rail_proxy(object: &RailProxy, settings: &Settings) -> Result<ValidatedRail, Invalid> {
    let spec = &object.spec;
    let name = object.name_any();
    let namespace = namespace_of(object)?;
    let owner = owner_of(object)?;
    let image = spec.image.clone().unwrap_or_else(|| settings.image.clone());
    let stub_name = format!("{name}-stub");
    let rail_url = match (&spec.rail_url, &spec.stub) {
        (Some(url), None) => url.clone(),
        (None, Some(_)) => service_url(&stub_name, &namespace),
        _ => {
            return Err(invalid(
                "spec",
                "set exactly one of spec.railUrl and spec.stub",
            ));
        }
    };
    let read_timeout_ms = spec.read_timeout_ms.unwrap_or(READ_TIMEOUT_MS_DEFAULT);
    if !(100..=120_000).contains(&read_timeout_ms) {
        return Err(invalid("spec.readTimeoutMs", "must be 100 to 120000"));
    }
    let mut secret_env = vec![SecretEnv {
        name: "DLOCK_RAIL_PROXY_PG_URL".to_owned(),
        secret: spec.database_url_secret.clone(),
    }];
    if let Some(token) = &spec.operator_token_secret {
        secret_env.push(SecretEnv {
            name: "DLOCK_RAIL_PROXY_OPERATOR_TOKEN".to_owned(),
            secret: token.clone(),
        });
    }
    // A rollout must never cut a forward in flight: the pod gets the whole read timeout, rounded
    // up, plus room to answer and drain.
    let grace = (read_timeout_ms + 999) / 1000 + TERMINATION_GRACE_ABOVE_READ_TIMEOUT_SECONDS;
    let proxy = Workload {
        name: name.clone(),
        namespace: namespace.clone(),
        component: Component::RailProxy,
        instance: name.clone(),
        image: image.clone(),
        replicas: replicas(spec.replicas)?,
        config_toml: config(&[
            ("server.listen", listen()),
            ("rail.proxy.rail-url", toml_string(&rail_url)),
            ("rail.proxy.read-timeout-ms", read_timeout_ms.to_string()),
        ]),
        secret_env,
        termination_grace_period_seconds: grace,
        cloud_sql: cloud_sql(spec.cloud_sql.as_ref()),
        data_volume: false,
        etcd_tls_secret: None,
        owner: owner.clone(),
    };
    let stub = spec.stub.as_ref().map(|stub| Workload {
        name: stub_name,
        namespace,
        component: Component::RailStub,
        instance: name.clone(),
        image,
        // One stub: its statement is one file, like one rail's books.
        replicas: 1,
        config_toml: config(&[
            ("server.listen", listen()),
            (
                "rail.stub.latency-ms",
                stub.latency_ms.unwrap_or(0).to_string(),
            ),
            (
                "rail.stub.failure-rate",
                toml::Value::Float(stub.failure_rate.unwrap_or(0.0)).to_string(),
            ),
            (
                "rail.stub.duplicate-ack-rate",
                toml::Value::Float(stub.duplicate_ack_rate.unwrap_or(0.0)).to_string(),
            ),
            (
                "rail.stub.statement-path",
                toml_string("/data/rail-statement.jsonl"),
            ),
        ]),
        secret_env: Vec::new(),
        termination_grace_period_seconds: TERMINATION_GRACE_SECONDS_DEFAULT,
        cloud_sql: None,
        data_volume: true,
        etcd_tls_secret: None,
        owner,
    });
    Ok(ValidatedRail { proxy, stub })
}

/// The executor's manifest, in the DESIGN §11 format `dlock run -f` reads.
#[derive(serde::Serialize)]
#[serde(rename_all = "camelCase")]
struct Manifest<'a> {
    api_version: &'a str,
    kind: &'a str,
    metadata: ManifestMetadata<'a>,
    spec: ManifestSpec<'a>,
}

#[derive(serde::Serialize)]
struct ManifestMetadata<'a> {
    name: &'a str,
    namespace: &'a str,
}

#[derive(serde::Serialize)]
struct ManifestSpec<'a> {
    workers: i32,
    payouts: &'a [crate::crd::PayoutItem],
}

pub fn payout_batch(object: &PayoutBatch, settings: &Settings) -> Result<ValidatedBatch, Invalid> {
    let spec = &object.spec;
    let name = object.name_any();
    let namespace = namespace_of(object)?;
    let workers = spec.workers.unwrap_or(WORKERS_DEFAULT);
    if !(1..=256).contains(&workers) {
        return Err(invalid("spec.workers", "must be 1 to 256"));
    }
    if spec.payouts.is_empty() {
        return Err(invalid("spec.payouts", "must list at least one payout"));
    }
    let mut keys = std::collections::HashSet::new();
    for (index, item) in spec.payouts.iter().enumerate() {
        if !keys.insert(item.key.as_str()) {
            return Err(invalid(
                &format!("spec.payouts[{index}].key"),
                format!(
                    "{:?} appears twice; keys are unique within a batch",
                    item.key
                ),
            ));
        }
        if item.amount_minor <= 0 {
            return Err(invalid(
                &format!("spec.payouts[{index}].amountMinor"),
                "must be positive",
            ));
        }
    }
    let manifest = Manifest {
        api_version: "dlock.io/v1alpha1",
        kind: "PayoutBatch",
        metadata: ManifestMetadata {
            name: &name,
            namespace: &namespace,
        },
        spec: ManifestSpec {
            workers,
            payouts: &spec.payouts,
        },
    };
    let manifest_yaml = serde_yaml_ng::to_string(&manifest)
        .map_err(|e| invalid("spec", format!("cannot be written as a manifest: {e}")))?;
    let url = |spec: &Option<String>, default: &str| {
        service_url(spec.as_deref().unwrap_or(default), &namespace)
    };
    Ok(ValidatedBatch {
        image: spec.image.clone().unwrap_or_else(|| settings.image.clone()),
        workers,
        manifest_yaml,
        lock_server_url: url(&spec.lock_server, "lock-server"),
        payment_resource_url: url(&spec.payment_resource, "payment-resource"),
        rail_proxy_url: url(&spec.rail_proxy, "rail-proxy"),
        owner: owner_of(object)?,
        namespace: namespace.clone(),
        name,
    })
}

/// Where a revocation goes and what it says.
#[derive(Clone, Debug, PartialEq)]
pub struct RevocationTarget {
    pub key: String,
    pub account_id: String,
    pub operator: String,
    pub reason: String,
    pub lock_server_url: String,
    pub payment_resource_url: String,
    pub rail_proxy_url: String,
}

/// The shortest revocation reason the lock server accepts (L8).
pub const REVOKE_REASON_LEN_MIN: usize = 8;

pub fn revocation_target(
    namespace: &str,
    key: &str,
    account_id: &str,
    operator: &str,
    reason: &str,
    services: [Option<&str>; 3],
) -> Result<RevocationTarget, Invalid> {
    let operator = operator.trim();
    if operator.is_empty() || operator.chars().count() > 128 {
        return Err(invalid("revokedBy", "must be 1 to 128 characters"));
    }
    let reason_len = reason.trim().chars().count();
    if !(REVOKE_REASON_LEN_MIN..=1024).contains(&reason_len) {
        return Err(invalid(
            "reason",
            format!("must be {REVOKE_REASON_LEN_MIN} to 1024 characters, got {reason_len}"),
        ));
    }
    if account_id.is_empty() {
        return Err(invalid(
            "accountId",
            format!("{key:?} is not a payout lock key (payout:{{accountId}}); nothing to fence"),
        ));
    }
    let [lock_server, payment_resource, rail_proxy] = services;
    Ok(RevocationTarget {
        key: key.to_owned(),
        account_id: account_id.to_owned(),
        operator: operator.to_owned(),
        reason: reason.trim().to_owned(),
        lock_server_url: service_url(lock_server.unwrap_or("lock-server"), namespace),
        payment_resource_url: service_url(
            payment_resource.unwrap_or("payment-resource"),
            namespace,
        ),
        rail_proxy_url: service_url(rail_proxy.unwrap_or("rail-proxy"), namespace),
    })
}

pub fn lock_revocation(object: &LockRevocation) -> Result<RevocationTarget, Invalid> {
    let spec = &object.spec;
    revocation_target(
        &namespace_of(object)?,
        &spec.key,
        &spec.account_id,
        &spec.revoked_by,
        &spec.reason,
        [
            spec.lock_server.as_deref(),
            spec.payment_resource.as_deref(),
            spec.rail_proxy.as_deref(),
        ],
    )
}

/// A validated Reconciliation: what the reconciler Job runs against.
#[derive(Clone, Debug, PartialEq)]
pub struct ValidatedReconciliation {
    pub name: String,
    pub namespace: String,
    pub image: String,
    pub schedule: Option<String>,
    pub paydb: crate::crd::SecretKeyRef,
    pub rail_url: String,
    pub owner: OwnerReference,
}

pub fn reconciliation(
    object: &crate::crd::Reconciliation,
    settings: &Settings,
) -> Result<ValidatedReconciliation, Invalid> {
    let spec = &object.spec;
    let namespace = namespace_of(object)?;
    if let Some(schedule) = &spec.schedule
        && schedule.split_whitespace().count() != 5
    {
        return Err(invalid(
            "spec.schedule",
            "must be a five-field cron schedule (minute hour day month weekday)",
        ));
    }
    let rail_url = spec.rail_url.clone().unwrap_or_else(|| {
        service_url(
            &format!(
                "{}-stub",
                spec.rail_proxy.as_deref().unwrap_or("rail-proxy")
            ),
            &namespace,
        )
    });
    Ok(ValidatedReconciliation {
        name: object.name_any(),
        image: spec.image.clone().unwrap_or_else(|| settings.image.clone()),
        schedule: spec.schedule.clone(),
        paydb: spec.database_url_secret.clone(),
        rail_url,
        owner: owner_of(object)?,
        namespace,
    })
}
