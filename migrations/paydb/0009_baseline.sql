-- paydb: accounts, the double-entry ledger, payouts and their idempotency records, the rail
-- proxy's submissions, and the audit of every out-of-band action.
--
-- This file is the paydb schema. Versions 1–8 are the history it replaces: their files are in git
-- history, and a database that applied them is adopted on start by the services, which rewrite
-- its migration rows to this baseline. New changes go in new migrations, numbered from 10.
--
-- This database is enforcement point (a). The payment resource trusts no lock state, only the
-- token a request presents and the fence stored here, so every rule that keeps money from moving
-- twice is written into the schema: the conditional writes are functions that run in the caller's
-- transaction, and the triggers below refuse what no code path may do, whichever code path it is
-- (the rail proxy, an operator's psql session, a bug).
--
-- Order: reference data, the tables with their constraints and indexes, then the functions and
-- triggers grouped by what they do: the guards, the ledger, the append-only records, the payment
-- resource's writes, the idempotency records and the rail proxy's writes.

-- =============================================================================================
-- Reference data
-- =============================================================================================

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
-- recovery re-claim. PENDING | CLAIMED -> ABANDONED has a guard of its own on top
-- (pay_payouts_abandon_guard).
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

-- =============================================================================================
-- Accounts
-- =============================================================================================

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
    -- Maintained by the ledger trigger only, so it cannot drift from the entries (FR-25). A
    -- settlement account's balance is this plus the sum of its account_balance_shards.
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

-- The settlement account's balance in shards. Every payout posting credits
-- `rail-settlement-<currency>`; kept on the account row, that one row would be updated by every
-- post of the currency, and concurrent posts of different accounts would queue on its row lock.
-- So the ledger trigger adds each settlement entry to the shard its payout hashes to, and the
-- account's balance is its row's balance (what was posted before the balance was sharded, in a
-- database that had postings then) plus the sum of its shards. The entries themselves are as
-- for any account: one DEBIT and one CREDIT per posting, the credit names
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

-- =============================================================================================
-- Payouts
-- =============================================================================================

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

-- Why a payout was abandoned, by whom, under which token. One row per payout: ABANDONED is
-- terminal.
CREATE TABLE payout_abandonments (
    payout_id      uuid PRIMARY KEY REFERENCES payouts,
    account_id     text NOT NULL REFERENCES accounts,
    -- attempts_exhausted: a claim found the payout out of attempts (payment.payout.max-attempts);
    -- cancelled: an operator cancelled it.
    cause          text NOT NULL CHECK (cause IN ('attempts_exhausted', 'cancelled')),
    from_state     text NOT NULL CHECK (from_state IN ('PENDING', 'CLAIMED')),
    attempt_count  integer NOT NULL CHECK (attempt_count >= 0),
    token          bigint NOT NULL CHECK (token > 0),
    owner_id       text NOT NULL CHECK (char_length(owner_id) BETWEEN 1 AND 64),
    -- The authenticated identity, when the caller had one; the operator's typed name for a cancel.
    identity       text CHECK (identity IS NULL OR char_length(identity) BETWEEN 1 AND 256),
    operator       text CHECK (operator IS NULL OR char_length(operator) BETWEEN 1 AND 128),
    reason         text NOT NULL CHECK (char_length(reason) BETWEEN 8 AND 4096),
    recorded_at    timestamptz NOT NULL DEFAULT clock_timestamp(),
    CHECK (cause <> 'cancelled' OR (identity IS NOT NULL AND operator IS NOT NULL))
);

-- =============================================================================================
-- The ledger
-- =============================================================================================

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

-- =============================================================================================
-- Rail submissions (written by the rail proxy, read by the payment resource for P4)
-- =============================================================================================

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
    -- For replay (rail_admit): SHA-256 of the canonical request (never the request itself:
    -- bodies name beneficiaries), and the answer given for the attempt once it was resolved. An
    -- attempt recorded before replay existed (in an adopted database) has neither: a retry of one
    -- is answered from its outcome.
    request_hash    bytea CHECK (octet_length(request_hash) = 32),
    response_status smallint CHECK (response_status BETWEEN 200 AND 599),
    response_body   bytea,
    -- An attempt is resolved exactly when it has an outcome other than unresolved.
    CHECK ((outcome = 'unresolved') = (resolved_at IS NULL)),
    CHECK ((response_status IS NULL) = (response_body IS NULL)),
    -- An answer is stored only for a resolved attempt.
    CHECK (response_status IS NULL OR outcome <> 'unresolved')
);
-- FR-18 with D-2: one presented attempt per payout. Fenced attempts never reached the rail, so
-- they must not block the legitimate holder.
CREATE UNIQUE INDEX rail_submission_one_per_payout_idx ON rail_submission (payout_id)
    WHERE outcome <> 'FENCED';
-- Replay looks an attempt up by its key and token.
CREATE INDEX rail_submission_key_token_idx ON rail_submission (idempotency_key, presented_token);
-- The sweep of FENCED attempts (rail_sweep_fenced).
CREATE INDEX rail_submission_fenced_idx ON rail_submission (resolved_at) WHERE outcome = 'FENCED';

-- =============================================================================================
-- Idempotency records (ADR 0004, D-7)
-- =============================================================================================

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

-- =============================================================================================
-- Audit of the out-of-band actions: fence advances (D-3), ambiguous resolutions, fence
-- recoveries (D-8)
-- =============================================================================================

-- Every out-of-band action records who asked (the body's `operator`, text the caller types, so
-- anybody with an operator credential can write any name there) and the identity the credential
-- authenticated as (a tokens-file identity, a Kubernetes service account, the legacy operator
-- token's identity), which is what an investigation can rely on.
--
-- audit_log and rail_fence_advances hold rows written before the identity was recorded; they
-- have none and keep none (the tables are append-only). So their `*_identity_recorded`
-- constraints are NOT VALID: they hold every row written since, and no code path can record an
-- advance or a resolution without saying whose credential made it.

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
    identity       text CHECK (identity IS NULL OR char_length(identity) BETWEEN 1 AND 256),
    CHECK (action <> 'fence_advanced' OR (previous_fence IS NOT NULL AND new_fence >= previous_fence)),
    CHECK (action <> 'ambiguous_resolved' OR (payout_id IS NOT NULL AND outcome IS NOT NULL))
);
ALTER TABLE audit_log
    ADD CONSTRAINT audit_log_identity_recorded CHECK (identity IS NOT NULL) NOT VALID;
CREATE INDEX audit_log_account_idx ON audit_log (account_id, recorded_at);

-- D-3: every revocation floor pushed to the rail, attributed.
CREATE TABLE rail_fence_advances (
    advance_id     bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    account_id     text NOT NULL REFERENCES accounts,
    previous_token bigint NOT NULL,
    floor_token    bigint NOT NULL CHECK (floor_token > 0),
    -- The mark only ever rises: a floor below it leaves it where it was.
    new_token      bigint NOT NULL CHECK (new_token >= previous_token AND new_token >= floor_token),
    operator       text NOT NULL CHECK (char_length(operator) BETWEEN 1 AND 128),
    owner_id       text NOT NULL,
    reason         text NOT NULL CHECK (char_length(reason) BETWEEN 1 AND 4096),
    revocation_id  uuid,
    recorded_at    timestamptz NOT NULL DEFAULT clock_timestamp(),
    identity       text CHECK (identity IS NULL OR char_length(identity) BETWEEN 1 AND 256)
);
ALTER TABLE rail_fence_advances
    ADD CONSTRAINT rail_fence_advances_identity_recorded CHECK (identity IS NOT NULL) NOT VALID;
CREATE INDEX rail_fence_advances_account_idx ON rail_fence_advances (account_id, recorded_at);

-- Recovery of an account poisoned by a forged fencing token (DESIGN D-8).
--
-- Before proofs, any authenticated caller could present a token far above anything the lock
-- server had issued; the account fence and the rail high-water mark took it, and since both only
-- rise, every real holder was FENCED_OUT for good. Proofs stop new forgeries. This is the way out
-- for an account poisoned before them: an operator, holding a fresh grant on the account's key
-- (which the lock server issues only while nobody else holds it, and above every token issued
-- before), lowers the fence and the mark to that grant's token. Every lowering is recorded here,
-- append-only, in the same transaction, and the guards refuse a lowering that has no such
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

-- =============================================================================================
-- The payment resource's writes. Each runs inside the caller's transaction (together with its
-- idempotency record) and takes its row locks in one order, payout -> customer account ->
-- system account, so two writes never deadlock.
--
-- The ones on the payout path are PL/pgSQL even where one SQL statement would do: a
-- LANGUAGE sql function whose body writes (or reads FROM a table) is not inlined into its
-- caller, and PostgreSQL (before 18) parses and plans such a body again on every call, its plan
-- living only as long as one statement of the caller. PL/pgSQL plans the same statements once
-- per connection and keeps them. The LANGUAGE sql functions here are off that path:
-- pay_balance_shard (inlined), pay_recovery_recorded (evaluated only when a fence is lowered),
-- pay_ensure_system_accounts (a currency's first account), pay_idempotency_sweep and
-- rail_sweep_fenced (background sweeps, one call per batch).
-- =============================================================================================

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

-- Abandons a payout under a fenced token, as a claim would: strict (`fence < token`), the fence
-- advances, the state must be the expected one. Runs under the payout's and the account's row
-- locks, in the caller's transaction.
-- outcome: abandoned | fenced_out | not_claimable | not_found
CREATE FUNCTION pay_abandon(p_payout_id uuid, p_token bigint, p_expected_state text,
                            p_cause text, p_owner_id text, p_identity text, p_operator text,
                            p_reason text)
RETURNS TABLE (outcome text, state text, fence bigint, attempt_count integer, account_id text)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    p payouts%ROWTYPE;
    acct accounts%ROWTYPE;
BEGIN
    SELECT * INTO p FROM payouts x WHERE x.payout_id = p_payout_id FOR UPDATE;
    IF NOT FOUND THEN
        RETURN QUERY SELECT 'not_found'::text, NULL::text, NULL::bigint, NULL::integer, NULL::text;
        RETURN;
    END IF;
    SELECT * INTO acct FROM accounts a WHERE a.account_id = p.account_id FOR UPDATE;
    IF acct.fence >= p_token THEN
        RETURN QUERY SELECT 'fenced_out'::text, p.state, acct.fence, p.attempt_count, p.account_id;
        RETURN;
    END IF;
    IF p.state <> p_expected_state OR p_expected_state NOT IN ('PENDING', 'CLAIMED') THEN
        RETURN QUERY SELECT 'not_claimable'::text, p.state, acct.fence, p.attempt_count,
                            p.account_id;
        RETURN;
    END IF;
    UPDATE accounts a SET fence = p_token WHERE a.account_id = p.account_id AND a.fence < p_token;
    INSERT INTO payout_abandonments (payout_id, account_id, cause, from_state, attempt_count,
                                     token, owner_id, identity, operator, reason)
    VALUES (p_payout_id, p.account_id, p_cause, p.state, p.attempt_count, p_token, p_owner_id,
            p_identity, p_operator, p_reason);
    -- The hold of a CLAIMED payout is released by the holds trigger.
    UPDATE payouts x SET state = 'ABANDONED'
     WHERE x.payout_id = p_payout_id AND x.state = p_expected_state;
    RETURN QUERY SELECT 'abandoned'::text, 'ABANDONED'::text, p_token, p.attempt_count,
                        p.account_id;
END $$;

-- P2 with a bound on attempts: a claim that finds the payout already claimed p_max_attempts
-- times abandons it instead (same fence and state checks, same row locks), so a payout that
-- keeps losing its holders before it reaches the rail stops being retried. Otherwise exactly
-- pay_claim. outcome: pay_claim's, or abandoned.
CREATE FUNCTION pay_claim_bounded(p_payout_id uuid, p_token bigint, p_expected_state text,
                                  p_max_attempts integer, p_owner_id text)
RETURNS TABLE (outcome text, state text, fence bigint, attempt_count integer,
               claim_token bigint, account_id text, available_minor bigint, amount_minor bigint)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    p payouts%ROWTYPE;
    fence_now bigint;
    gone record;
BEGIN
    SELECT * INTO p FROM payouts x WHERE x.payout_id = p_payout_id FOR UPDATE;
    IF FOUND AND p.state = p_expected_state AND p.attempt_count >= p_max_attempts THEN
        SELECT a.fence INTO fence_now FROM accounts a WHERE a.account_id = p.account_id FOR UPDATE;
        IF fence_now < p_token THEN
            SELECT * INTO gone FROM pay_abandon(
                p_payout_id, p_token, p_expected_state, 'attempts_exhausted', p_owner_id, NULL,
                NULL, format('claimed %s times, the most payment.payout.max-attempts allows',
                             p.attempt_count));
            RETURN QUERY SELECT gone.outcome, gone.state, gone.fence, gone.attempt_count,
                                p.claim_token, p.account_id, NULL::bigint, p.amount_minor;
            RETURN;
        END IF;
    END IF;
    RETURN QUERY SELECT * FROM pay_claim(p_payout_id, p_token, p_expected_state);
END $$;

-- The two rows of a payout posting, inside a fenced post or an operator resolution. On the
-- payout path (every post and every resolution), hence PL/pgSQL.
CREATE FUNCTION pay_write_payout_posting(p payouts, p_fence bigint, p_kind text)
RETURNS void LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO ledger_entries (entry_id, account_id, currency, direction, amount_minor, fence,
                                kind, reference, payout_id)
    VALUES (gen_random_uuid(), p.account_id, p.currency, 'DEBIT', p.amount_minor, p_fence, p_kind,
            'payout:' || p.payout_id, p.payout_id),
           (gen_random_uuid(), 'rail-settlement-' || p.currency, p.currency, 'CREDIT',
            p.amount_minor, p_fence, p_kind, 'payout:' || p.payout_id, p.payout_id);
END $$;

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

-- Out-of-band resolution of a quarantined payout, attributed (operator and identity).
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

-- D-3: raises an account's fence to a revocation floor, attributed (operator and identity).
-- outcome: advanced | not_found
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

-- D-8: the payment resource's recovery of a poisoned fence. outcome: lowered | unchanged (the
-- fence is already at or below p_to: nothing to do, nothing recorded) | not_found.
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

-- =============================================================================================
-- Idempotency records, and the protected writes in one call each
-- =============================================================================================

-- The first step of every idempotent write, in the write's own transaction.
-- A concurrent duplicate blocks on the primary key until the first transaction ends, then sees
-- its committed record: the effect runs once and every duplicate replays its answer. The wait is
-- bounded by `lock_timeout` for this statement only, so a stuck first request cannot pile up
-- duplicates forever.
--
-- The conflicting record is read under a key-share lock, which the sweeper's delete respects:
-- read with a plain SELECT, a record the sweeper deleted (it had expired) between the insert and
-- the read was found missing, a "replay" with no stored answer, which the service answered 500.
-- A record that vanished in between is simply gone: the insert is tried again and the request
-- runs fresh, as it would have a moment later. The loop is bounded; a record that keeps changing
-- under the request is reported as in progress (lock_not_available), which the caller may retry.
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
    found_it boolean;
BEGIN
    FOR attempt IN 1..3 LOOP
        PERFORM set_config('lock_timeout', p_wait_ms::text, true);
        INSERT INTO idempotency_records (route, idempotency_key, fencing_token, owner_id,
                                         payload_hash, status, expires_at)
        VALUES (p_route, p_key, p_token, p_owner_id, p_payload_hash, 'in_progress',
                clock_timestamp() + p_retention_ms * interval '1 millisecond')
        ON CONFLICT DO NOTHING;
        GET DIAGNOSTICS inserted = ROW_COUNT;
        IF inserted = 1 THEN
            PERFORM set_config('lock_timeout', '0', true);
            RETURN QUERY SELECT 'fresh'::text, NULL::smallint, NULL::bytea;
            RETURN;
        END IF;
        SELECT * INTO r FROM idempotency_records x
         WHERE x.route = p_route AND x.idempotency_key = p_key AND x.fencing_token = p_token
           FOR KEY SHARE;
        found_it := FOUND;
        PERFORM set_config('lock_timeout', '0', true);
        IF found_it THEN
            IF r.payload_hash <> p_payload_hash THEN
                RETURN QUERY SELECT 'conflict'::text, NULL::smallint, NULL::bytea;
            ELSE
                RETURN QUERY SELECT 'replay'::text, r.response_status, r.response_body;
            END IF;
            RETURN;
        END IF;
        -- Swept between the insert and the read: try again.
    END LOOP;
    RAISE EXCEPTION 'the idempotency record of % % kept changing; retry', p_route, p_key
        USING ERRCODE = 'lock_not_available';
END $$;

-- Deletes expired records, a bounded batch at a time. Returns how many went. It skips records a
-- request is reading (key-share locked by pay_idempotency_begin) instead of waiting for it; they
-- go on the next tick.
CREATE FUNCTION pay_idempotency_sweep(p_batch integer) RETURNS bigint
LANGUAGE sql AS $$
    WITH gone AS (
        DELETE FROM idempotency_records
         WHERE ctid IN (SELECT ctid FROM idempotency_records
                         WHERE expires_at < clock_timestamp() LIMIT p_batch
                           FOR UPDATE SKIP LOCKED)
        RETURNING 1)
    SELECT count(*) FROM gone;
$$;

-- One call per protected write, so that the idempotency record and the effect cost one round
-- trip.
--
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

-- =============================================================================================
-- The rail proxy's writes: admission (C3 §3.5 steps 1–3) and outcome recording, each one
-- transaction, so that no code path can forward without a durable intent and no token can
-- submit twice for an account.
-- =============================================================================================

-- Steps 1 to 3 of the admission order, in that order, in one transaction. The caller forwards to
-- the rail only when this returns 'admitted', and only after it has committed.
--
-- Idempotent replay (C3 §3.1, DESIGN D-7) is checked first: after the payout row lock, before
-- anything else is decided. The identical request retried by the same holder (same
-- X-Idempotency-Key, same X-Fencing-Token, same body) gets the first answer back ('replay': the
-- first attempt, its outcome and stored answer) and is never forwarded again; it is not a
-- duplicate attempt and does not page. The same key and token with another body is 'conflict'
-- (IDEMPOTENCY_CONFLICT), naming the attempt whose key and token it reused. A different token
-- for a payout that already has an attempt stays 'duplicate' (DUPLICATE_SUBMISSION) or 'fenced'
-- (FENCED_OUT): the token is part of the idempotency scope.
CREATE FUNCTION rail_admit(p_payout uuid, p_account text, p_amount bigint, p_currency text,
                           p_token bigint, p_key text, p_submission uuid, p_request text)
RETURNS TABLE (outcome text, highest_token bigint, resource_type text, state text,
               submission_id uuid, submission_outcome text, response_status smallint,
               response_body bytea)
LANGUAGE plpgsql AS $$
DECLARE
    v_payout   payouts%ROWTYPE;
    v_high     bigint;
    v_fence    bigint;
    v_existing rail_submission%ROWTYPE;
    v_same     rail_submission%ROWTYPE;
    v_hash     bytea := sha256(convert_to(p_request, 'UTF8'));
BEGIN
    -- The payout row lock serializes every submission of one payout.
    SELECT * INTO v_payout FROM payouts WHERE payout_id = p_payout FOR UPDATE;
    IF NOT FOUND THEN
        RETURN QUERY SELECT 'payout_unknown', NULL::bigint, NULL::text, NULL::text, NULL::uuid,
                            NULL::text, NULL::smallint, NULL::bytea;
        RETURN;
    END IF;

    -- Replay: an attempt presented under this very key and token. FENCED rows never reached
    -- the rail and are answered afresh (a stale token stays fenced).
    SELECT * INTO v_same FROM rail_submission r
    WHERE r.idempotency_key = p_key AND r.presented_token = p_token AND r.outcome <> 'FENCED'
    ORDER BY r.submitted_at LIMIT 1;
    IF v_same.submission_id IS NOT NULL AND v_same.request_hash IS NOT NULL THEN
        IF v_same.payout_id = p_payout AND v_same.request_hash = v_hash THEN
            RETURN QUERY SELECT 'replay', p_token, NULL::text, v_payout.state,
                                v_same.submission_id, v_same.outcome, v_same.response_status,
                                v_same.response_body;
        ELSE
            RETURN QUERY SELECT 'conflict', p_token, NULL::text, v_payout.state,
                                v_same.submission_id, v_same.outcome, NULL::smallint, NULL::bytea;
        END IF;
        RETURN;
    END IF;

    IF v_payout.account_id <> p_account OR v_payout.amount_minor <> p_amount
       OR v_payout.currency <> p_currency THEN
        RETURN QUERY SELECT 'mismatch', NULL::bigint, NULL::text, v_payout.state, NULL::uuid,
                            NULL::text, NULL::smallint, NULL::bytea;
        RETURN;
    END IF;

    -- Step 1: the account's durable high-water mark, strict. The row lock serializes every
    -- submission of one account, whichever proxy replica it reached.
    INSERT INTO rail_high_water (account_id, highest_token) VALUES (p_account, 0)
    ON CONFLICT (account_id) DO NOTHING;
    SELECT h.highest_token INTO v_high FROM rail_high_water h
    WHERE h.account_id = p_account FOR UPDATE;
    SELECT * INTO v_existing FROM rail_submission r
    WHERE r.payout_id = p_payout AND r.outcome <> 'FENCED';
    IF p_token <= v_high THEN
        -- The same payout and token under another key (or an attempt from before replay was
        -- recorded) is a duplicate, not a stale writer. Either way nothing reaches the rail.
        IF v_existing.submission_id IS NOT NULL AND v_existing.presented_token = p_token THEN
            RETURN QUERY SELECT 'duplicate', v_high, NULL::text, v_payout.state,
                                v_existing.submission_id, v_existing.outcome, NULL::smallint,
                                NULL::bytea;
            RETURN;
        END IF;
        INSERT INTO rail_submission (submission_id, payout_id, account_id, presented_token,
                                     idempotency_key, outcome, resolved_at)
        VALUES (p_submission, p_payout, p_account, p_token, p_key, 'FENCED', clock_timestamp());
        RETURN QUERY SELECT 'fenced', v_high, 'rail', v_payout.state, p_submission, 'FENCED',
                            NULL::smallint, NULL::bytea;
        RETURN;
    END IF;
    -- A token below the account's fence or the payout's latest claim belongs to a holder that
    -- has been superseded, even if the newer holder has not submitted yet.
    SELECT a.fence INTO v_fence FROM accounts a WHERE a.account_id = p_account;
    IF p_token < v_fence OR p_token < coalesce(v_payout.claim_token, 0) THEN
        INSERT INTO rail_submission (submission_id, payout_id, account_id, presented_token,
                                     idempotency_key, outcome, resolved_at)
        VALUES (p_submission, p_payout, p_account, p_token, p_key, 'FENCED', clock_timestamp());
        RETURN QUERY SELECT 'fenced', greatest(v_fence, coalesce(v_payout.claim_token, 0)),
                            'account', v_payout.state, p_submission, 'FENCED', NULL::smallint,
                            NULL::bytea;
        RETURN;
    END IF;

    -- Step 2: one presented attempt per payout, whatever the token (FR-18).
    IF v_existing.submission_id IS NOT NULL THEN
        RETURN QUERY SELECT 'duplicate', v_high, NULL::text, v_payout.state,
                            v_existing.submission_id, v_existing.outcome, NULL::smallint,
                            NULL::bytea;
        RETURN;
    END IF;
    -- Only a payout claimed with this very token may be submitted.
    IF v_payout.state <> 'CLAIMED' OR v_payout.claim_token <> p_token THEN
        RETURN QUERY SELECT 'not_claimable', v_high, NULL::text, v_payout.state, NULL::uuid,
                            NULL::text, NULL::smallint, NULL::bytea;
        RETURN;
    END IF;

    -- Step 3: the intent (with the request's hash), the advanced mark and the payout's
    -- SUBMITTING state commit together, before any network call.
    UPDATE rail_high_water h SET highest_token = p_token, updated_at = clock_timestamp()
    WHERE h.account_id = p_account;
    INSERT INTO rail_submission (submission_id, payout_id, account_id, presented_token,
                                 idempotency_key, request_hash)
    VALUES (p_submission, p_payout, p_account, p_token, p_key, v_hash);
    UPDATE payouts p SET state = 'SUBMITTING', submission_id = p_submission
    WHERE p.payout_id = p_payout;
    RETURN QUERY SELECT 'admitted', p_token, NULL::text, 'SUBMITTING', p_submission, 'unresolved',
                        NULL::smallint, NULL::bytea;
END $$;

-- Records the one outcome of a forwarded attempt and moves the payout with it: ACKED →
-- RAIL_ACKED, REJECTED → FAILED (the hold is released), TIMEOUT → RAIL_AMBIGUOUS (quarantine).
-- An attempt is resolved once; a late answer after the sweeper timed it out changes nothing.
CREATE FUNCTION rail_record(p_submission uuid, p_outcome text, p_reference text)
RETURNS TABLE (outcome text, payout_id uuid, rail_reference text, submitted_at timestamptz,
               resolved_at timestamptz)
LANGUAGE plpgsql AS $$
DECLARE
    v_row rail_submission%ROWTYPE;
BEGIN
    IF p_outcome NOT IN ('ACKED', 'REJECTED', 'TIMEOUT') THEN
        RAISE EXCEPTION 'an attempt resolves as ACKED, REJECTED or TIMEOUT, not %', p_outcome
            USING ERRCODE = 'check_violation';
    END IF;
    UPDATE rail_submission r
       SET outcome = p_outcome,
           rail_reference = CASE WHEN p_outcome = 'ACKED' THEN p_reference END,
           resolved_at = clock_timestamp()
     WHERE r.submission_id = p_submission AND r.outcome = 'unresolved'
    RETURNING * INTO v_row;
    IF v_row.submission_id IS NULL THEN
        SELECT * INTO v_row FROM rail_submission r WHERE r.submission_id = p_submission;
        RETURN QUERY SELECT v_row.outcome, v_row.payout_id, v_row.rail_reference,
                            v_row.submitted_at, v_row.resolved_at;
        RETURN;
    END IF;
    UPDATE payouts p
       SET state = CASE p_outcome WHEN 'ACKED' THEN 'RAIL_ACKED'
                                  WHEN 'REJECTED' THEN 'FAILED'
                                  ELSE 'RAIL_AMBIGUOUS' END,
           rail_reference = CASE WHEN p_outcome = 'ACKED' THEN p_reference ELSE p.rail_reference END
     WHERE p.payout_id = v_row.payout_id AND p.state = 'SUBMITTING';
    RETURN QUERY SELECT v_row.outcome, v_row.payout_id, v_row.rail_reference,
                        v_row.submitted_at, v_row.resolved_at;
END $$;

-- Stores the answer given for a resolved attempt, once: a replay returns exactly it. Called as a
-- statement of its own for every attempt the rail proxy answers, hence PL/pgSQL.
CREATE FUNCTION rail_store_answer(p_submission uuid, p_outcome text, p_status smallint,
                                  p_body bytea)
RETURNS boolean LANGUAGE plpgsql AS $$
DECLARE
    was_stored boolean;
BEGIN
    -- A data-modifying WITH must be a statement's top level, so the answer goes through INTO.
    WITH stored AS (
        UPDATE rail_submission r SET response_status = p_status, response_body = p_body
        WHERE r.submission_id = p_submission AND r.outcome = p_outcome
          AND r.response_status IS NULL
        RETURNING 1
    )
    SELECT EXISTS (SELECT 1 FROM stored) INTO was_stored;
    RETURN was_stored;
END $$;

-- D-5: an intent still unresolved after the rail read timeout plus a margin belongs to a proxy
-- that died mid-flight. It becomes TIMEOUT and its payout RAIL_AMBIGUOUS; it is never forwarded
-- again. Returns the payouts it quarantined.
CREATE FUNCTION rail_expire_unresolved(p_older_than_ms bigint)
RETURNS TABLE (submission_id uuid, payout_id uuid)
LANGUAGE plpgsql AS $$
DECLARE
    v_row rail_submission%ROWTYPE;
BEGIN
    FOR v_row IN
        SELECT * FROM rail_submission r
        WHERE r.outcome = 'unresolved'
          AND r.submitted_at < clock_timestamp() - p_older_than_ms * interval '1 millisecond'
        FOR UPDATE SKIP LOCKED
    LOOP
        UPDATE rail_submission r SET outcome = 'TIMEOUT', resolved_at = clock_timestamp()
        WHERE r.submission_id = v_row.submission_id;
        UPDATE payouts p SET state = 'RAIL_AMBIGUOUS'
        WHERE p.payout_id = v_row.payout_id AND p.state = 'SUBMITTING';
        submission_id := v_row.submission_id;
        payout_id := v_row.payout_id;
        RETURN NEXT;
    END LOOP;
END $$;

-- Deletes FENCED rows resolved more than p_older_than_ms ago, a bounded batch at a time.
-- Returns how many went.
CREATE FUNCTION rail_sweep_fenced(p_older_than_ms bigint, p_batch integer) RETURNS bigint
LANGUAGE sql AS $$
    WITH gone AS (
        DELETE FROM rail_submission
         WHERE submission_id IN (
               SELECT r.submission_id FROM rail_submission r
                WHERE r.outcome = 'FENCED'
                  AND r.resolved_at < clock_timestamp() - p_older_than_ms * interval '1 millisecond'
                LIMIT p_batch FOR UPDATE SKIP LOCKED)
           AND outcome = 'FENCED'
        RETURNING 1)
    SELECT count(*) FROM gone;
$$;

-- D-3: raises an account's rail high-water mark to a revocation floor, so that every write with
-- the revoked token (or any older one) is fenced at the rail from now on. Attributed (operator
-- and identity) in rail_fence_advances.
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

-- D-8: the rail proxy's recovery of a poisoned high-water mark. outcome: lowered | unchanged |
-- not_found.
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
