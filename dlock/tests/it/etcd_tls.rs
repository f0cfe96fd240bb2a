//! The lock server on etcd as production runs it: TLS with a client
//! certificate (`--client-cert-auth`), etcd's authentication on, and a role that grants the lock
//! server's user only its prefix. Certificates are generated here; etcd is the real binary.
//! A wrong CA, an expired client certificate and a user without the prefix each stop the server
//! at start with a message that names the cause, and never leave it retrying.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use dlock_devstack::certs::{CertFiles, TestCa, Validity};
use dlock_devstack::etcd_cluster::{EtcdCluster, EtcdTls};
use dlock_devstack::{ManagedChild, free_port, http_status, spawn_logged, wait_until};
use etcd_client::{Certificate, Client, ConnectOptions, Identity, Permission, TlsOptions};

use crate::harness::{hold, party, release, stopped_at_start};

const EXE: &str = env!("CARGO_BIN_EXE_dlock");
const PREFIX: &str = "/dlock-prod";

pub(crate) struct SecureEtcd {
    pub(crate) cluster: EtcdCluster,
    pub(crate) dir: tempfile::TempDir,
    /// The CA of etcd's serving certificate: what the lock server must trust.
    pub(crate) server_ca: PathBuf,
    /// A client certificate etcd accepts (signed by the clients' CA), for the lock server.
    pub(crate) client: CertFiles,
    /// The lock server's user (role: readwrite on the prefix only) and its password file.
    pub(crate) password_file: PathBuf,
    /// The CA etcd trusts for client certificates.
    pub(crate) clients_ca: TestCa,
}

pub(crate) fn tls_options(ca: &Path, cert: &CertFiles) -> TlsOptions {
    let read = |p: &Path| std::fs::read(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    TlsOptions::new()
        .ca_certificate(Certificate::from_pem(read(ca)))
        .identity(Identity::from_pem(
            read(&cert.cert_file),
            read(&cert.key_file),
        ))
}

impl SecureEtcd {
    /// `members` etcd members with client TLS, client-certificate auth and authentication on:
    /// users `root`, `lock-server` (readwrite on `PREFIX/`) and `outsider` (readwrite on
    /// `/elsewhere/` only).
    pub(crate) async fn start(members: usize) -> Self {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let etcd_ca = TestCa::new(dir.path(), "etcd").unwrap_or_else(|e| panic!("{e:#}"));
        let clients_ca = TestCa::new(dir.path(), "clients").unwrap_or_else(|e| panic!("{e:#}"));
        let server = etcd_ca
            .server("etcd-server")
            .unwrap_or_else(|e| panic!("{e:#}"));
        let cluster = EtcdCluster::start(
            members,
            Some(EtcdTls {
                server,
                client_ca_file: clients_ca.ca_file.clone(),
            }),
        )
        .unwrap_or_else(|e| panic!("{e:#}"));
        let client = clients_ca
            .client("lock-server", "lock-server", Validity::Current)
            .unwrap_or_else(|e| panic!("{e:#}"));
        // With --client-cert-auth and no password, etcd takes a certificate's CN as the user.
        let root = clients_ca
            .client("root", "root", Validity::Current)
            .unwrap_or_else(|e| panic!("{e:#}"));
        let options = ConnectOptions::new().with_tls(tls_options(&etcd_ca.ca_file, &root));
        let mut admin = Client::connect(cluster.endpoints(), Some(options))
            .await
            .unwrap_or_else(|e| panic!("admin client: {e}"));
        admin
            .user_add("root", "root-password", None)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        admin
            .user_grant_role("root", "root")
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        for (user, role, prefix) in [
            ("lock-server", "dlock-lock-server", format!("{PREFIX}/")),
            ("outsider", "elsewhere", "/elsewhere/".to_owned()),
        ] {
            admin.role_add(role).await.unwrap_or_else(|e| panic!("{e}"));
            admin
                .role_grant_permission(role, Permission::read_write(prefix).with_prefix())
                .await
                .unwrap_or_else(|e| panic!("{e}"));
            admin
                .user_add(user, format!("{user}-password"), None)
                .await
                .unwrap_or_else(|e| panic!("{e}"));
            admin
                .user_grant_role(user, role)
                .await
                .unwrap_or_else(|e| panic!("{e}"));
        }
        admin.auth_enable().await.unwrap_or_else(|e| panic!("{e}"));
        let password_file = dir.path().join("lock-server.password");
        std::fs::write(&password_file, "lock-server-password\n").unwrap_or_else(|e| panic!("{e}"));
        Self {
            cluster,
            server_ca: etcd_ca.ca_file.clone(),
            client,
            password_file,
            clients_ca,
            dir,
        }
    }

    /// The lock server's etcd keys for these credentials.
    pub(crate) fn pairs(&self) -> Vec<(&'static str, String)> {
        vec![
            ("lock.backend", "etcd".into()),
            ("lock.etcd.endpoints", self.cluster.endpoints().join(",")),
            ("lock.etcd.prefix", PREFIX.into()),
            ("lock.etcd.ca-file", self.server_ca.display().to_string()),
            (
                "lock.etcd.cert-file",
                self.client.cert_file.display().to_string(),
            ),
            (
                "lock.etcd.key-file",
                self.client.key_file.display().to_string(),
            ),
            ("lock.etcd.username", "lock-server".into()),
            (
                "lock.etcd.password-file",
                self.password_file.display().to_string(),
            ),
            ("lock.etcd.connect-timeout-ms", "1000".into()),
        ]
    }
}

/// `dlock serve {name}` on `port` with `pairs`, in a configuration file beside `log`.
fn args(name: &str, port: u16, pairs: &[(&'static str, String)], log: &Path) -> Vec<String> {
    let mut config = vec![("server.listen".to_owned(), format!("127.0.0.1:{port}"))];
    config.extend(pairs.iter().map(|(k, v)| ((*k).to_owned(), v.clone())));
    crate::harness::serve_args(name, &config, log)
}

fn with(
    pairs: &[(&'static str, String)],
    key: &'static str,
    value: String,
) -> Vec<(&'static str, String)> {
    let mut out: Vec<_> = pairs.iter().filter(|(k, _)| *k != key).cloned().collect();
    out.push((key, value));
    out
}

/// These lock servers run without fencing-token proofs, said by name
/// (docs/threat-model.md#safe-defaults): TLS and etcd users are what they test.
fn without_proofs(pairs: &[(&'static str, String)]) -> Vec<(&'static str, String)> {
    with(pairs, "fencing.insecure-no-proofs", "true".to_owned())
}

/// Starts a lock server process and waits until it is ready.
fn serve(pairs: &[(&'static str, String)], log: &Path) -> (ManagedChild, String) {
    serve_process("lock-server", &without_proofs(pairs), log)
}

/// Starts `dlock serve {name}` and waits until its `/readyz` answers 200; returns its URL.
pub(crate) fn serve_process(
    name: &str,
    pairs: &[(&'static str, String)],
    log: &Path,
) -> (ManagedChild, String) {
    let port = free_port().unwrap_or_else(|e| panic!("{e}"));
    let args = args(name, port, pairs, log);
    let mut child = spawn_logged(name, Path::new(EXE), &args, &[], Some(log))
        .unwrap_or_else(|e| panic!("{e:#}"));
    let addr: SocketAddr = ([127, 0, 0, 1], port).into();
    wait_until(name, Duration::from_secs(30), || {
        !child.exited() && http_status(addr, "/readyz") == Some(200)
    })
    .unwrap_or_else(|e| {
        panic!(
            "{e:#}: {}",
            std::fs::read_to_string(log).unwrap_or_default()
        )
    });
    (child, format!("http://{addr}"))
}

/// Starts a lock server that must refuse to start: it exits non-zero within 20 s (no retry
/// loop) and its log names the cause. Returns the log.
fn refused(pairs: &[(&'static str, String)], log: &Path, cause: &[&str]) -> String {
    refused_process("lock-server", &without_proofs(pairs), log, cause)
}

/// Starts `dlock serve {name}`, which must stop at start naming every word of `cause`.
pub(crate) fn refused_process(
    name: &str,
    pairs: &[(&'static str, String)],
    log: &Path,
    cause: &[&str],
) -> String {
    let port = free_port().unwrap_or_else(|e| panic!("{e}"));
    let args = args(name, port, pairs, log);
    let mut child = spawn_logged(name, Path::new(EXE), &args, &[], Some(log))
        .unwrap_or_else(|e| panic!("{e:#}"));
    let text = stopped_at_start(&mut child, name, log);
    assert!(
        !text.contains("etcd_unreachable"),
        "a refusal is not retried as if etcd were unreachable:\n{text}"
    );
    println!(
        "refused at start: {}",
        text.lines()
            .rev()
            .find(|l| !l.trim().is_empty())
            .unwrap_or_default()
    );
    for word in cause {
        assert!(
            text.contains(word),
            "the start-up error names {word:?}:\n{text}"
        );
    }
    text
}

/// One whole lock cycle: session, acquire, renew (same token), release, end.
pub(crate) async fn lock_cycle(url: &str, key: &str) -> i64 {
    let (lock, session) = party(url, "tls-owner", 10_000).await;
    let grant = hold(&lock, key, session, 5_000).await;
    let renewed = lock
        .renew(key, session, grant.fencing_token, None)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(renewed.fencing_token, grant.fencing_token);
    release(&lock, key, session, grant.fencing_token).await;
    lock.end_session(session)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    grant.fencing_token
}

/// Replaces the lock server's certificate and key files by `from`'s (each by a rename).
fn rotate_to(client: &CertFiles, from: &CertFiles) {
    for (src, dst) in [
        (&from.cert_file, &client.cert_file),
        (&from.key_file, &client.key_file),
    ] {
        let staged = dst.with_extension("staged");
        std::fs::copy(src, &staged).unwrap_or_else(|e| panic!("{e}"));
        std::fs::rename(&staged, dst).unwrap_or_else(|e| panic!("{e}"));
    }
}

async fn log_says(log: &Path, event: &str) {
    crate::harness::eventually(
        &format!("{event} in {}", log.display()),
        Duration::from_secs(30),
        || async {
            std::fs::read_to_string(log)
                .unwrap_or_default()
                .contains(event)
                .then_some(())
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_lock_server_runs_on_etcd_with_tls_client_certificates_and_a_prefix_role() {
    let etcd = SecureEtcd::start(1).await;
    let logs = etcd.dir.path().to_path_buf();
    let good = etcd.pairs();
    let expired = etcd
        .clients_ca
        .client("expired", "lock-server", Validity::Expired)
        .unwrap_or_else(|e| panic!("{e:#}"));

    // Positive control: the right CA, a valid client certificate, the user with the prefix.
    let log = logs.join("good.log");
    let (mut server, url) = serve(&good, &log);
    let first = lock_cycle(&url, "payout:tls-1").await;
    assert!(first > 0);

    // A rotation to a certificate etcd refuses (from a CA it does not trust) keeps the working
    // client...
    let stranger =
        TestCa::new(&logs.join("stranger"), "stranger").unwrap_or_else(|e| panic!("{e:#}"));
    let untrusted = stranger
        .client("untrusted", "lock-server", Validity::Current)
        .unwrap_or_else(|e| panic!("{e:#}"));
    rotate_to(&etcd.client, &untrusted);
    log_says(&log, "etcd_rotation_refused").await;
    assert!(lock_cycle(&url, "payout:tls-2").await > first);
    // ...and a rotation to a fresh certificate is picked up without a restart.
    let fresh = etcd
        .clients_ca
        .client("fresh", "lock-server", Validity::Current)
        .unwrap_or_else(|e| panic!("{e:#}"));
    rotate_to(&etcd.client, &fresh);
    log_says(&log, "etcd_credentials_rotated").await;
    assert!(lock_cycle(&url, "payout:tls-3").await > first);
    server.stop();

    // 1. A CA that did not sign etcd's certificate.
    refused(
        &with(
            &good,
            "lock.etcd.ca-file",
            stranger.ca_file.display().to_string(),
        ),
        &logs.join("wrong-ca.log"),
        &["TLS handshake with etcd", "lock.etcd.ca-file"],
    );

    // 2. An expired client certificate from the CA etcd trusts.
    refused(
        &with(
            &with(
                &good,
                "lock.etcd.cert-file",
                expired.cert_file.display().to_string(),
            ),
            "lock.etcd.key-file",
            expired.key_file.display().to_string(),
        ),
        &logs.join("expired.log"),
        &["lock.etcd.cert-file", "expired at"],
    );

    // 3. A user whose role grants another prefix only.
    let outsider_password = logs.join("outsider.password");
    std::fs::write(&outsider_password, "outsider-password").unwrap_or_else(|e| panic!("{e}"));
    refused(
        &with(
            &with(&good, "lock.etcd.username", "outsider".into()),
            "lock.etcd.password-file",
            outsider_password.display().to_string(),
        ),
        &logs.join("outsider.log"),
        &["permission denied", "outsider", PREFIX],
    );

    // 4. A wrong password is named as such.
    let wrong = logs.join("wrong.password");
    std::fs::write(&wrong, "not-the-password").unwrap_or_else(|e| panic!("{e}"));
    refused(
        &with(
            &good,
            "lock.etcd.password-file",
            wrong.display().to_string(),
        ),
        &logs.join("wrong-password.log"),
        &["authentication failed", "lock.etcd.password-file"],
    );
}
