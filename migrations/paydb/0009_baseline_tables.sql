-- paydb: accounts, the double-entry ledger, payouts and their idempotency records, the rail
-- proxy's submissions, and the audit of every out-of-band action.
--
-- This file and the three after it (0010–0012) are the paydb baseline: the whole schema, in four
-- parts (tables; guards and the ledger's triggers; the payment resource's writes; idempotency
-- records and the rail proxy's writes). Versions 1–8 are the history they replace: their files are
-- in git history (retired.tsv lists them), and a database that applied them is adopted when a
-- service starts, which rewrites its migration rows to these four (services/server/src/squash.rs).
-- A change goes into a new migration, numbered from 13.
--
-- This database is enforcement point (a). The payment resource trusts no lock state, only the
-- token a request presents and the fence stored here, so every rule that keeps money from moving
-- twice is written into the schema: the conditional writes are functions that run in the caller's
-- transaction, and the triggers below refuse what no code path may do, whichever code path it is
-- (the rail proxy, an operator's psql session, a bug).
--
-- This part: reference data, then the tables with their constraints and indexes. The functions and
-- triggers follow in the next parts, grouped by what they do (plain SQL functions check the tables
-- they name when they are created, so every table comes first).

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
