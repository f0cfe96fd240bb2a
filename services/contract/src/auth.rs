//! What a client presents: a bearer credential, fixed or read from a file as it rotates. How a
//! service checks one is `dlock_server::auth`.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A credential a client presents: fixed, or a file re-read as it changes (a projected
/// service-account token is rotated by kubelet; a Secret mount is updated in place).
#[derive(Clone)]
pub struct Credential {
    source: Arc<CredentialSource>,
}

enum CredentialSource {
    Fixed(String),
    File {
        path: PathBuf,
        current: Mutex<(Instant, String)>,
    },
}

/// A credential file is read again when its copy is older than this.
const CREDENTIAL_REREAD_EVERY: Duration = Duration::from_secs(30);

impl std::fmt::Debug for Credential {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.source.as_ref() {
            CredentialSource::Fixed(_) => f.write_str("Credential(fixed, redacted)"),
            CredentialSource::File { path, .. } => {
                write!(f, "Credential(file {}, redacted)", path.display())
            }
        }
    }
}

fn read_credential(path: &Path) -> Result<String, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read the credential file {}: {e}", path.display()))?;
    let token = text.trim().to_owned();
    if token.is_empty() || !token.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(format!(
            "the credential file {} must hold one token of printable characters",
            path.display()
        ));
    }
    Ok(token)
}

impl Credential {
    pub fn fixed(token: &str) -> Self {
        Self {
            source: Arc::new(CredentialSource::Fixed(token.trim().to_owned())),
        }
    }

    /// Reads the file now (so a wrong path fails at start) and again every 30 s.
    pub fn from_file(path: &Path) -> Result<Self, String> {
        let token = read_credential(path)?;
        Ok(Self {
            source: Arc::new(CredentialSource::File {
                path: path.to_owned(),
                current: Mutex::new((Instant::now(), token)),
            }),
        })
    }

    /// `DLOCK_CREDENTIAL_FILE` (preferred: it rotates) or `DLOCK_CREDENTIAL`; neither is `None`.
    pub fn from_env() -> Result<Option<Self>, String> {
        Self::from_env_named("DLOCK_CREDENTIAL_FILE", "DLOCK_CREDENTIAL")
    }

    /// The file named by `file_var` (preferred: it rotates), else the token in `token_var`;
    /// neither is `None`.
    pub fn from_env_named(file_var: &str, token_var: &str) -> Result<Option<Self>, String> {
        if let Some(path) = std::env::var_os(file_var).filter(|v| !v.is_empty()) {
            return Self::from_file(Path::new(&path)).map(Some);
        }
        Ok(std::env::var(token_var)
            .ok()
            .filter(|v| !v.trim().is_empty())
            .map(|v| Self::fixed(&v)))
    }

    /// The token to send now.
    pub fn token(&self) -> String {
        match self.source.as_ref() {
            CredentialSource::Fixed(token) => token.clone(),
            CredentialSource::File { path, current } => {
                let Ok(mut current) = current.lock() else {
                    return String::new();
                };
                if current.0.elapsed() >= CREDENTIAL_REREAD_EVERY {
                    match read_credential(path) {
                        Ok(token) => *current = (Instant::now(), token),
                        Err(error) => {
                            tracing::warn!(event = "credential_reread_failed", %error, "keeping the previous credential");
                            current.0 = Instant::now();
                        }
                    }
                }
                current.1.clone()
            }
        }
    }

    /// The `Authorization` header value.
    pub fn header_value(&self) -> String {
        format!("Bearer {}", self.token())
    }
}
