//! The treasury's CLI through the real services of `dlock dev up`: `dlock fundings approve`
//! applies a funding that waits for a second treasury identity and refuses the identity that
//! asked for it (403, nothing changes); `dlock accounts limits` sets limits that paydb then
//! enforces (422 LIMIT_EXCEEDED). Each command reads its token from a file
//! (`--credential-file`), none from the environment.

use super::*;

use dlock_contract::auth::Credential;
use dlock_contract::error::ErrorCode;
use dlock_contract::payment::CreatePayoutRequest;

const THRESHOLD: &str = "100000";
const TREASURY_2: &str = "treasury-2-cli-0123456789abcdef";

/// A funding above the threshold waits; `dlock fundings approve` as the identity that asked is
/// refused (403, the service's message and a hint) and changes nothing; as a second treasury
/// identity it applies the funding, once (the same command again applies nothing more).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dlock_fundings_approve_applies_a_waiting_funding_only_as_a_second_treasury_identity() {
    let stack = DevStack::with_second_treasury(THRESHOLD, TREASURY_2).await;
    let payment = stack.url("paymentResource");
    let files = TokenFiles::new();
    let first = files.write("treasury", &format!("{}\n", stack.token("treasury")));
    let second = files.write("treasury-2", TREASURY_2);

    let pending = large_funding_waits(&stack.treasury_payments(), "acct-cli", "cli").await;
    let pool = stack.pool("paydb").await;
    let balance = "SELECT balance_minor FROM accounts WHERE account_id = 'acct-cli'";
    assert_eq!(scalar(&pool, balance).await, 100_000, "not applied yet");
    let id = pending.funding_id.to_string();

    // The identity that asked: refused with the service's envelope message and a hint.
    stack
        .forbidden_with_hint(
            &["fundings", "approve", &id],
            ("treasury", &first),
            "treasury asked for this funding and may not approve it too",
            "self-approval must fail",
        )
        .await;
    assert_eq!(scalar(&pool, balance).await, 100_000);

    // A second treasury identity applies it.
    let out = approved_by_second(&id, &payment, &second, "the second identity approves");
    assert!(
        out.contains("requested by treasury, approved by treasury-2; balance 5100000"),
        "{out}"
    );
    assert_eq!(scalar(&pool, balance).await, 5_100_000, "applied");
    // The same command again answers the same approval and applies nothing more.
    let out = approved_by_second(&id, &payment, &second, "the same approval again");
    assert!(out.contains("balance 5100000"), "{out}");
    assert_applied_once(&pool, balance, "large-cli").await;
}

/// `dlock accounts limits` as the treasury sets the limits paydb enforces: a payout above the
/// largest single payout is refused with 422 LIMIT_EXCEEDED and written nowhere, one under it is
/// registered; the executor's credential is refused (403 with a hint) and the limits stay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn limits_set_by_dlock_accounts_limits_refuse_a_payout_over_them() {
    let stack = DevStack::up().await;
    let payment = stack.url("paymentResource");
    let files = TokenFiles::new();
    let treasury = files.write("treasury", &stack.token("treasury"));
    let executor = files.write("executor", &stack.token("executor"));
    open_account(&stack.treasury_payments(), "acct-lim", Some(100_000)).await;
    let registrar = stack.registrar_payments();
    let payout = |amount_minor: i64| CreatePayoutRequest {
        payout_id: uuid::Uuid::new_v4(),
        account_id: "acct-lim".to_owned(),
        amount_minor,
        currency: "EUR".to_owned(),
        beneficiary_ref: "ben-lim".to_owned(),
    };
    // Before any limit, 600 registers (the control for the refusal below).
    let unlimited = payout(600);
    registrar
        .create_payout(&format!("create-{}", unlimited.payout_id), &unlimited)
        .await
        .unwrap_or_else(|e| panic!("no limit yet: {e}"));

    let (ok, _, said) = dlock_as(
        &["accounts", "limits", "acct-lim", "--max-payout", "0"],
        &payment,
        "treasury",
        &treasury,
    );
    assert!(
        !ok && said.contains("--max-payout must be a positive amount"),
        "{said}"
    );
    let (ok, out, said) = dlock_as(
        &[
            "accounts",
            "limits",
            "acct-lim",
            "--max-payout",
            "500",
            "--daily-outflow",
            "1000",
        ],
        &payment,
        "treasury",
        &treasury,
    );
    assert!(ok, "the treasury sets limits: {said}");
    assert!(
        out.contains("account acct-lim: max payout 500, daily outflow 1000 (set by treasury)"),
        "{out}"
    );

    let over = payout(600);
    let before = stack.snapshot().await;
    let refused = registrar
        .create_payout(&format!("create-{}", over.payout_id), &over)
        .await
        .err()
        .unwrap_or_else(|| panic!("a payout over the limit is refused"));
    assert_eq!(refused.code(), Some(ErrorCode::LimitExceeded), "{refused}");
    assert!(refused.to_string().starts_with("422 "), "{refused}");
    assert_eq!(before, stack.snapshot().await, "the refusal wrote nothing");
    let under = payout(500);
    registrar
        .create_payout(&format!("create-{}", under.payout_id), &under)
        .await
        .unwrap_or_else(|e| panic!("at the limit: {e}"));

    // The executor's credential is no treasury's: refused, with a hint, and the limits stay.
    stack
        .forbidden_with_hint(
            &["accounts", "limits", "acct-lim"],
            ("executor", &executor),
            "this credential's identity has no treasury role",
            "the executor may not set limits",
        )
        .await;
    let still = payout(600);
    let refused = PaymentClient::new(&payment, "registrar/again")
        .unwrap_or_else(|e| panic!("{e}"))
        .with_credential(Some(Credential::fixed(&stack.token("registrar"))))
        .create_payout(&format!("create-{}", still.payout_id), &still)
        .await
        .err()
        .unwrap_or_else(|| panic!("the limit is still in force"));
    assert_eq!(refused.code(), Some(ErrorCode::LimitExceeded), "{refused}");
}
