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
# pytest exits 5 when nothing was collected: that is a failure here, like any non-zero code.
exec "$VENV/bin/python" -m pytest tests -ra --durations=15 "$@"
