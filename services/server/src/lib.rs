//! What only the dlock services need (the clients' side lives in `dlock-contract`).

pub mod pg;
