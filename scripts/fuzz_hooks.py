"""schemathesis 4.x hooks for scripts/fuzz.

Loaded through SCHEMATHESIS_HOOKS=fuzz_hooks (scripts/ on PYTHONPATH). The environment tells it
which service it is fuzzing, where the others are, the stack's credentials, and how to read the
fuzzed service's durable state:

  DLOCK_FUZZ_SERVICE      lock-server | payment-resource | rail-proxy | rail-stub
  DLOCK_FUZZ_BASE         the fuzzed service's base URL (rail stub: GET /statement)
  DLOCK_FUZZ_LOCK_SERVER, DLOCK_FUZZ_PAYMENT_RESOURCE, DLOCK_FUZZ_RAIL_PROXY
                          every service's base URL: the hooks make real accounts, payouts,
                          grants and rail attempts before a case that needs them
  DLOCK_FUZZ_PAYDB        paydb URL (payment resource, rail proxy)
  DLOCK_FUZZ_LOCKDB       lockdb URL (lock server)
  DLOCK_FUZZ_EXECUTOR, DLOCK_FUZZ_OPERATOR, DLOCK_FUZZ_TREASURY, DLOCK_FUZZ_REGISTRAR
                          the bearer credentials `dlock dev up` prints, one per role
  DLOCK_FUZZ_TALLY        a file the hooks append one JSON line per call to (operation, status,
                          code, credential sent, whether the case was filled with real state,
                          whether it reached the handler); `python3 scripts/fuzz_hooks.py
                          summary <files>` prints the per-operation table and fails when a
                          money-moving operation never reached its handler
  DLOCK_FUZZ_SEED         seeds the hooks' own choices (default: random)

What the hooks do to each case before it is sent (before_call):

  credential   the Authorization header of a role the operation allows (the table is
               services/server/src/auth/roles.rs, WRITES, which ROLE_TABLE below reads), and
               X-Owner-Id the identity of that credential. WRONG_ROLE of the writes instead get a
               role the operation does not allow and NO_CREDENTIAL none at all, to fuzz the refusal.
  real state   FILL of the cases get path parameters, fencing headers and body fields taken
               from objects made for them right before the call: a funded account and a
               registered payout (treasury, registrar), a grant on payout:{accountId} the
               executor or the operator acquired at the lock server (its token and proof), a
               payout claimed with that grant, submitted to the rail proxy, or quarantined as
               RAIL_AMBIGUOUS by the stub's redirects, an operator's fresh grant for a fence
               lowering, a pending funding above the dual-approval threshold. The remaining
               fields stay as schemathesis generated them, so the filled cases fuzz the
               handler's own checks (amounts, states, references) with everything around them
               valid. The durable state is digested after this, so what the hooks made is not
               counted as a change the fuzzed request made.

Custom checks:
  error_envelope           every 4xx/5xx body is the contract's envelope (ErrorBody in
                           services/contract/src/error.rs: code, message, retrySafe, traceId,
                           optional retryAfterMillis and details)
  rejected_changed_nothing a >= 400 answer left the service's durable state unchanged, except
                           for the rejections the contract itself records (see RECORDED)
  wrong_role_refused       a write sent with the credential of a role the table does not allow
                           for it, or with none, is 403 or 401
"""

import hashlib
import json
import os
import random
import re
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid

SERVICE = os.environ.get("DLOCK_FUZZ_SERVICE", "")
PAYDB = os.environ.get("DLOCK_FUZZ_PAYDB", "")
LOCKDB = os.environ.get("DLOCK_FUZZ_LOCKDB", "")
BASE = os.environ.get("DLOCK_FUZZ_BASE", "").rstrip("/")
LOCK = os.environ.get("DLOCK_FUZZ_LOCK_SERVER", "").rstrip("/")
PAY = os.environ.get("DLOCK_FUZZ_PAYMENT_RESOURCE", "").rstrip("/")
RAIL = os.environ.get("DLOCK_FUZZ_RAIL_PROXY", "").rstrip("/")
TALLY = os.environ.get("DLOCK_FUZZ_TALLY", "")

# The stack's credentials by role, and the identity each proves (`dlock dev up`'s tokens file,
# dlock/src/dev.rs: the operator's identity also holds the registrar role).
CREDENTIALS = {
    "executor": os.environ.get("DLOCK_FUZZ_EXECUTOR", ""),
    "operator": os.environ.get("DLOCK_FUZZ_OPERATOR", "dev-operator-token"),
    "treasury": os.environ.get("DLOCK_FUZZ_TREASURY", ""),
    "registrar": os.environ.get("DLOCK_FUZZ_REGISTRAR", ""),
}
IDENTITY = {"executor": "executor", "operator": "operator", "treasury": "treasury", "registrar": "registrar"}
HELD_BY = {"executor": {"executor"}, "operator": {"operator", "registrar"}, "treasury": {"treasury"}, "registrar": {"registrar"}}


def _role_table():
    """services/server/src/auth/roles.rs's WRITES, the services' one table of who may write
    what, read from the source rather than copied here: its lists of roles by name, and its rows
    (method, path pattern ('*' one segment), the roles' names). A table this cannot read stops
    the run."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "services", "server",
                        "src", "auth", "roles.rs")
    with open(path) as f:
        source = f.read()
    lists = {name: {role.lower() for role in re.findall(r"Role::(\w+)", roles)}
             for name, roles in re.findall(r"const (\w+): &\[Role\] = &\[([^\]]*)\];", source)}
    start = source.find("pub const WRITES")
    body = source[start:source.find("];", start)] if start >= 0 else ""
    rows = re.findall(r'\("([A-Z]+)", "([^"]+)", (\w+)\)', body)
    unknown = sorted({name for _, _, name in rows if not lists.get(name)})
    if not rows or unknown:
        raise SystemExit(f"fuzz hooks: cannot read the role table WRITES in {path} "
                         f"({len(rows)} rows; lists of roles not found: {unknown})")
    return lists, [(method, pattern, lists[name]) for method, pattern, name in rows]


ROLE_LISTS, ROLE_TABLE = _role_table()
# Who may hold sessions and locks (the executor, and the operator for its own grants).
HOLDER = ROLE_LISTS["HOLDER"]

# The operations that move money or the fences guarding it: the run fails when one of them
# never reached its handler (scripts/fuzz, docs/testing.md#fuzzing).
MONEY_MOVING = {
    "fund": "POST /v1/accounts/{accountId}/fund",
    "approve": "POST /v1/fundings/{fundingId}/approve",
    "register": "POST /v1/payouts",
    "claim": "POST /v1/payouts/{payoutId}/claim",
    "submit": "POST /v1/rail/submissions",
    "post": "POST /v1/payouts/{payoutId}/post",
    "cancel": "POST /v1/payouts/{payoutId}/cancel",
    "resolve": "POST /v1/payouts/{payoutId}/resolve",
    "lower (fence)": "POST /v1/accounts/{accountId}/fence/lower",
    "lower (rail mark)": "POST /v1/rail/high-water/{accountId}/lower",
}

# The positive control of rejected_changed_nothing: with DLOCK_FUZZ_PLANT=1 the hooks change
# the durable state after the digest, as a handler that wrote before refusing would, and every
# rejected call must fail the check; and a call drawn to carry a wrong role carries a right one,
# which wrong_role_refused must flag when it is accepted.
PLANT = os.environ.get("DLOCK_FUZZ_PLANT") == "1"
FILL = float(os.environ.get("DLOCK_FUZZ_FILL", "0.7"))
WRONG_ROLE = 0.1
NO_CREDENTIAL = 0.03
CURRENCY = "EUR"
# Fundings above this wait for a second treasury identity (scripts/fuzz starts the stack with
# --treasury-dual-approval-above at this value).
DUAL_APPROVAL_ABOVE = int(os.environ.get("DLOCK_FUZZ_DUAL_APPROVAL_ABOVE", "1000000"))

# Every table of migrations/lockdb and migrations/paydb that holds durable state. The lock
# server's waiter queue is not durable state (an entry lapses by itself) and is left out.
LOCKDB_TABLES = ["sessions", "locks", "lock_keys_seen", "revocations"]
PAYMENT_TABLES = [
    "accounts",
    "payouts",
    "payout_transitions",
    "ledger_entries",
    "audit_log",
    "rail_high_water",
    "rail_fence_advances",
]
# Idempotency records are left out on purpose: the contract stores a rejected write's answer so
# that its replay returns the same status and body (docs/contract.md#idempotency-rules), which is
# not a change of state.
# For the rail proxy, rail_submission rows with outcome FENCED are the contract's record of a
# refused submission (docs/contract.md#rail-step-1), so only the other rows count.
RAIL_SUBMISSION = "(SELECT * FROM rail_submission WHERE outcome IS DISTINCT FROM 'FENCED') t"

# Rejections the contract defines as recorded outcomes, not as "nothing happened":
# INSUFFICIENT_FUNDS moves the payout to FAILED (docs/contract.md#error-codes), RAIL_AMBIGUOUS
# quarantines it, and the rail's decline (422) records a REJECTED submission.
RECORDED = {"INSUFFICIENT_FUNDS", "RAIL_AMBIGUOUS"}

_state = threading.local()
_rng = random.Random(os.environ.get("DLOCK_FUZZ_SEED") or None)
_lock = threading.Lock()


def _table_digest_sql(source: str) -> str:
    return f"SELECT coalesce(md5(string_agg(md5(t::text), '' ORDER BY md5(t::text))), '-') FROM {source}"


class _Psql:
    """One psql process per database for the whole run: a digest is a query, not a connection."""

    def __init__(self):
        self.procs = {}

    def query(self, url: str, sql: str) -> str:
        proc = self.procs.get(url)
        if proc is None or proc.poll() is not None:
            proc = subprocess.Popen(
                ["psql", url, "-X", "-At", "-v", "ON_ERROR_STOP=0"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                bufsize=1,
            )
            self.procs[url] = proc
        marker = f"--end-{uuid.uuid4().hex}--"
        proc.stdin.write(sql.rstrip().rstrip(";") + ";\n\\echo " + marker + "\n")
        proc.stdin.flush()
        out = []
        while True:
            line = proc.stdout.readline()
            if not line:
                raise RuntimeError(f"psql on {url.split('@')[-1]} ended: {''.join(out)[-500:]}")
            if line.strip() == marker:
                break
            out.append(line)
        text = "".join(out).strip()
        if "ERROR" in text:
            raise RuntimeError(f"psql: {text[-500:]}")
        return text


_PSQL = _Psql()


def _psql(url: str, sql: str) -> str:
    return _PSQL.query(url, sql)


def _md5_digest() -> str:
    if SERVICE == "lock-server":
        parts = [_table_digest_sql(f"{t} t") for t in LOCKDB_TABLES]
        return _psql(LOCKDB, "SELECT " + " || ".join(f"({p})" for p in parts))
    parts = [_table_digest_sql(f"{t} t") for t in PAYMENT_TABLES]
    parts.append(_table_digest_sql(RAIL_SUBMISSION))
    return _psql(PAYDB, "SELECT " + " || ".join(f"({p})" for p in parts))


# The default digest is a counter of changed rows: a trigger on every table above adds one for
# each row inserted, deleted, or updated to other values (an update that writes the same values
# changes nothing, as with the md5 digest), in the writing transaction, so a rolled-back write
# counts nothing. It costs one row read per digest where the md5 digest reads every table, whose
# rows the run keeps adding (0.1 s per digest after 500 payouts). DLOCK_FUZZ_DIGEST=md5 takes
# the tables' contents instead.
DIGEST = os.environ.get("DLOCK_FUZZ_DIGEST", "counter")
_installed = set()


def _install_counter(url: str, tables) -> None:
    statements = [
        "CREATE TABLE IF NOT EXISTS fuzz_row_changes (id int PRIMARY KEY, n bigint NOT NULL)",
        "INSERT INTO fuzz_row_changes VALUES (1, 0) ON CONFLICT DO NOTHING",
        "CREATE OR REPLACE FUNCTION fuzz_count_change() RETURNS trigger LANGUAGE plpgsql AS "
        "$$ BEGIN UPDATE fuzz_row_changes SET n = n + 1 WHERE id = 1; RETURN NULL; END $$",
    ]
    for table, when in tables:
        extra = f" AND ({when})" if when else ""
        statements += [
            f"DROP TRIGGER IF EXISTS fuzz_count_ins_del ON {table}",
            f"DROP TRIGGER IF EXISTS fuzz_count_upd ON {table}",
            f"CREATE TRIGGER fuzz_count_ins_del AFTER INSERT OR DELETE ON {table} FOR EACH ROW "
            f"EXECUTE FUNCTION fuzz_count_change()",
            f"CREATE TRIGGER fuzz_count_upd AFTER UPDATE ON {table} FOR EACH ROW "
            f"WHEN (OLD.* IS DISTINCT FROM NEW.*{extra}) EXECUTE FUNCTION fuzz_count_change()",
        ]
    _psql(url, ";\n".join(statements))


def _counter_digest() -> str:
    if SERVICE == "lock-server":
        url, tables = LOCKDB, [(t, None) for t in LOCKDB_TABLES]
    else:
        url, tables = PAYDB, [(t, None) for t in PAYMENT_TABLES]
    if url not in _installed:
        _install_counter(url, tables)
        if SERVICE != "lock-server":
            # A FENCED submission is the contract's record of a refusal: inserting one is not a
            # change, and an update counts when the row is or becomes a presented attempt.
            _psql(url, "DROP TRIGGER IF EXISTS fuzz_count_ins_del ON rail_submission;\n"
                       "DROP TRIGGER IF EXISTS fuzz_count_upd ON rail_submission;\n"
                       "CREATE TRIGGER fuzz_count_ins_del AFTER INSERT OR DELETE ON rail_submission FOR EACH ROW "
                       "WHEN (false) EXECUTE FUNCTION fuzz_count_change()")
            _psql(url, "DROP TRIGGER IF EXISTS fuzz_count_ins_del ON rail_submission;\n"
                       "CREATE OR REPLACE FUNCTION fuzz_count_presented() RETURNS trigger LANGUAGE plpgsql AS "
                       "$$ BEGIN IF (TG_OP = 'DELETE' AND OLD.outcome IS DISTINCT FROM 'FENCED') OR "
                       "(TG_OP <> 'DELETE' AND NEW.outcome IS DISTINCT FROM 'FENCED') THEN "
                       "UPDATE fuzz_row_changes SET n = n + 1 WHERE id = 1; END IF; RETURN NULL; END $$;\n"
                       "CREATE TRIGGER fuzz_count_ins_del AFTER INSERT OR DELETE ON rail_submission FOR EACH ROW "
                       "EXECUTE FUNCTION fuzz_count_presented();\n"
                       "CREATE TRIGGER fuzz_count_upd AFTER UPDATE ON rail_submission FOR EACH ROW "
                       "WHEN (OLD.* IS DISTINCT FROM NEW.*) EXECUTE FUNCTION fuzz_count_presented()")
        else:
            # The lock server removes what has lapsed (dlock_sweep on a timer, an acquire clearing
            # the key's lapsed grant, migrations/lockdb/0016_baseline.sql): a grant or session
            # that had already ended, and a key past its retention, were free before the delete
            # and are after it, so deleting them is not a change of state.
            _psql(url, "CREATE OR REPLACE FUNCTION fuzz_count_lock_change() RETURNS trigger LANGUAGE plpgsql AS $$ "
                       "BEGIN IF TG_OP = 'DELETE' THEN "
                       "IF TG_TABLE_NAME = 'lock_keys_seen' THEN RETURN NULL; END IF; "
                       "IF TG_TABLE_NAME = 'sessions' AND OLD.expires_at <= clock_timestamp() THEN RETURN NULL; END IF; "
                       "IF TG_TABLE_NAME = 'locks' AND (OLD.expires_at <= clock_timestamp() OR NOT EXISTS "
                       "(SELECT 1 FROM sessions s WHERE s.session_id = OLD.session_id AND s.expires_at > clock_timestamp())) "
                       "THEN RETURN NULL; END IF; END IF; "
                       "UPDATE fuzz_row_changes SET n = n + 1 WHERE id = 1; RETURN NULL; END $$")
            for table in LOCKDB_TABLES:
                _psql(url, f"DROP TRIGGER IF EXISTS fuzz_count_ins_del ON {table};\n"
                           f"CREATE TRIGGER fuzz_count_ins_del AFTER INSERT OR DELETE ON {table} FOR EACH ROW "
                           f"EXECUTE FUNCTION fuzz_count_lock_change()")
        _installed.add(url)
    return _psql(url, "SELECT n FROM fuzz_row_changes WHERE id = 1")


def digest() -> str:
    """A digest of the fuzzed service's durable state."""
    if SERVICE in ("lock-server", "payment-resource", "rail-proxy"):
        return _md5_digest() if DIGEST == "md5" else _counter_digest()
    if SERVICE == "rail-stub":
        with urllib.request.urlopen(f"{BASE}/statement", timeout=30) as answer:
            return hashlib.sha256(answer.read()).hexdigest()
    return ""


# ---------------------------------------------------------------------------------------------
# Real state, made over HTTP with the right credentials.


class Setup(Exception):
    """A preparation step was not answered as the contract says: the case goes out unfilled."""


def _call(base, method, path, role=None, owner=None, body=None, headers=None, ok=(200, 201)):
    h = {"Content-Type": "application/json"}
    if role:
        h["Authorization"] = f"Bearer {CREDENTIALS[role]}"
        h["X-Owner-Id"] = owner or IDENTITY[role]
    h.update(headers or {})
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(base + path, data=data, method=method, headers=h)
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:
            status, raw = answer.status, answer.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    try:
        doc = json.loads(raw or b"null")
    except ValueError:
        doc = None
    if status not in ok:
        raise Setup(f"{method} {path}: {status} {doc}")
    return status, doc


def _key():
    return f"fuzz-{uuid.uuid4()}"


class World:
    """Accounts, payouts, sessions and grants made for the cases."""

    def __init__(self):
        self.sessions = {}
        self.shared = None
        self.quarantined = []

    def account(self, funded=500_000):
        account = f"fz-{uuid.uuid4().hex[:12]}"
        _call(PAY, "POST", "/v1/accounts", "treasury", body={"accountId": account, "currency": CURRENCY},
              headers={"X-Idempotency-Key": _key()}, ok=(201,))
        if funded:
            self.fund(account, funded)
        return account

    def fund(self, account, amount):
        return _call(PAY, "POST", f"/v1/accounts/{account}/fund", "treasury",
                     body={"amountMinor": amount, "reference": f"fz-{uuid.uuid4().hex}"},
                     headers={"X-Idempotency-Key": _key()}, ok=(200, 202))[1]

    def payout(self, account=None, amount=None):
        if account is None:
            # Eight payouts per funded account, then a new one: fewer calls per case, and the
            # funding (500 000) covers most of them.
            if self.shared is None or self.shared[1] >= 8:
                self.shared = [self.account(), 0]
            self.shared[1] += 1
            account = self.shared[0]
        payout = {
            "payoutId": str(uuid.uuid4()),
            "accountId": account,
            "amountMinor": amount or _rng.randint(1, 50_000),
            "currency": CURRENCY,
            "beneficiaryRef": f"ben-{uuid.uuid4().hex[:8]}",
        }
        _call(PAY, "POST", "/v1/payouts", "registrar", body=payout,
              headers={"X-Idempotency-Key": f"register-{payout['payoutId']}"}, ok=(201,))
        return payout

    def session(self, role, fresh=False):
        if fresh or role not in self.sessions or self.sessions[role][1] < time.monotonic():
            _, doc = _call(LOCK, "POST", "/v1/sessions", role, body={"ttlMillis": 60_000}, ok=(201,))
            if fresh:
                return doc["sessionId"]
            self.sessions[role] = (doc["sessionId"], time.monotonic() + 40)
        return self.sessions[role][0]

    def grant(self, account_or_key, role="executor", keep=False):
        """A grant on payout:{account} (or a key): its token and proof. Released at once unless
        `keep`: the payment resource and the rail proxy trust the token and proof, not the lock."""
        key = account_or_key if ":" in account_or_key else f"payout:{account_or_key}"
        body = {"sessionId": self.session(role), "waitMillis": 2000}
        try:
            _, grant = _call(LOCK, "POST", f"/v1/locks/{key}/acquire", role, body=body)
        except Setup:  # the session lapsed or was ended by a fuzzed call: a new one
            self.sessions.pop(role, None)
            body["sessionId"] = self.session(role)
            _, grant = _call(LOCK, "POST", f"/v1/locks/{key}/acquire", role, body=body)
        session = body["sessionId"]
        if not keep:
            _call(LOCK, "DELETE", f"/v1/locks/{key}", role, body={"sessionId": session},
                  headers={"X-Fencing-Token": str(grant["fencingToken"])}, ok=(204,))
        return grant

    def claimed(self, amount=None):
        payout = self.payout(amount=amount)
        grant = self.grant(payout["accountId"])
        _call(PAY, "POST", f"/v1/payouts/{payout['payoutId']}/claim", "executor", body={"expectedState": "PENDING"},
              headers=_fence_headers(grant) | {"X-Idempotency-Key": f"payout-{payout['payoutId']}"})
        return payout, grant

    def submitted(self):
        """A payout claimed and submitted; the rail's answer (ACKED, or RAIL_AMBIGUOUS for a
        redirect the stub answered)."""
        payout, grant = self.claimed()
        _, doc = _call(RAIL, "POST", "/v1/rail/submissions", "executor", body=payout,
                       headers=_fence_headers(grant) | {"X-Idempotency-Key": f"payout-{payout['payoutId']}"},
                       ok=(200, 409, 502))
        if isinstance(doc, dict) and doc.get("code") == "RAIL_AMBIGUOUS":
            self.quarantined.append((payout, doc))
        return payout, grant, doc

    def acked(self):
        for _ in range(5):
            payout, grant, doc = self.submitted()
            if doc.get("outcome") == "ACKED":
                return payout, grant, doc
        raise Setup("five submissions without an ACKED one")

    def ambiguous(self):
        if self.quarantined:  # one a post's preparation met on its way
            return self.quarantined.pop()
        for _ in range(60):
            try:
                payout, grant, doc = self.submitted()
            except Setup:
                continue
            if doc.get("code") == "RAIL_AMBIGUOUS":
                self.quarantined.pop()
                return payout, doc
        raise Setup("sixty submissions without a RAIL_AMBIGUOUS one (is --rail-redirect-rate set?)")


WORLD = World()


def _fence_headers(grant):
    return {"X-Fencing-Token": str(grant["fencingToken"]), "X-Fencing-Proof": grant.get("fencingProof") or ""}


# ---------------------------------------------------------------------------------------------
# Filling a case.


def _route(path):
    return re.sub(r"\{[^}]+\}", "*", path)


def allowed_roles(method, path):
    route = _route(path)
    for m, pattern, roles in ROLE_TABLE:
        if m == method and pattern == route:
            return roles
    return None  # a read: any role


def _set_body(case, **fields):
    body = case.body if isinstance(case.body, dict) else {}
    body = dict(body)
    body.update(fields)
    case.body = body


def _keep_or(case, field, value, valid):
    """The generated value when it is of the right kind half the time, else `value`."""
    body = case.body if isinstance(case.body, dict) else {}
    current = body.get(field)
    if valid(current) and _rng.random() < 0.5:
        return current
    return value


def _int(lo, hi):
    return lambda v: isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi


def _one_of(*values):
    return lambda v: v in values


def _keep_or_value(current, value, valid):
    return current if valid(current) and _rng.random() < 0.5 else value


def _text(n):
    return lambda v: isinstance(v, str) and n[0] <= len(v) <= n[1]


def _fill(case, op, role):
    """Fills `case` with real state for `op`; returns the owner id to send."""
    pp = case.path_parameters if case.path_parameters is not None else {}
    headers = {}
    w = WORLD
    if op == "POST /v1/accounts":
        _set_body(case, accountId=f"fz-{uuid.uuid4().hex[:12]}", currency=_keep_or(case, "currency", CURRENCY, lambda v: v == CURRENCY))
    elif op in ("POST /v1/accounts/{accountId}/fund", "POST /v1/accounts/{accountId}/limits", "GET /v1/accounts/{accountId}",
                "GET /v1/rail/high-water/{accountId}", "POST /v1/accounts/{accountId}/fence", "POST /v1/rail/high-water/{accountId}"):
        # A fresh account per case: a fence or mark moved to a generated floor, or a limit,
        # would otherwise stop the payouts of the accounts other cases use.
        pp["accountId"] = w.account(funded=_rng.choice([0, 500_000]))
        if op.endswith("/fund"):
            amount = _rng.choice([_rng.randint(1, 10_000), DUAL_APPROVAL_ABOVE + _rng.randint(1, 1000)])
            _set_body(case, amountMinor=_keep_or(case, "amountMinor", amount, lambda v: isinstance(v, int)),
                      reference=f"fz-{uuid.uuid4().hex}")
        if op.endswith("/fence") or op == "POST /v1/rail/high-water/{accountId}":
            _set_body(case, revocationId=str(uuid.uuid4()),
                      floor=_keep_or(case, "floor", _rng.randint(1, 10**9), _int(1, 2**63 - 1)),
                      operator=_keep_or(case, "operator", "fuzz", _text((1, 128))),
                      reason=_keep_or(case, "reason", "fuzz advances the fence", _text((8, 1024))))
        if op.endswith("/limits"):
            _set_body(case, maxPayoutMinor=_keep_or(case, "maxPayoutMinor", _rng.randint(1, 10**6), _int(1, 10**15)),
                      dailyOutflowMinor=_keep_or(case, "dailyOutflowMinor", None, _int(1, 10**15)))
    elif op == "POST /v1/fundings/{fundingId}/approve":
        account = w.account(funded=0)
        doc = w.fund(account, DUAL_APPROVAL_ABOVE + _rng.randint(1, 1000))
        if "fundingId" in doc:
            pp["fundingId"] = doc["fundingId"]
        case.body = {}
    elif op == "POST /v1/payouts":
        account = w.account()
        _set_body(case, payoutId=str(uuid.uuid4()), accountId=account, currency=CURRENCY,
                  amountMinor=_keep_or(case, "amountMinor", _rng.randint(1, 50_000), _int(1, 10**15)),
                  beneficiaryRef=_keep_or(case, "beneficiaryRef", "ben-1", _text((1, 128))))
    elif op == "GET /v1/locks":
        q = {k: v for k, v in (case.query or {}).items() if k == "limit"}
        q["limit"] = _keep_or_value(q.get("limit"), _rng.randint(1, 1000), _int(1, 1000))
        case.query = q
    elif op == "GET /v1/payouts/{payoutId}":
        pp["payoutId"] = w.payout()["payoutId"]
    elif op == "GET /v1/payouts":
        q = dict(case.query or {})
        q["accountId"] = w.payout()["accountId"]
        q["limit"] = _rng.randint(1, 500)
        q["state"] = _rng.choice(["PENDING", "CLAIMED", "POSTED", "FAILED", "RAIL_AMBIGUOUS"])
        for name in list(q):
            if name not in ("accountId", "limit", "state", "cursor") or (name == "cursor" and _rng.random() < 0.5):
                del q[name]
        case.query = q
    elif op == "POST /v1/payouts/{payoutId}/claim":
        if _rng.random() < 0.3:
            payout, old = w.claimed()  # a re-claim by a newer holder
            state = "CLAIMED"
        else:
            payout, state = w.payout(amount=_rng.choice([_rng.randint(1, 50_000), 900_000])), "PENDING"
        grant = w.grant(payout["accountId"])
        pp["payoutId"] = payout["payoutId"]
        headers = _fence_headers(grant) | {"X-Idempotency-Key": f"payout-{payout['payoutId']}"}
        _set_body(case, expectedState=_keep_or(case, "expectedState", state, _one_of("PENDING", "CLAIMED")))
    elif op == "POST /v1/rail/submissions":
        payout, grant = w.claimed()
        headers = _fence_headers(grant) | {"X-Idempotency-Key": f"payout-{payout['payoutId']}"}
        body = dict(payout)
        if _rng.random() < 0.3:  # one field of the payout's own changed: the handler names it
            field = _rng.choice(["amountMinor", "currency", "beneficiaryRef", "accountId"])
            generated = case.body.get(field) if isinstance(case.body, dict) else None
            if generated is not None:
                body[field] = generated
        case.body = body
    elif op == "POST /v1/payouts/{payoutId}/post":
        payout, grant, doc = w.acked()
        pp["payoutId"] = payout["payoutId"]
        headers = _fence_headers(grant) | {"X-Idempotency-Key": f"payout-{payout['payoutId']}"}
        _set_body(case, railOutcome="ACKED",
                  railReference=_keep_or(case, "railReference", doc["railReference"], _text((1, 128))),
                  submissionId=_keep_or(case, "submissionId", doc["submissionId"], _text((36, 36))))
    elif op == "POST /v1/payouts/{payoutId}/cancel":
        if _rng.random() < 0.5:
            payout, state = w.payout(), "PENDING"
        else:
            payout, state = w.claimed()[0], "CLAIMED"
        grant = w.grant(payout["accountId"], "operator")
        pp["payoutId"] = payout["payoutId"]
        headers = _fence_headers(grant) | {"X-Idempotency-Key": _key()}
        _set_body(case, expectedState=_keep_or(case, "expectedState", state, _one_of("PENDING", "CLAIMED")),
                  operator="fuzz", reason=_keep_or(case, "reason", "fuzzing a cancel", _text((8, 4096))))
    elif op == "POST /v1/payouts/{payoutId}/resolve":
        payout, _ = w.ambiguous()
        pp["payoutId"] = payout["payoutId"]
        headers = {"X-Idempotency-Key": _key()}
        outcome = _rng.choice(["POSTED", "FAILED"])
        fields = {"outcome": _keep_or(case, "outcome", outcome, lambda v: isinstance(v, str)), "operator": "fuzz",
                  "evidence": _keep_or(case, "evidence", "the rail's statement, fuzz", _text((1, 4096)))}
        if fields["outcome"] == "POSTED":
            fields["railReference"] = _keep_or(case, "railReference", f"fz-{uuid.uuid4().hex[:8]}", _text((1, 128)))
        _set_body(case, **fields)
    elif op in ("POST /v1/accounts/{accountId}/fence/lower", "POST /v1/rail/high-water/{accountId}/lower"):
        account = w.account()
        if _rng.random() < 0.5:  # a poisoned fence or mark: raised by a floor no holder presented
            floor = {"floor": _rng.randint(10**12, 10**15), "operator": "fuzz", "reason": "fuzz poisons the fence",
                     "revocationId": str(uuid.uuid4())}
            if "/rail/" in op:
                _call(RAIL, "POST", f"/v1/rail/high-water/{account}", "operator", body=floor)
            else:
                _call(PAY, "POST", f"/v1/accounts/{account}/fence", "operator", body=floor,
                      headers={"X-Idempotency-Key": _key()})
        grant = w.grant(account, "operator")
        pp["accountId"] = account
        headers = _fence_headers(grant) | {"X-Idempotency-Key": _key()}
        _set_body(case, operator="fuzz", reason=_keep_or(case, "reason", "fuzz lowers the fence", _text((8, 4096))))
    # The lock server.
    elif op == "POST /v1/sessions":
        if isinstance(case.body, dict) and "ownerId" in case.body and _rng.random() < 0.7:
            _set_body(case, ownerId=getattr(_state, "owner", None) or IDENTITY[role])
        if isinstance(case.body, dict):
            _set_body(case, ttlMillis=_keep_or(case, "ttlMillis", _rng.randint(1000, 60_000), _int(1000, 60_000)))
    elif op in ("POST /v1/sessions/{sessionId}/heartbeat", "DELETE /v1/sessions/{sessionId}"):
        pp["sessionId"] = WORLD.session(role, fresh=True)
    elif op == "POST /v1/locks/{key}/acquire":
        pp["key"] = f"payout:fz-{uuid.uuid4().hex[:8]}" if _rng.random() < 0.7 else _held_key(role)
        _set_body(case, sessionId=WORLD.session(role),
                  ttlMillis=_keep_or(case, "ttlMillis", _rng.randint(1000, 60_000), _int(1000, 60_000)),
                  waitMillis=_keep_or(case, "waitMillis", 0, _int(0, 2000)))
    elif op in ("POST /v1/locks/{key}/renew", "DELETE /v1/locks/{key}", "POST /v1/locks/{key}/revoke",
                "GET /v1/locks/{key}"):
        holder = role if role in HOLDER else "executor"
        key = f"payout:fz-{uuid.uuid4().hex[:8]}"
        grant = w.grant(key, holder, keep=True)
        pp["key"] = key
        if op.endswith("/revoke"):
            _set_body(case, operator="fuzz", reason=_keep_or(case, "reason", "fuzz revokes a grant", _text((8, 1024))),
                      expectedToken=_keep_or(case, "expectedToken", grant["fencingToken"], _int(1, 2**63 - 1)))
        elif op != "GET /v1/locks/{key}":
            headers = {"X-Fencing-Token": str(grant["fencingToken"])}
            _set_body(case, sessionId=grant["sessionId"])
            if op.endswith("/renew"):
                _set_body(case, ttlMillis=_keep_or(case, "ttlMillis", _rng.randint(1000, 60_000), _int(1000, 60_000)))
    else:
        return False, headers
    if case.path_parameters is not None or pp:
        case.path_parameters = pp
    return True, headers


def _held_key(role):
    key = f"payout:fz-{uuid.uuid4().hex[:8]}"
    WORLD.grant(key, "executor", keep=True)
    return key


def _operation(case):
    return f"{case.method.upper()} {case.operation.path}"


def before_call(context, case, kwargs):
    op = _operation(case)
    method = case.method.upper()
    roles = allowed_roles(method, case.operation.path)
    headers = dict(case.headers or {})
    for name in list(headers):
        if name.lower() == "authorization":
            del headers[name]
    # The credential: one of the operation's roles, a wrong one, or none.
    wrong = [r for r in CREDENTIALS if roles is not None and not (HELD_BY[r] & roles)]
    draw = _rng.random()
    if roles is None:
        credential, role = "right", _rng.choice(list(CREDENTIALS))
    elif wrong and draw < WRONG_ROLE:
        credential, role = "wrong", _rng.choice(wrong)
    elif draw < WRONG_ROLE + NO_CREDENTIAL:
        credential, role = "none", None
    else:
        credential = "right"
        role = _rng.choice([r for r in CREDENTIALS if HELD_BY[r] & roles])
    if SERVICE == "rail-stub":
        # The stub takes transfers from the rail proxy's identity only.
        submitter = os.environ.get("DLOCK_FUZZ_RAIL_SUBMITTER", "")
        if submitter and _rng.random() < 0.9:
            headers["Authorization"] = f"Bearer {submitter}"
        case.headers = headers
        _state.info = {"op": op, "credential": "right", "role": "rail-proxy", "filled": False}
        _state.before = digest()
        return
    # The identity's own owner id, or a worker of it, most of the time: a generated owner id is
    # foreign and only fuzzes the owner binding.
    owner = None
    if role is not None and method != "GET" and _rng.random() < 0.9:
        owner = IDENTITY[role] if _rng.random() < 0.7 else f"{IDENTITY[role]}/w{_rng.randint(1, 9)}"
    _state.owner = owner
    filled = False
    if _rng.random() < FILL:
        # The state is made as a right role would have it, whichever credential goes out.
        fill_role = role if credential == "right" else _rng.choice([r for r in CREDENTIALS if HELD_BY[r] & roles])
        try:
            filled, extra = _fill(case, op, fill_role)
            if filled and method != "GET" and _rng.random() < 0.8:
                # A fresh, valid key unless the operation's own is set below: a generated one
                # is mostly malformed and fuzzes only the header's parsing.
                for name in list(headers):
                    if name.lower() == "x-idempotency-key":
                        del headers[name]
                headers["X-Idempotency-Key"] = _key()
            headers.update(extra)
        except Setup as e:
            print(f"fuzz: could not prepare {op}: {e}", file=sys.stderr)
            filled = False
    sent_role = role
    if PLANT and credential == "wrong":  # the wrong_role_refused check's positive control
        sent_role = _rng.choice([r for r in CREDENTIALS if HELD_BY[r] & roles])
    if role is not None and CREDENTIALS.get(sent_role):
        headers["Authorization"] = f"Bearer {CREDENTIALS[sent_role]}"
        if owner is not None:
            for name in list(headers):
                if name.lower() == "x-owner-id":
                    del headers[name]
            headers["X-Owner-Id"] = owner
    case.headers = headers
    _state.info = {"op": op, "credential": credential, "role": role, "filled": filled}
    _state.before = digest()
    if PLANT:
        WORLD.grant(f"payout:fz-plant-{uuid.uuid4().hex[:8]}") if SERVICE == "lock-server" else WORLD.account()


def _body(response):
    try:
        return json.loads(response.content or b"null")
    except ValueError:
        return None


def reached(status, body):
    """Did the request get past authentication and body parsing into the handler?"""
    details = body.get("details") if isinstance(body, dict) else None
    details = details if isinstance(details, dict) else {}
    if status < 400 or status in (404, 409, 410, 422, 429):
        return True
    if status == 403 and "fundingId" in details:  # the requester approving its own funding
        return True
    if status == 400 and ("recordedOutcome" in details or "submissionId" in details):
        return True  # paydb's own refusal (a resolution against the record, a post's attempt)
    return False


def after_call(context, case, response):
    info = getattr(_state, "info", None)
    if not info or not TALLY:
        return
    body = _body(response)
    code = body.get("code") if isinstance(body, dict) else None
    line = dict(info, status=response.status_code, code=code, reached=reached(response.status_code, body),
                service=SERVICE, documented=case.method.upper() == case.operation.method.upper())
    if response.status_code >= 400 and isinstance(body, dict):
        line["message"] = str(body.get("message", ""))[:160]
    with _lock, open(TALLY, "a") as f:
        f.write(json.dumps(line) + "\n")


try:
    import schemathesis
except ImportError:  # the summary below runs without schemathesis
    schemathesis = None

if schemathesis is not None:
    schemathesis.hook(before_call)
    schemathesis.hook(after_call)

    @schemathesis.check
    def error_envelope(ctx, response, case):
        """Every 4xx/5xx answer is the contract's error envelope."""
        if response.status_code < 400:
            return None
        body = _body(response)
        if not isinstance(body, dict):
            raise AssertionError(f"{response.status_code} body is not a JSON object: {response.content[:200]!r}")
        missing = [f for f in ("code", "message", "retrySafe", "traceId") if f not in body]
        if missing:
            raise AssertionError(f"{response.status_code} envelope lacks {missing}: {body}")
        if not isinstance(body["code"], str) or not isinstance(body["message"], str):
            raise AssertionError(f"code and message must be strings: {body}")
        if not isinstance(body["retrySafe"], bool):
            raise AssertionError(f"retrySafe must be a boolean: {body}")
        if "retryAfterMillis" in body and not (
            isinstance(body["retryAfterMillis"], int) and body["retryAfterMillis"] >= 1
        ):
            raise AssertionError(f"retryAfterMillis must be a positive integer: {body}")
        if "details" in body and not isinstance(body["details"], dict):
            raise AssertionError(f"details must be an object: {body}")
        allowed = {"code", "message", "retrySafe", "retryAfterMillis", "details", "traceId"}
        extra = set(body) - allowed
        if extra:
            raise AssertionError(f"envelope carries fields outside the contract: {sorted(extra)}")
        return None

    @schemathesis.check
    def rejected_changed_nothing(ctx, response, case):
        """A rejected request (>= 400) changed no durable state."""
        if response.status_code < 400:
            return None
        before = getattr(_state, "before", None)
        if before is None:
            return None
        body = _body(response)
        code = body.get("code") if isinstance(body, dict) else None
        if code in RECORDED:
            return None
        if SERVICE == "rail-proxy" and response.status_code == 422:
            return None
        after = digest()
        if after != before:
            raise AssertionError(
                f"{case.method} {case.formatted_path} was answered {response.status_code} {code} "
                f"but the durable state of {SERVICE} changed"
            )
        return None

    @schemathesis.check
    def wrong_role_refused(ctx, response, case):
        """A write with a role its row does not allow, or with no credential, is refused."""
        info = getattr(_state, "info", None) or {}
        if info.get("credential") == "wrong" and response.status_code != 403:
            raise AssertionError(f"{_operation(case)} with the {info.get('role')} credential was answered "
                                 f"{response.status_code}, not 403")
        if info.get("credential") == "none" and response.status_code != 401:
            raise AssertionError(f"{_operation(case)} without a credential was answered {response.status_code}, not 401")
        return None


# ---------------------------------------------------------------------------------------------
# The per-operation table.


def summary(paths):
    rows = {}
    for path in paths:
        try:
            lines = open(path).read().splitlines()
        except FileNotFoundError:
            continue
        for raw in lines:
            t = json.loads(raw)
            if not t.get("documented", True):
                t["op"] = "(methods the document does not list)"
            r = rows.setdefault((t["service"], t["op"]), {"calls": 0, "reached": 0, "filled": 0, "wrong": 0, "statuses": {}})
            r["calls"] += 1
            r["reached"] += t["reached"]
            r["filled"] += t["filled"]
            r["wrong"] += t["credential"] != "right"
            key = str(t["status"]) + (f" {t['code']}" if t.get("code") else "")
            r["statuses"][key] = r["statuses"].get(key, 0) + 1
    total = sum(r["calls"] for r in rows.values())
    print(f"{'service':<17} {'operation':<46} {'calls':>6} {'filled':>6} {'refusal':>7} {'reached':>7}  answers")
    for (service, op), r in sorted(rows.items()):
        top = ", ".join(f"{k} x{n}" for k, n in sorted(r["statuses"].items(), key=lambda kv: -kv[1])[:5])
        print(f"{service:<17} {op:<46} {r['calls']:>6} {r['filled']:>6} {r['wrong']:>7} {r['reached']:>7}  {top}")
    print(f"total: {total} calls, {sum(r['reached'] for r in rows.values())} reached their handler")
    reached_ops = {op for (_, op), r in rows.items() if r["reached"] > 0}
    missing = [f"{name} ({op})" for name, op in MONEY_MOVING.items() if op not in reached_ops]
    if missing:
        print("fuzz: these money-moving operations never reached their handler: " + "; ".join(missing))
        return 1
    return 0


def selftest():
    """The digest's positive control: a change the hooks make moves it, a refused call does not."""
    global SERVICE
    for service in ("payment-resource", "lock-server"):
        SERVICE = service
        before = digest()
        try:
            _call(PAY, "POST", "/v1/accounts", "registrar", body={"accountId": "fz-refused", "currency": CURRENCY},
                  headers={"X-Idempotency-Key": _key()}, ok=(403,))
        except Setup as e:
            print(f"fuzz selftest: the registrar opening an account was not refused: {e}")
            return 1
        if digest() != before:
            print(f"fuzz selftest: the {service} digest moved on a refused call with nothing else running")
            return 1
        if service == "payment-resource":
            WORLD.account()
        else:
            WORLD.grant(f"payout:fz-selftest-{uuid.uuid4().hex[:6]}")
        if digest() == before:
            print(f"fuzz selftest: the {service} digest did not move when the hooks made state")
            return 1
    print("fuzz selftest: the digests move on a change and stay on a refusal (paydb, lockdb)")
    return 0


if __name__ == "__main__" and len(sys.argv) >= 2 and sys.argv[1] == "summary":
    sys.exit(summary(sys.argv[2:]))
if __name__ == "__main__" and len(sys.argv) >= 2 and sys.argv[1] == "selftest":
    sys.exit(selftest())
