//! TLS for every dlock listener, on rustls with the ring provider.
//!
//! A service serves TLS when `server.tls.cert-file` and `server.tls.key-file` are both set (PEM;
//! a Kubernetes `kubernetes.io/tls` Secret mounted as files fits as is). The files are re-read
//! when they change, so a certificate rotated by cert-manager is picked up without a restart;
//! a rotation that leaves unreadable files keeps the previous certificate and says so in the log.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use dlock_contract::tls::install_crypto_provider;
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::TlsAcceptor;
use tokio_rustls::server::TlsStream;

use crate::config::{ConfigError, RawConfig};
use crate::watch::{Reload, Watched};

/// How often a listener looks at its certificate files for a rotation.
const RELOAD_CHECK_EVERY: Duration = Duration::from_secs(10);
/// A client that has not finished its handshake after this long is dropped.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// `server.tls.*`: the listener's certificate and key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsSettings {
    pub cert_file: PathBuf,
    pub key_file: PathBuf,
    /// `server.tls.handshakes-max`: TLS handshakes in progress at once; more wait in the
    /// kernel's accept backlog.
    pub handshakes_max: usize,
}

impl TlsSettings {
    /// Reads `server.tls.cert-file`, `server.tls.key-file` and `server.tls.handshakes-max`.
    /// Neither file set is plain HTTP; one without the other stops the service.
    pub fn from_raw(raw: &mut RawConfig) -> Result<Option<Self>, ConfigError> {
        let cert = raw.string_optional("server.tls.cert-file")?;
        let key = raw.string_optional("server.tls.key-file")?;
        let handshakes_max = raw.integer("server.tls.handshakes-max", 256, 1..=65_536)? as usize;
        let settings = match (cert, key) {
            (None, None) => return Ok(None),
            (Some(cert), Some(key)) => Self {
                cert_file: cert.into(),
                key_file: key.into(),
                handshakes_max,
            },
            (Some(_), None) | (None, Some(_)) => {
                return Err(ConfigError {
                    key: "server.tls.cert-file".into(),
                    origin: String::new(),
                    message: "server.tls.cert-file and server.tls.key-file go together: set both \
                              for TLS, or neither for plain HTTP"
                        .into(),
                });
            }
        };
        // Fail at start, naming the key, rather than at the first handshake.
        load_certified_key(&settings.cert_file, &settings.key_file).map_err(|message| {
            ConfigError {
                key: "server.tls.cert-file".into(),
                origin: String::new(),
                message,
            }
        })?;
        Ok(Some(settings))
    }

    /// The acceptor for this listener, with the rotation-aware certificate resolver.
    pub fn acceptor(&self) -> Result<TlsAcceptor, String> {
        let provider = install_crypto_provider();
        let resolver = ReloadingResolver::new(self.cert_file.clone(), self.key_file.clone())?;
        let mut config = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| format!("TLS protocol versions: {e}"))?
            .with_no_client_auth()
            .with_cert_resolver(Arc::new(resolver));
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(TlsAcceptor::from(Arc::new(config)))
    }
}

fn load_certified_key(cert_file: &Path, key_file: &Path) -> Result<CertifiedKey, String> {
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(cert_file)
        .map_err(|e| format!("cannot read the certificate {}: {e}", cert_file.display()))?
        .collect::<Result<_, _>>()
        .map_err(|e| format!("the certificate {} is not PEM: {e}", cert_file.display()))?;
    if certs.is_empty() {
        return Err(format!(
            "{} holds no CERTIFICATE block; it must be the PEM certificate chain, leaf first",
            cert_file.display()
        ));
    }
    let key = PrivateKeyDer::from_pem_file(key_file).map_err(|e| {
        format!(
            "cannot read a private key from {}: {e}; it must be a PEM PKCS#8, PKCS#1 or SEC1 key",
            key_file.display()
        )
    })?;
    let provider = install_crypto_provider();
    let signing = provider
        .key_provider
        .load_private_key(key)
        .map_err(|e| format!("the key in {} is not usable: {e}", key_file.display()))?;
    let certified = CertifiedKey::new(certs, signing);
    certified.keys_match().map_err(|e| {
        format!(
            "the key in {} does not belong to the certificate in {}: {e}",
            key_file.display(),
            cert_file.display()
        )
    })?;
    Ok(certified)
}

/// Serves the current certificate and swaps in a new one when the files change.
struct ReloadingResolver(Watched<Arc<CertifiedKey>>);

impl std::fmt::Debug for ReloadingResolver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("ReloadingResolver")
            .field(&self.0.path())
            .finish()
    }
}

fn load_pair(paths: &[PathBuf]) -> Result<Arc<CertifiedKey>, String> {
    match paths {
        [cert_file, key_file] => load_certified_key(cert_file, key_file).map(Arc::new),
        _ => Err("a certificate and its key are two files".into()),
    }
}

impl ReloadingResolver {
    fn new(cert_file: PathBuf, key_file: PathBuf) -> Result<Self, String> {
        Watched::new(vec![cert_file, key_file], RELOAD_CHECK_EVERY, load_pair).map(Self)
    }

    fn maybe_reload(&self) {
        match self.0.maybe_reload() {
            Reload::Unchanged => {}
            Reload::Reloaded => tracing::info!(
                event = "tls_certificate_reloaded",
                cert = %self.0.path().display(),
                "the listener's certificate changed on disk and is now served"
            ),
            Reload::Failed(error) => tracing::error!(
                event = "tls_certificate_reload_failed",
                %error,
                "the certificate files changed but cannot be used; the previous certificate is \
                 still served. Fix the files (or the Secret); they are checked again shortly"
            ),
        }
    }

    fn current(&self) -> Option<Arc<CertifiedKey>> {
        self.0.read().map(|key| Arc::clone(&key))
    }
}

impl ResolvesServerCert for ReloadingResolver {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        self.maybe_reload();
        self.current()
    }
}

/// A TLS listener for `axum::serve`: accepts TCP, runs each handshake in its own task with a
/// deadline (a slow client never stalls the others), and hands out finished streams.
pub struct TlsListener {
    incoming: tokio::sync::mpsc::Receiver<(TlsStream<TcpStream>, SocketAddr)>,
    local: SocketAddr,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for TlsListener {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl TlsListener {
    pub fn new(listener: TcpListener, settings: &TlsSettings) -> std::io::Result<Self> {
        let acceptor = settings.acceptor().map_err(std::io::Error::other)?;
        let local = listener.local_addr()?;
        let (tx, incoming) = tokio::sync::mpsc::channel(64);
        let permits = Arc::new(tokio::sync::Semaphore::new(settings.handshakes_max));
        let task = tokio::spawn(async move {
            loop {
                let Ok(permit) = permits.clone().acquire_owned().await else {
                    return;
                };
                let (tcp, peer) = match listener.accept().await {
                    Ok(accepted) => accepted,
                    Err(error) => {
                        tracing::warn!(event = "accept_failed", %error, "accepting a connection failed; retrying");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                };
                let _ = tcp.set_nodelay(true);
                let acceptor = acceptor.clone();
                let tx = tx.clone();
                tokio::spawn(async move {
                    let _permit = permit;
                    match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
                        Ok(Ok(stream)) => {
                            let _ = tx.send((stream, peer)).await;
                        }
                        Ok(Err(error)) => tracing::debug!(
                            event = "tls_handshake_failed",
                            %peer,
                            %error,
                            "a client failed the TLS handshake (plain HTTP to a TLS port, or an untrusted certificate)"
                        ),
                        Err(_) => tracing::debug!(
                            event = "tls_handshake_timeout",
                            %peer,
                            "a client did not finish its TLS handshake in time"
                        ),
                    }
                });
            }
        });
        Ok(Self {
            incoming,
            local,
            task,
        })
    }
}

impl axum::serve::Listener for TlsListener {
    type Io = TlsStream<TcpStream>;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        match self.incoming.recv().await {
            Some(accepted) => accepted,
            // The accept task only ends when the listener is dropped.
            None => std::future::pending().await,
        }
    }

    fn local_addr(&self) -> std::io::Result<Self::Addr> {
        Ok(self.local)
    }
}
#[cfg(test)]
mod tests {
    use super::*;
    use std::time::SystemTime;

    fn write_cert(dir: &Path, name: &str) -> (PathBuf, PathBuf) {
        let cert = rcgen::generate_simple_self_signed(vec!["localhost".to_owned()])
            .unwrap_or_else(|e| panic!("{e}"));
        let cert_file = dir.join(format!("{name}.crt"));
        let key_file = dir.join(format!("{name}.key"));
        std::fs::write(&cert_file, cert.cert.pem()).unwrap_or_else(|e| panic!("{e}"));
        std::fs::write(&key_file, cert.signing_key.serialize_pem())
            .unwrap_or_else(|e| panic!("{e}"));
        (cert_file, key_file)
    }

    #[test]
    fn a_key_of_another_certificate_is_refused_at_load() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let (cert_a, _) = write_cert(dir.path(), "a");
        let (_, key_b) = write_cert(dir.path(), "b");
        let error = load_certified_key(&cert_a, &key_b)
            .err()
            .unwrap_or_default();
        assert!(error.contains("does not belong"), "{error}");
        let (cert_a2, key_a2) = write_cert(dir.path(), "c");
        assert!(load_certified_key(&cert_a2, &key_a2).is_ok());
    }

    #[test]
    fn half_a_tls_configuration_names_the_keys() {
        let mut raw =
            RawConfig::from_pairs(&[("server.tls.cert-file", "/nonexistent.crt".to_owned())])
                .unwrap_or_else(|e| panic!("{e}"));
        let error = TlsSettings::from_raw(&mut raw).err().map(|e| e.message);
        assert!(error.unwrap_or_default().contains("go together"));
    }

    #[test]
    fn a_rotated_certificate_is_served_after_the_reload_check() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let (cert, key) = write_cert(dir.path(), "live");
        let resolver =
            ReloadingResolver::new(cert.clone(), key.clone()).unwrap_or_else(|e| panic!("{e}"));
        let before = resolver
            .current()
            .map(|key| key.cert[0].clone())
            .unwrap_or_else(|| panic!("no certificate"));
        // Rotate: new files under the same names, with a later mtime.
        let (new_cert, new_key) = write_cert(dir.path(), "next");
        std::fs::rename(new_cert, &cert).unwrap_or_else(|e| panic!("{e}"));
        std::fs::rename(new_key, &key).unwrap_or_else(|e| panic!("{e}"));
        let later = SystemTime::now() + Duration::from_secs(5);
        for f in [&cert, &key] {
            std::fs::File::options()
                .write(true)
                .open(f)
                .and_then(|file| file.set_modified(later))
                .unwrap_or_else(|e| panic!("{e}"));
        }
        resolver.0.look_now();
        resolver.maybe_reload();
        let after = resolver
            .current()
            .map(|key| key.cert[0].clone())
            .unwrap_or_else(|| panic!("no certificate"));
        assert_ne!(before, after, "the rotated certificate is served");
    }
}
