//! The services' configuration as typed structs, for the operator, which writes a ConfigMap per
//! workload. (The local and test stacks, `dlock_devstack::stack`, write the dotted keys
//! themselves, since a test may set or override any key a service reads.) [`to_toml`] writes a
//! struct as the flat dotted keys that `config::RawConfig` reads (`"server.listen" =
//! "0.0.0.0:8080"`), in field order, leaving out what is absent.
//!
//! Only the keys the operator sets are here; a service reads many more (with defaults).

use serde::Serialize;

/// Writes one service's configuration as TOML, one `"dotted.key" = value` line a key. Every
/// field is a string, a number or a list of strings under a flat key, which TOML always holds.
pub fn to_toml<T: Serialize>(config: &T) -> Result<String, toml::ser::Error> {
    toml::to_string(config)
}

/// `server.*`: where the service listens.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Server {
    #[serde(rename = "server.listen")]
    pub listen: String,
}

/// How a service authenticates its callers (`auth.mode`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum AuthMode {
    None,
    Tokens,
    TokenReview,
}

/// `auth.*`: callers' authentication.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Auth {
    #[serde(rename = "auth.mode")]
    pub mode: AuthMode,
    /// With `tokens`: the file of `<token> <identity>` lines.
    #[serde(rename = "auth.tokens-file", skip_serializing_if = "Option::is_none")]
    pub tokens_file: Option<String>,
    /// With `tokenreview`: the audiences a token must carry.
    #[serde(
        rename = "auth.tokenreview.audiences",
        skip_serializing_if = "Vec::is_empty"
    )]
    pub tokenreview_audiences: Vec<String>,
    /// The identities allowed the operator-only calls.
    #[serde(
        rename = "auth.operator-identities",
        skip_serializing_if = "Vec::is_empty"
    )]
    pub operator_identities: Vec<String>,
    /// The identities allowed to open and fund accounts (the payment resource's treasury role).
    #[serde(
        rename = "auth.treasury-identities",
        skip_serializing_if = "Vec::is_empty"
    )]
    pub treasury_identities: Vec<String>,
    /// With `tokenreview`: the ServiceAccount allow-list, `<namespace>/<name>=<role>[+<role>…]`
    /// (docs/contract.md#roles). A ServiceAccount named nowhere holds no role.
    #[serde(
        rename = "auth.tokenreview.service-accounts",
        skip_serializing_if = "Vec::is_empty"
    )]
    pub service_accounts: Vec<String>,
}

impl Auth {
    /// `auth.mode = "none"` and nothing else.
    pub fn none() -> Self {
        Self {
            mode: AuthMode::None,
            tokens_file: None,
            tokenreview_audiences: Vec::new(),
            operator_identities: Vec::new(),
            treasury_identities: Vec::new(),
            service_accounts: Vec::new(),
        }
    }
}

/// `fencing.*`: the fencing-token proof keys (docs/design.md#d-8).
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Fencing {
    /// The same key as [`crate::proof::KEYS_FILE_KEY`].
    #[serde(
        rename = "fencing.proof-keys-file",
        skip_serializing_if = "Option::is_none"
    )]
    pub proof_keys_file: Option<String>,
}

/// `lock.backend`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum LockBackend {
    Pg,
    Etcd,
}

/// The lock server's configuration.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct LockServer {
    #[serde(flatten)]
    pub server: Server,
    #[serde(rename = "lock.backend")]
    pub backend: LockBackend,
    #[serde(rename = "lock.pg.url", skip_serializing_if = "Option::is_none")]
    pub pg_url: Option<String>,
    #[serde(rename = "lock.etcd.endpoints", skip_serializing_if = "Vec::is_empty")]
    pub etcd_endpoints: Vec<String>,
    #[serde(flatten)]
    pub etcd_tls: Option<EtcdTls>,
    #[serde(flatten)]
    pub etcd_auth: Option<EtcdAuth>,
    #[serde(flatten)]
    pub auth: Auth,
    #[serde(flatten)]
    pub fencing: Fencing,
}

/// `lock.etcd.ca-file`, `cert-file` and `key-file`: TLS to etcd with a client certificate.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct EtcdTls {
    #[serde(rename = "lock.etcd.ca-file")]
    pub ca_file: String,
    #[serde(rename = "lock.etcd.cert-file")]
    pub cert_file: String,
    #[serde(rename = "lock.etcd.key-file")]
    pub key_file: String,
}

/// `lock.etcd.username` and `password-file`: etcd's own authentication.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct EtcdAuth {
    #[serde(rename = "lock.etcd.username")]
    pub username: String,
    #[serde(rename = "lock.etcd.password-file")]
    pub password_file: String,
}

/// The payment resource's configuration.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct PaymentResource {
    #[serde(flatten)]
    pub server: Server,
    /// Absent where the URL is a file mounted from a Secret (`payment.pg.url-file`, which the
    /// operator writes after these keys: `SecretFile::config_lines` in operator/src/workload.rs).
    #[serde(rename = "payment.pg.url", skip_serializing_if = "Option::is_none")]
    pub pg_url: Option<String>,
    #[serde(flatten)]
    pub auth: Auth,
    /// `auth.treasury.dual-approval-above`: a funding above it waits for a second treasury
    /// identity (docs/contract.md#dual-approval).
    #[serde(
        rename = "auth.treasury.dual-approval-above",
        skip_serializing_if = "Option::is_none"
    )]
    pub dual_approval_above: Option<i64>,
    #[serde(flatten)]
    pub fencing: Fencing,
}

/// The rail proxy's configuration.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct RailProxy {
    #[serde(flatten)]
    pub server: Server,
    /// Absent where the URL is a file mounted from a Secret (`rail.proxy.pg.url-file`).
    #[serde(rename = "rail.proxy.pg.url", skip_serializing_if = "Option::is_none")]
    pub pg_url: Option<String>,
    #[serde(rename = "rail.proxy.rail-url")]
    pub rail_url: String,
    #[serde(rename = "rail.proxy.read-timeout-ms")]
    pub read_timeout_ms: i64,
    #[serde(
        rename = "rail.proxy.rail-credential-file",
        skip_serializing_if = "Option::is_none"
    )]
    pub rail_credential_file: Option<String>,
    #[serde(flatten)]
    pub auth: Auth,
    #[serde(flatten)]
    pub fencing: Fencing,
}

/// The rail stub's configuration.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct RailStub {
    #[serde(flatten)]
    pub server: Server,
    #[serde(rename = "rail.stub.latency-ms")]
    pub latency_ms: i64,
    #[serde(rename = "rail.stub.failure-rate")]
    pub failure_rate: f64,
    #[serde(rename = "rail.stub.duplicate-ack-rate")]
    pub duplicate_ack_rate: f64,
    #[serde(
        rename = "rail.stub.redirect-rate",
        skip_serializing_if = "Option::is_none"
    )]
    pub redirect_rate: Option<f64>,
    #[serde(rename = "rail.stub.statement-path")]
    pub statement_path: String,
    #[serde(flatten)]
    pub auth: Option<Auth>,
}

#[cfg(test)]
mod tests {
    use super::*;

    type TestResult = Result<(), Box<dyn std::error::Error>>;

    fn server() -> Server {
        Server {
            listen: "127.0.0.1:8080".into(),
        }
    }

    #[test]
    fn writes_flat_dotted_keys_in_field_order_and_leaves_out_the_absent() -> TestResult {
        let config = RailProxy {
            server: server(),
            pg_url: None,
            rail_url: "http://rail:8080".into(),
            read_timeout_ms: 5000,
            rail_credential_file: None,
            auth: Auth {
                mode: AuthMode::TokenReview,
                tokens_file: None,
                tokenreview_audiences: vec!["dlock".into()],
                operator_identities: vec!["system:serviceaccount:ops:dlock-operator".into()],
                treasury_identities: Vec::new(),
                service_accounts: Vec::new(),
            },
            fencing: Fencing::default(),
        };
        assert_eq!(
            to_toml(&config)?,
            "\"server.listen\" = \"127.0.0.1:8080\"\n\
             \"rail.proxy.rail-url\" = \"http://rail:8080\"\n\
             \"rail.proxy.read-timeout-ms\" = 5000\n\
             \"auth.mode\" = \"tokenreview\"\n\
             \"auth.tokenreview.audiences\" = [\"dlock\"]\n\
             \"auth.operator-identities\" = [\"system:serviceaccount:ops:dlock-operator\"]\n"
        );
        Ok(())
    }

    #[test]
    fn what_is_written_reads_back_under_the_same_keys() -> TestResult {
        let config = LockServer {
            server: server(),
            backend: LockBackend::Etcd,
            pg_url: None,
            etcd_endpoints: vec!["https://etcd-0:2379".into(), "https://etcd-1:2379".into()],
            etcd_tls: Some(EtcdTls {
                ca_file: "/tls/ca.crt".into(),
                cert_file: "/tls/tls.crt".into(),
                key_file: "/tls/tls.key".into(),
            }),
            etcd_auth: Some(EtcdAuth {
                username: "dlock".into(),
                password_file: "/auth/password".into(),
            }),
            auth: Auth::none(),
            fencing: Fencing {
                proof_keys_file: Some("/keys/proof-keys".into()),
            },
        };
        let text = to_toml(&config)?;
        // Read back as the services read it: a TOML table whose keys are the dotted names.
        let table: toml::Table = text.parse()?;
        let string = |key: &str| table.get(key).and_then(toml::Value::as_str);
        assert_eq!(string("server.listen"), Some("127.0.0.1:8080"));
        assert_eq!(string("lock.backend"), Some("etcd"));
        assert_eq!(
            table.get("lock.etcd.endpoints"),
            Some(&toml::Value::Array(vec![
                "https://etcd-0:2379".into(),
                "https://etcd-1:2379".into()
            ]))
        );
        assert_eq!(string("lock.etcd.ca-file"), Some("/tls/ca.crt"));
        assert_eq!(string("lock.etcd.cert-file"), Some("/tls/tls.crt"));
        assert_eq!(string("lock.etcd.key-file"), Some("/tls/tls.key"));
        assert_eq!(string("lock.etcd.username"), Some("dlock"));
        assert_eq!(string("lock.etcd.password-file"), Some("/auth/password"));
        assert_eq!(string("auth.mode"), Some("none"));
        assert_eq!(
            string(crate::proof::KEYS_FILE_KEY),
            Some("/keys/proof-keys")
        );
        assert_eq!(table.len(), 10, "nothing else is written: {text}");
        Ok(())
    }

    #[test]
    fn the_stub_writes_floats_as_floats() -> TestResult {
        let config = RailStub {
            server: server(),
            latency_ms: 0,
            failure_rate: 0.0,
            duplicate_ack_rate: 0.25,
            redirect_rate: None,
            statement_path: "/data/rail-statement.jsonl".into(),
            auth: None,
        };
        let text = to_toml(&config)?;
        assert!(
            text.contains("\"rail.stub.failure-rate\" = 0.0\n"),
            "{text}"
        );
        assert!(
            text.contains("\"rail.stub.duplicate-ack-rate\" = 0.25\n"),
            "{text}"
        );
        assert!(!text.contains("auth."), "{text}");
        Ok(())
    }
}
