#!/usr/bin/env bash
# The test command (README; .ci/run calls it): sets up ./.venv (or uses the active virtualenv),
# installs this checkout with its test extra (building the native library; ORT headers are fetched
# into a cache if the machine has none) and runs the fast suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
ORTSPARSE_EXTRAS=test . scripts/env.sh
python -m pytest -q "$@"
