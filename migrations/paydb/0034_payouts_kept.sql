-- paydb 0034: a payout is never deleted.
--
-- A payout's id names one account for good: the guard of 0026 (pay_payouts_guard) refuses any
-- change of its account, amount, currency or beneficiary, and nothing in dlock deletes a payout.
-- The payment resource relies on it: the account a claim or a post is proven against
-- (`payout:{accountId}`, docs/design.md#d-8) is looked up once per payout and kept in memory
-- (services/payment-resource/src/store/mod.rs). A payout deleted and registered again under its
-- id with another account would have its writes proven against the first account's lock, so the
-- database refuses the delete: the same statement-level refusal as the append-only tables.
--
-- Can run again (OR REPLACE, IF EXISTS).

CREATE OR REPLACE FUNCTION pay_payouts_kept() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'payouts are never deleted: a payout''s id names its account for good'
        USING ERRCODE = 'check_violation';
END $$;
DROP TRIGGER IF EXISTS payouts_kept ON payouts;
-- Statement-level, so that a DELETE or TRUNCATE is refused even when it would match no row.
CREATE TRIGGER payouts_kept BEFORE DELETE OR TRUNCATE ON payouts
    FOR EACH STATEMENT EXECUTE FUNCTION pay_payouts_kept();
