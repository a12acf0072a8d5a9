#!/usr/bin/env bash
# The test suite: prepares the environment if needed (idempotent), then runs pytest.
#   bash scripts/run_tests.sh [pytest args...]
# Golden-output parity tests read ../shared/fixtures (skipped with a reason when absent;
# set FLATTEN_MM_SHARED to point elsewhere).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash scripts/setup_env.sh
VENV="${FLATTEN_MM_VENV:-$ROOT/.venv}"
# Test files run in parallel worker processes (pytest-xdist; a file stays on one worker, so
# its module fixtures are built once): one per core, at most 4 (each may hold a few GiB);
# FLATTEN_MM_TEST_WORKERS=0 runs everything in this process.
WORKERS="${FLATTEN_MM_TEST_WORKERS:-$(( $(nproc) < 4 ? $(nproc) : 4 ))}"
# pytest exits 5 when nothing was collected: that is a failure here, like any non-zero code.
exec "$VENV/bin/python" -m pytest tests -ra --durations=25 -n "$WORKERS" --dist loadfile "$@"
