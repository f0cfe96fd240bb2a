//! NetworkPolicies: who may reach a service's port, and who may reach the rail stub.

use super::*;

/// Only the rail proxy's pods may reach the stub: any other caller would bypass the proxy's
/// durable high-water mark. The reconciler's pods may too, to read the statement.
#[test]
fn only_the_rail_proxy_and_the_reconciler_reach_the_rail_stub() {
    let rail = validated_rail_proxy();
    let stub = rail.stub.expect("the stub is asked for");
    assert_json(
        &network_policy::rail_network_policy(&stub, &rail.proxy.instance),
        json!({
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": object_meta("rail-proxy-stub", labels("rail-stub", "rail-proxy"), owner("RailProxy", "rail-proxy", "uid-rail-proxy")),
            "spec": {
                "podSelector": {"matchLabels": selector("rail-stub", "rail-proxy")},
                "policyTypes": ["Ingress"],
                "ingress": [{
                    "from": [
                        {"podSelector": {"matchLabels": selector("rail-proxy", "rail-proxy")}},
                        // The reconciler reads the rail statement.
                        {"podSelector": {"matchLabels": {
                            "app.kubernetes.io/component": "reconciler",
                            "app.kubernetes.io/name": "dlock",
                        }}},
                    ],
                    "ports": [{"port": "http", "protocol": "TCP"}],
                }],
            },
        }),
    );
}

/// Only the executor and reconciler pods of the namespace and the operator's pods (in the
/// operator's namespace, by `kubernetes.io/metadata.name`) reach a service's port.
#[test]
fn only_executors_reconcilers_and_the_operator_reach_a_services_port() {
    let pods = |component: &str| {
        json!({"matchLabels": {
            "app.kubernetes.io/component": component,
            "app.kubernetes.io/name": "dlock",
        }})
    };
    assert_json(
        &network_policy::service_network_policy(&validated_payment_resource(), "dlock-system"),
        workload_object(
            ("networking.k8s.io/v1", "NetworkPolicy"),
            ("PaymentResource", "payment-resource"),
            json!({"spec": {
                "podSelector": {"matchLabels": selector("payment-resource", "payment-resource")},
                "policyTypes": ["Ingress"],
                "ingress": [{
                    "from": [
                        {"podSelector": pods("executor")},
                        {"podSelector": pods("reconciler")},
                        {
                            "namespaceSelector": {"matchLabels": {
                                "kubernetes.io/metadata.name": "dlock-system",
                            }},
                            "podSelector": pods("operator"),
                        },
                    ],
                    "ports": [{"port": "http", "protocol": "TCP"}],
                }],
            }}),
        ),
    );
}
