#!/usr/bin/env bash
# The long chaos run (not part of CI, which runs the bounded version of the same test):
# dlock/tests/it/chaos/long.rs on one stack — lockdb and paydb on a PostgreSQL pair with a
# synchronous standby, the four services as processes, three `dlock run` executors per batch, a
# hostile rail — with every fault kind striking in turn (an executor paused past its lease, links
# slowed and reset, rail answers lost and late, kill -9 of the lock server, the payment resource and
# the rail proxy, the primary SIGKILLed and the standby promoted once), batch after batch, until
# both DLOCK_CHAOS_PAYOUTS payouts ran and DLOCK_CHAOS_SECONDS passed. Then the invariants: each
# clientRef once on the rail statement, every payout settled or RAIL_AMBIGUOUS, FAILED/ABANDONED
# with a reason, `dlock reconcile` without a critical finding and classifying every RAIL_AMBIGUOUS.
# It prints the figures (docs/faults.md#the-long-chaos-run) and exits non-zero if one is off.
#
#   e2e/chaos-long.sh                                       # an hour, at least 10 000 payouts
#   DLOCK_CHAOS_SECONDS=0 DLOCK_CHAOS_PAYOUTS=10000 e2e/chaos-long.sh   # sized by payouts only
#
# Knobs: DLOCK_CHAOS_SECONDS (3600), DLOCK_CHAOS_PAYOUTS (10000), DLOCK_CHAOS_BATCH (1000 payouts
# per batch), DLOCK_CHAOS_ACCOUNTS (40), DLOCK_CHAOS_PROFILE (debug or release; debug),
# DLOCK_CHAOS_DIR (where the binaries, the logs of every service and executor, the rail statement,
# the reconciler's findings and the run's output are kept; a new temporary directory by default).
# The binaries are copied there first, so a rebuild in the checkout during the run changes nothing.
# Needs PostgreSQL (its bin directory under /usr/lib/postgresql) and runs it as the current user,
# or as postgres when run as root, as the it tests do.
set -euo pipefail
cd "$(dirname "$0")/.."

export DLOCK_CHAOS_SECONDS=${DLOCK_CHAOS_SECONDS:-3600}
export DLOCK_CHAOS_PAYOUTS=${DLOCK_CHAOS_PAYOUTS:-10000}
export DLOCK_CHAOS_BATCH=${DLOCK_CHAOS_BATCH:-1000}
export DLOCK_CHAOS_ACCOUNTS=${DLOCK_CHAOS_ACCOUNTS:-40}
PROFILE=${DLOCK_CHAOS_PROFILE:-debug}
DIR=${DLOCK_CHAOS_DIR:-$(mktemp -d -t dlock-chaos-long-XXXXXX)}
mkdir -p "$DIR/bin" "$DIR/logs"

case "$PROFILE" in
  debug) flags=() ;;
  release) flags=(--release) ;;
  *) echo "chaos-long: DLOCK_CHAOS_PROFILE is debug or release, not $PROFILE" >&2; exit 2 ;;
esac

echo "chaos-long: building the $PROFILE test binary and dlock" >&2
if ! cargo test "${flags[@]}" -p dlock --test it --no-run --message-format=json \
  >"$DIR/build.json" 2>"$DIR/build.log"; then
  tail -n 30 "$DIR/build.log" >&2
  echo "chaos-long: the build failed (cargo test -p dlock --test it --no-run); its output is in $DIR/build.log" >&2
  exit 1
fi
test_bin=$(jq -r 'select(.reason == "compiler-artifact" and .target.name == "it" and .executable != null) | .executable' \
  <"$DIR/build.json" | tail -n 1)
[ -x "$test_bin" ] || { echo "chaos-long: the it test binary was not built (cargo test -p dlock --test it --no-run)" >&2; exit 1; }
cp "$test_bin" "$DIR/bin/it"
cp "target/$PROFILE/dlock" "$DIR/bin/dlock"
export DLOCK_BIN="$DIR/bin/dlock"
export DLOCK_CHAOS_KEEP="$DIR/logs"

echo "chaos-long: at least $DLOCK_CHAOS_PAYOUTS payouts and $DLOCK_CHAOS_SECONDS s; everything in $DIR" >&2
started=$(date +%s)
status=0
"$DIR/bin/it" --exact \
  chaos::long::every_fault_at_once_over_a_long_stream_pays_nobody_twice_and_loses_nothing \
  --nocapture 2>&1 | tee "$DIR/run.log" || status=$?
echo "chaos-long: $PROFILE build, $(( $(date +%s) - started )) s wall, exit $status; output in $DIR/run.log" >&2
exit "$status"
