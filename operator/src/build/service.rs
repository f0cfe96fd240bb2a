use k8s_openapi::api::core::v1::{Service, ServicePort, ServiceSpec};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

use crate::workload::{PORT, Workload};

pub fn service(workload: &Workload) -> Service {
    Service {
        metadata: super::workload_meta(workload, workload.name.clone()),
        spec: Some(ServiceSpec {
            selector: Some(super::selector_labels(
                workload.component,
                &workload.instance,
            )),
            ports: Some(vec![ServicePort {
                name: Some("http".to_owned()),
                port: PORT,
                target_port: Some(IntOrString::String("http".to_owned())),
                protocol: Some("TCP".to_owned()),
                ..ServicePort::default()
            }]),
            ..ServiceSpec::default()
        }),
        ..Service::default()
    }
}
