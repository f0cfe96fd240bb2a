//! The dlock Kubernetes operator (docs/design.md#kubernetes): the custom resources of
//! `dlock.io/v1alpha1`, their controllers, and the pure builders of everything the controllers
//! apply.

pub mod build;
pub mod controller;
pub mod crd;
pub mod metrics;
pub mod run;
pub mod services;
pub mod validate;
pub mod workload;

pub use run::{OperatorArgs, run};
