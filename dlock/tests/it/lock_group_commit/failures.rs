//! Group commit of the lock server's acquires when lockdb fails a batch or moves to a new
//! timeline (docs/design.md#group-commit): an aborted batch answers each of its items 503
//! NOT_LEADER, retry-safe, and writes nothing; an item lockdb refuses fails the batch's statement,
//! and every item runs again alone, so it is answered as it would be alone and its neighbours are
//! granted; a batch on a new timeline takes every token above the gap (docs/design.md#d-12).

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_aborted_batch_answers_every_item_503_retry_safe_and_writes_nothing() {
    let server = Server::start().await;
    let (held, free) = (server.party("ga-held").await, server.party("ga-free").await);
    let gate_party = server.party("ga-gate").await;
    // ga:held's acquire lock is held from outside: the batch stops there, and dies there.
    let blocker = server.gate_acquire("ga:held").await;
    let ((gate, answers, batches), ()) = tokio::join!(
        server.acquires_gated(
            &gate_party,
            "ga:gate",
            vec![
                acquire(&free, "ga:free", Some(PATIENT_MS)),
                acquire(&held, "ga:held", Some(PATIENT_MS)),
            ],
        ),
        async {
            // Once the gate is open, the batch of the two waits for ga:held's lock (ga:free's it
            // took first, in key order): its backend is terminated there.
            let pid = server.waits_in("dlock_acquire_many").await;
            server.psql(&format!("SELECT pg_terminate_backend({pid})"));
        }
    );
    open(blocker).await;
    gate.unwrap_or_else(|e| panic!("the gate's acquire: {e}"));
    assert_eq!(batches, (2.0, 3.0), "the gate, then the batch of two");
    for (key, answer) in ["ga:free", "ga:held"].iter().zip(&answers) {
        let error = answer
            .as_ref()
            .err()
            .unwrap_or_else(|| panic!("{key}: {answer:?}"));
        assert_eq!(error.code(), Some(ErrorCode::NotLeader), "{key}: {error}");
        assert!(error.retry_safe(), "{key}: retry-safe");
        // Nothing of the batch was written: no grant, not even the key's first sighting.
        assert_eq!(server.rows_of(key), ("0".into(), "0".into()), "{key}");
    }
    // Positive control: the same acquires again are granted and written.
    for (p, key) in [(&free, "ga:free"), (&held, "ga:held")] {
        let grant = acquire(p, key, None)
            .await
            .unwrap_or_else(|e| panic!("{key} again: {e}"));
        held_by(p, key, grant.fencing_token).await;
        assert_eq!(server.rows_of(key), ("1".into(), "1".into()), "{key}");
    }
}

/// A trigger on lockdb's grants that raises for one key: lockdb refuses any statement that
/// grants it, as it would an item a future constraint or a bug makes it refuse.
const POISON: &str = "
    CREATE FUNCTION test_poisoned_key() RETURNS trigger LANGUAGE plpgsql AS $$
    BEGIN
        IF NEW.lock_key = 'gp:poisoned' THEN
            RAISE EXCEPTION 'gp:poisoned is refused by the test';
        END IF;
        RETURN NEW;
    END $$;
    CREATE TRIGGER test_poisoned_key BEFORE INSERT OR UPDATE ON locks
        FOR EACH ROW EXECUTE FUNCTION test_poisoned_key();
";

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_item_lockdb_refuses_fails_no_neighbour_and_is_answered_as_alone() {
    let server = Server::start().await;
    server.psql(POISON);
    let parties = server.parties("gp", 3).await;
    let gate_party = server.party("gp-gate").await;
    let keys = ["gp:first", "gp:poisoned", "gp:last"];
    let (gate, answers, batches) = server
        .acquires_gated(
            &gate_party,
            "gp:gate",
            parties
                .iter()
                .zip(keys)
                .map(|(p, key)| acquire(p, key, Some(PATIENT_MS)))
                .collect(),
        )
        .await;
    gate.unwrap_or_else(|e| panic!("the gate's acquire: {e}"));
    // The three went to lockdb in one statement, which lockdb refused whole.
    assert_eq!(batches, (2.0, 4.0), "the gate, then one batch of three");
    let refused = answers[1]
        .as_ref()
        .err()
        .unwrap_or_else(|| panic!("gp:poisoned was granted: {:?}", answers[1]));
    for i in [0, 2] {
        let grant = answers[i]
            .as_ref()
            .unwrap_or_else(|e| panic!("{}, beside the refused item: {e}", keys[i]));
        held_by(&parties[i], keys[i], grant.fencing_token).await;
        assert_eq!(
            server.rows_of(keys[i]),
            ("1".into(), "1".into()),
            "{}",
            keys[i]
        );
    }
    assert_eq!(
        server.rows_of("gp:poisoned"),
        ("0".into(), "0".into()),
        "the refused item wrote nothing"
    );
    // Positive controls: alone, the same acquire gets the same answer; without the trigger it is
    // granted, so nothing but the trigger refused it.
    let alone = acquire(&parties[1], "gp:poisoned", None).await;
    assert_eq!(
        code(&alone),
        refused.code(),
        "as alone: {alone:?}, in the batch: {refused}"
    );
    assert_eq!(
        alone.as_ref().err().map(ClientError::retry_safe),
        Some(refused.retry_safe()),
        "as alone: {alone:?}"
    );
    server.psql("DROP TRIGGER test_poisoned_key ON locks");
    let grant = acquire(&parties[1], "gp:poisoned", None)
        .await
        .unwrap_or_else(|e| panic!("gp:poisoned without the trigger: {e}"));
    held_by(&parties[1], "gp:poisoned", grant.fencing_token).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_batch_on_a_new_timeline_takes_every_token_above_the_gap() {
    let server = Server::start().await;
    let parties = server.parties("ge", 4).await;
    let (gate_party, waiter) = (
        server.party("ge-gate").await,
        server.party("ge-waiter").await,
    );
    let earlier = acquire(&parties[0], "ge:earlier", None)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    // The gate's acquire must grant nothing (a grant would be the first on the new timeline): the
    // head of ge:gate's queue is another session, so it is refused before any insert.
    server.psql(&format!(
        "INSERT INTO lock_waiters (waiter_id, lock_key, session_id, deadline) \
         VALUES (gen_random_uuid(), 'ge:gate', '{}', clock_timestamp() + interval '1 minute')",
        waiter.session
    ));
    // Tokens were last issued on another timeline, as after a promotion or a point-in-time
    // recovery (docs/design.md#d-12): the next grant, one of the batch's, must jump the gap.
    server.psql("UPDATE store_epoch SET timeline = timeline + 1");
    assert_eq!(server.psql("SELECT count(*) FROM store_epoch_changes"), "0");
    let gate_conn = server.gate_acquire("ge:gate").await;
    let (gate, answers, batches) =
        server
            .gated(
                "acquire",
                gate_conn,
                acquire_now(&server, &gate_party, "ge:gate"),
                parties
                    .iter()
                    .enumerate()
                    .map(|(i, p)| async move {
                        acquire(p, &format!("ge:key-{i}"), Some(PATIENT_MS)).await
                    })
                    .collect(),
            )
            .await;
    assert_eq!(gate.err(), Some(ErrorCode::LockContended), "the gate");
    assert_eq!(
        batches,
        (2.0, 5.0),
        "the gate alone, then one batch of four"
    );
    // The batch moved the sequence once, past the gap, and every grant of it is above.
    let change = server.psql("SELECT highest_known || ' ' || floor FROM store_epoch_changes");
    let (highest, floor) = change
        .split_once(' ')
        .map(|(h, f)| (h.parse::<i64>().unwrap_or(0), f.parse::<i64>().unwrap_or(0)))
        .unwrap_or_else(|| panic!("one epoch change, got {change:?}"));
    assert!(highest >= earlier.fencing_token, "{highest}");
    assert_eq!(floor, highest + 1_000_000_000, "the gap is 10^9");
    for (i, answer) in answers.iter().enumerate() {
        let grant = answer
            .as_ref()
            .unwrap_or_else(|e| panic!("ge:key-{i}: {e}"));
        assert!(
            grant.fencing_token > floor,
            "ge:key-{i}: {} is above the new epoch's floor {floor}",
            grant.fencing_token
        );
    }
}
