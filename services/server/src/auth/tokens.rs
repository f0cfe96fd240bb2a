//! `auth.mode = "tokens"`: the tokens file, kept as digests and re-read when it changes.

use super::*;

/// `auth.tokens-file`: identities, the digests of their tokens and the roles their lines give,
/// re-read when it changes.
pub(super) struct TokenTable(pub(super) Watched<Vec<([u8; 32], String, Roles)>>);

/// One line of a tokens file: its number, identity, token and roles (none when the line has no
/// third column).
pub type TokenLine = (usize, String, String, Roles);

/// Parses `<identity> <token> [<role>[,<role>…]]` lines; `#` starts a comment. The third column
/// adds roles to those the `auth.<role>-identities` lists give
/// (docs/config.md#every-service-authentication). An identity may have several tokens
/// (rotation); a token may not belong to two identities.
pub fn parse_tokens_file(text: &str) -> Result<Vec<(String, String)>, String> {
    Ok(parse_token_lines(text)?
        .into_iter()
        .map(|(_, identity, token, _)| (identity, token))
        .collect())
}

/// [`parse_tokens_file`], with each line's number and roles.
pub fn parse_token_lines(text: &str) -> Result<Vec<TokenLine>, String> {
    let mut lines = Vec::new();
    for (number, line) in text.lines().enumerate() {
        let number = number + 1;
        let line = line.split('#').next().unwrap_or_default().trim();
        if line.is_empty() {
            continue;
        }
        let words: Vec<&str> = line.split_whitespace().collect();
        let (identity, token, roles) = match words[..] {
            [identity, token] => (identity, token, Roles::NONE),
            [identity, token, roles] => (
                identity,
                token,
                Roles::parse_list(roles).map_err(|e| format!("line {number}: the roles {e}"))?,
            ),
            _ => {
                return Err(format!(
                    "line {number}: expected `<identity> <token> [<role>[,<role>…]]`, two or three \
                     words"
                ));
            }
        };
        lines.push((number, identity, token, roles));
    }
    let mut entries: Vec<TokenLine> = Vec::new();
    for (number, identity, token, roles) in lines {
        if identity.len() > 64 {
            return Err(format!(
                "line {number}: identity `{identity}` is longer than 64 characters (X-Owner-Id's limit)"
            ));
        }
        let whose = format!("the token of `{identity}`");
        crate::watch::check_secret(number, &whose, token, TOKEN_LEN_MIN)?;
        if entries.iter().any(|(_, _, t, _)| t == token) {
            return Err(format!(
                "line {number}: this token is already listed for another line; every token names one \
                 identity"
            ));
        }
        entries.push((number, identity.to_owned(), token.to_owned(), roles));
    }
    Ok(entries)
}

/// The table of the tokens file at `paths[0]`; a file with no line is refused.
fn read_table(paths: &[PathBuf]) -> Result<Vec<([u8; 32], String, Roles)>, String> {
    let path = paths.first().map_or(Path::new(""), PathBuf::as_path);
    let text =
        std::fs::read_to_string(path).map_err(|e| format!("cannot read the tokens file: {e}"))?;
    let entries = parse_token_lines(&text)?
        .into_iter()
        .map(|(_, identity, token, roles)| (digest(&token), identity, roles))
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

    pub(super) fn lookup(&self, token: &str) -> Option<(String, Roles)> {
        self.maybe_reload();
        let presented = digest(token);
        let entries = self.0.read()?;
        // Every entry is compared, so the time taken says nothing about which one matched.
        let mut found = None;
        for (candidate, identity, roles) in entries.iter() {
            if bool::from(candidate.ct_eq(&presented)) {
                found = Some((identity.clone(), *roles));
            }
        }
        found
    }
}
