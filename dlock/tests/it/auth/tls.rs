//! A TLS listener: HTTPS only, and only to clients that trust its CA.

use super::*;

/// A self-signed certificate for 127.0.0.1 and localhost, written as PEM files.
fn certificate(dir: &Path) -> (std::path::PathBuf, std::path::PathBuf) {
    let cert = rcgen::generate_simple_self_signed(vec!["127.0.0.1".into(), "localhost".into()])
        .unwrap_or_else(|e| panic!("{e}"));
    let cert_file = dir.join("tls.crt");
    let key_file = dir.join("tls.key");
    std::fs::write(&cert_file, cert.cert.pem()).unwrap_or_else(|e| panic!("{e}"));
    std::fs::write(&key_file, cert.signing_key.serialize_pem()).unwrap_or_else(|e| panic!("{e}"));
    (cert_file, key_file)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tls_listener_serves_https_only_to_clients_that_trust_its_ca() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let (cert, key) = certificate(dir.path());
    let port = free_port().unwrap_or_else(|e| panic!("{e}"));
    let env = vec![
        ("server.listen".to_owned(), format!("127.0.0.1:{port}")),
        (
            "server.tls.cert-file".to_owned(),
            cert.display().to_string(),
        ),
        ("server.tls.key-file".to_owned(), key.display().to_string()),
        (
            "rail.stub.statement-path".to_owned(),
            dir.path().join("statement.jsonl").display().to_string(),
        ),
        ("auth.mode".to_owned(), "none".to_owned()),
    ];
    let _stub = serve("rail-stub", env, &dir.path().join("stub.log"));
    let tls = dlock_contract::tls::client_config(Some(&cert)).unwrap_or_else(|e| panic!("{e}"));
    let trusting = reqwest::Client::builder()
        .use_preconfigured_tls(tls)
        .build()
        .unwrap_or_else(|e| panic!("{e}"));
    let https = format!("https://127.0.0.1:{port}");
    eventually("the TLS listener answers", Duration::from_secs(30), || {
        let trusting = trusting.clone();
        let url = format!("{https}/healthz");
        async move {
            let response = trusting.get(&url).send().await.ok()?;
            (response.status() == 200).then_some(())
        }
    })
    .await;
    let response = trusting
        .post(format!("{https}/submit"))
        .header("content-type", "application/json")
        .body(r#"{"clientRef":"tls-1","amountMinor":100,"currency":"EUR"}"#)
        .send()
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(response.status(), 200);
    assert_eq!(
        response
            .headers()
            .get("content-type")
            .and_then(|v| v.to_str().ok()),
        Some(JSON)
    );
    // The system's roots do not know this CA: the handshake fails, nothing is sent.
    let untrusting = dlock_contract::client::http_client().unwrap_or_else(|e| panic!("{e}"));
    assert!(
        untrusting
            .get(format!("{https}/healthz"))
            .send()
            .await
            .is_err()
    );
    // Plain HTTP to a TLS port gets no HTTP answer.
    let plain = untrusting
        .get(format!("http://127.0.0.1:{port}/healthz"))
        .timeout(Duration::from_secs(5))
        .send()
        .await;
    assert!(plain.is_err(), "{plain:?}");
}
