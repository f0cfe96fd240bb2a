-- paydb baseline, part 4 of 4 (after 0039): the idempotency records, the protected writes in one
-- call each and by the batch, and the rail proxy's writes.

-- =============================================================================================
-- Idempotency records, and the protected writes in one call each
-- =============================================================================================

-- The first step of every idempotent write, in the write's own transaction.
-- A concurrent duplicate blocks on the primary key until the first transaction ends, then sees
-- its committed record: the effect runs once and every duplicate replays its answer. The wait is
-- bounded by `lock_timeout` for this statement only, so a stuck first request cannot pile up
-- duplicates forever.
--
-- The conflicting record is read under a key-share lock, which the sweeper's delete respects:
-- read with a plain SELECT, a record the sweeper deleted (it had expired) between the insert and
-- the read was found missing, a "replay" with no stored answer, which the service answered 500.
-- A record that vanished in between is simply gone: the insert is tried again and the request
-- runs fresh, as it would have a moment later. The loop is bounded; a record that keeps changing
-- under the request is reported as in progress (lock_not_available), which the caller may retry.
-- outcome: fresh | replay | conflict
CREATE FUNCTION pay_idempotency_begin(p_route text, p_key text, p_token bigint, p_owner_id text,
                                      p_payload_hash bytea, p_retention_ms bigint,
                                      p_wait_ms integer)
RETURNS TABLE (outcome text, response_status smallint, response_body bytea)
LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan SET enable_seqscan = off SET jit = off AS $$
#variable_conflict use_column
DECLARE
    r idempotency_records%ROWTYPE;
    inserted integer;
    found_it boolean;
BEGIN
    FOR attempt IN 1..3 LOOP
        PERFORM set_config('lock_timeout', p_wait_ms::text, true);
        INSERT INTO idempotency_records (route, idempotency_key, fencing_token, owner_id,
                                         payload_hash, status, expires_at)
        VALUES (p_route, p_key, p_token, p_owner_id, p_payload_hash, 'in_progress',
                clock_timestamp() + p_retention_ms * interval '1 millisecond')
        ON CONFLICT DO NOTHING;
        GET DIAGNOSTICS inserted = ROW_COUNT;
        IF inserted = 1 THEN
            PERFORM set_config('lock_timeout', '0', true);
            RETURN QUERY SELECT 'fresh'::text, NULL::smallint, NULL::bytea;
            RETURN;
        END IF;
        SELECT * INTO r FROM idempotency_records x
         WHERE x.route = p_route AND x.idempotency_key = p_key AND x.fencing_token = p_token
           FOR KEY SHARE;
        found_it := FOUND;
        PERFORM set_config('lock_timeout', '0', true);
        IF found_it THEN
            IF r.payload_hash <> p_payload_hash THEN
                RETURN QUERY SELECT 'conflict'::text, NULL::smallint, NULL::bytea;
            ELSE
                RETURN QUERY SELECT 'replay'::text, r.response_status, r.response_body;
            END IF;
            RETURN;
        END IF;
        -- Swept between the insert and the read: try again.
    END LOOP;
    RAISE EXCEPTION 'the idempotency record of % % kept changing; retry', p_route, p_key
        USING ERRCODE = 'lock_not_available';
END $$;

-- Deletes expired records, a bounded batch at a time. Returns how many went. It skips records a
-- request is reading (key-share locked by pay_idempotency_begin) instead of waiting for it; they
-- go on the next tick.
CREATE FUNCTION pay_idempotency_sweep(p_batch integer) RETURNS bigint
LANGUAGE sql AS $$
    WITH gone AS (
        DELETE FROM idempotency_records
         WHERE ctid IN (SELECT ctid FROM idempotency_records
                         WHERE expires_at < clock_timestamp() LIMIT p_batch
                           FOR UPDATE SKIP LOCKED)
        RETURNING 1)
    SELECT count(*) FROM gone;
$$;

-- One call per protected write, so that the idempotency record and the effect cost one round
-- trip.
--
-- P2 in one call: the request's idempotency record (pay_idempotency_begin) and, when the
-- request is fresh, pay_claim_bounded, in the caller's transaction. begin_outcome is fresh,
-- replay or conflict; the effect's columns are set only when fresh.
CREATE FUNCTION pay_claim_once(p_route text, p_key text, p_token bigint,
                               p_owner_id text, p_payload_hash bytea,
                               p_retention_ms bigint, p_wait_ms integer,
                               p_payout_id uuid, p_expected_state text,
                               p_max_attempts integer, p_proven boolean DEFAULT false)
RETURNS TABLE (begin_outcome text, response_status smallint, response_body bytea,
               outcome text, state text, fence bigint, attempt_count integer,
               claim_token bigint, account_id text, available_minor bigint, amount_minor bigint)
LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan SET enable_seqscan = off SET jit = off AS $$
#variable_conflict use_column
DECLARE
    b record;
BEGIN
    SELECT * INTO b FROM pay_idempotency_begin(p_route, p_key, p_token, p_owner_id,
                                               p_payload_hash, p_retention_ms, p_wait_ms);
    IF b.outcome <> 'fresh' THEN
        RETURN QUERY SELECT b.outcome, b.response_status, b.response_body, NULL::text, NULL::text,
                            NULL::bigint, NULL::integer, NULL::bigint, NULL::text, NULL::bigint,
                            NULL::bigint;
        RETURN;
    END IF;
    RETURN QUERY SELECT 'fresh'::text, NULL::smallint, NULL::bytea, c.*
                   FROM pay_claim_bounded(p_payout_id, p_token, p_expected_state, p_max_attempts,
                                          p_owner_id, p_proven) c;
END $$;

-- P3 in one call: the idempotency record, pay_post and, when posted, the posting's two entries
-- (DEBIT first, as the answer lists them) as a JSON array.
CREATE FUNCTION pay_post_once(p_route text, p_key text, p_token bigint,
                              p_owner_id text, p_payload_hash bytea,
                              p_retention_ms bigint, p_wait_ms integer,
                              p_payout_id uuid, p_rail_reference text,
                              p_submission_id uuid, p_proven boolean DEFAULT false)
RETURNS TABLE (begin_outcome text, response_status smallint, response_body bytea,
               outcome text, state text, fence bigint, account_id text, balance_minor bigint,
               entries text)
LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan SET enable_seqscan = off SET jit = off AS $$
#variable_conflict use_column
DECLARE
    b record;
    r record;
BEGIN
    SELECT * INTO b FROM pay_idempotency_begin(p_route, p_key, p_token, p_owner_id,
                                               p_payload_hash, p_retention_ms, p_wait_ms);
    IF b.outcome <> 'fresh' THEN
        RETURN QUERY SELECT b.outcome, b.response_status, b.response_body, NULL::text, NULL::text,
                            NULL::bigint, NULL::text, NULL::bigint, NULL::text;
        RETURN;
    END IF;
    SELECT * INTO r FROM pay_post(p_payout_id, p_token, p_rail_reference, p_submission_id,
                                  p_proven);
    RETURN QUERY SELECT 'fresh'::text, NULL::smallint, NULL::bytea, r.outcome, r.state, r.fence,
                        r.account_id, r.balance_minor,
                        CASE WHEN r.outcome = 'posted' THEN
                            (SELECT jsonb_agg(jsonb_build_object(
                                        'entryId', e.entry_id, 'accountId', e.account_id,
                                        'direction', e.direction, 'amountMinor', e.amount_minor,
                                        'fence', e.fence) ORDER BY e.direction DESC)
                               FROM ledger_entries e
                              WHERE e.reference = 'payout:' || p_payout_id)::text
                        END;
END $$;

-- =============================================================================================
-- Claims and posts by the batch, for the payment resource's group commit
-- (docs/design.md#group-commit)
-- =============================================================================================

-- The payment resource runs the claims (and the posts) that queued while its previous
-- transaction ran as one transaction: one call of pay_claim_many (pay_post_many), one statement
-- that stores every answer (pay_idempotency_finish_many), one commit. Each item keeps its own
-- idempotency record, token, proof flag and outcome, and is decided exactly as the per-row
-- functions decide it; these stay for a lone request and for operator writes.
--
-- 1. Locks in key order for the whole set before any item runs: the payouts by id, then their
--    accounts by id, then (posts) the settlement shards the postings will update, by account and
--    shard. Two batches, or a batch and a single write (which locks payout -> account -> system
--    account), then wait for each other instead of deadlocking.
-- 2. The set path. The items that are simple to decide together go through pay_claim_set
--    (pay_post_set): one INSERT of every idempotency record, one read of the records that were
--    already there (replay or conflict), one read of the locked rows deciding each fresh item with
--    the per-row function's conditions, in its order (pay_claim: fence < token, else FENCED_OUT;
--    the expected state, else not claimable; available >= amount for a PENDING payout, else
--    FAILED; pay_post: fence <= token, RAIL_ACKED, the same rail reference and submission), then
--    one UPDATE of the accounts' fences and max_seen_token, one UPDATE of the payouts, (posts)
--    one INSERT of every posting's two entries, and one read of every answer.
-- 3. The per-row path for the rest: pay_claim_once (pay_post_once) in a subtransaction of its
--    own (a BEGIN ... EXCEPTION block), its answer exactly the single path's, for an item whose
--    decision depends on another item or is not reproduced by the set: its payout does not
--    exist; its account has another item in the batch (items of one account run highest token
--    first, so a stale holder and a newer one in the same batch leave the stale one FENCED_OUT
--    whichever arrived first, as they would if the newer one had committed before); a claim
--    would abandon it for exhausted attempts; its idempotency record vanished between the insert
--    and the read (swept). If anything in the set path raises (an account limit, a CHECK, the
--    bounded wait on a duplicate's record in another transaction), the set path is rolled back
--    as a whole (one subtransaction) and every one of its items goes the per-row way instead.
--    There an item that raises is rolled back alone, record included, and answered as `error`
--    with its SQLSTATE: the service runs it again on the single path after the batch commits, so
--    it never fails its neighbours. An item whose payout does not exist is rolled back the same
--    way (its idempotency record is not kept, as the single path keeps none for a 404) and
--    answered `not_found`.
--
-- Every money-moving write is still the per-row function's conditional write, checked by the
-- same constraints and triggers.

-- One item's answer, the columns of pay_claim_many (pay_post_many). begin_outcome `retry` (set
-- path only): its record vanished between the insert and the read; the item goes the per-row way.
CREATE TYPE pay_claim_answer AS (
    item integer, begin_outcome text, response_status smallint, response_body bytea,
    outcome text, state text, fence bigint, attempt_count integer, claim_token bigint,
    account_id text, available_minor bigint, amount_minor bigint, error_state text,
    error_message text);
CREATE TYPE pay_post_answer AS (
    item integer, begin_outcome text, response_status smallint, response_body bytea,
    outcome text, state text, fence bigint, account_id text, balance_minor bigint,
    entries text, error_state text, error_message text);

-- The idempotency records of items p_items (pay_idempotency_begin for each, in one INSERT and
-- one read): the fresh items, and the answers of the others (replay, conflict, or retry when
-- the record vanished in between).
CREATE FUNCTION pay_idempotency_begin_set(p_items integer[], p_routes text[],
                                          p_keys text[], p_tokens bigint[],
                                          p_owners text[], p_hashes bytea[],
                                          p_retention_ms bigint[], p_wait_ms integer)
RETURNS TABLE (item integer, outcome text, response_status smallint, response_body bytea)
LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan SET enable_seqscan = off SET jit = off AS $$
#variable_conflict use_column
DECLARE
    fresh integer[];
BEGIN
    PERFORM set_config('lock_timeout', p_wait_ms::text, true);
    WITH inserted AS (
        INSERT INTO idempotency_records (route, idempotency_key, fencing_token, owner_id,
                                         payload_hash, status, expires_at)
        SELECT p_routes[i], p_keys[i], p_tokens[i], p_owners[i], p_hashes[i], 'in_progress',
               clock_timestamp() + p_retention_ms[i] * interval '1 millisecond'
          FROM unnest(p_items) AS i
         ORDER BY 1, 2, 3
        ON CONFLICT DO NOTHING
        RETURNING route, idempotency_key, fencing_token)
    SELECT coalesce(array_agg(i), '{}') INTO fresh
      FROM unnest(p_items) AS i
      JOIN inserted r ON r.route = p_routes[i] AND r.idempotency_key = p_keys[i]
                     AND r.fencing_token = p_tokens[i];
    RETURN QUERY SELECT i, 'fresh'::text, NULL::smallint, NULL::bytea FROM unnest(fresh) AS i;
    RETURN QUERY
        SELECT i, CASE WHEN x.payload_hash <> p_hashes[i] THEN 'conflict' ELSE 'replay' END,
               CASE WHEN x.payload_hash <> p_hashes[i] THEN NULL ELSE x.response_status END,
               CASE WHEN x.payload_hash <> p_hashes[i] THEN NULL ELSE x.response_body END
          FROM unnest(p_items) AS i
          JOIN idempotency_records x ON x.route = p_routes[i] AND x.idempotency_key = p_keys[i]
                                    AND x.fencing_token = p_tokens[i]
         WHERE i <> ALL (fresh)
           FOR KEY SHARE OF x;
    RETURN QUERY
        SELECT i, 'retry'::text, NULL::smallint, NULL::bytea
          FROM unnest(p_items) AS i
         WHERE i <> ALL (fresh)
           AND NOT EXISTS (SELECT 1 FROM idempotency_records x
                            WHERE x.route = p_routes[i] AND x.idempotency_key = p_keys[i]
                              AND x.fencing_token = p_tokens[i]);
    PERFORM set_config('lock_timeout', '0', true);
END $$;

-- The claims p_items of a batch by the set. Each item's payout exists and is locked, no other
-- item of the batch is on its account, and it is not out of attempts (pay_claim_many chose
-- them). The decisions are pay_claim's.
CREATE FUNCTION pay_claim_set(p_items integer[], p_routes text[], p_keys text[],
                              p_tokens bigint[], p_owners text[], p_hashes bytea[],
                              p_retention_ms bigint[], p_wait_ms integer,
                              p_payouts uuid[], p_expected text[],
                              p_max_attempts integer, p_proven boolean)
RETURNS SETOF pay_claim_answer
LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan SET enable_seqscan = off SET jit = off AS $$
#variable_conflict use_column
DECLARE
    begun record;
    fresh integer[] := '{}';
    d_items integer[];
    d_outcomes text[];
    d_available bigint[];
BEGIN
    FOR begun IN SELECT * FROM pay_idempotency_begin_set(p_items, p_routes, p_keys, p_tokens,
                                                         p_owners, p_hashes, p_retention_ms,
                                                         p_wait_ms) LOOP
        IF begun.outcome = 'fresh' THEN
            fresh := fresh || begun.item;
        ELSE
            RETURN NEXT ROW(begun.item, begun.outcome, begun.response_status,
                            begun.response_body, NULL, NULL, NULL, NULL, NULL, NULL, NULL,
                            NULL, NULL, NULL)::pay_claim_answer;
        END IF;
    END LOOP;
    IF cardinality(fresh) = 0 THEN
        RETURN;
    END IF;
    -- pay_claim's decision for each fresh item, on the rows as locked.
    SELECT array_agg(d.i), array_agg(d.outcome), array_agg(d.available)
      INTO d_items, d_outcomes, d_available
      FROM (SELECT i, a.balance_minor - a.held_minor AS available,
                   CASE WHEN a.fence >= p_tokens[i] THEN 'fenced_out'
                        WHEN x.state <> p_expected[i]
                             OR p_expected[i] NOT IN ('PENDING', 'CLAIMED') THEN 'not_claimable'
                        WHEN x.state = 'PENDING'
                             AND a.balance_minor - a.held_minor < x.amount_minor
                             THEN 'insufficient_funds'
                        ELSE 'claimed'
                   END AS outcome
              FROM unnest(fresh) AS i
              JOIN payouts x ON x.payout_id = p_payouts[i]
              JOIN accounts a ON a.account_id = x.account_id) d;
    -- The fence advances for every admitted claim, whatever it decides.
    UPDATE accounts a
       SET fence = p_tokens[d.i],
           max_seen_token = CASE WHEN p_proven THEN p_tokens[d.i] ELSE a.max_seen_token END,
           updated_at = clock_timestamp()
      FROM unnest(d_items, d_outcomes) AS d(i, outcome)
      JOIN payouts x ON x.payout_id = p_payouts[d.i]
     WHERE d.outcome IN ('claimed', 'insufficient_funds')
       AND a.account_id = x.account_id AND a.fence < p_tokens[d.i];
    -- A re-claim (CLAIMED -> CLAIMED) already holds its amount; the holds trigger takes none.
    UPDATE payouts x
       SET state = CASE WHEN d.outcome = 'claimed' THEN 'CLAIMED' ELSE 'FAILED' END,
           attempt_count = CASE WHEN d.outcome = 'claimed' THEN x.attempt_count + 1
                                ELSE x.attempt_count END,
           claim_token = CASE WHEN d.outcome = 'claimed' THEN p_tokens[d.i]
                              ELSE x.claim_token END,
           updated_at = clock_timestamp()
      FROM unnest(d_items, d_outcomes) AS d(i, outcome)
     WHERE d.outcome IN ('claimed', 'insufficient_funds')
       AND x.payout_id = p_payouts[d.i] AND x.state = p_expected[d.i];
    -- The answers, from the rows as they are now (pay_claim's columns for each outcome).
    RETURN QUERY
        SELECT d.i, 'fresh'::text, NULL::smallint, NULL::bytea, d.outcome, x.state, a.fence,
               x.attempt_count, x.claim_token, x.account_id,
               CASE WHEN d.outcome IN ('claimed', 'insufficient_funds') THEN d.available END,
               x.amount_minor, NULL::text, NULL::text
          FROM unnest(d_items, d_outcomes, d_available) AS d(i, outcome, available)
          JOIN payouts x ON x.payout_id = p_payouts[d.i]
          JOIN accounts a ON a.account_id = x.account_id;
END $$;

-- The posts p_items of a batch by the set (chosen as for pay_claim_set). The decisions are
-- pay_post's.
CREATE FUNCTION pay_post_set(p_items integer[], p_routes text[], p_keys text[],
                             p_tokens bigint[], p_owners text[], p_hashes bytea[],
                             p_retention_ms bigint[], p_wait_ms integer,
                             p_payouts uuid[], p_rail_references text[],
                             p_submissions uuid[], p_proven boolean)
RETURNS SETOF pay_post_answer
LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan SET enable_seqscan = off SET jit = off AS $$
#variable_conflict use_column
DECLARE
    begun record;
    fresh integer[] := '{}';
    d_items integer[];
    d_outcomes text[];
    posted integer[];
BEGIN
    FOR begun IN SELECT * FROM pay_idempotency_begin_set(p_items, p_routes, p_keys, p_tokens,
                                                         p_owners, p_hashes, p_retention_ms,
                                                         p_wait_ms) LOOP
        IF begun.outcome = 'fresh' THEN
            fresh := fresh || begun.item;
        ELSE
            RETURN NEXT ROW(begun.item, begun.outcome, begun.response_status,
                            begun.response_body, NULL, NULL, NULL, NULL, NULL, NULL, NULL,
                            NULL)::pay_post_answer;
        END IF;
    END LOOP;
    IF cardinality(fresh) = 0 THEN
        RETURN;
    END IF;
    -- pay_post's decision for each fresh item: the claimer or a later holder may post
    -- (fence <= token, docs/design.md#d-1).
    SELECT array_agg(d.i), array_agg(d.outcome),
           coalesce(array_agg(d.i) FILTER (WHERE d.outcome = 'posted'), '{}')
      INTO d_items, d_outcomes, posted
      FROM (SELECT i,
                   CASE WHEN a.fence > p_tokens[i] THEN 'fenced_out'
                        WHEN x.state <> 'RAIL_ACKED' THEN 'not_claimable'
                        WHEN (x.rail_reference IS NOT NULL
                              AND x.rail_reference <> p_rail_references[i])
                             OR (x.submission_id IS NOT NULL
                                 AND x.submission_id <> p_submissions[i])
                             THEN 'reference_mismatch'
                        ELSE 'posted'
                   END AS outcome
              FROM unnest(fresh) AS i
              JOIN payouts x ON x.payout_id = p_payouts[i]
              JOIN accounts a ON a.account_id = x.account_id) d;
    IF cardinality(posted) > 0 THEN
        UPDATE accounts a
           SET fence = greatest(a.fence, p_tokens[i]),
               max_seen_token = CASE WHEN p_proven THEN greatest(a.max_seen_token, p_tokens[i])
                                     ELSE a.max_seen_token END,
               updated_at = clock_timestamp()
          FROM unnest(posted) AS i
          JOIN payouts x ON x.payout_id = p_payouts[i]
         WHERE a.account_id = x.account_id
           AND (a.fence < p_tokens[i] OR (p_proven AND a.max_seen_token < p_tokens[i]));
        -- The holds are released (trigger, at the end of this statement) before the debits land,
        -- so available never dips below 0.
        UPDATE payouts x
           SET state = 'POSTED', rail_reference = p_rail_references[i],
               submission_id = p_submissions[i], updated_at = clock_timestamp()
          FROM unnest(posted) AS i
         WHERE x.payout_id = p_payouts[i] AND x.state = 'RAIL_ACKED';
        -- pay_write_payout_posting for each: DEBIT the customer, CREDIT the settlement account.
        INSERT INTO ledger_entries (entry_id, account_id, currency, direction, amount_minor,
                                    fence, kind, reference, payout_id)
        SELECT gen_random_uuid(),
               CASE WHEN e.direction = 'DEBIT' THEN x.account_id
                    ELSE 'rail-settlement-' || x.currency END,
               x.currency, e.direction, x.amount_minor, p_tokens[i], 'payout',
               'payout:' || x.payout_id, x.payout_id
          FROM unnest(posted) AS i
          JOIN payouts x ON x.payout_id = p_payouts[i]
         CROSS JOIN (VALUES (1, 'DEBIT'), (2, 'CREDIT')) AS e(n, direction)
         ORDER BY i, e.n;
    END IF;
    RETURN QUERY
        SELECT d.i, 'fresh'::text, NULL::smallint, NULL::bytea, d.outcome, x.state, a.fence,
               x.account_id, a.balance_minor,
               CASE WHEN d.outcome = 'posted' THEN
                   (SELECT jsonb_agg(jsonb_build_object(
                               'entryId', e.entry_id, 'accountId', e.account_id,
                               'direction', e.direction, 'amountMinor', e.amount_minor,
                               'fence', e.fence) ORDER BY e.direction DESC)
                      FROM ledger_entries e
                     WHERE e.reference = 'payout:' || x.payout_id)::text
               END,
               NULL::text, NULL::text
          FROM unnest(d_items, d_outcomes) AS d(i, outcome)
          JOIN payouts x ON x.payout_id = p_payouts[d.i]
          JOIN accounts a ON a.account_id = x.account_id;
END $$;

-- outcome per item: as pay_claim_once's columns, with begin_outcome one of fresh | replay |
-- conflict | not_found | error; error_state and error_message for `error`.
CREATE FUNCTION pay_claim_many(p_routes text[], p_keys text[], p_tokens bigint[],
                               p_owners text[], p_hashes bytea[],
                               p_retention_ms bigint[], p_wait_ms integer,
                               p_payouts uuid[], p_expected text[],
                               p_max_attempts integer, p_proven boolean)
RETURNS TABLE (item integer, begin_outcome text, response_status smallint, response_body bytea,
               outcome text, state text, fence bigint, attempt_count integer,
               claim_token bigint, account_id text, available_minor bigint, amount_minor bigint,
               error_state text, error_message text)
LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan SET enable_seqscan = off SET jit = off AS $$
#variable_conflict use_column
DECLARE
    i integer;
    r record;
    by_set integer[];
    one_by_one integer[];
    answers pay_claim_answer[];
BEGIN
    IF cardinality(p_payouts) IS DISTINCT FROM cardinality(p_routes)
       OR cardinality(p_payouts) IS DISTINCT FROM cardinality(p_tokens) THEN
        RAISE EXCEPTION 'pay_claim_many: the item arrays differ in length'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    PERFORM 1 FROM payouts x WHERE x.payout_id = ANY (p_payouts)
     ORDER BY x.payout_id FOR UPDATE OF x;
    PERFORM 1 FROM accounts a
     WHERE a.account_id IN (SELECT x.account_id FROM payouts x WHERE x.payout_id = ANY (p_payouts))
     ORDER BY a.account_id FOR UPDATE OF a;
    -- By the set: the payout exists, its account has no other item here, and a claim would not
    -- abandon it (out of attempts). The rest one by one.
    SELECT coalesce(array_agg(c.n::integer) FILTER (WHERE c.simple), '{}'),
           coalesce(array_agg(c.n::integer) FILTER (WHERE NOT c.simple), '{}')
      INTO by_set, one_by_one
      FROM (SELECT t.n,
                   coalesce(x.payout_id IS NOT NULL
                            AND count(*) OVER (PARTITION BY x.account_id) = 1
                            AND NOT (x.state = p_expected[t.n]
                                     AND x.attempt_count >= p_max_attempts), false) AS simple
              FROM unnest(p_payouts) WITH ORDINALITY AS t(payout_id, n)
              LEFT JOIN payouts x ON x.payout_id = t.payout_id) c;
    IF cardinality(by_set) > 0 THEN
        BEGIN
            SELECT array_agg(a) INTO answers
              FROM pay_claim_set(by_set, p_routes, p_keys, p_tokens, p_owners, p_hashes,
                                 p_retention_ms, p_wait_ms, p_payouts, p_expected,
                                 p_max_attempts, p_proven) a;
        EXCEPTION WHEN OTHERS THEN
            -- Rolled back as a whole: every item of the set goes one by one.
            answers := NULL;
            one_by_one := one_by_one || by_set;
        END;
    END IF;
    RETURN QUERY SELECT * FROM unnest(answers) a WHERE a.begin_outcome <> 'retry';
    one_by_one := one_by_one
        || coalesce((SELECT array_agg(a.item) FROM unnest(answers) a
                      WHERE a.begin_outcome = 'retry'), '{}');
    FOR i IN
        SELECT t.n FROM unnest(p_payouts, p_tokens) WITH ORDINALITY AS t(payout_id, token, n)
          LEFT JOIN payouts x ON x.payout_id = t.payout_id
         WHERE t.n = ANY (one_by_one)
         ORDER BY x.account_id NULLS LAST, t.token DESC, t.n
    LOOP
        BEGIN
            SELECT * INTO r FROM pay_claim_once(p_routes[i], p_keys[i], p_tokens[i], p_owners[i],
                                                p_hashes[i], p_retention_ms[i], p_wait_ms,
                                                p_payouts[i], p_expected[i], p_max_attempts,
                                                p_proven);
            IF r.begin_outcome = 'fresh' AND r.outcome = 'not_found' THEN
                RAISE EXCEPTION 'payout % not found', p_payouts[i] USING ERRCODE = 'DL404';
            END IF;
            RETURN QUERY SELECT i, r.begin_outcome, r.response_status, r.response_body,
                                r.outcome, r.state, r.fence, r.attempt_count, r.claim_token,
                                r.account_id, r.available_minor, r.amount_minor, NULL::text,
                                NULL::text;
        EXCEPTION
            WHEN SQLSTATE 'DL404' THEN
                RETURN QUERY SELECT i, 'not_found'::text, NULL::smallint, NULL::bytea,
                                    'not_found'::text, NULL::text, NULL::bigint, NULL::integer,
                                    NULL::bigint, NULL::text, NULL::bigint, NULL::bigint,
                                    NULL::text, NULL::text;
            WHEN OTHERS THEN
                RETURN QUERY SELECT i, 'error'::text, NULL::smallint, NULL::bytea, NULL::text,
                                    NULL::text, NULL::bigint, NULL::integer, NULL::bigint,
                                    NULL::text, NULL::bigint, NULL::bigint, SQLSTATE::text,
                                    SQLERRM::text;
        END;
    END LOOP;
END $$;

-- As pay_claim_many, for posts (pay_post_once's columns and its entries JSON).
CREATE FUNCTION pay_post_many(p_routes text[], p_keys text[], p_tokens bigint[],
                              p_owners text[], p_hashes bytea[],
                              p_retention_ms bigint[], p_wait_ms integer,
                              p_payouts uuid[], p_rail_references text[],
                              p_submissions uuid[], p_proven boolean)
RETURNS TABLE (item integer, begin_outcome text, response_status smallint, response_body bytea,
               outcome text, state text, fence bigint, account_id text, balance_minor bigint,
               entries text, error_state text, error_message text)
LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan SET enable_seqscan = off SET jit = off AS $$
#variable_conflict use_column
DECLARE
    i integer;
    r record;
    by_set integer[];
    one_by_one integer[];
    answers pay_post_answer[];
BEGIN
    IF cardinality(p_payouts) IS DISTINCT FROM cardinality(p_routes)
       OR cardinality(p_payouts) IS DISTINCT FROM cardinality(p_tokens) THEN
        RAISE EXCEPTION 'pay_post_many: the item arrays differ in length'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    PERFORM 1 FROM payouts x WHERE x.payout_id = ANY (p_payouts)
     ORDER BY x.payout_id FOR UPDATE OF x;
    PERFORM 1 FROM accounts a
     WHERE a.account_id IN (SELECT x.account_id FROM payouts x WHERE x.payout_id = ANY (p_payouts))
     ORDER BY a.account_id FOR UPDATE OF a;
    -- The settlement shards the postings will update, when they exist; a shard's first posting
    -- inserts it.
    PERFORM 1 FROM account_balance_shards s
     WHERE (s.account_id, s.shard) IN (
            SELECT 'rail-settlement-' || x.currency, pay_balance_shard(x.payout_id, NULL)
              FROM payouts x WHERE x.payout_id = ANY (p_payouts))
     ORDER BY s.account_id, s.shard FOR UPDATE OF s;
    SELECT coalesce(array_agg(c.n::integer) FILTER (WHERE c.simple), '{}'),
           coalesce(array_agg(c.n::integer) FILTER (WHERE NOT c.simple), '{}')
      INTO by_set, one_by_one
      FROM (SELECT t.n,
                   x.payout_id IS NOT NULL AND count(*) OVER (PARTITION BY x.account_id) = 1
                       AS simple
              FROM unnest(p_payouts) WITH ORDINALITY AS t(payout_id, n)
              LEFT JOIN payouts x ON x.payout_id = t.payout_id) c;
    IF cardinality(by_set) > 0 THEN
        BEGIN
            SELECT array_agg(a) INTO answers
              FROM pay_post_set(by_set, p_routes, p_keys, p_tokens, p_owners, p_hashes,
                                p_retention_ms, p_wait_ms, p_payouts, p_rail_references,
                                p_submissions, p_proven) a;
        EXCEPTION WHEN OTHERS THEN
            answers := NULL;
            one_by_one := one_by_one || by_set;
        END;
    END IF;
    RETURN QUERY SELECT * FROM unnest(answers) a WHERE a.begin_outcome <> 'retry';
    one_by_one := one_by_one
        || coalesce((SELECT array_agg(a.item) FROM unnest(answers) a
                      WHERE a.begin_outcome = 'retry'), '{}');
    FOR i IN
        SELECT t.n FROM unnest(p_payouts, p_tokens) WITH ORDINALITY AS t(payout_id, token, n)
          LEFT JOIN payouts x ON x.payout_id = t.payout_id
         WHERE t.n = ANY (one_by_one)
         ORDER BY x.account_id NULLS LAST, t.token DESC, t.n
    LOOP
        BEGIN
            SELECT * INTO r FROM pay_post_once(p_routes[i], p_keys[i], p_tokens[i], p_owners[i],
                                               p_hashes[i], p_retention_ms[i], p_wait_ms,
                                               p_payouts[i], p_rail_references[i],
                                               p_submissions[i], p_proven);
            IF r.begin_outcome = 'fresh' AND r.outcome = 'not_found' THEN
                RAISE EXCEPTION 'payout % not found', p_payouts[i] USING ERRCODE = 'DL404';
            END IF;
            RETURN QUERY SELECT i, r.begin_outcome, r.response_status, r.response_body,
                                r.outcome, r.state, r.fence, r.account_id, r.balance_minor,
                                r.entries, NULL::text, NULL::text;
        EXCEPTION
            WHEN SQLSTATE 'DL404' THEN
                RETURN QUERY SELECT i, 'not_found'::text, NULL::smallint, NULL::bytea,
                                    'not_found'::text, NULL::text, NULL::bigint, NULL::text,
                                    NULL::bigint, NULL::text, NULL::text, NULL::text;
            WHEN OTHERS THEN
                RETURN QUERY SELECT i, 'error'::text, NULL::smallint, NULL::bytea, NULL::text,
                                    NULL::text, NULL::bigint, NULL::text, NULL::bigint,
                                    NULL::text, SQLSTATE::text, SQLERRM::text;
        END;
    END LOOP;
END $$;

-- The answers of a batch's fresh items, stored in one statement (as the single path's
-- PayStore::finish does for one): only records still in progress, in this transaction.
CREATE FUNCTION pay_idempotency_finish_many(p_routes text[], p_keys text[],
                                            p_tokens bigint[], p_statuses smallint[],
                                            p_bodies bytea[])
RETURNS integer LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan SET enable_seqscan = off SET jit = off AS $$
DECLARE
    updated integer;
BEGIN
    UPDATE idempotency_records r
       SET status = CASE WHEN u.status < 300 THEN 'succeeded' ELSE 'failed' END,
           response_status = u.status, response_body = u.body
      FROM unnest(p_routes, p_keys, p_tokens, p_statuses, p_bodies)
           AS u(route, idempotency_key, fencing_token, status, body)
     WHERE r.route = u.route AND r.idempotency_key = u.idempotency_key
       AND r.fencing_token = u.fencing_token AND r.status = 'in_progress';
    GET DIAGNOSTICS updated = ROW_COUNT;
    RETURN updated;
END $$;

-- =============================================================================================
-- Registrations by the batch, for the payment resource's group commit
-- (docs/design.md#group-commit)
-- =============================================================================================

-- A run registers its batch's payouts 32 at a time, each `POST /v1/payouts` in a transaction of
-- its own: five round trips and a commit per payout. In a new user's `dlock run -f` of 1 500
-- payouts the registrations took the first 1.4 s of a 4.6 s run, and the payouts paid while
-- they ran went at a quarter of the rate that followed. pay_create_many takes the registrations
-- that queued while the previous one's transaction ran, in one call and one transaction, and
-- makes the same decisions for the whole batch in a few statements: the idempotency records
-- (pay_idempotency_begin_set, as the claims and posts do), one INSERT of the new payouts, one
-- read of the answers. Done one by one (a savepoint, pay_idempotency_begin, pay_create_payout
-- and an INSERT of one row per payout), these were the largest share of paydb's time after the
-- rail's and the posts' set functions (pay_create_payout 350 ms and pay_idempotency_begin 277 ms
-- of function time for 1 500 payouts, measured with track_functions). The decisions are
-- pay_create_payout's, in its order:
--
--   * a payout that exists is `exists` when the item asks for the same payout (account, amount,
--     currency, beneficiary), else `conflict`, whatever account the item names;
--   * else an account that does not exist or is not a customer account is `account_unknown`:
--     the item keeps nothing, its idempotency record included (the single path rolls it back and
--     answers 404); here the record written in this transaction is deleted, and the item is
--     answered `not_found`;
--   * else an account of another currency is `currency_mismatch`;
--   * else the payout is inserted: `created` (or, when a concurrent registration of the same
--     payout committed first, `exists` or `conflict` as above).
--
-- The insert fires the same row triggers and constraints as the single path's. One that raises
-- (an account's largest single payout) rolls the set back as a whole, and every item then runs
-- one by one in a subtransaction of its own (pay_create_one_by_one): the item over its limit
-- fails alone. Two items of one payout or of one idempotency key, and an item whose record
-- vanished between its insert and its read, also go one by one (the second sees the first's
-- effect, as it would a moment later).
--
-- Lock order: pay_create_many key-share locks the batch's accounts in key order before anything
-- else. A payout's insert key-share locks its account (the foreign key) and a claim locks
-- accounts for update in key order, so a batch whose set part and one-by-one part touch
-- different accounts cannot wait on a claim in a cycle.
--
-- outcome per item: begin_outcome is fresh | replay | conflict | not_found | error; for fresh,
-- outcome is pay_create_payout's (created | exists | conflict | currency_mismatch); not_found is
-- an unknown account, rolled back alone like a raise, as the single path keeps nothing of it;
-- for error, error_state and error_message.

-- One item's answer, the columns of pay_create_many.
CREATE TYPE pay_create_answer AS (
    item integer, begin_outcome text, response_status smallint, response_body bytea,
    outcome text, error_state text, error_message text);

-- The items that do not go by the set, each decided by the single path's functions in a
-- subtransaction of its own: its idempotency record (pay_idempotency_begin) and, when fresh, the
-- payout (pay_create_payout, whose insert fires the same row triggers and checks: the account's
-- largest single payout among them). An item that raises (a limit, a duplicate still in flight
-- past the wait) is rolled back alone and answered `error`, and the service runs it again on the
-- single path, which answers it as it always has. The items run in account order, then payout
-- order: a payout's insert key-share locks its account (the foreign key), and a claim locks
-- accounts for update in account order (pay_claim_many, pay_claim_once one account at a time),
-- so two batches that touch the same accounts never wait on each other in a cycle.
CREATE FUNCTION pay_create_one_by_one(p_routes text[], p_keys text[], p_tokens bigint[],
                                      p_owners text[], p_hashes bytea[],
                                      p_retention_ms bigint[], p_wait_ms integer,
                                      p_payouts uuid[], p_accounts text[],
                                      p_amounts bigint[], p_currencies text[],
                                      p_beneficiaries text[])
RETURNS TABLE (item integer, begin_outcome text, response_status smallint, response_body bytea,
               outcome text, error_state text, error_message text)
LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan SET enable_seqscan = off SET jit = off AS $$
#variable_conflict use_column
DECLARE
    i integer;
    b record;
    created text;
BEGIN
    IF cardinality(p_payouts) IS DISTINCT FROM cardinality(p_routes)
       OR cardinality(p_payouts) IS DISTINCT FROM cardinality(p_keys)
       OR cardinality(p_payouts) IS DISTINCT FROM cardinality(p_tokens)
       OR cardinality(p_payouts) IS DISTINCT FROM cardinality(p_owners)
       OR cardinality(p_payouts) IS DISTINCT FROM cardinality(p_hashes)
       OR cardinality(p_payouts) IS DISTINCT FROM cardinality(p_retention_ms)
       OR cardinality(p_payouts) IS DISTINCT FROM cardinality(p_accounts)
       OR cardinality(p_payouts) IS DISTINCT FROM cardinality(p_amounts)
       OR cardinality(p_payouts) IS DISTINCT FROM cardinality(p_currencies)
       OR cardinality(p_payouts) IS DISTINCT FROM cardinality(p_beneficiaries) THEN
        RAISE EXCEPTION 'pay_create_many: the item arrays differ in length'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    FOR i IN
        SELECT t.n FROM unnest(p_accounts, p_payouts) WITH ORDINALITY AS t(account_id, payout_id, n)
         ORDER BY t.account_id, t.payout_id, t.n
    LOOP
        -- Each item's answer is the block's last statement: a raise before it returns nothing
        -- for the item but its error row.
        BEGIN
            SELECT * INTO b FROM pay_idempotency_begin(p_routes[i], p_keys[i], p_tokens[i],
                                                        p_owners[i], p_hashes[i],
                                                        p_retention_ms[i], p_wait_ms);
            created := NULL;
            IF b.outcome = 'fresh' THEN
                SELECT c.outcome INTO created
                  FROM pay_create_payout(p_payouts[i], p_accounts[i], p_amounts[i],
                                         p_currencies[i]::char(3), p_beneficiaries[i]) c;
                -- An unknown account keeps nothing, record included (the single path answers
                -- 404 and rolls back): rolled back alone here.
                IF created = 'account_unknown' THEN
                    RAISE EXCEPTION 'account % not found', p_accounts[i] USING ERRCODE = 'DL404';
                END IF;
            END IF;
            RETURN QUERY SELECT i, b.outcome, b.response_status, b.response_body, created,
                                NULL::text, NULL::text;
        EXCEPTION
            WHEN SQLSTATE 'DL404' THEN
                RETURN QUERY SELECT i, 'not_found'::text, NULL::smallint, NULL::bytea, NULL::text,
                                    NULL::text, NULL::text;
            WHEN OTHERS THEN
                RETURN QUERY SELECT i, 'error'::text, NULL::smallint, NULL::bytea, NULL::text,
                                SQLSTATE::text, SQLERRM::text;
        END;
    END LOOP;
END $$;

CREATE FUNCTION pay_create_many(p_routes text[], p_keys text[], p_tokens bigint[],
                                p_owners text[], p_hashes bytea[],
                                p_retention_ms bigint[], p_wait_ms integer,
                                p_payouts uuid[], p_accounts text[],
                                p_amounts bigint[], p_currencies text[],
                                p_beneficiaries text[])
RETURNS TABLE (item integer, begin_outcome text, response_status smallint, response_body bytea,
               outcome text, error_state text, error_message text)
LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan SET enable_seqscan = off SET jit = off AS $$
#variable_conflict use_column
DECLARE
    items integer[];
    begun record;
    fresh integer[] := '{}';
    created uuid[];
    strangers integer[];
    answers pay_create_answer[] := '{}';
    one_by_one integer[];
BEGIN
    IF (SELECT count(DISTINCT c) FROM unnest(ARRAY[
            cardinality(p_routes), cardinality(p_keys), cardinality(p_tokens),
            cardinality(p_owners), cardinality(p_hashes), cardinality(p_retention_ms),
            cardinality(p_payouts), cardinality(p_accounts), cardinality(p_amounts),
            cardinality(p_currencies), cardinality(p_beneficiaries)]) AS c) > 1 THEN
        RAISE EXCEPTION 'pay_create_many: the item arrays differ in length'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    PERFORM 1 FROM accounts a WHERE a.account_id = ANY (p_accounts)
     ORDER BY a.account_id FOR KEY SHARE OF a;
    -- By the set: the only item of its payout and of its idempotency key.
    SELECT coalesce(array_agg(c.n) FILTER (WHERE c.alone), '{}') INTO items
      FROM (SELECT t.n::integer AS n,
                   count(*) OVER (PARTITION BY t.payout_id) = 1
                   AND count(*) OVER (PARTITION BY p_routes[t.n], p_keys[t.n], p_tokens[t.n]) = 1
                       AS alone
              FROM unnest(p_payouts) WITH ORDINALITY AS t(payout_id, n)) c;
    BEGIN
        FOR begun IN SELECT * FROM pay_idempotency_begin_set(items, p_routes, p_keys, p_tokens,
                                                             p_owners, p_hashes, p_retention_ms,
                                                             p_wait_ms) LOOP
            IF begun.outcome = 'fresh' THEN
                fresh := fresh || begun.item;
            ELSIF begun.outcome <> 'retry' THEN
                answers := answers || ROW(begun.item, begun.outcome, begun.response_status,
                                          begun.response_body, NULL, NULL, NULL)::pay_create_answer;
            END IF;
        END LOOP;
        -- The new payouts, in account order, then payout order.
        WITH inserted AS (
            INSERT INTO payouts (payout_id, account_id, currency, amount_minor, beneficiary_ref)
            SELECT p_payouts[i], p_accounts[i], p_currencies[i]::char(3), p_amounts[i],
                   p_beneficiaries[i]
              FROM unnest(fresh) AS i
              JOIN accounts a ON a.account_id = p_accounts[i]
             WHERE a.kind = 'customer' AND a.currency = p_currencies[i]::char(3)
               AND NOT EXISTS (SELECT 1 FROM payouts x WHERE x.payout_id = p_payouts[i])
             ORDER BY p_accounts[i], p_payouts[i]
            ON CONFLICT (payout_id) DO NOTHING
            RETURNING payout_id)
        SELECT coalesce(array_agg(payout_id), '{}') INTO created FROM inserted;
        -- An unknown account's item keeps nothing: its record goes.
        SELECT coalesce(array_agg(i), '{}') INTO strangers
          FROM unnest(fresh) AS i
         WHERE NOT EXISTS (SELECT 1 FROM payouts x WHERE x.payout_id = p_payouts[i])
           AND NOT EXISTS (SELECT 1 FROM accounts a
                            WHERE a.account_id = p_accounts[i] AND a.kind = 'customer');
        DELETE FROM idempotency_records x
         USING unnest(strangers) AS i
         WHERE x.route = p_routes[i] AND x.idempotency_key = p_keys[i]
           AND x.fencing_token = p_tokens[i];
        answers := answers || ARRAY(
            SELECT ROW(i, CASE WHEN i = ANY (strangers) THEN 'not_found' ELSE 'fresh' END,
                       NULL, NULL,
                       CASE WHEN i = ANY (strangers) THEN NULL
                            WHEN p_payouts[i] = ANY (created) THEN 'created'
                            WHEN x.payout_id IS NULL THEN 'currency_mismatch'
                            WHEN x.account_id = p_accounts[i] AND x.amount_minor = p_amounts[i]
                                 AND x.currency = p_currencies[i]::char(3)
                                 AND x.beneficiary_ref = p_beneficiaries[i] THEN 'exists'
                            ELSE 'conflict'
                       END, NULL, NULL)::pay_create_answer
              FROM unnest(fresh) AS i
              LEFT JOIN payouts x ON x.payout_id = p_payouts[i]);
    EXCEPTION WHEN OTHERS THEN
        -- Rolled back as a whole: every item goes one by one.
        answers := '{}';
    END;
    RETURN QUERY SELECT * FROM unnest(answers);
    -- The rest (not alone, a record that vanished in between, a set that raised) one by one.
    SELECT coalesce(array_agg(t.n::integer ORDER BY t.n), '{}') INTO one_by_one
      FROM generate_subscripts(p_payouts, 1) AS t(n)
     WHERE t.n <> ALL (SELECT a.item FROM unnest(answers) a);
    IF cardinality(one_by_one) = 0 THEN
        RETURN;
    END IF;
    -- The items of one_by_one as a batch of their own, whose item k is one_by_one[k].
    RETURN QUERY
        SELECT one_by_one[r.item], r.begin_outcome, r.response_status, r.response_body,
               r.outcome, r.error_state, r.error_message
          FROM (SELECT array_agg(p_routes[n] ORDER BY k) AS routes,
                       array_agg(p_keys[n] ORDER BY k) AS keys,
                       array_agg(p_tokens[n] ORDER BY k) AS tokens,
                       array_agg(p_owners[n] ORDER BY k) AS owners,
                       array_agg(p_hashes[n] ORDER BY k) AS hashes,
                       array_agg(p_retention_ms[n] ORDER BY k) AS retention,
                       array_agg(p_payouts[n] ORDER BY k) AS payouts,
                       array_agg(p_accounts[n] ORDER BY k) AS accounts,
                       array_agg(p_amounts[n] ORDER BY k) AS amounts,
                       array_agg(p_currencies[n] ORDER BY k) AS currencies,
                       array_agg(p_beneficiaries[n] ORDER BY k) AS beneficiaries
                  FROM unnest(one_by_one) WITH ORDINALITY AS u(n, k)) s,
               LATERAL pay_create_one_by_one(s.routes, s.keys, s.tokens, s.owners, s.hashes,
                                             s.retention, p_wait_ms, s.payouts, s.accounts,
                                             s.amounts, s.currencies, s.beneficiaries) r;
END $$;

-- =============================================================================================
-- The rail proxy's writes: admission (docs/contract.md#s3-5, steps 1–3) and outcome recording,
-- each one transaction, so that no code path can forward without a durable intent and no token
-- can submit twice for an account.
-- =============================================================================================

-- Steps 1 to 3 of the admission order, in that order, in one transaction. The caller forwards to
-- the rail only when this returns 'admitted', and only after it has committed.
--
-- Idempotent replay (docs/contract.md#idempotency-rules, docs/design.md#d-7) is checked first:
-- after the payout row lock, before anything else is decided. The identical request retried by
-- the same holder (same X-Idempotency-Key, same X-Fencing-Token, same body) gets the first answer
-- back ('replay': the first attempt, its outcome and stored answer) and is never forwarded again;
-- it is not a duplicate attempt and does not page. The same key and token with another body is
-- 'conflict' (IDEMPOTENCY_CONFLICT), naming the attempt whose key and token it reused. A
-- different token for a payout that already has an attempt stays 'duplicate'
-- (DUPLICATE_SUBMISSION) or 'fenced' (FENCED_OUT): the token is part of the idempotency scope.
--
-- rail_admit refuses ('mismatch') a submission whose account, amount, currency or beneficiary
-- (p_beneficiary, the submission's beneficiaryRef) differs from the payout's, naming the fields
-- that differ (docs/contract.md#s3-5): a holder of a valid claim cannot send the payout's money
-- to another beneficiary through the proxy. Nothing is recorded then and no mark moves.
CREATE FUNCTION rail_admit(p_payout uuid, p_account text, p_amount bigint,
                           p_currency text, p_beneficiary text, p_token bigint,
                           p_key text, p_submission uuid, p_request text)
RETURNS TABLE (outcome text, highest_token bigint, resource_type text, state text,
               submission_id uuid, submission_outcome text, response_status smallint,
               response_body bytea)
LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan SET enable_seqscan = off SET jit = off AS $$
DECLARE
    v_payout   payouts%ROWTYPE;
    v_high     bigint;
    v_fence    bigint;
    v_existing rail_submission%ROWTYPE;
    v_same     rail_submission%ROWTYPE;
    v_hash     bytea := sha256(convert_to(p_request, 'UTF8'));
    v_differs  text;
BEGIN
    -- The payout row lock serializes every submission of one payout.
    SELECT * INTO v_payout FROM payouts WHERE payout_id = p_payout FOR UPDATE;
    IF NOT FOUND THEN
        RETURN QUERY SELECT 'payout_unknown', NULL::bigint, NULL::text, NULL::text, NULL::uuid,
                            NULL::text, NULL::smallint, NULL::bytea;
        RETURN;
    END IF;

    -- Replay: an attempt presented under this very key and token. FENCED rows never reached
    -- the rail and are answered afresh (a stale token stays fenced).
    SELECT * INTO v_same FROM rail_submission r
    WHERE r.idempotency_key = p_key AND r.presented_token = p_token AND r.outcome <> 'FENCED'
    ORDER BY r.submitted_at LIMIT 1;
    IF v_same.submission_id IS NOT NULL AND v_same.request_hash IS NOT NULL THEN
        IF v_same.payout_id = p_payout AND v_same.request_hash = v_hash THEN
            RETURN QUERY SELECT 'replay', p_token, NULL::text, v_payout.state,
                                v_same.submission_id, v_same.outcome, v_same.response_status,
                                v_same.response_body;
        ELSE
            RETURN QUERY SELECT 'conflict', p_token, NULL::text, v_payout.state,
                                v_same.submission_id, v_same.outcome, NULL::smallint, NULL::bytea;
        END IF;
        RETURN;
    END IF;

    -- What reaches the rail is the registered payout: its account, amount, currency and
    -- beneficiary. A submission that differs in any of them is refused before any mark moves;
    -- resource_type names the fields that differ, in the contract's spelling.
    v_differs := array_to_string(ARRAY[
        CASE WHEN v_payout.account_id <> p_account THEN 'accountId' END,
        CASE WHEN v_payout.amount_minor <> p_amount THEN 'amountMinor' END,
        CASE WHEN v_payout.currency <> p_currency THEN 'currency' END,
        CASE WHEN v_payout.beneficiary_ref <> p_beneficiary THEN 'beneficiaryRef' END], ',');
    IF v_differs <> '' THEN
        RETURN QUERY SELECT 'mismatch', NULL::bigint, v_differs, v_payout.state, NULL::uuid,
                            NULL::text, NULL::smallint, NULL::bytea;
        RETURN;
    END IF;

    -- Step 1: the account's durable high-water mark, strict. The row lock serializes every
    -- submission of one account, whichever proxy replica it reached.
    INSERT INTO rail_high_water (account_id, highest_token) VALUES (p_account, 0)
    ON CONFLICT (account_id) DO NOTHING;
    SELECT h.highest_token INTO v_high FROM rail_high_water h
    WHERE h.account_id = p_account FOR UPDATE;
    SELECT * INTO v_existing FROM rail_submission r
    WHERE r.payout_id = p_payout AND r.outcome <> 'FENCED';
    IF p_token <= v_high THEN
        -- The same payout and token under another key (or an attempt from before replay was
        -- recorded) is a duplicate, not a stale writer. Either way nothing reaches the rail.
        IF v_existing.submission_id IS NOT NULL AND v_existing.presented_token = p_token THEN
            RETURN QUERY SELECT 'duplicate', v_high, NULL::text, v_payout.state,
                                v_existing.submission_id, v_existing.outcome, NULL::smallint,
                                NULL::bytea;
            RETURN;
        END IF;
        INSERT INTO rail_submission (submission_id, payout_id, account_id, presented_token,
                                     idempotency_key, outcome, resolved_at)
        VALUES (p_submission, p_payout, p_account, p_token, p_key, 'FENCED', clock_timestamp());
        RETURN QUERY SELECT 'fenced', v_high, 'rail', v_payout.state, p_submission, 'FENCED',
                            NULL::smallint, NULL::bytea;
        RETURN;
    END IF;
    -- A token below the account's fence or the payout's latest claim belongs to a holder that
    -- has been superseded, even if the newer holder has not submitted yet.
    SELECT a.fence INTO v_fence FROM accounts a WHERE a.account_id = p_account;
    IF p_token < v_fence OR p_token < coalesce(v_payout.claim_token, 0) THEN
        INSERT INTO rail_submission (submission_id, payout_id, account_id, presented_token,
                                     idempotency_key, outcome, resolved_at)
        VALUES (p_submission, p_payout, p_account, p_token, p_key, 'FENCED', clock_timestamp());
        RETURN QUERY SELECT 'fenced', greatest(v_fence, coalesce(v_payout.claim_token, 0)),
                            'account', v_payout.state, p_submission, 'FENCED', NULL::smallint,
                            NULL::bytea;
        RETURN;
    END IF;

    -- Step 2: one presented attempt per payout, whatever the token (docs/contract.md#rail-step-2).
    IF v_existing.submission_id IS NOT NULL THEN
        RETURN QUERY SELECT 'duplicate', v_high, NULL::text, v_payout.state,
                            v_existing.submission_id, v_existing.outcome, NULL::smallint,
                            NULL::bytea;
        RETURN;
    END IF;
    -- Only a payout claimed with this very token may be submitted.
    IF v_payout.state <> 'CLAIMED' OR v_payout.claim_token <> p_token THEN
        RETURN QUERY SELECT 'not_claimable', v_high, NULL::text, v_payout.state, NULL::uuid,
                            NULL::text, NULL::smallint, NULL::bytea;
        RETURN;
    END IF;

    -- Step 3: the intent (with the request's hash), the advanced mark and the payout's
    -- SUBMITTING state commit together, before any network call.
    UPDATE rail_high_water h SET highest_token = p_token, updated_at = clock_timestamp()
    WHERE h.account_id = p_account;
    INSERT INTO rail_submission (submission_id, payout_id, account_id, presented_token,
                                 idempotency_key, request_hash)
    VALUES (p_submission, p_payout, p_account, p_token, p_key, v_hash);
    UPDATE payouts p SET state = 'SUBMITTING', submission_id = p_submission
    WHERE p.payout_id = p_payout;
    RETURN QUERY SELECT 'admitted', p_token, NULL::text, 'SUBMITTING', p_submission, 'unresolved',
                        NULL::smallint, NULL::bytea;
END $$;

-- rail_admit, and p_proven: whether the rail proxy verified the token's proof (with proof keys
-- configured every submission is proven before it reaches here). An admitted proven submission
-- raises max_seen_token to its token in the same transaction, under the row lock rail_admit
-- took. The 9-argument rail_admit stays for a caller that passes no proof flag and records
-- nothing; this one wraps it, so a change of admission there is a change here too.
CREATE FUNCTION rail_admit(p_payout uuid, p_account text, p_amount bigint,
                           p_currency text, p_beneficiary text, p_token bigint,
                           p_key text, p_submission uuid, p_request text,
                           p_proven boolean)
RETURNS TABLE (outcome text, highest_token bigint, resource_type text, state text,
               submission_id uuid, submission_outcome text, response_status smallint,
               response_body bytea)
LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan SET enable_seqscan = off SET jit = off AS $$
#variable_conflict use_column
DECLARE
    r record;
BEGIN
    SELECT * INTO r FROM rail_admit(p_payout, p_account, p_amount, p_currency, p_beneficiary,
                                    p_token, p_key, p_submission, p_request) a;
    IF r.outcome = 'admitted' AND p_proven THEN
        UPDATE rail_high_water h SET max_seen_token = p_token
         WHERE h.account_id = p_account AND h.max_seen_token < p_token;
    END IF;
    RETURN QUERY SELECT r.outcome, r.highest_token, r.resource_type, r.state, r.submission_id,
                        r.submission_outcome, r.response_status, r.response_body;
END $$;

-- Records the one outcome of a forwarded attempt and moves the payout with it: ACKED →
-- RAIL_ACKED, REJECTED → FAILED (the hold is released), TIMEOUT → RAIL_AMBIGUOUS (quarantine).
-- An attempt is resolved once; a late answer after the sweeper timed it out changes nothing but
-- is kept: when the attempt was already timed out (the sweeper resolved it while the forward
-- still waited for the rail), an ACKED or REJECTED answer is recorded as the late answer. The
-- attempt keeps its TIMEOUT and the payout stays RAIL_AMBIGUOUS for the operator: the late
-- answer is the evidence a resolution is checked against (pay_resolve).
CREATE FUNCTION rail_record(p_submission uuid, p_outcome text, p_reference text)
RETURNS TABLE (outcome text, payout_id uuid, rail_reference text, submitted_at timestamptz,
               resolved_at timestamptz)
LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan SET enable_seqscan = off SET jit = off AS $$
DECLARE
    v_row rail_submission%ROWTYPE;
BEGIN
    IF p_outcome NOT IN ('ACKED', 'REJECTED', 'TIMEOUT') THEN
        RAISE EXCEPTION 'an attempt resolves as ACKED, REJECTED or TIMEOUT, not %', p_outcome
            USING ERRCODE = 'check_violation';
    END IF;
    UPDATE rail_submission r
       SET outcome = p_outcome,
           rail_reference = CASE WHEN p_outcome = 'ACKED' THEN p_reference END,
           resolved_at = clock_timestamp()
     WHERE r.submission_id = p_submission AND r.outcome = 'unresolved'
    RETURNING * INTO v_row;
    IF v_row.submission_id IS NULL THEN
        IF p_outcome = 'REJECTED' OR (p_outcome = 'ACKED' AND p_reference IS NOT NULL) THEN
            UPDATE rail_submission r
               SET late_outcome = p_outcome,
                   late_rail_reference = CASE WHEN p_outcome = 'ACKED' THEN p_reference END,
                   late_at = clock_timestamp()
             WHERE r.submission_id = p_submission AND r.outcome = 'TIMEOUT'
               AND r.late_outcome IS NULL;
        END IF;
        SELECT * INTO v_row FROM rail_submission r WHERE r.submission_id = p_submission;
        RETURN QUERY SELECT v_row.outcome, v_row.payout_id, v_row.rail_reference,
                            v_row.submitted_at, v_row.resolved_at;
        RETURN;
    END IF;
    UPDATE payouts p
       SET state = CASE p_outcome WHEN 'ACKED' THEN 'RAIL_ACKED'
                                  WHEN 'REJECTED' THEN 'FAILED'
                                  ELSE 'RAIL_AMBIGUOUS' END,
           rail_reference = CASE WHEN p_outcome = 'ACKED' THEN p_reference ELSE p.rail_reference END
     WHERE p.payout_id = v_row.payout_id AND p.state = 'SUBMITTING';
    RETURN QUERY SELECT v_row.outcome, v_row.payout_id, v_row.rail_reference,
                        v_row.submitted_at, v_row.resolved_at;
END $$;

-- Stores the answer given for a resolved attempt, once: a replay returns exactly it. Called as a
-- statement of its own for every attempt the rail proxy answers, hence PL/pgSQL.
CREATE FUNCTION rail_store_answer(p_submission uuid, p_outcome text, p_status smallint,
                                  p_body bytea)
RETURNS boolean LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan SET enable_seqscan = off SET jit = off AS $$
DECLARE
    was_stored boolean;
BEGIN
    -- A data-modifying WITH must be a statement's top level, so the answer goes through INTO.
    WITH stored AS (
        UPDATE rail_submission r SET response_status = p_status, response_body = p_body
        WHERE r.submission_id = p_submission AND r.outcome = p_outcome
          AND r.response_status IS NULL
        RETURNING 1
    )
    SELECT EXISTS (SELECT 1 FROM stored) INTO was_stored;
    RETURN was_stored;
END $$;

-- docs/design.md#d-5: an intent still unresolved after the rail read timeout plus a margin
-- belongs to a proxy that died mid-flight. It becomes TIMEOUT and its payout RAIL_AMBIGUOUS; it
-- is never forwarded again. Returns the payouts it quarantined.
CREATE FUNCTION rail_expire_unresolved(p_older_than_ms bigint)
RETURNS TABLE (submission_id uuid, payout_id uuid)
LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan SET enable_seqscan = off SET jit = off AS $$
DECLARE
    v_row rail_submission%ROWTYPE;
BEGIN
    FOR v_row IN
        SELECT * FROM rail_submission r
        WHERE r.outcome = 'unresolved'
          AND r.submitted_at < clock_timestamp() - p_older_than_ms * interval '1 millisecond'
        FOR UPDATE SKIP LOCKED
    LOOP
        UPDATE rail_submission r SET outcome = 'TIMEOUT', resolved_at = clock_timestamp()
        WHERE r.submission_id = v_row.submission_id;
        UPDATE payouts p SET state = 'RAIL_AMBIGUOUS'
        WHERE p.payout_id = v_row.payout_id AND p.state = 'SUBMITTING';
        submission_id := v_row.submission_id;
        payout_id := v_row.payout_id;
        RETURN NEXT;
    END LOOP;
END $$;

-- Deletes FENCED rows resolved more than p_older_than_ms ago, a bounded batch at a time.
-- Returns how many went.
CREATE FUNCTION rail_sweep_fenced(p_older_than_ms bigint, p_batch integer) RETURNS bigint
LANGUAGE sql AS $$
    WITH gone AS (
        DELETE FROM rail_submission
         WHERE submission_id IN (
               SELECT r.submission_id FROM rail_submission r
                WHERE r.outcome = 'FENCED'
                  AND r.resolved_at < clock_timestamp() - p_older_than_ms * interval '1 millisecond'
                LIMIT p_batch FOR UPDATE SKIP LOCKED)
           AND outcome = 'FENCED'
        RETURNING 1)
    SELECT count(*) FROM gone;
$$;

-- docs/design.md#d-3: raises an account's rail high-water mark to a revocation floor, so that
-- every write with the revoked token (or any older one) is fenced at the rail from now on.
-- Attributed (operator and identity) in rail_fence_advances.
CREATE FUNCTION rail_advance_high_water(p_account text, p_floor bigint, p_operator text,
                                        p_owner text, p_reason text, p_revocation uuid,
                                        p_identity text)
RETURNS TABLE (previous_token bigint, new_token bigint)
LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan SET enable_seqscan = off SET jit = off AS $$
DECLARE
    v_previous bigint;
    v_new      bigint;
BEGIN
    INSERT INTO rail_high_water (account_id, highest_token) VALUES (p_account, 0)
    ON CONFLICT (account_id) DO NOTHING;
    SELECT h.highest_token INTO v_previous FROM rail_high_water h
    WHERE h.account_id = p_account FOR UPDATE;
    v_new := greatest(v_previous, p_floor);
    UPDATE rail_high_water h SET highest_token = v_new, updated_at = clock_timestamp()
    WHERE h.account_id = p_account;
    INSERT INTO rail_fence_advances (account_id, previous_token, floor_token, new_token, operator,
                                     identity, owner_id, reason, revocation_id)
    VALUES (p_account, v_previous, p_floor, v_new, p_operator, p_identity, p_owner, p_reason,
            p_revocation);
    RETURN QUERY SELECT v_previous, v_new;
END $$;

-- docs/design.md#d-8: the rail proxy's recovery of a poisoned high-water mark, never under
-- max_seen_token. outcome: lowered | unchanged (the mark is already at or below p_to: nothing to
-- do, nothing recorded) | below_seen (p_to is below a proven token the proxy admitted: nothing
-- changed, nothing recorded) | not_found. seen_token is the mark's max_seen_token.
CREATE FUNCTION rail_lower_high_water(p_account text, p_to bigint, p_operator text,
                                      p_identity text, p_owner text, p_reason text)
RETURNS TABLE (outcome text, previous_token bigint, highest_token bigint, recovery_id bigint,
               seen_token bigint)
LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan SET enable_seqscan = off SET jit = off AS $$
#variable_conflict use_column
DECLARE
    h  rail_high_water%ROWTYPE;
    v_id bigint;
BEGIN
    PERFORM 1 FROM accounts a WHERE a.account_id = p_account;
    IF NOT FOUND THEN
        RETURN QUERY SELECT 'not_found'::text, NULL::bigint, NULL::bigint, NULL::bigint,
                            NULL::bigint;
        RETURN;
    END IF;
    SELECT * INTO h FROM rail_high_water x WHERE x.account_id = p_account FOR UPDATE;
    IF NOT FOUND THEN
        RETURN QUERY SELECT 'unchanged'::text, 0::bigint, 0::bigint, NULL::bigint, 0::bigint;
        RETURN;
    END IF;
    IF h.highest_token <= p_to THEN
        RETURN QUERY SELECT 'unchanged'::text, h.highest_token, h.highest_token, NULL::bigint,
                            h.max_seen_token;
        RETURN;
    END IF;
    IF p_to < h.max_seen_token THEN
        RETURN QUERY SELECT 'below_seen'::text, h.highest_token, h.highest_token, NULL::bigint,
                            h.max_seen_token;
        RETURN;
    END IF;
    INSERT INTO fence_recoveries (resource, account_id, previous_token, new_token, operator,
                                  identity, owner_id, reason)
    VALUES ('rail', p_account, h.highest_token, p_to, p_operator, p_identity, p_owner, p_reason)
    RETURNING fence_recoveries.recovery_id INTO v_id;
    UPDATE rail_high_water x SET highest_token = p_to, updated_at = clock_timestamp()
     WHERE x.account_id = p_account;
    RETURN QUERY SELECT 'lowered'::text, h.highest_token, p_to, v_id, h.max_seen_token;
END $$;

-- =============================================================================================
-- The rail proxy's admissions and records by the batch (docs/design.md#group-commit)
-- =============================================================================================

-- The rail proxy admits the submissions that queued behind a running admission in one statement
-- and one commit, and records the answers of concurrent forwards the same way.
--
-- rail_admit_many takes a batch's submissions as arrays (one element per item, in item order)
-- and answers one row per item, named by its 1-based place (`item`), with rail_admit's columns;
-- rail_record_many likewise with rail_record's. A batch goes through rail_admit_set and
-- rail_record_set, which make rail_admit's and rail_record's decisions for all its items in a
-- few statements (the mark, one attempt per payout, the intent row, a FENCED row for a stale
-- token), and falls back to the item loop when the set cannot take it:
--
-- - the set path needs every item on its own payout, its own account and its own idempotency
--   key and token (the rail proxy's batches are built that way), and every outcome a rail
--   outcome; it refuses anything else (invalid_parameter_value) before it writes;
-- - if the set path raises for any reason (an item a trigger refuses, the epoch guard), its
--   writes are rolled back as a whole and every item goes one by one through rail_admit
--   (rail_record) in a subtransaction of its own, where an item that raises (the epoch guard,
--   DL012, included) is rolled back alone and answered outcome 'error' with its SQLSTATE and
--   message, and its neighbours are decided and committed as if it had not been there. A
--   poisoned item never fails its neighbours.
--
-- Locks first, in key order, in the order the single functions take them: the batch's payouts,
-- then the high-water marks of their accounts (admission); the attempts, then their payouts
-- (record). A batch takes every payout before any mark, so batches and single admissions never
-- wait on each other in a cycle.

-- One item's answer, the columns of rail_admit_many (rail_record_many) but the error's.
CREATE TYPE rail_admit_answer AS (
    item integer, outcome text, highest_token bigint, resource_type text, state text,
    submission_id uuid, submission_outcome text, response_status smallint,
    response_body bytea);
CREATE TYPE rail_record_answer AS (
    item integer, outcome text, payout_id uuid, rail_reference text,
    submitted_at timestamptz, resolved_at timestamptz);

-- What rail_admit decides before it touches a mark, for each item (1-based `item`): the payout
-- does not exist (payout_unknown), the key and token were presented before (replay, or conflict
-- when the payout or the request differs), or the submission differs from the registered payout
-- (mismatch, `differs` naming the fields in the contract's spelling). `verdict` is NULL for an
-- item that goes on to the mark. `same_*` is the earlier attempt under this key and token.
CREATE FUNCTION rail_admit_read(p_payouts uuid[], p_accounts text[],
                                p_amounts bigint[], p_currencies text[],
                                p_beneficiaries text[], p_tokens bigint[],
                                p_keys text[], p_requests text[])
RETURNS TABLE (item integer, verdict text, differs text, payout_state text, claim_token bigint,
               same_submission uuid, same_outcome text, same_status smallint, same_body bytea)
LANGUAGE sql STABLE AS $$
    SELECT i.n::integer,
           CASE WHEN x.payout_id IS NULL THEN 'payout_unknown'
                WHEN s.submission_id IS NOT NULL AND s.request_hash IS NOT NULL THEN
                    CASE WHEN s.payout_id = i.payout
                              AND s.request_hash = sha256(convert_to(i.request, 'UTF8'))
                         THEN 'replay' ELSE 'conflict' END
                WHEN d.differs <> '' THEN 'mismatch'
           END,
           d.differs, x.state, x.claim_token, s.submission_id, s.outcome, s.response_status,
           s.response_body
      FROM unnest(p_payouts, p_accounts, p_amounts, p_currencies, p_beneficiaries, p_tokens,
                  p_keys, p_requests)
           WITH ORDINALITY AS i(payout, account, amount, currency, beneficiary, token, key,
                                request, n)
      LEFT JOIN payouts x ON x.payout_id = i.payout
      LEFT JOIN LATERAL (SELECT r.submission_id, r.payout_id, r.request_hash, r.outcome,
                                r.response_status, r.response_body
                           FROM rail_submission r
                          WHERE r.idempotency_key = i.key AND r.presented_token = i.token
                            AND r.outcome <> 'FENCED'
                          ORDER BY r.submitted_at LIMIT 1) s ON true
      CROSS JOIN LATERAL (SELECT array_to_string(ARRAY[
                                 CASE WHEN x.account_id <> i.account THEN 'accountId' END,
                                 CASE WHEN x.amount_minor <> i.amount THEN 'amountMinor' END,
                                 CASE WHEN x.currency <> i.currency THEN 'currency' END,
                                 CASE WHEN x.beneficiary_ref <> i.beneficiary
                                      THEN 'beneficiaryRef' END], ',') AS differs) d
$$;

-- rail_admit (with p_proven) for a whole batch: the same outcome for each item, the same rows
-- written. One answer per item, in item order.
CREATE FUNCTION rail_admit_set(p_payouts uuid[], p_accounts text[],
                               p_amounts bigint[], p_currencies text[],
                               p_beneficiaries text[], p_tokens bigint[],
                               p_keys text[], p_submissions uuid[],
                               p_requests text[], p_proven boolean)
RETURNS SETOF rail_admit_answer
LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan SET enable_seqscan = off SET jit = off AS $$
DECLARE
    n integer := coalesce(cardinality(p_payouts), 0);
BEGIN
    IF n IS DISTINCT FROM coalesce(cardinality(p_accounts), 0)
       OR n IS DISTINCT FROM coalesce(cardinality(p_amounts), 0)
       OR n IS DISTINCT FROM coalesce(cardinality(p_currencies), 0)
       OR n IS DISTINCT FROM coalesce(cardinality(p_beneficiaries), 0)
       OR n IS DISTINCT FROM coalesce(cardinality(p_tokens), 0)
       OR n IS DISTINCT FROM coalesce(cardinality(p_keys), 0)
       OR n IS DISTINCT FROM coalesce(cardinality(p_submissions), 0)
       OR n IS DISTINCT FROM coalesce(cardinality(p_requests), 0)
       OR (SELECT count(DISTINCT u) FROM unnest(p_payouts) u) <> n
       OR (SELECT count(DISTINCT u) FROM unnest(p_accounts) u) <> n
       OR (SELECT count(DISTINCT (k, t)) FROM unnest(p_keys, p_tokens) AS z(k, t)) <> n THEN
        RAISE EXCEPTION 'rail_admit_set: the items need arrays of one length and a payout, an '
                        'account and a key and token of their own'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    PERFORM 1 FROM payouts x WHERE x.payout_id = ANY (p_payouts)
     ORDER BY x.payout_id FOR UPDATE OF x;
    PERFORM 1 FROM rail_high_water h WHERE h.account_id = ANY (p_accounts)
     ORDER BY h.account_id FOR UPDATE OF h;
    -- Step 1 of rail_admit: the mark of every account whose item gets that far.
    INSERT INTO rail_high_water (account_id, highest_token)
    SELECT p_accounts[r.item], 0
      FROM rail_admit_read(p_payouts, p_accounts, p_amounts, p_currencies, p_beneficiaries,
                           p_tokens, p_keys, p_requests) r
     WHERE r.verdict IS NULL
     ORDER BY 1
    ON CONFLICT (account_id) DO NOTHING;
    RETURN QUERY
    WITH d AS (
        SELECT r.*, i.payout, i.account, i.token, i.key, i.submission, i.request,
               h.highest_token AS high, a.fence, e.submission_id AS ex_id,
               e.presented_token AS ex_token, e.outcome AS ex_outcome
          FROM rail_admit_read(p_payouts, p_accounts, p_amounts, p_currencies, p_beneficiaries,
                               p_tokens, p_keys, p_requests) r
          JOIN unnest(p_payouts, p_accounts, p_tokens, p_keys, p_submissions, p_requests)
               WITH ORDINALITY AS i(payout, account, token, key, submission, request, n)
            ON i.n = r.item
          LEFT JOIN rail_high_water h ON h.account_id = i.account
          LEFT JOIN accounts a ON a.account_id = i.account
          LEFT JOIN rail_submission e ON e.payout_id = i.payout AND e.outcome <> 'FENCED'
    ), v AS (
        SELECT d.*,
               CASE WHEN d.verdict IS NOT NULL THEN d.verdict
                    -- Step 1: at or below the mark: the same attempt again, or a stale writer.
                    WHEN d.token <= d.high AND d.ex_id IS NOT NULL AND d.ex_token = d.token
                        THEN 'duplicate'
                    WHEN d.token <= d.high THEN 'fenced_rail'
                    -- Superseded by the account's fence or the payout's latest claim.
                    WHEN d.token < d.fence OR d.token < coalesce(d.claim_token, 0)
                        THEN 'fenced_account'
                    -- Step 2: one presented attempt per payout.
                    WHEN d.ex_id IS NOT NULL THEN 'duplicate'
                    WHEN d.payout_state <> 'CLAIMED' OR d.claim_token <> d.token
                        THEN 'not_claimable'
                    ELSE 'admitted' END AS o
          FROM d
    ), fenced AS (
        INSERT INTO rail_submission (submission_id, payout_id, account_id, presented_token,
                                     idempotency_key, outcome, resolved_at)
        SELECT v.submission, v.payout, v.account, v.token, v.key, 'FENCED', clock_timestamp()
          FROM v WHERE v.o IN ('fenced_rail', 'fenced_account')
        RETURNING 1
    ), marks AS (
        -- Step 3: the advanced mark (and, for a proven token, the highest proven one), the
        -- intent with the request's hash and the payout's SUBMITTING state, in one commit.
        UPDATE rail_high_water h
           SET highest_token = v.token, updated_at = clock_timestamp(),
               max_seen_token = CASE WHEN p_proven AND h.max_seen_token < v.token THEN v.token
                                     ELSE h.max_seen_token END
          FROM v WHERE v.o = 'admitted' AND h.account_id = v.account
        RETURNING 1
    ), intents AS (
        INSERT INTO rail_submission (submission_id, payout_id, account_id, presented_token,
                                     idempotency_key, request_hash)
        SELECT v.submission, v.payout, v.account, v.token, v.key,
               sha256(convert_to(v.request, 'UTF8'))
          FROM v WHERE v.o = 'admitted'
        RETURNING 1
    ), moved AS (
        UPDATE payouts p SET state = 'SUBMITTING', submission_id = v.submission
          FROM v WHERE v.o = 'admitted' AND p.payout_id = v.payout
        RETURNING 1
    )
    SELECT v.item,
           CASE WHEN v.o IN ('fenced_rail', 'fenced_account') THEN 'fenced' ELSE v.o END,
           CASE v.o WHEN 'payout_unknown' THEN NULL WHEN 'mismatch' THEN NULL
                    WHEN 'replay' THEN v.token WHEN 'conflict' THEN v.token
                    WHEN 'admitted' THEN v.token
                    WHEN 'fenced_account' THEN greatest(v.fence, coalesce(v.claim_token, 0))
                    ELSE v.high END,
           CASE v.o WHEN 'mismatch' THEN v.differs WHEN 'fenced_rail' THEN 'rail'
                    WHEN 'fenced_account' THEN 'account' END,
           CASE v.o WHEN 'payout_unknown' THEN NULL WHEN 'admitted' THEN 'SUBMITTING'
                    ELSE v.payout_state END,
           CASE WHEN v.o IN ('replay', 'conflict') THEN v.same_submission
                WHEN v.o = 'duplicate' THEN v.ex_id
                WHEN v.o IN ('fenced_rail', 'fenced_account', 'admitted') THEN v.submission END,
           CASE WHEN v.o IN ('replay', 'conflict') THEN v.same_outcome
                WHEN v.o = 'duplicate' THEN v.ex_outcome
                WHEN v.o IN ('fenced_rail', 'fenced_account') THEN 'FENCED'
                WHEN v.o = 'admitted' THEN 'unresolved' END,
           CASE WHEN v.o = 'replay' THEN v.same_status END,
           CASE WHEN v.o = 'replay' THEN v.same_body END
      FROM v
     ORDER BY v.item;
END $$;

CREATE FUNCTION rail_admit_many(p_payouts uuid[], p_accounts text[],
                                p_amounts bigint[], p_currencies text[],
                                p_beneficiaries text[], p_tokens bigint[],
                                p_keys text[], p_submissions uuid[],
                                p_requests text[], p_proven boolean)
RETURNS TABLE (item integer, outcome text, highest_token bigint, resource_type text,
               state text, submission_id uuid, submission_outcome text,
               response_status smallint, response_body bytea, error_state text,
               error_message text)
LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan SET enable_seqscan = off SET jit = off AS $$
#variable_conflict use_column
DECLARE
    i integer;
    r record;
    n integer := coalesce(cardinality(p_payouts), 0);
    answers rail_admit_answer[];
BEGIN
    IF n IS DISTINCT FROM coalesce(cardinality(p_accounts), 0)
       OR n IS DISTINCT FROM coalesce(cardinality(p_amounts), 0)
       OR n IS DISTINCT FROM coalesce(cardinality(p_currencies), 0)
       OR n IS DISTINCT FROM coalesce(cardinality(p_beneficiaries), 0)
       OR n IS DISTINCT FROM coalesce(cardinality(p_tokens), 0)
       OR n IS DISTINCT FROM coalesce(cardinality(p_keys), 0)
       OR n IS DISTINCT FROM coalesce(cardinality(p_submissions), 0)
       OR n IS DISTINCT FROM coalesce(cardinality(p_requests), 0) THEN
        RAISE EXCEPTION 'rail_admit_many: the item arrays differ in length'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    BEGIN
        SELECT array_agg(a) INTO answers
          FROM rail_admit_set(p_payouts, p_accounts, p_amounts, p_currencies, p_beneficiaries,
                              p_tokens, p_keys, p_submissions, p_requests, p_proven) a;
    EXCEPTION WHEN OTHERS THEN
        -- Rolled back as a whole: every item goes one by one.
        answers := NULL;
    END;
    IF answers IS NOT NULL THEN
        RETURN QUERY SELECT a.*, NULL::text, NULL::text FROM unnest(answers) a;
        RETURN;
    END IF;
    PERFORM 1 FROM payouts x WHERE x.payout_id = ANY (p_payouts)
     ORDER BY x.payout_id FOR UPDATE OF x;
    PERFORM 1 FROM rail_high_water h WHERE h.account_id = ANY (p_accounts)
     ORDER BY h.account_id FOR UPDATE OF h;
    FOR i IN 1 .. n LOOP
        BEGIN
            SELECT * INTO r FROM rail_admit(p_payouts[i], p_accounts[i], p_amounts[i],
                                            p_currencies[i], p_beneficiaries[i], p_tokens[i],
                                            p_keys[i], p_submissions[i], p_requests[i],
                                            p_proven) a;
            RETURN QUERY SELECT i, r.outcome, r.highest_token, r.resource_type, r.state,
                                r.submission_id, r.submission_outcome, r.response_status,
                                r.response_body, NULL::text, NULL::text;
        EXCEPTION WHEN OTHERS THEN
            RETURN QUERY SELECT i, 'error'::text, NULL::bigint, NULL::text, NULL::text,
                                NULL::uuid, NULL::text, NULL::smallint, NULL::bytea,
                                SQLSTATE::text, SQLERRM::text;
        END;
    END LOOP;
END $$;

-- rail_record for a whole batch: each attempt still unresolved gets its outcome and its payout
-- leaves SUBMITTING; a timed-out attempt keeps a rail answer as its late answer; every item is
-- answered with its attempt as it then stands. One answer per item, in item order.
CREATE FUNCTION rail_record_set(p_submissions uuid[], p_outcomes text[],
                                p_references text[])
RETURNS SETOF rail_record_answer
LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan SET enable_seqscan = off SET jit = off AS $$
DECLARE
    n integer := coalesce(cardinality(p_submissions), 0);
BEGIN
    IF n IS DISTINCT FROM coalesce(cardinality(p_outcomes), 0)
       OR n IS DISTINCT FROM coalesce(cardinality(p_references), 0)
       OR (SELECT count(DISTINCT u) FROM unnest(p_submissions) u) <> n
       OR EXISTS (SELECT 1 FROM unnest(p_outcomes) o
                   WHERE o IS NULL OR o NOT IN ('ACKED', 'REJECTED', 'TIMEOUT')) THEN
        RAISE EXCEPTION 'rail_record_set: the items need arrays of one length, an attempt of '
                        'their own and a rail outcome'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    PERFORM 1 FROM rail_submission s WHERE s.submission_id = ANY (p_submissions)
     ORDER BY s.submission_id FOR UPDATE OF s;
    PERFORM 1 FROM payouts x
     WHERE x.payout_id IN (SELECT s.payout_id FROM rail_submission s
                            WHERE s.submission_id = ANY (p_submissions))
     ORDER BY x.payout_id FOR UPDATE OF x;
    RETURN QUERY
    WITH i AS (
        SELECT * FROM unnest(p_submissions, p_outcomes, p_references)
                      WITH ORDINALITY AS i(submission, outcome, reference, n)
    ), resolved AS (
        UPDATE rail_submission r
           SET outcome = i.outcome,
               rail_reference = CASE WHEN i.outcome = 'ACKED' THEN i.reference END,
               resolved_at = clock_timestamp()
          FROM i WHERE r.submission_id = i.submission AND r.outcome = 'unresolved'
        RETURNING i.n, r.outcome, r.payout_id, r.rail_reference, r.submitted_at, r.resolved_at
    ), late AS (
        UPDATE rail_submission r
           SET late_outcome = i.outcome,
               late_rail_reference = CASE WHEN i.outcome = 'ACKED' THEN i.reference END,
               late_at = clock_timestamp()
          FROM i WHERE r.submission_id = i.submission AND r.outcome = 'TIMEOUT'
           AND r.late_outcome IS NULL
           AND (i.outcome = 'REJECTED' OR (i.outcome = 'ACKED' AND i.reference IS NOT NULL))
        RETURNING 1
    ), moved AS (
        UPDATE payouts p
           SET state = CASE x.outcome WHEN 'ACKED' THEN 'RAIL_ACKED'
                                      WHEN 'REJECTED' THEN 'FAILED'
                                      ELSE 'RAIL_AMBIGUOUS' END,
               rail_reference = CASE WHEN x.outcome = 'ACKED' THEN x.rail_reference
                                     ELSE p.rail_reference END
          FROM resolved x WHERE p.payout_id = x.payout_id AND p.state = 'SUBMITTING'
        RETURNING 1
    )
    -- An attempt not resolved here is answered as it stood (a late answer changes none of
    -- these columns); an unknown attempt with NULLs, as rail_record answers it.
    SELECT i.n::integer,
           CASE WHEN x.n IS NULL THEN s.outcome ELSE x.outcome END,
           CASE WHEN x.n IS NULL THEN s.payout_id ELSE x.payout_id END,
           CASE WHEN x.n IS NULL THEN s.rail_reference ELSE x.rail_reference END,
           CASE WHEN x.n IS NULL THEN s.submitted_at ELSE x.submitted_at END,
           CASE WHEN x.n IS NULL THEN s.resolved_at ELSE x.resolved_at END
      FROM i
      LEFT JOIN resolved x ON x.n = i.n
      LEFT JOIN rail_submission s ON s.submission_id = i.submission
     ORDER BY i.n;
END $$;

CREATE FUNCTION rail_record_many(p_submissions uuid[], p_outcomes text[],
                                 p_references text[])
RETURNS TABLE (item integer, outcome text, payout_id uuid, rail_reference text,
               submitted_at timestamptz, resolved_at timestamptz, error_state text,
               error_message text)
LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan SET enable_seqscan = off SET jit = off AS $$
#variable_conflict use_column
DECLARE
    i integer;
    r record;
    n integer := coalesce(cardinality(p_submissions), 0);
    answers rail_record_answer[];
BEGIN
    IF n IS DISTINCT FROM coalesce(cardinality(p_outcomes), 0)
       OR n IS DISTINCT FROM coalesce(cardinality(p_references), 0) THEN
        RAISE EXCEPTION 'rail_record_many: the item arrays differ in length'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    BEGIN
        SELECT array_agg(a) INTO answers
          FROM rail_record_set(p_submissions, p_outcomes, p_references) a;
    EXCEPTION WHEN OTHERS THEN
        -- Rolled back as a whole: every item goes one by one.
        answers := NULL;
    END;
    IF answers IS NOT NULL THEN
        RETURN QUERY SELECT a.*, NULL::text, NULL::text FROM unnest(answers) a;
        RETURN;
    END IF;
    PERFORM 1 FROM rail_submission s WHERE s.submission_id = ANY (p_submissions)
     ORDER BY s.submission_id FOR UPDATE OF s;
    PERFORM 1 FROM payouts x
     WHERE x.payout_id IN (SELECT s.payout_id FROM rail_submission s
                            WHERE s.submission_id = ANY (p_submissions))
     ORDER BY x.payout_id FOR UPDATE OF x;
    FOR i IN 1 .. n LOOP
        BEGIN
            SELECT * INTO r FROM rail_record(p_submissions[i], p_outcomes[i], p_references[i]) a;
            RETURN QUERY SELECT i, r.outcome, r.payout_id, r.rail_reference, r.submitted_at,
                                r.resolved_at, NULL::text, NULL::text;
        EXCEPTION WHEN OTHERS THEN
            RETURN QUERY SELECT i, 'error'::text, NULL::uuid, NULL::text, NULL::timestamptz,
                                NULL::timestamptz, SQLSTATE::text, SQLERRM::text;
        END;
    END LOOP;
END $$;
