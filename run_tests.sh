#!/usr/bin/env bash
# Runs the style and architecture checks (ruff, import-linter), then the test suite (set-up included on
# a fresh machine). Extra arguments go to pytest, e.g. ./run_tests.sh -m "not slow" for the fast tier.
set -euo pipefail
# The tests also drive transformers as a real client of the Hugging Face export: the `hf` extra.
TITANLITE_EXTRAS=dev,hf,wandb
source "$(dirname "${BASH_SOURCE[0]}")/scripts/env.sh"
cd "$TITANLITE_ROOT"
BIN=$(dirname "$PYTHON")
"$BIN/ruff" check --quiet .
"$BIN/ruff" format --check --quiet .
"$BIN/lint-imports" --no-cache >/dev/null || "$BIN/lint-imports" --no-cache
exec "$PYTHON" -m pytest "$@"
