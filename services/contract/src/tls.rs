//! TLS for every dlock client, on rustls with the ring provider: the one crypto provider of the
//! process and the roots a client trusts. (A service's listener is `dlock_server::tls`.)
//!
//! Clients trust the system's roots, or only the PEM bundle named by `DLOCK_CA_FILE` when it is
//! set (a private CA is the common case inside a cluster).

use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use rustls::crypto::CryptoProvider;
use rustls_pki_types::CertificateDer;
use rustls_pki_types::pem::PemObject;

/// The one crypto provider of the process. reqwest and the listeners both need one installed;
/// every client and listener in dlock goes through here, so calling it first is enough.
pub fn install_crypto_provider() -> Arc<CryptoProvider> {
    static PROVIDER: OnceLock<Arc<CryptoProvider>> = OnceLock::new();
    PROVIDER
        .get_or_init(|| {
            let provider = Arc::new(rustls::crypto::ring::default_provider());
            // Another part of the process may have installed one first; both are ring.
            let _ = CryptoProvider::install_default(provider.as_ref().clone());
            CryptoProvider::get_default().cloned().unwrap_or(provider)
        })
        .clone()
}
/// The client TLS configuration: the roots in `ca_file` only, or the system's roots.
pub fn client_config(ca_file: Option<&Path>) -> Result<rustls::ClientConfig, String> {
    let provider = install_crypto_provider();
    let mut roots = rustls::RootCertStore::empty();
    match ca_file {
        Some(path) => {
            let certs = CertificateDer::pem_file_iter(path)
                .map_err(|e| format!("cannot read the CA bundle {}: {e}", path.display()))?;
            for cert in certs {
                let cert =
                    cert.map_err(|e| format!("the CA bundle {} is not PEM: {e}", path.display()))?;
                roots
                    .add(cert)
                    .map_err(|e| format!("a certificate in {} is unusable: {e}", path.display()))?;
            }
            if roots.is_empty() {
                return Err(format!(
                    "the CA bundle {} holds no certificate",
                    path.display()
                ));
            }
        }
        None => {
            let native = rustls_native_certs::load_native_certs();
            for cert in native.certs {
                let _ = roots.add(cert);
            }
        }
    }
    Ok(rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| format!("TLS protocol versions: {e}"))?
        .with_root_certificates(roots)
        .with_no_client_auth())
}

/// The CA bundle clients trust, from `DLOCK_CA_FILE`; `None` means the system's roots.
pub fn ca_file_from_env() -> Option<PathBuf> {
    std::env::var_os("DLOCK_CA_FILE")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
}
