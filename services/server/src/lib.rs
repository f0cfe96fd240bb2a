//! What only the dlock services need; the clients' side, and everything on the wire, is
//! `dlock-contract`. A client (the executor, the operator, the CLI) has no use for any of this.

pub mod auth;
pub mod config;
pub mod http;
pub mod pg;
pub mod proof;
pub mod tls;
pub mod trace;
