//! Test code both suites use (`it` and `k8s`): accounts opened and funded, `dlock dev up` as a process, raw HTTP
//! requests, payout batches and payouts written as the executor writes them, and a spawned service waited for until
//! it serves.

pub mod accounts;
pub mod dev_up;
pub mod http;
pub mod payouts;
pub mod process;
