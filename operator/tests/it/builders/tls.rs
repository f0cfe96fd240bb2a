//! TLS between the pods and the rail stub's callers: `spec.tls.secretName` mounted as a
//! directory and named by `server.tls.*`, `https://` URLs for the operator and the Jobs with the
//! namespace's `ca.crt` (and nothing else of the Secret), and the operator's stub that takes
//! transfers only from the rail proxy's projected token.

use dlock_operator::services::NamespaceTls;
use k8s_openapi::api::core::v1::{PodSpec, Volume, VolumeMount};

use super::*;

const TLS_SECRET: &str = "dlock-tls";

fn with_tls(service: &mut dlock_operator::crd::ServiceSettings) {
    service.tls = Some(serde_json::from_value(json!({"secretName": TLS_SECRET})).unwrap());
}

fn pod_of(workload: &dlock_operator::workload::Workload) -> PodSpec {
    deployment::deployment(workload)
        .spec
        .unwrap()
        .template
        .spec
        .unwrap()
}

fn mount<'a>(mounts: &'a [VolumeMount], name: &str) -> &'a VolumeMount {
    mounts
        .iter()
        .find(|m| m.name == name)
        .unwrap_or_else(|| panic!("no mount {name} in {mounts:?}"))
}

fn volume<'a>(volumes: &'a [Volume], name: &str) -> &'a Volume {
    volumes
        .iter()
        .find(|v| v.name == name)
        .unwrap_or_else(|| panic!("no volume {name} in {volumes:?}"))
}

/// The TLS Secret of a service: mounted read-only as a whole directory (never a subPath, so
/// cert-manager's renewal reaches the pod), named by `server.tls.cert-file` and `key-file`, the
/// probes on HTTPS, and the Service's URL (status.url, the operator's) `https://`.
#[test]
fn each_service_with_spec_tls_mounts_its_secret_serves_https_and_is_called_at_https() {
    let mut lock_server = fixtures::lock_server();
    with_tls(&mut lock_server.spec.service);
    let mut payment = fixtures::payment_resource();
    with_tls(&mut payment.spec.service);
    let mut rail = fixtures::rail_proxy();
    with_tls(&mut rail.spec.service);
    let lock_server = validate::lock_server(&lock_server, &settings()).unwrap();
    let payment = validate::payment_resource(&payment, &settings()).unwrap();
    let rail = validate::rail_proxy(&rail, &settings()).unwrap();
    let stub = rail.stub.clone().unwrap();
    for (workload, url) in [
        (&lock_server, "https://lock-server.default.svc:8080"),
        (&payment, "https://payment-resource.default.svc:8080"),
        (&rail.proxy, "https://rail-proxy.default.svc:8080"),
        (&stub, "https://rail-proxy-stub.default.svc:8080"),
    ] {
        assert_eq!(workload.url(), url);
        assert!(
            workload.config_toml.contains(
                "\"server.tls.cert-file\" = \"/etc/dlock/tls/tls.crt\"\n\"server.tls.key-file\" = \"/etc/dlock/tls/tls.key\"\n"
            ),
            "{}: {}",
            workload.name,
            workload.config_toml
        );
        let pod = pod_of(workload);
        let container = &pod.containers[0];
        assert_json(
            mount(container.volume_mounts.as_deref().unwrap(), "tls"),
            json!({"name": "tls", "mountPath": "/etc/dlock/tls", "readOnly": true}),
        );
        assert_json(
            volume(pod.volumes.as_deref().unwrap(), "tls"),
            json!({"name": "tls", "secret": {"secretName": TLS_SECRET}}),
        );
        for probe in [&container.readiness_probe, &container.liveness_probe] {
            let get = probe.as_ref().unwrap().http_get.as_ref().unwrap();
            assert_eq!(get.scheme.as_deref(), Some("HTTPS"), "{}", workload.name);
        }
    }
    // The proxy calls the stub at https:// and trusts the CA of its own Secret.
    assert!(
        rail.proxy
            .config_toml
            .contains("\"rail.proxy.rail-url\" = \"https://rail-proxy-stub.default.svc:8080\"\n")
            && rail
                .proxy
                .config_toml
                .contains("\"rail.proxy.rail-ca-file\" = \"/etc/dlock/tls/ca.crt\"\n"),
        "{}",
        rail.proxy.config_toml
    );
}

/// Without `spec.tls` nothing changes: plain HTTP, no TLS keys, no mount, HTTP probes (the
/// positive control of the test above).
#[test]
fn a_service_without_spec_tls_stays_plain_http() {
    let lock_server = validated_lock_server();
    let rail = validated_rail_proxy();
    for workload in [&lock_server, &rail.proxy, rail.stub.as_ref().unwrap()] {
        assert!(workload.url().starts_with("http://"), "{}", workload.url());
        assert!(!workload.config_toml.contains("server.tls"));
        assert!(!workload.config_toml.contains("rail-ca-file"));
        let pod = pod_of(workload);
        assert!(pod.volumes.unwrap().iter().all(|v| v.name != "tls"));
        let probe = pod.containers[0].readiness_probe.clone().unwrap();
        assert_eq!(probe.http_get.unwrap().scheme, None);
    }
    assert!(
        rail.proxy
            .config_toml
            .contains("\"rail.proxy.rail-url\" = \"http://rail-proxy-stub.default.svc:8080\"\n")
    );
}

/// A TLS Secret name that is not a DNS label is refused naming the field, before anything is
/// built (the controller writes it as Degraded/InvalidSpec).
#[test]
fn a_tls_secret_name_that_is_not_a_dns_label_is_refused_naming_the_field() {
    for bad in [
        "",
        "Dlock-TLS",
        "dlock_tls",
        "-tls",
        "tls-",
        "a.b",
        &"t".repeat(64),
    ] {
        let mut object = fixtures::payment_resource();
        object.spec.service.tls = Some(serde_json::from_value(json!({"secretName": bad})).unwrap());
        let error = validate::payment_resource(&object, &settings()).unwrap_err();
        assert_eq!(error.field, "spec.tls.secretName", "{bad:?}: {error}");
        assert!(error.message.contains("DNS label"), "{error}");
    }
    let mut object = fixtures::rail_proxy();
    object.spec.service.tls = Some(serde_json::from_value(json!({"secretName": "a/b"})).unwrap());
    assert_eq!(
        validate::rail_proxy(&object, &settings())
            .unwrap_err()
            .field,
        "spec.tls.secretName"
    );
    // 63 characters, digits first: a DNS label, accepted.
    let mut object = fixtures::lock_server();
    object.spec.service.tls = Some(
        serde_json::from_value(json!({"secretName": format!("0{}", "t".repeat(62))})).unwrap(),
    );
    assert!(validate::lock_server(&object, &settings()).is_ok());
}

/// The operator's rail stub authenticates its callers: TokenReview with the audience `dlock`,
/// and only the rail proxy's ServiceAccount (`dlock-service` of the namespace) may submit. The
/// proxy's pod gets a projected token of that account, audience `dlock`, which its
/// `rail.proxy.rail-credential-file` names; the stub's pod runs as the account with its own
/// token for the TokenReview calls.
#[test]
fn the_operators_stub_takes_transfers_only_from_the_rail_proxys_projected_token() {
    let rail = validated_rail_proxy();
    let stub = rail.stub.clone().unwrap();
    assert_eq!(
        stub.config_toml,
        "\"server.listen\" = \"0.0.0.0:8080\"\n\"rail.stub.latency-ms\" = 200\n\"rail.stub.failure-rate\" = 0.05\n\"rail.stub.duplicate-ack-rate\" = 0.01\n\"rail.stub.statement-path\" = \"/data/rail-statement.jsonl\"\n\"auth.mode\" = \"tokenreview\"\n\"auth.tokenreview.audiences\" = [\"dlock\"]\n\"rail.stub.submitter-identities\" = [\"system:serviceaccount:default:dlock-service\"]\n",
    );
    assert!(!stub.config_toml.contains("\"auth.mode\" = \"none\""));
    let stub_pod = pod_of(&stub);
    assert_eq!(
        stub_pod.service_account_name.as_deref(),
        Some("dlock-service")
    );
    assert_eq!(stub_pod.automount_service_account_token, Some(true));

    assert!(
        rail.proxy.config_toml.contains(
            "\"rail.proxy.rail-credential-file\" = \"/var/run/secrets/dlock/rail/token\"\n"
        ),
        "{}",
        rail.proxy.config_toml
    );
    let pod = pod_of(&rail.proxy);
    assert_eq!(pod.service_account_name.as_deref(), Some("dlock-service"));
    assert_json(
        mount(
            pod.containers[0].volume_mounts.as_deref().unwrap(),
            "rail-token",
        ),
        json!({"name": "rail-token", "mountPath": "/var/run/secrets/dlock/rail", "readOnly": true}),
    );
    assert_json(
        volume(pod.volumes.as_deref().unwrap(), "rail-token"),
        json!({"name": "rail-token", "projected": {"sources": [{"serviceAccountToken": {
            "audience": "dlock", "expirationSeconds": 3600, "path": "token"}}]}}),
    );

    // With `auth.mode: none` on the proxy the stub still checks its callers, and the proxy
    // still presents its projected token (its pod mounts no API token: it reviews none).
    let mut open = fixtures::rail_proxy();
    open.spec.service.auth = Some(serde_json::from_value(json!({"mode": "none"})).unwrap());
    let rail = validate::rail_proxy(&open, &settings()).unwrap();
    assert!(
        rail.stub
            .unwrap()
            .config_toml
            .contains("\"auth.mode\" = \"tokenreview\"\n")
    );
    let pod = pod_of(&rail.proxy);
    assert_eq!(pod.service_account_name.as_deref(), Some("dlock-service"));
    assert_eq!(pod.automount_service_account_token, Some(false));
    assert!(pod.volumes.unwrap().iter().any(|v| v.name == "rail-token"));

    // A proxy in front of a real rail gets no rail token (it has no stub to present it to).
    let mut real = fixtures::rail_proxy();
    real.spec.stub = None;
    real.spec.rail_url = Some("https://rail.example".to_owned());
    let rail = validate::rail_proxy(&real, &settings()).unwrap();
    assert!(!rail.proxy.config_toml.contains("rail-credential-file"));
    assert!(
        pod_of(&rail.proxy)
            .volumes
            .unwrap()
            .iter()
            .all(|v| v.name != "rail-token")
    );
}

/// The namespace's TLS, read from the objects' `spec.tls`: a Service URL the operator built
/// becomes `https://` when that Service serves TLS (a RailProxy's stub with it); anything else,
/// another namespace's look-alike or a real rail's URL, stays as it is.
#[test]
fn urls_become_https_only_for_the_namespaces_tls_services() {
    let tls = NamespaceTls::from_specs(
        "default",
        [
            ("lock-server".to_owned(), Some("dlock-tls"), false),
            ("payment-resource".to_owned(), None, false),
            ("rail-proxy".to_owned(), Some("dlock-tls"), true),
        ],
    );
    assert_eq!(tls.ca_secret.as_deref(), Some("dlock-tls"));
    for (url, secured) in [
        (
            "http://lock-server.default.svc:8080",
            "https://lock-server.default.svc:8080",
        ),
        (
            "http://payment-resource.default.svc:8080",
            "http://payment-resource.default.svc:8080",
        ),
        (
            "http://rail-proxy-stub.default.svc:8080",
            "https://rail-proxy-stub.default.svc:8080",
        ),
        (
            "http://lock-server.other.svc:8080",
            "http://lock-server.other.svc:8080",
        ),
        ("https://rail.example", "https://rail.example"),
    ] {
        assert_eq!(tls.secure(url), secured, "{url}");
    }
    assert_eq!(
        NamespaceTls::from_specs("default", [("lock-server".to_owned(), None, false)]).ca_secret,
        None
    );
}

/// An executor Job calling a TLS service trusts the namespace's `ca.crt` through
/// `DLOCK_CA_FILE`, mounted as a directory with that one key (never `tls.key`); the reconciler's
/// Job the same for an `https://` stub. Without TLS neither has the mount nor the variable.
#[test]
fn the_jobs_trust_only_the_ca_of_the_namespaces_tls_secret() {
    let tls = NamespaceTls::from_specs(
        "default",
        [
            ("lock-server".to_owned(), Some(TLS_SECRET), false),
            ("payment-resource".to_owned(), Some(TLS_SECRET), false),
            ("rail-proxy".to_owned(), Some(TLS_SECRET), true),
        ],
    );
    let mut batch = validate_batch(&fixtures::payout_batch()).unwrap();
    let plain = job::executor_job(&batch);
    tls.secure_batch(&mut batch);
    assert_eq!(
        batch.lock_server_url,
        "https://lock-server.default.svc:8080"
    );
    assert_eq!(
        batch.payment_resource_url,
        "https://payment-resource.default.svc:8080"
    );
    assert_eq!(batch.rail_proxy_url, "https://rail-proxy.default.svc:8080");
    let executor = job::executor_job(&batch);
    let mut reconciliation =
        validate::reconciliation(&fixtures::reconciliation(None), &settings()).unwrap();
    let plain_reconciler = reconciler::reconciler_job(&reconciliation);
    tls.secure_reconciliation(&mut reconciliation);
    assert_eq!(
        reconciliation.rail_url,
        "https://rail-proxy-stub.default.svc:8080"
    );
    let reconciler = reconciler::reconciler_job(&reconciliation);
    for (built, env_url) in [
        (
            &executor,
            ("DLOCK_LOCK_SERVER", "https://lock-server.default.svc:8080"),
        ),
        (
            &reconciler,
            ("DLOCK_RAIL", "https://rail-proxy-stub.default.svc:8080"),
        ),
    ] {
        let pod = built.spec.clone().unwrap().template.spec.unwrap();
        let container = &pod.containers[0];
        let env = container.env.clone().unwrap();
        let value = |name: &str| {
            env.iter()
                .find(|e| e.name == name)
                .and_then(|e| e.value.clone())
        };
        assert_eq!(value(env_url.0).as_deref(), Some(env_url.1));
        assert_eq!(
            value("DLOCK_CA_FILE").as_deref(),
            Some("/etc/dlock/ca/ca.crt")
        );
        assert_json(
            mount(container.volume_mounts.as_deref().unwrap(), "ca"),
            json!({"name": "ca", "mountPath": "/etc/dlock/ca", "readOnly": true}),
        );
        assert_json(
            volume(pod.volumes.as_deref().unwrap(), "ca"),
            json!({"name": "ca", "secret": {"secretName": TLS_SECRET,
                "items": [{"key": "ca.crt", "path": "ca.crt"}]}}),
        );
    }
    for built in [&plain, &plain_reconciler] {
        let pod = built.spec.clone().unwrap().template.spec.unwrap();
        assert!(
            pod.containers[0]
                .env
                .clone()
                .unwrap()
                .iter()
                .all(|e| e.name != "DLOCK_CA_FILE")
        );
        assert!(
            pod.volumes
                .unwrap_or_default()
                .iter()
                .all(|v| v.name != "ca")
        );
    }
}
