//! `auth.mode = "tokens"`: the tokens file, kept as digests and re-read when it changes.

use super::*;

/// `auth.tokens-file`: identities and the digests of their tokens.
pub(super) struct TokenTable {
    pub(super) path: PathBuf,
    pub(super) state: RwLock<TableState>,
    pub(super) checked: Mutex<Instant>,
}

pub(super) struct TableState {
    pub(super) modified: Option<SystemTime>,
    pub(super) entries: Vec<([u8; 32], String)>,
}

/// Parses `<identity> <token>` lines; `#` starts a comment. An identity may have several tokens
/// (rotation); a token may not belong to two identities.
pub fn parse_tokens_file(text: &str) -> Result<Vec<(String, String)>, String> {
    let mut entries: Vec<(String, String)> = Vec::new();
    for (number, line) in text.lines().enumerate() {
        let line = line.split('#').next().unwrap_or_default().trim();
        if line.is_empty() {
            continue;
        }
        let mut parts = line.split_whitespace();
        let (Some(identity), Some(token), None) = (parts.next(), parts.next(), parts.next()) else {
            return Err(format!(
                "line {}: expected `<identity> <token>`, two words",
                number + 1
            ));
        };
        if identity.len() > 64 {
            return Err(format!(
                "line {}: identity `{identity}` is longer than 64 characters (X-Owner-Id's limit)",
                number + 1
            ));
        }
        if token.len() < TOKEN_LEN_MIN || !token.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(format!(
                "line {}: the token of `{identity}` must be at least {TOKEN_LEN_MIN} printable \
                 characters (e.g. `openssl rand -hex 32`)",
                number + 1
            ));
        }
        if entries.iter().any(|(_, t)| t == token) {
            return Err(format!(
                "line {}: this token is already listed for another line; every token names one \
                 identity",
                number + 1
            ));
        }
        entries.push((identity.to_owned(), token.to_owned()));
    }
    Ok(entries)
}

impl TokenTable {
    pub(super) fn read(path: &Path) -> Result<TableState, String> {
        let modified = std::fs::metadata(path).and_then(|m| m.modified()).ok();
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("cannot read the tokens file: {e}"))?;
        let entries = parse_tokens_file(&text)?
            .into_iter()
            .map(|(identity, token)| (digest(&token), identity))
            .collect::<Vec<_>>();
        if entries.is_empty() {
            return Err("the tokens file lists no `<identity> <token>` line".into());
        }
        Ok(TableState { modified, entries })
    }

    pub(super) fn load(path: &Path) -> Result<Self, String> {
        Ok(Self {
            path: path.to_owned(),
            state: RwLock::new(Self::read(path)?),
            checked: Mutex::new(Instant::now()),
        })
    }

    pub(super) fn maybe_reload(&self) {
        {
            let Ok(mut checked) = self.checked.lock() else {
                return;
            };
            if checked.elapsed() < TOKENS_RECHECK_EVERY {
                return;
            }
            *checked = Instant::now();
        }
        let modified = std::fs::metadata(&self.path)
            .and_then(|m| m.modified())
            .ok();
        let unchanged = self
            .state
            .read()
            .map(|s| s.modified == modified)
            .unwrap_or(true);
        if unchanged {
            return;
        }
        match Self::read(&self.path) {
            Ok(state) => {
                let identities = state.entries.len();
                if let Ok(mut current) = self.state.write() {
                    *current = state;
                }
                tracing::info!(
                    event = "auth_tokens_reloaded",
                    file = %self.path.display(),
                    tokens = identities,
                    "the tokens file changed and is now in force"
                );
            }
            Err(error) => tracing::error!(
                event = "auth_tokens_reload_failed",
                file = %self.path.display(),
                %error,
                "the tokens file changed but cannot be used; the previous tokens stay in force"
            ),
        }
    }

    pub(super) fn lookup(&self, token: &str) -> Option<String> {
        self.maybe_reload();
        let presented = digest(token);
        let state = self.state.read().ok()?;
        // Every entry is compared, so the time taken says nothing about which one matched.
        let mut found = None;
        for (candidate, identity) in &state.entries {
            if bool::from(candidate.ct_eq(&presented)) {
                found = Some(identity.clone());
            }
        }
        found
    }
}
