//! The lock server's connection to etcd: TLS with a client certificate, etcd's own
//! authentication, a start-up check that the credentials may read and write the prefix, and a
//! reconnect with fresh files when a certificate, key, CA bundle or password is rotated.
//!
//! etcd-client fixes its TLS configuration when a client is built, so a rotation is a new client:
//! every [`ROTATION_CHECK_EVERY`] the files are read again, and when their contents changed a new
//! client is connected (and, with a user, authenticated) with them and replaces the old one for
//! every later request. Requests in flight finish on the old one. A rotation that leaves files
//! that cannot be read, or credentials etcd refuses, keeps the previous client and says so in the
//! log on every check until it is fixed.
//!
//! Requests are spread over every endpoint (etcd-client's balanced channel). That channel keeps
//! a member that stopped answering in its rotation: each request routed there fails to connect
//! (on a host that is gone, only after `lock.etcd.connect-timeout-ms`) and is refused as
//! `NOT_LEADER`, although the other members still form a quorum. So every
//! [`MEMBER_CHECK_EVERY`] each member is asked for its status over its own connection; one that
//! cannot be reached is taken out of the rotation (never the last one) and put back when it
//! answers again (`etcd_member_unreachable`, `etcd_member_back`).
//!
//! At start-up a refusal by etcd is final and named (a CA that does not match etcd's certificate,
//! a client certificate etcd does not accept — expired, say —, a wrong password, a user whose role
//! does not grant the prefix): the server stops with that message instead of retrying. Only an
//! etcd that cannot be reached at all is waited for, with a warning per attempt.

use std::collections::BTreeSet;
use std::path::Path;
use std::sync::{Arc, RwLock, Weak};
use std::time::Duration;

use etcd_client::{
    Certificate, Client, Compare, CompareOp, ConnectOptions, GetOptions, Identity, TlsOptions, Txn,
    TxnOp,
};

use crate::config::EtcdSettings;

/// How often the TLS and password files are looked at for a rotation.
pub const ROTATION_CHECK_EVERY: Duration = Duration::from_secs(10);
/// The wait between two start-up attempts while etcd cannot be reached.
const UNREACHABLE_RETRY: Duration = Duration::from_secs(1);

/// How often each member's status is asked, to keep dead members out of the rotation.
pub const MEMBER_CHECK_EVERY: Duration = Duration::from_millis(250);

/// The client every request uses; replaced whole on a rotation.
pub type ClientCell = Arc<Connection>;

/// The current client, with what the member check needs to reach each member on its own.
pub struct Connection {
    current: RwLock<Current>,
}

struct Current {
    client: Client,
    /// Bumped on every rotation: the new client has every endpoint in its rotation again.
    generation: u64,
    /// The connection options without the user (a status call needs no authentication).
    probe_options: ConnectOptions,
}

impl Connection {
    fn new(client: Client, probe_options: ConnectOptions) -> Self {
        Self {
            current: RwLock::new(Current {
                client,
                generation: 0,
                probe_options,
            }),
        }
    }

    /// The client for one request (cheap: a handle on shared channels).
    pub fn client(&self) -> Client {
        self.read().client.clone()
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, Current> {
        self.current.read().unwrap_or_else(|p| p.into_inner())
    }

    fn replace(&self, client: Client, probe_options: ConnectOptions) {
        let mut current = self.current.write().unwrap_or_else(|p| p.into_inner());
        current.client = client;
        current.generation += 1;
        current.probe_options = probe_options;
    }
}

/// The contents of every credential file, as read at one moment.
#[derive(PartialEq, Eq)]
struct Material {
    ca: Option<Vec<u8>>,
    cert: Option<Vec<u8>>,
    key: Option<Vec<u8>>,
    password: Option<String>,
}

fn read(key: &str, path: &Path) -> Result<Vec<u8>, String> {
    std::fs::read(path).map_err(|e| format!("{key}: cannot read {}: {e}", path.display()))
}

/// etcd answers a client certificate out of its validity with a bare "bad certificate" alert;
/// saying here that it expired (or is not valid yet) is what tells the operator what to renew.
fn check_validity(cert_file: &Path, der: &[u8]) -> Result<(), String> {
    let (_, cert) = x509_parser::parse_x509_certificate(der).map_err(|e| {
        format!(
            "lock.etcd.cert-file: {} is not an X.509 certificate: {e}",
            cert_file.display()
        )
    })?;
    let validity = cert.validity();
    let now = x509_parser::time::ASN1Time::now();
    if now > validity.not_after {
        return Err(format!(
            "lock.etcd.cert-file: the client certificate {} expired at {}; renew it (etcd \
             refuses an expired client certificate)",
            cert_file.display(),
            validity.not_after
        ));
    }
    if now < validity.not_before {
        return Err(format!(
            "lock.etcd.cert-file: the client certificate {} is not valid before {}",
            cert_file.display(),
            validity.not_before
        ));
    }
    Ok(())
}

impl Material {
    fn read(settings: &EtcdSettings) -> Result<Self, String> {
        let (mut ca, mut cert, mut key) = (None, None, None);
        if let Some(tls) = &settings.tls {
            let pem = read("lock.etcd.ca-file", &tls.ca_file)?;
            if !String::from_utf8_lossy(&pem).contains("-----BEGIN CERTIFICATE-----") {
                return Err(format!(
                    "lock.etcd.ca-file: {} holds no PEM CERTIFICATE block",
                    tls.ca_file.display()
                ));
            }
            ca = Some(pem);
            if let Some((cert_file, key_file)) = &tls.client {
                let c = read("lock.etcd.cert-file", cert_file)?;
                let k = read("lock.etcd.key-file", key_file)?;
                // Checked here so that a bad pair is named now, not as a failed handshake.
                use rustls_pki_types::pem::PemObject;
                let der = rustls_pki_types::CertificateDer::from_pem_slice(&c).map_err(|e| {
                    format!(
                        "lock.etcd.cert-file: {} is not a PEM certificate: {e}",
                        cert_file.display()
                    )
                })?;
                check_validity(cert_file, &der)?;
                rustls_pki_types::PrivateKeyDer::from_pem_slice(&k).map_err(|e| {
                    format!(
                        "lock.etcd.key-file: {} is not a PEM private key: {e}",
                        key_file.display()
                    )
                })?;
                cert = Some(c);
                key = Some(k);
            }
        }
        let password = match &settings.user {
            Some(user) => {
                let bytes = read("lock.etcd.password-file", &user.password_file)?;
                let text = String::from_utf8(bytes).map_err(|_| {
                    format!(
                        "lock.etcd.password-file: {} is not UTF-8 text",
                        user.password_file.display()
                    )
                })?;
                // A Secret written by hand often ends in a newline; a password never does.
                let password = text.trim_end_matches(['\n', '\r']).to_owned();
                if password.is_empty() {
                    return Err(format!(
                        "lock.etcd.password-file: {} is empty",
                        user.password_file.display()
                    ));
                }
                Some(password)
            }
            None => None,
        };
        Ok(Self {
            ca,
            cert,
            key,
            password,
        })
    }

    fn options(&self, settings: &EtcdSettings) -> ConnectOptions {
        let mut options = self.probe_options(settings);
        if let (Some(user), Some(password)) = (&settings.user, &self.password) {
            // etcd's tokens lapse (`--auth-token-ttl`, 5 min idle by default) and a restarted
            // member forgets simple tokens: a request refused for its token authenticates again
            // and is sent once more, instead of every later request being refused.
            options = options
                .with_user(user.name.clone(), password.clone())
                .with_auto_token_refresh(true);
        }
        options
    }

    /// TLS and timeouts, without the user.
    fn probe_options(&self, settings: &EtcdSettings) -> ConnectOptions {
        let mut options = ConnectOptions::new()
            .with_connect_timeout(settings.connect_timeout)
            .with_timeout(settings.request_timeout);
        if let Some(ca) = &self.ca {
            let mut tls = TlsOptions::new().ca_certificate(Certificate::from_pem(ca));
            if let (Some(cert), Some(key)) = (&self.cert, &self.key) {
                tls = tls.identity(Identity::from_pem(cert, key));
            }
            options = options.with_tls(tls);
        }
        options
    }
}

/// Why etcd could not be used.
#[derive(Debug)]
pub enum Refusal {
    /// No answer at all (connection refused, timed out): waited for at start-up.
    Unreachable(String),
    /// etcd answered and refused, or the files are unusable: final, with what to fix.
    Fatal(String),
}

/// The whole chain of an error, which is where TLS failures say what went wrong.
pub fn chain(error: &(dyn std::error::Error + 'static)) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        let more = cause.to_string();
        if !text.contains(&more) {
            text.push_str(": ");
            text.push_str(&more);
        }
        source = cause.source();
    }
    text
}

/// What kind of failure an etcd error is, by its gRPC status and its message chain.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Failure {
    Tls,
    Authentication,
    Permission,
    Unreachable,
    Other,
}

pub fn classify(error: &etcd_client::Error) -> (Failure, String) {
    let text = chain(error);
    let lower = text.to_lowercase();
    let tls = [
        "certificate",
        "alert",
        "handshake",
        "unknownissuer",
        "invalid peer",
        "tls",
    ]
    .iter()
    .any(|w| lower.contains(w));
    let failure = if let etcd_client::Error::GRpcStatus(status) = error {
        let message = status.message().to_lowercase();
        match i32::from(status.code()) {
            // The client's own deadline (`lock.etcd.request-timeout-ms`, tonic's "Timeout
            // expired"): no answer in time, as while the members elect a leader.
            1 if status.message().contains("Timeout expired") => Failure::Unreachable,
            // The connection broke under the request (a member killed or restarted): tonic's
            // Unknown "transport error" (connection reset, broken pipe, an h2 stream error), or
            // a Cancelled stream of a connection that closed. A failed TLS handshake is a
            // transport error too, and stays a TLS failure.
            1 | 2 | 13
                if !tls
                    && [
                        "transport error",
                        "connection reset",
                        "connection closed",
                        "broken pipe",
                        "h2 protocol error",
                        "error trying to connect",
                    ]
                    .iter()
                    .any(|m| message.contains(m) || lower.contains(m)) =>
            {
                Failure::Unreachable
            }
            7 => Failure::Permission,
            16 => Failure::Authentication,
            _ if message.contains("permission denied") => Failure::Permission,
            _ if message.contains("authentication failed")
                || message.contains("user name is empty")
                || message.contains("user name not found")
                || message.contains("invalid auth token")
                || message.contains("auth: ") =>
            {
                Failure::Authentication
            }
            _ if tls => Failure::Tls,
            4 | 14 => Failure::Unreachable,
            _ => Failure::Other,
        }
    } else if tls {
        Failure::Tls
    } else if matches!(
        error,
        etcd_client::Error::TransportError(_) | etcd_client::Error::IoError(_)
    ) {
        Failure::Unreachable
    } else {
        Failure::Other
    };
    (failure, text)
}

/// Whether an error's chain shows the request never left the lock server: no connection could
/// be opened, or the request was still queued for a connection that closed (hyper's "operation
/// was canceled" with "connection closed": the request is handed back unsent). Anything else
/// after a write was handed to the transport may have reached etcd.
pub fn sent_nothing(text: &str) -> bool {
    let lower = text.to_lowercase();
    let refused = [
        "tcp connect error",
        "error trying to connect",
        "connection refused",
        "dns error",
    ]
    .iter()
    .any(|m| lower.contains(m));
    refused || (lower.contains("operation was canceled") && lower.contains("connection closed"))
}

/// The refusal for an error at start-up, with what the operator must fix.
fn refusal(settings: &EtcdSettings, error: &etcd_client::Error) -> Refusal {
    let (failure, text) = classify(error);
    let endpoints = settings.endpoints.join(",");
    let user = settings.user.as_ref().map(|u| u.name.as_str());
    match failure {
        Failure::Unreachable => Refusal::Unreachable(format!(
            "etcd at {endpoints} cannot be reached (lock.etcd.endpoints): {text}"
        )),
        Failure::Tls => Refusal::Fatal(format!(
            "the TLS handshake with etcd at {endpoints} failed: {text}. Check lock.etcd.ca-file \
             (the CA that signed etcd's serving certificate) and lock.etcd.cert-file / key-file \
             (a client certificate, not expired, signed by a CA in etcd's --trusted-ca-file)"
        )),
        Failure::Authentication => Refusal::Fatal(match user {
            Some(user) => format!(
                "etcd at {endpoints} refused the user {user:?}: {text}. Check lock.etcd.username \
                 and lock.etcd.password-file"
            ),
            None => format!(
                "etcd at {endpoints} requires authentication: {text}. Set lock.etcd.username and \
                 lock.etcd.password-file"
            ),
        }),
        Failure::Permission => Refusal::Fatal(format!(
            "etcd at {endpoints} does not let {} read and write under {:?}: {text}. Grant its \
             role readwrite on the key prefix \"{}/\"",
            user.map(|u| format!("the user {u:?}"))
                .unwrap_or_else(|| "the lock server's client certificate (its CN)".into()),
            settings.prefix,
            settings.prefix.trim_end_matches('/'),
        )),
        Failure::Other => Refusal::Fatal(format!("etcd at {endpoints}: {text}")),
    }
}

/// Connects with `material` and checks, in one transaction that changes nothing, that the
/// credentials may read and write under the prefix (etcd checks the permissions of both
/// branches of a transaction, whichever runs).
async fn open(
    settings: &EtcdSettings,
    material: &Material,
    prefix: &str,
) -> Result<Client, Refusal> {
    let mut client = Client::connect(&settings.endpoints, Some(material.options(settings)))
        .await
        .map_err(|e| refusal(settings, &e))?;
    let probe = format!("{prefix}/probe");
    let txn = Txn::new()
        .when([Compare::version(probe.clone(), CompareOp::Less, 0)])
        .and_then([TxnOp::put(probe, "", None)])
        .or_else([TxnOp::get(
            format!("{prefix}/"),
            Some(
                GetOptions::new()
                    .with_prefix()
                    .with_keys_only()
                    .with_limit(1),
            ),
        )]);
    client.txn(txn).await.map_err(|e| refusal(settings, &e))?;
    Ok(client)
}

/// Connects at start-up: waits while etcd cannot be reached (a warning per attempt), stops at
/// the first refusal. Then watches the credential files for rotations.
pub async fn connect(settings: &EtcdSettings, prefix: &str) -> anyhow::Result<ClientCell> {
    let mut attempt = 0u32;
    let (client, material) = loop {
        let material = Material::read(settings).map_err(anyhow::Error::msg)?;
        match open(settings, &material, prefix).await {
            Ok(client) => break (client, material),
            Err(Refusal::Fatal(message)) => anyhow::bail!(message),
            Err(Refusal::Unreachable(message)) => {
                attempt += 1;
                tracing::warn!(
                    event = "etcd_unreachable",
                    attempt,
                    %message,
                    "etcd cannot be reached yet; trying again in 1 s"
                );
                tokio::time::sleep(UNREACHABLE_RETRY).await;
            }
        }
    };
    tracing::info!(
        event = "etcd_connected",
        endpoints = %settings.endpoints.join(","),
        tls = settings.tls.is_some(),
        client_certificate = settings.tls.as_ref().is_some_and(|t| t.client.is_some()),
        user = settings.user.as_ref().map(|u| u.name.as_str()),
        "connected to etcd; the credentials may read and write the prefix"
    );
    let cell = Arc::new(Connection::new(client, material.probe_options(settings)));
    if settings.endpoints.len() > 1 {
        tokio::spawn(keep_dead_members_out(
            Arc::downgrade(&cell),
            settings.clone(),
        ));
    }
    if settings.tls.is_some() || settings.user.is_some() {
        tokio::spawn(watch_rotation(
            Arc::downgrade(&cell),
            settings.clone(),
            prefix.to_owned(),
            material,
        ));
    }
    Ok(cell)
}

/// Re-reads the credential files and reconnects when they changed, until the store is gone.
async fn watch_rotation(
    cell: Weak<Connection>,
    settings: EtcdSettings,
    prefix: String,
    mut current: Material,
) {
    let mut ticker = tokio::time::interval(ROTATION_CHECK_EVERY);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    ticker.tick().await;
    loop {
        ticker.tick().await;
        if cell.strong_count() == 0 {
            return;
        }
        let fresh = match Material::read(&settings) {
            Ok(fresh) if fresh == current => continue,
            Ok(fresh) => fresh,
            Err(message) => {
                tracing::warn!(
                    event = "etcd_credentials_unreadable",
                    %message,
                    "the rotated etcd credentials cannot be read; the previous ones stay in use"
                );
                continue;
            }
        };
        match open(&settings, &fresh, &prefix).await {
            Ok(client) => {
                let Some(cell) = cell.upgrade() else { return };
                cell.replace(client, fresh.probe_options(&settings));
                current = fresh;
                tracing::info!(
                    event = "etcd_credentials_rotated",
                    "reconnected to etcd with the rotated certificate, key, CA or password"
                );
            }
            Err(Refusal::Fatal(message) | Refusal::Unreachable(message)) => tracing::warn!(
                event = "etcd_rotation_refused",
                %message,
                "the rotated etcd credentials do not work yet; the previous ones stay in use"
            ),
        }
    }
}

/// The endpoint as etcd-client keys it in the balanced channel (a bare `host:port` gets the
/// scheme etcd-client gives it).
fn endpoint_url(endpoint: &str, tls: bool) -> String {
    if endpoint.starts_with("http://") || endpoint.starts_with("https://") {
        endpoint.to_owned()
    } else if tls {
        format!("https://{endpoint}")
    } else {
        format!("http://{endpoint}")
    }
}

/// Whether the member at `endpoint` answers at all: any answer (even a refusal) is a live
/// member; no connection or no answer within the connect timeout is a dead one.
async fn answers(probe: &mut Client, timeout: Duration) -> bool {
    match tokio::time::timeout(timeout, probe.status()).await {
        Err(_) => false,
        Ok(Ok(_)) => true,
        Ok(Err(error)) => classify(&error).0 != Failure::Unreachable,
    }
}

/// Takes members that cannot be reached out of the client's rotation and puts them back when
/// they answer, until the store is gone. At least one endpoint always stays in.
async fn keep_dead_members_out(cell: Weak<Connection>, settings: EtcdSettings) {
    let tls = settings.tls.is_some();
    let urls: Vec<String> = settings
        .endpoints
        .iter()
        .map(|e| endpoint_url(e, tls))
        .collect();
    let timeout = settings.connect_timeout.min(MEMBER_CHECK_EVERY * 4);
    let mut generation = None;
    let mut probes: Vec<Option<Client>> = Vec::new();
    let mut out: BTreeSet<usize> = BTreeSet::new();
    let mut ticker = tokio::time::interval(MEMBER_CHECK_EVERY);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticker.tick().await;
        let Some(connection) = cell.upgrade() else {
            return;
        };
        let (client, current_generation, probe_options) = {
            let current = connection.read();
            (
                current.client.clone(),
                current.generation,
                current.probe_options.clone(),
            )
        };
        drop(connection);
        if generation != Some(current_generation) {
            // A new client (start, or a rotation): every endpoint is in its rotation.
            generation = Some(current_generation);
            out.clear();
            probes = Vec::with_capacity(urls.len());
            for url in &urls {
                probes.push(
                    Client::connect([url], Some(probe_options.clone()))
                        .await
                        .ok(),
                );
            }
        }
        let checks = probes.iter_mut().map(|probe| async {
            match probe {
                Some(probe) => answers(probe, timeout).await,
                // No probe client (cannot happen for an endpoint the main client took): unknown,
                // so the endpoint stays in.
                None => true,
            }
        });
        let alive = futures::future::join_all(checks).await;
        for (i, url) in urls.iter().enumerate() {
            if !alive[i] && !out.contains(&i) && out.len() + 1 < urls.len() {
                if client.remove_endpoint(url).await.is_ok() {
                    out.insert(i);
                    tracing::warn!(
                        event = "etcd_member_unreachable",
                        endpoint = %url,
                        "an etcd member does not answer; requests go to the others until it does"
                    );
                }
            } else if alive[i] && out.contains(&i) && client.add_endpoint(url).await.is_ok() {
                out.remove(&i);
                tracing::info!(
                    event = "etcd_member_back",
                    endpoint = %url,
                    "an etcd member answers again; requests go to it again"
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::sent_nothing;

    #[test]
    fn a_request_handed_back_unsent_or_never_connected_sent_nothing() {
        // As seen when every connection to etcd was reset: the request was still queued.
        let queued = "grpc request error: code: 'The operation was cancelled', message: \
             \"operation was canceled\", source: tonic::transport::Error(Transport, \
             hyper::Error(Canceled, \"connection closed\"))";
        assert!(sent_nothing(queued));
        assert!(sent_nothing(
            "transport error: tcp connect error: Connection refused (os error 111)"
        ));
        // Positive control: a connection reset under a request that was written may have
        // reached etcd, and so may tonic's own deadline.
        assert!(!sent_nothing(
            "grpc request error: code: 'Unknown error', message: \"transport error\", source: \
             hyper::Error(Io, Os { code: 104, kind: ConnectionReset })"
        ));
        assert!(!sent_nothing(
            "grpc request error: code: 'The operation was cancelled', message: \"Timeout expired\""
        ));
    }
}
