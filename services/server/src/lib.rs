//! What only the dlock services need; the clients' side, and everything on the wire, is
//! `dlock-contract`. A client (the executor, the operator, the CLI) has no use for any of this.

pub mod auth;
pub mod batch;
pub mod checks;
pub mod config;
pub mod extract;
/// The group-commit queue lives in the contract crate, which its clients share
/// (services/contract/src/group_commit.rs); re-exported for the services.
pub use dlock_contract::group_commit;
pub mod http;
pub mod idempotency;
pub mod metrics;
pub mod openapi;
pub mod pg;
pub mod proof;
pub mod registry;
pub mod squash;
pub mod sweep;
pub mod tls;
pub mod trace;
pub mod watch;

/// Logs, once at start, what a service checks: its callers' credentials and, where it has them,
/// fencing proofs.
pub fn announce(service: &str, auth: &auth::Authenticator, proof_keys: Option<&proof::ProofKeys>) {
    auth.announce(service);
    proof::announce(proof_keys, service);
}
