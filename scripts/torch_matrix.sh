#!/usr/bin/env bash
# Test titanlite with one torch release: build a side environment with that torch from the package index,
# then run the fast test tier and a 2-rank compiled, bucketed run_train.sh in it. Prints one summary line;
# exit code 0 only if what ran passed.
#
#   scripts/torch_matrix.sh [--smoke-only] VERSION [pytest arguments]     e.g. scripts/torch_matrix.sh 2.11.0
#
# --smoke-only: only the 2-rank run (CI runs it on the oldest and newest supported releases, .ci/run); the
# environment then gets the runtime requirements only, the test tools come with the first full call.
#
# The environment lives outside the checkout, in $TITANLITE_MATRIX_DIR/torch-VERSION (default
# ~/.cache/titanlite), and is reused by the next call. torch comes from the package index as pip chooses it
# (on Linux x86-64 a CUDA build, which also runs on CPU); the other requirements are installed beside it by
# scripts/deps.py, which never touches torch. The environment is the matrix's own: a pip constraint
# (PIP_CONSTRAINT, pip.conf) is not applied to it, as one that caps torch would refuse the release asked for.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
USAGE="usage: scripts/torch_matrix.sh [--smoke-only] VERSION [pytest arguments]"
SMOKE_ONLY=0
[ "${1:-}" = --smoke-only ] && { SMOKE_ONLY=1; shift; }
[ $# -ge 1 ] || { echo "$USAGE" >&2; exit 2; }
VERSION=$1; shift
[[ "$VERSION" =~ ^[0-9]+\.[0-9]+(\.[0-9]+)?$ ]] || { echo "titanlite: error: VERSION such as 2.11.0, got '$VERSION'" >&2; exit 2; }
[ "$SMOKE_ONLY" = 0 ] || [ $# = 0 ] || { echo "titanlite: error: --smoke-only runs no tests, got '$*'" >&2; exit 2; }
[[ "$VERSION" =~ ^[0-9]+\.[0-9]+$ ]] && VERSION="$VERSION.0"
ENV=${TITANLITE_MATRIX_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/titanlite}/torch-$VERSION
PY="$ENV/bin/python"
export PIP_CONSTRAINT=/dev/null

START=$SECONDS
BUILT="reused"
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  echo "titanlite: building $ENV (torch $VERSION)" >&2
  rm -rf "$ENV"
  python3 -m venv "$ENV"
  # The index's default Linux wheel is a CUDA build: it runs on CPU, but its libraries link the CUDA
  # libraries (nvidia-*, about 4 GB), so `import torch` needs them: they come with it.
  "$PY" -m pip install --quiet --disable-pip-version-check "torch==$VERSION"
  BUILT="built"
fi
EXTRAS=(--extras dev,hf,wandb,float8,ft)
[ "$SMOKE_ONLY" = 1 ] && EXTRAS=()
"$PY" "$ROOT/scripts/deps.py" ensure --own-venv "${EXTRAS[@]+"${EXTRAS[@]}"}" >/dev/null
TORCH=$("$PY" -c "import torch; print(torch.__version__)")
SETUP="environment $BUILT in $((SECONDS - START)) s"

cd "$ROOT"
LOG=$(mktemp -d)
set +e
TESTS_RC=0
if [ "$SMOKE_ONLY" = 0 ]; then
  PYTHON="$PY" ./run_tests.sh -m "not slow" -q -p no:cacheprovider "$@" >"$LOG/tests.log" 2>&1
  TESTS_RC=$?
  TESTS=$(grep -E "^(=+ )?[0-9]+ (passed|failed)|(passed|failed).* in [0-9.]+s" "$LOG/tests.log" | tail -1 | tr -d '=')
fi
RUN_START=$SECONDS
PYTHON="$PY" NGPU=2 ./run_train.sh --compile.enable --compile.bucketing transformer_block --training.steps 10 \
  --metrics.log_freq 5 --job.dump_folder "$LOG/run" >"$LOG/train.log" 2>&1
TRAIN_RC=$?
RUN_SECONDS=$((SECONDS - RUN_START))
set -e
GATHERS=$("$PY" - "$LOG/run/compile_report.json" <<'PY' 2>/dev/null || echo "no compile report"
import json, sys
r = json.load(open(sys.argv[1]))
ag = r["dp"]["all_gather"]
print(f"dp all-gathers per step {ag['before']} -> {ag['after']}, compile {r['compile_seconds']} s")
PY
)
RUN="exit $TRAIN_RC, $GATHERS, $RUN_SECONDS s"
if [ "$SMOKE_ONLY" = 1 ]; then
  echo "torch $TORCH: 2-rank compiled bucketed run_train.sh: $RUN; $SETUP; logs in $LOG"
else
  echo "torch $TORCH: fast tier: ${TESTS:-no summary} (exit $TESTS_RC); 2-rank compiled bucketed run_train.sh: $RUN; $SETUP; logs in $LOG"
fi
# Where the logs do not outlive the machine (CI), the end of a failed run's log says why.
[ "$TRAIN_RC" = 0 ] || tail -n 40 "$LOG/train.log" >&2
[ "$TESTS_RC" = 0 ] && [ "$TRAIN_RC" = 0 ]
