//! `dlock fundings list` (`GET /v1/fundings`, docs/contract.md#dual-approval) through the real
//! services of `dlock dev up` with dual approval: the second treasury identity finds the funding
//! that waits for it, with its requester, and approves it by the id the list gave; afterwards the
//! funding is listed as applied and approved by that identity. Only a treasury identity may list
//! (403 for the executor and the registrar, nothing changes); a bad `state` or `limit` is
//! 400 VALIDATION_FAILED naming the field.

use super::*;

const THRESHOLD: &str = "100000";
const TREASURY_2: &str = "treasury-2-list-0123456789abcdef";

/// `dlock fundings list --state STATE -o json` as `identity`: the answer, parsed.
fn listed(state: &str, payment: &str, identity: &str, file: &str) -> Value {
    let (ok, out, said) = dlock_as(
        &["fundings", "list", "--state", state, "-o", "json"],
        payment,
        identity,
        file,
    );
    assert!(ok, "{identity} lists the {state} fundings: {said}");
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("not JSON ({e}): {out}"))
}

/// The items of a listing.
fn items(list: &Value) -> &Vec<Value> {
    list["items"]
        .as_array()
        .unwrap_or_else(|| panic!("no items: {list}"))
}

/// Treasury A funds above the threshold; `dlock fundings list` as treasury B shows it pending
/// with A as its requester (JSON and table); B approves it via the CLI by the listed id; it is
/// then no longer pending, and `--state all` / `--state applied` show it APPROVED by B. The
/// executor's and the registrar's credentials are 403 FORBIDDEN (the treasury's own request to
/// the same URL is the positive control) and change neither paydb nor the list; a bad state or
/// limit is 400 VALIDATION_FAILED naming the field.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dlock_fundings_list_shows_a_waiting_funding_to_the_second_treasury_identity() {
    let stack = DevStack::with_second_treasury(THRESHOLD, TREASURY_2).await;
    let payment = stack.url("paymentResource");
    let files = TokenFiles::new();
    let second = files.write("treasury-2", TREASURY_2);
    let executor = files.write("executor", &stack.token("executor"));

    // Nothing waits yet: the table says so (the control for the listing below).
    let (ok, out, said) = dlock_as(&["fundings", "list"], &payment, "treasury-2", &second);
    assert!(ok, "an empty listing: {said}");
    assert!(out.contains("no pending fundings"), "{out}");

    // Treasury A asks for a funding above the threshold: it waits.
    let pending = large_funding_waits(&stack.treasury_payments(), "acct-list", "list").await;

    // Treasury B lists what waits: that funding, asked for by A, not approved.
    let waiting = listed("pending", &payment, "treasury-2", &second);
    assert_eq!(items(&waiting).len(), 1, "{waiting}");
    assert_eq!(waiting["truncated"], json!(false), "{waiting}");
    let item = &items(&waiting)[0];
    assert_eq!(item["accountId"], "acct-list", "{item}");
    assert_eq!(item["amountMinor"], json!(5_000_000), "{item}");
    assert_eq!(item["currency"], "EUR", "{item}");
    assert_eq!(item["reference"], "large-list", "{item}");
    assert_eq!(item["requestedBy"], "treasury", "{item}");
    assert_eq!(item["status"], "PENDING_APPROVAL", "{item}");
    assert_eq!(item["approvedBy"], Value::Null, "{item}");
    assert!(item["requestedAt"].is_string(), "{item}");
    let id = item["fundingId"]
        .as_str()
        .unwrap_or_else(|| panic!("no fundingId: {item}"))
        .to_owned();
    assert_eq!(
        id,
        pending.funding_id.to_string(),
        "the funding A asked for"
    );
    let (ok, table, said) = dlock_as(&["fundings", "list"], &payment, "treasury-2", &second);
    assert!(ok, "the table: {said}");
    let row = table
        .lines()
        .find(|line| line.starts_with(&id))
        .unwrap_or_else(|| panic!("no row for {id}: {table}"));
    for column in [
        "acct-list",
        "5000000",
        "EUR",
        "PENDING_APPROVAL",
        "treasury",
    ] {
        assert!(row.contains(column), "{column} in {row}");
    }

    // Only a treasury identity may list; a refusal changes nothing, paydb or the list.
    let url = format!("{payment}/v1/fundings");
    let (status, _, body) = get_as(&format!("{url}?state=all"), TREASURY_2).await;
    assert_eq!(
        status, 200,
        "the treasury's own request (the control): {body}"
    );
    assert_eq!(items(&body).len(), 1, "{body}");
    let before = stack.snapshot().await;
    for who in ["executor", "registrar"] {
        for query in ["", "?state=all", "?state=bogus"] {
            let answer = get_as(&format!("{url}{query}"), &stack.token(who)).await;
            assert_refused(&format!("{who} GET {query}"), &answer, 403, "FORBIDDEN");
            let message = answer.2["message"].as_str().unwrap_or_default();
            assert!(
                message.contains(&format!("`{who}` is not a treasury identity")),
                "{message}"
            );
        }
    }
    stack
        .forbidden_with_hint(
            &["fundings", "list"],
            ("executor", &executor),
            "this credential's identity has no treasury role",
            "the executor may not list fundings",
        )
        .await;
    assert_eq!(
        before,
        stack.snapshot().await,
        "the refusals changed nothing"
    );
    assert_eq!(
        listed("pending", &payment, "treasury-2", &second),
        waiting,
        "the list is unchanged"
    );

    // A bad state or limit: 400 VALIDATION_FAILED naming the field; in range it answers.
    for (query, field) in [
        ("state=bogus", "state"),
        ("state=PENDING", "state"),
        ("limit=0", "limit"),
        ("limit=501", "limit"),
        ("limit=ten", "limit"),
        ("color=red", "color"),
    ] {
        let answer = get_as(&format!("{url}?{query}"), TREASURY_2).await;
        assert_refused(query, &answer, 400, "VALIDATION_FAILED");
        assert_eq!(
            answer.2["details"]["fields"][0]["field"], field,
            "{query}: {}",
            answer.2
        );
    }
    let (status, _, body) = get_as(&format!("{url}?state=pending&limit=500"), TREASURY_2).await;
    assert_eq!(status, 200, "limit 500 is in range: {body}");
    assert_eq!(items(&body).len(), 1, "{body}");
    let (ok, _, said) = dlock_as(
        &["fundings", "list", "--limit", "0"],
        &payment,
        "treasury-2",
        &second,
    );
    assert!(!ok, "--limit 0 is refused: {said}");
    assert!(said.contains("400 VALIDATION_FAILED"), "{said}");

    // B approves it by the listed id.
    approved_by_second(&id, &payment, &second, "the second identity approves");

    // No longer pending; listed as applied, approved by B.
    assert_eq!(
        items(&listed("pending", &payment, "treasury-2", &second)).len(),
        0,
        "nothing waits any more"
    );
    let (ok, out, said) = dlock_as(&["fundings", "list"], &payment, "treasury-2", &second);
    assert!(ok && out.contains("no pending fundings"), "{out}{said}");
    for state in ["all", "applied"] {
        let list = listed(state, &payment, "treasury-2", &second);
        assert_eq!(items(&list).len(), 1, "{state}: {list}");
        let item = &items(&list)[0];
        assert_eq!(item["fundingId"], json!(id), "{state}: {item}");
        assert_eq!(item["status"], "APPROVED", "{state}: {item}");
        assert_eq!(item["requestedBy"], "treasury", "{state}: {item}");
        assert_eq!(item["approvedBy"], "treasury-2", "{state}: {item}");
        assert!(item["approvedAt"].is_string(), "{state}: {item}");
    }
    let (ok, table, said) = dlock_as(
        &["fundings", "list", "--state", "all"],
        &payment,
        "treasury-2",
        &second,
    );
    assert!(ok, "{said}");
    let row = table
        .lines()
        .find(|line| line.starts_with(&id))
        .unwrap_or_else(|| panic!("no row for {id}: {table}"));
    assert!(
        row.contains("APPROVED") && row.contains("treasury-2"),
        "{row}"
    );
}
