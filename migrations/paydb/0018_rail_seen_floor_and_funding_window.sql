-- paydb 0018: the rail high-water's seen-token floor, and a large funding that cannot be split
-- under the dual-approval threshold.
--
-- 1. The rail proxy's high-water mark gets the account fence's floor (0014): rail_high_water.
--    max_seen_token is the highest token the rail proxy admitted a submission with whose proof it
--    verified, a CHECK keeps highest_token at or above it, and it never goes down. The
--    lowering (rail_lower_high_water) refuses a token under it ('below_seen': nothing changes,
--    nothing is recorded), so an old, released grant's proof cannot readmit the submissions
--    between it and a token that was used. A mark raised by a revocation floor (docs/design.md#d-3) or by a
--    token admitted without a proof still comes down to a fresh proven grant.
--
-- 2. The threshold of docs/contract.md#dual-approval applies to what one treasury identity funds
--    on an account on its own word in a rolling 24 hours, not to one funding alone:
--    pay_fund_as, under the account row lock, adds the funding to what the same identity
--    funded there in the 24 hours before (direct_fundings) and records it in pending_fundings
--    for a second treasury identity when the sum would pass the threshold. Before, one identity
--    funded T, T, T... each applied at once. A funding a second identity approved does not
--    count: two people saw it.
--
-- Like 0013 to 0017, this file can run again on a database that already has its changes.

-- =============================================================================================
-- 1. The highest proven token the rail proxy admitted
-- =============================================================================================

ALTER TABLE rail_high_water
    ADD COLUMN IF NOT EXISTS max_seen_token bigint NOT NULL DEFAULT 0
        CONSTRAINT rail_high_water_max_seen_token_check CHECK (max_seen_token >= 0);
ALTER TABLE rail_high_water DROP CONSTRAINT IF EXISTS rail_high_water_covers_seen_check;
-- A mark below a token the proxy admitted would admit again the holders between the two: a
-- recovery may lower it to that token, never under it.
ALTER TABLE rail_high_water
    ADD CONSTRAINT rail_high_water_covers_seen_check CHECK (highest_token >= max_seen_token);

-- The seen mark only rises; it records what happened and has no recovery.
CREATE OR REPLACE FUNCTION pay_rail_seen_guard() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'rail_high_water.max_seen_token of % may not go down (% -> %)',
        OLD.account_id, OLD.max_seen_token, NEW.max_seen_token
        USING ERRCODE = 'check_violation';
END $$;
DROP TRIGGER IF EXISTS rail_high_water_seen_guard ON rail_high_water;
CREATE TRIGGER rail_high_water_seen_guard BEFORE UPDATE OF max_seen_token ON rail_high_water
    FOR EACH ROW WHEN (NEW.max_seen_token < OLD.max_seen_token)
    EXECUTE FUNCTION pay_rail_seen_guard();

-- rail_admit as 0017 has it, and p_proven: whether the rail proxy verified the token's proof
-- (with proof keys configured every submission is proven before it reaches here). An admitted
-- proven submission raises max_seen_token to its token in the same transaction, under the row
-- lock rail_admit took. The 9-argument rail_admit stays (a proxy of the previous release during
-- a rollout calls it and records nothing); this one wraps it, so a later change of admission
-- there is a change here too.
CREATE OR REPLACE FUNCTION rail_admit(p_payout uuid, p_account text, p_amount bigint,
                                      p_currency text, p_beneficiary text, p_token bigint,
                                      p_key text, p_submission uuid, p_request text,
                                      p_proven boolean)
RETURNS TABLE (outcome text, highest_token bigint, resource_type text, state text,
               submission_id uuid, submission_outcome text, response_status smallint,
               response_body bytea)
LANGUAGE plpgsql AS $$
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

-- docs/design.md#d-8: the rail proxy's recovery of a poisoned high-water mark, as in 0012, and now never under
-- max_seen_token. outcome: lowered | unchanged (the mark is already at or below p_to: nothing to
-- do, nothing recorded) | below_seen (p_to is below a proven token the proxy admitted: nothing
-- changed, nothing recorded) | not_found. seen_token is the mark's max_seen_token.
DROP FUNCTION IF EXISTS rail_lower_high_water(text, bigint, text, text, text, text);
CREATE OR REPLACE FUNCTION rail_lower_high_water(p_account text, p_to bigint, p_operator text,
                                                 p_identity text, p_owner text, p_reason text)
RETURNS TABLE (outcome text, previous_token bigint, highest_token bigint, recovery_id bigint,
               seen_token bigint)
LANGUAGE plpgsql AS $$
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
-- 2. What one treasury identity funds on its own word, per account and 24 hours
-- =============================================================================================

-- Every funding applied without a second approval, with the treasury identity that asked for
-- it (its credential's identity). The ledger's `fund:<reference>` pair is the money; this row
-- is who put it there alone, and the window pay_fund_as sums.
CREATE TABLE IF NOT EXISTS direct_fundings (
    reference    text PRIMARY KEY CHECK (char_length(reference) BETWEEN 1 AND 128),
    account_id   text NOT NULL REFERENCES accounts,
    amount_minor bigint NOT NULL CHECK (amount_minor > 0),
    funded_by    text NOT NULL CHECK (char_length(funded_by) BETWEEN 1 AND 320),
    funded_at    timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE INDEX IF NOT EXISTS direct_fundings_window_idx
    ON direct_fundings (account_id, funded_by, funded_at);

-- The window is only as good as its rows: none is changed or deleted.
CREATE OR REPLACE FUNCTION pay_direct_fundings_guard() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'direct_fundings keeps every row as written (%)', TG_OP
        USING ERRCODE = 'check_violation';
END $$;
DROP TRIGGER IF EXISTS direct_fundings_guard ON direct_fundings;
CREATE TRIGGER direct_fundings_guard BEFORE UPDATE OR DELETE ON direct_fundings
    FOR EACH ROW EXECUTE FUNCTION pay_direct_fundings_guard();
DROP TRIGGER IF EXISTS direct_fundings_no_truncate ON direct_fundings;
CREATE TRIGGER direct_fundings_no_truncate BEFORE TRUNCATE ON direct_fundings
    FOR EACH STATEMENT EXECUTE FUNCTION pay_direct_fundings_guard();

-- A treasury identity's funding (`POST /v1/accounts/{accountId}/fund`), applied or recorded for a
-- second approval, decided here under the account row lock: two fundings of one account are
-- decided one after the other, and the second sees the first. p_threshold is the payment
-- resource's auth.treasury.dual-approval-above (NULL: every funding applies at once).
-- `outcome`:
--   funded       applied now (ledger pair, direct_fundings row);
--   exists       the reference was applied before with this account and amount (nothing new);
--   pending      recorded now in pending_fundings, or found there with this account and amount
--                (approved_by says whether a second identity applied it since);
--   conflict     the reference names another funding; not_found; not_customer.
-- window_minor is what p_identity funded on the account alone in the 24 hours before, without
-- this funding.
CREATE OR REPLACE FUNCTION pay_fund_as(p_funding_id uuid, p_account_id text, p_amount bigint,
                                       p_reference text, p_identity text, p_threshold bigint)
RETURNS TABLE (outcome text, balance_minor bigint, funding_id uuid, requested_by text,
               approved_by text, window_minor bigint)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    acct accounts%ROWTYPE;
    prior pending_fundings%ROWTYPE;
    v_window numeric;
    funded record;
BEGIN
    SELECT * INTO acct FROM accounts a WHERE a.account_id = p_account_id FOR UPDATE;
    IF NOT FOUND THEN
        RETURN QUERY SELECT 'not_found'::text, NULL::bigint, NULL::uuid, NULL::text, NULL::text,
                            NULL::bigint;
        RETURN;
    END IF;
    IF acct.kind <> 'customer' THEN
        RETURN QUERY SELECT 'not_customer'::text, NULL::bigint, NULL::uuid, NULL::text,
                            NULL::text, NULL::bigint;
        RETURN;
    END IF;
    -- A reference that waits (or waited) for a second approval answers as it is.
    SELECT * INTO prior FROM pending_fundings f WHERE f.reference = p_reference;
    IF FOUND THEN
        IF prior.account_id = p_account_id AND prior.amount_minor = p_amount THEN
            RETURN QUERY SELECT 'pending'::text, acct.balance_minor, prior.funding_id,
                                prior.requested_by, prior.approved_by, NULL::bigint;
        ELSE
            RETURN QUERY SELECT 'conflict'::text, NULL::bigint, prior.funding_id, NULL::text,
                                NULL::text, NULL::bigint;
        END IF;
        RETURN;
    END IF;
    -- A reference applied before: pay_fund answers exists or conflict and writes nothing.
    IF EXISTS (SELECT 1 FROM ledger_entries e WHERE e.reference = 'fund:' || p_reference) THEN
        SELECT * INTO funded FROM pay_fund(p_account_id, p_amount, p_reference);
        RETURN QUERY SELECT funded.outcome, funded.balance_minor, NULL::uuid, NULL::text,
                            NULL::text, NULL::bigint;
        RETURN;
    END IF;
    -- The sum is read after the row lock was granted, so it includes every funding of the
    -- account that committed before (read committed: each statement sees what committed).
    SELECT coalesce(sum(d.amount_minor), 0) INTO v_window FROM direct_fundings d
     WHERE d.account_id = p_account_id AND d.funded_by = p_identity
       AND d.funded_at > clock_timestamp() - interval '24 hours';
    IF p_threshold IS NOT NULL AND v_window + p_amount > p_threshold THEN
        INSERT INTO pending_fundings (funding_id, account_id, amount_minor, reference,
                                      requested_by)
        VALUES (p_funding_id, p_account_id, p_amount, p_reference, p_identity);
        RETURN QUERY SELECT 'pending'::text, acct.balance_minor, p_funding_id, p_identity,
                            NULL::text, least(v_window, 9223372036854775807)::bigint;
        RETURN;
    END IF;
    SELECT * INTO funded FROM pay_fund(p_account_id, p_amount, p_reference);
    IF funded.outcome <> 'funded' THEN
        RAISE EXCEPTION 'funding % of % did not apply: pay_fund answered %', p_reference,
            p_account_id, funded.outcome USING ERRCODE = 'check_violation';
    END IF;
    INSERT INTO direct_fundings (reference, account_id, amount_minor, funded_by)
    VALUES (p_reference, p_account_id, p_amount, p_identity);
    RETURN QUERY SELECT 'funded'::text, funded.balance_minor, NULL::uuid, NULL::text, NULL::text,
                        least(v_window, 9223372036854775807)::bigint;
END $$;
