//! The operator's tests: builders against whole expected objects, the controllers' conversations
//! with a mocked API server, the generated CRDs and their CEL rules, and the Argo CD health
//! scripts. No API server runs here.

// A test that cannot set itself up should stop right there, with the reason.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod argocd;
mod args;
mod builders;
mod controllers;
mod crd_rules;
mod crds;
mod examples;
mod fixtures;
mod references;
mod telemetry;
mod treasury;
