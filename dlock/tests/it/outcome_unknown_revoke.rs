//! `dlock revoke` when L8's answer is lost (docs/contract.md#outcome-unknown): the lock server's
//! store sits behind the fault proxy of `outcome_unknown`, which lets L8's write through and cuts
//! (PostgreSQL) or stalls (etcd) its answer, so the lock server answers `503 OUTCOME_UNKNOWN`
//! although the grant is gone. The real binary reads the key, finds the grant gone, says so,
//! and finishes the revocation at both fences with the token after the revoked one: exit 0, one
//! revocation in the store, never a second L8 and never a failure. Run again with `--settle`, it
//! reads first and revokes nothing more. Positive control: with every connection to the store
//! reset before anything is sent, the revocation is refused as retry-safe (exit 1, "nothing was
//! revoked"), and the store shows the grant still held and no revocation.

use std::time::Duration;

use dlock_contract::ErrorCode;
use dlock_contract::payment_client::PaymentClient;
use dlock_devstack::faultproxy::Mode;
use dlock_devstack::stack::{Role, Stack};
use uuid::Uuid;

use crate::harness::{Backend, client, etcd_under, eventually, hold, on_each_backend, session};
use crate::outcome_unknown::{Proxied, l7, proxied};
use crate::shared::accounts::open_account;
use crate::shared::process::Ran;

const EXE: &str = env!("CARGO_BIN_EXE_dlock");
const OPERATOR_TOKEN: &str = "revoke-outcome-operator-token";

/// Runs `dlock revoke KEY` against the lock server at `lock` and the fences of `fences`.
async fn revoke(lock: &str, fences: &Stack, key: &str, reason: &str, extra: &[&str]) -> Ran {
    tokio::process::Command::new(EXE)
        .args(["revoke", key, "--reason", reason, "--operator", "oncall"])
        .args(["--lock-server", lock])
        .args(["--payment-resource", &fences.payment().url()])
        .args(["--rail-proxy", &fences.proxy().url()])
        .args(["--operator-token", OPERATOR_TOKEN])
        .args(extra)
        .output()
        .await
        .unwrap_or_else(|e| panic!("dlock revoke: {e}"))
        .into()
}

/// How many revocations of `key` the lock server's store holds, read from the store itself.
async fn revocations(p: &Proxied, key: &str) -> usize {
    if let Some(pg) = p.stack.pg() {
        let sql = format!("SELECT count(*) FROM revocations WHERE lock_key = '{key}'");
        let count = pg
            .psql("lockdb", &sql)
            .unwrap_or_else(|e| panic!("lockdb: {e:#}"));
        return count
            .trim()
            .parse()
            .unwrap_or_else(|e| panic!("{count:?}: {e}"));
    }
    let etcd = p.stack.etcd().unwrap_or_else(|| panic!("no store"));
    // One etcd per test: every revocation record under the prefix is this test's.
    etcd_under(&etcd.endpoint(), "/dlock/r/")
        .await
        .kvs()
        .iter()
        .filter(|kv| kv.value_str().is_ok_and(|v| v.contains(key)))
        .count()
}

/// The account fence and the rail proxy's high-water mark of `account` (0 when it has none).
async fn fences_of(fences: &Stack, payment: &PaymentClient, account: &str) -> (i64, i64) {
    let fence = payment
        .get_account(account)
        .await
        .unwrap_or_else(|e| panic!("P5 {account}: {e}"))
        .fence;
    let url = format!("{}/v1/rail/high-water/{account}", fences.proxy().url());
    let (status, _, body) = crate::harness::raw(reqwest::Method::GET, &url, &[], None).await;
    let mark = match status {
        200 => body["highestToken"]
            .as_i64()
            .unwrap_or_else(|| panic!("{url}: {body}")),
        404 => 0,
        _ => panic!("{url}: {status} {body}"),
    };
    (fence, mark)
}

async fn lost_revoke(backend: Backend) {
    let _ = tracing_subscriber::fmt().with_test_writer().try_init();
    let p = proxied(backend).await;
    let fences = Stack::builder(EXE)
        .only(&[Role::PaymentResource, Role::RailStub, Role::RailProxy])
        .operator_token(OPERATOR_TOKEN)
        .start();
    let payment = PaymentClient::new(&fences.payment().url(), "revoke-test")
        .unwrap_or_else(|e| panic!("{e}"));
    let account = format!("rv-{}", &Uuid::new_v4().simple().to_string()[..12]);
    open_account(&payment, &account, None).await;
    let key = format!("payout:{account}");
    let holder = client(&p.url, "wedged-holder");
    let sid = session(&holder, 60_000).await;
    let token = hold(&holder, &key, sid, 60_000).await.fencing_token;
    // Only L8's write carries the reason: in dlock_revoke's Bind (pg), in the revocation record
    // of the revoking transaction (etcd).
    let reason = format!("holder wedged {}", Uuid::new_v4().simple());

    // Positive control: every connection to the store reset, nothing reaches it. The revocation
    // is refused retry-safe, and nothing is revoked or fenced.
    let resets = p.proxy.stats().reset;
    p.proxy.set_mode(Mode::Reset);
    eventually("the open connections reset", Duration::from_secs(5), || {
        let reset = p.proxy.stats().reset;
        async move { (reset > resets).then_some(()) }
    })
    .await;
    let guarded = token.to_string();
    let refused = revoke(
        &p.url,
        &fences,
        &key,
        &reason,
        &["--expected-token", &guarded],
    )
    .await;
    assert_eq!(refused.code, Some(1), "{backend:?}: {refused}");
    assert!(
        refused.err.contains("nothing was revoked"),
        "{backend:?}: says it is retry-safe: {refused}"
    );
    p.proxy.set_mode(Mode::Forward);
    let info = eventually(
        "the lock server reaches its store again",
        Duration::from_secs(20),
        || {
            let (holder, key) = (holder.clone(), key.clone());
            async move { holder.get(&key).await.ok() }
        },
    )
    .await;
    assert_eq!(
        (info.held, info.fencing_token),
        (true, Some(token)),
        "{backend:?}: the refused revocation left the grant: {info:?}"
    );
    assert_eq!(revocations(&p, &key).await, 0, "{backend:?}");
    assert_eq!(
        fences_of(&fences, &payment, &account).await,
        (0, 0),
        "{backend:?}"
    );
    assert_eq!(p.proxy.fired(), 0);

    // L8's answer lost: the binary settles it by reading the key and completes.
    p.lose_answer_of(reason.as_bytes(), 0);
    let ran = revoke(&p.url, &fences, &key, &reason, &[]).await;
    assert_eq!(
        p.proxy.fired(),
        1,
        "{backend:?}: L8 reached the store: {ran}"
    );
    assert_eq!(ran.code, Some(0), "{backend:?}: {ran}");
    println!(
        "{backend:?}: dlock revoke with L8's answer lost:\n{}",
        ran.out
    );
    for said in [
        format!("the answer to L8 for token {token} was lost"),
        "OUTCOME_UNKNOWN".to_owned(),
        format!("{key} is not held: the revocation took effect"),
        format!("fence 0 -> {}", token + 1),
        format!("high-water 0 -> {}", token + 1),
        "done:".to_owned(),
    ] {
        assert!(ran.out.contains(&said), "{backend:?}: says {said:?}: {ran}");
    }
    assert_eq!(
        revocations(&p, &key).await,
        1,
        "{backend:?}: revoked once: {ran}"
    );
    let info = l7(&holder, &key, backend).await;
    assert!(!info.held, "{backend:?}: {info:?}");
    let renewed = holder.renew(&key, sid, token, Some(60_000)).await;
    assert_eq!(
        renewed.as_ref().err().and_then(|e| e.code()),
        Some(ErrorCode::LockLost),
        "{backend:?}: the revoked holder's grant is gone: {renewed:?}"
    );
    assert_eq!(
        fences_of(&fences, &payment, &account).await,
        (token + 1, token + 1),
        "{backend:?}: both fences at the token after the revoked one"
    );

    // Settled again (an operator unsure what the first run did): read first, nothing revoked
    // again, the fences already there.
    let settle = token.to_string();
    let again = revoke(&p.url, &fences, &key, &reason, &["--settle", &settle]).await;
    assert_eq!(again.code, Some(0), "{backend:?}: {again}");
    assert_eq!(revocations(&p, &key).await, 1, "{backend:?}: {again}");
    println!(
        "{backend:?}: L8 with its answer lost -> dlock revoke read {key} (not held), fenced token \
         {token} out at floor {} (account fence and rail mark), exit 0, 1 revocation in the store; \
         store reset before L8 -> exit 1, nothing revoked",
        token + 1
    );
}

on_each_backend!(lost_revoke =>
    a_revocation_whose_answer_is_lost_is_settled_by_reading_the_key_on_pg,
    a_revocation_whose_answer_is_lost_is_settled_by_reading_the_key_on_etcd);
