-- paydb 0016: claims and posts by the set, for the payment resource's group commit
-- (docs/design.md#group-commit).
--
-- The payment resource runs the claims (and the posts) that queued while its previous
-- transaction ran as one transaction: one call of pay_claim_many (pay_post_many), one statement
-- that stores every answer, one commit. These functions make the same decisions as the per-row
-- functions, which stay for a lone request and for operator writes, because they call them:
-- each item is pay_claim_once (pay_post_once) with its own idempotency record, token, proof
-- flag and outcome. What they add:
--
-- 1. Locks in key order for the whole set before any item runs: the payouts by id, then their
--    accounts by id, then (posts) the settlement shards the postings will update, by account and
--    shard. Two batches, or a batch and a single write (which locks payout -> account -> system
--    account), then wait for each other instead of deadlocking.
-- 2. Items of one account run highest token first: a stale holder and a newer one in the same
--    batch leave the stale one FENCED_OUT whichever arrived first, as they would if the newer
--    one had committed before.
-- 3. Each item runs in its own subtransaction (a BEGIN ... EXCEPTION block). An item that raises
--    (a CHECK, a trigger, an account limit, the bounded wait on a duplicate's idempotency record)
--    is rolled back alone, record included, and answered as `error` with its SQLSTATE: the
--    service runs it again on the single path after the batch commits, so it never fails its
--    neighbours. An item whose payout does not exist is rolled back the same way (its
--    idempotency record is not kept, as the single path keeps none for a 404) and answered
--    `not_found`.
--
-- Every money-moving write is still the per-row function's conditional write (fence < token,
-- state checks, the funds check under the row locks), checked by the same constraints and
-- triggers. Nothing here changes a table.
--
-- Like 0013 and 0014, this file can run again on a database that already has its changes
-- (CREATE OR REPLACE).

-- outcome per item: as pay_claim_once's columns, with begin_outcome one of fresh | replay |
-- conflict | not_found | error; error_state and error_message for `error`.
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
    FOR i IN
        SELECT t.n FROM unnest(p_payouts, p_tokens) WITH ORDINALITY AS t(payout_id, token, n)
          LEFT JOIN payouts x ON x.payout_id = t.payout_id
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
    -- The settlement shards the postings will update (pay_ledger_apply), when they exist; a
    -- shard's first posting inserts it.
    PERFORM 1 FROM account_balance_shards s
     WHERE (s.account_id, s.shard) IN (
            SELECT 'rail-settlement-' || x.currency, pay_balance_shard(x.payout_id, NULL)
              FROM payouts x WHERE x.payout_id = ANY (p_payouts))
     ORDER BY s.account_id, s.shard FOR UPDATE OF s;
    FOR i IN
        SELECT t.n FROM unnest(p_payouts, p_tokens) WITH ORDINALITY AS t(payout_id, token, n)
          LEFT JOIN payouts x ON x.payout_id = t.payout_id
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
CREATE OR REPLACE FUNCTION pay_idempotency_finish_many(p_routes text[], p_keys text[],
                                                       p_tokens bigint[], p_statuses smallint[],
                                                       p_bodies bytea[])
RETURNS integer LANGUAGE plpgsql AS $$
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
