-- paydb 0024: two accounts of one new currency opened at once no longer fail.
--
-- pay_ensure_system_accounts (0011) inserted the currency's funding and settlement accounts with
-- ON CONFLICT (account_id) DO NOTHING. accounts has two more unique constraints
-- ((account_id, currency) and (account_id, currency, kind)); an insert that names one arbiter
-- is still checked against the others, so when two transactions opened the first two customer
-- accounts of a currency at once, the second one's insert of the same system accounts raised a
-- unique violation on accounts_account_id_currency_key (an open answered 500) instead of doing
-- nothing. Without a conflict target every unique constraint arbitrates. pay_create_account's
-- own insert had the same shape (two opens of one new id at once) and changes the same way; its
-- outcomes (created, exists, conflict) are unchanged.
--
-- Can run again on a database that already has its changes (OR REPLACE).

CREATE OR REPLACE FUNCTION pay_ensure_system_accounts(p_currency char(3)) RETURNS void
LANGUAGE sql AS $$
    INSERT INTO accounts (account_id, currency, kind) VALUES
        ('funding-' || p_currency, p_currency, 'funding'),
        ('rail-settlement-' || p_currency, p_currency, 'settlement')
    ON CONFLICT DO NOTHING;
$$;

-- outcome: created | exists | conflict
CREATE OR REPLACE FUNCTION pay_create_account(p_account_id text, p_currency char(3))
RETURNS TABLE (outcome text, currency char(3))
LANGUAGE plpgsql AS $$
DECLARE
    existing accounts%ROWTYPE;
BEGIN
    INSERT INTO accounts (account_id, currency, kind) VALUES (p_account_id, p_currency, 'customer')
    ON CONFLICT DO NOTHING;
    IF FOUND THEN
        PERFORM pay_ensure_system_accounts(p_currency);
        RETURN QUERY SELECT 'created'::text, p_currency;
        RETURN;
    END IF;
    SELECT * INTO existing FROM accounts a WHERE a.account_id = p_account_id;
    IF existing.currency = p_currency AND existing.kind = 'customer' THEN
        RETURN QUERY SELECT 'exists'::text, existing.currency;
    ELSE
        RETURN QUERY SELECT 'conflict'::text, existing.currency;
    END IF;
END $$;
