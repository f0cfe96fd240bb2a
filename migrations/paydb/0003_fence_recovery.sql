-- Recovery of an account poisoned by a forged fencing token (DESIGN D-8).
--
-- Before proofs, any authenticated caller could present a token far above anything the lock
-- server had issued; the account fence and the rail high-water mark took it, and since both only
-- rise, every real holder was FENCED_OUT for good. Proofs stop new forgeries. This is the way out
-- for an account poisoned before them: an operator, holding a fresh grant on the account's key
-- (which the lock server issues only while nobody else holds it, and above every token issued
-- before), lowers the fence and the mark to that grant's token. Every lowering is recorded here,
-- append-only, in the same transaction, and the guards below refuse a lowering that has no such
-- record: no code path can lower a fence quietly.

CREATE TABLE fence_recoveries (
    recovery_id     bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    -- account: accounts.fence (payment resource); rail: rail_high_water (rail proxy).
    resource        text NOT NULL CHECK (resource IN ('account', 'rail')),
    account_id      text NOT NULL REFERENCES accounts,
    previous_token  bigint NOT NULL,
    -- The token of the operator's grant on payout:{account_id}.
    new_token       bigint NOT NULL CHECK (new_token > 0 AND new_token < previous_token),
    -- Who asked (the body's operator), on whose credential (the authenticated identity), in
    -- whose name (X-Owner-Id), and why.
    operator        text NOT NULL CHECK (char_length(operator) BETWEEN 1 AND 128),
    identity        text NOT NULL CHECK (char_length(identity) BETWEEN 1 AND 256),
    owner_id        text NOT NULL CHECK (char_length(owner_id) BETWEEN 1 AND 64),
    reason          text NOT NULL CHECK (char_length(reason) BETWEEN 8 AND 4096),
    -- The transaction that lowered the mark; the guards look for it.
    xact_id         xid8 NOT NULL DEFAULT pg_current_xact_id(),
    recorded_at     timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE INDEX fence_recoveries_account_idx ON fence_recoveries (account_id, recorded_at);
CREATE TRIGGER fence_recoveries_append_only BEFORE UPDATE OR DELETE OR TRUNCATE ON fence_recoveries
    FOR EACH STATEMENT EXECUTE FUNCTION pay_append_only();

-- Whether this transaction recorded the lowering of `resource` of `account` from `old` to `new`.
CREATE FUNCTION pay_recovery_recorded(p_resource text, p_account text, p_old bigint, p_new bigint)
RETURNS boolean LANGUAGE sql STABLE AS $$
    SELECT EXISTS (SELECT 1 FROM fence_recoveries r
                   WHERE r.resource = p_resource AND r.account_id = p_account
                     AND r.previous_token = p_old AND r.new_token = p_new
                     AND r.xact_id = pg_current_xact_id());
$$;

-- The account guard of 0001, with one exception: a lowering recorded in fence_recoveries by the
-- same transaction.
CREATE OR REPLACE FUNCTION pay_accounts_guard() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.fence < OLD.fence
       AND NOT pay_recovery_recorded('account', OLD.account_id, OLD.fence, NEW.fence) THEN
        RAISE EXCEPTION 'accounts.fence of % may not go down (% -> %)',
            OLD.account_id, OLD.fence, NEW.fence USING ERRCODE = 'check_violation';
    END IF;
    IF NEW.account_id <> OLD.account_id OR NEW.currency <> OLD.currency OR NEW.kind <> OLD.kind THEN
        RAISE EXCEPTION 'account % may not change its id, currency or kind', OLD.account_id
            USING ERRCODE = 'check_violation';
    END IF;
    NEW.updated_at := clock_timestamp();
    RETURN NEW;
END $$;

-- The rail high-water mark had no guard in the database, only in rail_admit; it gets the same
-- one as the account fence.
CREATE FUNCTION pay_rail_high_water_guard() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.highest_token < OLD.highest_token
       AND NOT pay_recovery_recorded('rail', OLD.account_id, OLD.highest_token, NEW.highest_token) THEN
        RAISE EXCEPTION 'rail_high_water of % may not go down (% -> %)',
            OLD.account_id, OLD.highest_token, NEW.highest_token USING ERRCODE = 'check_violation';
    END IF;
    IF NEW.account_id <> OLD.account_id THEN
        RAISE EXCEPTION 'rail_high_water of % may not change its account', OLD.account_id
            USING ERRCODE = 'check_violation';
    END IF;
    RETURN NEW;
END $$;
CREATE TRIGGER rail_high_water_guard BEFORE UPDATE ON rail_high_water
    FOR EACH ROW EXECUTE FUNCTION pay_rail_high_water_guard();

-- The payment resource's recovery. outcome: lowered | unchanged (the fence is already at or
-- below p_to: nothing to do, nothing recorded) | not_found.
CREATE FUNCTION pay_lower_fence(p_account text, p_to bigint, p_operator text, p_identity text,
                                p_owner text, p_reason text)
RETURNS TABLE (outcome text, previous_fence bigint, fence bigint, recovery_id bigint)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    acct accounts%ROWTYPE;
    v_id bigint;
BEGIN
    SELECT * INTO acct FROM accounts a WHERE a.account_id = p_account FOR UPDATE;
    IF NOT FOUND THEN
        RETURN QUERY SELECT 'not_found'::text, NULL::bigint, NULL::bigint, NULL::bigint;
        RETURN;
    END IF;
    IF acct.fence <= p_to THEN
        RETURN QUERY SELECT 'unchanged'::text, acct.fence, acct.fence, NULL::bigint;
        RETURN;
    END IF;
    INSERT INTO fence_recoveries (resource, account_id, previous_token, new_token, operator,
                                  identity, owner_id, reason)
    VALUES ('account', p_account, acct.fence, p_to, p_operator, p_identity, p_owner, p_reason)
    RETURNING fence_recoveries.recovery_id INTO v_id;
    UPDATE accounts a SET fence = p_to WHERE a.account_id = p_account;
    RETURN QUERY SELECT 'lowered'::text, acct.fence, p_to, v_id;
END $$;

-- The rail proxy's recovery. outcome: lowered | unchanged | not_found.
CREATE FUNCTION rail_lower_high_water(p_account text, p_to bigint, p_operator text,
                                      p_identity text, p_owner text, p_reason text)
RETURNS TABLE (outcome text, previous_token bigint, highest_token bigint, recovery_id bigint)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    v_high bigint;
    v_id   bigint;
BEGIN
    PERFORM 1 FROM accounts a WHERE a.account_id = p_account;
    IF NOT FOUND THEN
        RETURN QUERY SELECT 'not_found'::text, NULL::bigint, NULL::bigint, NULL::bigint;
        RETURN;
    END IF;
    SELECT h.highest_token INTO v_high FROM rail_high_water h
    WHERE h.account_id = p_account FOR UPDATE;
    IF NOT FOUND OR v_high <= p_to THEN
        RETURN QUERY SELECT 'unchanged'::text, coalesce(v_high, 0), coalesce(v_high, 0), NULL::bigint;
        RETURN;
    END IF;
    INSERT INTO fence_recoveries (resource, account_id, previous_token, new_token, operator,
                                  identity, owner_id, reason)
    VALUES ('rail', p_account, v_high, p_to, p_operator, p_identity, p_owner, p_reason)
    RETURNING fence_recoveries.recovery_id INTO v_id;
    UPDATE rail_high_water h SET highest_token = p_to, updated_at = clock_timestamp()
    WHERE h.account_id = p_account;
    RETURN QUERY SELECT 'lowered'::text, v_high, p_to, v_id;
END $$;
