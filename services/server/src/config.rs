//! Service configuration: one TOML file, validated whole at start, and files mounted from
//! Secrets that the file names.
//!
//! Keys are the contract's dotted names (`lock.session.ttl`). A key may be written flat
//! (`"lock.session.ttl" = 10000`) or nested (`[lock.session] ttl = 10000`). A bad value, or a key
//! the service does not know, stops the service at start with a message that names the key: a
//! typo in a money system's configuration must not quietly fall back to a default.
//!
//! A service never takes its configuration from the environment. Whoever can change a pod's
//! environment (a ConfigMap injected into it, say) could otherwise turn authentication off,
//! empty the proof keys or point the service at another rail. The process path ([`load`])
//! refuses to start when the environment names a key the service reads (`DLOCK_` and the key in
//! upper case, dots and dashes as underscores: `DLOCK_AUTH_MODE`), anything under the security
//! sections ([`SECURITY_SECTIONS`]), or a variable the service's clients would obey
//! ([`PROCESS_SECURITY_ENV`]); only [`ENVIRONMENT_ALLOWED`] (observability) is taken. A secret
//! value (a database URL with its password, an operator token) comes from a file mounted from a
//! Secret, named by the key's `-file` form ([`RawConfig::secret`]). [`RawConfig::from_pairs`] and
//! [`RawConfig::from_parts`] still read overrides given to them: a test's convenience, never
//! the process's environment.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::ops::RangeInclusive;
use std::path::{Path, PathBuf};

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("configuration key `{key}`{origin}: {message}")]
pub struct ConfigError {
    pub key: String,
    pub origin: String,
    pub message: String,
}

impl ConfigError {
    /// An error of `key` found after reading it (a check across keys, a file it names): no
    /// origin.
    pub fn new(key: &str, message: impl Into<String>) -> Self {
        Self {
            key: key.into(),
            origin: String::new(),
            message: message.into(),
        }
    }
}

#[derive(Debug, Clone)]
enum Origin {
    File(PathBuf),
    Env(String),
}

#[derive(Debug)]
pub struct RawConfig {
    file_values: BTreeMap<String, toml::Value>,
    file: Option<PathBuf>,
    used: BTreeSet<String>,
    env: BTreeMap<String, String>,
}

/// The only `DLOCK_*` environment variables a service obeys: how much it logs and in which
/// format (read by the telemetry set-up, never by the configuration). The `OTEL_*` variables of
/// the trace exporter are not `DLOCK_*` and are read as OpenTelemetry defines them. No
/// configuration key is on this list: every key a service reads changes who may call, what is
/// fenced, where money goes or whether the service stays up, so it belongs in the file.
pub const ENVIRONMENT_ALLOWED: [&str; 2] = ["DLOCK_LOG", "DLOCK_LOG_FORMAT"];

/// Sections whose every key is a security setting: who may call (`auth.*`), the fencing-token
/// proofs (`fencing.*`) and the listener with its TLS (`server.*`). A `DLOCK_AUTH_…`,
/// `DLOCK_FENCING_…` or `DLOCK_SERVER_…` variable is refused even when this service, as
/// configured, would not read that key.
pub const SECURITY_SECTIONS: [&str; 3] = ["auth", "fencing", "server"];

/// Variables outside the configuration that the clients inside a service would obey: the
/// address map that redirects every service URL ([`dlock_contract::address_map::ENV`]) and the
/// CA bundle trusted for `https://` services.
pub const PROCESS_SECURITY_ENV: [&str; 2] = [dlock_contract::address_map::ENV, "DLOCK_CA_FILE"];

/// The first variable of `env` a service must refuse, given the keys it `used`: see
/// [`ENVIRONMENT_ALLOWED`], [`SECURITY_SECTIONS`] and [`PROCESS_SECURITY_ENV`].
pub fn refused_variable<'a>(
    used: &BTreeSet<String>,
    env: impl IntoIterator<Item = &'a str>,
) -> Option<ConfigError> {
    let sections: Vec<String> = SECURITY_SECTIONS
        .iter()
        .map(|section| format!("{}_", env_name(section)))
        .collect();
    env.into_iter().find_map(|name| {
        if !name.starts_with("DLOCK_") || ENVIRONMENT_ALLOWED.contains(&name) {
            return None;
        }
        let key = used.iter().find(|key| env_name(key) == name);
        let what = if let Some(key) = key {
            format!("would set `{key}`")
        } else if sections
            .iter()
            .any(|prefix| name.starts_with(prefix.as_str()))
        {
            "would set a key of an auth, fencing or server section".to_owned()
        } else if PROCESS_SECURITY_ENV.contains(&name) {
            "would redirect or re-trust the service's own calls".to_owned()
        } else {
            return None;
        };
        Some(ConfigError {
            key: name.to_owned(),
            origin: " (an environment variable)".to_owned(),
            message: format!(
                "{what}, and a service takes no security setting from its environment (whoever \
                 can change a pod's environment could turn authentication off or redirect \
                 money). Set it in the configuration file (--config), a secret value such as a \
                 database URL in a file mounted from a Secret that the key's -file form names, \
                 and unset {name}. Only {} and OTEL_* are read from the environment \
                 (docs/config.md#the-environment)",
                ENVIRONMENT_ALLOWED.join(", ")
            ),
        })
    })
}

/// The environment variable that would override `key` under [`RawConfig::from_pairs`], and
/// that [`load`] refuses.
pub fn env_name(key: &str) -> String {
    let mut name = String::from("DLOCK_");
    name.extend(key.chars().map(|c| match c {
        '.' | '-' => '_',
        c => c.to_ascii_uppercase(),
    }));
    name
}

fn flatten(prefix: &str, table: &toml::Table, out: &mut BTreeMap<String, toml::Value>) {
    for (name, value) in table {
        let key = if prefix.is_empty() {
            name.clone()
        } else {
            format!("{prefix}.{name}")
        };
        match value {
            toml::Value::Table(inner) => flatten(&key, inner, out),
            other => {
                out.insert(key, other.clone());
            }
        }
    }
}

/// Reads a whole service configuration from `file` through `from_raw`, then refuses a
/// security setting in the process's environment ([`refused_variable`]) and any key in the file
/// that `from_raw` did not ask for.
pub fn load<T>(
    file: Option<&Path>,
    from_raw: impl FnOnce(&mut RawConfig) -> Result<T, ConfigError>,
) -> Result<T, ConfigError> {
    let env: Vec<String> = std::env::vars_os()
        .filter_map(|(name, _)| name.into_string().ok())
        .collect();
    load_with_env(file, env.iter().map(String::as_str), from_raw)
}

/// [`load`] with the names of the environment's variables given.
pub fn load_with_env<'a, T>(
    file: Option<&Path>,
    env: impl IntoIterator<Item = &'a str>,
    from_raw: impl FnOnce(&mut RawConfig) -> Result<T, ConfigError>,
) -> Result<T, ConfigError> {
    let mut raw = RawConfig::from_parts(file, BTreeMap::new())?;
    let config = from_raw(&mut raw);
    // Refused before any other error: the variable is what must change first, and a `from_raw`
    // that stopped early still read the keys before the one it stopped at.
    if let Some(refused) = refused_variable(&raw.used, env) {
        return Err(refused);
    }
    let config = config?;
    raw.finish()?;
    Ok(config)
}

impl RawConfig {
    /// Reads `file` and the given environment; tests pass their own.
    pub fn from_parts(
        file: Option<&Path>,
        env: BTreeMap<String, String>,
    ) -> Result<Self, ConfigError> {
        let mut file_values = BTreeMap::new();
        if let Some(path) = file {
            let text = std::fs::read_to_string(path).map_err(|e| ConfigError {
                key: "(file)".into(),
                origin: format!(" in {}", path.display()),
                message: format!("cannot read the configuration file: {e}"),
            })?;
            let table: toml::Table = text.parse().map_err(|e| ConfigError {
                key: "(file)".into(),
                origin: format!(" in {}", path.display()),
                message: format!("not valid TOML: {e}"),
            })?;
            flatten("", &table, &mut file_values);
        }
        Ok(Self {
            file_values,
            file: file.map(Path::to_path_buf),
            used: BTreeSet::new(),
            env,
        })
    }

    /// Configuration given as `(key, value)` pairs, as overrides: for embedding a service in a
    /// test or a benchmark without a file. A `dlock serve` process never reads these ([`load`]).
    pub fn from_pairs(pairs: &[(&str, String)]) -> Result<Self, ConfigError> {
        let env = pairs
            .iter()
            .map(|(key, value)| (env_name(key), value.clone()))
            .collect();
        Self::from_parts(None, env)
    }

    fn lookup(&mut self, key: &str) -> Option<(toml::Value, Origin)> {
        self.used.insert(key.to_owned());
        let env_key = env_name(key);
        if let Some(text) = self.env.get(&env_key) {
            return Some((toml::Value::String(text.clone()), Origin::Env(env_key)));
        }
        let file = self.file.clone().unwrap_or_default();
        self.file_values
            .get(key)
            .cloned()
            .map(|v| (v, Origin::File(file)))
    }

    fn error(key: &str, origin: &Origin, message: impl Into<String>) -> ConfigError {
        ConfigError {
            key: key.to_owned(),
            origin: match origin {
                Origin::File(path) => format!(" in {}", path.display()),
                Origin::Env(name) => format!(" (environment {name})"),
            },
            message: message.into(),
        }
    }

    /// A string value.
    pub fn string(&mut self, key: &str, default: &str) -> Result<String, ConfigError> {
        match self.lookup(key) {
            None => Ok(default.to_owned()),
            Some((toml::Value::String(s), _)) => Ok(s),
            Some((other, origin)) => Err(Self::error(
                key,
                &origin,
                format!("must be a string, got {other}"),
            )),
        }
    }

    /// A secret string: the value of `key`, or the contents of the file its `-file` form names
    /// (`payment.pg.url-file`: a file mounted from a Secret; a trailing newline is dropped).
    /// Empty counts as absent; both forms set is refused.
    pub fn secret(&mut self, key: &str) -> Result<Option<String>, ConfigError> {
        let file_key = format!("{key}-file");
        let value = self.string_optional(key)?;
        let file = self.string_optional(&file_key)?;
        match (value, file) {
            (Some(_), Some(_)) => Err(ConfigError {
                key: key.to_owned(),
                origin: String::new(),
                message: format!("and `{file_key}` are both set; keep one"),
            }),
            (value, None) => Ok(value),
            (None, Some(path)) => {
                let text = std::fs::read_to_string(&path).map_err(|e| ConfigError {
                    key: file_key.clone(),
                    origin: String::new(),
                    message: format!("cannot read {path}: {e}"),
                })?;
                let text = text.strip_suffix('\n').unwrap_or(&text);
                let text = text.strip_suffix('\r').unwrap_or(text);
                if text.is_empty() {
                    return Err(ConfigError {
                        key: file_key,
                        origin: String::new(),
                        message: format!("{path} is empty"),
                    });
                }
                Ok(Some(text.to_owned()))
            }
        }
    }

    /// An optional string value; empty counts as absent.
    pub fn string_optional(&mut self, key: &str) -> Result<Option<String>, ConfigError> {
        let value = self.string(key, "")?;
        Ok((!value.is_empty()).then_some(value))
    }

    /// A string that must be set; `example` shows what one looks like.
    pub fn string_required(&mut self, key: &str, example: &str) -> Result<String, ConfigError> {
        self.string_optional(key)?.ok_or_else(|| ConfigError {
            key: key.into(),
            origin: String::new(),
            message: format!("is required ({example})"),
        })
    }

    /// A socket address (`127.0.0.1:7070`), `default` when unset.
    pub fn socket_addr(&mut self, key: &str, default: &str) -> Result<SocketAddr, ConfigError> {
        let text = self.string(key, default)?;
        text.parse().map_err(|e| ConfigError {
            key: key.into(),
            origin: String::new(),
            message: format!("must be an address like {default}, got {text:?}: {e}"),
        })
    }

    /// A list of strings: a TOML array, or a comma-separated string (the environment's form).
    pub fn string_list(&mut self, key: &str, default: &[&str]) -> Result<Vec<String>, ConfigError> {
        match self.lookup(key) {
            None => Ok(default.iter().map(|s| (*s).to_owned()).collect()),
            Some((toml::Value::String(s), _)) => Ok(s
                .split(',')
                .map(str::trim)
                .filter(|s| !s.is_empty())
                .map(str::to_owned)
                .collect()),
            Some((toml::Value::Array(items), origin)) => items
                .into_iter()
                .map(|item| match item {
                    toml::Value::String(s) => Ok(s),
                    other => Err(Self::error(
                        key,
                        &origin,
                        format!("every item must be a string, got {other}"),
                    )),
                })
                .collect(),
            Some((other, origin)) => Err(Self::error(
                key,
                &origin,
                format!("must be a list of strings, got {other}"),
            )),
        }
    }

    /// An integer within `range`.
    pub fn integer(
        &mut self,
        key: &str,
        default: i64,
        range: RangeInclusive<i64>,
    ) -> Result<i64, ConfigError> {
        self.number(key, default, range, "an integer", |value| match value {
            toml::Value::Integer(n) => Some(*n),
            toml::Value::String(s) => s.trim().parse::<i64>().ok(),
            _ => None,
        })
    }

    /// A duration in milliseconds within `range` (a key ending in `-ms`).
    pub fn millis(
        &mut self,
        key: &str,
        default: i64,
        range: RangeInclusive<i64>,
    ) -> Result<std::time::Duration, ConfigError> {
        let ms = self.integer(key, default, range)?;
        Ok(std::time::Duration::from_millis(ms.max(0) as u64))
    }

    /// A decimal number within `range`.
    pub fn decimal(
        &mut self,
        key: &str,
        default: f64,
        range: RangeInclusive<f64>,
    ) -> Result<f64, ConfigError> {
        // A finite range leaves infinities and NaN out of it.
        debug_assert!(range.start().is_finite() && range.end().is_finite());
        self.number(key, default, range, "a number", |value| match value {
            toml::Value::Float(f) => Some(*f),
            toml::Value::Integer(n) => Some(*n as f64),
            toml::Value::String(s) => s.trim().parse::<f64>().ok(),
            _ => None,
        })
    }

    /// A number read by `parse` (none: not `kind`), within `range`.
    fn number<T: PartialOrd + std::fmt::Display>(
        &mut self,
        key: &str,
        default: T,
        range: RangeInclusive<T>,
        kind: &str,
        parse: impl Fn(&toml::Value) -> Option<T>,
    ) -> Result<T, ConfigError> {
        let Some((value, origin)) = self.lookup(key) else {
            return Ok(default);
        };
        let message = match parse(&value) {
            Some(n) if range.contains(&n) => return Ok(n),
            Some(n) => format!(
                "must be between {} and {}, got {n}",
                range.start(),
                range.end()
            ),
            None => format!("must be {kind}, got {value}"),
        };
        Err(Self::error(key, &origin, message))
    }

    /// A boolean: TOML `true`/`false`, or the strings `true`/`false` from the environment.
    pub fn boolean(&mut self, key: &str, default: bool) -> Result<bool, ConfigError> {
        match self.lookup(key) {
            None => Ok(default),
            Some((toml::Value::Boolean(b), _)) => Ok(b),
            Some((toml::Value::String(s), origin)) => match s.trim() {
                "true" => Ok(true),
                "false" => Ok(false),
                other => Err(Self::error(
                    key,
                    &origin,
                    format!("must be true or false, got {other:?}"),
                )),
            },
            Some((other, origin)) => Err(Self::error(
                key,
                &origin,
                format!("must be true or false, got {other}"),
            )),
        }
    }

    /// One of a fixed set of words.
    pub fn choice(
        &mut self,
        key: &str,
        default: &str,
        allowed: &[&str],
    ) -> Result<String, ConfigError> {
        let origin = self.lookup(key).map(|(_, o)| o);
        let value = self.string(key, default)?;
        if allowed.contains(&value.as_str()) {
            Ok(value)
        } else {
            Err(Self::error(
                key,
                &origin.unwrap_or(Origin::Env(env_name(key))),
                format!("must be one of {}, got {value:?}", allowed.join(", ")),
            ))
        }
    }

    /// Fails on any key in the file that no getter asked for: a misspelt key is an error, not
    /// a silent default.
    pub fn finish(self) -> Result<(), ConfigError> {
        let unknown: Vec<&String> = self
            .file_values
            .keys()
            .filter(|k| !self.used.contains(*k))
            .collect();
        match unknown.first() {
            None => Ok(()),
            Some(first) => Err(ConfigError {
                key: (*first).clone(),
                origin: format!(" in {}", self.file.clone().unwrap_or_default().display()),
                message: format!(
                    "is not a key this service knows{}",
                    if unknown.len() > 1 {
                        format!(" (nor are {} other keys)", unknown.len() - 1)
                    } else {
                        String::new()
                    }
                ),
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(toml: &str, env: &[(&str, &str)]) -> RawConfig {
        let dir = std::env::temp_dir().join(format!("dlock-config-{}", uuid::Uuid::new_v4()));
        let _ = std::fs::create_dir_all(&dir);
        let path = dir.join("c.toml");
        let _ = std::fs::write(&path, toml);
        let env = env
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        let raw = RawConfig::from_parts(Some(&path), env);
        let _ = std::fs::remove_dir_all(&dir);
        raw.unwrap_or_else(|e| panic!("{e}"))
    }

    #[test]
    fn nested_and_flat_keys_read_alike_and_env_overrides() {
        let mut c = config(
            "\"lock.default.ttl\" = 7000\n[lock.session]\nttl = 5000\n",
            &[],
        );
        assert_eq!(c.integer("lock.session.ttl", 1, 1..=60_000), Ok(5000));
        assert_eq!(c.integer("lock.default.ttl", 1, 1..=60_000), Ok(7000));
        let mut c = config(
            "[lock.session]\nttl = 5000\n",
            &[("DLOCK_LOCK_SESSION_TTL", "9000")],
        );
        assert_eq!(c.integer("lock.session.ttl", 1, 1..=60_000), Ok(9000));
    }

    fn used(keys: &[&str]) -> BTreeSet<String> {
        keys.iter().map(|k| (*k).to_owned()).collect()
    }

    #[test]
    fn the_environment_may_set_only_what_is_harmless() {
        let used = used(&["auth.mode", "lock.pg.url", "rail.proxy.rail-url"]);
        for (name, named) in [
            ("DLOCK_AUTH_MODE", "auth.mode"),
            ("DLOCK_LOCK_PG_URL", "lock.pg.url"),
            ("DLOCK_RAIL_PROXY_RAIL_URL", "rail.proxy.rail-url"),
            (
                "DLOCK_FENCING_PROOF_KEYS_FILE",
                "DLOCK_FENCING_PROOF_KEYS_FILE",
            ),
            ("DLOCK_AUTH_TOKENREVIEW_URL", "DLOCK_AUTH_TOKENREVIEW_URL"),
            ("DLOCK_SERVICE_ADDRESSES", "DLOCK_SERVICE_ADDRESSES"),
            ("DLOCK_CA_FILE", "DLOCK_CA_FILE"),
        ] {
            let refused = refused_variable(&used, ["PATH", name]).map(|e| e.to_string());
            assert!(
                refused
                    .as_deref()
                    .is_some_and(|e| e.contains(name) && e.contains(named)),
                "{name}: {refused:?}"
            );
        }
        // Observability, other programs' variables and keys of other services pass.
        let env = [
            "DLOCK_LOG",
            "DLOCK_LOG_FORMAT",
            "OTEL_EXPORTER_OTLP_ENDPOINT",
            "DLOCK_PG_BIN",
            "DLOCK_PAYMENT_PG_URL",
        ];
        assert_eq!(refused_variable(&used, env), None);
    }

    #[test]
    fn a_secret_comes_from_its_value_or_the_file_its_file_form_names() {
        let dir = std::env::temp_dir().join(format!("dlock-secret-{}", uuid::Uuid::new_v4()));
        let _ = std::fs::create_dir_all(&dir);
        let path = dir.join("url");
        let _ = std::fs::write(&path, "postgres://u:p@db/paydb\n");
        let file = format!(
            "\"payment.pg.url-file\" = {:?}\n",
            path.display().to_string()
        );
        let mut c = config(&file, &[]);
        assert_eq!(
            c.secret("payment.pg.url"),
            Ok(Some("postgres://u:p@db/paydb".to_owned()))
        );
        assert!(c.finish().is_ok());
        let both = format!("{file}\"payment.pg.url\" = \"postgres://x\"\n");
        let err = config(&both, &[]).secret("payment.pg.url").err();
        assert_eq!(err.map(|e| e.key), Some("payment.pg.url".to_owned()));
        let _ = std::fs::write(&path, "");
        let err = config(&file, &[]).secret("payment.pg.url").err();
        assert_eq!(err.map(|e| e.key), Some("payment.pg.url-file".to_owned()));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn bad_values_and_unknown_keys_name_the_key() {
        let mut c = config("[lock.session]\nttl = 500000\n", &[]);
        let err = c.integer("lock.session.ttl", 1, 1..=60_000).err();
        assert_eq!(err.map(|e| e.key), Some("lock.session.ttl".to_owned()));
        let mut c = config("[lock]\nbakend = \"pg\"\n", &[]);
        let _ = c.string("lock.backend", "pg");
        assert_eq!(
            c.finish().err().map(|e| e.key),
            Some("lock.bakend".to_owned())
        );
        let mut c = config("", &[("DLOCK_LOCK_BACKEND", "redis")]);
        let err = c.choice("lock.backend", "pg", &["pg", "etcd"]).err();
        assert!(err.is_some_and(|e| e.to_string().contains("DLOCK_LOCK_BACKEND")));
    }
}
