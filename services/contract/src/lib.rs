//! The dlock wire contract.
//!
//! Every service and every client speaks through this crate, so that the error envelope, the
//! header rules, the timestamp format and the JSON conventions exist exactly once. A service that
//! built its own 404 page or parsed `X-Fencing-Token` by itself would be the first place where two
//! services disagree about what a malformed token means, and a malformed token coerced to `0` is
//! precisely how a stale writer slips below every fence.

pub mod address_map;
pub mod auth;
pub mod batch;
pub mod client;
pub mod error;
pub mod group_commit;
pub mod headers;
pub mod http;
pub mod json;
pub mod lock;
pub mod openapi;
pub mod payment;
pub mod payment_client;
pub mod payout_batch;
pub mod proof;
pub mod rail;
pub mod reconcile;
pub mod revoke;
pub mod service_config;
pub mod session;
pub mod time;
pub mod tls;
pub mod trace;

pub use error::{ApiError, ErrorBody, ErrorCode, FieldError};
pub use json::Json;
