-- paydb 0015: limits on what leaves an account, and a second treasury identity for a large
-- funding (docs/contract.md#account-limits, docs/contract.md#dual-approval).
--
-- 1. Per-account limits, set by the treasury: the largest single payout and the outflow per UTC
--    day. Money leaves an account when a payout is claimed (PENDING -> CLAIMED takes the hold the
--    rail then pays from), so the check sits on that transition, in a trigger on payouts: every
--    claim path (pay_claim, pay_claim_bounded, pay_claim_once and whatever calls them later)
--    passes it. A payout above the single-payout limit is also refused when it is registered.
--    A refusal raises check_violation with a constraint name account_limits_*, which rolls back
--    the whole transaction (the fence advance and the idempotency record of the claim included):
--    nothing changes, and the payment resource answers 422 LIMIT_EXCEEDED.
-- 2. Pending fundings: a funding above the payment resource's auth.treasury.dual-approval-above
--    is recorded here, not applied; a second, different treasury identity approves it, and the
--    approval and the funding commit together, once (a conditional update; a CHECK keeps the
--    approver apart from the requester).
--
-- Like 0013 and 0014, this file can run again on a database that already has its changes.

-- =============================================================================================
-- 1. Per-account limits
-- =============================================================================================

CREATE TABLE IF NOT EXISTS account_limits (
    account_id          text PRIMARY KEY REFERENCES accounts,
    -- The largest amount of one payout, minor units; NULL: no limit.
    max_payout_minor    bigint CONSTRAINT account_limits_max_payout_positive
                        CHECK (max_payout_minor > 0),
    -- The most the account's claims may take in one UTC day, minor units; NULL: no limit.
    daily_outflow_minor bigint CONSTRAINT account_limits_daily_outflow_positive
                        CHECK (daily_outflow_minor > 0),
    -- The treasury identity that set them, as its credential proved it.
    set_by              text NOT NULL CHECK (char_length(set_by) BETWEEN 1 AND 320),
    updated_at          timestamptz NOT NULL DEFAULT clock_timestamp()
);

-- What each account's claims took per UTC day: a claim (PENDING -> CLAIMED) adds its amount. A
-- re-claim (CLAIMED -> CLAIMED) holds nothing new and adds nothing; a claimed payout that later
-- fails or is abandoned still counts for its day (the limit bounds what was let out towards the
-- rail, not what finally settled).
CREATE TABLE IF NOT EXISTS account_daily_outflow (
    account_id    text NOT NULL REFERENCES accounts,
    day           date NOT NULL,
    claimed_minor bigint NOT NULL CHECK (claimed_minor > 0),
    PRIMARY KEY (account_id, day)
);

-- The limits of a payout leaving its account. On INSERT (registration) only the single-payout
-- limit applies; on PENDING -> CLAIMED both do, and the day's outflow grows by the amount in the
-- same statement, under the account row lock every claim takes first (so two claims of one
-- account cannot both pass on the same remainder).
CREATE OR REPLACE FUNCTION pay_payouts_limits() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    lim account_limits%ROWTYPE;
    today date := (clock_timestamp() AT TIME ZONE 'UTC')::date;
    total bigint;
BEGIN
    SELECT * INTO lim FROM account_limits l WHERE l.account_id = NEW.account_id;
    IF FOUND AND lim.max_payout_minor IS NOT NULL AND NEW.amount_minor > lim.max_payout_minor THEN
        RAISE EXCEPTION 'payout % of % is above the account''s largest single payout %',
            NEW.payout_id, NEW.amount_minor, lim.max_payout_minor
            USING ERRCODE = 'check_violation', CONSTRAINT = 'account_limits_max_payout',
                  DETAIL = json_build_object('limit', 'maxPayoutMinor',
                                             'accountId', NEW.account_id,
                                             'amountMinor', NEW.amount_minor,
                                             'limitMinor', lim.max_payout_minor)::text;
    END IF;
    IF TG_OP = 'INSERT' THEN
        RETURN NEW;
    END IF;
    INSERT INTO account_daily_outflow AS o (account_id, day, claimed_minor)
    VALUES (NEW.account_id, today, NEW.amount_minor)
    ON CONFLICT (account_id, day)
        DO UPDATE SET claimed_minor = o.claimed_minor + EXCLUDED.claimed_minor
    RETURNING o.claimed_minor INTO total;
    IF FOUND AND lim.daily_outflow_minor IS NOT NULL AND total > lim.daily_outflow_minor THEN
        RAISE EXCEPTION 'claiming payout % (%) would take % out of account % on %, above its daily outflow limit %',
            NEW.payout_id, NEW.amount_minor, total, NEW.account_id, today, lim.daily_outflow_minor
            USING ERRCODE = 'check_violation', CONSTRAINT = 'account_limits_daily_outflow',
                  DETAIL = json_build_object('limit', 'dailyOutflowMinor',
                                             'accountId', NEW.account_id,
                                             'amountMinor', NEW.amount_minor,
                                             'limitMinor', lim.daily_outflow_minor,
                                             'outflowMinor', total - NEW.amount_minor,
                                             'day', today)::text;
    END IF;
    RETURN NEW;
END $$;
DROP TRIGGER IF EXISTS payouts_limits_register ON payouts;
CREATE TRIGGER payouts_limits_register BEFORE INSERT ON payouts
    FOR EACH ROW EXECUTE FUNCTION pay_payouts_limits();
DROP TRIGGER IF EXISTS payouts_limits_claim ON payouts;
-- The WHEN clause keeps the function off every other transition (a re-claim, submit, post,
-- resolve, cancel).
CREATE TRIGGER payouts_limits_claim BEFORE UPDATE OF state ON payouts
    FOR EACH ROW WHEN (OLD.state = 'PENDING' AND NEW.state = 'CLAIMED')
    EXECUTE FUNCTION pay_payouts_limits();

-- Sets (or clears, with NULL) an account's limits; `outcome`: set | not_found | not_customer.
CREATE OR REPLACE FUNCTION pay_set_limits(p_account_id text, p_max_payout bigint,
                                          p_daily_outflow bigint, p_identity text)
RETURNS TABLE (outcome text, max_payout_minor bigint, daily_outflow_minor bigint,
               set_by text, updated_at timestamptz)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    acct accounts%ROWTYPE;
BEGIN
    SELECT * INTO acct FROM accounts a WHERE a.account_id = p_account_id FOR UPDATE;
    IF NOT FOUND THEN
        RETURN QUERY SELECT 'not_found'::text, NULL::bigint, NULL::bigint, NULL::text,
                            NULL::timestamptz;
        RETURN;
    END IF;
    IF acct.kind <> 'customer' THEN
        RETURN QUERY SELECT 'not_customer'::text, NULL::bigint, NULL::bigint, NULL::text,
                            NULL::timestamptz;
        RETURN;
    END IF;
    RETURN QUERY
    INSERT INTO account_limits AS l (account_id, max_payout_minor, daily_outflow_minor, set_by)
    VALUES (p_account_id, p_max_payout, p_daily_outflow, p_identity)
    ON CONFLICT (account_id) DO UPDATE
        SET max_payout_minor = EXCLUDED.max_payout_minor,
            daily_outflow_minor = EXCLUDED.daily_outflow_minor,
            set_by = EXCLUDED.set_by,
            updated_at = clock_timestamp()
    RETURNING 'set'::text, l.max_payout_minor, l.daily_outflow_minor, l.set_by, l.updated_at;
END $$;

-- =============================================================================================
-- 2. Pending fundings and their second approval
-- =============================================================================================

CREATE TABLE IF NOT EXISTS pending_fundings (
    funding_id   uuid PRIMARY KEY,
    account_id   text NOT NULL REFERENCES accounts,
    amount_minor bigint NOT NULL CHECK (amount_minor > 0),
    -- The funding's reference: applied, it is the ledger's `fund:<reference>`, so it names one
    -- funding for good.
    reference    text NOT NULL UNIQUE CHECK (char_length(reference) BETWEEN 1 AND 128),
    requested_by text NOT NULL CHECK (char_length(requested_by) BETWEEN 1 AND 320),
    requested_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    approved_by  text CHECK (char_length(approved_by) BETWEEN 1 AND 320),
    approved_at  timestamptz,
    -- Two people: the approver is never the requester, whatever wrote the row.
    CONSTRAINT pending_fundings_second_identity
        CHECK (approved_by IS NULL OR approved_by <> requested_by),
    CONSTRAINT pending_fundings_approved_at
        CHECK ((approved_by IS NULL) = (approved_at IS NULL))
);

-- A pending funding is approved once and then never changes; no row is deleted.
CREATE OR REPLACE FUNCTION pay_pending_fundings_guard() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP <> 'UPDATE' THEN
        RAISE EXCEPTION 'pending_fundings keeps every row (%)', TG_OP
            USING ERRCODE = 'check_violation';
    END IF;
    IF OLD.approved_by IS NOT NULL
       OR (NEW.funding_id, NEW.account_id, NEW.amount_minor, NEW.reference, NEW.requested_by,
           NEW.requested_at)
          IS DISTINCT FROM (OLD.funding_id, OLD.account_id, OLD.amount_minor, OLD.reference,
                            OLD.requested_by, OLD.requested_at) THEN
        RAISE EXCEPTION 'pending funding % may only be approved, once', OLD.funding_id
            USING ERRCODE = 'check_violation';
    END IF;
    RETURN NEW;
END $$;
DROP TRIGGER IF EXISTS pending_fundings_guard ON pending_fundings;
CREATE TRIGGER pending_fundings_guard BEFORE UPDATE OR DELETE ON pending_fundings
    FOR EACH ROW EXECUTE FUNCTION pay_pending_fundings_guard();
DROP TRIGGER IF EXISTS pending_fundings_no_truncate ON pending_fundings;
CREATE TRIGGER pending_fundings_no_truncate BEFORE TRUNCATE ON pending_fundings
    FOR EACH STATEMENT EXECUTE FUNCTION pay_pending_fundings_guard();

-- Records a funding that waits for a second approval. `outcome`: pending (recorded now) |
-- exists (the same account, amount and reference already wait, or were approved) | conflict (the
-- reference names another funding, pending or applied) | not_found | not_customer.
CREATE OR REPLACE FUNCTION pay_request_funding(p_funding_id uuid, p_account_id text,
                                               p_amount bigint, p_reference text,
                                               p_identity text)
RETURNS TABLE (outcome text, funding_id uuid, requested_by text, approved_by text)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    acct accounts%ROWTYPE;
    prior pending_fundings%ROWTYPE;
BEGIN
    SELECT * INTO acct FROM accounts a WHERE a.account_id = p_account_id FOR UPDATE;
    IF NOT FOUND THEN
        RETURN QUERY SELECT 'not_found'::text, NULL::uuid, NULL::text, NULL::text;
        RETURN;
    END IF;
    IF acct.kind <> 'customer' THEN
        RETURN QUERY SELECT 'not_customer'::text, NULL::uuid, NULL::text, NULL::text;
        RETURN;
    END IF;
    SELECT * INTO prior FROM pending_fundings f WHERE f.reference = p_reference;
    IF FOUND THEN
        IF prior.account_id = p_account_id AND prior.amount_minor = p_amount THEN
            RETURN QUERY SELECT 'exists'::text, prior.funding_id, prior.requested_by,
                                prior.approved_by;
        ELSE
            RETURN QUERY SELECT 'conflict'::text, prior.funding_id, NULL::text, NULL::text;
        END IF;
        RETURN;
    END IF;
    IF EXISTS (SELECT 1 FROM ledger_entries e WHERE e.reference = 'fund:' || p_reference) THEN
        RETURN QUERY SELECT 'conflict'::text, NULL::uuid, NULL::text, NULL::text;
        RETURN;
    END IF;
    INSERT INTO pending_fundings (funding_id, account_id, amount_minor, reference, requested_by)
    VALUES (p_funding_id, p_account_id, p_amount, p_reference, p_identity);
    RETURN QUERY SELECT 'pending'::text, p_funding_id, p_identity, NULL::text;
END $$;

-- The second approval (`POST /v1/fundings/{fundingId}/approve`): marks the funding approved by p_identity (only if it is still pending
-- and p_identity is not its requester: one conditional update) and applies it with pay_fund in
-- the same transaction. `outcome`: approved | not_found (no such funding of this account) |
-- same_identity | already_approved (by `approved_by`). A pay_fund that does not fund raises, so
-- an approval never stands without its funding.
CREATE OR REPLACE FUNCTION pay_approve_funding(p_funding_id uuid, p_identity text)
RETURNS TABLE (outcome text, account_id text, amount_minor bigint, reference text,
               requested_by text, approved_by text, balance_minor bigint)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    f pending_fundings%ROWTYPE;
    funded record;
BEGIN
    UPDATE pending_fundings x SET approved_by = p_identity, approved_at = clock_timestamp()
     WHERE x.funding_id = p_funding_id
       AND x.approved_by IS NULL AND x.requested_by <> p_identity
    RETURNING * INTO f;
    IF NOT FOUND THEN
        SELECT * INTO f FROM pending_fundings x WHERE x.funding_id = p_funding_id;
        IF NOT FOUND THEN
            RETURN QUERY SELECT 'not_found'::text, NULL::text, NULL::bigint, NULL::text,
                                NULL::text, NULL::text, NULL::bigint;
        ELSIF f.approved_by IS NOT NULL THEN
            RETURN QUERY SELECT 'already_approved'::text, f.account_id, f.amount_minor,
                                f.reference, f.requested_by, f.approved_by, NULL::bigint;
        ELSE
            RETURN QUERY SELECT 'same_identity'::text, f.account_id, f.amount_minor,
                                f.reference, f.requested_by, NULL::text, NULL::bigint;
        END IF;
        RETURN;
    END IF;
    SELECT * INTO funded FROM pay_fund(f.account_id, f.amount_minor, f.reference);
    IF funded.outcome <> 'funded' THEN
        RAISE EXCEPTION 'approved funding % did not apply: pay_fund answered %', p_funding_id,
            funded.outcome USING ERRCODE = 'check_violation';
    END IF;
    RETURN QUERY SELECT 'approved'::text, f.account_id, f.amount_minor, f.reference,
                        f.requested_by, f.approved_by, funded.balance_minor;
END $$;
