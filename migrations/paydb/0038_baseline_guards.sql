-- paydb baseline, part 2 of 4 (after 0037): the guards that keep the fences and the high-water
-- marks rising and the payout state machine legal, an account's limits, the ledger's balances and
-- balanced postings, the append-only records, and the store epoch.

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

-- The highest proven token an account admitted only rises, like the fence, and it has no
-- recovery: it records what happened.
CREATE FUNCTION pay_accounts_seen_guard() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.max_seen_token < OLD.max_seen_token THEN
        RAISE EXCEPTION 'accounts.max_seen_token of % may not go down (% -> %)',
            OLD.account_id, OLD.max_seen_token, NEW.max_seen_token
            USING ERRCODE = 'check_violation';
    END IF;
    RETURN NEW;
END $$;
-- The WHEN clause keeps the function off the claim and post path: it runs only for a lowering.
CREATE TRIGGER accounts_seen_guard BEFORE UPDATE OF max_seen_token ON accounts
    FOR EACH ROW WHEN (NEW.max_seen_token < OLD.max_seen_token)
    EXECUTE FUNCTION pay_accounts_seen_guard();

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

-- The rail's seen mark only rises; it records what happened and has no recovery.
CREATE FUNCTION pay_rail_seen_guard() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'rail_high_water.max_seen_token of % may not go down (% -> %)',
        OLD.account_id, OLD.max_seen_token, NEW.max_seen_token
        USING ERRCODE = 'check_violation';
END $$;
CREATE TRIGGER rail_high_water_seen_guard BEFORE UPDATE OF max_seen_token ON rail_high_water
    FOR EACH ROW WHEN (NEW.max_seen_token < OLD.max_seen_token)
    EXECUTE FUNCTION pay_rail_seen_guard();

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

-- Holds follow the state, in the same statement (an AFTER STATEMENT trigger runs before the
-- statement returns), so `held_minor` is never out of step with the payouts and the customer
-- CHECK on accounts sees every hold before anything else runs. Once per statement, not once per
-- row: every step of a batch (claim, admission, record, post) is one statement over the batch's
-- payouts, where a row trigger paid two firings a payout and this pays four a batch (68 us per
-- row against 128 us per statement, measured on this database). Several payouts of one account
-- in one statement move its held_minor once, by their sum; the CHECK judges the account as the
-- statement leaves it. The accounts are locked in key order before they are written, so two
-- statements that move the holds of the same accounts never wait on each other in a cycle.
CREATE FUNCTION pay_payouts_holds_rows() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    moved text[];
    deltas bigint[];
BEGIN
    SELECT array_agg(d.account_id ORDER BY d.account_id),
           array_agg(d.delta ORDER BY d.account_id)
      INTO moved, deltas
      FROM (SELECT n.account_id,
                   sum(CASE WHEN sn.holds THEN n.amount_minor ELSE -n.amount_minor END)::bigint
                       AS delta
              FROM old_payouts o
              JOIN new_payouts n ON n.payout_id = o.payout_id
              JOIN payout_states so ON so.state = o.state
              JOIN payout_states sn ON sn.state = n.state
             WHERE so.holds <> sn.holds
             GROUP BY n.account_id) d
     WHERE d.delta <> 0;
    IF moved IS NULL THEN
        RETURN NULL;
    END IF;
    PERFORM 1 FROM accounts a WHERE a.account_id = ANY (moved)
     ORDER BY a.account_id FOR UPDATE OF a;
    -- By the primary key (a join with the arrays would be planned as a scan of accounts).
    UPDATE accounts a
       SET held_minor = a.held_minor + deltas[array_position(moved, a.account_id)]
     WHERE a.account_id = ANY (moved);
    RETURN NULL;
END $$;
CREATE TRIGGER payouts_holds AFTER UPDATE ON payouts
    REFERENCING OLD TABLE AS old_payouts NEW TABLE AS new_payouts
    FOR EACH STATEMENT EXECUTE FUNCTION pay_payouts_holds_rows();

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

-- CLAIMED -> RAIL_AMBIGUOUS only inside pay_epoch_confirm (which sets dlock.epoch_recovery for
-- its transaction): the rail proxy's own path goes through SUBMITTING.
CREATE FUNCTION pay_payouts_quarantine_guard() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF current_setting('dlock.epoch_recovery', true) IS DISTINCT FROM 'on' THEN
        RAISE EXCEPTION 'payout % may go from CLAIMED to RAIL_AMBIGUOUS only in the epoch '
                        'recovery (dlock recover paydb-epoch)', OLD.payout_id
            USING ERRCODE = 'check_violation';
    END IF;
    RETURN NEW;
END $$;
CREATE TRIGGER payouts_quarantine_guard BEFORE UPDATE OF state ON payouts
    FOR EACH ROW WHEN (OLD.state = 'CLAIMED' AND NEW.state = 'RAIL_AMBIGUOUS')
    EXECUTE FUNCTION pay_payouts_quarantine_guard();

-- =============================================================================================
-- Guards: an account's limits (docs/contract.md#account-limits)
-- =============================================================================================

-- Money leaves an account when a payout is claimed (PENDING -> CLAIMED takes the hold the rail
-- then pays from), so the limits are checked on that transition, in a trigger on payouts: every
-- claim path (pay_claim, pay_claim_bounded, pay_claim_once, the batches, and whatever calls them
-- later) passes it. A payout above the single-payout limit is also refused when it is
-- registered. A refusal raises check_violation with a constraint name account_limits_*, which
-- rolls back the whole transaction (the fence advance and the idempotency record of the claim
-- included): nothing changes, and the payment resource answers 422 LIMIT_EXCEEDED.
--
-- On INSERT (registration) only the single-payout limit applies; on PENDING -> CLAIMED both do,
-- and the day's outflow grows by the amount in the same statement, under the account row lock
-- every claim takes first (so two claims of one account cannot both pass on the same remainder).
CREATE FUNCTION pay_payouts_limits() RETURNS trigger LANGUAGE plpgsql AS $$
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
CREATE TRIGGER payouts_limits_register BEFORE INSERT ON payouts
    FOR EACH ROW EXECUTE FUNCTION pay_payouts_limits();
-- The WHEN clause keeps the function off every other transition (a re-claim, submit, post,
-- resolve, cancel).
CREATE TRIGGER payouts_limits_claim BEFORE UPDATE OF state ON payouts
    FOR EACH ROW WHEN (OLD.state = 'PENDING' AND NEW.state = 'CLAIMED')
    EXECUTE FUNCTION pay_payouts_limits();

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
-- Applied once per INSERT statement over its transition table: one UPDATE of the accounts and
-- one upsert of the shards, however many postings the statement wrote (a batch's posts write
-- theirs in one statement, docs/design.md#group-commit).
CREATE FUNCTION pay_ledger_apply_rows() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    UPDATE accounts a
       SET balance_minor = a.balance_minor + d.delta, updated_at = clock_timestamp()
      FROM (SELECT e.account_id,
                   sum(CASE WHEN e.direction = 'CREDIT' THEN e.amount_minor
                            ELSE -e.amount_minor END)::bigint AS delta
              FROM new_entries e GROUP BY e.account_id) d
     WHERE a.account_id = d.account_id AND a.kind <> 'settlement';
    INSERT INTO account_balance_shards AS s (account_id, currency, shard, balance_minor)
    SELECT e.account_id, e.currency, pay_balance_shard(e.payout_id, e.reference),
           sum(CASE WHEN e.direction = 'CREDIT' THEN e.amount_minor
                    ELSE -e.amount_minor END)::bigint
      FROM new_entries e JOIN accounts a ON a.account_id = e.account_id
     WHERE a.kind = 'settlement'
     GROUP BY 1, 2, 3
     ORDER BY 1, 3
    ON CONFLICT (account_id, shard)
    DO UPDATE SET balance_minor = s.balance_minor + EXCLUDED.balance_minor;
    RETURN NULL;
END $$;

-- The same, one entry at a time: the ledger's trigger before it was made statement-level. No
-- trigger runs it; the payouts bench (services/executor/benches/payouts.rs) puts it back on a
-- second database to compare the two.
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

-- Every posting balances: exactly one DEBIT and one CREDIT of the same amount and currency.
-- Checked at the end of each INSERT statement for every posting it wrote; a posting that
-- balances then balances at commit (the posting key allows one DEBIT and one CREDIT, the ledger
-- is append-only). One written over several statements of a transaction (an operator's psql
-- session) goes into ledger_split_postings, whose deferred constraint trigger checks it again at
-- commit with pay_posting_balanced.
CREATE FUNCTION pay_ledger_balanced_rows() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO ledger_split_postings (reference)
    SELECT r.reference
      FROM (SELECT DISTINCT e.reference FROM new_entries e) r
      JOIN LATERAL (
            SELECT count(*) AS rows_count,
                   coalesce(sum(x.amount_minor) FILTER (WHERE x.direction = 'DEBIT'), 0) AS debits,
                   coalesce(sum(x.amount_minor) FILTER (WHERE x.direction = 'CREDIT'), 0)
                       AS credits,
                   count(DISTINCT x.currency) AS currencies_count
              FROM ledger_entries x WHERE x.reference = r.reference) b ON true
     WHERE b.rows_count <> 2 OR b.debits <> b.credits OR b.currencies_count <> 1;
    RETURN NULL;
END $$;

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

CREATE TRIGGER ledger_entries_apply AFTER INSERT ON ledger_entries
    REFERENCING NEW TABLE AS new_entries
    FOR EACH STATEMENT EXECUTE FUNCTION pay_ledger_apply_rows();
CREATE TRIGGER ledger_entries_balanced AFTER INSERT ON ledger_entries
    REFERENCING NEW TABLE AS new_entries
    FOR EACH STATEMENT EXECUTE FUNCTION pay_ledger_balanced_rows();
CREATE CONSTRAINT TRIGGER ledger_split_postings_balanced AFTER INSERT ON ledger_split_postings
    DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION pay_posting_balanced();

-- The guards stay row triggers (accounts_guard, payouts_guard and payouts_limits_claim):
-- measured on this database, a statement-level version of each costs more for the statements of
-- one row that every single request runs (guards 3 and 12 us per row against 17 and 54 us per
-- statement, limits 43 against 80) than it saves on the batch's statements of a few rows, so the
-- batch's UPDATEs of payouts and accounts fire them per row, with the same checks as every other
-- write. payouts_holds went the other way once the rail proxy's writes, too, became statements
-- over the batch (its comment above).

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

-- A payout is never deleted. Its id names one account for good: pay_payouts_guard refuses any
-- change of its account, amount, currency or beneficiary, and nothing in dlock deletes a payout.
-- The payment resource relies on it: the account a claim or a post is proven against
-- (`payout:{accountId}`, docs/design.md#d-8) is looked up once per payout and kept in memory
-- (services/payment-resource/src/store/mod.rs). A payout deleted and registered again under its
-- id with another account would have its writes proven against the first account's lock, so the
-- database refuses the delete, as it refuses an append-only table's.
CREATE FUNCTION pay_payouts_kept() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'payouts are never deleted: a payout''s id names its account for good'
        USING ERRCODE = 'check_violation';
END $$;
-- Statement-level, so that a DELETE or TRUNCATE is refused even when it would match no row.
CREATE TRIGGER payouts_kept BEFORE DELETE OR TRUNCATE ON payouts
    FOR EACH STATEMENT EXECUTE FUNCTION pay_payouts_kept();

-- rail_submission keeps every attempt. A FENCED row records a stale writer refused before any
-- rail call. It is evidence for the incident it belongs to, and is kept for the retention
-- (rail.proxy.fenced-retention-ms, rail_sweep_fenced); nothing decides anything from it
-- (admission ignores FENCED rows, docs/design.md#d-2). Every other row is the one presented
-- attempt of its payout (docs/contract.md#rail-step-2): deleting one would let the payout be
-- submitted again, so the database refuses it, whoever asks.
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


-- A pending funding is approved once and then never changes; no row is deleted.
CREATE FUNCTION pay_pending_fundings_guard() RETURNS trigger LANGUAGE plpgsql AS $$
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
CREATE TRIGGER pending_fundings_guard BEFORE UPDATE OR DELETE ON pending_fundings
    FOR EACH ROW EXECUTE FUNCTION pay_pending_fundings_guard();
CREATE TRIGGER pending_fundings_no_truncate BEFORE TRUNCATE ON pending_fundings
    FOR EACH STATEMENT EXECUTE FUNCTION pay_pending_fundings_guard();

-- The window of direct fundings is only as good as its rows: none is changed or deleted.
CREATE FUNCTION pay_direct_fundings_guard() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'direct_fundings keeps every row as written (%)', TG_OP
        USING ERRCODE = 'check_violation';
END $$;
CREATE TRIGGER direct_fundings_guard BEFORE UPDATE OR DELETE ON direct_fundings
    FOR EACH ROW EXECUTE FUNCTION pay_direct_fundings_guard();
CREATE TRIGGER direct_fundings_no_truncate BEFORE TRUNCATE ON direct_fundings
    FOR EACH STATEMENT EXECUTE FUNCTION pay_direct_fundings_guard();

-- Findings are evidence: nothing rewrites or removes one.
CREATE FUNCTION pay_findings_append_only() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'reconcile_findings is append-only: % refused', TG_OP
        USING ERRCODE = 'check_violation';
END $$;
CREATE TRIGGER reconcile_findings_append_only BEFORE UPDATE OR DELETE ON reconcile_findings
    FOR EACH ROW EXECUTE FUNCTION pay_findings_append_only();
CREATE TRIGGER reconcile_findings_no_truncate BEFORE TRUNCATE ON reconcile_findings
    FOR EACH STATEMENT EXECUTE FUNCTION pay_findings_append_only();

-- =============================================================================================
-- The store epoch: the fences and marks do not silently go back with paydb (docs/design.md#d-12)
-- =============================================================================================

-- paydb keeps the two enforcement points, `accounts.fence` and `rail_high_water`. A promoted
-- asynchronous replica, or a restore to a point in time, can lose acknowledged commits: a fence
-- would remember less than a stale holder was already refused by, and that holder's next write
-- would pass. Such a database is on a new PostgreSQL timeline, so the timeline is paydb's epoch,
-- recorded in pay_store_epoch. Every write statement on the fenced tables checks it in its own
-- transaction (statement-level triggers). On a new timeline:
--
-- * when the primary it was written on was replicating synchronously when last looked at (at most
--   a second before the last write: `synchronous_standby_names` set, `synchronous_commit` at least
--   `on`, a synchronous standby streaming), no acknowledged commit can be missing from the standby
--   that was promoted: the new epoch is taken and recorded, and the write goes on. No human.
-- * otherwise the write is refused (SQLSTATE DL012, which the services answer as 503 with a
--   message that says what to do), and so is every later one, until an operator has reconciled
--   and confirms with `dlock recover paydb-epoch` (pay_epoch_confirm, in the next part).
--
-- Reads are not refused: they are advisory. A restore to a point in time of a database that was
-- replicating synchronously looks like a synchronous failover here and is taken without a human:
-- restoring paydb is an operator's act, who runs the recovery in any case (docs/design.md#d-12).

CREATE FUNCTION pay_timeline() RETURNS bigint LANGUAGE sql VOLATILE AS $$
    SELECT ('x' || lpad(substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8), 16, '0'))::bit(64)::bigint
$$;

-- Without the pg_monitor role pg_stat_replication hides sync_state: then this says false, and a
-- failover waits for an operator, which is the safe side.
CREATE FUNCTION pay_replicating_synchronously() RETURNS boolean LANGUAGE sql VOLATILE AS $$
    SELECT current_setting('synchronous_standby_names') <> ''
       AND current_setting('synchronous_commit') IN ('on', 'remote_write', 'remote_apply')
       AND EXISTS (SELECT 1 FROM pg_stat_replication
                   WHERE state = 'streaming' AND sync_state IN ('sync', 'quorum'))
$$;

INSERT INTO pay_store_epoch (timeline, synchronous)
VALUES (pay_timeline(), pay_replicating_synchronously());

CREATE FUNCTION pay_epoch_guard() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    v_timeline bigint := pay_timeline();
    v_epoch    pay_store_epoch;
BEGIN
    SELECT * INTO v_epoch FROM pay_store_epoch;
    IF v_epoch.timeline = v_timeline THEN
        -- Look at the replication again at most once a second, by whichever write gets the row.
        IF v_epoch.checked_at < clock_timestamp() - interval '1 second' THEN
            PERFORM 1 FROM pay_store_epoch FOR UPDATE SKIP LOCKED;
            IF FOUND THEN
                UPDATE pay_store_epoch
                   SET synchronous = pay_replicating_synchronously(), checked_at = clock_timestamp();
            END IF;
        END IF;
        RETURN NULL;
    END IF;
    SELECT * INTO v_epoch FROM pay_store_epoch FOR UPDATE;
    IF v_epoch.timeline = v_timeline THEN
        RETURN NULL;
    END IF;
    IF v_epoch.synchronous THEN
        UPDATE pay_store_epoch
           SET timeline = v_timeline, synchronous = pay_replicating_synchronously(),
               checked_at = clock_timestamp();
        INSERT INTO pay_store_epoch_changes (from_timeline, to_timeline, decided_by)
        VALUES (v_epoch.timeline, v_timeline, 'synchronous');
        RETURN NULL;
    END IF;
    RAISE EXCEPTION USING
        ERRCODE = 'DL012',
        MESSAGE = format('paydb is on timeline %s, its fences were written on timeline %s by a '
                         'primary that was not replicating synchronously, so acknowledged writes '
                         '(fences, high-water marks, postings) may be lost: nothing was written',
                         v_timeline, v_epoch.timeline),
        HINT = 'reconcile (dlock reconcile), then confirm with dlock recover paydb-epoch '
               '--token-floor <the highest token the lock server has issued> (docs/design.md#d-12)';
END $$;

CREATE TRIGGER accounts_epoch_guard BEFORE UPDATE ON accounts
    FOR EACH STATEMENT EXECUTE FUNCTION pay_epoch_guard();
CREATE TRIGGER payouts_epoch_guard BEFORE INSERT OR UPDATE ON payouts
    FOR EACH STATEMENT EXECUTE FUNCTION pay_epoch_guard();
CREATE TRIGGER ledger_entries_epoch_guard BEFORE INSERT ON ledger_entries
    FOR EACH STATEMENT EXECUTE FUNCTION pay_epoch_guard();
CREATE TRIGGER rail_high_water_epoch_guard BEFORE INSERT OR UPDATE ON rail_high_water
    FOR EACH STATEMENT EXECUTE FUNCTION pay_epoch_guard();
