-- paydb: accounts, the double-entry ledger, payouts and their idempotency records, the rail
-- proxy's submissions, and the audit of every out-of-band action.
--
-- This file and the three after it (0038–0040) are the paydb baseline: the whole schema, in four
-- parts (tables; guards and the ledger's triggers; the payment resource's writes; idempotency
-- records, the batched writes and the rail proxy's writes). They replace three histories, all in
-- git history and listed in migrations/paydb/retired.tsv: versions 25–36 (the second baseline
-- and the migrations after it), versions 9–24, which that second baseline had replaced, and
-- versions 1–8, which the first baseline had replaced. A database whose migration rows are
-- exactly versions 25–36 is adopted when a service starts, which rewrites them to these four in
-- one transaction; one at an older history is refused with what to do
-- (services/server/src/squash.rs). A change goes into a new migration after these, written to
-- run again harmlessly.
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

-- Every PL/pgSQL function of the baseline that is not a trigger function carries three settings
-- (SET on the function; the statements it runs, the functions it calls and the triggers its
-- writes fire run under them; a psql session's own queries keep the defaults):
--
-- - plan_cache_mode = force_generic_plan: each statement is planned once per connection. A
--   statement of a PL/pgSQL function is planned through PostgreSQL's plan cache; under the
--   default (auto) a statement with parameters is planned again for its values on each of its
--   first five runs, and then on every run for as long as the generic plan is not estimated
--   cheaper, which for the batch functions' statements over unnest() of array parameters it
--   never is. Planning was then the largest single share of paydb's CPU: a profile of a new
--   user's `dlock run -f` of 1 500 payouts (perf, durable `dlock dev up`) put 18 % of
--   PostgreSQL's time in the planner and 11 % in starting executors. Every statement of these
--   functions looks rows up by key (payout, account, submission, idempotency key) or over the
--   batch's own arrays, so the plan does not depend on the values: one generic plan serves every
--   call.
-- - enable_seqscan = off: a connection is usually opened while the tables are small (a new
--   stack, a new replica), when the planner prices a sequential scan below index lookups, so the
--   generic plans of the batch functions scanned `payouts`, `rail_submission` and
--   `idempotency_records` whole, hashing them for joins with the batch's arrays, and kept doing
--   so as the tables grew (a new user's run of 1 500 payouts read 4.3 million rows that way).
--   Every one of these statements finds its rows by key, so with sequential scans priced out the
--   plans use the primary keys and unique indexes whatever the tables' size. A table with no
--   index that fits is still scanned: the setting prices scans, it does not forbid them.
-- - jit = off: pricing scans out lifts some plans' estimated cost above `jit_above_cost`, and
--   PostgreSQL then compiles the statement with LLVM on every execution (about 50 ms each,
--   measured on the store epoch's one-row read); these are statements of a millisecond.
--
-- Measured on a new user's run (1 500 payouts over 100 accounts at 32 workers, durable `dlock dev
-- up`, three runs alternated with three without the index settings): median 3.31 s against 3.99 s,
-- and a fifth less CPU over the run (docs/benchmarks.md). `CREATE OR REPLACE FUNCTION` drops a
-- function's SET clauses, so a later migration that replaces one of these functions says them
-- again; dlock/tests/it/generic_plans.rs fails on any PL/pgSQL function without them.

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
    ('RAIL_AMBIGUOUS', 'FAILED', 'operator resolution'),
    -- The store-epoch recovery only (pay_payouts_quarantine_guard): the rail has the payout and
    -- paydb lost its attempt.
    ('CLAIMED', 'RAIL_AMBIGUOUS', 'epoch recovery: on the rail, no attempt left in paydb');

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
    -- Maintained by the ledger trigger only, so it cannot drift from the entries
    -- (docs/contract.md#p5). A settlement account's balance is this plus the sum of its
    -- account_balance_shards.
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
    -- The highest token the account admitted with a proof the payment resource verified, raised by
    -- the fenced writes (claim, cancel, post). A fence is lowered (docs/design.md#fence-recovery)
    -- only to a token at or above it, so no code path, psql included, can lower a fence under a
    -- token that was used. A fence raised by a revocation floor (docs/design.md#d-3), which no
    -- holder presented, can still be lowered down to it: the recovery after the lock server's
    -- store was restored and hands out tokens below the floor. It only rises
    -- (pay_accounts_seen_guard). 0: no proven token yet.
    max_seen_token bigint NOT NULL DEFAULT 0
                  CONSTRAINT accounts_max_seen_token_check CHECK (max_seen_token >= 0),
    -- A fence below a token that an account has admitted would re-admit the holders between the
    -- two: a recovery may lower the fence to that token, never under it.
    CONSTRAINT accounts_fence_covers_seen_check CHECK (fence >= max_seen_token),
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
-- `rail-settlement-<currency>`, so double entry and the ledger-sum check (docs/contract.md#p5)
-- stay exact.
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

-- Per-account limits, set by the treasury (docs/contract.md#account-limits): the largest single
-- payout and the outflow per UTC day, enforced on every claim by pay_payouts_limits.
CREATE TABLE account_limits (
    account_id          text PRIMARY KEY REFERENCES accounts,
    -- The largest amount of one payout, minor units; NULL: no limit.
    max_payout_minor    bigint CONSTRAINT account_limits_max_payout_positive
                        CHECK (max_payout_minor > 0),
    -- The most the account's claims may take in one UTC day, minor units; NULL: no limit.
    daily_outflow_minor bigint CONSTRAINT account_limits_daily_outflow_positive
                        CHECK (daily_outflow_minor > 0),
    -- The treasury identity that set them, as its credential proved it.
    set_by              text NOT NULL CHECK (char_length(set_by) BETWEEN 1 AND 320),
    updated_at          timestamptz NOT NULL DEFAULT clock_timestamp()
);

-- What each account's claims took per UTC day: a claim (PENDING -> CLAIMED) adds its amount. A
-- re-claim (CLAIMED -> CLAIMED) holds nothing new and adds nothing; a claimed payout that later
-- fails or is abandoned still counts for its day (the limit bounds what was let out towards the
-- rail, not what finally settled).
CREATE TABLE account_daily_outflow (
    account_id    text NOT NULL REFERENCES accounts,
    day           date NOT NULL,
    claimed_minor bigint NOT NULL CHECK (claimed_minor > 0),
    PRIMARY KEY (account_id, day)
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


-- The postings written over more than one statement of a transaction (an operator's psql
-- session); each is checked at commit (pay_ledger_balanced_rows).
CREATE TABLE ledger_split_postings (
    reference   text NOT NULL,
    recorded_at timestamptz NOT NULL DEFAULT clock_timestamp()
);

-- =============================================================================================
-- Fundings (docs/contract.md#dual-approval)
-- =============================================================================================

-- Fundings that wait for a second treasury identity: above the payment resource's
-- auth.treasury.dual-approval-above (what one identity funds on an account alone in 24 hours),
-- a funding is recorded here, not applied; a second, different treasury identity approves it,
-- and the approval and the funding commit together, once (a conditional update; a CHECK keeps
-- the approver apart from the requester).
CREATE TABLE pending_fundings (
    funding_id   uuid PRIMARY KEY,
    account_id   text NOT NULL REFERENCES accounts,
    amount_minor bigint NOT NULL CHECK (amount_minor > 0),
    -- The funding's reference: applied, it is the ledger's `fund:<reference>`, so it names one
    -- funding for good.
    reference    text NOT NULL UNIQUE CHECK (char_length(reference) BETWEEN 1 AND 128),
    requested_by text NOT NULL CHECK (char_length(requested_by) BETWEEN 1 AND 320),
    requested_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    approved_by  text CHECK (char_length(approved_by) BETWEEN 1 AND 320),
    approved_at  timestamptz,
    -- Two people: the approver is never the requester, whatever wrote the row.
    CONSTRAINT pending_fundings_second_identity
        CHECK (approved_by IS NULL OR approved_by <> requested_by),
    CONSTRAINT pending_fundings_approved_at
        CHECK ((approved_by IS NULL) = (approved_at IS NULL))
);

-- Every funding applied without a second approval, with the treasury identity that asked for
-- it (its credential's identity). The ledger's `fund:<reference>` pair is the money; this row
-- is who put it there alone, and the window pay_fund_as sums.
CREATE TABLE direct_fundings (
    reference    text PRIMARY KEY CHECK (char_length(reference) BETWEEN 1 AND 128),
    account_id   text NOT NULL REFERENCES accounts,
    amount_minor bigint NOT NULL CHECK (amount_minor > 0),
    funded_by    text NOT NULL CHECK (char_length(funded_by) BETWEEN 1 AND 320),
    funded_at    timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE INDEX direct_fundings_window_idx ON direct_fundings (account_id, funded_by, funded_at);

-- =============================================================================================
-- Rail submissions (written by the rail proxy, read by the payment resource for P4)
-- =============================================================================================

CREATE TABLE rail_high_water (
    account_id    text PRIMARY KEY REFERENCES accounts,
    -- Strict: a token submits at most once per account (docs/contract.md#rail-step-1).
    highest_token bigint NOT NULL DEFAULT 0 CHECK (highest_token >= 0),
    updated_at    timestamptz NOT NULL DEFAULT clock_timestamp(),
    -- The highest token the rail proxy admitted a submission with whose proof it verified (as
    -- accounts.max_seen_token for the fence): the mark is lowered (rail_lower_high_water) only
    -- to a token at or above it, so an old, released grant's proof cannot readmit the
    -- submissions between it and a token that was used. A mark raised by a revocation floor
    -- (docs/design.md#d-3) or by a token admitted without a proof still comes down to a fresh
    -- proven grant. It only rises (pay_rail_seen_guard).
    max_seen_token bigint NOT NULL DEFAULT 0
                  CONSTRAINT rail_high_water_max_seen_token_check CHECK (max_seen_token >= 0),
    -- A mark below a token the proxy admitted would admit again the holders between the two: a
    -- recovery may lower it to that token, never under it.
    CONSTRAINT rail_high_water_covers_seen_check CHECK (highest_token >= max_seen_token)
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
    -- The rail's answer to a forward that came after the attempt was timed out (the sweeper made
    -- it TIMEOUT and its payout RAIL_AMBIGUOUS): kept here by rail_record, the payout staying
    -- quarantined, as the evidence a resolution is checked against (pay_resolve).
    late_outcome    text CONSTRAINT rail_submission_late_outcome_check
                    CHECK (late_outcome IN ('ACKED', 'REJECTED')),
    late_rail_reference text,
    late_at         timestamptz,
    -- An attempt is resolved exactly when it has an outcome other than unresolved.
    CHECK ((outcome = 'unresolved') = (resolved_at IS NULL)),
    CHECK ((response_status IS NULL) = (response_body IS NULL)),
    -- An answer is stored only for a resolved attempt.
    CHECK (response_status IS NULL OR outcome <> 'unresolved'),
    -- Only a timed-out attempt gets a late answer, once, with its time; an acknowledgement names
    -- the rail's reference, a refusal none.
    CONSTRAINT rail_submission_late_answer_check CHECK (
        (late_outcome IS NULL) = (late_at IS NULL)
        AND (late_outcome IS NULL OR outcome = 'TIMEOUT')
        AND ((late_outcome IS NOT DISTINCT FROM 'ACKED') = (late_rail_reference IS NOT NULL)))
);
-- One presented attempt per payout (docs/contract.md#rail-step-2). Fenced attempts never reached
-- the rail, so they must not block the legitimate holder (docs/design.md#d-2).
CREATE UNIQUE INDEX rail_submission_one_per_payout_idx ON rail_submission (payout_id)
    WHERE outcome <> 'FENCED';
-- Replay looks an attempt up by its key and token.
CREATE INDEX rail_submission_key_token_idx ON rail_submission (idempotency_key, presented_token);
-- The sweep of FENCED attempts (rail_sweep_fenced).
CREATE INDEX rail_submission_fenced_idx ON rail_submission (resolved_at) WHERE outcome = 'FENCED';
-- A payout's read (P4, GET /v1/payouts/{id}: the executor's re-read after every acquire,
-- docs/design.md#executor) lists the payout's attempts, FENCED ones included, in the order they
-- were presented; the partial unique index above leaves FENCED attempts out.
CREATE INDEX rail_submission_payout_idx ON rail_submission (payout_id, submitted_at, submission_id);

-- =============================================================================================
-- Idempotency records (docs/design.md#idempotency, docs/design.md#d-7)
-- =============================================================================================

CREATE TABLE idempotency_records (
    -- Method and concrete path (`POST /v1/payouts/{id}/claim` with the id filled in).
    route           text NOT NULL,
    idempotency_key text NOT NULL CHECK (char_length(idempotency_key) BETWEEN 1 AND 128),
    -- A newer holder re-uses the payout's stable key, so the token is part of the scope
    -- (docs/design.md#d-7). 0 for writes that carry no token.
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
-- Audit of the out-of-band actions: fence advances (docs/design.md#d-3), ambiguous
-- resolutions, fence recoveries (docs/design.md#d-8)
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

-- docs/design.md#d-3: every revocation floor pushed to the rail, attributed.
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

-- Recovery of an account poisoned by a forged fencing token (docs/design.md#d-8).
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
-- Reconciliation (docs/contract.md#resolve-evidence)
-- =============================================================================================

-- What `dlock reconcile` found for each RAIL_AMBIGUOUS payout it classified against the rail's
-- statement, append-only: present on the statement under the rail's reference, or absent from a
-- statement read at statement_read_at, with the settlement window the reconciler ran with.
-- Written through pay_record_finding; a resolution of an attempt whose outcome nobody recorded
-- stands on it (pay_resolve).
CREATE TABLE reconcile_findings (
    finding_id           bigserial PRIMARY KEY,
    payout_id            uuid NOT NULL REFERENCES payouts,
    verdict              text NOT NULL CHECK (verdict IN ('present', 'absent')),
    rail_reference       text CHECK (char_length(rail_reference) BETWEEN 1 AND 128),
    -- paydb's clock when the reconciler started reading the statement: not in the future.
    statement_read_at    timestamptz NOT NULL,
    settlement_window_ms bigint NOT NULL CHECK (settlement_window_ms >= 0),
    recorded_at          timestamptz NOT NULL DEFAULT clock_timestamp(),
    CHECK ((verdict = 'present') = (rail_reference IS NOT NULL)),
    CHECK (statement_read_at <= recorded_at)
);
CREATE INDEX reconcile_findings_payout ON reconcile_findings (payout_id);

-- The references POSTED resolutions recorded: one payout each, so a reference the rail paid once
-- cannot settle two payouts.
CREATE TABLE resolution_references (
    rail_reference text PRIMARY KEY,
    payout_id      uuid NOT NULL UNIQUE REFERENCES payouts,
    recorded_at    timestamptz NOT NULL DEFAULT clock_timestamp()
);

-- =============================================================================================
-- The store epoch: the fences and marks do not silently go back with paydb (docs/design.md#d-12)
-- =============================================================================================

-- The timeline paydb's fences were last written on, and whether its primary was replicating
-- synchronously when last looked at (pay_epoch_guard, in the next part, says what they decide).
CREATE TABLE pay_store_epoch (
    singleton   boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    timeline    bigint NOT NULL CHECK (timeline > 0),
    synchronous boolean NOT NULL,
    checked_at  timestamptz NOT NULL DEFAULT clock_timestamp()
);

-- Every epoch taken, by the rule or by an operator: kept, never swept.
CREATE TABLE pay_store_epoch_changes (
    changed_at    timestamptz NOT NULL DEFAULT clock_timestamp(),
    from_timeline bigint NOT NULL,
    to_timeline   bigint NOT NULL,
    decided_by    text NOT NULL CHECK (decided_by IN ('synchronous', 'operator')),
    token_floor   bigint CHECK (token_floor IS NULL OR token_floor > 0),
    fences_raised integer,
    marks_raised  integer,
    operator      text CHECK (operator IS NULL OR char_length(operator) BETWEEN 1 AND 128),
    reason        text CHECK (reason IS NULL OR char_length(reason) BETWEEN 1 AND 1024),
    -- The payouts the operator's confirmation quarantined (pay_epoch_quarantined).
    quarantined   integer,
    CHECK ((decided_by = 'operator') = (operator IS NOT NULL AND reason IS NOT NULL
                                        AND token_floor IS NOT NULL)),
    PRIMARY KEY (changed_at, to_timeline)
);

-- Every payout the recovery quarantined, for the operator: kept, never swept.
CREATE TABLE pay_epoch_quarantined (
    payout_id      uuid PRIMARY KEY REFERENCES payouts,
    to_timeline    bigint NOT NULL,
    from_state     text NOT NULL CHECK (from_state IN ('PENDING', 'CLAIMED')),
    quarantined_at timestamptz NOT NULL DEFAULT clock_timestamp()
);
