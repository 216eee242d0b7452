#!/usr/bin/env bash
# The project's Python (set up on first use, as run_train.sh does) with titanlite importable from this
# checkout, for the tools: scripts/python.sh -m titanlite.tools.hf export ..., -m titanlite.tools.generate ...
set -euo pipefail
# The tools write and read Hugging Face folders (the tokenizer conversion): the `hf` extra too. Only what
# the environment lacks of it is installed, once (scripts/deps.py): after run_train.sh's set-up, that is
# the hf packages alone, not a second set-up.
TITANLITE_EXTRAS=${TITANLITE_EXTRAS:-hf}
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
exec "$PYTHON" "$@"
