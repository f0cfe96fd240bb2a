//! Throwaway certificate authorities for tests and local stacks: a CA, server certificates for
//! loopback, client certificates (also already expired ones), all as PEM files (rcgen).

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, KeyUsagePurpose, date_time_ymd,
};

/// A certificate and its key, written as PEM files.
#[derive(Debug, Clone)]
pub struct CertFiles {
    pub cert_file: PathBuf,
    pub key_file: PathBuf,
}

/// A private CA that signs server and client certificates into `dir`.
pub struct TestCa {
    name: String,
    dir: PathBuf,
    issuer: CertifiedIssuer<'static, KeyPair>,
    /// The CA's certificate (PEM): what a peer trusts.
    pub ca_file: PathBuf,
}

/// How long a certificate is valid.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Validity {
    /// From yesterday for a year (rcgen's default window is far wider; a year is enough).
    Current,
    /// Valid in 2020 only: expired long ago.
    Expired,
}

impl TestCa {
    /// A new CA named `name`, its certificate written to `dir/{name}-ca.crt`.
    pub fn new(dir: &Path, name: &str) -> Result<Self> {
        std::fs::create_dir_all(dir)?;
        let mut params = CertificateParams::new(Vec::<String>::new())?;
        params
            .distinguished_name
            .push(DnType::CommonName, format!("{name} test CA"));
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let issuer = CertifiedIssuer::self_signed(params, KeyPair::generate()?)
            .context("signing the test CA")?;
        let ca_file = dir.join(format!("{name}-ca.crt"));
        std::fs::write(&ca_file, issuer.pem())
            .with_context(|| format!("writing {}", ca_file.display()))?;
        Ok(Self {
            name: name.to_owned(),
            dir: dir.to_path_buf(),
            issuer,
            ca_file,
        })
    }

    /// A server certificate for 127.0.0.1 and localhost, written as `dir/{file}.crt|.key`.
    pub fn server(&self, file: &str) -> Result<CertFiles> {
        self.issue(
            file,
            &format!("{} server", self.name),
            &["127.0.0.1", "localhost"],
            // etcd members present their serving certificate to each other as clients too.
            &[
                ExtendedKeyUsagePurpose::ServerAuth,
                ExtendedKeyUsagePurpose::ClientAuth,
            ],
            Validity::Current,
        )
    }

    /// A client certificate with common name `common_name`.
    pub fn client(&self, file: &str, common_name: &str, validity: Validity) -> Result<CertFiles> {
        self.issue(
            file,
            common_name,
            &[],
            &[ExtendedKeyUsagePurpose::ClientAuth],
            validity,
        )
    }

    fn issue(
        &self,
        file: &str,
        common_name: &str,
        names: &[&str],
        usages: &[ExtendedKeyUsagePurpose],
        validity: Validity,
    ) -> Result<CertFiles> {
        let names: Vec<String> = names.iter().map(|s| (*s).to_owned()).collect();
        let mut params = CertificateParams::new(names)?;
        params
            .distinguished_name
            .push(DnType::CommonName, common_name);
        params.key_usages = vec![
            KeyUsagePurpose::DigitalSignature,
            KeyUsagePurpose::KeyEncipherment,
        ];
        params.extended_key_usages = usages.to_vec();
        match validity {
            Validity::Current => {
                let now = std::time::SystemTime::now();
                params.not_before = (now - std::time::Duration::from_secs(86_400)).into();
                params.not_after = (now + std::time::Duration::from_secs(365 * 86_400)).into();
            }
            Validity::Expired => {
                params.not_before = date_time_ymd(2020, 1, 1);
                params.not_after = date_time_ymd(2020, 12, 31);
            }
        }
        let key = KeyPair::generate()?;
        let cert = params
            .signed_by(&key, &self.issuer)
            .with_context(|| format!("signing the certificate {common_name}"))?;
        let files = CertFiles {
            cert_file: self.dir.join(format!("{file}.crt")),
            key_file: self.dir.join(format!("{file}.key")),
        };
        std::fs::write(&files.cert_file, cert.pem())?;
        std::fs::write(&files.key_file, key.serialize_pem())?;
        Ok(files)
    }
}

impl crate::PgServer {
    /// A throwaway PostgreSQL with `ssl=on`, serving `server` (copied into its directory, owned
    /// by the server's user with mode 0600, as PostgreSQL demands of a key). Plain connections
    /// are still accepted; `sslmode=verify-full` clients get TLS and check the name.
    pub fn start_tls(dir: Option<&Path>, server: &CertFiles) -> Result<Self> {
        Self::start_with(dir, &[], |dir| {
            let target = dir.join("tls");
            std::fs::create_dir_all(&target)?;
            crate::chown_for_postgres(&target)?;
            let mut settings = vec!["ssl=on".to_owned()];
            for (from, name, setting) in [
                (&server.cert_file, "server.crt", "ssl_cert_file"),
                (&server.key_file, "server.key", "ssl_key_file"),
            ] {
                let to = target.join(name);
                std::fs::copy(from, &to)
                    .with_context(|| format!("copying {} to {}", from.display(), to.display()))?;
                std::fs::set_permissions(&to, std::fs::Permissions::from_mode(0o600))?;
                crate::chown_for_postgres(&to)?;
                settings.push(format!("{setting}={}", to.display()));
            }
            Ok(settings)
        })
    }
}
