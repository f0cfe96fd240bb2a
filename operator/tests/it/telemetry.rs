//! The `dlock-telemetry` ConfigMap reaches a pod key by key: only the telemetry settings named in
//! `build::TELEMETRY_KEYS`, never the whole map, so whoever may write a ConfigMap in the namespace
//! cannot set a security setting (`DLOCK_AUTH_MODE`, the proof keys, a rail or API server URL)
//! of a dlock pod through it.

use dlock_operator::build::{self, TELEMETRY_CONFIG_MAP, TELEMETRY_KEYS};
use dlock_operator::validate;
use k8s_openapi::api::core::v1::PodSpec;

use crate::fixtures::{self, settings};

/// Every container of `spec`: no `envFrom`, and every variable it takes from a ConfigMap is a
/// telemetry key read from the telemetry ConfigMap under its own name.
fn assert_key_by_key(what: &str, spec: &PodSpec) {
    for container in &spec.containers {
        assert_eq!(
            container.env_from, None,
            "{what}: {} reads a whole map",
            container.name
        );
        let from_config_maps: Vec<&str> = container
            .env
            .iter()
            .flatten()
            .filter_map(|var| {
                let selector = var.value_from.as_ref()?.config_map_key_ref.as_ref()?;
                // Other ConfigMaps read here are the operator's own (the rail proxy's settings).
                if selector.name != TELEMETRY_CONFIG_MAP {
                    return None;
                }
                assert_eq!(
                    selector.key, var.name,
                    "{what}: {} under another name",
                    var.name
                );
                assert_eq!(selector.optional, Some(true), "{what}: {}", var.name);
                Some(var.name.as_str())
            })
            .collect();
        // Positive control: the telemetry settings do reach the container.
        assert_eq!(
            from_config_maps, TELEMETRY_KEYS,
            "{what}: {}",
            container.name
        );
        assert!(
            from_config_maps
                .iter()
                .all(|name| !name.starts_with("DLOCK_AUTH")
                    && !name.contains("PROOF")
                    && !name.contains("URL")),
            "{what}: a security setting can come from the ConfigMap: {from_config_maps:?}"
        );
    }
}

#[test]
fn every_pod_takes_only_the_telemetry_keys_from_the_telemetry_config_map() {
    let settings = settings();
    let lock = validate::lock_server(&fixtures::lock_server(), &settings).unwrap();
    let payments = validate::payment_resource(&fixtures::payment_resource(), &settings).unwrap();
    let rail = validate::rail_proxy(&fixtures::rail_proxy(), &settings).unwrap();
    for workload in [&lock, &payments, &rail.proxy] {
        let deployment = build::deployment::deployment(workload);
        let spec = deployment.spec.unwrap().template.spec.unwrap();
        assert_key_by_key(&workload.name, &spec);
    }
    let batch =
        validate::payout_batch(&fixtures::payout_batch(), &settings, &Default::default()).unwrap();
    let job = build::job::executor_job(&batch);
    assert_key_by_key("executor Job", &job.spec.unwrap().template.spec.unwrap());
}
