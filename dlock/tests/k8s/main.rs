//! dlock on a real Kubernetes control plane: kube-apiserver, kube-controller-manager and
//! kube-scheduler built from the upstream Go modules, etcd, and KWOK for nodes and pods
//! (services/devstack/src/kube.rs). The operator runs as a separate process under the chart's
//! RBAC, the services as real processes, and the pods of Jobs as local processes (kubelet.rs).
//! The real_pods scenarios run everything as pods instead, on a real node (real_node.rs:
//! containerd, runc, the kubelet, kube-proxy, CoreDNS), installed with helm.
//!
//! Run with `./scripts/test-k8s` (it builds the control plane once, cached by version); the
//! default `./scripts/test` leaves this binary out because it needs Go.

mod contract_rules;
mod control_plane;
mod executor_identity;
mod kubelet;
mod lock_revocation;
mod locks;
mod monitoring;
mod operations;
mod payout_batch;
mod pinned_images;
mod plugin;
mod real_node;
mod real_pods;
mod reconciliation;
mod references;
mod revoke;
mod revoke_live;
mod service_auth;
mod service_roles;
/// What both test binaries use (dlock/tests/shared).
#[path = "../shared/mod.rs"]
mod shared;
mod stack;
mod tls_pods;
mod watch_namespaces;
mod world;
