//! `auth.mode = "tokens"`: the tokens file, kept as digests and re-read when it changes.

use super::*;

/// `auth.tokens-file`: identities and the digests of their tokens, re-read when it changes.
pub(super) struct TokenTable(pub(super) Watched<Vec<([u8; 32], String)>>);

/// Parses `<identity> <token>` lines; `#` starts a comment. An identity may have several tokens
/// (rotation); a token may not belong to two identities.
pub fn parse_tokens_file(text: &str) -> Result<Vec<(String, String)>, String> {
    let mut entries: Vec<(String, String)> = Vec::new();
    for (number, identity, token) in pairs(text, "<identity> <token>")? {
        if identity.len() > 64 {
            return Err(format!(
                "line {number}: identity `{identity}` is longer than 64 characters (X-Owner-Id's limit)"
            ));
        }
        let whose = format!("the token of `{identity}`");
        crate::watch::check_secret(number, &whose, token, TOKEN_LEN_MIN)?;
        if entries.iter().any(|(_, t)| t == token) {
            return Err(format!(
                "line {number}: this token is already listed for another line; every token names one \
                 identity"
            ));
        }
        entries.push((identity.to_owned(), token.to_owned()));
    }
    Ok(entries)
}

/// The table of the tokens file at `paths[0]`; a file with no line is refused.
fn read_table(paths: &[PathBuf]) -> Result<Vec<([u8; 32], String)>, String> {
    let path = paths.first().map_or(Path::new(""), PathBuf::as_path);
    let text =
        std::fs::read_to_string(path).map_err(|e| format!("cannot read the tokens file: {e}"))?;
    let entries = parse_tokens_file(&text)?
        .into_iter()
        .map(|(identity, token)| (digest(&token), identity))
        .collect::<Vec<_>>();
    if entries.is_empty() {
        return Err("the tokens file lists no `<identity> <token>` line".into());
    }
    Ok(entries)
}

impl TokenTable {
    pub(super) fn load(path: &Path) -> Result<Self, String> {
        Watched::new(vec![path.to_owned()], TOKENS_RECHECK_EVERY, read_table).map(Self)
    }

    pub(super) fn maybe_reload(&self) {
        let file = self.0.path().display();
        match self.0.maybe_reload() {
            Reload::Unchanged => {}
            Reload::Reloaded => tracing::info!(
                event = "auth_tokens_reloaded",
                file = %file,
                tokens = self.0.read().map_or(0, |entries| entries.len()),
                "the tokens file changed and is now in force"
            ),
            Reload::Failed(error) => tracing::error!(
                event = "auth_tokens_reload_failed",
                file = %file,
                %error,
                "the tokens file changed but cannot be used; the previous tokens stay in force"
            ),
        }
    }

    pub(super) fn lookup(&self, token: &str) -> Option<String> {
        self.maybe_reload();
        let presented = digest(token);
        let entries = self.0.read()?;
        // Every entry is compared, so the time taken says nothing about which one matched.
        let mut found = None;
        for (candidate, identity) in entries.iter() {
            if bool::from(candidate.ct_eq(&presented)) {
                found = Some(identity.clone());
            }
        }
        found
    }
}
