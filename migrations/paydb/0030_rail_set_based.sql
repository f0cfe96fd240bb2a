-- paydb 0030: the rail proxy's batches decided by the set (docs/design.md#group-commit).
--
-- rail_admit_many and rail_record_many ran each item of a batch through rail_admit and
-- rail_record, one subtransaction and half a dozen statements per item. They keep their
-- signatures and answers; a batch now goes through rail_admit_set and rail_record_set, which
-- make the same decisions for all its items in a few statements, and falls back to the item
-- loop when the set cannot take it:
--
-- - the set path needs every item on its own payout, its own account and its own idempotency
--   key and token (the rail proxy's batches are built that way), and every outcome a rail
--   outcome; it refuses anything else (invalid_parameter_value) before it writes;
-- - if the set path raises for any reason (an item a trigger refuses, the epoch guard), its
--   writes are rolled back as a whole and every item goes one by one through the loop, where an
--   item that raises is answered `error` alone and its neighbours are decided as if it had not
--   been there. A poisoned item never fails its neighbours.
--
-- Locks are taken in the order the loop takes them: the batch's payouts in key order, then the
-- high-water marks of their accounts (admission); the attempts, then their payouts (record).
--
-- Can run again on a database that already has it (OR REPLACE, IF NOT EXISTS).

DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_type WHERE typname = 'rail_admit_answer') THEN
        CREATE TYPE rail_admit_answer AS (
            item integer, outcome text, highest_token bigint, resource_type text, state text,
            submission_id uuid, submission_outcome text, response_status smallint,
            response_body bytea);
    END IF;
    IF NOT EXISTS (SELECT 1 FROM pg_type WHERE typname = 'rail_record_answer') THEN
        CREATE TYPE rail_record_answer AS (
            item integer, outcome text, payout_id uuid, rail_reference text,
            submitted_at timestamptz, resolved_at timestamptz);
    END IF;
END $$;

-- What rail_admit decides before it touches a mark, for each item (1-based `item`): the payout
-- does not exist (payout_unknown), the key and token were presented before (replay, or conflict
-- when the payout or the request differs), or the submission differs from the registered payout
-- (mismatch, `differs` naming the fields in the contract's spelling). `verdict` is NULL for an
-- item that goes on to the mark. `same_*` is the earlier attempt under this key and token.
CREATE OR REPLACE FUNCTION rail_admit_read(p_payouts uuid[], p_accounts text[],
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

-- rail_admit (0017, with 0018's max_seen_token) for a whole batch: the same outcome for each
-- item, the same rows written. One answer per item, in item order.
CREATE OR REPLACE FUNCTION rail_admit_set(p_payouts uuid[], p_accounts text[],
                                          p_amounts bigint[], p_currencies text[],
                                          p_beneficiaries text[], p_tokens bigint[],
                                          p_keys text[], p_submissions uuid[],
                                          p_requests text[], p_proven boolean)
RETURNS SETOF rail_admit_answer
LANGUAGE plpgsql AS $$
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

-- As 0023, with the set path first.
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

-- rail_record (0014) for a whole batch: each attempt still unresolved gets its outcome and its
-- payout leaves SUBMITTING; a timed-out attempt keeps a rail answer as its late answer; every
-- item is answered with its attempt as it then stands. One answer per item, in item order.
CREATE OR REPLACE FUNCTION rail_record_set(p_submissions uuid[], p_outcomes text[],
                                           p_references text[])
RETURNS SETOF rail_record_answer
LANGUAGE plpgsql AS $$
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

-- As 0023, with the set path first.
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
