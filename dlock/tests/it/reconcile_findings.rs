//! The reconciler against a ledger and a rail that disagree, each disagreement made for real on
//! a running stack (PostgreSQL, the four services as processes, the rail stub) and reported by a
//! real `dlock reconcile` process: its JSON findings, its human table, its exit status and the
//! termination summary the operator reads into a Reconciliation's status.
//!
//! - a transfer sent straight to the rail stub, past the rail proxy: no payout, or a payout
//!   that never went to the proxy; or a payout whose hold was released (FAILED at the claim,
//!   ABANDONED by a cancel);
//! - a transfer sent straight to the stub under a payout's id with another amount, before the
//!   payout runs: the stub answers the proxy's submission with that first transfer, so the
//!   payout is POSTED while the rail took the other amount;
//! - a RAIL_AMBIGUOUS payout the rail did take, resolved FAILED (its hold released);
//! - a RAIL_AMBIGUOUS payout the rail never saw (the stub was down), resolved POSTED with a
//!   reference the rail never gave.
//!
//! Each test first reconciles the clean ledger (no finding of these classes: the negative
//! control), then makes the disagreement and finds it (the positive control).

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use dlock_contract::payment::{Resolution, ResolveRequest};
use dlock_contract::payment_client::PaymentClient;
use dlock_contract::payout_batch::payout_id;
use dlock_contract::rail::read_statement;
use dlock_contract::reconcile::ReconcileSummary;
use dlock_devstack::stack::{Role, Stack};
use dlock_executor::executor::{RunOptions, execute};

use crate::harness::endpoints;
use serde_json::{Value, json};
use uuid::Uuid;

use crate::shared::accounts::open_account;
use crate::shared::payouts::register_payout;

const EXE: &str = env!("CARGO_BIN_EXE_dlock");
const OPERATOR_TOKEN: &str = "reconcile-operator-token";

const WITHOUT_PAYOUT: &str = "rail_transfer_without_payout";
const DIFFERS: &str = "rail_transfer_differs_from_payout";
const POSTED_NOT_ON_RAIL: &str = "posted_payout_not_on_rail";
const RELEASED_PAID: &str = "released_payout_paid_on_rail";
const CLASSES: [&str; 4] = [WITHOUT_PAYOUT, DIFFERS, POSTED_NOT_ON_RAIL, RELEASED_PAID];

/// One `dlock reconcile` run as a process.
struct Run {
    exit: Option<i32>,
    /// `--json`'s findings document.
    json: Value,
    /// The termination summary (`--termination-log`), as the operator parses it.
    summary: ReconcileSummary,
    /// The same run's human table (a second process without `--json`).
    table: String,
}

impl Run {
    /// `(kind, subject)` of every finding of the four rail-against-ledger classes.
    fn of_classes(&self) -> Vec<(String, String)> {
        let mut found: Vec<(String, String)> = self.json["findings"]
            .as_array()
            .unwrap_or_else(|| panic!("no findings array: {}", self.json))
            .iter()
            .filter(|f| CLASSES.contains(&f["kind"].as_str().unwrap_or_default()))
            .map(|f| {
                (
                    f["kind"].as_str().unwrap_or_default().to_owned(),
                    f["subject"].as_str().unwrap_or_default().to_owned(),
                )
            })
            .collect();
        found.sort();
        found
    }

    /// The four counts: JSON, then the termination summary; both must agree.
    fn counts(&self) -> [u64; 4] {
        let json = [
            "transfersWithoutPayout",
            "transfersDifferingFromPayout",
            "postedNotOnRail",
            "releasedPaidOnRail",
        ]
        .map(|k| {
            self.json[k]
                .as_u64()
                .unwrap_or_else(|| panic!("{k} missing: {}", self.json))
        });
        let s = &self.summary.statement;
        let summary = [
            s.transfers_without_payout,
            s.transfers_differing_from_payout,
            s.posted_not_on_rail,
            s.released_paid_on_rail,
        ]
        .map(|n| n as u64);
        assert_eq!(
            json, summary,
            "the JSON and the termination summary disagree"
        );
        json
    }
}

fn reconcile(stack: &Stack, settlement_window_ms: u64) -> Run {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let log = dir.path().join("termination-log");
    let window = settlement_window_ms.to_string();
    let paydb = stack.pg().url("paydb");
    let rail = stack.stub().url();
    let base = [
        "reconcile",
        "--paydb",
        paydb.as_str(),
        "--rail",
        rail.as_str(),
        "--settlement-window-ms",
        window.as_str(),
    ];
    let run = |extra: &[&str]| {
        Command::new(EXE)
            .args(base)
            .args(extra)
            .env_remove("DLOCK_TERMINATION_LOG")
            .output()
            .unwrap_or_else(|e| panic!("{EXE}: {e}"))
    };
    let json_run = run(&["--json", "--termination-log", path_str(&log)]);
    let stdout = String::from_utf8_lossy(&json_run.stdout);
    let json: Value = serde_json::from_str(&stdout).unwrap_or_else(|e| {
        panic!(
            "dlock reconcile --json: {e}\nstdout: {stdout}\nstderr: {}",
            String::from_utf8_lossy(&json_run.stderr)
        )
    });
    let summary_text = std::fs::read_to_string(&log).unwrap_or_else(|e| panic!("{e}"));
    let summary: ReconcileSummary = serde_json::from_str(&summary_text)
        .unwrap_or_else(|e| panic!("termination summary: {e}: {summary_text}"));
    let table_run = run(&[]);
    assert_eq!(table_run.status.code(), json_run.status.code());
    Run {
        exit: json_run.status.code(),
        json,
        summary,
        table: String::from_utf8_lossy(&table_run.stdout).into_owned(),
    }
}

fn path_str(path: &Path) -> &str {
    path.to_str()
        .unwrap_or_else(|| panic!("{} is not UTF-8", path.display()))
}

/// A transfer sent straight to the rail stub, as anything holding its address could: the rail
/// proxy never sees it. Its rail reference.
async fn submit_to_stub(stack: &Stack, client_ref: &str, amount_minor: i64) -> String {
    let response = reqwest::Client::new()
        .post(format!("{}/submit", stack.stub().url()))
        .json(&json!({"clientRef": client_ref, "amountMinor": amount_minor, "currency": "EUR"}))
        .send()
        .await
        .unwrap_or_else(|e| panic!("submit {client_ref}: {e}"));
    assert_eq!(
        response.status().as_u16(),
        200,
        "the stub took {client_ref}"
    );
    let body: Value = response.json().await.unwrap_or_else(|e| panic!("{e}"));
    body["railReference"]
        .as_str()
        .unwrap_or_else(|| panic!("no railReference: {body}"))
        .to_owned()
}

fn batch(name: &str, items: &[(&str, &str, i64)]) -> dlock_executor::PayoutBatch {
    let mut yaml = format!(
        "apiVersion: dlock.io/v1alpha1\nkind: PayoutBatch\nmetadata:\n  name: {name}\nspec:\n  payouts:\n"
    );
    for (key, account, amount) in items {
        yaml.push_str(&format!(
            "    - key: {key}\n      accountId: {account}\n      amountMinor: {amount}\n      currency: EUR\n      beneficiaryRef: ben-{key}\n"
        ));
    }
    dlock_executor::manifest::parse(&yaml).unwrap_or_else(|e| panic!("{e}"))
}

async fn run_batch(stack: &Stack, batch: &dlock_executor::PayoutBatch) {
    let endpoints = endpoints(stack);
    let options = RunOptions {
        workers: 2,
        settle_timeout: Duration::from_secs(60),
        ..RunOptions::default()
    };
    let report = execute(batch, &endpoints, options)
        .await
        .unwrap_or_else(|e| panic!("{e:#}"));
    assert!(report.complete, "{report:?}");
}

fn state(stack: &Stack, payout: Uuid) -> String {
    stack
        .pg()
        .psql(
            "paydb",
            &format!("SELECT state FROM payouts WHERE payout_id = '{payout}'"),
        )
        .unwrap_or_else(|e| panic!("{e:#}"))
        .trim()
        .to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transfers_past_the_proxy_and_an_amount_the_rail_changed_are_reported() {
    let stack = Stack::builder(EXE).operator_token(OPERATOR_TOKEN).start();
    let client =
        PaymentClient::new(&stack.payment().url(), "recon").unwrap_or_else(|e| panic!("{e}"));
    open_account(&client, "rich", Some(10_000)).await;
    open_account(&client, "poor", Some(300)).await;

    // A clean ledger: paid, refused at the claim (FAILED: `poor` holds 300, never at the rail),
    // and PENDING.
    run_batch(
        &stack,
        &batch(
            "clean",
            &[
                ("rich-1", "rich", 100),
                ("rich-2", "rich", 300),
                ("poor-1", "poor", 400),
            ],
        ),
    )
    .await;
    let failed = payout_id("clean", "poor-1");
    assert_eq!(state(&stack, failed), "FAILED");
    let pending = register_payout(&client, "rich", 700, "ben-pending").await;
    // Cancelled before it reached the rail (ABANDONED), as deleting its PayoutBatch does.
    let abandoned = register_payout(&client, "rich", 800, "ben-cancelled").await;
    let lock = dlock_contract::client::LockClient::new(&stack.lock().url(), "alice")
        .unwrap_or_else(|e| panic!("{e}"));
    let cancelled = dlock_executor::cancel::cancel_unfinished(
        &lock,
        &client.as_operator(OPERATOR_TOKEN),
        &[(abandoned, "rich".to_owned())],
        "alice",
        "the batch was deleted",
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(cancelled.abandoned, vec![abandoned], "{cancelled:?}");
    let clean = reconcile(&stack, 0);
    assert_eq!(clean.of_classes(), vec![], "{}", clean.json);
    assert_eq!(clean.counts(), [0; 4]);
    assert_eq!(clean.exit, Some(0), "{}", clean.table);
    assert!(
        clean.table.contains(
            "rail against ledger: 0 transfers without a payout, 0 differing from their payout; \
             0 posted payouts not on the rail; 0 failed or abandoned payouts paid on the rail"
        ),
        "{}",
        clean.table
    );

    // Past the proxy: a clientRef that is no payout id, an id paydb does not have, the id of a
    // payout that never went to the proxy (PENDING), and the ids of the FAILED and the
    // ABANDONED ones (their holds released).
    let unknown = Uuid::new_v4().to_string();
    submit_to_stub(&stack, "not-a-payout", 250).await;
    submit_to_stub(&stack, &unknown, 250).await;
    submit_to_stub(&stack, &pending.to_string(), 700).await;
    submit_to_stub(&stack, &failed.to_string(), 400).await;
    submit_to_stub(&stack, &abandoned.to_string(), 800).await;
    // The rail takes 9 999 under the id of a payout of 200 before the payout runs; the proxy's
    // submission is then answered with that first transfer, and the payout is POSTED.
    let changed = payout_id("later", "rich-3");
    let taken = submit_to_stub(&stack, &changed.to_string(), 9_999).await;
    run_batch(&stack, &batch("later", &[("rich-3", "rich", 200)])).await;
    assert_eq!(state(&stack, changed), "POSTED");
    let posted_as = stack
        .pg()
        .psql(
            "paydb",
            &format!("SELECT rail_reference FROM payouts WHERE payout_id = '{changed}'"),
        )
        .unwrap_or_else(|e| panic!("{e:#}"));
    assert_eq!(
        posted_as.trim(),
        taken,
        "posted with the rail's first transfer"
    );

    let found = reconcile(&stack, 0);
    let mut expected = vec![
        (WITHOUT_PAYOUT.to_owned(), "not-a-payout".to_owned()),
        (WITHOUT_PAYOUT.to_owned(), unknown.clone()),
        (WITHOUT_PAYOUT.to_owned(), pending.to_string()),
        (DIFFERS.to_owned(), changed.to_string()),
        (RELEASED_PAID.to_owned(), failed.to_string()),
        (RELEASED_PAID.to_owned(), abandoned.to_string()),
    ];
    expected.sort();
    assert_eq!(found.of_classes(), expected, "{}", found.json);
    assert_eq!(found.counts(), [3, 1, 0, 2]);
    assert_eq!(
        found.exit,
        Some(2),
        "critical findings exit 2: {}",
        found.table
    );
    assert_eq!(found.summary.critical, 6, "{:?}", found.summary);
    for line in [
        format!("critical {WITHOUT_PAYOUT} {unknown}"),
        format!("critical {DIFFERS} {changed}"),
    ] {
        assert!(
            found.summary.findings.iter().any(|f| f.starts_with(&line)),
            "{line} in {:?}",
            found.summary.findings
        );
    }
    let differs = found.json["findings"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|f| f["kind"] == DIFFERS)
        .unwrap_or_else(|| panic!("{}", found.json));
    let detail = differs["detail"].as_str().unwrap_or_default();
    assert!(
        detail.contains("9999 EUR") && detail.contains("200 EUR"),
        "{detail}"
    );
    assert!(
        found.table.contains(
            "rail against ledger: 3 transfers without a payout, 1 differing from their payout; \
             0 posted payouts not on the rail; 2 failed or abandoned payouts paid on the rail"
        ) && found.table.contains(DIFFERS),
        "{}",
        found.table
    );
    assert!(
        found
            .summary
            .summary()
            .contains("transfers without a payout: 3"),
        "{}",
        found.summary.summary()
    );
}

async fn resolve(
    client: &PaymentClient,
    payout: Uuid,
    outcome: Resolution,
    reference: Option<&str>,
) {
    let body = ResolveRequest {
        outcome,
        rail_reference: reference.map(str::to_owned),
        operator: "alice".to_owned(),
        evidence: "the test's decision".to_owned(),
    };
    client
        .as_operator(OPERATOR_TOKEN)
        .resolve(payout, &format!("resolve-{payout}"), &body)
        .await
        .unwrap_or_else(|e| panic!("resolving {payout}: {e}"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resolutions_the_rails_statement_contradicts_are_reported() {
    // Every transfer is taken and answered with a redirect, which the proxy does not follow:
    // each payout is RAIL_AMBIGUOUS and on the rail.
    let mut stack = Stack::builder(EXE)
        .operator_token(OPERATOR_TOKEN)
        .rail_stub(&[("rail.stub.redirect-rate", "1.0")])
        .start();
    let client =
        PaymentClient::new(&stack.payment().url(), "recon").unwrap_or_else(|e| panic!("{e}"));
    open_account(&client, "acct", Some(10_000)).await;
    run_batch(
        &stack,
        &batch("taken", &[("right", "acct", 100), ("wrong", "acct", 200)]),
    )
    .await;
    // The rail is down for one payout: the proxy's connection is refused and nothing reaches
    // the rail, but the proxy cannot prove it, so the payout is RAIL_AMBIGUOUS too.
    stack.service_mut(Role::RailStub).kill();
    run_batch(&stack, &batch("unseen", &[("gone", "acct", 300)])).await;
    stack.restart(Role::RailStub);
    let (right, wrong, gone) = (
        payout_id("taken", "right"),
        payout_id("taken", "wrong"),
        payout_id("unseen", "gone"),
    );
    for payout in [right, wrong, gone] {
        assert_eq!(state(&stack, payout), "RAIL_AMBIGUOUS");
    }

    // Unresolved: classified, and no disagreement (the negative control).
    let ambiguous = reconcile(&stack, 0);
    assert_eq!(ambiguous.of_classes(), vec![], "{}", ambiguous.json);
    assert_eq!(ambiguous.counts(), [0; 4]);
    assert_eq!(
        (
            ambiguous.summary.statement.ambiguous_found_on_rail,
            ambiguous.summary.statement.ambiguous_not_on_rail
        ),
        (2, 1)
    );
    assert_eq!(ambiguous.exit, Some(0), "{}", ambiguous.table);

    // `right` is resolved as the statement says; `wrong` as FAILED though the rail has it;
    // `gone` as POSTED under a reference the rail never gave. paydb's pay_resolve refuses the
    // last two against the findings just recorded (docs/contract.md#resolve-evidence), so they
    // are written around it, as a psql session could: the reconciler reports them all the same.
    let statement = read_statement(&stack.stub().url(), Some(&right.to_string()))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let reference = &statement.transfers[0].rail_reference;
    resolve(&client, right, Resolution::Posted, Some(reference)).await;
    stack
        .pg()
        .psql(
            "paydb",
            &format!(
                "UPDATE payouts SET state = 'FAILED' WHERE payout_id = '{wrong}';
                 DO $$ DECLARE p payouts%ROWTYPE; BEGIN
                   SELECT * INTO p FROM payouts WHERE payout_id = '{gone}';
                   UPDATE payouts SET state = 'POSTED', rail_reference = 'rail-made-up'
                    WHERE payout_id = '{gone}';
                   PERFORM pay_write_payout_posting(p, p.claim_token, 'resolution');
                 END $$;"
            ),
        )
        .unwrap_or_else(|e| panic!("{e:#}"));
    assert_eq!(
        [right, wrong, gone].map(|p| state(&stack, p)),
        ["POSTED", "FAILED", "POSTED"]
    );

    let found = reconcile(&stack, 0);
    let mut expected = vec![
        (RELEASED_PAID.to_owned(), wrong.to_string()),
        (POSTED_NOT_ON_RAIL.to_owned(), gone.to_string()),
    ];
    expected.sort();
    assert_eq!(found.of_classes(), expected, "{}", found.json);
    assert_eq!(found.counts(), [0, 0, 1, 1]);
    assert_eq!(found.exit, Some(2), "{}", found.table);
    assert!(
        found.table.contains(POSTED_NOT_ON_RAIL) && found.table.contains(RELEASED_PAID),
        "{}",
        found.table
    );

    // Within the settlement window the missing transfer may still come: not reported yet.
    let early = reconcile(&stack, 3_600_000);
    assert_eq!(
        early.of_classes(),
        vec![(RELEASED_PAID.to_owned(), wrong.to_string())],
        "{}",
        early.json
    );
}
