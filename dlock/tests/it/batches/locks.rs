//! `POST /v1/batches/acquire` and `/v1/batches/release` on a real lock server on PostgreSQL: a
//! key is one path segment whatever it holds, so an item never reaches another route.

use reqwest::Method;
use serde_json::{Value, json};

use crate::harness::{Backend, LockStack, client, hold, party, post_json, raw, session};

const JSON: &str = "application/json; charset=utf-8";

/// `POST {url}{path}` of `items` as `owner`: the answers `(status, body)`, one per item.
async fn batch(url: &str, path: &str, owner: &str, items: &[Value]) -> Vec<(u16, Value)> {
    let (status, content_type, body) = post_json(
        &format!("{url}{path}"),
        &[("x-owner-id", owner)],
        &json!({ "items": items }),
    )
    .await;
    assert_eq!(status, 200, "{path}: {body}");
    assert_eq!(content_type, JSON, "{path}: content type");
    let answers = body["items"]
        .as_array()
        .unwrap_or_else(|| panic!("{path}: no items: {body}"));
    assert_eq!(answers.len(), items.len(), "{path}: one answer per item");
    answers
        .iter()
        .map(|a| {
            (
                a["status"]
                    .as_u64()
                    .and_then(|s| u16::try_from(s).ok())
                    .unwrap_or(0),
                a.get("body").cloned().unwrap_or(Value::Null),
            )
        })
        .collect()
}

/// L7 of `key` (its URL path segment): `(status, body)`.
async fn read_lock(url: &str, segment: &str) -> (u16, Value) {
    let (status, _, body) = raw(Method::GET, &format!("{url}/v1/locks/{segment}"), &[], None).await;
    (status, body)
}

/// Acquire items whose keys hold `/`, `?` or `..` are each that item's 400 (or, for `..`, a
/// grant of the key `..` itself, as the single endpoint gives): none reaches another route, and
/// another session's lock on `k` stays held with the same token; a valid acquire in the same
/// batch is granted. Releases: the right token is 204 with no body, a wrong token or another
/// owner's grant is 409 LOCK_LOST and the lock stays held.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_item_key_never_reaches_another_route() {
    let (_stack, url) = LockStack::serving(Backend::Pg, &[]).await;
    let (holder, holder_session) = party(&url, "owner-a", 30_000).await;
    let held = hold(&holder, "k", holder_session, 30_000).await;
    let before = read_lock(&url, "k").await;
    assert_eq!(before.0, 200, "{}", before.1);
    assert_eq!(
        (&before.1["held"], &before.1["fencingToken"]),
        (&json!(true), &json!(held.fencing_token))
    );

    let other = client(&url, "owner-b");
    let other_session = session(&other, 30_000).await;
    let acquire =
        |key: &str| json!({ "key": key, "sessionId": other_session, "ttlMillis": 10_000 });
    let items = [
        acquire("k/revoke"),
        acquire("k?force=true"),
        acquire("k/../k"),
        acquire(".."),
        acquire("batch-free-1"),
        acquire("batch-free-2"),
    ];
    let answers = batch(&url, "/v1/batches/acquire", "owner-b", &items).await;
    for (n, what) in [
        (0, "a key with /"),
        (1, "a key with ?"),
        (2, "a key with /../"),
    ] {
        super::refused(what, &answers[n], 400, "VALIDATION_FAILED");
    }
    // The single endpoint answers the same for the encoded key.
    let (status, _, body) = post_json(
        &format!("{url}/v1/locks/k%2Frevoke/acquire"),
        &[("x-owner-id", "owner-b")],
        &json!({ "sessionId": other_session, "ttlMillis": 10_000 }),
    )
    .await;
    assert_eq!(
        (status, super::code_of(&body)),
        (answers[0].0, super::code_of(&answers[0].1)),
        "k%2Frevoke at the single endpoint: {body}"
    );
    // `..` is a key of the contract's alphabet: granted as the key `..`, at no other route.
    assert_eq!(answers[3].0, 200, "the key ..: {}", answers[3].1);
    assert_eq!(answers[3].1["key"], json!(".."), "{}", answers[3].1);
    for n in [4, 5] {
        assert_eq!(answers[n].0, 200, "a free key: {}", answers[n].1);
        assert_eq!(answers[n].1["key"], items[n]["key"]);
        assert_eq!(answers[n].1["sessionId"], json!(other_session));
        assert!(
            answers[n].1["fencingToken"]
                .as_i64()
                .is_some_and(|t| t > held.fencing_token)
        );
    }
    assert_eq!(
        read_lock(&url, "k").await,
        before,
        "the lock on k is held as before"
    );

    let token = |n: usize| answers[n].1["fencingToken"].as_i64().unwrap_or_default();
    let release = |key: &str, fencing_token: i64| json!({ "key": key, "sessionId": other_session, "fencingToken": fencing_token });
    let releases = [
        release("batch-free-1", token(4)),
        release("batch-free-2", token(5) + 1_000),
        release("k", held.fencing_token),
        release("..", token(3)),
    ];
    let answers_r = batch(&url, "/v1/batches/release", "owner-b", &releases).await;
    assert_eq!(answers_r[0].0, 204, "the right token: {}", answers_r[0].1);
    assert_eq!(answers_r[0].1, Value::Null, "a 204 item has no body");
    super::refused("a wrong token", &answers_r[1], 409, "LOCK_LOST");
    super::refused("another owner's grant", &answers_r[2], 409, "LOCK_LOST");
    assert_eq!(answers_r[3].0, 204, "the key ..: {}", answers_r[3].1);
    let released = read_lock(&url, "batch-free-1").await;
    assert_eq!(
        (released.0, &released.1["held"]),
        (200, &json!(false)),
        "released: {}",
        released.1
    );
    let still = read_lock(&url, "batch-free-2").await;
    assert_eq!(still.0, 200, "{}", still.1);
    assert_eq!(
        still.1["fencingToken"],
        json!(token(5)),
        "kept by the wrong token"
    );
    assert_eq!(read_lock(&url, "k").await, before, "k is held as before");
}
