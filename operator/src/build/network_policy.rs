use std::collections::BTreeMap;

use k8s_openapi::api::networking::v1::{
    NetworkPolicy, NetworkPolicyIngressRule, NetworkPolicyPeer, NetworkPolicyPort,
    NetworkPolicySpec,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

use crate::workload::{Component, Workload};

fn dlock_pods(component: &str) -> LabelSelector {
    LabelSelector {
        match_labels: Some(BTreeMap::from([
            ("app.kubernetes.io/name".to_owned(), "dlock".to_owned()),
            (
                "app.kubernetes.io/component".to_owned(),
                component.to_owned(),
            ),
        ])),
        ..LabelSelector::default()
    }
}

/// An ingress policy on `workload`'s pods: only `from` reach its `http` port.
fn ingress_only_from(workload: &Workload, from: Vec<NetworkPolicyPeer>) -> NetworkPolicy {
    NetworkPolicy {
        metadata: super::workload_meta(workload, workload.name.clone()),
        spec: Some(NetworkPolicySpec {
            pod_selector: Some(LabelSelector {
                match_labels: Some(super::selector_labels(
                    workload.component,
                    &workload.instance,
                )),
                ..LabelSelector::default()
            }),
            policy_types: Some(vec!["Ingress".to_owned()]),
            ingress: Some(vec![NetworkPolicyIngressRule {
                from: Some(from),
                ports: Some(vec![NetworkPolicyPort {
                    port: Some(IntOrString::String("http".to_owned())),
                    protocol: Some("TCP".to_owned()),
                    ..NetworkPolicyPort::default()
                }]),
            }]),
            ..NetworkPolicySpec::default()
        }),
    }
}

fn pods(selector: LabelSelector) -> NetworkPolicyPeer {
    NetworkPolicyPeer {
        pod_selector: Some(selector),
        ..NetworkPolicyPeer::default()
    }
}

/// Who reaches a service's port (lock server, payment resource, rail proxy): the executor pods
/// and the reconciler pods of its namespace, and the operator's pods in the operator's namespace
/// (selected by `kubernetes.io/metadata.name`, which the API server sets on every namespace).
/// Nothing else in the cluster can even try a credential. Kubelet's probes are not affected.
pub fn service_network_policy(workload: &Workload, operator_namespace: &str) -> NetworkPolicy {
    ingress_only_from(
        workload,
        vec![
            pods(dlock_pods("executor")),
            pods(dlock_pods("reconciler")),
            NetworkPolicyPeer {
                namespace_selector: Some(LabelSelector {
                    match_labels: Some(BTreeMap::from([(
                        "kubernetes.io/metadata.name".to_owned(),
                        operator_namespace.to_owned(),
                    )])),
                    ..LabelSelector::default()
                }),
                ..pods(dlock_pods("operator"))
            },
        ],
    )
}

/// Only the rail proxy's pods reach the rail stub: any other caller of the rail would bypass the
/// durable high-water mark and the intent row (enforcement point (c)). The reconciler's pods
/// reach it too, to read the statement it compares paydb with.
pub fn rail_network_policy(stub: &Workload, proxy_instance: &str) -> NetworkPolicy {
    ingress_only_from(
        stub,
        vec![
            pods(LabelSelector {
                match_labels: Some(super::selector_labels(Component::RailProxy, proxy_instance)),
                ..LabelSelector::default()
            }),
            // The reconciler reads the statement (`GET /statement`); it submits nothing.
            pods(dlock_pods("reconciler")),
        ],
    )
}
