use k8s_openapi::api::policy::v1::{PodDisruptionBudget, PodDisruptionBudgetSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

use crate::workload::Workload;

/// At most one pod of a workload is evicted at a time; with one replica a drain still proceeds
/// (the Deployment's surge pod takes over), with more the others keep serving.
pub fn pdb(workload: &Workload) -> PodDisruptionBudget {
    PodDisruptionBudget {
        metadata: super::workload_meta(workload, workload.name.clone()),
        spec: Some(PodDisruptionBudgetSpec {
            max_unavailable: Some(IntOrString::Int(1)),
            selector: Some(LabelSelector {
                match_labels: Some(super::selector_labels(
                    workload.component,
                    &workload.instance,
                )),
                ..LabelSelector::default()
            }),
            ..PodDisruptionBudgetSpec::default()
        }),
        ..PodDisruptionBudget::default()
    }
}
