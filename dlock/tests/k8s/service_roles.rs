//! Under TokenReview every ServiceAccount of the cluster authenticates; only those named in
//! `auth.tokenreview.service-accounts` hold roles (docs/threat-model.md#roles). A real
//! `dlock serve payment-resource` on PostgreSQL, reviewing tokens at the real API server: a
//! ServiceAccount outside the list is 403 on a write and a read and changes nothing, the listed
//! executor cannot open or fund an account, and the listed treasury opens one (positive control).

use std::time::{Duration, Instant};

use dlock_devstack::{PgServer, free_port};
use serde_json::{Value, json};

use crate::world::{World, serve};

const NS: &str = "roles";
/// The payment resource's own account (it reviews callers' tokens with it).
const OWN: &str = "payment-resource";

/// `POST url` with `token`'s ServiceAccount as the caller; the status and the body.
async fn post(
    http: &reqwest::Client,
    url: &str,
    token: &str,
    account: &str,
    body: &Value,
) -> (u16, Value) {
    let answer = http
        .post(url)
        .bearer_auth(token)
        .header(
            "x-owner-id",
            format!("system:serviceaccount:{NS}:{account}"),
        )
        .header(
            "x-idempotency-key",
            format!("{account}-{}", uuid::Uuid::new_v4()),
        )
        .json(body)
        .send()
        .await
        .unwrap_or_else(|e| panic!("POST {url}: {e}"));
    let status = answer.status().as_u16();
    (status, answer.json().await.unwrap_or_default())
}

async fn count(pool: &sqlx::PgPool) -> i64 {
    sqlx::query_scalar(
        "SELECT (SELECT count(*) FROM accounts) + (SELECT count(*) FROM idempotency_records)",
    )
    .fetch_one(pool)
    .await
    .unwrap_or_else(|e| panic!("{e}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_service_account_outside_the_allow_list_is_refused_by_a_real_payment_resource() {
    let world = World::start().await;
    world.namespace(NS);
    for account in [OWN, "treasury", "runner", "stranger"] {
        world.kubectl(&["create", "serviceaccount", account, "-n", NS]);
    }
    world.kubectl(&[
        "create",
        "clusterrolebinding",
        "roles-payment-resource-auth-delegator",
        "--clusterrole=system:auth-delegator",
        &format!("--serviceaccount={NS}:{OWN}"),
    ]);
    let token = |account: &str, audience: Option<&str>| {
        let mut args = vec!["create", "token", account, "-n", NS, "--duration=1h"];
        if let Some(audience) = audience {
            args.extend_from_slice(&["--audience", audience]);
        }
        world.kubectl(&args).trim().to_owned()
    };
    let (api, ca) = world.api_server(NS);
    let dir = world.cluster.dir().join("roles");
    std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("{e}"));
    let own_token = dir.join("own-token");
    std::fs::write(&own_token, token(OWN, None)).unwrap_or_else(|e| panic!("{e}"));

    let pg = PgServer::start(None).unwrap_or_else(|e| panic!("PostgreSQL: {e:#}"));
    pg.create_database("paydb")
        .unwrap_or_else(|e| panic!("{e:#}"));
    let port = free_port().unwrap_or_else(|e| panic!("{e}"));
    let config = format!(
        "\"server.listen\" = \"127.0.0.1:{port}\"\n\
         \"payment.pg.url\" = {:?}\n\
         \"fencing.insecure-no-proofs\" = true\n\
         \"auth.mode\" = \"tokenreview\"\n\
         \"auth.tokenreview.url\" = {api:?}\n\
         \"auth.tokenreview.ca-file\" = {:?}\n\
         \"auth.tokenreview.token-file\" = {:?}\n\
         \"auth.tokenreview.audiences\" = [\"dlock\"]\n\
         \"auth.tokenreview.service-accounts\" = [\"{NS}/treasury=treasury\", \"{NS}/runner=executor\"]\n",
        pg.url("paydb"),
        ca.display().to_string(),
        own_token.display().to_string(),
    );
    let (_service, _log) = serve(
        "payment-resource",
        "payment-resource",
        &dir,
        &config,
        port,
        Duration::from_secs(60),
    );
    let url = format!("http://127.0.0.1:{port}");
    let http = dlock_contract::client::http_client().unwrap_or_else(|e| panic!("{e}"));
    let pool = sqlx::PgPool::connect(&pg.url("paydb"))
        .await
        .unwrap_or_else(|e| panic!("{e}"));

    // Positive control first, which also waits for the auth-delegator binding to take effect:
    // the listed treasury opens an account.
    let treasury = token("treasury", Some("dlock"));
    let opened = Instant::now();
    loop {
        let (status, body) = post(
            &http,
            &format!("{url}/v1/accounts"),
            &treasury,
            "treasury",
            &json!({"accountId": "acct-t", "currency": "EUR"}),
        )
        .await;
        if (200..300).contains(&status) {
            break;
        }
        assert!(
            status == 503 && opened.elapsed() < Duration::from_secs(30),
            "the listed treasury could not open an account: {status} {body}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    let before = count(&pool).await;
    let stranger = token("stranger", Some("dlock"));
    let open = json!({"accountId": "acct-k", "currency": "EUR"});
    let (status, body) = post(
        &http,
        &format!("{url}/v1/accounts"),
        &stranger,
        "stranger",
        &open,
    )
    .await;
    assert_eq!(
        (status, body["code"].as_str()),
        (403, Some("FORBIDDEN")),
        "{body}"
    );
    assert_eq!(body["details"]["roles"], json!([]), "{body}");
    let read = http
        .get(format!("{url}/v1/payouts"))
        .bearer_auth(&stranger)
        .send()
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(read.status().as_u16(), 403, "a read outside the allow-list");
    let runner = token("runner", Some("dlock"));
    for (path, payload) in [
        ("/v1/accounts", open.clone()),
        (
            "/v1/accounts/acct-t/fund",
            json!({"amountMinor": 100, "reference": "runner-fund"}),
        ),
    ] {
        let (status, body) =
            post(&http, &format!("{url}{path}"), &runner, "runner", &payload).await;
        assert_eq!(
            (status, body["code"].as_str()),
            (403, Some("FORBIDDEN")),
            "POST {path} as the listed executor: {body}"
        );
    }
    assert_eq!(
        count(&pool).await,
        before,
        "the refused requests changed nothing"
    );
}
