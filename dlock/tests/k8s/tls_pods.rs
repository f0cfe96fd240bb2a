//! TLS between the operator's pods on a real node (real_node.rs), as examples/stack.yaml turns it
//! on: the services serve HTTPS with the Secret `dlock-tls`, the operator trusts its CA through
//! the chart's `serviceTLS.caConfigMap`, the executor Job through the Secret's `ca.crt`, and the
//! rail stub takes transfers only from the rail proxy's projected token
//! (docs/kubernetes.md#tls-between-pods, docs/threat-model.md#the-rail-stub).
//!
//! The certificates come from a CA made here (rcgen), as cert-manager's CA Issuer would make them:
//! one certificate naming the four Services (`<name>.default.svc`) and, so that this machine can
//! call them at their Service address, their cluster IPs. It is made once the operator has made
//! the Services, and until then the pods wait for the Secret.

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, KeyUsagePurpose, SanType,
};
use serde_json::Value;

use crate::real_node::RealCluster;
use crate::reconciliation::{assert_no_double_payment, reconciliation_status};
use crate::world::OPERATOR_NAMESPACE;

/// The Secret examples/stack.yaml names in `spec.tls.secretName`.
pub const TLS_SECRET: &str = "dlock-tls";
/// The ConfigMap of the operator's namespace with the CA (the chart's `serviceTLS.caConfigMap`).
pub const CA_CONFIG_MAP: &str = "dlock-ca";
/// The Services whose certificate `dlock-tls` is.
pub const SERVICES: [&str; 4] = [
    "lock-server",
    "payment-resource",
    "rail-proxy",
    "rail-proxy-stub",
];

/// The CA of the services' certificates, kept beside the cluster's files.
pub struct ServiceCa {
    issuer: CertifiedIssuer<'static, KeyPair>,
    pub ca_file: PathBuf,
}

fn tls_dir(cluster: &RealCluster) -> PathBuf {
    cluster.dir.path().join("tls")
}

/// The CA's certificate: what the machine's clients (curl, `dlock accounts fund`) trust.
pub fn ca_file(cluster: &RealCluster) -> PathBuf {
    tls_dir(cluster).join("ca.crt")
}

/// A new CA, written to [`ca_file`], and its certificate as the ConfigMap [`CA_CONFIG_MAP`] of
/// the operator's namespace (which must exist), before the chart is installed with
/// `serviceTLS.caConfigMap`.
pub fn make_ca(cluster: &RealCluster) -> ServiceCa {
    std::fs::create_dir_all(tls_dir(cluster)).unwrap_or_else(|e| panic!("{e}"));
    let mut params = CertificateParams::new(Vec::<String>::new()).unwrap_or_else(|e| panic!("{e}"));
    params
        .distinguished_name
        .push(DnType::CommonName, "dlock services test CA");
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    let key = KeyPair::generate().unwrap_or_else(|e| panic!("{e}"));
    let issuer = CertifiedIssuer::self_signed(params, key).unwrap_or_else(|e| panic!("{e}"));
    let ca_file = ca_file(cluster);
    std::fs::write(&ca_file, issuer.pem()).unwrap_or_else(|e| panic!("{e}"));
    cluster.kubectl(&[
        "create",
        "configmap",
        CA_CONFIG_MAP,
        "-n",
        OPERATOR_NAMESPACE,
        &format!("--from-file=ca.crt={}", ca_file.display()),
    ]);
    ServiceCa { issuer, ca_file }
}

/// The cluster IP of Service `name`, once the operator has made it.
fn cluster_ip(cluster: &RealCluster, namespace: &str, name: &str) -> String {
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    loop {
        if let Ok(ip) = cluster.try_cluster_ip(namespace, name)
            && !ip.is_empty()
        {
            return ip;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the operator made no Service {namespace}/{name}{}",
            cluster.diagnostics()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// The Secret [`TLS_SECRET`] in `namespace`, in the `kubernetes.io/tls` layout cert-manager
/// writes (`tls.crt`, `tls.key`, `ca.crt`): one certificate for the four Services, by DNS name
/// and by cluster IP.
pub fn issue_secret(cluster: &RealCluster, ca: &ServiceCa, namespace: &str) {
    let mut names: Vec<SanType> = Vec::new();
    for service in SERVICES {
        let dns = format!("{service}.{namespace}.svc");
        names.push(SanType::DnsName(
            dns.try_into().unwrap_or_else(|e| panic!("{e}")),
        ));
        let ip = cluster_ip(cluster, namespace, service);
        names.push(SanType::IpAddress(
            ip.parse().unwrap_or_else(|e| panic!("{ip}: {e}")),
        ));
    }
    let mut params = CertificateParams::new(Vec::<String>::new()).unwrap_or_else(|e| panic!("{e}"));
    params.subject_alt_names = names;
    params
        .distinguished_name
        .push(DnType::CommonName, "dlock services");
    params.key_usages = vec![
        KeyUsagePurpose::DigitalSignature,
        KeyUsagePurpose::KeyEncipherment,
    ];
    params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    let now = std::time::SystemTime::now();
    params.not_before = (now - Duration::from_secs(86_400)).into();
    params.not_after = (now + Duration::from_secs(30 * 86_400)).into();
    let key = KeyPair::generate().unwrap_or_else(|e| panic!("{e}"));
    let cert = params
        .signed_by(&key, &ca.issuer)
        .unwrap_or_else(|e| panic!("{e}"));
    let dir = tls_dir(cluster);
    let (crt, pem_key) = (dir.join("tls.crt"), dir.join("tls.key"));
    std::fs::write(&crt, cert.pem()).unwrap_or_else(|e| panic!("{e}"));
    std::fs::write(&pem_key, key.serialize_pem()).unwrap_or_else(|e| panic!("{e}"));
    cluster.kubectl(&[
        "create",
        "secret",
        "generic",
        TLS_SECRET,
        "-n",
        namespace,
        "--type=kubernetes.io/tls",
        &format!("--from-file=tls.crt={}", crt.display()),
        &format!("--from-file=tls.key={}", pem_key.display()),
        &format!("--from-file=ca.crt={}", ca.ca_file.display()),
    ]);
}

/// `https://<cluster IP>:8080` of Service `name`: its certificate names that address.
pub fn https_url(cluster: &RealCluster, namespace: &str, name: &str) -> String {
    cluster
        .service_url(namespace, name)
        .replacen("http://", "https://", 1)
}

/// `curl ARGS` trusting only the services' CA: the HTTP status (0 when no HTTP answer came) and
/// the body.
pub fn curl(cluster: &RealCluster, args: &[&str]) -> (u16, String) {
    let out = Command::new("curl")
        .args(["-s", "--max-time", "10", "--cacert"])
        .arg(ca_file(cluster))
        .args(["-w", "\n%{http_code}"])
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("curl: {e}"));
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let (body, code) = text.rsplit_once('\n').unwrap_or(("", &text));
    (code.trim().parse().unwrap_or(0), body.to_owned())
}

/// Waits until Service `name` answers `GET /readyz` 200 over HTTPS with the services' CA.
pub fn wait_https_ready(cluster: &RealCluster, namespace: &str, name: &str) {
    let url = format!("{}/readyz", https_url(cluster, namespace, name));
    dlock_devstack::wait_until(
        &format!("Service {namespace}/{name} answers {url} over TLS"),
        Duration::from_secs(120),
        || curl(cluster, &[&url]).0 == 200,
    )
    .unwrap_or_else(|e| panic!("{e:#}{}", cluster.diagnostics()));
}

/// `POST /submit` straight to the rail stub, with `bearer` (none: no Authorization header).
fn submit_to_stub(cluster: &RealCluster, bearer: Option<&str>, client_ref: &str) -> (u16, String) {
    let url = format!("{}/submit", https_url(cluster, NS, "rail-proxy-stub"));
    let body = format!(r#"{{"clientRef":"{client_ref}","amountMinor":100,"currency":"EUR"}}"#);
    let authorization = bearer.map(|b| format!("Authorization: Bearer {b}"));
    let mut args = vec![
        "-X",
        "POST",
        "-H",
        "Content-Type: application/json",
        "-d",
        &body,
    ];
    if let Some(header) = &authorization {
        args.extend(["-H", header]);
    }
    args.push(&url);
    curl(cluster, &args)
}

const NS: &str = "default";

fn token(cluster: &RealCluster, service_account: &str) -> String {
    cluster
        .kubectl(&[
            "create",
            "token",
            service_account,
            "-n",
            NS,
            "--audience",
            "dlock",
        ])
        .trim()
        .to_owned()
}

/// The environment of `job`'s first container, and a lookup of one variable's value in it
/// (`null` when it is not set).
fn container_env(job: &Value) -> (&Value, impl Fn(&str) -> Value + '_) {
    let env = &job["spec"]["template"]["spec"]["containers"][0]["env"];
    let value = move |name: &str| -> Value {
        env.as_array()
            .into_iter()
            .flatten()
            .find(|e| e["name"] == name)
            .map(|e| e["value"].clone())
            .unwrap_or(Value::Null)
    };
    (env, value)
}

#[test]
fn a_tls_stack_pays_through_https_and_refuses_plain_http_and_foreign_tokens() {
    let cluster = RealCluster::start();
    let started = std::time::Instant::now();
    // The chart with serviceTLS.caConfigMap, examples/stack.yaml as it is (TLS on for all
    // three), the Secret made once the Services exist.
    crate::real_pods::install(&cluster);
    crate::real_pods::quiet_stub(&cluster);
    let installed = started.elapsed();

    // Each kind's status.url, the address the operator calls, is https://.
    for (object, url) in [
        (
            "lockserver/lock-server",
            "https://lock-server.default.svc:8080",
        ),
        (
            "paymentresource/payment-resource",
            "https://payment-resource.default.svc:8080",
        ),
        (
            "railproxy/rail-proxy",
            "https://rail-proxy.default.svc:8080",
        ),
    ] {
        let status = cluster.get_json(&[object, "-n", NS]);
        assert_eq!(status["status"]["url"], url, "{status}");
    }

    // A service's pod speaks TLS only: plain HTTP to its port gets no HTTP answer, while HTTPS
    // with the CA, by the Service's name, is answered (the control).
    let pods = cluster.get_json(&[
        "pods",
        "-n",
        NS,
        "-l",
        "app.kubernetes.io/instance=payment-resource",
    ]);
    let pod_ip = pods["items"][0]["status"]["podIP"]
        .as_str()
        .unwrap_or_else(|| panic!("no pod IP: {pods}"))
        .to_owned();
    let (plain, body) = curl(&cluster, &[&format!("http://{pod_ip}:8080/readyz")]);
    assert_ne!(plain, 200, "plain HTTP was answered: {body}");
    assert_eq!(plain, 0, "plain HTTP got an HTTP answer {plain}: {body}");
    let resolve = format!("payment-resource.default.svc:8080:{pod_ip}");
    let (secure, body) = curl(
        &cluster,
        &[
            "--resolve",
            &resolve,
            "https://payment-resource.default.svc:8080/readyz",
        ],
    );
    assert_eq!(secure, 200, "HTTPS by the Service's name: {body}");

    // A batch pays through https: the operator registers it (its CA from the ConfigMap), the
    // executor Job calls the three services (the Secret's ca.crt), the proxy presents its
    // projected token to the stub over TLS.
    let example = crate::real_pods::example("payoutbatch.yaml");
    crate::real_pods::fund(&cluster, &example);
    cluster.kubectl(&["apply", "-n", NS, "-f", &example]);
    cluster.kubectl(&[
        "wait",
        "-n",
        NS,
        "--for=condition=Ready",
        "payoutbatch/payroll-2026-12",
        "--timeout=300s",
    ]);
    let batch = cluster.get_json(&["payoutbatch", "payroll-2026-12", "-n", NS]);
    assert_eq!(
        batch["status"]["counts"],
        serde_json::json!({"POSTED": 4}),
        "{batch}"
    );
    let job = cluster.get_json(&["job", "payroll-2026-12-executor", "-n", NS]);
    let (env, value) = container_env(&job);
    assert_eq!(value("DLOCK_CA_FILE"), "/etc/dlock/ca/ca.crt", "{env}");
    assert_eq!(
        value("DLOCK_RAIL_PROXY"),
        "https://rail-proxy.default.svc:8080",
        "{env}"
    );
    let paid = crate::real_pods::statement(&cluster);
    assert_eq!(paid.len(), 4, "{paid:?}");
    assert!(paid.values().all(|n| *n == 1), "paid twice: {paid:?}");

    // The reconciler's Job reads the stub's statement over https, trusting the Secret's ca.crt:
    // one run, its summary in status.
    cluster.apply_stdin(
        "apiVersion: dlock.io/v1alpha1\nkind: Reconciliation\nmetadata:\n  name: once\n  \
         namespace: default\nspec:\n  databaseUrlSecret: {name: paydb, key: url}\n  \
         railProxy: rail-proxy\n",
    );
    let mut status = Value::Null;
    dlock_devstack::wait_until(
        "the reconciler's findings in status",
        Duration::from_secs(180),
        || {
            status = reconciliation_status(|args| cluster.try_kubectl(args), "once", NS);
            status["summary"]
                .as_str()
                .is_some_and(|s| s.contains("double payments"))
        },
    )
    .unwrap_or_else(|e| panic!("{e:#}: {status}{}", cluster.diagnostics()));
    assert_no_double_payment(&status);
    let job = cluster.get_json(&["job", "once-reconcile", "-n", NS]);
    let (env, value) = container_env(&job);
    assert_eq!(
        value("DLOCK_RAIL"),
        "https://rail-proxy-stub.default.svc:8080",
        "{env}"
    );
    assert_eq!(value("DLOCK_CA_FILE"), "/etc/dlock/ca/ca.crt", "{env}");

    // Straight to the stub, past every fence: another pod's token (the executor's, audience
    // dlock) is 403, no token 401, and the statement does not change.
    let executor = token(&cluster, "dlock-executor");
    let (status, body) = submit_to_stub(&cluster, Some(&executor), "direct-executor");
    assert_eq!(status, 403, "{body}");
    assert!(body.contains("FORBIDDEN"), "{body}");
    let (status, body) = submit_to_stub(&cluster, None, "direct-anonymous");
    assert_eq!(status, 401, "{body}");
    let treasury = token(&cluster, "treasury");
    let (status, body) = submit_to_stub(&cluster, Some(&treasury), "direct-treasury");
    assert_eq!(status, 403, "{body}");
    assert_eq!(crate::real_pods::statement(&cluster), paid);
    // The control: a token of the proxy's own account is taken, so the 403s above are the
    // identity's, not a broken request.
    let proxy = token(&cluster, "dlock-service");
    let (status, body) = submit_to_stub(&cluster, Some(&proxy), "direct-proxy-account");
    assert!((200..300).contains(&status), "{status}: {body}");
    let after = crate::real_pods::statement(&cluster);
    assert_eq!(after.get("direct-proxy-account"), Some(&1), "{after:?}");
    assert_eq!(after.len(), paid.len() + 1, "{after:?}");
    eprintln!(
        "tls stack: installed and Ready over TLS in {:.1} s, whole scenario {:.1} s",
        installed.as_secs_f64(),
        started.elapsed().as_secs_f64()
    );
}
