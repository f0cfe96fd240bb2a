//! dlock's integration tests: real PostgreSQL, real etcd and real HTTP, started by the harness.

mod auth;
mod bad_input;
mod batches;
mod chaos;
mod conformance;
mod crash;
mod dev_env;
mod environment;
mod etcd_leader;
mod etcd_restore;
mod etcd_tls;
mod exclusion;
mod executor_deadline;
mod executor_registration;
mod executor_report;
mod expiry;
mod failover;
mod hardening;
mod harness;
mod history;
mod lock_group_commit;
mod lock_owner;
mod monitoring;
mod netfault;
mod outcome_unknown;
mod outcome_unknown_revoke;
mod payment;
mod payment_hygiene;
mod pg_tls;
mod proof;
mod rail;
mod rail_reason;
mod rail_replay;
mod rail_statement;
mod rail_stub_auth;
mod rail_validation;
mod reconcile_findings;
mod recovery_evidence;
mod safe_defaults;
/// What both test binaries use (dlock/tests/shared).
#[path = "../shared/mod.rs"]
mod shared;
mod squash;
mod steps;
mod traces;
mod waiters;
