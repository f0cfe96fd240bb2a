use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::ConfigMap;

use crate::workload::Workload;

/// The file name of a service's configuration inside `/config`.
pub const CONFIG_FILE: &str = "config.toml";

/// The service's TOML configuration. Secrets never go here: they reach the container as
/// `DLOCK_…` environment overrides from Secret references.
pub fn config_map(workload: &Workload) -> ConfigMap {
    ConfigMap {
        metadata: super::workload_meta(workload, workload.name.clone()),
        data: Some(BTreeMap::from([(
            CONFIG_FILE.to_owned(),
            workload.config_toml.clone(),
        )])),
        ..ConfigMap::default()
    }
}
