-- paydb 0033: registrations are group-committed like claims and posts (docs/design.md#group-commit).
--
-- A run registers its batch's payouts 32 at a time, each `POST /v1/payouts` in a transaction of
-- its own: five round trips and a commit per payout. In a new user's `dlock run -f` of 1 500
-- payouts the registrations took the first 1.4 s of a 4.6 s run, and the payouts paid while
-- they ran went at a quarter of the rate that followed. pay_create_many takes the registrations
-- that queued while the previous one's transaction ran, in one call and one transaction.
--
-- Each item makes the decisions of the single path, by the same functions: its idempotency
-- record (pay_idempotency_begin) and, when fresh, the payout (pay_create_payout, whose insert
-- fires the same row triggers and checks: the account's largest single payout among them). Each
-- item runs in a subtransaction of its own: an item that raises (a limit, a duplicate still in
-- flight past the wait) is rolled back alone and answered `error`, and the service runs it again
-- on the single path, which answers it as it always has. Nothing else of the batch is lost.
--
-- Lock order: the items run in account order, then payout order. A payout's insert key-share
-- locks its account (the foreign key), and a claim locks accounts for update in account order
-- (pay_claim_many, pay_claim_once one account at a time): two batches that touch the same
-- accounts never wait on each other in a cycle.
--
-- outcome per item: begin_outcome is fresh | replay | conflict | not_found | error; for fresh,
-- outcome is pay_create_payout's (created | exists | conflict | currency_mismatch); not_found is
-- an unknown account, rolled back alone like a raise, as the single path keeps nothing of it;
-- for error, error_state and error_message.
--
-- Can run again (OR REPLACE; the SET clause is said here, docs in 0032).

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
AS $$
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
