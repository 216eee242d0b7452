#!/usr/bin/env bash
# Runs the test suite (set-up included on a fresh machine). Extra arguments go to pytest,
# e.g. ./run_tests.sh -m "not slow" for the fast unit tests only.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/scripts/env.sh"
cd "$TITANLITE_ROOT"
exec "$PYTHON" -m pytest "$@"
