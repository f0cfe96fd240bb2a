-- paydb 0019: a batch of claims (or posts) decided by the set, and the ledger's row triggers
-- made statement-level (docs/design.md#group-commit).
--
-- 0016's pay_claim_many and pay_post_many ran each item of a batch through the per-row function
-- in a subtransaction of its own, so a batch of 32 still ran 32 times every statement of a claim
-- and every trigger. Here:
--
-- 1. The set path. pay_claim_many and pay_post_many keep their signatures and answers. After the
--    row locks in key order (as 0016: payouts, their accounts, then for posts the settlement
--    shards), the items that are simple to decide together go through pay_claim_set
--    (pay_post_set): one INSERT of every idempotency record, one read of the records that were
--    already there (replay or conflict), one read of the locked rows deciding each fresh item with
--    the per-row function's conditions, in its order (pay_claim: fence < token, else FENCED_OUT;
--    the expected state, else not claimable; available >= amount for a PENDING payout, else
--    FAILED; pay_post: fence <= token, RAIL_ACKED, the same rail reference and submission), then
--    one UPDATE of the accounts' fences and max_seen_token, one UPDATE of the payouts, (posts)
--    one INSERT of every posting's two entries, and one read of every answer.
-- 2. The per-row path for the rest. An item goes through 0016's loop (pay_claim_once or
--    pay_post_once in its own subtransaction, its answer exactly the single path's) when its
--    decision depends on another item or is not reproduced here: its payout does not exist; its
--    account has another item in the batch (the order between a stale and a newer holder); a claim
--    would abandon it for exhausted attempts; its idempotency record vanished between the insert
--    and the read (swept). And if anything in the set path raises (an account limit, a CHECK, the
--    bounded wait on a duplicate's record in another transaction), the set path is rolled back
--    as a whole (one subtransaction) and every one of its items goes through the loop instead,
--    where the item that raises is rolled back alone, as before.
-- 3. Statement-level triggers where per row is what costs. A posting's two entries were applied to
--    the balances by a row trigger each (an UPDATE of the account or an upsert of a settlement
--    shard per entry) and checked by a deferred row trigger each at commit; ledger_entries_apply
--    and ledger_entries_balanced now run once per INSERT statement over its transition table:
--    one UPDATE of the accounts and one upsert of the shards, and one check of every posting the
--    statement wrote. A single request's INSERT is a statement of two rows, checked the same way.
--    A posting that balances at the end of its statement balances at commit (the posting key
--    allows one DEBIT and one CREDIT, the ledger is append-only); one written over several
--    statements of a transaction (an operator's psql session) is still checked at commit, as
--    before: its reference goes into ledger_split_postings, whose deferred constraint trigger
--    runs 0010's check.
--
--    The guards stay row triggers (accounts_guard, payouts_guard, payouts_holds and 0015's
--    payouts_limits_claim): measured on this database, a statement-level version of each costs
--    more for the statements of one row that every single request and every rail proxy write
--    runs (guards 3 and 12 us per row against 17 and 54 us per statement, holds 68 against 128,
--    limits 43 against 80) than it saves on the batch's statements of a few rows, so the batch's
--    UPDATEs of payouts and accounts fire them per row, with the same checks as every other
--    write.
--
-- Like 0013 to 0016, this file can run again on a database that already has its changes.

-- =============================================================================================
-- Statement-level triggers
-- =============================================================================================

-- ledger_entries: 0010's pay_ledger_apply, one UPDATE of the accounts and one upsert of the
-- settlement shards per statement.
CREATE OR REPLACE FUNCTION pay_ledger_apply_rows() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    UPDATE accounts a
       SET balance_minor = a.balance_minor + d.delta, updated_at = clock_timestamp()
      FROM (SELECT e.account_id,
                   sum(CASE WHEN e.direction = 'CREDIT' THEN e.amount_minor
                            ELSE -e.amount_minor END)::bigint AS delta
              FROM new_entries e GROUP BY e.account_id) d
     WHERE a.account_id = d.account_id AND a.kind <> 'settlement';
    INSERT INTO account_balance_shards AS s (account_id, currency, shard, balance_minor)
    SELECT e.account_id, e.currency, pay_balance_shard(e.payout_id, e.reference),
           sum(CASE WHEN e.direction = 'CREDIT' THEN e.amount_minor
                    ELSE -e.amount_minor END)::bigint
      FROM new_entries e JOIN accounts a ON a.account_id = e.account_id
     WHERE a.kind = 'settlement'
     GROUP BY 1, 2, 3
     ORDER BY 1, 3
    ON CONFLICT (account_id, shard)
    DO UPDATE SET balance_minor = s.balance_minor + EXCLUDED.balance_minor;
    RETURN NULL;
END $$;

-- The postings written over more than one statement of a transaction; each is checked at commit.
CREATE TABLE IF NOT EXISTS ledger_split_postings (
    reference   text NOT NULL,
    recorded_at timestamptz NOT NULL DEFAULT clock_timestamp()
);
DROP TRIGGER IF EXISTS ledger_split_postings_balanced ON ledger_split_postings;
CREATE CONSTRAINT TRIGGER ledger_split_postings_balanced AFTER INSERT ON ledger_split_postings
    DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION pay_posting_balanced();

-- ledger_entries: every posting the statement wrote balances at its end (one DEBIT and one CREDIT
-- of the same amount and currency), or is checked again at commit.
CREATE OR REPLACE FUNCTION pay_ledger_balanced_rows() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO ledger_split_postings (reference)
    SELECT r.reference
      FROM (SELECT DISTINCT e.reference FROM new_entries e) r
      JOIN LATERAL (
            SELECT count(*) AS rows_count,
                   coalesce(sum(x.amount_minor) FILTER (WHERE x.direction = 'DEBIT'), 0) AS debits,
                   coalesce(sum(x.amount_minor) FILTER (WHERE x.direction = 'CREDIT'), 0)
                       AS credits,
                   count(DISTINCT x.currency) AS currencies_count
              FROM ledger_entries x WHERE x.reference = r.reference) b ON true
     WHERE b.rows_count <> 2 OR b.debits <> b.credits OR b.currencies_count <> 1;
    RETURN NULL;
END $$;

DROP TRIGGER IF EXISTS ledger_entries_apply ON ledger_entries;
DROP TRIGGER IF EXISTS ledger_entries_balanced ON ledger_entries;
CREATE TRIGGER ledger_entries_apply AFTER INSERT ON ledger_entries
    REFERENCING NEW TABLE AS new_entries
    FOR EACH STATEMENT EXECUTE FUNCTION pay_ledger_apply_rows();
CREATE TRIGGER ledger_entries_balanced AFTER INSERT ON ledger_entries
    REFERENCING NEW TABLE AS new_entries
    FOR EACH STATEMENT EXECUTE FUNCTION pay_ledger_balanced_rows();

-- =============================================================================================
-- The set path
-- =============================================================================================

-- One item's answer, the columns of pay_claim_many (pay_post_many). begin_outcome `retry` (set
-- path only): its record vanished between the insert and the read; the item goes the per-row way.
DROP FUNCTION IF EXISTS pay_claim_set(integer[], text[], text[], bigint[], text[], bytea[],
                                      bigint[], integer, uuid[], text[], integer, boolean);
DROP FUNCTION IF EXISTS pay_post_set(integer[], text[], text[], bigint[], text[], bytea[],
                                     bigint[], integer, uuid[], text[], uuid[], boolean);
DROP TYPE IF EXISTS pay_claim_answer;
DROP TYPE IF EXISTS pay_post_answer;
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
CREATE OR REPLACE FUNCTION pay_idempotency_begin_set(p_items integer[], p_routes text[],
                                                     p_keys text[], p_tokens bigint[],
                                                     p_owners text[], p_hashes bytea[],
                                                     p_retention_ms bigint[], p_wait_ms integer)
RETURNS TABLE (item integer, outcome text, response_status smallint, response_body bytea)
LANGUAGE plpgsql AS $$
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
CREATE OR REPLACE FUNCTION pay_claim_set(p_items integer[], p_routes text[], p_keys text[],
                                         p_tokens bigint[], p_owners text[], p_hashes bytea[],
                                         p_retention_ms bigint[], p_wait_ms integer,
                                         p_payouts uuid[], p_expected text[],
                                         p_max_attempts integer, p_proven boolean)
RETURNS SETOF pay_claim_answer
LANGUAGE plpgsql AS $$
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
CREATE OR REPLACE FUNCTION pay_post_set(p_items integer[], p_routes text[], p_keys text[],
                                        p_tokens bigint[], p_owners text[], p_hashes bytea[],
                                        p_retention_ms bigint[], p_wait_ms integer,
                                        p_payouts uuid[], p_rail_references text[],
                                        p_submissions uuid[], p_proven boolean)
RETURNS SETOF pay_post_answer
LANGUAGE plpgsql AS $$
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

-- =============================================================================================
-- pay_claim_many and pay_post_many: the set path, and 0016's loop for the rest
-- =============================================================================================

CREATE OR REPLACE FUNCTION pay_claim_many(p_routes text[], p_keys text[], p_tokens bigint[],
                                          p_owners text[], p_hashes bytea[],
                                          p_retention_ms bigint[], p_wait_ms integer,
                                          p_payouts uuid[], p_expected text[],
                                          p_max_attempts integer, p_proven boolean)
RETURNS TABLE (item integer, begin_outcome text, response_status smallint, response_body bytea,
               outcome text, state text, fence bigint, attempt_count integer,
               claim_token bigint, account_id text, available_minor bigint, amount_minor bigint,
               error_state text, error_message text)
LANGUAGE plpgsql AS $$
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

CREATE OR REPLACE FUNCTION pay_post_many(p_routes text[], p_keys text[], p_tokens bigint[],
                                         p_owners text[], p_hashes bytea[],
                                         p_retention_ms bigint[], p_wait_ms integer,
                                         p_payouts uuid[], p_rail_references text[],
                                         p_submissions uuid[], p_proven boolean)
RETURNS TABLE (item integer, begin_outcome text, response_status smallint, response_body bytea,
               outcome text, state text, fence bigint, account_id text, balance_minor bigint,
               entries text, error_state text, error_message text)
LANGUAGE plpgsql AS $$
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
