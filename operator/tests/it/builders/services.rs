//! The services' own objects: the Service, the PodDisruptionBudget, and the ConfigMaps and
//! Deployments of the lock server (pg and etcd), the payment resource and the rail proxy.

use super::*;

/// The Service selects exactly the workload's pods by its immutable selector labels, or traffic
/// would reach another instance's pods.
#[test]
fn the_lock_server_service_selects_its_own_pods_on_the_http_port() {
    assert_json(
        &service::service(&validated_lock_server()),
        workload_object(
            ("v1", "Service"),
            ("LockServer", "lock-server"),
            json!({"spec": {
                "selector": selector("lock-server", "lock-server"),
                "ports": [{"name": "http", "port": 8080, "protocol": "TCP", "targetPort": "http"}],
            }}),
        ),
    );
}

/// At most one pod is evicted at a time, or a node drain could take every replica at once.
#[test]
fn the_pod_disruption_budget_allows_one_eviction_at_a_time() {
    assert_json(
        &pdb::pdb(&validated_payment_resource()),
        workload_object(
            ("policy/v1", "PodDisruptionBudget"),
            ("PaymentResource", "payment-resource"),
            json!({"spec": {
                "maxUnavailable": 1,
                "selector": {"matchLabels": selector("payment-resource", "payment-resource")},
            }}),
        ),
    );
}

/// The lock server's configuration names the backend and listens on the pod port; the lockdb URL
/// is not in it (`lock.pg.url-file` names the file mounted from its Secret). Authentication is on:
/// TokenReview with the audience `dlock`, and the operator's service account as the only operator
/// identity.
#[test]
fn the_lock_server_config_map_holds_the_toml_without_secrets() {
    assert_json(
        &config_map::config_map(&validated_lock_server()),
        workload_object(
            ("v1", "ConfigMap"),
            ("LockServer", "lock-server"),
            json!({"data": {
                "config.toml": "\"server.listen\" = \"0.0.0.0:8080\"\n\"lock.backend\" = \"pg\"\n\"auth.mode\" = \"tokenreview\"\n\"auth.tokenreview.audiences\" = [\"dlock\"]\n\"auth.operator-identities\" = [\"system:serviceaccount:dlock-system:dlock-operator\"]\n\"auth.tokenreview.service-accounts\" = [\"default/dlock-executor=executor\"]\n\"fencing.proof-keys-file\" = \"/etc/dlock/fencing-proof-keys/keys\"\n\"lock.pg.url-file\" = \"/etc/dlock/secrets/database-url/url\"\n",
            }}),
        ),
    );
}

#[test]
fn an_etcd_lock_server_config_lists_the_endpoints() {
    let mut object = fixtures::lock_server();
    object.spec.backend = fixtures::etcd_backend();
    let workload = validate::lock_server(&object, &settings()).unwrap();
    assert_eq!(
        workload.config_toml,
        "\"server.listen\" = \"0.0.0.0:8080\"\n\"lock.backend\" = \"etcd\"\n\"lock.etcd.endpoints\" = [\"https://etcd-0.etcd:2379\"]\n\"lock.etcd.ca-file\" = \"/etc/dlock/etcd-tls/ca.crt\"\n\"lock.etcd.cert-file\" = \"/etc/dlock/etcd-tls/tls.crt\"\n\"lock.etcd.key-file\" = \"/etc/dlock/etcd-tls/tls.key\"\n\"lock.etcd.username\" = \"dlock\"\n\"lock.etcd.password-file\" = \"/etc/dlock/etcd-auth/password\"\n\"auth.mode\" = \"tokenreview\"\n\"auth.tokenreview.audiences\" = [\"dlock\"]\n\"auth.operator-identities\" = [\"system:serviceaccount:dlock-system:dlock-operator\"]\n\"auth.tokenreview.service-accounts\" = [\"default/dlock-executor=executor\"]\n\"fencing.proof-keys-file\" = \"/etc/dlock/fencing-proof-keys/keys\"\n"
    );
    assert!(workload.secret_files.is_empty());
    assert_snapshot(
        "lock-server-etcd-deployment",
        &deployment::deployment(&workload),
    );
}

/// `spec.backend.etcd.tlsSecret` (the `kubernetes.io/tls` layout: `ca.crt`, `tls.crt`,
/// `tls.key`) and `spec.backend.etcd.auth` reach the lock server: both Secrets mounted read-only
/// as directories (a renewed certificate or a changed password reaches the pod) and named by the
/// `lock.etcd.*` file keys; no password in the ConfigMap or the environment. TLS without
/// `https://` endpoints (or the reverse), a bad user name or a key that could leave the mount is
/// refused by validation (the controller's Degraded `InvalidSpec`), before a pod crash-loops.
#[test]
fn the_etcd_tls_secret_and_password_are_mounted_and_named_by_the_lock_etcd_keys() {
    let mut object = fixtures::lock_server();
    object.spec.backend = fixtures::etcd_backend();
    let workload = validate::lock_server(&object, &settings()).unwrap();
    let config: toml::Table = workload.config_toml.parse().unwrap();
    for (key, value) in [
        ("lock.etcd.ca-file", "/etc/dlock/etcd-tls/ca.crt"),
        ("lock.etcd.cert-file", "/etc/dlock/etcd-tls/tls.crt"),
        ("lock.etcd.key-file", "/etc/dlock/etcd-tls/tls.key"),
        ("lock.etcd.username", "dlock"),
        ("lock.etcd.password-file", "/etc/dlock/etcd-auth/password"),
    ] {
        assert_eq!(config[key].as_str(), Some(value), "{key}");
    }
    let pod = serde_json::to_value(deployment::deployment(&workload)).unwrap()["spec"]["template"]
        ["spec"]
        .clone();
    let container = &pod["containers"][0];
    let mounts = container["volumeMounts"].as_array().unwrap();
    let volumes = pod["volumes"].as_array().unwrap();
    for (volume, dir, secret) in [
        ("etcd-tls", "/etc/dlock/etcd-tls", "etcd-client-tls"),
        ("etcd-auth", "/etc/dlock/etcd-auth", "etcd-dlock-user"),
    ] {
        assert!(
            mounts.contains(&json!({"name": volume, "mountPath": dir, "readOnly": true})),
            "{mounts:?}"
        );
        assert!(
            volumes.contains(&json!({"name": volume, "secret": {"secretName": secret}})),
            "{volumes:?}"
        );
    }
    assert!(
        !container["env"].to_string().contains("etcd-dlock-user"),
        "the password is a file, not an environment variable"
    );

    // Without TLS and auth: plain endpoints, no keys, no mounts.
    let mut plain = object.clone();
    plain.spec.backend.etcd = Some(dlock_operator::crd::EtcdBackend {
        endpoints: vec!["http://etcd:2379".to_owned()],
        tls_secret: None,
        auth: None,
    });
    let workload = validate::lock_server(&plain, &settings()).unwrap();
    assert!(
        !workload.config_toml.contains("lock.etcd.ca-file")
            && !workload.config_toml.contains("password-file")
            && !workload.config_toml.contains("username"),
        "{}",
        workload.config_toml
    );
    let pod = serde_json::to_value(deployment::deployment(&workload)).unwrap();
    assert!(!pod.to_string().contains("etcd-"), "{pod}");

    let refused = |edit: &dyn Fn(&mut dlock_operator::crd::EtcdBackend)| {
        let mut object = object.clone();
        edit(object.spec.backend.etcd.as_mut().unwrap());
        validate::lock_server(&object, &settings()).unwrap_err()
    };
    let error = refused(&|etcd| etcd.endpoints.push("http://etcd-1.etcd:2379".to_owned()));
    assert_eq!(error.field, "spec.backend.etcd.endpoints[1]");
    assert!(error.message.contains("must be https://"), "{error}");
    let error = refused(&|etcd| etcd.tls_secret = None);
    assert_eq!(error.field, "spec.backend.etcd.endpoints[0]");
    assert!(error.message.contains("tlsSecret"), "{error}");
    let error = refused(&|etcd| etcd.auth.as_mut().unwrap().username = "dl ock".to_owned());
    assert_eq!(error.field, "spec.backend.etcd.auth.username");
    let error = refused(&|etcd| etcd.auth.as_mut().unwrap().password_secret.key = "../x".into());
    assert_eq!(error.field, "spec.backend.etcd.auth.passwordSecret.key");
}

/// maxUnavailable 0, readiness on /readyz (which gates on the backend and, since each service
/// migrates before it listens, on the migrations), the lockdb URL from its Secret.
#[test]
fn the_lock_server_deployment_rolls_without_losing_capacity() {
    let workload = validated_lock_server();
    assert_snapshot("lock-server-deployment", &deployment::deployment(&workload));
}

/// The Cloud SQL Auth Proxy runs as a native sidecar, started before the service.
#[test]
fn the_payment_resource_deployment_has_the_cloud_sql_sidecar_and_its_secrets() {
    let workload = validated_payment_resource();
    assert_snapshot(
        "payment-resource-deployment",
        &deployment::deployment(&workload),
    );
    assert_snapshot(
        "payment-resource-config-map",
        &config_map::config_map(&workload),
    );
}

/// The proxy's pods get the preStop sleep, the read timeout and ten seconds more to stop, or a
/// rollout could cut a forward in flight and leave its outcome unknown.
#[test]
fn the_rail_proxy_deployment_outlasts_the_rail_read_timeout() {
    let rail = validated_rail_proxy();
    assert_eq!(rail.proxy.termination_grace_period_seconds, 5 + 8 + 10);
    assert_snapshot(
        "rail-proxy-deployment",
        &deployment::deployment(&rail.proxy),
    );
    assert_snapshot(
        "rail-proxy-config-map",
        &config_map::config_map(&rail.proxy),
    );
    let stub = rail.stub.expect("the stub is asked for");
    assert_snapshot("rail-stub-deployment", &deployment::deployment(&stub));
    assert_snapshot("rail-stub-config-map", &config_map::config_map(&stub));
}

/// A service's secrets are files mounted from their Secrets, never environment variables: a
/// service refuses to start when its environment sets a security key
/// (services/server/src/config.rs). Each of the three services' containers takes only the log
/// format and the telemetry keys from its environment; its database URL (and the operator token
/// when the spec names one) is a read-only directory mount of the Secret, named in the
/// configuration by the key's `-file` form.
#[test]
fn the_services_secrets_are_files_from_their_secrets_and_the_environment_is_telemetry_only() {
    let settings = settings();
    let lock = validate::lock_server(&fixtures::lock_server(), &settings).unwrap();
    let payment = validate::payment_resource(&fixtures::payment_resource(), &settings).unwrap();
    let proxy = validate::rail_proxy(&fixtures::rail_proxy(), &settings)
        .unwrap()
        .proxy;
    let allowed: Vec<&str> = std::iter::once("DLOCK_LOG_FORMAT")
        .chain(dlock_operator::build::TELEMETRY_KEYS)
        .collect();
    for (workload, files) in [
        (
            &lock,
            vec![("lock.pg.url", "database-url", "lockdb", "url")],
        ),
        (
            &payment,
            vec![
                ("payment.pg.url", "database-url", "paydb", "url"),
                (
                    "payment.operator.token",
                    "operator-token",
                    "operator-token",
                    "token",
                ),
            ],
        ),
        (
            &proxy,
            vec![
                ("rail.proxy.pg.url", "database-url", "paydb", "url"),
                (
                    "rail.proxy.operator-token",
                    "operator-token",
                    "operator-token",
                    "token",
                ),
            ],
        ),
    ] {
        let pod = serde_json::to_value(deployment::deployment(workload)).unwrap()["spec"]
            ["template"]["spec"]
            .clone();
        let container = &pod["containers"][0];
        for var in container["env"].as_array().unwrap() {
            let name = var["name"].as_str().unwrap();
            assert!(allowed.contains(&name), "{}: {var}", workload.name);
            assert!(var["valueFrom"]["secretKeyRef"].is_null(), "{var}");
        }
        for (key, volume, secret, secret_key) in files {
            let dir = format!("/etc/dlock/secrets/{volume}");
            assert!(
                workload
                    .config_toml
                    .contains(&format!("\"{key}-file\" = \"{dir}/{secret_key}\"\n")),
                "{}: {}",
                workload.name,
                workload.config_toml
            );
            assert!(
                !workload.config_toml.contains(&format!("\"{key}\" =")),
                "{}",
                workload.config_toml
            );
            let name = format!("secret-{volume}");
            assert!(
                container["volumeMounts"]
                    .as_array()
                    .unwrap()
                    .contains(&json!({"name": name, "mountPath": dir, "readOnly": true})),
                "{}",
                container["volumeMounts"]
            );
            assert!(
                pod["volumes"]
                    .as_array()
                    .unwrap()
                    .contains(&json!({"name": name, "secret": {"secretName": secret}})),
                "{}",
                pod["volumes"]
            );
        }
    }
}
