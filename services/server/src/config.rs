//! Service configuration: one TOML file plus environment overrides, validated whole at start.
//!
//! Keys are the contract's dotted names (`lock.session.ttl`). A key may be written flat
//! (`"lock.session.ttl" = 10000`) or nested (`[lock.session] ttl = 10000`). Its environment
//! override is `DLOCK_` followed by the key in upper case with dots and dashes as underscores
//! (`DLOCK_LOCK_SESSION_TTL`). A bad value, or a key the service does not know, stops the
//! service at start with a message that names the key: a typo in a money system's configuration
//! must not quietly fall back to a default.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::ops::RangeInclusive;
use std::path::{Path, PathBuf};

/// What every service reads alike and serves with: where it listens, the limits of a request,
/// TLS on the listener and who may call.
#[derive(Debug, Clone)]
pub struct Served {
    /// `server.listen`.
    pub listen: SocketAddr,
    /// `server.body-limit-bytes` and `server.request-timeout-ms`.
    pub http: crate::http::HttpLimits,
    /// `server.tls.*`: TLS on the listener when set.
    pub tls: Option<crate::tls::TlsSettings>,
    /// `auth.*`: who may call.
    pub auth: crate::auth::Authenticator,
}

impl Served {
    /// Reads `server.tls.*` for a service that listens on `listen` with `http` and `auth`.
    pub fn read(
        raw: &mut RawConfig,
        listen: SocketAddr,
        http: crate::http::HttpLimits,
        auth: crate::auth::Authenticator,
    ) -> Result<Self, ConfigError> {
        let tls = crate::tls::TlsSettings::from_raw(raw)?;
        Ok(Self {
            listen,
            http,
            tls,
            auth,
        })
    }

    /// Opens the listener on `server.listen`.
    pub async fn bind(&self) -> std::io::Result<tokio::net::TcpListener> {
        let listen = self.listen;
        tokio::net::TcpListener::bind(listen).await.map_err(|e| {
            std::io::Error::new(
                e.kind(),
                format!("cannot listen on {listen} (server.listen): {e}"),
            )
        })
    }

    /// A service's router: its `routes`, then `GET /readyz` and `GET /metrics` answered by
    /// `readyz` and `metrics`, then the tail of [`crate::http::service`] with this listener's
    /// credential check and limits.
    pub fn app<S, R, RT, M, MT>(
        &self,
        routes: axum::Router<S>,
        state: S,
        document: fn() -> utoipa::openapi::OpenApi,
        readyz: R,
        metrics: M,
    ) -> axum::Router
    where
        S: Clone + Send + Sync + 'static,
        R: axum::handler::Handler<RT, S>,
        M: axum::handler::Handler<MT, S>,
        RT: 'static,
        MT: 'static,
    {
        let routes = routes
            .route("/readyz", axum::routing::get(readyz))
            .route("/metrics", axum::routing::get(metrics));
        crate::http::service(routes, state, document, &self.auth, self.http)
    }

    /// Says once what `service` checks (see [`crate::announce`]), then serves `app` on
    /// `listener`, over TLS when configured, until SIGINT or SIGTERM; then drains in-flight
    /// requests and stops the service's background `sweeper`.
    pub async fn serve(
        &self,
        service: &str,
        proof_keys: Option<&crate::proof::ProofKeys>,
        listener: tokio::net::TcpListener,
        app: axum::Router,
        sweeper: tokio::task::JoinHandle<()>,
    ) -> std::io::Result<()> {
        crate::announce(service, &self.auth, proof_keys);
        crate::http::serve_until_signal(listener, self.tls.as_ref(), app).await?;
        sweeper.abort();
        Ok(())
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("configuration key `{key}`{origin}: {message}")]
pub struct ConfigError {
    pub key: String,
    pub origin: String,
    pub message: String,
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

/// The environment variable that overrides `key`.
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

/// Reads a whole service configuration: `file` and the environment through `from_raw`, then
/// refuses any key in the file that `from_raw` did not ask for.
pub fn load<T>(
    file: Option<&Path>,
    from_raw: impl FnOnce(&mut RawConfig) -> Result<T, ConfigError>,
) -> Result<T, ConfigError> {
    let mut raw = RawConfig::load(file)?;
    let config = from_raw(&mut raw)?;
    raw.finish()?;
    Ok(config)
}

impl RawConfig {
    /// Reads `file` (when given) and the process environment.
    pub fn load(file: Option<&Path>) -> Result<Self, ConfigError> {
        Self::from_parts(file, std::env::vars().collect())
    }

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

    /// Configuration given as `(key, value)` pairs, as if each came from its environment
    /// variable: for embedding a service in a test or a benchmark without a file.
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
