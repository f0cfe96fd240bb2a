//! The caller's identity at the lock server: `POST /v1/sessions` binds the body's `ownerId` to the
//! credential when `X-Owner-Id` is absent, and a revocation records the authenticated identity
//! beside the free-text `operator`.

use super::*;

/// A tokens file with a worker (the executor role, its third column) and the operator, and its
/// configuration keys.
fn auth_files(dir: &std::path::Path) -> (String, [(&'static str, String); 2]) {
    let path = dir.join("tokens");
    std::fs::write(
        &path,
        "worker-a wrk-a-0123456789abcdef executor\noperator opr-0123456789abcdef\n",
    )
    .unwrap_or_else(|e| panic!("{e}"));
    (
        path.display().to_string(),
        [
            ("auth.mode", "tokens".to_owned()),
            ("auth.tokens-file", path.display().to_string()),
        ],
    )
}

const WORKER: &str = "Bearer wrk-a-0123456789abcdef";
const OPERATOR: &str = "Bearer opr-0123456789abcdef";

/// Every session the backend holds, as (session id, owner).
async fn stored_sessions(stack: &LockStack) -> Vec<String> {
    match stack.backend {
        Backend::Pg => {
            let pool = lockdb(stack).await;
            let rows: Vec<(Uuid, String)> =
                sqlx::query_as("SELECT session_id, owner_id FROM sessions ORDER BY 1")
                    .fetch_all(&pool)
                    .await
                    .unwrap_or_else(|e| panic!("{e}"));
            rows.into_iter().map(|(s, o)| format!("{s} {o}")).collect()
        }
        Backend::Etcd => {
            let endpoint = stack.etcd().map(|e| e.endpoint());
            etcd_under(&endpoint.unwrap_or_else(|| panic!("no etcd")), "/dlock/s/")
                .await
                .kvs()
                .iter()
                .map(|kv| {
                    format!(
                        "{} {}",
                        kv.key_str().unwrap_or_default(),
                        kv.value_str().unwrap_or_default()
                    )
                })
                .collect()
        }
    }
}

async fn open_session(
    url: &str,
    auth: &str,
    header: Option<&str>,
    body: Value,
) -> (u16, String, Value) {
    let mut headers = vec![("authorization", auth)];
    headers.extend(header.map(|owner| ("x-owner-id", owner)));
    post_json(&format!("{url}/v1/sessions"), &headers, &body).await
}

/// `POST /v1/sessions` as `auth`, the owner `owner` named in the body only.
async fn open_named(url: &str, auth: &str, owner: &str) -> (u16, String, Value) {
    let body = json!({ "ownerId": owner, "ttlMillis": 5_000 });
    open_session(url, auth, None, body).await
}

/// `POST /v1/sessions` with the owner in the body only. The auth layer binds
/// `X-Owner-Id`; the body's `ownerId` is bound by the same rule: a worker cannot open a session
/// in another worker's name (403 FORBIDDEN, nothing stored); its own name, `<identity>/<worker>`
/// and an operator naming anyone still open one.
async fn body_owner_is_bound(backend: Backend) {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let (_, keys) = auth_files(dir.path());
    let extra: Vec<(&str, &str)> = keys.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let (stack, url) = LockStack::serving(backend, &extra).await;

    let before = stored_sessions(&stack).await;
    for foreign in ["worker-b", "worker-ab", "worker-a-x/1"] {
        let (status, content_type, body) = open_named(&url, WORKER, foreign).await;
        assert_eq!(status, 403, "{backend:?}: {foreign}: {body}");
        assert_eq!(content_type, JSON);
        assert_eq!(body["code"], "FORBIDDEN", "{body}");
        assert_eq!(body["retrySafe"], false, "{body}");
    }
    // The header route is refused by the auth layer as before.
    let (status, _, body) = open_session(
        &url,
        WORKER,
        Some("worker-b"),
        json!({ "ttlMillis": 5_000 }),
    )
    .await;
    assert_eq!(status, 403, "{body}");
    assert_eq!(
        stored_sessions(&stack).await,
        before,
        "{backend:?}: a refused session was stored"
    );

    // Positive controls.
    for (auth, owner) in [
        (WORKER, "worker-a"),
        (WORKER, "worker-a/pod-1"),
        (OPERATOR, "worker-b"),
    ] {
        let (status, content_type, body) = open_named(&url, auth, owner).await;
        assert_eq!(status, 201, "{backend:?}: {owner}: {body}");
        assert_eq!(content_type, JSON);
        assert_eq!(body["ownerId"], owner);
    }
    assert_eq!(stored_sessions(&stack).await.len(), before.len() + 3);
}

on_both_backends!(a_session_body_owner_id_is_bound_to_the_credential_on_both_backends => body_owner_is_bound);

/// The stored revocation record: (operator, revoked_by).
async fn stored_revocation(stack: &LockStack, id: &str) -> (String, Option<String>) {
    match stack.backend {
        Backend::Pg => {
            let pool = lockdb(stack).await;
            sqlx::query_as(
                "SELECT operator, revoked_by FROM revocations WHERE revocation_id = $1::uuid",
            )
            .bind(id)
            .fetch_one(&pool)
            .await
            .unwrap_or_else(|e| panic!("{e}"))
        }
        Backend::Etcd => {
            let mut etcd = etcd(stack).await;
            let response = etcd
                .get(format!("/dlock/r/{id}"), None)
                .await
                .unwrap_or_else(|e| panic!("{e}"));
            let kv = response
                .kvs()
                .first()
                .unwrap_or_else(|| panic!("no revocation {id}"));
            let record: Value =
                serde_json::from_slice(kv.value()).unwrap_or_else(|e| panic!("{e}"));
            (
                record["operator"].as_str().unwrap_or_default().to_owned(),
                record["revokedBy"].as_str().map(str::to_owned),
            )
        }
    }
}

/// The body's `operator` is free text; the revocation also records who the credential
/// proved the caller to be. Without authentication there is nobody to record.
async fn revocation_records_identity(backend: Backend) {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let (_, keys) = auth_files(dir.path());
    let extra: Vec<(&str, &str)> = keys.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let (stack, url) = LockStack::serving(backend, &extra).await;
    let worker = client(&url, "worker-a/pod-1").with_credential(Some(
        dlock_contract::auth::Credential::fixed("wrk-a-0123456789abcdef"),
    ));
    let s = session(&worker, 60_000).await;
    let grant = hold(&worker, "audit:k", s, 60_000).await;
    let (status, content_type, body) = post_json(
        &format!("{url}/v1/locks/audit:k/revoke"),
        &[("authorization", OPERATOR), ("x-owner-id", "ops")],
        &json!({ "operator": "somebody else entirely", "reason": "stuck worker on audit:k",
                 "expectedToken": grant.fencing_token }),
    )
    .await;
    assert_eq!(status, 200, "{backend:?}: {body}");
    assert_eq!(content_type, JSON);
    let id = body["revocationId"].as_str().unwrap_or_default().to_owned();
    let (operator, revoked_by) = stored_revocation(&stack, &id).await;
    assert_eq!(operator, "somebody else entirely");
    assert_eq!(revoked_by.as_deref(), Some("operator"), "{backend:?}");

    // auth.mode = none: the record says no identity was proved.
    let (open, url) = LockStack::serving(backend, &[]).await;
    let (anyone, s) = party(&url, "anyone", 60_000).await;
    let revocation =
        held_then_revoked(&anyone, "audit:k", s, ("laptop", "testing the audit trail")).await;
    let (operator, revoked_by) =
        stored_revocation(&open, &revocation.revocation_id.to_string()).await;
    assert_eq!(operator, "laptop");
    assert_eq!(revoked_by, None, "{backend:?}");
}

on_both_backends!(a_revocation_records_the_authenticated_identity_on_both_backends => revocation_records_identity);
