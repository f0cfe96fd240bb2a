//! The long-running services: LockServer, PaymentResource and RailProxy (with its stub).

use kube::ResourceExt;

use super::{
    Invalid, READ_TIMEOUT_MS_DEFAULT, REPLICAS_DEFAULT, Settings, auth_lines, invalid,
    namespace_of, owner_of,
};
use crate::build::deployment::{
    ETCD_AUTH_DIR, ETCD_TLS_CA_KEY, ETCD_TLS_CERT_KEY, ETCD_TLS_DIR, ETCD_TLS_KEY_KEY,
};
use crate::crd::{
    AuthMode, BackendType, CloudSql, LockServer, PaymentResource, RailProxy, ServiceAuth,
};
use crate::workload::{
    CLOUD_SQL_PROXY_IMAGE, Component, FENCING_PROOF_KEYS_DIR, PORT, PodSettings, SERVICE_ACCOUNT,
    SecretEnv, TERMINATION_GRACE_ABOVE_READ_TIMEOUT_SECONDS, TERMINATION_GRACE_SECONDS_DEFAULT,
    ValidCloudSql, Workload, service_resources, service_url, small_resources, toml_string,
};

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
