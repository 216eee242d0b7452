#!/usr/bin/env bash
# Runs the style and architecture checks (ruff, import-linter), then the test suite (set-up included on
# a fresh machine). Extra arguments go to pytest, e.g. ./run_tests.sh -m "not slow" for the fast tier.
set -euo pipefail
# The dev tools, and transformers as a real client of the Hugging Face export (`hf`), W&B's client (`wandb`),
# torchao for float8 training (`float8`), torchft for the replica groups (`ft`).
TITANLITE_EXTRAS=dev,hf,wandb,float8,ft
source "$(dirname "${BASH_SOURCE[0]}")/scripts/env.sh"
cd "$TITANLITE_ROOT"
# As modules: in an existing environment the tools may live in .deps/, whose scripts are not on PATH.
"$PYTHON" -m ruff check --quiet .
"$PYTHON" -m ruff format --check --quiet .
LINT=(-c 'import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())' --no-cache)
"$PYTHON" "${LINT[@]}" >/dev/null || "$PYTHON" "${LINT[@]}"
# The suite starts some 600 Python processes: with PYTHONDONTWRITEBYTECODE set (some images set it), each
# would compile titanlite's and the tests' sources again (and pytest rewrite every test module's asserts).
unset PYTHONDONTWRITEBYTECODE
# Two test processes, each module's tests in one of them (module fixtures run once): the two cores stay
# busy while a launch starts or one process compiles. `-n 0` runs everything in this process.
exec "$PYTHON" -m pytest -n 2 --dist loadfile "$@"
