//! Validate: each raw custom resource becomes a validated value with resolved defaults, the only
//! input of the builders. An error here is permanent: the controller records it in a condition and
//! waits for the spec to change.

use dlock_contract::payout_batch;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::{Resource, ResourceExt};

use crate::build::deployment::{
    ETCD_AUTH_DIR, ETCD_TLS_CA_KEY, ETCD_TLS_CERT_KEY, ETCD_TLS_DIR, ETCD_TLS_KEY_KEY,
};
use crate::build::job::{
    ExecutorCredential, TOKEN_AUDIENCE, TokenSource, ValidatedBatch, executor_owner_id,
};
use crate::crd::{
    AuthMode, BackendType, CloudSql, LockRevocation, LockServer, PaymentResource, PayoutBatch,
    RailProxy, ServiceAuth,
};
use crate::workload::{
    CLOUD_SQL_PROXY_IMAGE, Component, FENCING_PROOF_KEYS_DIR, PORT, PodSettings, SERVICE_ACCOUNT,
    SecretEnv, TERMINATION_GRACE_ABOVE_READ_TIMEOUT_SECONDS, TERMINATION_GRACE_SECONDS_DEFAULT,
    ValidCloudSql, Workload, service_resources, service_url, small_resources, toml_string,
};

/// The rail proxy's read timeout when the spec names none (the service's own default).
pub const READ_TIMEOUT_MS_DEFAULT: i64 = 8_000;
pub const REPLICAS_DEFAULT: i32 = 2;

/// What the operator knows that the spec does not say.
#[derive(Clone, Debug, PartialEq)]
pub struct Settings {
    /// The `dlock` image every pod runs when the spec names none.
    pub image: String,
    /// The operator's own identity at the services (`system:serviceaccount:<ns>:<sa>`), written
    /// into their `auth.operator-identities` so its revocations are allowed.
    pub operator_identity: String,
    /// The operator's own namespace: the services' NetworkPolicies let its pods in.
    pub operator_namespace: String,
}

/// The identity a service account's projected token authenticates as under TokenReview.
pub fn service_account_identity(namespace: &str, service_account: &str) -> String {
    format!("system:serviceaccount:{namespace}:{service_account}")
}

/// The `auth.*` lines of a service's configuration: TokenReview with the audience `dlock` (the
/// executor's and the operator's projected tokens), and the operator as the only operator
/// identity.
///
/// `spec.auth.mode: none` writes `auth.mode = "none"` and nothing else.
pub fn auth_lines(settings: &Settings, auth: AuthMode) -> Vec<(&'static str, String)> {
    if auth == AuthMode::None {
        return vec![("auth.mode", toml_string("none"))];
    }
    let list = |items: &[&str]| {
        toml::Value::Array(
            items
                .iter()
                .map(|i| toml::Value::String((*i).to_owned()))
                .collect(),
        )
        .to_string()
    };
    vec![
        ("auth.mode", toml_string("tokenreview")),
        ("auth.tokenreview.audiences", list(&[TOKEN_AUDIENCE])),
        (
            "auth.operator-identities",
            list(&[settings.operator_identity.as_str()]),
        ),
    ]
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

fn auth_mode(spec: Option<&ServiceAuth>) -> AuthMode {
    spec.and_then(|a| a.mode).unwrap_or_default()
}

/// The pod's service account: the namespace's `dlock-service` when it calls TokenReview.
fn service_account(auth: AuthMode) -> Option<String> {
    (auth == AuthMode::TokenReview).then(|| SERVICE_ACCOUNT.to_owned())
}

/// Lines of a service's TOML configuration: key, TOML value.
type ConfigLines = Vec<(&'static str, String)>;

/// A Secret name, or a Secret key that is a plain file name (1 to 253 of `[-._a-zA-Z0-9]`).
fn valid_name(v: &str) -> bool {
    !v.is_empty()
        && v.len() <= 253
        && v != "."
        && v != ".."
        && v.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
}

/// A Secret key mounted as a file in a directory: its name must be a Secret name and its key a
/// file name that cannot leave the directory.
fn check_mounted_secret(secret: &crate::crd::SecretKeyRef, field: &str) -> Result<(), Invalid> {
    if !valid_name(&secret.name) {
        return Err(invalid(&format!("{field}.name"), "must be a Secret name"));
    }
    if !valid_name(&secret.key) {
        return Err(invalid(
            &format!("{field}.key"),
            "must be a Secret key (1 to 253 of [-._a-zA-Z0-9], not . or ..)",
        ));
    }
    Ok(())
}

/// The `lock.etcd.*` TLS and authentication lines for `spec.backend.etcd`, with the Secrets to
/// mount: the TLS Secret's `ca.crt`, `tls.crt` and `tls.key` (the `kubernetes.io/tls` layout)
/// and the user's password key. TLS and `https://` go together, as the lock server requires
/// (it would stop at start otherwise): refused here, before a pod crash-loops on it.
fn etcd_credentials(
    etcd: &crate::crd::EtcdBackend,
) -> Result<(ConfigLines, Option<String>, Option<String>), Invalid> {
    let mut lines = Vec::new();
    for (i, endpoint) in etcd.endpoints.iter().enumerate() {
        let field = format!("spec.backend.etcd.endpoints[{i}]");
        let https = endpoint.starts_with("https://");
        if etcd.tls_secret.is_some() && !https {
            return Err(invalid(
                &field,
                format!(
                    "{endpoint:?} must be https:// with spec.backend.etcd.tlsSecret (the lock \
                     server speaks TLS to every member or to none)"
                ),
            ));
        }
        if etcd.tls_secret.is_none() && https {
            return Err(invalid(
                &field,
                format!(
                    "{endpoint:?} is https://: set spec.backend.etcd.tlsSecret (a Secret with \
                     ca.crt, tls.crt and tls.key) or use http:// endpoints"
                ),
            ));
        }
    }
    if let Some(secret) = &etcd.tls_secret {
        if !valid_name(secret) {
            return Err(invalid(
                "spec.backend.etcd.tlsSecret",
                "must be a Secret name",
            ));
        }
        for (key, file) in [
            ("lock.etcd.ca-file", ETCD_TLS_CA_KEY),
            ("lock.etcd.cert-file", ETCD_TLS_CERT_KEY),
            ("lock.etcd.key-file", ETCD_TLS_KEY_KEY),
        ] {
            lines.push((key, toml_string(&format!("{ETCD_TLS_DIR}/{file}"))));
        }
    }
    let mut password_secret = None;
    if let Some(auth) = &etcd.auth {
        let username = auth.username.as_str();
        if username.is_empty()
            || username.len() > 128
            || username
                .chars()
                .any(|c| c.is_whitespace() || c.is_control())
        {
            return Err(invalid(
                "spec.backend.etcd.auth.username",
                "must be an etcd user name (1 to 128 characters, no spaces)",
            ));
        }
        check_mounted_secret(
            &auth.password_secret,
            "spec.backend.etcd.auth.passwordSecret",
        )?;
        lines.push(("lock.etcd.username", toml_string(username)));
        lines.push((
            "lock.etcd.password-file",
            toml_string(&format!("{ETCD_AUTH_DIR}/{}", auth.password_secret.key)),
        ));
        password_secret = Some(auth.password_secret.name.clone());
    }
    Ok((lines, etcd.tls_secret.clone(), password_secret))
}

/// `fencing.proof-keys-file` and the Secret to mount for `spec.fencingProofKeysSecret`.
fn fencing_proof_keys(
    spec: Option<&crate::crd::SecretKeyRef>,
) -> Result<(ConfigLines, Option<String>), Invalid> {
    let Some(secret) = spec else {
        return Ok((Vec::new(), None));
    };
    check_mounted_secret(secret, "spec.fencingProofKeysSecret")?;
    Ok((
        vec![(
            "fencing.proof-keys-file",
            toml_string(&format!("{FENCING_PROOF_KEYS_DIR}/{}", secret.key)),
        )],
        Some(secret.name.clone()),
    ))
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
    let mut etcd_password_secret = None;
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
            let (credential_lines, tls_secret, password_secret) = etcd_credentials(etcd)?;
            lines.extend(credential_lines);
            etcd_tls_secret = tls_secret;
            etcd_password_secret = password_secret;
        }
    }
    let auth = auth_mode(spec.auth.as_ref());
    lines.extend(auth_lines(settings, auth));
    let (proof_lines, fencing_proof_keys_secret) =
        fencing_proof_keys(spec.fencing_proof_keys_secret.as_ref())?;
    lines.extend(proof_lines);
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
        etcd_password_secret,
        service_account: service_account(auth),
        auth_disabled: auth == AuthMode::None,
        fencing_proof_keys_secret: fencing_proof_keys_secret.clone(),
        pod: PodSettings::from_spec(
            spec.resources.as_ref(),
            spec.image_pull_secrets.as_ref(),
            service_resources(),
        ),
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
    let auth = auth_mode(spec.auth.as_ref());
    let (proof_lines, fencing_proof_keys_secret) =
        fencing_proof_keys(spec.fencing_proof_keys_secret.as_ref())?;
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
        config_toml: config(
            &[
                vec![("server.listen", listen())],
                auth_lines(settings, auth),
                proof_lines,
            ]
            .concat(),
        ),
        secret_env,
        termination_grace_period_seconds: TERMINATION_GRACE_SECONDS_DEFAULT,
        cloud_sql: cloud_sql(spec.cloud_sql.as_ref()),
        data_volume: false,
        etcd_tls_secret: None,
        etcd_password_secret: None,
        service_account: service_account(auth),
        auth_disabled: auth == AuthMode::None,
        fencing_proof_keys_secret: fencing_proof_keys_secret.clone(),
        pod: PodSettings::from_spec(
            spec.resources.as_ref(),
            spec.image_pull_secrets.as_ref(),
            service_resources(),
        ),
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
    let auth = auth_mode(spec.auth.as_ref());
    let (proof_lines, fencing_proof_keys_secret) =
        fencing_proof_keys(spec.fencing_proof_keys_secret.as_ref())?;
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
        config_toml: config(
            &[
                vec![
                    ("server.listen", listen()),
                    ("rail.proxy.rail-url", toml_string(&rail_url)),
                    ("rail.proxy.read-timeout-ms", read_timeout_ms.to_string()),
                ],
                auth_lines(settings, auth),
                proof_lines,
            ]
            .concat(),
        ),
        secret_env,
        termination_grace_period_seconds: grace,
        cloud_sql: cloud_sql(spec.cloud_sql.as_ref()),
        data_volume: false,
        etcd_tls_secret: None,
        etcd_password_secret: None,
        service_account: service_account(auth),
        auth_disabled: auth == AuthMode::None,
        fencing_proof_keys_secret: fencing_proof_keys_secret.clone(),
        pod: PodSettings::from_spec(
            spec.resources.as_ref(),
            spec.image_pull_secrets.as_ref(),
            service_resources(),
        ),
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
        etcd_password_secret: None,
        service_account: None,
        auth_disabled: false,
        fencing_proof_keys_secret: None,
        pod: PodSettings::from_spec(
            stub.resources.as_ref(),
            spec.image_pull_secrets.as_ref(),
            small_resources(),
        ),
        owner,
    });
    Ok(ValidatedRail { proxy, stub })
}

/// The service account of executor pods when `spec.executor.serviceAccountName` is absent.
pub const EXECUTOR_SERVICE_ACCOUNT_DEFAULT: &str = "default";

/// The executor's identity, owner id and token source (`spec.executor`).
pub fn executor_credential(
    spec: Option<&crate::crd::ExecutorSpec>,
    namespace: &str,
    batch: &str,
) -> Result<ExecutorCredential, Invalid> {
    let default = crate::crd::ExecutorSpec::default();
    let spec = spec.unwrap_or(&default);
    let service_account_name = spec
        .service_account_name
        .clone()
        .unwrap_or_else(|| EXECUTOR_SERVICE_ACCOUNT_DEFAULT.to_owned());
    let service_account_identity = service_account_identity(namespace, &service_account_name);
    let given = spec
        .identity
        .as_deref()
        .map(str::trim)
        .filter(|i| !i.is_empty());
    let (identity, token) = match (&spec.credential_secret, given) {
        (Some(secret), Some(identity)) => {
            (identity.to_owned(), TokenSource::Secret(secret.clone()))
        }
        (Some(_), None) => {
            return Err(invalid(
                "spec.executor.identity",
                "credentialSecret needs the identity its token authenticates as",
            ));
        }
        (None, Some(identity)) if identity != service_account_identity => {
            return Err(invalid(
                "spec.executor.identity",
                format!(
                    "without credentialSecret the executor authenticates with its service \
                     account's token, as {service_account_identity}; name a credentialSecret \
                     for {identity:?}"
                ),
            ));
        }
        (None, _) => (
            service_account_identity,
            TokenSource::ProjectedServiceAccountToken {
                audience: TOKEN_AUDIENCE.to_owned(),
            },
        ),
    };
    let owner_id = executor_owner_id(&identity, batch).ok_or_else(|| {
        invalid(
            "spec.executor.identity",
            format!(
                "{identity:?} is longer than the 64 characters of an owner id; use a shorter \
                 service account name or a credentialSecret with a shorter identity"
            ),
        )
    })?;
    Ok(ExecutorCredential {
        identity,
        owner_id,
        service_account_name,
        token,
    })
}

/// The first of a batch's problems, with the others named in its message (a condition holds one
/// field; a person should still see every problem at once).
fn batch_invalid(problems: &[dlock_contract::payout_batch::Problem]) -> Option<Invalid> {
    const NAMED_MAX: usize = 5;
    let (first, others) = problems.split_first()?;
    let mut message = first.message.clone();
    if !others.is_empty() {
        let named: Vec<String> = others
            .iter()
            .take(NAMED_MAX)
            .map(|p| p.to_string())
            .collect();
        let rest = if others.len() > NAMED_MAX {
            "; …"
        } else {
            ""
        };
        message.push_str(&format!(
            " (and {} more: {}{rest})",
            others.len(),
            named.join("; ")
        ));
    }
    Some(invalid(&first.field, message))
}

/// The batch as the executor's manifest (DESIGN §11, the format `dlock run -f` reads), checked by
/// the contract's validator, the one `dlock run -f` applies.
pub fn payout_batch(object: &PayoutBatch, settings: &Settings) -> Result<ValidatedBatch, Invalid> {
    let spec = &object.spec;
    let name = object.name_any();
    let namespace = namespace_of(object)?;
    let workers = spec.workers.unwrap_or(payout_batch::WORKERS_DEFAULT as i32);
    let manifest = payout_batch::PayoutBatch::new(
        &name,
        Some(&namespace),
        // A negative count becomes 0, which the validator refuses as out of range.
        u32::try_from(workers).unwrap_or(0),
        spec.payouts.clone(),
    );
    if let Some(invalid) = batch_invalid(&manifest.validate()) {
        return Err(invalid);
    }
    let manifest_yaml = serde_yaml_ng::to_string(&manifest)
        .map_err(|e| invalid("spec", format!("cannot be written as a manifest: {e}")))?;
    let url = |spec: &Option<String>, default: &str| {
        service_url(spec.as_deref().unwrap_or(default), &namespace)
    };
    let credential = executor_credential(spec.executor.as_ref(), &namespace, &name)?;
    Ok(ValidatedBatch {
        credential,
        pod: PodSettings::from_spec(
            spec.resources.as_ref(),
            spec.image_pull_secrets.as_ref(),
            service_resources(),
        ),
        image: spec.image.clone().unwrap_or_else(|| settings.image.clone()),
        workers,
        manifest_yaml,
        lock_server_url: url(&spec.lock_server, "lock-server"),
        payment_resource_url: url(&spec.payment_resource, "payment-resource"),
        rail_proxy_url: url(&spec.rail_proxy, "rail-proxy"),
        rail_proxy_name: spec
            .rail_proxy
            .clone()
            .unwrap_or_else(|| "rail-proxy".to_owned()),
        rail_read_timeout_ms: READ_TIMEOUT_MS_DEFAULT,
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
    /// L8's CAS guard: revoke only the grant with this token.
    pub expected_token: Option<i64>,
    pub lock_server_url: String,
    pub payment_resource_url: String,
    pub rail_proxy_url: String,
}

/// The shortest revocation reason the lock server accepts (L8).
pub const REVOKE_REASON_LEN_MIN: usize = 8;

/// The LockServer, PaymentResource and RailProxy objects present in a namespace, by name.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct NamespaceTargets {
    pub lock_servers: Vec<String>,
    pub payment_resources: Vec<String>,
    pub rail_proxies: Vec<String>,
}

/// Which enforcement point (or lock server) of a namespace a revocation goes to.
///
/// The rule: a name given explicitly (a LockRevocation's `spec.paymentResource`, `spec.railProxy`,
/// `spec.lockServer`; a Lock's `spec.lockServer`) is used as given. Otherwise the namespace must
/// hold exactly one object of the kind, and that one is used: with none there is nothing to
/// fence, and with several the operator cannot know which holds the account, so the revocation is
/// refused before anything is sent (name the target in a LockRevocation). Fixed service names are
/// never assumed: a fence pushed to a service that does not exist leaves the real one open.
pub fn fence_target(
    kind: &str,
    field: &str,
    named: Option<&str>,
    present: &[String],
) -> Result<String, Invalid> {
    if let Some(name) = named.map(str::trim).filter(|n| !n.is_empty()) {
        return Ok(name.to_owned());
    }
    match present {
        [one] => Ok(one.clone()),
        [] => Err(invalid(
            field,
            format!("no {kind} in the namespace; there is nothing to send the revocation to"),
        )),
        several => Err(invalid(
            field,
            format!(
                "{} {kind}s in the namespace ({}); name one in a LockRevocation",
                several.len(),
                several.join(", ")
            ),
        )),
    }
}

/// What a revocation asks for, before its targets are resolved.
#[derive(Clone, Debug, PartialEq)]
pub struct RevocationAsk<'a> {
    pub key: &'a str,
    pub account_id: &'a str,
    pub operator: &'a str,
    pub reason: &'a str,
    pub expected_token: Option<i64>,
    /// Explicit names: lock server, payment resource, rail proxy.
    pub named: [Option<&'a str>; 3],
}

/// What a revocation must say, checked before any target is looked up.
pub fn check_ask(ask: &RevocationAsk<'_>) -> Result<(), Invalid> {
    let RevocationAsk {
        key,
        account_id,
        operator,
        reason,
        expected_token,
        named: _,
    } = *ask;
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
    if !dlock_contract::lock::key_is_valid(key) {
        return Err(invalid("key", "must be 1 to 128 of [a-zA-Z0-9:._-]"));
    }
    if !dlock_contract::payment::account_id_is_valid(account_id) {
        return Err(invalid(
            "accountId",
            dlock_contract::payment::ACCOUNT_ID_RULE,
        ));
    }
    if expected_token.is_some_and(|t| t <= 0) {
        return Err(invalid("expectedToken", "must be greater than 0"));
    }
    Ok(())
}

pub fn revocation_target(
    namespace: &str,
    ask: &RevocationAsk<'_>,
    present: &NamespaceTargets,
) -> Result<RevocationTarget, Invalid> {
    check_ask(ask)?;
    let RevocationAsk {
        key,
        account_id,
        operator,
        reason,
        expected_token,
        named: [lock_server, payment_resource, rail_proxy],
    } = *ask;
    let lock_server = fence_target(
        "LockServer",
        "lockServer",
        lock_server,
        &present.lock_servers,
    )?;
    let payment_resource = fence_target(
        "PaymentResource",
        "paymentResource",
        payment_resource,
        &present.payment_resources,
    )?;
    let rail_proxy = fence_target("RailProxy", "railProxy", rail_proxy, &present.rail_proxies)?;
    Ok(RevocationTarget {
        key: key.to_owned(),
        account_id: account_id.to_owned(),
        operator: operator.trim().to_owned(),
        reason: reason.trim().to_owned(),
        expected_token,
        lock_server_url: service_url(&lock_server, namespace),
        payment_resource_url: service_url(&payment_resource, namespace),
        rail_proxy_url: service_url(&rail_proxy, namespace),
    })
}

/// The ask of a LockRevocation.
pub fn lock_revocation_ask(object: &LockRevocation) -> RevocationAsk<'_> {
    let spec = &object.spec;
    RevocationAsk {
        key: &spec.key,
        account_id: &spec.account_id,
        operator: &spec.revoked_by,
        reason: &spec.reason,
        expected_token: spec.expected_token,
        named: [
            spec.lock_server.as_deref(),
            spec.payment_resource.as_deref(),
            spec.rail_proxy.as_deref(),
        ],
    }
}

pub fn lock_revocation(
    object: &LockRevocation,
    present: &NamespaceTargets,
) -> Result<RevocationTarget, Invalid> {
    revocation_target(
        &namespace_of(object)?,
        &lock_revocation_ask(object),
        present,
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
    pub pod: PodSettings,
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
        pod: PodSettings::from_spec(
            spec.resources.as_ref(),
            spec.image_pull_secrets.as_ref(),
            service_resources(),
        ),
        name: object.name_any(),
        image: spec.image.clone().unwrap_or_else(|| settings.image.clone()),
        schedule: spec.schedule.clone(),
        paydb: spec.database_url_secret.clone(),
        rail_url,
        owner: owner_of(object)?,
        namespace,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(list: &[&str]) -> Vec<String> {
        list.iter().map(|n| (*n).to_owned()).collect()
    }

    #[test]
    fn a_fence_target_is_the_named_one_or_the_namespaces_only_one() {
        let kind = "PaymentResource";
        assert_eq!(
            fence_target(kind, "f", Some("pay"), &names(&["a", "b"])),
            Ok("pay".to_owned())
        );
        assert_eq!(
            fence_target(kind, "f", None, &names(&["payments-eu"])),
            Ok("payments-eu".to_owned())
        );
        let Err(none) = fence_target(kind, "f", None, &[]) else {
            panic!("chosen from none");
        };
        assert!(none.message.contains("no PaymentResource"), "{none}");
        let Err(several) = fence_target(kind, "f", Some(" "), &names(&["a", "b"])) else {
            panic!("chosen from several");
        };
        assert!(
            several
                .message
                .contains("2 PaymentResources in the namespace (a, b)"),
            "{several}"
        );
    }

    #[test]
    fn a_revocation_target_uses_the_namespaces_objects_never_fixed_names() {
        let ask = RevocationAsk {
            key: "payout:acct-17",
            account_id: "acct-17",
            operator: " oncall ",
            reason: "worker wedged",
            expected_token: Some(41),
            named: [Some("locks"), None, None],
        };
        let present = NamespaceTargets {
            lock_servers: Vec::new(),
            payment_resources: names(&["payments"]),
            rail_proxies: names(&["rail"]),
        };
        let target = revocation_target("ns1", &ask, &present).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(target.lock_server_url, "http://locks.ns1.svc:8080");
        assert_eq!(target.payment_resource_url, "http://payments.ns1.svc:8080");
        assert_eq!(target.rail_proxy_url, "http://rail.ns1.svc:8080");
        assert_eq!(target.operator, "oncall");
        assert_eq!(target.expected_token, Some(41));
        let bad_key = RevocationAsk {
            key: "payout:a/b",
            account_id: "a/b",
            ..ask.clone()
        };
        assert!(check_ask(&bad_key).is_err());
    }
}
