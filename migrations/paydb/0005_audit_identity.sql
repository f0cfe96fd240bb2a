-- The authenticated identity beside the typed-in operator (issue 13, item 13).
--
-- `operator` is text the caller writes into the body; anybody with an operator credential can
-- type any name there. The identity the credential authenticated as (a tokens-file identity, a
-- Kubernetes service account, the legacy operator token's identity) is what an investigation can
-- rely on, so every fence advance and every resolution records it too. fence_recoveries (0003)
-- already does.
--
-- Rows written before this migration have no identity and keep none (the tables are append-only
-- audit). The NOT VALID constraints hold every row written from now on: no code path can record
-- an advance or a resolution without saying whose credential made it.

ALTER TABLE audit_log
    ADD COLUMN identity text CHECK (identity IS NULL OR char_length(identity) BETWEEN 1 AND 256);
ALTER TABLE audit_log
    ADD CONSTRAINT audit_log_identity_recorded CHECK (identity IS NOT NULL) NOT VALID;

ALTER TABLE rail_fence_advances
    ADD COLUMN identity text CHECK (identity IS NULL OR char_length(identity) BETWEEN 1 AND 256);
ALTER TABLE rail_fence_advances
    ADD CONSTRAINT rail_fence_advances_identity_recorded CHECK (identity IS NOT NULL) NOT VALID;
CREATE INDEX rail_fence_advances_account_idx ON rail_fence_advances (account_id, recorded_at);
CREATE INDEX audit_log_account_idx ON audit_log (account_id, recorded_at);

-- The writers of 0001 and 0002 take the identity now; the old signatures go, so that a caller
-- that does not pass one fails loudly instead of writing an unattributed row.
DROP FUNCTION pay_advance_fence(text, bigint, text, text, uuid, text);
DROP FUNCTION pay_resolve(uuid, text, text, text, text, text);
DROP FUNCTION rail_advance_high_water(text, bigint, text, text, text, uuid);

-- D-3. outcome: advanced | not_found
CREATE FUNCTION pay_advance_fence(p_account_id text, p_floor bigint, p_operator text,
                                  p_reason text, p_revocation_id uuid, p_owner_id text,
                                  p_identity text)
RETURNS TABLE (outcome text, previous_fence bigint, fence bigint)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    acct accounts%ROWTYPE;
    advanced bigint;
BEGIN
    SELECT * INTO acct FROM accounts a WHERE a.account_id = p_account_id FOR UPDATE;
    IF NOT FOUND THEN
        RETURN QUERY SELECT 'not_found'::text, NULL::bigint, NULL::bigint;
        RETURN;
    END IF;
    advanced := greatest(acct.fence, p_floor);
    UPDATE accounts a SET fence = advanced WHERE a.account_id = p_account_id;
    INSERT INTO audit_log (action, account_id, operator, identity, owner_id, reason,
                           revocation_id, previous_fence, new_fence)
    VALUES ('fence_advanced', p_account_id, p_operator, p_identity, p_owner_id, p_reason,
            p_revocation_id, acct.fence, advanced);
    RETURN QUERY SELECT 'advanced'::text, acct.fence, advanced;
END $$;

-- Out-of-band resolution of a quarantined payout.
-- outcome: resolved | not_claimable | not_found
CREATE FUNCTION pay_resolve(p_payout_id uuid, p_outcome text, p_rail_reference text,
                            p_operator text, p_evidence text, p_owner_id text, p_identity text)
RETURNS TABLE (outcome text, state text, account_id text, balance_minor bigint)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    p payouts%ROWTYPE;
BEGIN
    SELECT * INTO p FROM payouts x WHERE x.payout_id = p_payout_id FOR UPDATE;
    IF NOT FOUND THEN
        RETURN QUERY SELECT 'not_found'::text, NULL::text, NULL::text, NULL::bigint;
        RETURN;
    END IF;
    PERFORM 1 FROM accounts a WHERE a.account_id = p.account_id FOR UPDATE;
    IF p.state <> 'RAIL_AMBIGUOUS' THEN
        RETURN QUERY SELECT 'not_claimable'::text, p.state, p.account_id,
                            (SELECT a.balance_minor FROM accounts a WHERE a.account_id = p.account_id);
        RETURN;
    END IF;
    UPDATE payouts x SET state = p_outcome,
                         rail_reference = coalesce(p_rail_reference, x.rail_reference)
     WHERE x.payout_id = p_payout_id AND x.state = 'RAIL_AMBIGUOUS';
    IF p_outcome = 'POSTED' THEN
        PERFORM pay_write_payout_posting(p, p.claim_token, 'resolution');
    END IF;
    INSERT INTO audit_log (action, account_id, payout_id, operator, identity, owner_id, reason,
                           outcome, rail_reference)
    VALUES ('ambiguous_resolved', p.account_id, p_payout_id, p_operator, p_identity, p_owner_id,
            p_evidence, p_outcome, p_rail_reference);
    RETURN QUERY SELECT 'resolved'::text, p_outcome, p.account_id, a.balance_minor
                   FROM accounts a WHERE a.account_id = p.account_id;
END $$;

-- D-3: raises an account's rail high-water mark to a revocation floor.
CREATE FUNCTION rail_advance_high_water(p_account text, p_floor bigint, p_operator text,
                                        p_owner text, p_reason text, p_revocation uuid,
                                        p_identity text)
RETURNS TABLE (previous_token bigint, new_token bigint)
LANGUAGE plpgsql AS $$
DECLARE
    v_previous bigint;
    v_new      bigint;
BEGIN
    INSERT INTO rail_high_water (account_id, highest_token) VALUES (p_account, 0)
    ON CONFLICT (account_id) DO NOTHING;
    SELECT h.highest_token INTO v_previous FROM rail_high_water h
    WHERE h.account_id = p_account FOR UPDATE;
    v_new := greatest(v_previous, p_floor);
    UPDATE rail_high_water h SET highest_token = v_new, updated_at = clock_timestamp()
    WHERE h.account_id = p_account;
    INSERT INTO rail_fence_advances (account_id, previous_token, floor_token, new_token, operator,
                                     identity, owner_id, reason, revocation_id)
    VALUES (p_account, v_previous, p_floor, v_new, p_operator, p_identity, p_owner, p_reason,
            p_revocation);
    RETURN QUERY SELECT v_previous, v_new;
END $$;
