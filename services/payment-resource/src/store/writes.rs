//! The money-moving writes: each is one call of a paydb function, inside the transaction that
//! holds the request's idempotency record, and each answers its operation's outcome enum.

use dlock_contract::payment::PayoutState;
use sqlx::PgConnection;
use uuid::Uuid;

use super::outcome::{
    AbandonOutcome, AbandonRow, AdvanceOutcome, ClaimOutcome, ClaimRow, CreateAccountOutcome,
    CreatePayoutOutcome, FenceRow, FundOutcome, LowerOutcome, LowerRow, PostOutcome, PostRow,
    ResolveOutcome, ResolveRow,
};
use super::{PayStore, StoreResult, map_sqlx};

/// Who makes an operator write (a fence lowering, a cancel) and why, for its audit row.
pub use dlock_server::pg::Audit;

/// One call of a paydb function in the request's transaction: its row, bound with `$arg`s in
/// order, or what the failure means ([`map_sqlx`]).
macro_rules! call {
    ($conn:expr, $sql:expr $(, $arg:expr)* $(,)?) => {
        sqlx::query_as($sql)
            $(.bind($arg))*
            .fetch_one($conn)
            .await
            .map_err(map_sqlx)
    };
}

impl PayStore {
    pub async fn create_account(
        conn: &mut PgConnection,
        account_id: &str,
        currency: &str,
    ) -> StoreResult<CreateAccountOutcome> {
        let (outcome, existing): (String, String) = call!(
            conn,
            "SELECT outcome, currency::text FROM pay_create_account($1, $2::char(3))",
            account_id,
            currency
        )?;
        CreateAccountOutcome::parse(&outcome, existing)
    }

    pub async fn fund(
        conn: &mut PgConnection,
        account_id: &str,
        amount_minor: i64,
        reference: &str,
    ) -> StoreResult<FundOutcome> {
        let (outcome, balance): (String, Option<i64>) = call!(
            conn,
            "SELECT outcome, balance_minor FROM pay_fund($1, $2, $3)",
            account_id,
            amount_minor,
            reference
        )?;
        FundOutcome::parse(&outcome, balance)
    }

    pub async fn create_payout(
        conn: &mut PgConnection,
        payout_id: Uuid,
        account_id: &str,
        amount_minor: i64,
        currency: &str,
        beneficiary_ref: &str,
    ) -> StoreResult<CreatePayoutOutcome> {
        let (outcome,): (String,) = call!(
            conn,
            "SELECT outcome FROM pay_create_payout($1, $2, $3, $4::char(3), $5)",
            payout_id,
            account_id,
            amount_minor,
            currency,
            beneficiary_ref
        )?;
        CreatePayoutOutcome::parse(&outcome)
    }

    /// P2: `fence < token` then `fence = token`, the state check and the funds check, in one
    /// function under the payout's and the account's row locks. A payout already claimed
    /// `max_attempts` times is abandoned instead (outcome `abandoned`), by the same function.
    pub async fn claim(
        conn: &mut PgConnection,
        payout_id: Uuid,
        token: i64,
        expected_state: PayoutState,
        max_attempts: i32,
        owner_id: &str,
    ) -> StoreResult<ClaimOutcome> {
        let row: ClaimRow = call!(
            conn,
            "SELECT outcome, state, fence, attempt_count, claim_token, account_id, \
                    available_minor, amount_minor FROM pay_claim_bounded($1, $2, $3, $4, $5)",
            payout_id,
            token,
            expected_state.as_str(),
            max_attempts,
            owner_id
        )?;
        row.into_outcome("pay_claim_bounded")
    }

    /// Cancels a PENDING or CLAIMED payout: ABANDONED under a fenced token (`fence < token`,
    /// the fence advances), recorded in `payout_abandonments`. The database refuses it once an
    /// attempt reached the rail proxy. `proven`: the token's proof was verified.
    pub async fn abandon(
        conn: &mut PgConnection,
        payout_id: Uuid,
        token: i64,
        expected_state: PayoutState,
        proven: bool,
        audit: &Audit<'_>,
    ) -> StoreResult<AbandonOutcome> {
        let row: AbandonRow = call!(
            conn,
            "SELECT outcome, state, fence, attempt_count, account_id \
             FROM pay_abandon($1, $2, $3, 'cancelled', $4, $5, $6, $7, $8)",
            payout_id,
            token,
            expected_state.as_str(),
            audit.owner_id,
            audit.identity,
            audit.operator,
            audit.reason,
            proven
        )?;
        row.into_outcome()
    }

    /// P3: `fence <= token`, RAIL_ACKED -> POSTED and the two ledger rows, in one function.
    pub async fn post(
        conn: &mut PgConnection,
        payout_id: Uuid,
        token: i64,
        rail_reference: &str,
        submission_id: Uuid,
    ) -> StoreResult<PostOutcome> {
        let row: PostRow = call!(
            conn,
            "SELECT outcome, state, fence, account_id, balance_minor FROM pay_post($1, $2, $3, $4)",
            payout_id,
            token,
            rail_reference,
            submission_id
        )?;
        row.into_outcome("pay_post")
    }

    pub async fn advance_fence(
        conn: &mut PgConnection,
        account_id: &str,
        floor: i64,
        revocation_id: Uuid,
        audit: &Audit<'_>,
    ) -> StoreResult<AdvanceOutcome> {
        let row: FenceRow = call!(
            conn,
            "SELECT outcome, previous_fence, fence \
             FROM pay_advance_fence($1, $2, $3, $4, $5, $6, $7)",
            account_id,
            floor,
            audit.operator,
            audit.reason,
            revocation_id,
            audit.owner_id,
            audit.identity
        )?;
        row.into_advance()
    }

    /// `audit.reason` is the operator's evidence from the rail statement.
    pub async fn resolve(
        conn: &mut PgConnection,
        payout_id: Uuid,
        outcome: PayoutState,
        rail_reference: Option<&str>,
        audit: &Audit<'_>,
    ) -> StoreResult<ResolveOutcome> {
        let row: ResolveRow = call!(
            conn,
            "SELECT outcome, state, balance_minor, recorded_outcome, recorded_reference, \
                    submission_id FROM pay_resolve($1, $2, $3, $4, $5, $6, $7)",
            payout_id,
            outcome.as_str(),
            rail_reference,
            audit.operator,
            audit.reason,
            audit.owner_id,
            audit.identity
        )?;
        row.into_outcome()
    }

    /// docs/design.md#d-8 recovery: lowers a poisoned account fence to `to`, recorded in
    /// `fence_recoveries`; never below the highest token the account admitted with a proof
    /// (`max_seen_token`).
    pub async fn lower_fence(
        conn: &mut PgConnection,
        account_id: &str,
        to: i64,
        audit: &Audit<'_>,
    ) -> StoreResult<LowerOutcome> {
        let sql = "SELECT outcome, previous_fence, fence, recovery_id, seen_token \
                   FROM pay_lower_fence($1, $2, $3, $4, $5, $6)";
        let row: LowerRow = audit
            .lowering(sql, account_id, to)
            .fetch_one(conn)
            .await
            .map_err(map_sqlx)?;
        row.into_outcome()
    }
}
