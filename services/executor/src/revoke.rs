//! Forced revocation (docs/design.md#d-3) is the contract's flow, [`dlock_contract::revoke`],
//! shared with the operator: `dlock revoke` and the Lock and LockRevocation controllers run the
//! same steps (L8, then the payment resource's account fence, then the rail proxy's high-water
//! mark), the same idempotency key and the same resumption from a recorded [`Progress`].
//! Re-exported here for the executor's callers.

pub use dlock_contract::revoke::{
    FenceStep, LockStep, Outcome, Progress, RevokeClients, RevokeOrder, RevokeReport,
    account_of_key, fence_idempotency_key, run,
};
