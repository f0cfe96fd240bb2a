-- paydb baseline, part 2 of 4 (after 0009): the guards that keep the fence and the high-water
-- mark rising and the payout state machine legal, the ledger's balances and balanced postings,
-- the append-only records.

-- =============================================================================================
-- Guards: the fence and the high-water mark only rise
-- =============================================================================================

-- Whether this transaction recorded the lowering of `resource` of `account` from `old` to `new`.
CREATE FUNCTION pay_recovery_recorded(p_resource text, p_account text, p_old bigint, p_new bigint)
RETURNS boolean LANGUAGE sql STABLE AS $$
    SELECT EXISTS (SELECT 1 FROM fence_recoveries r
                   WHERE r.resource = p_resource AND r.account_id = p_account
                     AND r.previous_token = p_old AND r.new_token = p_new
                     AND r.xact_id = pg_current_xact_id());
$$;

-- The fence only moves up. A fence that went down would re-admit every stale holder below the
-- old value; no code path may do that, so the database refuses it. The one exception is a
-- recovery: a lowering recorded in fence_recoveries by the same transaction.
CREATE FUNCTION pay_accounts_guard() RETURNS trigger LANGUAGE plpgsql AS $$
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
CREATE TRIGGER accounts_guard BEFORE UPDATE ON accounts
    FOR EACH ROW EXECUTE FUNCTION pay_accounts_guard();

-- The rail high-water mark gets the same guard as the account fence, in the database and not
-- only in rail_admit.
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

-- =============================================================================================
-- Guards: the payout state machine and its holds
-- =============================================================================================

CREATE FUNCTION pay_payouts_guard() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'INSERT' THEN
        -- Every payout starts at the beginning; nobody inserts one half-way through.
        IF NEW.state <> 'PENDING' OR NEW.attempt_count <> 0 OR NEW.claim_token IS NOT NULL THEN
            RAISE EXCEPTION 'a payout is created PENDING, unclaimed (got %)', NEW.state
                USING ERRCODE = 'check_violation';
        END IF;
        RETURN NEW;
    END IF;
    IF NEW.payout_id <> OLD.payout_id OR NEW.account_id <> OLD.account_id
       OR NEW.currency <> OLD.currency OR NEW.amount_minor <> OLD.amount_minor
       OR NEW.beneficiary_ref <> OLD.beneficiary_ref OR NEW.created_at <> OLD.created_at THEN
        RAISE EXCEPTION 'payout % may not change what it pays, to whom or from where',
            OLD.payout_id USING ERRCODE = 'check_violation';
    END IF;
    IF NOT EXISTS (SELECT 1 FROM payout_transitions
                   WHERE from_state = OLD.state AND to_state = NEW.state) THEN
        RAISE EXCEPTION 'payout % may not go from % to %', OLD.payout_id, OLD.state, NEW.state
            USING ERRCODE = 'check_violation';
    END IF;
    IF NEW.state = 'CLAIMED' THEN
        -- A claim counts once and carries a token newer than the previous claim's.
        IF NEW.attempt_count <> OLD.attempt_count + 1 THEN
            RAISE EXCEPTION 'a claim of payout % must add exactly one attempt', OLD.payout_id
                USING ERRCODE = 'check_violation';
        END IF;
        IF NEW.claim_token IS NULL OR NEW.claim_token <= coalesce(OLD.claim_token, 0) THEN
            RAISE EXCEPTION 'a claim of payout % needs a token above %', OLD.payout_id,
                coalesce(OLD.claim_token, 0) USING ERRCODE = 'check_violation';
        END IF;
    ELSIF NEW.attempt_count <> OLD.attempt_count
          OR NEW.claim_token IS DISTINCT FROM OLD.claim_token THEN
        RAISE EXCEPTION 'only a claim may change the attempt count or the claim token of %',
            OLD.payout_id USING ERRCODE = 'check_violation';
    END IF;
    NEW.updated_at := clock_timestamp();
    RETURN NEW;
END $$;
CREATE TRIGGER payouts_guard BEFORE INSERT OR UPDATE ON payouts
    FOR EACH ROW EXECUTE FUNCTION pay_payouts_guard();

-- Holds follow the state, in the same statement, so `held_minor` is never out of step with the
-- payouts and the customer CHECK on accounts sees every hold.
CREATE FUNCTION pay_payouts_holds() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    was_held boolean;
    is_held boolean;
BEGIN
    SELECT holds INTO was_held FROM payout_states WHERE state = OLD.state;
    SELECT holds INTO is_held FROM payout_states WHERE state = NEW.state;
    IF was_held <> is_held THEN
        UPDATE accounts
           SET held_minor = held_minor + CASE WHEN is_held THEN NEW.amount_minor
                                              ELSE -NEW.amount_minor END
         WHERE account_id = NEW.account_id;
    END IF;
    RETURN NULL;
END $$;
CREATE TRIGGER payouts_holds AFTER UPDATE OF state ON payouts
    FOR EACH ROW EXECUTE FUNCTION pay_payouts_holds();

-- The transition table allows PENDING | CLAIMED -> ABANDONED. The database adds what makes it
-- safe: never once an attempt reached the rail proxy (a non-FENCED rail_submission row means the
-- money may have moved, and then only the rail's statement decides), and never without its
-- record in payout_abandonments, in the same transaction.
CREATE FUNCTION pay_payouts_abandon_guard() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF EXISTS (SELECT 1 FROM rail_submission r
               WHERE r.payout_id = NEW.payout_id AND r.outcome <> 'FENCED') THEN
        RAISE EXCEPTION 'payout % has an attempt at the rail and cannot be abandoned',
            NEW.payout_id USING ERRCODE = 'check_violation';
    END IF;
    IF NOT EXISTS (SELECT 1 FROM payout_abandonments a
                   WHERE a.payout_id = NEW.payout_id AND a.from_state = OLD.state) THEN
        RAISE EXCEPTION 'payout % is abandoned only with its payout_abandonments record',
            NEW.payout_id USING ERRCODE = 'check_violation';
    END IF;
    RETURN NEW;
END $$;
CREATE TRIGGER payouts_abandon_guard BEFORE UPDATE OF state ON payouts
    FOR EACH ROW WHEN (NEW.state = 'ABANDONED' AND OLD.state <> 'ABANDONED')
    EXECUTE FUNCTION pay_payouts_abandon_guard();

-- =============================================================================================
-- The ledger: balances and balanced postings
-- =============================================================================================

-- The shard of a settlement entry: the payout's hash (the posting reference when there is no
-- payout), 16 ways. IMMUTABLE and one expression without FROM, so it is inlined into the ledger
-- trigger's INSERT.
CREATE FUNCTION pay_balance_shard(p_payout_id uuid, p_reference text) RETURNS smallint
LANGUAGE sql IMMUTABLE AS $$
    SELECT (hashtext(coalesce(p_payout_id::text, p_reference)) & 15)::smallint
$$;

-- The balance moves with the entries and only with them: balance = sum(CREDIT) - sum(DEBIT), a
-- customer's or a funding account's on its row, a settlement account's on one of its shards.
CREATE FUNCTION pay_ledger_apply() RETURNS trigger LANGUAGE plpgsql AS $$
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
CREATE TRIGGER ledger_entries_apply AFTER INSERT ON ledger_entries
    FOR EACH ROW EXECUTE FUNCTION pay_ledger_apply();

-- Every posting balances at commit: exactly one DEBIT and one CREDIT of the same amount and
-- currency. Deferred, because the two rows are inserted one after the other.
CREATE FUNCTION pay_posting_balanced() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    debits bigint;
    credits bigint;
    rows_count integer;
    currencies_count integer;
BEGIN
    SELECT count(*),
           coalesce(sum(amount_minor) FILTER (WHERE direction = 'DEBIT'), 0),
           coalesce(sum(amount_minor) FILTER (WHERE direction = 'CREDIT'), 0),
           count(DISTINCT currency)
      INTO rows_count, debits, credits, currencies_count
      FROM ledger_entries WHERE reference = NEW.reference;
    IF rows_count <> 2 OR debits <> credits OR currencies_count <> 1 THEN
        RAISE EXCEPTION 'posting % does not balance (% rows, debits %, credits %)',
            NEW.reference, rows_count, debits, credits USING ERRCODE = 'check_violation';
    END IF;
    RETURN NULL;
END $$;
CREATE CONSTRAINT TRIGGER ledger_entries_balanced AFTER INSERT ON ledger_entries
    DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION pay_posting_balanced();

-- =============================================================================================
-- Append-only records
-- =============================================================================================

-- The ledger is append-only: a correction is a new posting, never an edit. So are the audit
-- tables: an audit that can be edited is not one.
CREATE FUNCTION pay_append_only() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION '% is append-only', TG_TABLE_NAME USING ERRCODE = 'check_violation';
END $$;
-- Statement-level, so that a DELETE or TRUNCATE is refused even when it would match no row.
CREATE TRIGGER ledger_entries_append_only BEFORE UPDATE OR DELETE OR TRUNCATE ON ledger_entries
    FOR EACH STATEMENT EXECUTE FUNCTION pay_append_only();
CREATE TRIGGER audit_log_append_only BEFORE UPDATE OR DELETE OR TRUNCATE ON audit_log
    FOR EACH STATEMENT EXECUTE FUNCTION pay_append_only();
CREATE TRIGGER fence_recoveries_append_only BEFORE UPDATE OR DELETE OR TRUNCATE ON fence_recoveries
    FOR EACH STATEMENT EXECUTE FUNCTION pay_append_only();
CREATE TRIGGER payout_abandonments_append_only BEFORE UPDATE OR DELETE OR TRUNCATE
    ON payout_abandonments FOR EACH STATEMENT EXECUTE FUNCTION pay_append_only();

-- rail_submission keeps every attempt. A FENCED row records a stale writer refused before any
-- rail call. It is evidence for the incident it belongs to, and is kept for the retention
-- (rail.proxy.fenced-retention-ms, rail_sweep_fenced); nothing decides anything from it
-- (admission ignores FENCED rows, D-2). Every other row is the one presented attempt of its
-- payout (FR-18): deleting one would let the payout be submitted again, so the database refuses
-- it, whoever asks.
CREATE FUNCTION rail_submission_keep_attempts() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF OLD.outcome <> 'FENCED' THEN
        RAISE EXCEPTION 'rail_submission % (%) is the attempt of payout %; only FENCED rows may be deleted',
            OLD.submission_id, OLD.outcome, OLD.payout_id USING ERRCODE = 'check_violation';
    END IF;
    RETURN OLD;
END $$;
CREATE TRIGGER rail_submission_keep_attempts BEFORE DELETE ON rail_submission
    FOR EACH ROW EXECUTE FUNCTION rail_submission_keep_attempts();
-- TRUNCATE fires no row trigger: refuse it outright.
CREATE TRIGGER rail_submission_no_truncate BEFORE TRUNCATE ON rail_submission
    FOR EACH STATEMENT EXECUTE FUNCTION pay_append_only();
