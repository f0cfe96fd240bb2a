//! The payout job as a user runs it: the PayoutBatch manifest, the executor (`dlock run`), the
//! reconciler (`dlock reconcile`) and the revocation flow (`dlock revoke`).

pub mod cancel;
pub mod executor;
pub mod manifest;
pub mod metrics;
pub mod progress;
pub mod reconcile;
pub mod revoke;

pub use executor::{Endpoints, Report, RunOptions, execute, register};
pub use manifest::PayoutBatch;
