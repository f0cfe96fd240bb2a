-- paydb 0023: the rail proxy admits the submissions that queued behind a running admission in
-- one statement and one commit, and records the answers of concurrent forwards the same way
-- (docs/design.md#group-commit).
--
-- rail_admit_many takes a batch's submissions as arrays (one element per item, in item order)
-- and answers one row per item, named by its 1-based place (`item`), with rail_admit's columns.
-- Each item is decided by rail_admit itself (0018's, with p_proven), so the decisions are exactly
-- rail_admit's: the mark, one attempt per payout, the intent row, a FENCED row for a stale token.
-- The rail proxy puts at most one item per payout and per account in a batch.
--
-- - Locks first, in key order: the batch's payouts, then the existing high-water rows of their
--   accounts. rail_admit alone locks a payout, then its account's mark; a batch takes every
--   payout before any mark, so batches and single admissions never wait on each other in a
--   cycle.
-- - Each item in its own subtransaction: an item that raises (the epoch guard, DL012, included)
--   is rolled back alone and answered outcome 'error' with its SQLSTATE and message; its
--   neighbours are decided and committed as if it had not been there.
--
-- Can run again on a database that already has it (OR REPLACE).

CREATE OR REPLACE FUNCTION rail_admit_many(p_payouts uuid[], p_accounts text[],
                                           p_amounts bigint[], p_currencies text[],
                                           p_beneficiaries text[], p_tokens bigint[],
                                           p_keys text[], p_submissions uuid[],
                                           p_requests text[], p_proven boolean)
RETURNS TABLE (item integer, outcome text, highest_token bigint, resource_type text,
               state text, submission_id uuid, submission_outcome text,
               response_status smallint, response_body bytea, error_state text,
               error_message text)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    i integer;
    r record;
    n integer := coalesce(cardinality(p_payouts), 0);
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

-- rail_record_many: the answers of forwards that finished while a record ran, recorded in one
-- statement and one commit. Each item is rail_record itself (0014's), in its own subtransaction
-- (an item that raises is rolled back alone and answered 'error' with its SQLSTATE and
-- message). Locks first, in key order: the batch's attempts, then their payouts, the order
-- rail_record alone takes them in.
CREATE OR REPLACE FUNCTION rail_record_many(p_submissions uuid[], p_outcomes text[],
                                            p_references text[])
RETURNS TABLE (item integer, outcome text, payout_id uuid, rail_reference text,
               submitted_at timestamptz, resolved_at timestamptz, error_state text,
               error_message text)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    i integer;
    r record;
    n integer := coalesce(cardinality(p_submissions), 0);
BEGIN
    IF n IS DISTINCT FROM coalesce(cardinality(p_outcomes), 0)
       OR n IS DISTINCT FROM coalesce(cardinality(p_references), 0) THEN
        RAISE EXCEPTION 'rail_record_many: the item arrays differ in length'
            USING ERRCODE = 'invalid_parameter_value';
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
