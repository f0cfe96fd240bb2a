//! Admission at the rail proxy (docs/contract.md#admission-order): every row of the table answers
//! with its code, the high-water mark is shared by every replica, and only the operator raises it
//! to a revocation floor.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_row_of_the_admission_table_answers_with_its_code() {
    let (
        w,
        Rails {
            good,
            slow,
            declining,
            proxy,
            timing_out: slow_proxy,
            declining_proxy,
        },
    ) = RailWorld::with_three_rails().await;
    w.account("acct-a", 100_000).await;

    // Admitted, forwarded once, ACKED: the payout is RAIL_ACKED and the rail shows one transfer.
    let (p1, status, body) = w.submit_claimed(&proxy, "acct-a", 1_000, 10).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["outcome"], "ACKED");
    assert_eq!(body["presentedToken"], 10);
    assert_eq!(w.state(p1).await, "RAIL_ACKED");
    let transfers = statement(&good, p1).await;
    assert_eq!(transfers.len(), 1);
    assert_eq!(transfers[0]["railReference"], body["railReference"]);

    // docs/contract.md#submit-replay: the identical request again is a replay of the first answer,
    // not a duplicate.
    let (status, replay) = submit(&proxy, "acct-a", p1, 1_000, "10").await;
    assert_eq!((status, &replay), (200, &body));
    assert_eq!(metric(&proxy, "rail_duplicate_attempted_total").await, 0.0);
    // Step 2: another attempt (a newer token) is DUPLICATE_SUBMISSION, counted, never forwarded.
    let (status, dup) = submit(&proxy, "acct-a", p1, 1_000, "11").await;
    assert_eq!(status, 409);
    assert_envelope("duplicate", status, &dup, "DUPLICATE_SUBMISSION");
    assert_eq!(dup["details"]["submissionId"], body["submissionId"]);
    assert_eq!(metric(&proxy, "rail_duplicate_attempted_total").await, 1.0);
    assert_eq!(statement(&good, p1).await.len(), 1);

    // Step 1, rail: a token at or below the high-water mark is FENCED_OUT, recorded as FENCED,
    // and the rail never hears of it.
    let p2 = w.claimed("acct-a", 1_000, 12).await;
    let (status, fenced) = submit(&proxy, "acct-a", p2, 1_000, "9").await;
    assert_eq!(status, 409);
    assert_envelope("fenced rail", status, &fenced, "FENCED_OUT");
    let d = &fenced["details"];
    assert_eq!(
        (d["presentedToken"].as_i64(), d["highestToken"].as_i64()),
        (Some(9), Some(10))
    );
    assert_eq!(
        (
            d["resourceType"].as_str(),
            d["resourceId"].as_str(),
            d["ownerId"].as_str()
        ),
        (Some("rail"), Some("acct-a"), Some("worker"))
    );
    assert!(statement(&good, p2).await.is_empty());
    assert_eq!(w.submissions(p2).await, vec![("FENCED".to_owned(), 9)]);
    // docs/design.md#d-2: the fenced stale attempt does not block the legitimate holder.
    let (status, body) = submit(&proxy, "acct-a", p2, 1_000, "12").await;
    assert_eq!(status, 200, "{body}");

    // Step 1, account: a token above the mark but below a newer claim's is fenced too.
    let p3 = w.claimed("acct-a", 1_000, 13).await;
    let _p4 = w.claimed("acct-a", 1_000, 14).await;
    let (status, fenced) = submit(&proxy, "acct-a", p3, 1_000, "13").await;
    assert_eq!(status, 409);
    assert_envelope("fenced account", status, &fenced, "FENCED_OUT");
    assert_eq!(fenced["details"]["resourceType"], "account");
    assert_eq!(fenced["details"]["highestToken"], 14);
    // Each refusal counted under its resource: the rail's high-water mark once, the account once.
    for resource in ["rail", "account"] {
        let sample = format!("lock_fenced_out_total{{resource=\"{resource}\"}}");
        assert_eq!(metric(&proxy, &sample).await, 1.0, "{sample}");
    }

    // A payout not claimed with this token cannot be submitted.
    let p5 = w.claimed("acct-a", 1_000, 20).await;
    let (status, body) = submit(&proxy, "acct-a", p5, 1_000, "21").await;
    assert_eq!(status, 409);
    assert_envelope("not claimable", status, &body, "PAYOUT_NOT_CLAIMABLE");

    // Step 4, timeout: a rail slower than the read timeout leaves the outcome unknown.
    let (p6, status, body) = w.submit_claimed(&slow_proxy, "acct-a", 1_000, 30).await;
    assert_eq!(status, 409, "{body}");
    assert_envelope("ambiguous", status, &body, "RAIL_AMBIGUOUS");
    assert_eq!(body["details"]["outcome"], "TIMEOUT");
    assert_eq!(w.state(p6).await, "RAIL_AMBIGUOUS");
    assert_eq!(w.submissions(p6).await, vec![("TIMEOUT".to_owned(), 30)]);
    // The rail did take it, late: exactly the case that must never be submitted again.
    taken_late(&slow, p6).await;
    let (status, body) = submit(&slow_proxy, "acct-a", p6, 1_000, "31").await;
    assert_eq!(status, 409);
    assert_envelope(
        "ambiguous is quarantined",
        status,
        &body,
        "DUPLICATE_SUBMISSION",
    );

    // Step 4, declined: REJECTED, 422 VALIDATION_FAILED, the payout FAILED and its hold released.
    let held_before = w.held("acct-a").await;
    let (p7, status, body) = w
        .submit_claimed(&declining_proxy, "acct-a", 2_000, 40)
        .await;
    assert_eq!(status, 422, "{body}");
    assert_envelope("declined", status, &body, "VALIDATION_FAILED");
    assert_eq!(body["details"]["outcome"], "REJECTED");
    assert_eq!(w.state(p7).await, "FAILED");
    assert_eq!(
        w.held("acct-a").await,
        held_before,
        "the declined payout's hold is released"
    );
    assert!(statement(&declining, p7).await.is_empty());

    // Malformed tokens and bodies change nothing.
    let p8 = w.claimed("acct-a", 1_000, 50).await;
    for bad in ["0", "-1", "abc", "1e3", "", "9223372036854775808"] {
        let (status, body) = submit(&proxy, "acct-a", p8, 1_000, bad).await;
        assert_eq!(status, 400, "{bad}: {body}");
        assert_envelope("bad token", status, &body, "INVALID_TOKEN");
    }
    let (status, body) = submit(&proxy, "acct-a", p8, -5, "50").await;
    assert_eq!(status, 400);
    assert_envelope("bad amount", status, &body, "VALIDATION_FAILED");
    let (status, body) = submit(&proxy, "acct-a", p8, 999, "50").await;
    assert_eq!(status, 400, "an amount that is not the payout's: {body}");
    // The account id rule is the contract's, the same one the payment resource applies.
    for bad in ["acct a", "acct/a", "", &"a".repeat(65)] {
        let (status, body) = submit(&proxy, bad, p8, 1_000, "50").await;
        assert_envelope("bad account id", status, &body, "VALIDATION_FAILED");
        assert_eq!(
            body["details"]["fields"][0]["field"], "accountId",
            "{bad:?}: {body}"
        );
    }
    assert!(w.submissions(p8).await.is_empty());
    assert_eq!(w.state(p8).await, "CLAIMED");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_stale_token_sent_to_another_replica_is_fenced() {
    let (mut w, stub) = RailWorld::with_stub("stub", &[]).await;
    let replica_a = w.proxy(&stub, &[]).await;
    let replica_b = w.proxy(&stub, &[]).await;
    w.account("acct-d", 10_000).await;
    let (_, status, body) = w.submit_claimed(&replica_a, "acct-d", 100, 20).await;
    assert_eq!(status, 200, "{body}");
    let second = w.claimed("acct-d", 100, 25).await;
    let stale = second;
    // An in-memory mark on replica B would have seen nothing and let token 15 through.
    let (status, body) = submit(&replica_b, "acct-d", stale, 100, "15").await;
    assert_eq!(status, 409);
    assert_envelope("other replica", status, &body, "FENCED_OUT");
    assert_eq!(body["details"]["highestToken"], 20);
    assert!(statement(&stub, stale).await.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_high_water_mark_rises_to_a_revocation_floor_only_for_the_operator() {
    let (w, _, proxy) = RailWorld::with_proxy("acct-e").await;
    let payout = w.claimed("acct-e", 100, 5).await;
    let floor = json!({"floor": 9, "operator": "ops", "reason": "revoked a stuck holder"});
    // Raises `account`'s (as the path spells it) high-water mark to the floor, as `auth` if any.
    let (proxy, floor) = (&proxy, &floor);
    let advance = move |account: &'static str, auth: Option<&'static str>| async move {
        let mut headers = vec![("x-owner-id", "ops")];
        headers.extend(auth.map(|a| ("authorization", a)));
        post_json(
            &format!("{proxy}/v1/rail/high-water/{account}"),
            &headers,
            floor,
        )
        .await
    };
    let (status, _, body) = advance("acct-e", None).await;
    assert_eq!(status, 401);
    assert_envelope("no credential", status, &body, "UNAUTHENTICATED");
    // A credential that authenticates nobody is 401; 403 is for a known non-operator.
    let (status, _, body) = advance("acct-e", Some("Bearer wrong")).await;
    assert_eq!(status, 401);
    assert_envelope("wrong credential", status, &body, "UNAUTHENTICATED");
    let (status, _, body) = advance("acct-e", Some("Bearer test-operator")).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["highestToken"], 9);
    // An account id outside the contract's rule is refused and creates no mark.
    let (status, _, body) = advance("acct%20e", Some("Bearer test-operator")).await;
    assert_envelope("bad account id", status, &body, "VALIDATION_FAILED");
    let marks: (i64,) =
        sqlx::query_as("SELECT count(*) FROM rail_high_water WHERE account_id = 'acct e'")
            .fetch_one(&w.pool)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(marks.0, 0);
    // The revoked holder's token is now fenced at the rail, before it ever submitted.
    let (status, body) = submit(proxy, "acct-e", payout, 100, "5").await;
    assert_eq!(status, 409);
    assert_envelope("after the floor", status, &body, "FENCED_OUT");
    assert_eq!(body["details"]["highestToken"], 9);
}
