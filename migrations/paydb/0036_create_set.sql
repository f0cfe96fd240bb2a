-- paydb 0036: a batch of registrations is written by the set (docs/design.md#group-commit).
--
-- pay_create_many (0033) decided each registration of a batch by the single path's functions,
-- each in a subtransaction of its own: per payout a savepoint, pay_idempotency_begin,
-- pay_create_payout and an INSERT of one row whose statement triggers ran once per payout. In a
-- new user's `dlock run -f` of 1 500 payouts these were the largest share of paydb's time after
-- the rail's and the posts' set functions (pay_create_payout 350 ms and pay_idempotency_begin
-- 277 ms of function time, 1 500 calls each, measured with track_functions).
--
-- pay_create_many now makes the same decisions for the whole batch in a few statements: the
-- idempotency records (pay_idempotency_begin_set, as the claims and posts do), one INSERT of the
-- new payouts, one read of the answers. The decisions are pay_create_payout's, in its order:
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
-- one by one in a subtransaction of its own, as in 0033 (that function, renamed
-- pay_create_one_by_one): the item over its limit fails alone. Two items of one payout or of one
-- idempotency key, and an item whose record vanished between its insert and its read, also go
-- one by one (the second sees the first's effect, as it would a moment later).
--
-- Lock order: pay_create_many key-share locks the batch's accounts in key order before anything
-- else. A payout's insert key-share locks its account (the foreign key) and a claim locks
-- accounts for update in key order, so a batch whose set part and one-by-one part touch
-- different accounts cannot wait on a claim in a cycle.
--
-- Can run again (OR REPLACE; the type only when missing). The SET clauses are those every paydb
-- function carries (0032, 0035).

DO $$
BEGIN
    IF to_regtype('pay_create_answer') IS NULL THEN
        CREATE TYPE pay_create_answer AS (
            item integer, begin_outcome text, response_status smallint, response_body bytea,
            outcome text, error_state text, error_message text);
    END IF;
END $$;

-- 0033's pay_create_many, which runs each item in a subtransaction of its own, is kept under
-- another name for the items that do not go by the set.
DO $$
BEGIN
    IF to_regproc('pay_create_one_by_one') IS NULL THEN
        ALTER FUNCTION pay_create_many(text[], text[], bigint[], text[], bytea[], bigint[],
                                       integer, uuid[], text[], bigint[], text[], text[])
            RENAME TO pay_create_one_by_one;
    END IF;
END $$;

-- outcome per item: as in 0033.
CREATE OR REPLACE FUNCTION pay_create_many(p_routes text[], p_keys text[], p_tokens bigint[],
                                           p_owners text[], p_hashes bytea[],
                                           p_retention_ms bigint[], p_wait_ms integer,
                                           p_payouts uuid[], p_accounts text[],
                                           p_amounts bigint[], p_currencies text[],
                                           p_beneficiaries text[])
RETURNS TABLE (item integer, begin_outcome text, response_status smallint, response_body bytea,
               outcome text, error_state text, error_message text)
LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
SET jit = off
AS $$
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
