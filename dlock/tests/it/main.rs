//! dlock's integration tests: real PostgreSQL, real etcd and real HTTP, started by the harness.

mod auth;
mod bad_input;
mod chaos;
mod conformance;
mod crash;
mod exclusion;
mod expiry;
mod harness;
mod netfault;
mod payment;
mod rail;
