#!/usr/bin/env bash
# Test titanlite with one torch release: build a side environment with that torch from the package index,
# then run the fast test tier and a 2-rank compiled, bucketed run_train.sh in it. Prints one summary line;
# exit code 0 only if both passed.
#
#   scripts/torch_matrix.sh VERSION [pytest arguments]     e.g. scripts/torch_matrix.sh 2.11.0
#
# The environment lives outside the checkout, in $TITANLITE_MATRIX_DIR/torch-VERSION (default
# ~/.cache/titanlite), and is reused by the next call. torch comes from the package index as pip chooses it
# (on Linux x86-64 a CUDA build, which also runs on CPU); the runtime and test requirements are installed
# beside it by scripts/deps.py, which never touches torch.
# A pip constraint that caps torch (PIP_CONSTRAINT, pip.conf) must be lifted for newer releases:
# PIP_CONSTRAINT=/dev/null scripts/torch_matrix.sh 2.15.0.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
[ $# -ge 1 ] || { echo "usage: scripts/torch_matrix.sh VERSION [pytest arguments]" >&2; exit 2; }
VERSION=$1; shift
[[ "$VERSION" =~ ^[0-9]+\.[0-9]+(\.[0-9]+)?$ ]] || { echo "titanlite: error: VERSION such as 2.11.0, got '$VERSION'" >&2; exit 2; }
[[ "$VERSION" =~ ^[0-9]+\.[0-9]+$ ]] && VERSION="$VERSION.0"
ENV=${TITANLITE_MATRIX_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/titanlite}/torch-$VERSION
PY="$ENV/bin/python"

if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  echo "titanlite: building $ENV (torch $VERSION)" >&2
  rm -rf "$ENV"
  python3 -m venv "$ENV"
  # The index's default Linux wheel is a CUDA build: it runs on CPU, but imports its CUDA libraries
  # (nvidia-*, about 4 GB): they come with it.
  "$PY" -m pip install --quiet --disable-pip-version-check "torch==$VERSION"
fi
"$PY" "$ROOT/scripts/deps.py" ensure --own-venv --extras dev,hf,wandb >/dev/null
TORCH=$("$PY" -c "import torch; print(torch.__version__)")

cd "$ROOT"
LOG=$(mktemp -d)
set +e
PYTHON="$PY" ./run_tests.sh -m "not slow" -q -p no:cacheprovider "$@" >"$LOG/tests.log" 2>&1
TESTS_RC=$?
TESTS=$(grep -E "^(=+ )?[0-9]+ (passed|failed)|(passed|failed).* in [0-9.]+s" "$LOG/tests.log" | tail -1 | tr -d '=')
PYTHON="$PY" NGPU=2 ./run_train.sh --compile.enable --compile.bucketing transformer_block --training.steps 10 \
  --metrics.log_freq 5 --job.dump_folder "$LOG/run" >"$LOG/train.log" 2>&1
TRAIN_RC=$?
set -e
GATHERS=$("$PY" - "$LOG/run/compile_report.json" <<'PY' 2>/dev/null || echo "no compile report"
import json, sys
r = json.load(open(sys.argv[1]))
ag = r["dp"]["all_gather"]
print(f"dp all-gathers per step {ag['before']} -> {ag['after']}, compile {r['compile_seconds']} s")
PY
)
RUN="exit $TRAIN_RC, $GATHERS"
echo "torch $TORCH: fast tier: ${TESTS:-no summary} (exit $TESTS_RC); 2-rank compiled bucketed run_train.sh: $RUN; logs in $LOG"
[ "$TESTS_RC" = 0 ] && [ "$TRAIN_RC" = 0 ]
