//! The payout job as a user runs it: the PayoutBatch manifest, the executor (`dlock run`) and the
//! reconciler (`dlock reconcile`). The revocation flow (`dlock revoke`) is the contract's,
//! [`dlock_contract::revoke`].

pub mod cancel;
pub mod executor;
pub mod manifest;
pub mod metrics;
pub mod progress;
pub mod reconcile;

pub use executor::{Endpoints, Report, RunOptions, execute, register};
pub use manifest::PayoutBatch;
