//! Fencing-token proofs, the services' side (docs/design.md#d-8; the header and the lock key are
//! `dlock_contract::proof`): the lock server signs every grant with the first key of
//! `fencing.proof-keys-file`, and the enforcement points (payment resource, rail proxy) refuse a
//! token it did not sign. The MAC and the rotation of keys are described there.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use dlock_contract::error::{ApiError, ErrorCode};
use dlock_contract::proof::{KEYS_FILE_KEY, payout_lock_key, presented};
use http::HeaderMap;
use serde_json::json;
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use crate::config::{ConfigError, RawConfig};
use crate::watch::{Reload, Watched, pairs};

/// The key that lets a service run without proofs: `true`, by name, or the service does not start
/// without `fencing.proof-keys-file` (docs/threat-model.md#safe-defaults).
pub const INSECURE_NO_PROOFS_KEY: &str = "fencing.insecure-no-proofs";

/// The shortest secret accepted: an HMAC key that can be guessed proves nothing.
pub const SECRET_LEN_MIN: usize = 32;
/// The longest key id.
pub const KEY_ID_LEN_MAX: usize = 32;
/// How often the keys file is looked at for a change.
const RECHECK_EVERY: Duration = Duration::from_secs(2);
/// Domain separation: this MAC means "the lock server granted this token on this key" and
/// nothing else the same secret might one day be used for.
const DOMAIN: &[u8] = b"dlock fencing proof v1\n";

/// HMAC-SHA256 (RFC 2104) of `message` under `secret`.
pub fn hmac_sha256(secret: &[u8], message: &[u8]) -> [u8; 32] {
    const BLOCK: usize = 64;
    let mut block = [0u8; BLOCK];
    if secret.len() > BLOCK {
        block[..32].copy_from_slice(&Sha256::digest(secret));
    } else {
        block[..secret.len()].copy_from_slice(secret);
    }
    let mut inner = Sha256::new();
    inner.update(block.map(|b| b ^ 0x36));
    inner.update(message);
    let inner = inner.finalize();
    let mut outer = Sha256::new();
    outer.update(block.map(|b| b ^ 0x5c));
    outer.update(inner);
    outer.finalize().into()
}

/// The MAC of one grant: over the domain label, the key (length-prefixed, so no two (key, token)
/// pairs share a message) and the token.
pub fn grant_mac(secret: &[u8], lock_key: &str, token: i64) -> [u8; 32] {
    let mut message = Vec::with_capacity(DOMAIN.len() + 4 + lock_key.len() + 8);
    message.extend_from_slice(DOMAIN);
    message.extend_from_slice(&(lock_key.len() as u32).to_be_bytes());
    message.extend_from_slice(lock_key.as_bytes());
    message.extend_from_slice(&token.to_be_bytes());
    hmac_sha256(secret, &message)
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(text: &str) -> Option<[u8; 32]> {
    if text.len() != 64 {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, byte) in out.iter_mut().enumerate() {
        *byte = u8::from_str_radix(text.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(out)
}

fn key_id_is_valid(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= KEY_ID_LEN_MAX
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
}

/// Parses `<key-id> <secret>` lines; `#` starts a comment. The first line signs.
pub fn parse_keys_file(text: &str) -> Result<Keys, String> {
    let mut keys: Keys = Vec::new();
    for (number, id, secret) in pairs(text, "<key-id> <secret>")? {
        if !key_id_is_valid(id) {
            return Err(format!(
                "line {number}: the key id must be 1 to {KEY_ID_LEN_MAX} characters of [a-zA-Z0-9_-]"
            ));
        }
        let whose = format!("the secret of `{id}`");
        crate::watch::check_secret(number, &whose, secret, SECRET_LEN_MIN)?;
        if keys.iter().any(|(known, _)| known == id) {
            return Err(format!("line {number}: key id `{id}` is listed twice"));
        }
        keys.push((id.to_owned(), secret.as_bytes().to_vec()));
    }
    if keys.is_empty() {
        return Err("the proof keys file lists no `<key-id> <secret>` line".into());
    }
    Ok(keys)
}

/// Key ids and their secrets, the signing one first.
type Keys = Vec<(String, Vec<u8>)>;

/// The proof keys of one service: signs (lock server) and verifies (payment resource, rail
/// proxy). Cheap to clone.
#[derive(Clone)]
pub struct ProofKeys {
    inner: Arc<Source>,
}

enum Source {
    Fixed(Keys),
    File(Watched<Keys>),
}

impl std::fmt::Debug for ProofKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let file = match self.inner.as_ref() {
            Source::Fixed(_) => None,
            Source::File(watched) => Some(watched.path()),
        };
        let ids = self.with_keys(false, ids).unwrap_or_default();
        f.debug_struct("ProofKeys")
            .field("file", &file)
            .field("key_ids", &ids)
            .finish_non_exhaustive()
    }
}

fn ids(keys: &Keys) -> Vec<String> {
    keys.iter().map(|(id, _)| id.clone()).collect()
}

fn read_file(paths: &[PathBuf]) -> Result<Keys, String> {
    let path = paths.first().map_or(Path::new(""), PathBuf::as_path);
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read the proof keys file: {e}"))?;
    parse_keys_file(&text)
}

impl ProofKeys {
    /// `fencing.proof-keys-file`, read now (a wrong file stops the start). Unset, the service
    /// does not start unless `fencing.insecure-no-proofs = true` says so by name (`None`: no
    /// proofs); both set is refused too, as a configuration that contradicts itself.
    pub fn from_raw(raw: &mut RawConfig) -> Result<Option<Self>, ConfigError> {
        let path = raw.string_optional(KEYS_FILE_KEY)?;
        let insecure = raw.boolean(INSECURE_NO_PROOFS_KEY, false)?;
        let path = match (path, insecure) {
            (Some(path), false) => PathBuf::from(path),
            (None, true) => return Ok(None),
            (None, false) => {
                return Err(ConfigError {
                    key: KEYS_FILE_KEY.into(),
                    origin: String::new(),
                    message: format!(
                        "is not set, and this service does not start without fencing-token \
                         proofs: any authenticated caller could present a forged token that \
                         raises a fence for good. Set it to a file of `<key-id> <secret>` lines \
                         (`openssl rand -hex 32` makes a secret; the same file on the lock \
                         server, the payment resource and the rail proxy), or set \
                         {INSECURE_NO_PROOFS_KEY} = true in the configuration file to run without \
                         proofs, never with real money"
                    ),
                });
            }
            (Some(_), true) => {
                return Err(ConfigError {
                    key: INSECURE_NO_PROOFS_KEY.into(),
                    origin: String::new(),
                    message: format!(
                        "is true while {KEYS_FILE_KEY} is set: remove one (with the keys file, \
                         proofs are made and checked)"
                    ),
                });
            }
        };
        Self::load(&path).map(Some).map_err(|message| ConfigError {
            key: KEYS_FILE_KEY.into(),
            origin: format!(" ({})", path.display()),
            message,
        })
    }

    /// Reads a keys file; it is re-read when it changes.
    pub fn load(path: &Path) -> Result<Self, String> {
        let watched = Watched::new(vec![path.to_owned()], RECHECK_EVERY, read_file)?;
        Ok(Self {
            inner: Arc::new(Source::File(watched)),
        })
    }

    /// Fixed keys, for tests and tools (the text of a keys file).
    pub fn from_text(text: &str) -> Result<Self, String> {
        Ok(Self {
            inner: Arc::new(Source::Fixed(parse_keys_file(text)?)),
        })
    }

    /// `f` of the keys in force; a changed file is read first when `reload`.
    fn with_keys<R>(&self, reload: bool, f: impl FnOnce(&Keys) -> R) -> Option<R> {
        match self.inner.as_ref() {
            Source::Fixed(keys) => Some(f(keys)),
            Source::File(watched) => {
                if reload {
                    let file = watched.path().display();
                    match watched.maybe_reload() {
                        Reload::Unchanged => {}
                        Reload::Reloaded => tracing::info!(
                            event = "proof_keys_reloaded",
                            file = %file,
                            key_ids = ?watched.read().map(|keys| ids(&keys)),
                            "the proof keys file changed and is now in force (the first key signs)"
                        ),
                        Reload::Failed(error) => tracing::error!(
                            event = "proof_keys_reload_failed",
                            file = %file,
                            %error,
                            "the proof keys file changed but cannot be used; the previous keys \
                             stay in force"
                        ),
                    }
                }
                watched.read().map(|keys| f(&keys))
            }
        }
    }

    /// The key ids, the signing one first.
    pub fn key_ids(&self) -> Vec<String> {
        self.with_keys(true, ids).unwrap_or_default()
    }

    /// The proof of a grant of `token` on `lock_key`, with the first key: `<key-id>.<hex>`.
    pub fn sign(&self, lock_key: &str, token: i64) -> Option<String> {
        self.with_keys(true, |keys| {
            let (id, secret) = keys.first()?;
            Some(format!("{id}.{}", hex(&grant_mac(secret, lock_key, token))))
        })
        .flatten()
    }

    /// Whether `proof` proves a grant of `token` on `lock_key` under any listed key.
    pub fn verify(&self, lock_key: &str, token: i64, proof: &str) -> Result<(), &'static str> {
        self.with_keys(true, |keys| {
            let (id, mac) = proof
                .split_once('.')
                .ok_or("is not `<key-id>.<64 hex digits>`")?;
            let presented = unhex(mac).ok_or("is not `<key-id>.<64 hex digits>`")?;
            // Key ids are not secret; the MAC is compared in constant time.
            let (_, secret) = keys
                .iter()
                .find(|(known, _)| known == id)
                .ok_or("names a key this service does not have (rotated out, or never issued)")?;
            if bool::from(grant_mac(secret, lock_key, token).ct_eq(&presented)) {
                Ok(())
            } else {
                Err("does not prove this token on this lock key")
            }
        })
        .unwrap_or(Err("cannot be checked"))
    }

    /// The check of a protected write: the request's `X-Fencing-Proof` must prove `token` on
    /// `lock_key`, else `400 INVALID_TOKEN` (not retry-safe: the same request is refused again).
    pub fn require(&self, request: &HeaderMap, lock_key: &str, token: i64) -> Result<(), ApiError> {
        let proof = presented(request)?.ok_or_else(|| {
            refused(
                lock_key,
                token,
                "is missing: this service accepts only tokens the lock server signed",
            )
        })?;
        self.verify(lock_key, token, &proof).map_err(|why| {
            tracing::warn!(
                event = "fencing_proof_refused",
                lock_key,
                presented_token = token,
                reason = why,
                trace = %dlock_contract::trace::current_trace_id(),
                "a fencing token without a valid proof was refused before any fence moved"
            );
            refused(lock_key, token, why)
        })
    }
}

/// The operator's grant of a docs/design.md#d-8 recovery (a fence or high-water lowering) on
/// `payout:{account_id}`, checked after the operator check in the order every enforcement point
/// makes them: this service has proof keys, `X-Fencing-Token` is a token, the route's own `checks`
/// pass, and `X-Fencing-Proof` proves the token on the account's lock key. Answers the token and
/// what `checks` returned.
pub fn recovery_grant<T>(
    keys: Option<&ProofKeys>,
    headers: &HeaderMap,
    account_id: &str,
    checks: impl FnOnce() -> Result<T, ApiError>,
) -> Result<(i64, T), ApiError> {
    let keys = keys.ok_or_else(recovery_disabled)?;
    let token = dlock_contract::headers::fencing_token(headers)?;
    let checked = checks()?;
    keys.require(headers, &payout_lock_key(account_id), token)?;
    Ok((token, checked))
}

/// A recovery needs proofs: only a proven grant shows that nobody else holds the key.
fn recovery_disabled() -> ApiError {
    ApiError::new(
        ErrorCode::Forbidden,
        "lowering a fence needs fencing.proof-keys-file: only a proven grant of the operator on \
         the account's key shows that nobody else holds it; nothing was changed",
    )
}

/// `409 FENCED_OUT` of a recovery: the operator's grant `token` on `payout:{account_id}` is below
/// `seen`, a token the `resource_type` enforcement point already admitted with a proof. A recovery
/// lowers a fence to evidence, a proven grant at or above every token that was used, never under
/// it (docs/contract.md#fence-lower-floor); `refused` says what was refused, and the message goes
/// on with the remedy.
pub fn below_seen(
    resource_type: &str,
    account_id: &str,
    token: i64,
    seen: i64,
    owner_id: &str,
    refused: &str,
) -> ApiError {
    ApiError::fenced_out(
        &format!(
            "{refused} Lower it with a fresh grant on payout:{account_id} whose token is at least {seen} (after a restored lock store, move its token sequence past {seen} first)"
        ),
        &dlock_contract::error::FencedOutDetails {
            presented_token: token,
            highest_token: seen,
            resource_type: Some(resource_type.to_owned()),
            resource_id: account_id.to_owned(),
            owner_id: owner_id.to_owned(),
        },
    )
}

fn refused(lock_key: &str, token: i64, why: &str) -> ApiError {
    ApiError::new(
        ErrorCode::InvalidToken,
        format!("X-Fencing-Proof {why}; nothing was changed"),
    )
    .with_details(json!({ "lockKey": lock_key, "presentedToken": token }))
}
/// Logs, once at start, whether this service proves fencing tokens.
pub fn announce(keys: Option<&ProofKeys>, service: &str) {
    match keys {
        None => tracing::warn!(
            event = "fencing_tokens_unproven",
            service,
            "fencing.insecure-no-proofs is true: fencing tokens are not proven, and any \
             authenticated caller can present a forged token that raises a fence for good. Set \
             fencing.proof-keys-file instead (the same keys on the lock server, payment resource \
             and rail proxy) before this service moves real money"
        ),
        Some(keys) => tracing::info!(
            event = "fencing_tokens_proven",
            service,
            key_ids = ?keys.key_ids(),
            "fencing tokens must carry the lock server's proof (the first key signs)"
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;
    use std::time::SystemTime;

    const A: &str = "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa";
    const B: &str = "bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb";

    fn keys(text: &str) -> ProofKeys {
        ProofKeys::from_text(text).unwrap_or_else(|e| panic!("{e}"))
    }

    #[test]
    fn hmac_sha256_matches_rfc_4231() {
        // Test case 1 and test case 6 (a key longer than the block).
        let mac = hmac_sha256(&[0x0b; 20], b"Hi There");
        assert_eq!(
            hex(&mac),
            "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7"
        );
        let mac = hmac_sha256(
            &[0xaa; 131],
            b"Test Using Larger Than Block-Size Key - Hash Key First",
        );
        assert_eq!(
            hex(&mac),
            "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54"
        );
    }

    #[test]
    fn a_proof_is_bound_to_its_key_and_token() {
        let k = keys(&format!("k1 {A}\n"));
        let proof = k.sign("payout:a", 41).unwrap_or_default();
        assert!(proof.starts_with("k1."), "{proof}");
        assert_eq!(k.verify("payout:a", 41, &proof), Ok(()));
        assert!(k.verify("payout:b", 41, &proof).is_err());
        assert!(k.verify("payout:a", 42, &proof).is_err());
        assert!(k.verify("payout:a", i64::MAX, &proof).is_err());
        for bad in ["", "k1", "k1.", "k1.zz", "k2.00", &proof.to_uppercase()] {
            assert!(k.verify("payout:a", 41, bad).is_err(), "{bad}");
        }
        // Another secret under the same id proves nothing.
        let other = keys(&format!("k1 {B}\n"));
        assert!(other.verify("payout:a", 41, &proof).is_err());
    }

    #[test]
    fn the_first_key_signs_and_every_key_verifies() {
        let old_first = keys(&format!("old {A}\nnew {B}\n"));
        let new_first = keys(&format!("new {B}\nold {A}\n"));
        let by_new = new_first.sign("payout:x", 7).unwrap_or_default();
        let by_old = old_first.sign("payout:x", 7).unwrap_or_default();
        assert!(by_new.starts_with("new.") && by_old.starts_with("old."));
        for verifier in [&old_first, &new_first] {
            assert_eq!(verifier.verify("payout:x", 7, &by_new), Ok(()));
            assert_eq!(verifier.verify("payout:x", 7, &by_old), Ok(()));
        }
        let retired = keys(&format!("new {B}\n"));
        assert!(retired.verify("payout:x", 7, &by_old).is_err());
    }

    #[test]
    fn a_keys_file_is_checked_line_by_line() {
        assert!(parse_keys_file("").is_err());
        assert!(parse_keys_file("k short").is_err());
        assert!(parse_keys_file(&format!("k {A} extra")).is_err());
        assert!(
            parse_keys_file(&format!("k.1 {A}")).is_err(),
            "a dot splits the proof"
        );
        assert!(parse_keys_file(&format!("k {A}\nk {B}")).is_err());
        let parsed =
            parse_keys_file(&format!("# rotation\nk1 {A}\nk2 {B} # next\n")).unwrap_or_default();
        assert_eq!(parsed.len(), 2);
    }

    #[test]
    fn require_refuses_a_missing_repeated_or_wrong_proof_as_invalid_token() {
        let k = keys(&format!("k1 {A}\n"));
        let code = |h: &HeaderMap| k.require(h, "payout:a", 5).err().map(|e| e.code);
        let mut h = HeaderMap::new();
        assert_eq!(code(&h), Some(ErrorCode::InvalidToken));
        let good = k.sign("payout:a", 5).unwrap_or_default();
        h.insert(
            dlock_contract::headers::FENCING_PROOF,
            HeaderValue::from_str(&good).unwrap_or_else(|e| panic!("{e}")),
        );
        assert_eq!(code(&h), None);
        h.append(
            dlock_contract::headers::FENCING_PROOF,
            HeaderValue::from_str(&good).unwrap_or_else(|e| panic!("{e}")),
        );
        assert_eq!(code(&h), Some(ErrorCode::InvalidToken));
        let refused = k.require(&HeaderMap::new(), "payout:a", 5).err();
        assert_eq!(refused.map(|e| e.code.retry_safe()), Some(false));
    }

    /// Safe by default: no keys file and no `fencing.insecure-no-proofs = true` stops the start
    /// with what to do; the flag alone runs without proofs; both together are refused.
    #[test]
    fn proofs_are_off_only_by_name() {
        let from = |pairs: &[(&str, &str)]| {
            let pairs: Vec<(&str, String)> =
                pairs.iter().map(|(k, v)| (*k, (*v).to_owned())).collect();
            let mut raw = RawConfig::from_pairs(&pairs).unwrap_or_else(|e| panic!("{e}"));
            ProofKeys::from_raw(&mut raw).map(|keys| keys.is_some())
        };
        let refused = from(&[]).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(
            refused.contains("fencing.proof-keys-file")
                && refused.contains("does not start")
                && refused.contains("fencing.insecure-no-proofs = true"),
            "{refused}"
        );
        assert_eq!(from(&[("fencing.insecure-no-proofs", "false")]).ok(), None);
        assert_eq!(
            from(&[("fencing.insecure-no-proofs", "true")]).ok(),
            Some(false)
        );
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let file = dir.path().join("keys");
        std::fs::write(&file, format!("k1 {A}\n")).unwrap_or_else(|e| panic!("{e}"));
        let path = file.display().to_string();
        assert_eq!(from(&[("fencing.proof-keys-file", &path)]).ok(), Some(true));
        let both = from(&[
            ("fencing.proof-keys-file", &path),
            ("fencing.insecure-no-proofs", "true"),
        ]);
        assert_eq!(
            both.err().map(|e| e.key),
            Some("fencing.insecure-no-proofs".to_owned())
        );
    }

    #[test]
    fn a_changed_keys_file_takes_effect() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let file = dir.path().join("keys");
        std::fs::write(&file, format!("old {A}\n")).unwrap_or_else(|e| panic!("{e}"));
        let k = ProofKeys::load(&file).unwrap_or_else(|e| panic!("{e}"));
        std::fs::write(&file, format!("new {B}\nold {A}\n")).unwrap_or_else(|e| panic!("{e}"));
        std::fs::File::options()
            .write(true)
            .open(&file)
            .and_then(|f| f.set_modified(SystemTime::now() + Duration::from_secs(5)))
            .unwrap_or_else(|e| panic!("{e}"));
        if let Source::File(watched) = k.inner.as_ref() {
            watched.look_now();
        }
        assert!(
            k.sign("payout:a", 1)
                .unwrap_or_default()
                .starts_with("new.")
        );
    }
}
