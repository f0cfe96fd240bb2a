//! The payment resource (docs/contract.md#s3-4, docs/contract.md#extensions) through HTTP, against
//! real PostgreSQL, as a real `dlock serve payment-resource` process that [`Stack`] starts. Tokens
//! are plain increasing numbers, as a lock server's are; the rail is simulated by moving payouts
//! to SUBMITTING and RAIL_ACKED in SQL.

mod bad_input;
mod funds;
mod group_commit;
mod idempotency;
mod opening;
mod operator;
mod rows;
mod schema;
mod set_based;
mod workload;

use std::sync::atomic::{AtomicI64, Ordering};

use dlock_devstack::PgServer;
use dlock_devstack::stack::{Role, Stack};
use reqwest::Method;
use serde_json::{Value, json};
use sqlx::PgPool;
use uuid::Uuid;

use crate::conformance::assert_envelope;

pub const OPERATOR_TOKEN: &str = "test-operator-credential-0123456789";
pub const JSON_TYPE: &str = "application/json; charset=utf-8";

pub struct PayStack {
    pub pool: PgPool,
    pub url: String,
    tokens: AtomicI64,
    http: reqwest::Client,
    /// Last: the pool closes before the service and its PostgreSQL stop.
    stack: Stack,
}

/// One answer, with the raw bytes kept for byte-for-byte comparisons.
#[derive(Debug, Clone)]
pub struct Answer {
    pub status: u16,
    pub content_type: String,
    pub replayed: bool,
    pub bytes: Vec<u8>,
    pub json: Value,
}

impl Answer {
    /// Asserts the status (and for errors the envelope and code) and the JSON content type.
    pub fn expect(&self, step: &str, status: u16, code: Option<&str>) -> &Value {
        assert_eq!(self.status, status, "{step}: status, body {}", self.json);
        assert_eq!(self.content_type, JSON_TYPE, "{step}: content type");
        if let Some(code) = code {
            assert_envelope(step, self.status, &self.json, code);
        }
        &self.json
    }

    /// Asserts that this answer is `first` replayed: marked as a replay, byte for byte the same.
    pub fn replays(&self, step: &str, first: &Answer) {
        assert!(self.replayed, "{step}: marked as a replay");
        assert_eq!(
            self.bytes, first.bytes,
            "{step}: replay must be byte for byte"
        );
    }

    /// The names in `details.fields[]`.
    pub fn fields(&self) -> Vec<String> {
        fields_of(&self.json)
    }
}

/// The field names in an envelope's `details.fields[]`.
pub fn fields_of(body: &Value) -> Vec<String> {
    body["details"]["fields"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|f| f["field"].as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default()
}

impl PayStack {
    pub async fn start() -> Self {
        Self::start_with(&[]).await
    }

    /// A payment resource, a real `dlock serve payment-resource` process on a fresh paydb, from
    /// [`Stack::builder`]; `extra` are configuration keys.
    pub async fn start_with(extra: &[(&str, &str)]) -> Self {
        let mut builder = Stack::builder(env!("CARGO_BIN_EXE_dlock"))
            .only(&[Role::PaymentResource])
            .operator_token(OPERATOR_TOKEN)
            .set(Role::PaymentResource, "payment.pg.pool-max", "40")
            .set(
                Role::PaymentResource,
                "payment.pg.acquire-timeout-ms",
                "10000",
            );
        for (key, value) in extra {
            builder = builder.set(Role::PaymentResource, key, *value);
        }
        let stack = tokio::task::spawn_blocking(move || builder.start())
            .await
            .unwrap_or_else(|e| panic!("starting the stack: {e}"));
        // The tests' own connections to paydb, which the service has migrated by now.
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(16)
            .connect(&stack.pg().url("paydb"))
            .await
            .unwrap_or_else(|e| panic!("paydb: {e}"));
        Self {
            url: stack.payment().url(),
            pool,
            tokens: AtomicI64::new(100),
            http: dlock_contract::client::http_client().unwrap_or_else(|e| panic!("{e}")),
            stack,
        }
    }

    /// The stack's PostgreSQL (paydb, and lockdb for a test that runs a lock server beside).
    pub fn pg(&self) -> &PgServer {
        self.stack.pg()
    }

    /// A token above every token handed out before, as a lock server's next grant would be.
    pub fn token(&self) -> i64 {
        self.tokens.fetch_add(1, Ordering::SeqCst) + 1
    }

    pub fn psql(&self, sql: &str) -> String {
        self.pg()
            .psql("paydb", sql)
            .unwrap_or_else(|e| panic!("{e}"))
    }

    /// One request with exactly these headers and this body text.
    pub async fn send(
        &self,
        method: Method,
        path: &str,
        headers: &[(&str, String)],
        body: Option<&str>,
    ) -> Answer {
        let url = format!("{}{path}", self.url);
        let mut request = self.http.request(method, &url);
        for (name, value) in headers {
            request = request.header(*name, value);
        }
        if let Some(body) = body {
            request = request
                .header("content-type", "application/json")
                .body(body.to_owned());
        }
        let response = request
            .send()
            .await
            .unwrap_or_else(|e| panic!("{url}: {e}"));
        let status = response.status().as_u16();
        let header = |name: &str| {
            response
                .headers()
                .get(name)
                .and_then(|v| v.to_str().ok())
                .unwrap_or_default()
                .to_owned()
        };
        let content_type = header("content-type");
        let replayed = header("x-idempotent-replay") == "true";
        let bytes = response.bytes().await.unwrap_or_default().to_vec();
        let json = if bytes.is_empty() || content_type.starts_with("application/openmetrics") {
            Value::Null
        } else {
            serde_json::from_slice(&bytes).unwrap_or_else(|e| {
                panic!(
                    "{path}: not JSON ({e}): {}",
                    String::from_utf8_lossy(&bytes)
                )
            })
        };
        Answer {
            status,
            content_type,
            replayed,
            bytes,
            json,
        }
    }

    /// A write with X-Owner-Id, X-Idempotency-Key and (when given) X-Fencing-Token.
    pub async fn write(&self, path: &str, key: &str, token: Option<i64>, body: &Value) -> Answer {
        let mut headers = vec![
            ("x-owner-id", "worker-1".to_owned()),
            ("x-idempotency-key", key.to_owned()),
        ];
        if let Some(token) = token {
            headers.push(("x-fencing-token", token.to_string()));
        }
        self.send(Method::POST, path, &headers, Some(&body.to_string()))
            .await
    }

    /// An operator write with the credential.
    pub async fn operator_write(&self, path: &str, key: &str, body: &Value) -> Answer {
        let headers = vec![
            ("x-owner-id", "operator-cli".to_owned()),
            ("x-idempotency-key", key.to_owned()),
            ("authorization", format!("Bearer {OPERATOR_TOKEN}")),
        ];
        self.send(Method::POST, path, &headers, Some(&body.to_string()))
            .await
    }

    pub async fn get(&self, path: &str) -> Answer {
        self.send(Method::GET, path, &[], None).await
    }

    /// A stack with one EUR account `id` holding `amount`.
    pub async fn funded(id: &str, amount: i64) -> Self {
        Self::funded_with(&[], id, amount).await
    }

    /// A stack with `extra` settings and the EUR account `id` funded with `amount`.
    pub async fn funded_with(extra: &[(&str, &str)], id: &str, amount: i64) -> Self {
        let stack = Self::start_with(extra).await;
        stack.account(id, "EUR").await;
        stack.fund(id, amount).await;
        stack
    }

    /// A stack with `extra` settings, the EUR account `account` holding 500 and a PENDING payout
    /// of 100 on it.
    pub async fn with_payout(extra: &[(&str, &str)], account: &str) -> (Self, Uuid) {
        let stack = Self::funded_with(extra, account, 500).await;
        let payout = stack.payout(account, 100, "EUR").await;
        (stack, payout)
    }

    pub async fn account(&self, id: &str, currency: &str) {
        let body = json!({ "accountId": id, "currency": currency });
        self.write("/v1/accounts", &format!("acct-{id}"), None, &body)
            .await
            .expect("create account", 201, None);
    }

    pub async fn fund(&self, id: &str, amount: i64) {
        let reference = format!("fund-{}", Uuid::new_v4());
        let body = json!({ "amountMinor": amount, "reference": reference });
        self.write(&format!("/v1/accounts/{id}/fund"), &reference, None, &body)
            .await
            .expect("fund", 200, None);
    }

    pub async fn payout(&self, account: &str, amount: i64, currency: &str) -> Uuid {
        let id = Uuid::new_v4();
        let body = json!({
            "payoutId": id, "accountId": account, "amountMinor": amount,
            "currency": currency, "beneficiaryRef": format!("ben-{id}"),
        });
        self.write("/v1/payouts", &format!("create-{id}"), None, &body)
            .await
            .expect("create payout", 201, None);
        id
    }

    pub async fn claim(&self, payout: Uuid, token: i64, expected: &str) -> Answer {
        self.write(
            &format!("/v1/payouts/{payout}/claim"),
            &format!("payout-{payout}"),
            Some(token),
            &json!({ "expectedState": expected }),
        )
        .await
    }

    /// A newer holder (a fresh token) claiming `payout` as `expected` is refused: 409
    /// PAYOUT_NOT_CLAIMABLE.
    pub async fn not_claimable(&self, step: &str, payout: Uuid, expected: &str) {
        self.claim(payout, self.token(), expected).await.expect(
            step,
            409,
            Some("PAYOUT_NOT_CLAIMABLE"),
        );
    }

    pub async fn post(&self, payout: Uuid, token: i64) -> Answer {
        self.write(
            &format!("/v1/payouts/{payout}/post"),
            &format!("payout-{payout}"),
            Some(token),
            &post_body(payout),
        )
        .await
    }

    /// What the rail proxy would do between claim and post: SUBMITTING, then RAIL_ACKED.
    pub async fn rail_ack(&self, payout: Uuid) {
        rail_ack(&self.pool, payout).await;
    }

    /// The payout's state, read from paydb.
    pub async fn state_of(&self, payout: Uuid) -> String {
        payout_state(&self.pool, payout).await
    }

    /// Claims `payout` (PENDING) under a fresh token, which must succeed; the token.
    pub async fn claimed(&self, payout: Uuid) -> i64 {
        let token = self.token();
        self.claim(payout, token, "PENDING")
            .await
            .expect("claim", 200, None);
        token
    }

    /// Moves a CLAIMED payout on to RAIL_AMBIGUOUS (through SUBMITTING), as a forward whose
    /// outcome the rail proxy never learnt leaves it.
    pub fn make_ambiguous(&self, payout: Uuid) {
        self.psql(&format!(
            "UPDATE payouts SET state = 'SUBMITTING' WHERE payout_id = '{payout}'; \
             UPDATE payouts SET state = 'RAIL_AMBIGUOUS' WHERE payout_id = '{payout}'"
        ));
    }

    pub async fn metrics(&self) -> String {
        crate::harness::metrics_of(&self.url).await
    }
}

/// The submission id and rail reference the simulated rail uses for a payout.
pub fn rail_ids(payout: Uuid) -> (Uuid, String) {
    (
        Uuid::from_u128(payout.as_u128() ^ 0x5a5a),
        format!("rail-{}", payout.simple()),
    )
}

pub fn post_body(payout: Uuid) -> Value {
    let (submission, reference) = rail_ids(payout);
    json!({ "railReference": reference, "submissionId": submission, "railOutcome": "ACKED" })
}

/// The payout's state, read from paydb.
pub async fn payout_state(pool: &PgPool, payout: Uuid) -> String {
    let (state,): (String,) = sqlx::query_as("SELECT state FROM payouts WHERE payout_id = $1")
        .bind(payout)
        .fetch_one(pool)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    state
}

/// Moves a CLAIMED payout on through SUBMITTING to RAIL_ACKED, as the simulated rail does: each
/// step with how many rows it moved (none where the payout was not in the step's from-state).
pub async fn simulate_rail(pool: &PgPool, payout: Uuid) -> Vec<(&'static str, u64)> {
    let (submission, reference) = rail_ids(payout);
    let mut moves = Vec::new();
    for (step, value) in [
        (
            "UPDATE payouts SET state = 'SUBMITTING', submission_id = $2::uuid \
             WHERE payout_id = $1 AND state = 'CLAIMED'",
            submission.to_string(),
        ),
        (
            "UPDATE payouts SET state = 'RAIL_ACKED', rail_reference = $2 \
             WHERE payout_id = $1 AND state = 'SUBMITTING'",
            reference,
        ),
    ] {
        let moved = sqlx::query(step)
            .bind(payout)
            .bind(value)
            .execute(pool)
            .await
            .unwrap_or_else(|e| panic!("{e}"))
            .rows_affected();
        moves.push((step, moved));
    }
    moves
}

/// [`simulate_rail`] for a payout that must move through both steps.
pub async fn rail_ack(pool: &PgPool, payout: Uuid) {
    for (step, moved) in simulate_rail(pool, payout).await {
        assert_eq!(moved, 1, "payout {payout}: {step}");
    }
}
