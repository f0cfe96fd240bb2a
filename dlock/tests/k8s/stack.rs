//! What scenarios do at the real services of `dlock dev up` (accounts open through
//! `shared::accounts`): a lock held as a worker holds it, a revoked holder's writes refused at
//! both fences, and the rail proxy's high-water mark read from paydb.

use dlock_contract::auth::Credential;
use dlock_contract::client::LockClient;
use dlock_contract::lock::{LockGrant, Session};
use serde_json::{Value, json};

use crate::shared::http::post_json;
use crate::shared::payouts::register_payout;
use crate::world::DevStack;

/// A lock held at the real lock server as a worker holds it: a session and a grant of 60 s.
pub struct Held {
    pub client: LockClient,
    pub session: Session,
    pub grant: LockGrant,
}

/// `owner` (with the executor's credential) takes `key` at the lock server on `url`.
pub async fn hold(url: &str, executor: &str, owner: &str, key: &str) -> Held {
    let client = LockClient::new(url, owner)
        .unwrap_or_else(|e| panic!("{e}"))
        .with_credential(Some(Credential::fixed(executor)));
    let session = client
        .create_session(Some(60_000))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let grant = client
        .acquire(key, session.session_id, Some(60_000), None)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    Held {
        client,
        session,
        grant,
    }
}

/// A worker whose grant was revoked, writing on with it: its owner id, the revoked token and
/// the proof the grant carried.
pub struct Stale<'a> {
    pub owner: &'a str,
    pub token: i64,
    pub proof: Option<String>,
}

impl Stale<'_> {
    /// Registers a new payout on `account` at the stack's payment resource (as the registrar),
    /// then claims it there and submits it at the stack's rail proxy as the stale worker, with
    /// the executor's credential: both answers must be 409 FENCED_OUT. Returns the payout's id
    /// and the claim's answer.
    pub async fn is_fenced_out_at_both_points(
        &self,
        services: &DevStack,
        account: &str,
    ) -> (uuid::Uuid, Value) {
        // Registering is the registrar's; the stale claim and submission are the executor's.
        let stale =
            register_payout(&services.registrar_payments(), account, 500, "ben-stale").await;
        let bearer = format!("Bearer {}", services.token("executor"));
        let payment_url = services.url("paymentResource");
        let proxy_url = services.url("railProxy");
        let key = format!("payout-{stale}");
        let token = self.token.to_string();
        let mut headers = vec![
            ("authorization", bearer.as_str()),
            ("x-owner-id", self.owner),
            ("x-idempotency-key", key.as_str()),
            ("x-fencing-token", token.as_str()),
        ];
        if let Some(proof) = &self.proof {
            headers.push((dlock_contract::headers::FENCING_PROOF, proof.as_str()));
        }
        let claim = fenced_out(
            post_json(
                &format!("{payment_url}/v1/payouts/{stale}/claim"),
                &headers,
                &json!({"expectedState": "PENDING"}),
            )
            .await,
        );
        fenced_out(
            post_json(
                &format!("{proxy_url}/v1/rail/submissions"),
                &headers,
                &json!({"payoutId": stale, "accountId": account, "amountMinor": 500,
                       "currency": "EUR", "beneficiaryRef": "ben-stale"}),
            )
            .await,
        );
        (stale, claim)
    }
}

/// The body of a 409 FENCED_OUT answer; panics on any other.
fn fenced_out((code, _, body): (u16, String, Value)) -> Value {
    assert_eq!(
        (code, body["code"].as_str()),
        (409, Some("FENCED_OUT")),
        "{body}"
    );
    body
}

/// The rail proxy's high-water mark of `account`, read from paydb (`paydb` its URL).
pub async fn rail_high_water(paydb: &str, account: &str) -> i64 {
    let pool = sqlx::PgPool::connect(paydb)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let (high,): (i64,) =
        sqlx::query_as("SELECT highest_token FROM rail_high_water WHERE account_id = $1")
            .bind(account)
            .fetch_one(&pool)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
    high
}
