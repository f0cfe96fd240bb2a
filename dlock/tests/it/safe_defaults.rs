//! Safe by default (docs/threat-model.md#safe-defaults): the lock server, the payment resource and
//! the rail proxy do not start without fencing-token proof keys unless
//! `fencing.insecure-no-proofs = true` says so by name. Each is a real `dlock serve` process.

use crate::etcd_tls::{refused_process, serve_process};
use crate::harness::ServiceDbs;

/// A secret of the keys file (64 hex digits, as `openssl rand -hex 32` makes one).
const SECRET: &str = "5f2c8e1a9b7d4f3e6a0c2b8d1e9f7a3c5b4d6e8f0a1c3e5b7d9f2a4c6e8b0d1f";

/// Each service with neither `fencing.proof-keys-file` nor the flag exits non-zero at start with
/// a message naming the missing key, the flag (in the configuration file) and the danger; the
/// same configuration with the flag (positive control) starts, serves `/readyz` and warns
/// `fencing_tokens_unproven`; with a keys file it starts proving tokens; both together are
/// refused as a contradiction.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_service_without_proof_keys_starts_only_with_the_insecure_flag_said_by_name() {
    let ServiceDbs { dir, pg, keys } = ServiceDbs::start(SECRET);
    let keys = keys.display().to_string();
    let services: [(&str, Vec<(&'static str, String)>); 3] = [
        (
            "lock-server",
            vec![
                ("lock.backend", "pg".to_owned()),
                ("lock.pg.url", pg.url("lockdb")),
            ],
        ),
        (
            "payment-resource",
            vec![("payment.pg.url", pg.url("paydb"))],
        ),
        (
            "rail-proxy",
            vec![
                ("rail.proxy.pg.url", pg.url("paydb")),
                // Never called here: readiness is paydb's.
                ("rail.proxy.rail-url", "http://127.0.0.1:9".to_owned()),
            ],
        ),
    ];
    for (service, pairs) in services {
        let log = |what: &str| dir.path().join(format!("{service}-{what}.log"));
        let with = |extra: &[(&'static str, &str)]| {
            let mut all = pairs.clone();
            all.extend(extra.iter().map(|(k, v)| (*k, (*v).to_owned())));
            all
        };

        let refused = refused_process(
            service,
            &pairs,
            &log("refused"),
            &[
                "fencing.proof-keys-file",
                "does not start",
                "forged token",
                "fencing.insecure-no-proofs = true in the configuration file",
            ],
        );
        assert!(
            !refused.contains("_started"),
            "{service} never served:\n{refused}"
        );
        refused_process(
            service,
            &with(&[("fencing.insecure-no-proofs", "false")]),
            &log("flag-false"),
            &["fencing.proof-keys-file", "does not start"],
        );
        refused_process(
            service,
            &with(&[
                ("fencing.insecure-no-proofs", "true"),
                ("fencing.proof-keys-file", &keys),
            ]),
            &log("both"),
            &["fencing.insecure-no-proofs", "remove one"],
        );

        // Positive control: the same configuration with the flag starts, and says so loudly.
        let (insecure, _) = serve_process(
            service,
            &with(&[("fencing.insecure-no-proofs", "true")]),
            &log("insecure"),
        );
        let text = std::fs::read_to_string(log("insecure")).unwrap_or_default();
        assert!(
            text.contains("fencing_tokens_unproven"),
            "{service}:\n{text}"
        );
        drop(insecure);

        let (proven, _) = serve_process(
            service,
            &with(&[("fencing.proof-keys-file", &keys)]),
            &log("proven"),
        );
        let text = std::fs::read_to_string(log("proven")).unwrap_or_default();
        assert!(
            text.contains("fencing_tokens_proven") && !text.contains("fencing_tokens_unproven"),
            "{service}:\n{text}"
        );
        drop(proven);
    }
}
