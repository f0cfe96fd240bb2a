//! Roles, per-account limits and the second approval of a large funding, through the real
//! services of `dlock dev up` (docs/threat-model.md#roles): an identity does only what its
//! role allows and a refusal changes nothing in paydb, lockdb or the rail's statement.

use super::*;

use dlock_contract::auth::Credential;
use dlock_contract::client::LockClient;

use crate::harness::{hold, release, session};
use crate::shared::payouts::register_payout;

const STRANGER: &str = "stranger-0123456789abcdef";
const AUDITOR: &str = "auditor-0123456789abcdef";
const TREASURY_2: &str = "treasury-2-0123456789abcdef";

/// An identity with no role is 403 on every write and every read but the probes; the executor
/// cannot register payouts, fund, set limits or approve; the registrar cannot claim or submit;
/// a reader only reads. Nothing refused changes paydb, lockdb or the statement; the registrar
/// and the executor together still pay a batch (positive control).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_identity_does_only_what_its_role_allows_and_a_refusal_changes_nothing() {
    let stack = DevStack::up().await;
    let (lock, payment, proxy) = stack.services();
    let executor = stack.token("executor");
    let registrar = stack.token("registrar");
    let treasury = stack.token("treasury");
    stack
        .add_tokens(&[("stranger", STRANGER, ""), ("auditor", AUDITOR, "reader")])
        .await;
    open_account(&stack.treasury_payments(), "acct-r", Some(100_000)).await;
    let payout = register_payout(&stack.registrar_payments(), "acct-r", 100, "ben-r").await;
    let before = stack.snapshot().await;

    let session_id = "0195e3b4-0000-7000-8000-0000000000aa";
    let other = "0195e3b4-0000-7000-8000-0000000000bb";
    let new_payout = json!({
        "payoutId": other, "accountId": "acct-r", "amountMinor": 100,
        "currency": "EUR", "beneficiaryRef": "ben-x",
    });
    let submit = json!({
        "payoutId": payout, "accountId": "acct-r", "amountMinor": 100,
        "currency": "EUR", "beneficiaryRef": "ben-r",
    });
    let fund = json!({ "amountMinor": 500, "reference": "role-probe" });
    let limits = json!({ "maxPayoutMinor": 1 });
    let claim = json!({ "expectedState": "PENDING" });
    let writes: Vec<(String, Value)> = vec![
        (
            format!("{lock}/v1/sessions"),
            json!({ "ttlMillis": 10_000 }),
        ),
        (
            format!("{lock}/v1/locks/payout:acct-r/acquire"),
            json!({ "sessionId": session_id, "ttlMillis": 5_000 }),
        ),
        (
            format!("{lock}/v1/locks/payout:acct-r/revoke"),
            json!({ "operator": "op", "reason": "a paused worker holds it" }),
        ),
        (
            format!("{payment}/v1/accounts"),
            json!({ "accountId": "acct-z", "currency": "EUR" }),
        ),
        (format!("{payment}/v1/accounts/acct-r/fund"), fund.clone()),
        (
            format!("{payment}/v1/accounts/acct-r/limits"),
            limits.clone(),
        ),
        (format!("{payment}/v1/fundings/{other}/approve"), json!({})),
        (format!("{payment}/v1/payouts"), new_payout.clone()),
        (
            format!("{payment}/v1/payouts/{payout}/claim"),
            claim.clone(),
        ),
        (
            format!("{payment}/v1/payouts/{payout}/cancel"),
            json!({ "expectedState": "PENDING", "operator": "op", "reason": "not wanted" }),
        ),
        (format!("{proxy}/v1/rail/submissions"), submit.clone()),
        (
            format!("{proxy}/v1/rail/high-water/acct-r"),
            json!({ "floor": 99, "operator": "op", "reason": "revoked" }),
        ),
    ];
    let mut refused = 0;
    // No role: every write, and every read under /v1/, is 403 before any handler.
    for (url, body) in &writes {
        let answer = write_as(url, STRANGER, "stranger/w", Some((7, "dev.x")), body).await;
        forbidden(&format!("POST {url} with no role"), &answer, &mut refused);
    }
    for url in [
        format!("{payment}/v1/payouts/{payout}"),
        format!("{payment}/v1/accounts/acct-r"),
        format!("{payment}/v1/payouts"),
        format!("{lock}/v1/locks"),
        format!("{proxy}/v1/rail/high-water/acct-r"),
    ] {
        let answer = get_as(&url, STRANGER).await;
        forbidden(&format!("GET {url} with no role"), &answer, &mut refused);
    }
    // The probes stay open to it.
    for url in [format!("{payment}/readyz"), format!("{lock}/healthz")] {
        let (status, _, _) = get_as(&url, STRANGER).await;
        assert_eq!(status, 200, "{url}");
    }
    // The executor runs payouts and nothing else: it cannot register, fund, set limits or
    // approve a funding.
    for (url, body) in [
        (format!("{payment}/v1/payouts"), &new_payout),
        (format!("{payment}/v1/accounts/acct-r/fund"), &fund),
        (format!("{payment}/v1/accounts/acct-r/limits"), &limits),
        (format!("{payment}/v1/fundings/{other}/approve"), &json!({})),
    ] {
        let answer = write_as(&url, &executor, "executor/test", None, body).await;
        forbidden(
            &format!("POST {url} as the executor"),
            &answer,
            &mut refused,
        );
    }
    // The registrar registers and nothing else: it cannot claim, submit, hold a lock or fund.
    for (url, body) in [
        (format!("{payment}/v1/payouts/{payout}/claim"), &claim),
        (format!("{proxy}/v1/rail/submissions"), &submit),
        (
            format!("{lock}/v1/sessions"),
            &json!({ "ttlMillis": 10_000 }),
        ),
        (format!("{payment}/v1/accounts/acct-r/fund"), &fund),
    ] {
        let answer = write_as(&url, &registrar, "registrar/test", Some((7, "dev.x")), body).await;
        forbidden(
            &format!("POST {url} as the registrar"),
            &answer,
            &mut refused,
        );
    }
    // A reader reads, and writes nothing.
    let (status, _, body) = get_as(&format!("{payment}/v1/payouts/{payout}"), AUDITOR).await;
    assert_eq!(status, 200, "a reader reads a payout: {body}");
    for (url, body) in [
        (format!("{payment}/v1/payouts"), &new_payout),
        (format!("{payment}/v1/payouts/{payout}/claim"), &claim),
    ] {
        let answer = write_as(&url, AUDITOR, "auditor/test", Some((7, "dev.x")), body).await;
        forbidden(&format!("POST {url} as a reader"), &answer, &mut refused);
    }
    // The treasury funds, and registers nothing.
    let answer = write_as(
        &format!("{payment}/v1/payouts"),
        &treasury,
        "treasury/test",
        None,
        &new_payout,
    )
    .await;
    forbidden("POST /v1/payouts as the treasury", &answer, &mut refused);
    let after = stack.unchanged_since(&before, refused).await;

    // Positive control: the registrar registers (the snapshot sees it), and `dlock run` with the
    // registrar's credential for registering and the executor's for the cycles pays a batch.
    let answer = write_as(
        &format!("{payment}/v1/payouts"),
        &registrar,
        "registrar/test",
        None,
        &new_payout,
    )
    .await;
    assert_eq!(answer.0, 201, "the registrar registers: {}", answer.2);
    assert_ne!(after, stack.snapshot().await, "an accepted write is seen");
    let (ok, output) = stack.run_batch("roles-batch", "acct-r", 4).await;
    assert!(ok, "the registrar and the executor pay a batch: {output}");
    let pool = stack.pool("paydb").await;
    assert_eq!(
        scalar(
            &pool,
            "SELECT count(*) FROM payouts WHERE account_id = 'acct-r' AND state = 'POSTED'"
        )
        .await,
        4
    );
}

/// One lock cycle on `payout:{account}` as the executor: acquire, claim `payout`, release.
/// The claim's answer.
async fn claim_once(
    stack: &DevStack,
    locks: &LockClient,
    account: &str,
    payout: uuid::Uuid,
) -> (u16, String, Value) {
    let (_, payment, _) = stack.services();
    let key = format!("payout:{account}");
    let session_id = session(locks, 30_000).await;
    let grant = hold(locks, &key, session_id, 30_000).await;
    let proof = grant
        .fencing_proof
        .clone()
        .unwrap_or_else(|| panic!("dev up proves tokens: {grant:?}"));
    let answer = write_as(
        &format!("{payment}/v1/payouts/{payout}/claim"),
        &stack.token("executor"),
        "executor/test",
        Some((grant.fencing_token, &proof)),
        &json!({ "expectedState": "PENDING" }),
    )
    .await;
    release(locks, &key, session_id, grant.fencing_token).await;
    let _ = locks.end_session(session_id).await;
    answer
}

/// `answer` refused with 422 LIMIT_EXCEEDED naming `limit`.
fn assert_limit_exceeded(what: &str, answer: &(u16, String, Value), limit: &str) {
    assert_refused(what, answer, 422, "LIMIT_EXCEEDED");
    assert_eq!(answer.2["details"]["limit"], limit, "{what}: {}", answer.2);
}

/// The treasury sets an account's limits; paydb refuses a payout above the largest single
/// payout at registration, and a claim that would take the day's outflow over its limit, with
/// 422 LIMIT_EXCEEDED and no change (no payout row, no fence advance, no outflow counted);
/// payouts under the limits pass (positive control).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_payout_over_its_account_limits_is_refused_by_paydb_and_changes_nothing() {
    let stack = DevStack::with_account("acct-l", 1_000_000).await;
    let (_, payment, _) = stack.services();
    let treasury = stack.token("treasury");
    let answer = write_as(
        &format!("{payment}/v1/accounts/acct-l/limits"),
        &treasury,
        "treasury/test",
        None,
        &json!({ "maxPayoutMinor": 500, "dailyOutflowMinor": 1_000 }),
    )
    .await;
    assert_eq!(answer.0, 200, "the treasury sets limits: {}", answer.2);
    assert_eq!(answer.2["maxPayoutMinor"], 500, "{}", answer.2);
    assert_eq!(answer.2["setBy"], "treasury", "{}", answer.2);
    let bad = write_as(
        &format!("{payment}/v1/accounts/acct-l/limits"),
        &treasury,
        "treasury/test",
        None,
        &json!({ "maxPayoutMinor": 0 }),
    )
    .await;
    assert_refused("a zero limit", &bad, 400, "VALIDATION_FAILED");

    let pool = stack.pool("paydb").await;
    let registrar = stack.token("registrar");
    let over = uuid::Uuid::new_v4();
    let before = stack.snapshot().await;
    let answer = write_as(
        &format!("{payment}/v1/payouts"),
        &registrar,
        "registrar/test",
        None,
        &json!({
            "payoutId": over, "accountId": "acct-l", "amountMinor": 501,
            "currency": "EUR", "beneficiaryRef": "ben-over",
        }),
    )
    .await;
    assert_limit_exceeded("a payout above the single limit", &answer, "maxPayoutMinor");
    assert_eq!(answer.2["details"]["limitMinor"], 500, "{}", answer.2);
    assert_eq!(
        before,
        stack.snapshot().await,
        "the refused registration changed nothing"
    );

    // Under the single limit: three of 400 register (positive control); the day allows 1 000.
    let registrar_client = stack.registrar_payments();
    let mut payouts = Vec::new();
    for n in 0..3 {
        payouts.push(register_payout(&registrar_client, "acct-l", 400, &format!("ben-{n}")).await);
    }
    let locks = LockClient::new(&stack.url("lockServer"), "executor/test")
        .unwrap_or_else(|e| panic!("{e}"))
        .with_credential(Some(Credential::fixed(&stack.token("executor"))));
    for payout in &payouts[..2] {
        let answer = claim_once(&stack, &locks, "acct-l", *payout).await;
        assert_eq!(
            answer.0, 200,
            "a claim within the day's limit: {}",
            answer.2
        );
    }
    let outflow = "SELECT coalesce(sum(claimed_minor), 0)::bigint FROM account_daily_outflow \
                   WHERE account_id = 'acct-l'";
    assert_eq!(scalar(&pool, outflow).await, 800);
    let fence = "SELECT fence FROM accounts WHERE account_id = 'acct-l'";
    let fence_before = scalar(&pool, fence).await;
    let before = stack.snapshot().await;
    let answer = claim_once(&stack, &locks, "acct-l", payouts[2]).await;
    assert_limit_exceeded(
        "a claim over the day's outflow",
        &answer,
        "dailyOutflowMinor",
    );
    assert_eq!(answer.2["details"]["outflowMinor"], 800, "{}", answer.2);
    assert_eq!(scalar(&pool, outflow).await, 800, "no outflow counted");
    assert_eq!(
        scalar(&pool, fence).await,
        fence_before,
        "the fence did not move"
    );
    let state: String = sqlx::query_scalar("SELECT state FROM payouts WHERE payout_id = $1")
        .bind(payouts[2])
        .fetch_one(&pool)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(state, "PENDING", "the refused payout stays PENDING");
    // Only the lock server's tables moved (the cycle's own session and grant); paydb and the
    // statement did not.
    let after = stack.snapshot().await;
    let paydb = |rows: &[(String, String)]| {
        rows.iter()
            .filter(|(table, _)| !table.starts_with("lockdb."))
            .cloned()
            .collect::<Vec<_>>()
    };
    assert_eq!(
        paydb(&before),
        paydb(&after),
        "the refused claim changed nothing in paydb"
    );

    // Raising the day's limit (through the contract's client) lets the same payout through
    // (positive control).
    let raised = stack
        .treasury_payments()
        .set_limits(
            "acct-l",
            "raise-limits",
            &dlock_contract::payment::AccountLimitsRequest {
                max_payout_minor: Some(500),
                daily_outflow_minor: Some(2_000),
            },
        )
        .await
        .unwrap_or_else(|e| panic!("the treasury raises the limit: {e}"));
    assert_eq!(raised.daily_outflow_minor, Some(2_000));
    let answer = claim_once(&stack, &locks, "acct-l", payouts[2]).await;
    assert_eq!(answer.0, 200, "under the raised limit: {}", answer.2);
    assert_eq!(scalar(&pool, outflow).await, 1_200);
}

/// A funding above `auth.treasury.dual-approval-above` is recorded, not applied (202 with its
/// id); the same treasury identity approving it is 403 and changes nothing; a second, different
/// treasury identity applies it, once; a funding under the threshold applies at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_funding_waits_for_a_second_treasury_identity_and_self_approval_is_refused() {
    let stack = DevStack::with_dual_approval_above("100000").await;
    let (_, payment, _) = stack.services();
    let treasury = stack.token("treasury");
    stack
        .add_tokens(&[("treasury-2", TREASURY_2, "treasury")])
        .await;
    open_account(&stack.treasury_payments(), "acct-d", Some(100_000)).await;
    let pool = stack.pool("paydb").await;
    let balance = "SELECT balance_minor FROM accounts WHERE account_id = 'acct-d'";
    assert_eq!(
        scalar(&pool, balance).await,
        100_000,
        "at the threshold: applied at once"
    );

    let fund_url = format!("{payment}/v1/accounts/acct-d/fund");
    let large = json!({ "amountMinor": 5_000_000, "reference": "large-1" });
    let answer = write_as(&fund_url, &treasury, "treasury/test", None, &large).await;
    assert_eq!(answer.0, 202, "a large funding waits: {}", answer.2);
    assert_eq!(answer.2["status"], "PENDING_APPROVAL", "{}", answer.2);
    assert_eq!(answer.2["requestedBy"], "treasury", "{}", answer.2);
    let funding = answer.2["fundingId"]
        .as_str()
        .unwrap_or_else(|| panic!("no fundingId: {}", answer.2))
        .to_owned();
    assert_eq!(scalar(&pool, balance).await, 100_000, "not applied");
    // `dlock accounts fund` above the threshold says the funding waits, and applies nothing.
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let batch = dir.path().join("batch.yaml");
    let items = [crate::shared::payouts::Item::numbered(
        0,
        "item-0".into(),
        "acct-d",
        100,
    )];
    std::fs::write(
        &batch,
        crate::shared::payouts::batch_manifest("large-batch", 1, items),
    )
    .unwrap_or_else(|e| panic!("{e}"));
    let cli = std::process::Command::new(EXE)
        .args(["accounts", "fund", "-f"])
        .arg(&batch)
        .args(["--amount-minor", "2000000", "--payment-resource", &payment])
        .args(["--identity", "treasury"])
        .env("DLOCK_TREASURY_CREDENTIAL", &treasury)
        .output()
        .unwrap_or_else(|e| panic!("dlock accounts fund: {e}"));
    let said = String::from_utf8_lossy(&cli.stderr);
    assert!(cli.status.success(), "dlock accounts fund: {said}");
    assert!(
        said.contains("waits for a second treasury identity"),
        "dlock accounts fund says the funding waits: {said}"
    );
    assert_eq!(
        scalar(&pool, balance).await,
        100_000,
        "the CLI's funding is not applied"
    );

    let approve_url = format!("{payment}/v1/fundings/{funding}/approve");
    let before = stack.snapshot().await;
    let answer = write_as(&approve_url, &treasury, "treasury/test", None, &json!({})).await;
    assert_refused("approving one's own funding", &answer, 403, "FORBIDDEN");
    let answer = write_as(
        &approve_url,
        &stack.token("executor"),
        "executor/test",
        None,
        &json!({}),
    )
    .await;
    assert_refused("the executor approving", &answer, 403, "FORBIDDEN");
    assert_eq!(
        before,
        stack.snapshot().await,
        "the refused approvals changed nothing"
    );
    assert_eq!(scalar(&pool, balance).await, 100_000);

    // The second identity approves through the contract's client.
    let second = PaymentClient::new(&payment, "treasury-2/test")
        .unwrap_or_else(|e| panic!("{e}"))
        .with_credential(Some(Credential::fixed(TREASURY_2)));
    let funding_id = uuid::Uuid::parse_str(&funding).unwrap_or_else(|e| panic!("{e}"));
    let approved = second
        .approve_funding(
            funding_id,
            "approve-large-1",
            &dlock_contract::payment::ApproveFundingRequest {},
        )
        .await
        .unwrap_or_else(|e| panic!("a second treasury identity approves: {e}"));
    assert_eq!(approved.approved_by, "treasury-2");
    assert_eq!(approved.requested_by, "treasury");
    assert_eq!(approved.balance_minor, 5_100_000);
    assert_eq!(approved.entries.len(), 2, "one balanced pair");
    assert_eq!(scalar(&pool, balance).await, 5_100_000, "applied");
    // Once: another approval (a new key) is refused and applies nothing more.
    let answer = write_as(
        &approve_url,
        TREASURY_2,
        "treasury-2/test",
        None,
        &json!({}),
    )
    .await;
    assert_refused("a second approval", &answer, 422, "IDEMPOTENCY_CONFLICT");
    assert_applied_once(&pool, balance, "large-1").await;
    // paydb itself keeps the approver apart from the requester, whatever writes the row.
    let direct = sqlx::query(
        "INSERT INTO pending_fundings (funding_id, account_id, amount_minor, reference, \
         requested_by, approved_by, approved_at) \
         VALUES (gen_random_uuid(), 'acct-d', 1, 'psql', 'treasury', 'treasury', now())",
    )
    .execute(&pool)
    .await;
    assert!(direct.is_err(), "the CHECK refuses a self-approved row");
}
