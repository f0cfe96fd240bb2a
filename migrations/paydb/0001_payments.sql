-- paydb: accounts, the double-entry ledger, payouts and their idempotency records.
--
-- This database is enforcement point (a). The payment resource trusts no lock state, only the
-- token a request presents and the fence stored here, so every rule that keeps money from moving
-- twice is written into the schema: the conditional writes are functions that run in the caller's
-- transaction, and the triggers below refuse what no code path may do, whichever code path it is
-- (a later rail proxy, an operator's psql session, a bug).

-- The currencies the service accepts (ISO 4217, active codes). A foreign key instead of a regular
-- expression, because "ABC" matches [A-Z]{3} and is nobody's money.
CREATE TABLE currencies (
    currency char(3) PRIMARY KEY CHECK (currency ~ '^[A-Z]{3}$')
);
INSERT INTO currencies (currency)
SELECT unnest(string_to_array(
    'AED AFN ALL AMD ANG AOA ARS AUD AWG AZN BAM BBD BDT BGN BHD BIF BMD BND BOB BRL BSD BTN '
    'BWP BYN BZD CAD CDF CHF CLP CNY COP CRC CUP CVE CZK DJF DKK DOP DZD EGP ERN ETB EUR FJD '
    'FKP GBP GEL GHS GIP GMD GNF GTQ GYD HKD HNL HTG HUF IDR ILS INR IQD IRR ISK JMD JOD JPY '
    'KES KGS KHR KMF KPW KRW KWD KYD KZT LAK LBP LKR LRD LSL LYD MAD MDL MGA MKD MMK MNT MOP '
    'MRU MUR MVR MWK MXN MYR MZN NAD NGN NIO NOK NPR NZD OMR PAB PEN PGK PHP PKR PLN PYG QAR '
    'RON RSD RUB RWF SAR SBD SCR SDG SEK SGD SHP SLE SOS SRD SSP STN SVC SYP SZL THB TJS TMT '
    'TND TOP TRY TTD TWD TZS UAH UGX USD UYU UZS VES VND VUV WST XAF XCD XOF XPF YER ZAR ZMW '
    'ZWL', ' '));

-- ---------------------------------------------------------------------------------------------
-- Accounts
-- ---------------------------------------------------------------------------------------------

CREATE TABLE accounts (
    -- The same alphabet as lock keys, because the executor locks `payout:{accountId}`.
    account_id    text PRIMARY KEY CHECK (account_id ~ '^[a-zA-Z0-9:._-]{1,64}$'),
    currency      char(3) NOT NULL REFERENCES currencies,
    -- customer: holds money for payouts and may never go below zero, holds included.
    -- funding: the source of every funding posting of its currency; it goes negative by design,
    --   its balance is minus everything ever funded.
    -- settlement: the rail's side of every payout posting of its currency.
    kind          text NOT NULL DEFAULT 'customer'
                  CHECK (kind IN ('customer', 'funding', 'settlement')),
    -- Maintained by the ledger trigger only, so it cannot drift from the entries (FR-25).
    balance_minor bigint NOT NULL DEFAULT 0,
    -- The sum of the amounts of this account's payouts in CLAIMED, SUBMITTING, RAIL_ACKED or
    -- RAIL_AMBIGUOUS. Maintained by the payout trigger only.
    held_minor    bigint NOT NULL DEFAULT 0 CHECK (held_minor >= 0),
    -- The highest fencing token admitted for this account. 0 before the first claim: tokens are
    -- > 0, so 0 is below every token and admits the first holder.
    fence         bigint NOT NULL DEFAULT 0 CHECK (fence >= 0),
    created_at    timestamptz NOT NULL DEFAULT clock_timestamp(),
    updated_at    timestamptz NOT NULL DEFAULT clock_timestamp(),
    -- A customer account stays non-negative even if every held payout turns out to have been
    -- paid: available = balance - holds >= 0. Only the system accounts are exempt.
    CONSTRAINT accounts_customer_available_check
        CHECK (kind <> 'customer' OR (balance_minor >= 0 AND balance_minor - held_minor >= 0)),
    -- Targets of the composite foreign keys below: an entry or a payout cannot name an account
    -- in a different currency, and a payout cannot draw on a system account.
    UNIQUE (account_id, currency),
    UNIQUE (account_id, currency, kind)
);

-- The fence only moves up. A fence that went down would re-admit every stale holder below the
-- old value; no code path may do that, so the database refuses it.
CREATE FUNCTION pay_accounts_guard() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.fence < OLD.fence THEN
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

-- ---------------------------------------------------------------------------------------------
-- Payouts and their state machine
-- ---------------------------------------------------------------------------------------------

CREATE TABLE payout_states (
    state text PRIMARY KEY,
    -- Whether a payout in this state holds its amount on the account.
    holds boolean NOT NULL,
    terminal boolean NOT NULL
);
INSERT INTO payout_states (state, holds, terminal) VALUES
    ('PENDING', false, false),
    ('CLAIMED', true, false),
    ('SUBMITTING', true, false),
    ('RAIL_ACKED', true, false),
    ('POSTED', false, true),
    ('FAILED', false, true),
    -- Quarantined: it holds its amount because the money may have moved.
    ('RAIL_AMBIGUOUS', true, false),
    ('ABANDONED', false, true);

-- Every legal transition, and nothing else. The trigger on payouts refuses any UPDATE whose
-- (old state, new state) is not listed here, including "same state" rewrites other than the
-- recovery re-claim.
CREATE TABLE payout_transitions (
    from_state text NOT NULL REFERENCES payout_states,
    to_state   text NOT NULL REFERENCES payout_states,
    -- Who performs it, for the reader; the database does not know callers.
    actor      text NOT NULL,
    PRIMARY KEY (from_state, to_state)
);
INSERT INTO payout_transitions (from_state, to_state, actor) VALUES
    ('PENDING', 'CLAIMED', 'claim'),
    ('PENDING', 'FAILED', 'claim refused: insufficient funds'),
    ('CLAIMED', 'CLAIMED', 'recovery re-claim by a newer holder'),
    ('CLAIMED', 'SUBMITTING', 'rail proxy: intent committed'),
    ('SUBMITTING', 'RAIL_ACKED', 'rail proxy: rail acknowledged'),
    ('SUBMITTING', 'FAILED', 'rail proxy: rail declined'),
    ('SUBMITTING', 'RAIL_AMBIGUOUS', 'rail proxy: timeout, reset, 5xx or malformed ack'),
    ('RAIL_ACKED', 'POSTED', 'post'),
    ('PENDING', 'ABANDONED', 'cancel'),
    ('CLAIMED', 'ABANDONED', 'cancel'),
    ('RAIL_AMBIGUOUS', 'POSTED', 'operator resolution'),
    ('RAIL_AMBIGUOUS', 'FAILED', 'operator resolution');

CREATE TABLE payouts (
    payout_id       uuid PRIMARY KEY,
    account_id      text NOT NULL,
    currency        char(3) NOT NULL,
    -- Always 'customer': with the foreign key below, a payout cannot draw on the funding or the
    -- settlement account, nor on an account of another currency.
    account_kind    text NOT NULL DEFAULT 'customer' CHECK (account_kind = 'customer'),
    amount_minor    bigint NOT NULL CHECK (amount_minor > 0),
    beneficiary_ref text NOT NULL CHECK (char_length(beneficiary_ref) BETWEEN 1 AND 128),
    state           text NOT NULL DEFAULT 'PENDING' REFERENCES payout_states,
    -- Claims so far; the trigger lets it grow by exactly one per claim and never otherwise.
    attempt_count   integer NOT NULL DEFAULT 0 CHECK (attempt_count >= 0),
    -- The token of the latest claim.
    claim_token     bigint CHECK (claim_token > 0),
    rail_reference  text CHECK (char_length(rail_reference) BETWEEN 1 AND 128),
    submission_id   uuid,
    created_at      timestamptz NOT NULL DEFAULT clock_timestamp(),
    updated_at      timestamptz NOT NULL DEFAULT clock_timestamp(),
    FOREIGN KEY (account_id, currency, account_kind)
        REFERENCES accounts (account_id, currency, kind),
    -- Everything past a claim was done under a token.
    CONSTRAINT payouts_claimed_has_token_check
        CHECK (state IN ('PENDING', 'FAILED', 'ABANDONED') OR claim_token IS NOT NULL),
    -- A posted payout names what the rail called it, or the reconciler cannot match it.
    CONSTRAINT payouts_posted_has_reference_check
        CHECK (state <> 'POSTED' OR rail_reference IS NOT NULL)
);
-- P1 pages through one state (optionally one account) in creation order.
CREATE INDEX payouts_state_created_idx ON payouts (state, created_at, payout_id);
CREATE INDEX payouts_account_state_created_idx ON payouts (account_id, state, created_at, payout_id);
CREATE INDEX payouts_created_idx ON payouts (created_at, payout_id);

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

-- ---------------------------------------------------------------------------------------------
-- The ledger
-- ---------------------------------------------------------------------------------------------

CREATE TABLE ledger_entries (
    entry_id     uuid PRIMARY KEY,
    account_id   text NOT NULL,
    currency     char(3) NOT NULL,
    direction    text NOT NULL CHECK (direction IN ('DEBIT', 'CREDIT')),
    -- The direction carries the sign; a negative amount would be a debit in disguise.
    amount_minor bigint NOT NULL CHECK (amount_minor > 0),
    -- The fence the entry was written under: the token of the fenced post (or the ambiguous
    -- attempt's claim token for an operator resolution). 0 for funding, which is not a fenced
    -- write; real tokens are > 0, so the two cannot be confused.
    fence        bigint NOT NULL CHECK (fence >= 0),
    kind         text NOT NULL CHECK (kind IN ('funding', 'payout', 'resolution')),
    -- The posting this entry belongs to: `fund:{reference}` or `payout:{payoutId}`.
    reference    text NOT NULL CHECK (char_length(reference) BETWEEN 1 AND 160),
    payout_id    uuid REFERENCES payouts,
    created_at   timestamptz NOT NULL DEFAULT clock_timestamp(),
    FOREIGN KEY (account_id, currency) REFERENCES accounts (account_id, currency),
    -- A posting is one debit and one credit. Unique per (reference, direction): a retried post
    -- or funding can never write its rows twice, whatever the code above does.
    CONSTRAINT ledger_entries_posting_key UNIQUE (reference, direction)
);
CREATE INDEX ledger_entries_account_idx ON ledger_entries (account_id);
-- At most one payout posting per payout, however it was reached (post or resolution).
CREATE UNIQUE INDEX ledger_entries_payout_once_idx ON ledger_entries (payout_id, direction)
    WHERE payout_id IS NOT NULL;

-- The balance moves with the entries and only with them: balance = sum(CREDIT) - sum(DEBIT).
CREATE FUNCTION pay_ledger_apply() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    UPDATE accounts
       SET balance_minor = balance_minor + CASE WHEN NEW.direction = 'CREDIT' THEN NEW.amount_minor
                                                ELSE -NEW.amount_minor END
     WHERE account_id = NEW.account_id;
    RETURN NULL;
END $$;
CREATE TRIGGER ledger_entries_apply AFTER INSERT ON ledger_entries
    FOR EACH ROW EXECUTE FUNCTION pay_ledger_apply();

-- The ledger is append-only: a correction is a new posting, never an edit.
CREATE FUNCTION pay_append_only() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION '% is append-only', TG_TABLE_NAME USING ERRCODE = 'check_violation';
END $$;
-- Statement-level, so that a DELETE or TRUNCATE is refused even when it would match no row.
CREATE TRIGGER ledger_entries_append_only BEFORE UPDATE OR DELETE OR TRUNCATE ON ledger_entries
    FOR EACH STATEMENT EXECUTE FUNCTION pay_append_only();

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

-- ---------------------------------------------------------------------------------------------
-- Rail submissions (written by the rail proxy, read here for P4)
-- ---------------------------------------------------------------------------------------------

CREATE TABLE rail_high_water (
    account_id    text PRIMARY KEY REFERENCES accounts,
    -- Strict: a token submits at most once per account (C3 §3.5 step 1).
    highest_token bigint NOT NULL DEFAULT 0 CHECK (highest_token >= 0),
    updated_at    timestamptz NOT NULL DEFAULT clock_timestamp()
);

CREATE TABLE rail_submission (
    submission_id   uuid PRIMARY KEY,
    payout_id       uuid NOT NULL REFERENCES payouts,
    account_id      text NOT NULL REFERENCES accounts,
    presented_token bigint NOT NULL CHECK (presented_token > 0),
    idempotency_key text NOT NULL CHECK (char_length(idempotency_key) BETWEEN 1 AND 128),
    outcome         text NOT NULL DEFAULT 'unresolved'
                    CHECK (outcome IN ('unresolved', 'ACKED', 'FENCED', 'TIMEOUT', 'REJECTED')),
    rail_reference  text,
    submitted_at    timestamptz NOT NULL DEFAULT clock_timestamp(),
    resolved_at     timestamptz,
    -- An attempt is resolved exactly when it has an outcome other than unresolved.
    CHECK ((outcome = 'unresolved') = (resolved_at IS NULL))
);
-- FR-18 with D-2: one presented attempt per payout. Fenced attempts never reached the rail, so
-- they must not block the legitimate holder.
CREATE UNIQUE INDEX rail_submission_one_per_payout_idx ON rail_submission (payout_id)
    WHERE outcome <> 'FENCED';

-- ---------------------------------------------------------------------------------------------
-- Idempotency records (ADR 0004, D-7)
-- ---------------------------------------------------------------------------------------------

CREATE TABLE idempotency_records (
    -- Method and concrete path (`POST /v1/payouts/{id}/claim` with the id filled in).
    route           text NOT NULL,
    idempotency_key text NOT NULL CHECK (char_length(idempotency_key) BETWEEN 1 AND 128),
    -- D-7: a newer holder re-uses the payout's stable key, so the token is part of the scope.
    -- 0 for writes that carry no token.
    fencing_token   bigint NOT NULL CHECK (fencing_token >= 0),
    -- Recorded for attribution; not part of the scope.
    owner_id        text NOT NULL CHECK (char_length(owner_id) BETWEEN 1 AND 64),
    -- SHA-256 of the canonical request, never the request itself: bodies name beneficiaries.
    payload_hash    bytea NOT NULL CHECK (octet_length(payload_hash) = 32),
    status          text NOT NULL CHECK (status IN ('in_progress', 'succeeded', 'failed')),
    response_status smallint CHECK (response_status BETWEEN 200 AND 499),
    response_body   bytea,
    first_seen_at   timestamptz NOT NULL DEFAULT clock_timestamp(),
    expires_at      timestamptz NOT NULL,
    PRIMARY KEY (route, idempotency_key, fencing_token),
    -- A finished record can be replayed; an unfinished one has nothing to replay.
    CHECK ((status = 'in_progress') = (response_status IS NULL AND response_body IS NULL)),
    CHECK (expires_at > first_seen_at)
);
-- The sweep deletes by expiry.
CREATE INDEX idempotency_records_expires_idx ON idempotency_records (expires_at);

-- ---------------------------------------------------------------------------------------------
-- Audit of the out-of-band actions: fence advances (D-3) and ambiguous resolutions
-- ---------------------------------------------------------------------------------------------

CREATE TABLE audit_log (
    audit_id       bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    action         text NOT NULL CHECK (action IN ('fence_advanced', 'ambiguous_resolved')),
    account_id     text NOT NULL REFERENCES accounts,
    payout_id      uuid REFERENCES payouts,
    -- Who did it and why: an action nobody can be asked about is not an audit.
    operator       text NOT NULL CHECK (char_length(operator) BETWEEN 1 AND 128),
    owner_id       text NOT NULL,
    reason         text NOT NULL CHECK (char_length(reason) BETWEEN 1 AND 4096),
    revocation_id  uuid,
    previous_fence bigint,
    new_fence      bigint,
    outcome        text CHECK (outcome IN ('POSTED', 'FAILED')),
    rail_reference text,
    recorded_at    timestamptz NOT NULL DEFAULT clock_timestamp(),
    CHECK (action <> 'fence_advanced' OR (previous_fence IS NOT NULL AND new_fence >= previous_fence)),
    CHECK (action <> 'ambiguous_resolved' OR (payout_id IS NOT NULL AND outcome IS NOT NULL))
);
CREATE TRIGGER audit_log_append_only BEFORE UPDATE OR DELETE OR TRUNCATE ON audit_log
    FOR EACH STATEMENT EXECUTE FUNCTION pay_append_only();

-- ---------------------------------------------------------------------------------------------
-- The writes. Each runs inside the caller's transaction (together with its idempotency record)
-- and takes its row locks in one order, payout -> customer account -> system account, so two
-- writes never deadlock.
-- ---------------------------------------------------------------------------------------------

-- The system accounts of a currency, created with its first customer account.
CREATE FUNCTION pay_ensure_system_accounts(p_currency char(3)) RETURNS void
LANGUAGE sql AS $$
    INSERT INTO accounts (account_id, currency, kind) VALUES
        ('funding-' || p_currency, p_currency, 'funding'),
        ('rail-settlement-' || p_currency, p_currency, 'settlement')
    ON CONFLICT (account_id) DO NOTHING;
$$;

-- outcome: created | exists | conflict
CREATE FUNCTION pay_create_account(p_account_id text, p_currency char(3))
RETURNS TABLE (outcome text, currency char(3))
LANGUAGE plpgsql AS $$
DECLARE
    existing accounts%ROWTYPE;
BEGIN
    INSERT INTO accounts (account_id, currency, kind) VALUES (p_account_id, p_currency, 'customer')
    ON CONFLICT (account_id) DO NOTHING;
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

-- outcome: funded | exists | conflict | not_found | not_customer
CREATE FUNCTION pay_fund(p_account_id text, p_amount bigint, p_reference text)
RETURNS TABLE (outcome text, balance_minor bigint)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    acct accounts%ROWTYPE;
    posting text := 'fund:' || p_reference;
    prior ledger_entries%ROWTYPE;
BEGIN
    SELECT * INTO acct FROM accounts a WHERE a.account_id = p_account_id FOR UPDATE;
    IF NOT FOUND THEN
        RETURN QUERY SELECT 'not_found'::text, NULL::bigint;
        RETURN;
    END IF;
    IF acct.kind <> 'customer' THEN
        RETURN QUERY SELECT 'not_customer'::text, acct.balance_minor;
        RETURN;
    END IF;
    SELECT * INTO prior FROM ledger_entries e
     WHERE e.reference = posting AND e.direction = 'CREDIT';
    IF FOUND THEN
        IF prior.account_id = p_account_id AND prior.amount_minor = p_amount THEN
            RETURN QUERY SELECT 'exists'::text, acct.balance_minor;
        ELSE
            RETURN QUERY SELECT 'conflict'::text, acct.balance_minor;
        END IF;
        RETURN;
    END IF;
    INSERT INTO ledger_entries (entry_id, account_id, currency, direction, amount_minor, fence,
                                kind, reference)
    VALUES (gen_random_uuid(), p_account_id, acct.currency, 'CREDIT', p_amount, 0, 'funding', posting),
           (gen_random_uuid(), 'funding-' || acct.currency, acct.currency, 'DEBIT', p_amount, 0,
            'funding', posting);
    RETURN QUERY SELECT 'funded'::text, a.balance_minor FROM accounts a
                  WHERE a.account_id = p_account_id;
END $$;

-- outcome: created | exists | conflict | account_unknown | currency_mismatch
CREATE FUNCTION pay_create_payout(p_payout_id uuid, p_account_id text, p_amount bigint,
                                  p_currency char(3), p_beneficiary_ref text)
RETURNS TABLE (outcome text)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    acct accounts%ROWTYPE;
    existing payouts%ROWTYPE;
BEGIN
    SELECT * INTO existing FROM payouts p WHERE p.payout_id = p_payout_id;
    IF NOT FOUND THEN
        SELECT * INTO acct FROM accounts a WHERE a.account_id = p_account_id;
        IF NOT FOUND OR acct.kind <> 'customer' THEN
            RETURN QUERY SELECT 'account_unknown'::text;
            RETURN;
        END IF;
        IF acct.currency <> p_currency THEN
            RETURN QUERY SELECT 'currency_mismatch'::text;
            RETURN;
        END IF;
        INSERT INTO payouts (payout_id, account_id, currency, amount_minor, beneficiary_ref)
        VALUES (p_payout_id, p_account_id, p_currency, p_amount, p_beneficiary_ref)
        ON CONFLICT (payout_id) DO NOTHING;
        IF FOUND THEN
            RETURN QUERY SELECT 'created'::text;
            RETURN;
        END IF;
        SELECT * INTO existing FROM payouts p WHERE p.payout_id = p_payout_id;
    END IF;
    IF existing.account_id = p_account_id AND existing.amount_minor = p_amount
       AND existing.currency = p_currency AND existing.beneficiary_ref = p_beneficiary_ref THEN
        RETURN QUERY SELECT 'exists'::text;
    ELSE
        RETURN QUERY SELECT 'conflict'::text;
    END IF;
END $$;

-- P2. outcome: claimed | fenced_out | not_claimable | insufficient_funds | not_found
-- `fence` is the account's fence after the call (the stored fence that won, when fenced out).
CREATE FUNCTION pay_claim(p_payout_id uuid, p_token bigint, p_expected_state text)
RETURNS TABLE (outcome text, state text, fence bigint, attempt_count integer,
               claim_token bigint, account_id text, available_minor bigint, amount_minor bigint)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    p payouts%ROWTYPE;
    acct accounts%ROWTYPE;
    available bigint;
BEGIN
    SELECT * INTO p FROM payouts x WHERE x.payout_id = p_payout_id FOR UPDATE;
    IF NOT FOUND THEN
        RETURN QUERY SELECT 'not_found'::text, NULL::text, NULL::bigint, NULL::integer,
                            NULL::bigint, NULL::text, NULL::bigint, NULL::bigint;
        RETURN;
    END IF;
    SELECT * INTO acct FROM accounts a WHERE a.account_id = p.account_id FOR UPDATE;
    -- Strict: a claim admits only a token above every token seen for the account (D-1).
    IF acct.fence >= p_token THEN
        RETURN QUERY SELECT 'fenced_out'::text, p.state, acct.fence, p.attempt_count,
                            p.claim_token, p.account_id, NULL::bigint, p.amount_minor;
        RETURN;
    END IF;
    IF p.state <> p_expected_state OR p_expected_state NOT IN ('PENDING', 'CLAIMED') THEN
        RETURN QUERY SELECT 'not_claimable'::text, p.state, acct.fence, p.attempt_count,
                            p.claim_token, p.account_id, NULL::bigint, p.amount_minor;
        RETURN;
    END IF;
    -- The fence advances whatever the claim decides: the holder's write was admitted.
    UPDATE accounts a SET fence = p_token WHERE a.account_id = p.account_id AND a.fence < p_token;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'fence of % moved under a row lock', p.account_id;
    END IF;
    available := acct.balance_minor - acct.held_minor;
    IF p.state = 'PENDING' AND available < p.amount_minor THEN
        UPDATE payouts x SET state = 'FAILED' WHERE x.payout_id = p_payout_id;
        RETURN QUERY SELECT 'insufficient_funds'::text, 'FAILED'::text, p_token, p.attempt_count,
                            p.claim_token, p.account_id, available, p.amount_minor;
        RETURN;
    END IF;
    -- A re-claim (CLAIMED -> CLAIMED) already holds its amount; the hold is not taken twice.
    UPDATE payouts x SET state = 'CLAIMED', attempt_count = x.attempt_count + 1,
                         claim_token = p_token
     WHERE x.payout_id = p_payout_id AND x.state = p_expected_state;
    RETURN QUERY SELECT 'claimed'::text, 'CLAIMED'::text, p_token, p.attempt_count + 1, p_token,
                        p.account_id, available, p.amount_minor;
END $$;

-- The two rows of a payout posting, inside a fenced post or an operator resolution.
CREATE FUNCTION pay_write_payout_posting(p payouts, p_fence bigint, p_kind text) RETURNS void
LANGUAGE sql AS $$
    INSERT INTO ledger_entries (entry_id, account_id, currency, direction, amount_minor, fence,
                                kind, reference, payout_id)
    VALUES (gen_random_uuid(), p.account_id, p.currency, 'DEBIT', p.amount_minor, p_fence, p_kind,
            'payout:' || p.payout_id, p.payout_id),
           (gen_random_uuid(), 'rail-settlement-' || p.currency, p.currency, 'CREDIT',
            p.amount_minor, p_fence, p_kind, 'payout:' || p.payout_id, p.payout_id);
$$;

-- P3. outcome: posted | fenced_out | not_claimable | reference_mismatch | not_found
CREATE FUNCTION pay_post(p_payout_id uuid, p_token bigint, p_rail_reference text,
                         p_submission_id uuid)
RETURNS TABLE (outcome text, state text, fence bigint, account_id text, balance_minor bigint)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    p payouts%ROWTYPE;
    acct accounts%ROWTYPE;
BEGIN
    SELECT * INTO p FROM payouts x WHERE x.payout_id = p_payout_id FOR UPDATE;
    IF NOT FOUND THEN
        RETURN QUERY SELECT 'not_found'::text, NULL::text, NULL::bigint, NULL::text, NULL::bigint;
        RETURN;
    END IF;
    SELECT * INTO acct FROM accounts a WHERE a.account_id = p.account_id FOR UPDATE;
    -- The claimer or a later holder may post: fence <= token (D-1).
    IF acct.fence > p_token THEN
        RETURN QUERY SELECT 'fenced_out'::text, p.state, acct.fence, p.account_id,
                            acct.balance_minor;
        RETURN;
    END IF;
    IF p.state <> 'RAIL_ACKED' THEN
        RETURN QUERY SELECT 'not_claimable'::text, p.state, acct.fence, p.account_id,
                            acct.balance_minor;
        RETURN;
    END IF;
    IF (p.rail_reference IS NOT NULL AND p.rail_reference <> p_rail_reference)
       OR (p.submission_id IS NOT NULL AND p.submission_id <> p_submission_id) THEN
        RETURN QUERY SELECT 'reference_mismatch'::text, p.state, acct.fence, p.account_id,
                            acct.balance_minor;
        RETURN;
    END IF;
    UPDATE accounts a SET fence = p_token WHERE a.account_id = p.account_id AND a.fence < p_token;
    -- The hold is released (trigger) before the debit lands, so available never dips below 0.
    UPDATE payouts x SET state = 'POSTED', rail_reference = p_rail_reference,
                         submission_id = p_submission_id
     WHERE x.payout_id = p_payout_id AND x.state = 'RAIL_ACKED';
    PERFORM pay_write_payout_posting(p, p_token, 'payout');
    RETURN QUERY SELECT 'posted'::text, 'POSTED'::text, greatest(acct.fence, p_token), p.account_id,
                        a.balance_minor FROM accounts a WHERE a.account_id = p.account_id;
END $$;

-- D-3. outcome: advanced | not_found
CREATE FUNCTION pay_advance_fence(p_account_id text, p_floor bigint, p_operator text,
                                  p_reason text, p_revocation_id uuid, p_owner_id text)
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
    INSERT INTO audit_log (action, account_id, operator, owner_id, reason, revocation_id,
                           previous_fence, new_fence)
    VALUES ('fence_advanced', p_account_id, p_operator, p_owner_id, p_reason, p_revocation_id,
            acct.fence, advanced);
    RETURN QUERY SELECT 'advanced'::text, acct.fence, advanced;
END $$;

-- Out-of-band resolution of a quarantined payout.
-- outcome: resolved | not_claimable | not_found
CREATE FUNCTION pay_resolve(p_payout_id uuid, p_outcome text, p_rail_reference text,
                            p_operator text, p_evidence text, p_owner_id text)
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
    INSERT INTO audit_log (action, account_id, payout_id, operator, owner_id, reason, outcome,
                           rail_reference)
    VALUES ('ambiguous_resolved', p.account_id, p_payout_id, p_operator, p_owner_id, p_evidence,
            p_outcome, p_rail_reference);
    RETURN QUERY SELECT 'resolved'::text, p_outcome, p.account_id, a.balance_minor
                   FROM accounts a WHERE a.account_id = p.account_id;
END $$;

-- The first step of every idempotent write, in the write's own transaction.
-- A concurrent duplicate blocks on the primary key until the first transaction ends, then sees
-- its committed record: the effect runs once and every duplicate replays its answer. The wait is
-- bounded by `lock_timeout` for this statement only, so a stuck first request cannot pile up
-- duplicates forever.
-- outcome: fresh | replay | conflict
CREATE FUNCTION pay_idempotency_begin(p_route text, p_key text, p_token bigint, p_owner_id text,
                                      p_payload_hash bytea, p_retention_ms bigint,
                                      p_wait_ms integer)
RETURNS TABLE (outcome text, response_status smallint, response_body bytea)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    r idempotency_records%ROWTYPE;
    inserted integer;
BEGIN
    PERFORM set_config('lock_timeout', p_wait_ms::text, true);
    INSERT INTO idempotency_records (route, idempotency_key, fencing_token, owner_id,
                                     payload_hash, status, expires_at)
    VALUES (p_route, p_key, p_token, p_owner_id, p_payload_hash, 'in_progress',
            clock_timestamp() + p_retention_ms * interval '1 millisecond')
    ON CONFLICT DO NOTHING;
    GET DIAGNOSTICS inserted = ROW_COUNT;
    PERFORM set_config('lock_timeout', '0', true);
    IF inserted = 1 THEN
        RETURN QUERY SELECT 'fresh'::text, NULL::smallint, NULL::bytea;
        RETURN;
    END IF;
    SELECT * INTO r FROM idempotency_records x
     WHERE x.route = p_route AND x.idempotency_key = p_key AND x.fencing_token = p_token;
    IF r.payload_hash <> p_payload_hash THEN
        RETURN QUERY SELECT 'conflict'::text, NULL::smallint, NULL::bytea;
    ELSE
        RETURN QUERY SELECT 'replay'::text, r.response_status, r.response_body;
    END IF;
END $$;

-- Deletes expired records, a bounded batch at a time. Returns how many went.
CREATE FUNCTION pay_idempotency_sweep(p_batch integer) RETURNS bigint
LANGUAGE sql AS $$
    WITH gone AS (
        DELETE FROM idempotency_records
         WHERE ctid IN (SELECT ctid FROM idempotency_records
                         WHERE expires_at < clock_timestamp() LIMIT p_batch)
        RETURNING 1)
    SELECT count(*) FROM gone;
$$;
