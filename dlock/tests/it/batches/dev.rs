//! Batches on `dlock dev up` (every service with credentials and fencing-token proofs): a batch
//! needs the roles of its step's single endpoint, and `dlock run --batch-max` pays a whole
//! PayoutBatch through the batch endpoints.
//!
//! The services expose no request count by route on `/metrics`; what shows that the batch
//! endpoints were used is their traces: each request is a span named `METHOD route`
//! (services/server/src/trace.rs), exported over OTLP/HTTP. The test receives the export itself
//! and counts the span names in it (OTLP/protobuf carries a span's name as its UTF-8 bytes).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use dlock_contract::auth::Credential;
use dlock_contract::client::LockClient;
use serde_json::{Value, json};
use uuid::Uuid;

use super::claim_item;
use crate::auth::{DevStack, run_logged};
use crate::harness::{hold, loopback, post_json, serve_in_task, session};
use crate::shared::accounts::open_account;
use crate::shared::payouts::{Item, batch_manifest, register_payout};

const JSON: &str = "application/json; charset=utf-8";

/// A `POST /v1/batches/claim` of `items` with `token`'s credential: `(status, type, body)`.
async fn claim_batch_as(
    payment: &str,
    token: &str,
    owner: &str,
    items: &[Value],
) -> (u16, String, Value) {
    let bearer = format!("Bearer {token}");
    post_json(
        &format!("{payment}/v1/batches/claim"),
        &[("authorization", bearer.as_str()), ("x-owner-id", owner)],
        &json!({ "items": items }),
    )
    .await
}

/// The payout's state, attempts and fence, and the idempotency records of its claim.
async fn paydb_marks(pool: &sqlx::PgPool, payout: Uuid) -> (String, i32, i64, i64) {
    sqlx::query_as(
        "SELECT p.state, p.attempt_count, a.fence, \
         (SELECT count(*) FROM idempotency_records WHERE route LIKE '%' || $1::text || '%') \
         FROM payouts p JOIN accounts a USING (account_id) WHERE p.payout_id = $1",
    )
    .bind(payout)
    .fetch_one(pool)
    .await
    .unwrap_or_else(|e| panic!("{e}"))
}

/// A claim item for a new PENDING payout on the new funded account `account`, under the
/// executor's real grant on its lock and the grant's proof: (item, payout, token).
async fn one_claim_item(stack: &DevStack, account: &str) -> (Value, Uuid, i64) {
    open_account(&stack.treasury_payments(), account, Some(100_000)).await;
    let payout = register_payout(&stack.registrar_payments(), account, 100, "ben-b").await;
    let locks = LockClient::new(&stack.url("lockServer"), "executor/batches")
        .unwrap_or_else(|e| panic!("{e}"))
        .with_credential(Some(Credential::fixed(&stack.token("executor"))));
    let lock_session = session(&locks, 30_000).await;
    let grant = hold(&locks, &format!("payout:{account}"), lock_session, 30_000).await;
    let proof = grant
        .fencing_proof
        .clone()
        .unwrap_or_else(|| panic!("the dev stack's grants carry a proof: {grant:?}"));
    let item = claim_item(
        payout,
        grant.fencing_token,
        Some(&proof),
        &format!("claim-{account}"),
    );
    (item, payout, grant.fencing_token)
}

/// A batch of claims with a credential whose identity lacks the executor role (the registrar's,
/// the treasury's) is 403 FORBIDDEN for the whole request and changes nothing; the executor's is
/// answered item by item (positive control).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_needs_the_roles_of_its_single_endpoint() {
    let stack = DevStack::up().await;
    let payment = stack.url("paymentResource");
    let (item, payout, token) = one_claim_item(&stack, "acct-br").await;
    let items = [item];
    let pool = stack.pool("paydb").await;
    let before = paydb_marks(&pool, payout).await;
    assert_eq!(before, ("PENDING".to_owned(), 0, 0, 0));

    for who in ["registrar", "treasury"] {
        let (status, content_type, body) =
            claim_batch_as(&payment, &stack.token(who), &format!("{who}/test"), &items).await;
        assert_eq!(status, 403, "{who}: {body}");
        assert_eq!(content_type, JSON, "{who}: content type");
        crate::conformance::assert_envelope(who, status, &body, "FORBIDDEN");
        assert_eq!(
            paydb_marks(&pool, payout).await,
            before,
            "{who}'s batch changed nothing"
        );
    }
    let (status, content_type, body) = claim_batch_as(
        &payment,
        &stack.token("executor"),
        "executor/batch-roles",
        &items,
    )
    .await;
    assert_eq!((status, content_type.as_str()), (200, JSON), "{body}");
    assert_eq!(body["items"][0]["status"], json!(200), "{body}");
    assert_eq!(body["items"][0]["body"]["claimToken"], json!(token));
    assert_eq!(
        paydb_marks(&pool, payout).await,
        ("CLAIMED".to_owned(), 1, token, 1)
    );
    pool.close().await;
}

/// An OTLP/HTTP trace receiver: keeps every export's body.
struct Otlp {
    url: String,
    bodies: Arc<Mutex<Vec<u8>>>,
    _server: crate::harness::Servers,
}

impl Otlp {
    async fn start() -> Self {
        let bodies = Arc::new(Mutex::new(Vec::new()));
        let kept = bodies.clone();
        let app = axum::Router::new().route(
            "/v1/traces",
            axum::routing::post(move |body: axum::body::Bytes| {
                let kept = kept.clone();
                async move {
                    if let Ok(mut all) = kept.lock() {
                        all.extend_from_slice(&body);
                    }
                    (
                        [("content-type", "application/x-protobuf")],
                        Vec::<u8>::new(),
                    )
                }
            }),
        );
        let (listener, addr) = loopback().await;
        let mut server = crate::harness::Servers::default();
        server.push(serve_in_task(listener, app));
        Self {
            url: format!("http://{addr}"),
            bodies,
            _server: server,
        }
    }

    /// The distinct runs of printable characters in the exports that hold `part`.
    fn strings_with(&self, part: &str) -> std::collections::BTreeSet<String> {
        let all = self.bodies.lock().map(|b| b.clone()).unwrap_or_default();
        all.split(|b| !(0x20..0x7f).contains(b))
            .map(String::from_utf8_lossy)
            .filter(|s| s.contains(part))
            .map(|s| s.into_owned())
            .collect()
    }

    /// How many bytes of exports arrived.
    fn received(&self) -> usize {
        self.bodies.lock().map(|b| b.len()).unwrap_or_default()
    }

    /// How many spans named exactly `name` were exported so far: OTLP/protobuf writes a span's
    /// name as field 5 (tag 0x2a), its length (one byte below 128), then its bytes.
    fn spans(&self, name: &str) -> usize {
        let all = self.bodies.lock().map(|b| b.clone()).unwrap_or_default();
        let mut field = vec![0x2a, u8::try_from(name.len()).unwrap_or(u8::MAX)];
        assert!(
            name.len() < 128,
            "{name}: a longer name has a longer length"
        );
        field.extend_from_slice(name.as_bytes());
        all.windows(field.len()).filter(|w| *w == field).count()
    }

    /// Spans exported so far of the items of batch requests `batch` whose single request is
    /// `single`: named `single` (the single route's name) or, as the items' spans are named
    /// now, the batch route and the single route run together (`POST /v1/batches/claim` and
    /// `POST /v1/payouts/{payout_id}/claim` give `POST /v1/batches/claim/v1/payouts/{payout_id}/claim`).
    fn item_spans(&self, batch: &str, single: &str) -> usize {
        self.spans(single) + self.spans(&nested(batch, single))
    }
}

/// The name an item's span has when the batch request's route is prefixed to its own.
fn nested(batch: &str, single: &str) -> String {
    let batch_path = batch.split_once(' ').map_or(batch, |(_, p)| p);
    let (method, path) = single.split_once(' ').unwrap_or(("", single));
    format!("{method} {batch_path}{path}")
}

/// `dlock dev up` with every service exporting its spans to `otlp`.
async fn traced_stack(otlp: &Otlp) -> DevStack {
    let endpoint = otlp.url.clone();
    tokio::task::spawn_blocking(move || {
        DevStack::start_with_env(&[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint.as_str()),
            ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf"),
            ("OTEL_BSP_SCHEDULE_DELAY", "100"),
        ])
    })
    .await
    .unwrap_or_else(|e| panic!("{e}"))
}

/// The batch endpoints and the single routes their items run through, by service.
const STEPS: [(&str, &str); 5] = [
    ("POST /v1/batches/acquire", "POST /v1/locks/{key}/acquire"),
    (
        "POST /v1/batches/claim",
        "POST /v1/payouts/{payout_id}/claim",
    ),
    ("POST /v1/batches/submit", "POST /v1/rail/submissions"),
    ("POST /v1/batches/post", "POST /v1/payouts/{payout_id}/post"),
    ("POST /v1/batches/release", "DELETE /v1/locks/{key}"),
];

/// `dlock run --batch-max 16` of 40 payouts over 4 accounts with 8 workers on the dev stack:
/// every payout is POSTED and on the rail's statement exactly once, the ledger balances, and the
/// services' traces show every step going through its batch endpoint, with fewer batch
/// requests than items.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dlock_run_pays_a_batch_through_the_batch_endpoints() {
    let otlp = Otlp::start().await;
    let stack = traced_stack(&otlp).await;
    const FUNDS: i64 = 1_000_000;
    let accounts = ["acct-bt-0", "acct-bt-1", "acct-bt-2", "acct-bt-3"];
    for account in accounts {
        open_account(&stack.treasury_payments(), account, Some(FUNDS)).await;
    }
    let before: Vec<usize> = STEPS
        .iter()
        .flat_map(|(batch, single)| [otlp.spans(batch), otlp.spans(single)])
        .collect();
    assert!(before.iter().all(|n| *n == 0), "{before:?}");

    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let manifest = batch_manifest(
        "batched",
        8,
        (0..40).map(|i| Item::numbered(i, format!("item-{i:02}"), accounts[i % 4], 100)),
    );
    let file = dir.path().join("batch.yaml");
    std::fs::write(&file, manifest).unwrap_or_else(|e| panic!("{e}"));
    let args = stack.run_args(&file.display().to_string(), &["--batch-max", "16"]);
    let log = dir.path().join("run.log");
    let (ok, output) = run_logged(&args, &stack.run_env(), &log, Duration::from_secs(180)).await;
    assert!(ok, "dlock run: {output}");

    // Every payout POSTED, and on the rail's statement exactly once.
    let pool = stack.pool("paydb").await;
    let payouts: Vec<(Uuid, String, String, i64)> = sqlx::query_as(
        "SELECT payout_id, account_id, state, amount_minor FROM payouts \
         WHERE account_id LIKE 'acct-bt-%' ORDER BY payout_id",
    )
    .fetch_all(&pool)
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(payouts.len(), 40, "{output}");
    let statement = stack.rail_statement().await;
    let transfers = statement["transfers"]
        .as_array()
        .unwrap_or_else(|| panic!("no transfers: {statement}"));
    assert_eq!(transfers.len(), 40, "one transfer per payout: {statement}");
    for (id, account, state, amount) in &payouts {
        assert_eq!(state, "POSTED", "{id} on {account}: {output}");
        let on_rail: Vec<&Value> = transfers
            .iter()
            .filter(|t| t["clientRef"] == json!(id.to_string()))
            .collect();
        assert_eq!(on_rail.len(), 1, "{id} on the rail once: {on_rail:?}");
        assert_eq!(on_rail[0]["amountMinor"], json!(amount), "{id}");
    }

    // The ledger: each account's balance is its funding less its payouts, the sum of its
    // entries, with nothing held; debits and credits balance over the whole ledger.
    for account in accounts {
        let paid: i64 = payouts.iter().filter(|p| p.1 == account).map(|p| p.3).sum();
        let (balance, held, entries): (i64, i64, i64) = sqlx::query_as(
            "SELECT balance_minor, held_minor, \
             (SELECT coalesce(sum(CASE direction WHEN 'CREDIT' THEN amount_minor \
                                  ELSE -amount_minor END), 0)::bigint \
              FROM ledger_entries e WHERE e.account_id = a.account_id) \
             FROM accounts a WHERE account_id = $1",
        )
        .bind(account)
        .fetch_one(&pool)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            (balance, held, entries),
            (FUNDS - paid, 0, FUNDS - paid),
            "{account}"
        );
    }
    let (debits, credits): (i64, i64) = sqlx::query_as(
        "SELECT coalesce(sum(amount_minor) FILTER (WHERE direction = 'DEBIT'), 0)::bigint, \
         coalesce(sum(amount_minor) FILTER (WHERE direction = 'CREDIT'), 0)::bigint \
         FROM ledger_entries",
    )
    .fetch_one(&pool)
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(debits, credits, "double entry");
    pool.close().await;

    // The services' traces: each step went through its batch endpoint, in fewer batch
    // requests than the items they carried (one per payout). A batch request's span ends after
    // its items' spans and may leave in a later export, so the stack is stopped first: each
    // service flushes its last spans as it exits, and every span is counted once it is in.
    tokio::task::spawn_blocking(move || drop(stack))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let counts: Vec<(usize, usize)> = STEPS
        .iter()
        .map(|(batch, single)| (otlp.spans(batch), otlp.item_spans(batch, single)))
        .collect();
    assert!(
        counts.iter().all(|(_, items)| *items >= 40),
        "the services did not export every item's span by the time they stopped: {counts:?} \
         ({} bytes received; names with /v1/batches/: {:?})",
        otlp.received(),
        otlp.strings_with("/v1/batches/")
    );
    for ((batch, single), (batches, items)) in STEPS.iter().zip(&counts) {
        eprintln!("{batch}: {batches} requests for {items} items ({single})");
        assert!(
            *batches >= 1 && batches < items,
            "{batch}: {batches} batch requests for {items} items: {counts:?}"
        );
    }
}

/// An item's span is named by its single route, as the single request's is (so traces and
/// dashboards by span name read the same with batching on), under the batch request's span.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_items_span_is_named_by_its_single_route() {
    let otlp = Otlp::start().await;
    let stack = traced_stack(&otlp).await;
    let (item, _, _) = one_claim_item(&stack, "acct-bn").await;
    let (status, _, body) = claim_batch_as(
        &stack.url("paymentResource"),
        &stack.token("executor"),
        "executor/batch-names",
        &[item],
    )
    .await;
    assert_eq!(
        (status, &body["items"][0]["status"]),
        (200, &json!(200)),
        "{body}"
    );
    let (batch, single) = STEPS[1];
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while otlp.spans(batch) == 0 || otlp.item_spans(batch, single) == 0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the batch request's and its item's spans were not exported within 30 s"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(
        (otlp.spans(single), otlp.spans(&nested(batch, single))),
        (1, 0),
        "the item's span is named {single}: {:?}",
        otlp.strings_with("/v1/batches/")
    );
}
