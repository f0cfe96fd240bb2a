//! Custom resources for the tests, as builders: `fixtures::lock_server().paused()`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use dlock_operator::crd::*;
use kube::api::ObjectMeta;
use serde::Serialize;

pub const NAMESPACE: &str = "default";
pub const IMAGE: &str = "dlock:test";
/// An image the fixture's platform allows besides [`IMAGE`].
pub const ALLOWED_IMAGE: &str = "registry.example/dlock:pinned";
pub const OPERATOR_IDENTITY: &str = "system:serviceaccount:dlock-system:dlock-operator";
pub const NOW: &str = "2026-12-02T17:00:00Z";

/// What the fixtures' PaymentResource lets a batch pick for its executor: the ServiceAccount
/// `payroll-runner` and the Secret `executor-credential`.
pub fn executor_allowance() -> dlock_operator::validate::ExecutorAllowance {
    dlock_operator::validate::ExecutorAllowance {
        service_accounts: vec!["payroll-runner".to_owned()],
        credential_secrets: vec!["executor-credential".to_owned()],
        payment_resource: "payment-resource".to_owned(),
    }
}

/// The credential Secret [`executor_allowance`] lists: `executor-credential`, key `token`.
pub fn executor_credential() -> SecretKeyRef {
    SecretKeyRef {
        name: "executor-credential".to_owned(),
        key: "token".to_owned(),
    }
}

/// An executor authenticating with [`executor_credential`] as the identity `executor`.
pub fn executor_with_credential() -> ExecutorSpec {
    ExecutorSpec {
        identity: Some("executor".to_owned()),
        credential_secret: Some(executor_credential()),
        service_account_name: None,
    }
}

/// The lock a lock server holds in the mirror tests, as its held-locks list carries it.
pub fn held_lock() -> dlock_contract::lock::LockGrant {
    dlock_contract::lock::LockGrant {
        key: "payout:acct-17".to_owned(),
        owner_id: "executor-7".to_owned(),
        session_id: uuid::Uuid::from_u128(7),
        fencing_token: 42,
        acquired_at: "2026-12-02T16:59:00.250Z".parse().unwrap(),
        expires_at: "2026-12-02T17:00:10Z".parse().unwrap(),
        fencing_proof: None,
    }
}

pub fn settings() -> dlock_operator::validate::Settings {
    dlock_operator::validate::Settings {
        image: IMAGE.to_owned(),
        operator_identity: OPERATOR_IDENTITY.to_owned(),
        operator_namespace: "dlock-system".to_owned(),
        allowed_images: vec![ALLOWED_IMAGE.to_owned()],
        service_account_roles: Vec::new(),
    }
}

pub fn meta(name: &str, uid: &str) -> ObjectMeta {
    ObjectMeta {
        name: Some(name.to_owned()),
        namespace: Some(NAMESPACE.to_owned()),
        uid: Some(uid.to_owned()),
        generation: Some(1),
        ..ObjectMeta::default()
    }
}

pub fn secret(name: &str, key: &str) -> SecretKeyRef {
    SecretKeyRef {
        name: name.to_owned(),
        key: key.to_owned(),
    }
}

pub fn lock_server() -> LockServer {
    LockServer {
        metadata: meta("lock-server", "uid-lock-server"),
        spec: LockServerSpec {
            backend: LockBackend {
                type_: BackendType::Pg,
                pg: Some(PgBackend {
                    url_secret: secret("lockdb", "url"),
                }),
                etcd: None,
            },
            service: ServiceSettings::default(),
        },
        status: None,
    }
}

pub fn etcd_backend() -> LockBackend {
    LockBackend {
        type_: BackendType::Etcd,
        pg: None,
        etcd: Some(EtcdBackend {
            endpoints: vec!["https://etcd-0.etcd:2379".to_owned()],
            tls_secret: Some("etcd-client-tls".to_owned()),
            auth: Some(EtcdAuth {
                username: "dlock".to_owned(),
                password_secret: secret("etcd-dlock-user", "password"),
            }),
        }),
    }
}

pub fn payment_resource() -> PaymentResource {
    PaymentResource {
        metadata: meta("payment-resource", "uid-payment-resource"),
        spec: PaymentResourceSpec {
            database_url_secret: secret("paydb", "url"),
            operator_token_secret: Some(secret("operator-token", "token")),
            treasury: None,
            executor_service_accounts: None,
            executor_credential_secrets: None,
            service: ServiceSettings {
                replicas: Some(3),
                cloud_sql: Some(CloudSql {
                    instance_connection_name: "acme:europe-west1:paydb".to_owned(),
                    image: None,
                }),
                // From the spec: requests and limits as given, and the pull secrets.
                pod: PodOptions {
                    resources: Some(
                        serde_json::from_value(serde_json::json!({
                            "requests": {"cpu": "250m", "memory": "256Mi"},
                            "limits": {"cpu": "1", "memory": "1Gi"},
                        }))
                        .unwrap(),
                    ),
                    image_pull_secrets: Some(vec![
                        k8s_openapi::api::core::v1::LocalObjectReference {
                            name: "regcred".to_owned(),
                        },
                    ]),
                },
                ..ServiceSettings::default()
            },
        },
        status: None,
    }
}

pub fn rail_proxy() -> RailProxy {
    RailProxy {
        metadata: meta("rail-proxy", "uid-rail-proxy"),
        spec: RailProxySpec {
            database_url_secret: secret("paydb", "url"),
            rail_url: None,
            read_timeout_ms: Some(8_000),
            operator_token_secret: Some(secret("operator-token", "token")),
            service: ServiceSettings::default(),
            stub: Some(RailStubSpec {
                latency_ms: Some(200),
                failure_rate: Some(0.05),
                duplicate_ack_rate: Some(0.01),
                resources: None,
            }),
        },
        status: None,
    }
}

pub fn payout_item(key: &str, account: &str, amount_minor: i64) -> PayoutItem {
    PayoutItem {
        key: key.to_owned(),
        account_id: account.to_owned(),
        amount_minor,
        currency: "EUR".to_owned(),
        beneficiary_ref: format!("ben-{key}"),
    }
}

pub fn payout_batch() -> PayoutBatch {
    PayoutBatch {
        metadata: meta("payroll-2026-12", "uid-batch"),
        spec: PayoutBatchSpec {
            workers: Some(8),
            batch_max: None,
            payouts: vec![
                payout_item("emp-0001", "acct-17", 125_000),
                payout_item("emp-0002", "acct-18", 98_000),
            ],
            lock_server: None,
            payment_resource: None,
            rail_proxy: None,
            image: None,
            executor: None,
            pod: PodOptions::default(),
        },
        status: None,
    }
}

pub fn lock() -> Lock {
    let mut lock = Lock {
        metadata: meta("payout-acct-17-0a1b2c3d", "uid-lock"),
        spec: LockSpec {
            key: "payout:acct-17".to_owned(),
            lock_server: "lock-server".to_owned(),
            account_id: "acct-17".to_owned(),
        },
        status: Some(LockStatus {
            holder: Some("executor-7".to_owned()),
            token: Some(41),
            ..LockStatus::default()
        }),
    };
    lock.metadata.labels = Some(BTreeMap::from([(
        "dlock.io/lock-server".to_owned(),
        "lock-server".to_owned(),
    )]));
    lock
}

/// `lock` with the annotations that ask the operator to revoke it (`kubectl annotate`).
pub fn revoke_asked(lock: Lock) -> Lock {
    with_annotations(
        lock,
        &[
            ("dlock.io/revoke-reason", "worker wedged past its lease"),
            ("dlock.io/revoked-by", "oncall"),
        ],
    )
}

pub fn with_annotations<K: kube::Resource>(mut object: K, pairs: &[(&str, &str)]) -> K {
    let annotations = object
        .meta_mut()
        .annotations
        .get_or_insert_with(BTreeMap::new);
    for (key, value) in pairs {
        annotations.insert((*key).to_owned(), (*value).to_owned());
    }
    object
}

pub fn paused<K: kube::Resource>(object: K) -> K {
    with_annotations(object, &[("dlock.io/reconcile", "paused")])
}

pub fn snapshot_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/snapshots")
}

/// Compares `value`, as YAML, with the committed snapshot `tests/snapshots/<name>.yaml`.
/// `UPDATE_SNAPSHOTS=1` rewrites the snapshot instead (review the diff before committing).
pub fn assert_snapshot(name: &str, value: &impl Serialize) {
    let path = snapshot_dir().join(format!("{name}.yaml"));
    let actual = serde_yaml_ng::to_string(value).expect("serializes");
    if std::env::var_os("UPDATE_SNAPSHOTS").is_some() {
        std::fs::write(&path, &actual).expect("writes the snapshot");
        return;
    }
    let expected = std::fs::read_to_string(&path).unwrap_or_else(|_| {
        panic!(
            "no snapshot {}: run `UPDATE_SNAPSHOTS=1 cargo nextest run -p dlock-operator` and review it",
            path.display()
        )
    });
    assert_eq!(
        actual,
        expected,
        "{name} differs from {}; if the change is intended, rerun with UPDATE_SNAPSHOTS=1",
        path.display()
    );
}

pub fn reconciliation(schedule: Option<&str>) -> Reconciliation {
    Reconciliation {
        metadata: meta("hourly", "uid-reconciliation"),
        spec: ReconciliationSpec {
            database_url_secret: secret("paydb", "url"),
            rail_url: None,
            schedule: schedule.map(str::to_owned),
            rail_proxy: None,
            image: None,
            pod: PodOptions::default(),
        },
        status: None,
    }
}
