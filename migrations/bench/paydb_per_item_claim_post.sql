-- Not a migration: pay_claim_many and pay_post_many as they were before the set path
-- (pay_claim_set, pay_post_set in migrations/paydb/0040_baseline_idempotency_and_rail.sql), each
-- item through pay_claim_once (pay_post_once) in a subtransaction of its own. The payouts bench
-- (services/executor/benches/payouts.rs, --group-commit) puts them back on a second database,
-- with the ledger's row triggers, so that one run compares both SQL paths on the same server.
-- They take the row locks in key order for the whole set first, as the set path does. CREATE OR
-- REPLACE: the bench runs this file on a database migrated to the baseline.

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
