//! A service takes no security setting from its environment (services/server/src/config.rs,
//! docs/threat-model.md#configuration-from-the-environment). Whoever can change a pod's
//! environment, through a ConfigMap injected into it say, could otherwise set
//! `DLOCK_AUTH_MODE=none`, empty the proof keys or point a service at another rail. Each service
//! here is a real `dlock serve` process on real PostgreSQL, configured by its file with tokens
//! and proof keys, and the hostile variable is in its environment.

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use dlock_devstack::{free_port, http_status, spawn_logged, wait_until};
use reqwest::Method;

use crate::harness::{ServiceDbs, raw, serve_args, stopped_at_start};

const EXE: &str = env!("CARGO_BIN_EXE_dlock");

/// A secret of the keys file (64 hex digits, as `openssl rand -hex 32` makes one).
const SECRET: &str = "0c2b8d1e9f7a3c5b4d6e8f0a1c3e5b7d9f2a4c6e8b0d1f5f2c8e1a9b7d4f3e6a";

/// `dlock serve {name}` with `pairs` in its file and `env` in its environment.
fn start(
    name: &str,
    pairs: &[(String, String)],
    env: &[(&str, &str)],
    log: &Path,
) -> (dlock_devstack::ManagedChild, SocketAddr) {
    let listen: SocketAddr = (
        [127, 0, 0, 1],
        free_port().unwrap_or_else(|e| panic!("{e}")),
    )
        .into();
    let mut config = vec![("server.listen".to_owned(), listen.to_string())];
    config.extend(pairs.iter().cloned());
    let args = serve_args(name, &config, log);
    let env: Vec<(String, String)> = env
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect();
    let child = spawn_logged(name, Path::new(EXE), &args, &env, Some(log))
        .unwrap_or_else(|e| panic!("{e:#}"));
    (child, listen)
}

/// The service stops at start within 20 s, never serving, and its log names `words`.
fn assert_refused(
    name: &str,
    pairs: &[(String, String)],
    env: &[(&str, &str)],
    log: &Path,
    words: &[&str],
) {
    let (mut child, listen) = start(name, pairs, env, log);
    let text = stopped_at_start(&mut child, &format!("{name} with {env:?}"), log);
    assert_eq!(
        http_status(listen, "/healthz"),
        None,
        "{name} never listened"
    );
    for word in words {
        assert!(
            text.contains(word),
            "{name} with {env:?}: {word:?} in\n{text}"
        );
    }
}

/// For the lock server, the payment resource and the rail proxy: `DLOCK_AUTH_MODE=none`, an
/// emptied `DLOCK_FENCING_PROOF_KEYS_FILE`, `DLOCK_AUTH_TOKENS_FILE` and (the proxy)
/// `DLOCK_RAIL_PROXY_RAIL_URL` and `DLOCK_SERVICE_ADDRESSES` in the environment each stop the
/// service at start, naming the variable and saying to put the setting in the configuration
/// file. Positive control: the same file with only `DLOCK_LOG=debug` (harmless) in the
/// environment starts, logs at debug, proves tokens, and refuses a caller without a credential
/// (401): authentication stayed on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_security_setting_in_the_environment_stops_the_service_and_a_harmless_one_does_not() {
    let ServiceDbs { dir, pg, keys } = ServiceDbs::start(SECRET);
    let tokens = dir.path().join("tokens");
    std::fs::write(&tokens, "executor executor-token-0123456789\n")
        .unwrap_or_else(|e| panic!("{e}"));
    // The database URL from a file, as the operator mounts it from a Secret.
    let paydb_file = dir.path().join("paydb-url");
    std::fs::write(&paydb_file, format!("{}\n", pg.url("paydb"))).unwrap_or_else(|e| panic!("{e}"));
    let common = |pairs: &[(&str, String)]| {
        let mut all: Vec<(String, String)> = vec![
            ("auth.mode".into(), "tokens".into()),
            ("auth.tokens-file".into(), tokens.display().to_string()),
            ("fencing.proof-keys-file".into(), keys.display().to_string()),
        ];
        all.extend(pairs.iter().map(|(k, v)| ((*k).to_owned(), v.clone())));
        all
    };
    let services = [
        (
            "lock-server",
            common(&[
                ("lock.backend", "pg".into()),
                ("lock.pg.url", pg.url("lockdb")),
            ]),
            "/v1/locks/k",
            vec![],
        ),
        (
            "payment-resource",
            common(&[("payment.pg.url-file", paydb_file.display().to_string())]),
            "/v1/accounts/acct-x",
            vec![],
        ),
        (
            "rail-proxy",
            common(&[
                ("rail.proxy.pg.url-file", paydb_file.display().to_string()),
                // Never called here: readiness is paydb's.
                ("rail.proxy.rail-url", "http://127.0.0.1:9".into()),
            ]),
            "/v1/rail/high-water/acct-x",
            vec![
                (
                    "DLOCK_RAIL_PROXY_RAIL_URL",
                    "http://attacker.example:80",
                    "rail.proxy.rail-url",
                ),
                (
                    "DLOCK_SERVICE_ADDRESSES",
                    "127.0.0.1:9=attacker.example:80",
                    "DLOCK_SERVICE_ADDRESSES",
                ),
            ],
        ),
    ];
    for (service, pairs, read, extra) in services {
        let log = |what: &str| dir.path().join(format!("{service}-{what}.log"));
        let mut hostile = vec![
            ("DLOCK_AUTH_MODE", "none", "auth.mode"),
            (
                "DLOCK_FENCING_PROOF_KEYS_FILE",
                "",
                "DLOCK_FENCING_PROOF_KEYS_FILE",
            ),
            (
                "DLOCK_AUTH_TOKENS_FILE",
                "/tmp/attacker-tokens",
                "auth.tokens-file",
            ),
        ];
        hostile.extend(extra);
        for (i, (name, value, names)) in hostile.into_iter().enumerate() {
            assert_refused(
                service,
                &pairs,
                &[(name, value), ("DLOCK_LOG", "debug")],
                &log(&format!("hostile-{i}")),
                &[name, names, "configuration file", "Secret"],
            );
        }

        // Positive control: the same file; only the log level in the environment.
        let (_child, listen) = start(service, &pairs, &[("DLOCK_LOG", "debug")], &log("served"));
        wait_until(service, Duration::from_secs(30), || {
            http_status(listen, "/readyz") == Some(200)
        })
        .unwrap_or_else(|e| {
            panic!(
                "{e:#}: {}",
                std::fs::read_to_string(log("served")).unwrap_or_default()
            )
        });
        let (status, _, body) =
            raw(Method::GET, &format!("http://{listen}{read}"), &[], None).await;
        assert_eq!(status, 401, "{service}: authentication is on: {body}");
        assert_eq!(body["code"], "UNAUTHENTICATED", "{service}: {body}");
        let text = std::fs::read_to_string(log("served")).unwrap_or_default();
        assert!(
            text.contains("DEBUG"),
            "{service}: DLOCK_LOG reached it:\n{text}"
        );
        assert!(
            text.contains("fencing_tokens_proven") && !text.contains("auth_disabled"),
            "{service}:\n{text}"
        );
    }
}
