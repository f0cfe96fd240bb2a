//! The long-running services: LockServer, PaymentResource and RailProxy (with its stub).

use dlock_contract::service_config as config;
use kube::{Resource, ResourceExt};

use super::{
    Invalid, READ_TIMEOUT_MS_DEFAULT, REPLICAS_DEFAULT, Settings, auth_config, invalid,
    namespace_of, owner_of,
};
use crate::build::deployment::{ETCD_AUTH_DIR, ETCD_TLS_DIR};
use crate::build::proof_keys;
use crate::crd::{
    AuthMode, BackendType, CloudSql, LockServer, PaymentResource, RailProxy, ServiceAuth,
    ServiceSettings,
};
use crate::workload::{
    CA_FILE, CLOUD_SQL_PROXY_IMAGE, Component, FENCING_PROOF_KEYS_DIR, PORT, PodSettings,
    RAIL_TOKEN_DIR, SERVICE_ACCOUNT, SecretFile, TERMINATION_GRACE_ABOVE_READ_TIMEOUT_SECONDS,
    TERMINATION_GRACE_SECONDS_DEFAULT, TLS_DIR, ValidCloudSql, Workload, service_resources,
    service_url_with, small_resources, toml_string,
};

/// The Cloud SQL Auth Proxy sidecar: its default image, or one the platform allows (it runs in
/// the service's pod, beside the database password).
fn cloud_sql(
    spec: Option<&CloudSql>,
    settings: &Settings,
) -> Result<Option<ValidCloudSql>, Invalid> {
    spec.map(|c| {
        let image = match &c.image {
            None => CLOUD_SQL_PROXY_IMAGE.to_owned(),
            Some(image) if image == CLOUD_SQL_PROXY_IMAGE => image.clone(),
            Some(image) => settings.image_for("spec.cloudSql.image", Some(image))?,
        };
        Ok(ValidCloudSql {
            instance_connection_name: c.instance_connection_name.clone(),
            image,
        })
    })
    .transpose()
}

fn auth_mode(spec: Option<&ServiceAuth>) -> AuthMode {
    spec.and_then(|a| a.mode).unwrap_or_default()
}

/// The pod's service account: the namespace's `dlock-service` when it calls TokenReview.
fn service_account(auth: AuthMode) -> Option<String> {
    (auth == AuthMode::TokenReview).then(|| SERVICE_ACCOUNT.to_owned())
}

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

/// The `lock.etcd.*` TLS and authentication settings for `spec.backend.etcd`, with the Secrets
/// to mount: the TLS Secret's `ca.crt`, `tls.crt` and `tls.key` (the `kubernetes.io/tls` layout)
/// and the user's password key. TLS and `https://` go together, as the lock server requires
/// (it would stop at start otherwise): refused here, before a pod crash-loops on it.
fn etcd_credentials(etcd: &crate::crd::EtcdBackend) -> Result<EtcdCredentials, Invalid> {
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
    let mut tls = None;
    if let Some(secret) = &etcd.tls_secret {
        if !valid_name(secret) {
            return Err(invalid(
                "spec.backend.etcd.tlsSecret",
                "must be a Secret name",
            ));
        }
        // The Secret's keys (the `kubernetes.io/tls` layout, with cert-manager's `ca.crt`) are
        // files in its mount.
        let file = |key: &str| format!("{ETCD_TLS_DIR}/{key}");
        tls = Some(config::EtcdTls {
            ca_file: file("ca.crt"),
            cert_file: file("tls.crt"),
            key_file: file("tls.key"),
        });
    }
    let mut auth = None;
    if let Some(etcd_auth) = &etcd.auth {
        let username = etcd_auth.username.as_str();
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
            &etcd_auth.password_secret,
            "spec.backend.etcd.auth.passwordSecret",
        )?;
        auth = Some(config::EtcdAuth {
            username: username.to_owned(),
            password_file: format!("{ETCD_AUTH_DIR}/{}", etcd_auth.password_secret.key),
        });
    }
    Ok(EtcdCredentials {
        password_secret: etcd
            .auth
            .as_ref()
            .map(|auth| auth.password_secret.name.clone()),
        tls_secret: etcd.tls_secret.clone(),
        tls,
        auth,
    })
}

/// What `spec.backend.etcd` adds to the lock server's configuration and pod.
struct EtcdCredentials {
    tls: Option<config::EtcdTls>,
    auth: Option<config::EtcdAuth>,
    /// The Secrets to mount.
    tls_secret: Option<String>,
    password_secret: Option<String>,
}

/// `fencing.proof-keys-file` and the Secret to mount: `spec.fencingProofKeysSecret`, else the
/// namespace's own [`proof_keys::SECRET`], which the controller makes when it is missing. Never
/// none: a service without proof keys accepts forged fencing tokens (and refuses to start).
fn fencing_proof_keys(
    spec: Option<&crate::crd::SecretKeyRef>,
) -> Result<(config::Fencing, Option<String>), Invalid> {
    let Some(secret) = spec else {
        return Ok((
            config::Fencing {
                proof_keys_file: Some(format!("{FENCING_PROOF_KEYS_DIR}/{}", proof_keys::KEY)),
            },
            Some(proof_keys::SECRET.to_owned()),
        ));
    };
    check_mounted_secret(secret, "spec.fencingProofKeysSecret")?;
    Ok((
        config::Fencing {
            proof_keys_file: Some(format!("{FENCING_PROOF_KEYS_DIR}/{}", secret.key)),
        },
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

/// A service's configuration as the TOML of its ConfigMap.
fn render<T: serde::Serialize>(service_config: &T) -> Result<String, Invalid> {
    config::to_toml(service_config).map_err(|e| {
        invalid(
            "spec",
            format!("cannot be written as the service's configuration: {e}"),
        )
    })
}

fn server() -> config::Server {
    config::Server {
        listen: format!("0.0.0.0:{PORT}"),
    }
}

/// `spec.tls.secretName`, checked: the Secret's name is a DNS label (it names a volume too).
fn tls_secret(spec: &ServiceSettings) -> Result<Option<String>, Invalid> {
    let Some(tls) = &spec.tls else {
        return Ok(None);
    };
    if !crate::workload::is_dns_label(&tls.secret_name) {
        return Err(invalid(
            "spec.tls.secretName",
            format!(
                "{:?} is not a Secret name of one DNS label (1 to 63 of lower-case letters, \
                 digits and '-', starting and ending with a letter or digit): name the \
                 kubernetes.io/tls Secret (tls.crt, tls.key, ca.crt) that cert-manager writes",
                tls.secret_name
            ),
        ));
    }
    Ok(Some(tls.secret_name.clone()))
}

/// `server.tls.cert-file` and `key-file` lines for a workload with a TLS Secret (mounted at
/// [`TLS_DIR`]); nothing for plain HTTP.
fn tls_config_lines(workload: &Workload) -> String {
    if workload.tls_secret.is_none() {
        return String::new();
    }
    format!(
        "\"server.tls.cert-file\" = {}\n\"server.tls.key-file\" = {}\n",
        toml_string(&format!("{TLS_DIR}/tls.crt")),
        toml_string(&format!("{TLS_DIR}/tls.key")),
    )
}

/// A service's workload as [`ServiceSettings`] and the object make it, with its `auth.*` and
/// `fencing.*` configuration; the caller adds its own configuration, Secrets and volumes.
fn service<K: Resource<DynamicType = ()>>(
    object: &K,
    component: Component,
    spec: &ServiceSettings,
    settings: &Settings,
) -> Result<(Workload, config::Auth, config::Fencing), Invalid> {
    let name = object.name_any();
    // The name becomes the Service's, and the URL the operator sends its credential to.
    super::service_name("metadata.name", &name)?;
    let auth = auth_mode(spec.auth.as_ref());
    let namespace = namespace_of(object)?;
    let treasury = treasury_identities(spec.auth.as_ref(), &namespace)?;
    let (fencing, fencing_proof_keys_secret) =
        fencing_proof_keys(spec.fencing_proof_keys_secret.as_ref())?;
    let tls_secret = tls_secret(spec)?;
    let workload = Workload {
        namespace,
        component,
        instance: name.clone(),
        image: settings.image_for("spec.image", spec.image.as_ref())?,
        replicas: replicas(spec.replicas)?,
        config_toml: String::new(),
        secret_files: Vec::new(),
        termination_grace_period_seconds: TERMINATION_GRACE_SECONDS_DEFAULT,
        cloud_sql: cloud_sql(spec.cloud_sql.as_ref(), settings)?,
        data_volume: false,
        etcd_tls_secret: None,
        etcd_password_secret: None,
        service_account: service_account(auth),
        auth_disabled: auth == AuthMode::None,
        tls_secret,
        rail_token: false,
        fencing_proof_keys_secret,
        pod: PodSettings::from_options(&spec.pod, service_resources()),
        owner: owner_of(object)?,
        name,
    };
    let auth = auth_config(settings, auth, treasury, &workload.namespace);
    Ok((workload, auth, fencing))
}

/// `spec.auth.treasuryServiceAccounts` as the identities TokenReview gives their tokens.
fn treasury_identities(
    spec: Option<&ServiceAuth>,
    namespace: &str,
) -> Result<Vec<String>, Invalid> {
    let accounts = spec
        .and_then(|a| a.treasury_service_accounts.as_deref())
        .unwrap_or_default();
    accounts
        .iter()
        .enumerate()
        .map(|(i, account)| {
            super::service_name(&format!("spec.auth.treasuryServiceAccounts[{i}]"), account)?;
            Ok(super::service_account_identity(namespace, account))
        })
        .collect()
}

/// The Secret file of a service's database URL, as its configuration key `key`.
fn database_url_file(key: &str, secret: &crate::crd::SecretKeyRef) -> SecretFile {
    SecretFile {
        key: key.to_owned(),
        volume: "database-url".to_owned(),
        secret: secret.clone(),
    }
}

/// The Secret files of a service on paydb (the payment resource, the rail proxy): its database
/// URL and, when the spec names one, the operator's token, as their configuration keys `keys`.
fn paydb_secret_files(
    [pg_url_key, token_key]: [&str; 2],
    database_url: &crate::crd::SecretKeyRef,
    operator_token: Option<&crate::crd::SecretKeyRef>,
) -> Vec<SecretFile> {
    let token = operator_token.map(|token| SecretFile {
        key: token_key.to_owned(),
        volume: "operator-token".to_owned(),
        secret: token.clone(),
    });
    std::iter::once(database_url_file(pg_url_key, database_url))
        .chain(token)
        .collect()
}

/// The section `spec.backend.type` names (`section`), which must be set while the other is not.
fn backend_section<'a, T>(
    backend: &crate::crd::LockBackend,
    section: Option<&'a T>,
) -> Result<&'a T, Invalid> {
    let (type_, other, other_set) = match backend.type_ {
        BackendType::Pg => ("pg", "etcd", backend.etcd.is_some()),
        BackendType::Etcd => ("etcd", "pg", backend.pg.is_some()),
    };
    let section = section.ok_or_else(|| {
        invalid(
            &format!("spec.backend.{type_}"),
            format!("is required when spec.backend.type is {type_}"),
        )
    })?;
    if other_set {
        return Err(invalid(
            &format!("spec.backend.{other}"),
            format!("must be absent when type is {type_}"),
        ));
    }
    Ok(section)
}

pub fn lock_server(object: &LockServer, settings: &Settings) -> Result<Workload, Invalid> {
    let spec = &object.spec;
    let mut secret_files = Vec::new();
    let mut etcd_endpoints = Vec::new();
    let mut etcd = None;
    let backend = match spec.backend.type_ {
        BackendType::Pg => {
            let pg = backend_section(&spec.backend, spec.backend.pg.as_ref())?;
            secret_files = vec![database_url_file("lock.pg.url", &pg.url_secret)];
            config::LockBackend::Pg
        }
        BackendType::Etcd => {
            let backend = backend_section(&spec.backend, spec.backend.etcd.as_ref())?;
            if backend.endpoints.is_empty() {
                return Err(invalid(
                    "spec.backend.etcd.endpoints",
                    "must name an endpoint",
                ));
            }
            etcd_endpoints = backend.endpoints.clone();
            etcd = Some(etcd_credentials(backend)?);
            config::LockBackend::Etcd
        }
    };
    let (workload, auth, fencing) =
        service(object, Component::LockServer, &spec.service, settings)?;
    let (etcd_tls, etcd_auth, etcd_tls_secret, etcd_password_secret) = match etcd {
        Some(e) => (e.tls, e.auth, e.tls_secret, e.password_secret),
        None => (None, None, None, None),
    };
    let config_toml = render(&config::LockServer {
        server: server(),
        backend,
        pg_url: None,
        etcd_endpoints,
        etcd_tls,
        etcd_auth,
        auth,
        fencing,
    })? + &SecretFile::config_lines(&secret_files)
        + &tls_config_lines(&workload);
    Ok(Workload {
        config_toml,
        secret_files,
        etcd_tls_secret,
        etcd_password_secret,
        ..workload
    })
}

pub fn payment_resource(
    object: &PaymentResource,
    settings: &Settings,
) -> Result<Workload, Invalid> {
    let spec = &object.spec;
    let (workload, auth, fencing) =
        service(object, Component::PaymentResource, &spec.service, settings)?;
    let secret_files = paydb_secret_files(
        ["payment.pg.url", "payment.operator.token"],
        &spec.database_url_secret,
        spec.operator_token_secret.as_ref(),
    );
    Ok(Workload {
        config_toml: render(&config::PaymentResource {
            server: server(),
            pg_url: None,
            auth,
            dual_approval_above: dual_approval_above(spec.treasury.as_ref())?,
            fencing,
        })? + &SecretFile::config_lines(&secret_files)
            + &tls_config_lines(&workload),
        secret_files,
        ..workload
    })
}

/// `spec.treasury.dualApprovalAbove` as `auth.treasury.dual-approval-above`: a positive amount
/// in minor units, at most the contract's largest amount (the CRD's schema says the same).
fn dual_approval_above(
    treasury: Option<&crate::crd::TreasurySpec>,
) -> Result<Option<i64>, Invalid> {
    let Some(above) = treasury.and_then(|t| t.dual_approval_above) else {
        return Ok(None);
    };
    let max = dlock_contract::payment::AMOUNT_MINOR_MAX;
    if !(1..=max).contains(&above) {
        return Err(invalid(
            "spec.treasury.dualApprovalAbove",
            format!(
                "must be a whole number of minor units from 1 to {max} (a funding above it waits \
                 for a second treasury identity); remove it to apply every funding at once"
            ),
        ));
    }
    Ok(Some(above))
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
    let stub_name = format!("{name}-stub");
    // The stub serves with the proxy's TLS Secret (its certificate names both Services).
    let tls = tls_secret(&spec.service)?.is_some();
    let rail_url = match (&spec.rail_url, &spec.stub) {
        (Some(url), None) => url.clone(),
        (None, Some(_)) => service_url_with(
            &super::service_name("metadata.name", &stub_name)?,
            &namespace,
            tls,
        ),
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
    let (workload, auth, fencing) = service(object, Component::RailProxy, &spec.service, settings)?;
    let secret_files = paydb_secret_files(
        ["rail.proxy.pg.url", "rail.proxy.operator-token"],
        &spec.database_url_secret,
        spec.operator_token_secret.as_ref(),
    );
    let stubbed = spec.stub.is_some();
    // Towards the operator's stub the proxy presents a projected token of its ServiceAccount
    // (the namespace's `dlock-service`, audience `dlock`), and trusts the CA of its own TLS
    // Secret, which also signed the stub's certificate.
    let rail_credential_file = stubbed.then(|| format!("{RAIL_TOKEN_DIR}/token"));
    let rail_ca_line = if stubbed && tls {
        format!(
            "\"rail.proxy.rail-ca-file\" = {}\n",
            toml_string(&format!("{TLS_DIR}/{CA_FILE}"))
        )
    } else {
        String::new()
    };
    let proxy = Workload {
        config_toml: render(&config::RailProxy {
            server: server(),
            pg_url: None,
            rail_url,
            read_timeout_ms,
            rail_credential_file,
            auth,
            fencing,
        })? + &SecretFile::config_lines(&secret_files)
            + &tls_config_lines(&workload)
            + &rail_ca_line,
        secret_files,
        // A rollout must never cut a forward in flight: the pod gets the whole read timeout,
        // rounded up, plus room to answer and drain.
        termination_grace_period_seconds: (read_timeout_ms + 999) / 1000
            + TERMINATION_GRACE_ABOVE_READ_TIMEOUT_SECONDS,
        // The stub knows the proxy by its ServiceAccount, whatever the proxy's own auth mode.
        service_account: if stubbed {
            Some(SERVICE_ACCOUNT.to_owned())
        } else {
            workload.service_account.clone()
        },
        rail_token: stubbed,
        ..workload
    };
    let stub = match &spec.stub {
        None => None,
        Some(stub) => Some(rail_stub(&proxy, stub_name, stub, &spec.service)?),
    };
    Ok(ValidatedRail { proxy, stub })
}

/// The operator's rail stub beside `proxy`: TokenReview on every call, and only the proxy's
/// ServiceAccount (`rail.stub.submitter-identities`) may submit a transfer; any other pod that
/// reaches it, with any other token, is refused before a transfer is recorded
/// (docs/threat-model.md#the-rail-stub). It serves TLS with the proxy's Secret.
fn rail_stub(
    proxy: &Workload,
    name: String,
    stub: &crate::crd::RailStubSpec,
    service: &ServiceSettings,
) -> Result<Workload, Invalid> {
    let auth = config::Auth {
        mode: config::AuthMode::TokenReview,
        tokens_file: None,
        tokenreview_audiences: vec![crate::build::job::TOKEN_AUDIENCE.to_owned()],
        operator_identities: Vec::new(),
        treasury_identities: Vec::new(),
        service_accounts: Vec::new(),
    };
    let proxy_identity = super::service_account_identity(&proxy.namespace, SERVICE_ACCOUNT);
    let workload = Workload {
        name,
        component: Component::RailStub,
        // One stub: its statement is one file, like one rail's books.
        replicas: 1,
        config_toml: String::new(),
        secret_files: Vec::new(),
        termination_grace_period_seconds: TERMINATION_GRACE_SECONDS_DEFAULT,
        cloud_sql: None,
        data_volume: true,
        // Its TokenReview calls need the token of `dlock-service` (system:auth-delegator).
        service_account: Some(SERVICE_ACCOUNT.to_owned()),
        auth_disabled: false,
        rail_token: false,
        fencing_proof_keys_secret: None,
        pod: PodSettings::from_spec(
            stub.resources.as_ref(),
            service.pod.image_pull_secrets.as_ref(),
            small_resources(),
        ),
        ..proxy.clone()
    };
    let config_toml = render(&config::RailStub {
        server: server(),
        latency_ms: stub.latency_ms.unwrap_or(0),
        failure_rate: stub.failure_rate.unwrap_or(0.0),
        duplicate_ack_rate: stub.duplicate_ack_rate.unwrap_or(0.0),
        redirect_rate: None,
        statement_path: "/data/rail-statement.jsonl".to_owned(),
        auth: Some(auth),
    })? + &format!(
        "\"rail.stub.submitter-identities\" = [{}]\n",
        toml_string(&proxy_identity)
    ) + &tls_config_lines(&workload);
    Ok(Workload {
        config_toml,
        ..workload
    })
}
