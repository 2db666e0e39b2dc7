#!/usr/bin/env bash
# The test command (README; .ci/run calls it): installs the package with its test extra from this
# checkout (building the native library; ORT headers are fetched into a cache if the machine has
# none) and runs the fast suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q -e ".[test]"
python -m pytest -q "$@"
