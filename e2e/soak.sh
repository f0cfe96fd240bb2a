#!/usr/bin/env bash
# Soak (not part of CI): the whole local stack — a real PostgreSQL and the four services as
# separate `dlock serve` processes (`dlock dev up`) — driven by `dlock run` executors at full
# speed (rail latency 0, as the payouts benchmark) for DLOCK_SOAK_SECONDS (default 600).
#
# Every DLOCK_SOAK_SAMPLE_SECONDS (default 30) it samples each service's RSS (/proc/<pid>/status
# VmRSS), the machine's 1-minute load average (the cores may be shared) and, from paydb, the payouts POSTED in that window: throughput, and the latency p50/p99
# of each payout from its claim (the first claim's idempotency record) to its post (the POSTED
# transition). At the end it prints the table, the drift (last window vs first: RSS ratio per
# service, p99 ratio, throughput ratio) and the invariant figures (double payments on the rail
# statement, payouts left unsettled).
#
#   e2e/soak.sh                                  # 10 minutes, release build
#   DLOCK_SOAK_SECONDS=120 e2e/soak.sh           # shorter
#
# Knobs: DLOCK_SOAK_EXECUTORS (2 concurrent `dlock run`), DLOCK_SOAK_WORKERS (8 each),
# DLOCK_SOAK_BATCH (400 payouts per run), DLOCK_SOAK_ACCOUNTS (100), DLOCK_BIN (a dlock binary;
# default target/release/dlock, built if missing), DLOCK_SOAK_DIR (keep the data and logs there).
set -euo pipefail
cd "$(dirname "$0")/.."

DURATION=${DLOCK_SOAK_SECONDS:-600}
SAMPLE=${DLOCK_SOAK_SAMPLE_SECONDS:-30}
EXECUTORS=${DLOCK_SOAK_EXECUTORS:-2}
WORKERS=${DLOCK_SOAK_WORKERS:-8}
BATCH=${DLOCK_SOAK_BATCH:-400}
ACCOUNTS=${DLOCK_SOAK_ACCOUNTS:-100}
DLOCK=${DLOCK_BIN:-target/release/dlock}
DIR=${DLOCK_SOAK_DIR:-$(mktemp -d -t dlock-soak-XXXXXX)}
mkdir -p "$DIR/batches" "$DIR/logs"

for tool in jq curl; do
  command -v "$tool" >/dev/null || { echo "soak: needs $tool (apt-get install $tool)" >&2; exit 1; }
done
if [ ! -x "$DLOCK" ]; then
  echo "soak: building $DLOCK" >&2
  cargo build --release -p dlock
fi
PSQL=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1)/psql
[ -x "$PSQL" ] || { echo "soak: psql not found under /usr/lib/postgresql" >&2; exit 1; }

UP_PID=
LANES=()
cleanup() {
  for pid in "${LANES[@]}"; do kill "$pid" 2>/dev/null || true; done
  # The executor each lane has running (by pid), then the stack.
  for f in "$DIR"/lane-*.pid; do
    [ -f "$f" ] && kill "$(cat "$f")" 2>/dev/null || true
  done
  if [ -n "$UP_PID" ]; then
    kill -INT "$UP_PID" 2>/dev/null || true
    wait "$UP_PID" 2>/dev/null || true
  fi
}
trap cleanup EXIT

"$DLOCK" dev up --data-dir "$DIR/stack" >"$DIR/up.json" 2>"$DIR/logs/dev-up.log" &
UP_PID=$!
for _ in $(seq 1 240); do
  [ -s "$DIR/up.json" ] && break
  kill -0 "$UP_PID" 2>/dev/null || { cat "$DIR/logs/dev-up.log" >&2; exit 1; }
  sleep 0.5
done
[ -s "$DIR/up.json" ] || { echo "soak: dev up did not start" >&2; exit 1; }
UP=$(head -n 1 "$DIR/up.json")
LS=$(jq -r .lockServer <<<"$UP"); PR=$(jq -r .paymentResource <<<"$UP")
RP=$(jq -r .railProxy <<<"$UP"); RS=$(jq -r .railStub <<<"$UP")
PAYDB=$(jq -r .paydb <<<"$UP")
CRED=$(jq -r '.credentials.executor // empty' <<<"$UP")
TREASURY=$(jq -r '.credentials.treasury // empty' <<<"$UP")
declare -A PIDS=(
  [lock-server]=$(jq -r .pids.lockServer <<<"$UP")
  [payment-resource]=$(jq -r .pids.paymentResource <<<"$UP")
  [rail-proxy]=$(jq -r .pids.railProxy <<<"$UP")
  [rail-stub]=$(jq -r .pids.railStub <<<"$UP")
)
SERVICES=(lock-server payment-resource rail-proxy rail-stub)
OWNER=executor/soak
# Accounts are opened and funded by the treasury, the only identity allowed to.
auth=()
[ -n "$TREASURY" ] && auth=(-H "authorization: Bearer $TREASURY")

sql() { "$PSQL" -X -q -A -t -v ON_ERROR_STOP=1 "$PAYDB" -c "$1"; }

post() { # path idempotency-key body
  local code
  code=$(curl -s -o "$DIR/logs/last-post.json" -w '%{http_code}' -X POST "$PR$1" \
    -H 'content-type: application/json' -H "x-owner-id: treasury/soak" -H "x-idempotency-key: $2" \
    "${auth[@]}" -d "$3")
  case "$code" in 2??) ;; *) echo "soak: POST $1 -> $code $(cat "$DIR/logs/last-post.json")" >&2; exit 1 ;; esac
}

echo "soak: stack up ($LS), opening $ACCOUNTS accounts; data and logs in $DIR" >&2
for i in $(seq 0 $((ACCOUNTS - 1))); do
  a=$(printf 'soak-%03d' "$i")
  post /v1/accounts "open-$a" "{\"accountId\":\"$a\",\"currency\":\"EUR\"}"
  post "/v1/accounts/$a/fund" "fund-$a" "{\"amountMinor\":100000000000,\"reference\":\"seed-$a\"}"
done

batch_file() { # lane round
  local name="soak-l$1-r$2" file="$DIR/batches/soak-l$1-r$2.yaml"
  awk -v name="$name" -v n="$BATCH" -v accounts="$ACCOUNTS" -v lane="$1" -v w="$WORKERS" 'BEGIN {
    printf "apiVersion: dlock.io/v1alpha1\nkind: PayoutBatch\nmetadata:\n  name: %s\nspec:\n  workers: %d\n  payouts:\n", name, w
    for (i = 0; i < n; i++)
      printf "    - key: item-%05d\n      accountId: soak-%03d\n      amountMinor: %d\n      currency: EUR\n      beneficiaryRef: ben-%d\n", i, (i + lane * 37) % accounts, 100 + i % 900, i
  }' >"$file"
  echo "$file"
}

END=$(($(date +%s) + DURATION))
lane() { # lane
  local round=0 failures=0
  while [ "$(date +%s)" -lt "$END" ]; do
    round=$((round + 1))
    local file; file=$(batch_file "$1" "$round")
    DLOCK_CREDENTIAL="$CRED" "$DLOCK" run -f "$file" --lock-server "$LS" --payment-resource "$PR" \
      --rail-proxy "$RP" --workers "$WORKERS" --owner-id "$OWNER-$1" >>"$DIR/logs/lane-$1.log" 2>&1 &
    echo $! >"$DIR/lane-$1.pid"
    wait $! || failures=$((failures + 1))
    rm -f "$DIR/lane-$1.pid"
    rm -f "$file"
  done
  echo "$round $failures" >"$DIR/lane-$1.done"
}
for l in $(seq 1 "$EXECUTORS"); do
  lane "$l" &
  LANES+=($!)
done

rss() { awk '/^VmRSS:/ {printf "%.1f\n", $2 / 1024}' "/proc/$1/status" 2>/dev/null || echo 0; }

window() { # from to (epoch seconds): posted p50_ms p99_ms
  sql "WITH w AS (
         SELECT p.updated_at AS done,
                (SELECT min(r.first_seen_at) FROM idempotency_records r
                  WHERE r.route = 'POST /v1/payouts/' || p.payout_id || '/claim') AS started
           FROM payouts p
          WHERE p.state = 'POSTED' AND p.updated_at >= to_timestamp($1) AND p.updated_at < to_timestamp($2))
       SELECT count(*),
              round(coalesce(percentile_cont(0.5) WITHIN GROUP (ORDER BY extract(epoch FROM done - started) * 1000), 0)::numeric, 1),
              round(coalesce(percentile_cont(0.99) WITHIN GROUP (ORDER BY extract(epoch FROM done - started) * 1000), 0)::numeric, 1)
         FROM w WHERE started IS NOT NULL" | tr '|' ' '
}

TABLE=(); RATES=(); P99S=(); MEMS=()
header=$(printf '| %7s | %9s | %7s | %7s | %7s | %11s | %11s | %11s | %11s | %7s |' \
  "t (s)" "payouts/s" "posted" "p50 ms" "p99 ms" "lock MiB" "payment MiB" "proxy MiB" "stub MiB" "load 1m")
START=$(date +%s)
from=$START
echo "$header" >&2
while [ "$from" -lt "$END" ]; do
  to=$((from + SAMPLE)); [ "$to" -gt "$END" ] && to=$END
  now=$(date +%s); [ "$to" -gt "$now" ] && sleep $((to - now))
  read -r posted p50 p99 < <(window "$from" "$to")
  span=$((to - from)); [ "$span" -gt 0 ] || span=1
  rate=$(awk -v n="$posted" -v s="$span" 'BEGIN { printf "%.1f", n / s }')
  mem=()
  for s in "${SERVICES[@]}"; do mem+=("$(rss "${PIDS[$s]}")"); done
  load=$(cut -d ' ' -f 1 /proc/loadavg)
  row=$(printf '| %7d | %9s | %7d | %7s | %7s | %11s | %11s | %11s | %11s | %7s |' \
    $((to - START)) "$rate" "$posted" "$p50" "$p99" "${mem[0]}" "${mem[1]}" "${mem[2]}" "${mem[3]}" "$load")
  TABLE+=("$row"); RATES+=("$rate"); P99S+=("$p99"); MEMS+=("${mem[*]}")
  echo "$row" >&2
  from=$to
done
wait "${LANES[@]}" 2>/dev/null || true
LANES=()

runs=0; failed=0
for l in $(seq 1 "$EXECUTORS"); do
  r=0; f=0
  [ -f "$DIR/lane-$l.done" ] && read -r r f <"$DIR/lane-$l.done"
  runs=$((runs + r)); failed=$((failed + f))
done
total=$(sql "SELECT count(*) FROM payouts")
unsettled=$(sql "SELECT count(*) FROM payouts WHERE state NOT IN ('POSTED','FAILED','ABANDONED','RAIL_AMBIGUOUS')")
posted_total=$(sql "SELECT count(*) FROM payouts WHERE state = 'POSTED'")
ambiguous=$(sql "SELECT count(*) FROM payouts WHERE state = 'RAIL_AMBIGUOUS'")
transfers=$(wc -l <"$DIR/stack/rail-statement.jsonl" 2>/dev/null || echo '?')
DLOCK_CREDENTIAL="$CRED" "$DLOCK" reconcile --paydb "$PAYDB" --rail "$RS" --json \
  >"$DIR/reconcile.json" 2>"$DIR/logs/reconcile.log" || true
doubles=$(jq -r '.doublePayments // "?"' "$DIR/reconcile.json" 2>/dev/null || echo '?')
echo
echo "soak: ${DURATION} s, $EXECUTORS executors x $WORKERS workers, batches of $BATCH over $ACCOUNTS accounts, rail latency 0"
echo "$header"
echo "$header" | sed 's/[^|]/-/g'
printf '%s\n' "${TABLE[@]}"
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { if (a + 0 == 0) print "n/a"; else printf "%.2f", b / a }'; }
read -r -a FM <<<"${MEMS[0]}"; read -r -a LM <<<"${MEMS[-1]}"
echo
echo "drift (last window / first window):"
for i in "${!SERVICES[@]}"; do
  printf '  %-17s RSS %6s MiB -> %6s MiB   ratio %s\n' "${SERVICES[$i]}" "${FM[$i]}" "${LM[$i]}" "$(ratio "${FM[$i]}" "${LM[$i]}")"
done
printf '  %-17s     %6s ms  -> %6s ms    ratio %s\n' "payout p99" "${P99S[0]}" "${P99S[-1]}" "$(ratio "${P99S[0]}" "${P99S[-1]}")"
printf '  %-17s     %6s /s  -> %6s /s    ratio %s\n' "throughput" "${RATES[0]}" "${RATES[-1]}" "$(ratio "${RATES[0]}" "${RATES[-1]}")"
echo
echo "payouts $total (POSTED $posted_total, RAIL_AMBIGUOUS $ambiguous, unsettled $unsettled); executor runs $runs (failed $failed);"
echo "rail transfers $transfers; double payments (reconciler) $doubles"
[ "$doubles" = 0 ] && [ "$unsettled" = 0 ] && [ "$failed" = 0 ]
