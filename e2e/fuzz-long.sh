#!/usr/bin/env bash
# The long fuzz run (not part of CI): scripts/fuzz against one `dlock dev up` stack, round after
# round with fresh seeds, until DLOCK_FUZZ_REQUESTS requests were sent (default 100 000: about an
# hour on an otherwise idle 2-core machine at DLOCK_FUZZ_EXAMPLES=25, some 28 requests a second).
# Every check of the bounded run holds on every call: no 5xx beyond the documented ones, the
# documents' statuses, types and schemas, the error envelope, a rejected request changed nothing,
# a wrong role is refused; and every money-moving operation reached its handler. The run stops at
# the first round with a failure. The tallies and schemathesis's reports are kept in
# DLOCK_FUZZ_KEEP (default: a new directory, printed at the end). Figures of a run:
# docs/testing.md#fuzzing.
#
#   e2e/fuzz-long.sh                               # >= 100 000 requests
#   DLOCK_FUZZ_REQUESTS=20000 e2e/fuzz-long.sh     # shorter
set -euo pipefail
cd "$(dirname "$0")/.."

export DLOCK_FUZZ_REQUESTS="${DLOCK_FUZZ_REQUESTS:-100000}"
export DLOCK_FUZZ_EXAMPLES="${DLOCK_FUZZ_EXAMPLES:-25}"
export DLOCK_FUZZ_KEEP="${DLOCK_FUZZ_KEEP:-$(mktemp -d -t dlock-fuzz-long-XXXXXX)}"
status=0
./scripts/fuzz || status=$?
echo "fuzz-long: tallies and reports in $DLOCK_FUZZ_KEEP"
exit "$status"
