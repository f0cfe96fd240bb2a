-- Issue 14: no single hot row on the post path, and fewer round trips per protected write.

-- ---------------------------------------------------------------------------------------------
-- The settlement account's balance in shards
-- ---------------------------------------------------------------------------------------------

-- Every payout posting credits `rail-settlement-<currency>`. Kept on the account row, that one
-- row was updated by every post of the currency, so concurrent posts of different accounts
-- queued on its row lock. The settlement balance now lives in N shard rows: the ledger trigger
-- adds each settlement entry to the shard its payout hashes to, and the account's balance is its
-- row's balance (what was posted before this migration) plus the sum of its shards. The entries
-- themselves are unchanged: one DEBIT and one CREDIT per posting, the credit still names
-- `rail-settlement-<currency>`, so double entry and the ledger-sum check (FR-25) stay exact.
CREATE TABLE account_balance_shards (
    account_id    text NOT NULL,
    currency      char(3) NOT NULL,
    -- Only settlement accounts are sharded: the composite key below names the account's kind.
    kind          text NOT NULL DEFAULT 'settlement' CHECK (kind = 'settlement'),
    shard         smallint NOT NULL CHECK (shard BETWEEN 0 AND 15),
    balance_minor bigint NOT NULL DEFAULT 0,
    PRIMARY KEY (account_id, shard),
    FOREIGN KEY (account_id, currency, kind) REFERENCES accounts (account_id, currency, kind)
);

-- The shard of a settlement entry: the payout's hash (the posting reference when there is no
-- payout), 16 ways.
CREATE FUNCTION pay_balance_shard(p_payout_id uuid, p_reference text) RETURNS smallint
LANGUAGE sql IMMUTABLE AS $$
    SELECT (hashtext(coalesce(p_payout_id::text, p_reference)) & 15)::smallint
$$;

-- The balance still moves with the entries and only with them: a customer's or a funding
-- account's on its row, a settlement account's on one of its shards.
CREATE OR REPLACE FUNCTION pay_ledger_apply() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    delta bigint := CASE WHEN NEW.direction = 'CREDIT' THEN NEW.amount_minor
                         ELSE -NEW.amount_minor END;
    account_kind text;
BEGIN
    SELECT a.kind INTO account_kind FROM accounts a WHERE a.account_id = NEW.account_id;
    IF account_kind = 'settlement' THEN
        INSERT INTO account_balance_shards AS s (account_id, currency, shard, balance_minor)
        VALUES (NEW.account_id, NEW.currency, pay_balance_shard(NEW.payout_id, NEW.reference),
                delta)
        ON CONFLICT (account_id, shard)
        DO UPDATE SET balance_minor = s.balance_minor + EXCLUDED.balance_minor;
    ELSE
        UPDATE accounts SET balance_minor = balance_minor + delta
         WHERE account_id = NEW.account_id;
    END IF;
    RETURN NULL;
END $$;

-- ---------------------------------------------------------------------------------------------
-- One call per protected write: the idempotency record and the effect
-- ---------------------------------------------------------------------------------------------

-- P2 in one call: the request's idempotency record (pay_idempotency_begin) and, when the
-- request is fresh, pay_claim_bounded, in the caller's transaction. begin_outcome is fresh,
-- replay or conflict; the effect's columns are set only when fresh.
CREATE FUNCTION pay_claim_once(p_route text, p_key text, p_token bigint, p_owner_id text,
                               p_payload_hash bytea, p_retention_ms bigint, p_wait_ms integer,
                               p_payout_id uuid, p_expected_state text, p_max_attempts integer)
RETURNS TABLE (begin_outcome text, response_status smallint, response_body bytea,
               outcome text, state text, fence bigint, attempt_count integer,
               claim_token bigint, account_id text, available_minor bigint, amount_minor bigint)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    b record;
BEGIN
    SELECT * INTO b FROM pay_idempotency_begin(p_route, p_key, p_token, p_owner_id,
                                               p_payload_hash, p_retention_ms, p_wait_ms);
    IF b.outcome <> 'fresh' THEN
        RETURN QUERY SELECT b.outcome, b.response_status, b.response_body, NULL::text, NULL::text,
                            NULL::bigint, NULL::integer, NULL::bigint, NULL::text, NULL::bigint,
                            NULL::bigint;
        RETURN;
    END IF;
    RETURN QUERY SELECT 'fresh'::text, NULL::smallint, NULL::bytea, c.*
                   FROM pay_claim_bounded(p_payout_id, p_token, p_expected_state, p_max_attempts,
                                          p_owner_id) c;
END $$;

-- P3 in one call: the idempotency record, pay_post and, when posted, the posting's two entries
-- (DEBIT first, as the answer lists them) as a JSON array.
CREATE FUNCTION pay_post_once(p_route text, p_key text, p_token bigint, p_owner_id text,
                              p_payload_hash bytea, p_retention_ms bigint, p_wait_ms integer,
                              p_payout_id uuid, p_rail_reference text, p_submission_id uuid)
RETURNS TABLE (begin_outcome text, response_status smallint, response_body bytea,
               outcome text, state text, fence bigint, account_id text, balance_minor bigint,
               entries text)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    b record;
    r record;
BEGIN
    SELECT * INTO b FROM pay_idempotency_begin(p_route, p_key, p_token, p_owner_id,
                                               p_payload_hash, p_retention_ms, p_wait_ms);
    IF b.outcome <> 'fresh' THEN
        RETURN QUERY SELECT b.outcome, b.response_status, b.response_body, NULL::text, NULL::text,
                            NULL::bigint, NULL::text, NULL::bigint, NULL::text;
        RETURN;
    END IF;
    SELECT * INTO r FROM pay_post(p_payout_id, p_token, p_rail_reference, p_submission_id);
    RETURN QUERY SELECT 'fresh'::text, NULL::smallint, NULL::bytea, r.outcome, r.state, r.fence,
                        r.account_id, r.balance_minor,
                        CASE WHEN r.outcome = 'posted' THEN
                            (SELECT jsonb_agg(jsonb_build_object(
                                        'entryId', e.entry_id, 'accountId', e.account_id,
                                        'direction', e.direction, 'amountMinor', e.amount_minor,
                                        'fence', e.fence) ORDER BY e.direction DESC)
                               FROM ledger_entries e
                              WHERE e.reference = 'payout:' || p_payout_id)::text
                        END;
END $$;
