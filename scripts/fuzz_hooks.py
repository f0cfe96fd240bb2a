"""schemathesis 4.x hooks for scripts/fuzz.

Loaded through SCHEMATHESIS_HOOKS=fuzz_hooks (scripts/ on PYTHONPATH). The environment tells it
which service it is fuzzing and how to read that service's durable state:

  DLOCK_FUZZ_SERVICE      lock-server | payment-resource | rail-proxy | rail-stub
  DLOCK_FUZZ_PAYDB        paydb URL (payment resource, rail proxy)
  DLOCK_FUZZ_LOCKDB       lockdb URL (lock server)
  DLOCK_FUZZ_BASE         the service's base URL (rail stub: GET /statement)
  DLOCK_FUZZ_EXECUTOR     the executor bearer token (ordinary writes)
  DLOCK_FUZZ_OPERATOR     the operator bearer token (revoke, fence, resolve, high-water)

Custom checks:
  error_envelope           every 4xx/5xx body is the contract's envelope (ErrorBody in
                           services/contract/src/error.rs: code, message, retrySafe, traceId,
                           optional retryAfterMillis and details)
  rejected_changed_nothing a >= 400 answer left the service's durable state unchanged, except
                           for the rejections the contract itself records (see RECORDED)
"""

import hashlib
import json
import os
import subprocess
import threading
import urllib.request

import schemathesis

SERVICE = os.environ.get("DLOCK_FUZZ_SERVICE", "")
PAYDB = os.environ.get("DLOCK_FUZZ_PAYDB", "")
LOCKDB = os.environ.get("DLOCK_FUZZ_LOCKDB", "")
BASE = os.environ.get("DLOCK_FUZZ_BASE", "").rstrip("/")
EXECUTOR = os.environ.get("DLOCK_FUZZ_EXECUTOR", "")
OPERATOR = os.environ.get("DLOCK_FUZZ_OPERATOR", "dev-operator-token")

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

OPERATOR_SUFFIXES = ("/revoke", "/fence", "/resolve")

_state = threading.local()


def _table_digest_sql(source: str) -> str:
    return f"SELECT coalesce(md5(string_agg(md5(t::text), '' ORDER BY md5(t::text))), '-') FROM {source}"


def _psql(url: str, sql: str) -> str:
    out = subprocess.run(
        ["psql", url, "-X", "-At", "-c", sql],
        check=True,
        capture_output=True,
        text=True,
        timeout=30,
    )
    return out.stdout.strip()


def digest() -> str:
    """A digest of the fuzzed service's durable state."""
    if SERVICE == "lock-server":
        parts = [_table_digest_sql(f"{t} t") for t in LOCKDB_TABLES]
        return _psql(LOCKDB, "SELECT " + " || ".join(f"({p})" for p in parts))
    if SERVICE in ("payment-resource", "rail-proxy"):
        parts = [_table_digest_sql(f"{t} t") for t in PAYMENT_TABLES]
        parts.append(_table_digest_sql(RAIL_SUBMISSION))
        return _psql(PAYDB, "SELECT " + " || ".join(f"({p})" for p in parts))
    if SERVICE == "rail-stub":
        with urllib.request.urlopen(f"{BASE}/statement", timeout=30) as answer:
            return hashlib.sha256(answer.read()).hexdigest()
    return ""


def _operator_route(case) -> bool:
    path = case.operation.path
    return case.method.upper() == "POST" and (
        path.endswith(OPERATOR_SUFFIXES) or path.startswith("/v1/rail/high-water/")
    )


@schemathesis.hook
def before_call(context, case, kwargs):
    # The credential per operation: the operator's for operator actions, the executor's else.
    token = OPERATOR if _operator_route(case) else EXECUTOR
    if token:
        headers = case.headers if case.headers is not None else {}
        if "Authorization" not in headers and "authorization" not in headers:
            headers["Authorization"] = f"Bearer {token}"
            case.headers = headers
    _state.before = digest()


def _body(response):
    try:
        return json.loads(response.content or b"null")
    except ValueError:
        return None


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
