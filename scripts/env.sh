# Sourced by run_train.sh, run_tests.sh and the other scripts: choose the Python, make sure it has what
# titanlite needs (scripts/deps.py), export PYTHON and PYTHONPATH. Run it alone (`bash scripts/env.sh`) to
# set up once, e.g. on a cluster's login node: inside a SLURM job nothing is installed (every node would
# install into the shared checkout at once), a missing package is one line and exit code 2.
#
# The Python, first match:
#   1. PYTHON=...                         used as it is; it must have torch 2.11 to 2.15 (CUDA or CPU)
#   2. the active virtualenv/conda env    if its python has torch
#   3. the checkout's .venv               if it exists
#   4. python3 on PATH                    if it has torch (a GPU image, a site container, a module)
#   5. else a new .venv with torch        CUDA build where nvidia-smi lists GPUs, else the CPU build;
#                                         TITANLITE_TORCH=cuda|cpu chooses (a login node without GPUs
#                                         setting up for GPU nodes: TITANLITE_TORCH=cuda)
# An environment of the user (1, 2, 4) is never changed: its torch is never reinstalled, and what it lacks
# (torchdata, say) is installed into .deps/<python>/ in the checkout, put on PYTHONPATH here. Only the
# runtime requirements are needed to train; TITANLITE_EXTRAS adds extras (run_tests.sh: dev,hf,wandb).
# Offline: TITANLITE_WHEELHOUSE=DIR (or a .wheelhouse/ folder in the checkout) is the only source, made by
# scripts/wheelhouse.sh on a connected machine; without one, an unreachable index is one line within seconds.
TITANLITE_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
TITANLITE_EXTRAS=${TITANLITE_EXTRAS:-}
_titanlite_fail() { echo "titanlite: error: $1" >&2; exit 2; }
_has_torch() { "$1" -c 'import importlib.util as u, sys; sys.exit(0 if u.find_spec("torch") else 1)' >/dev/null 2>&1; }
VENV="$TITANLITE_ROOT/.venv"
OWN_VENV=0
if [ -n "${PYTHON:-}" ]; then
  command -v "$PYTHON" >/dev/null || _titanlite_fail "PYTHON=$PYTHON is not a program"
elif [ -n "${VIRTUAL_ENV:-}${CONDA_PREFIX:-}" ] && command -v python >/dev/null && _has_torch python; then
  PYTHON=$(command -v python)
elif [ -x "$VENV/bin/python" ]; then
  PYTHON="$VENV/bin/python" OWN_VENV=1
elif command -v python3 >/dev/null && _has_torch python3; then
  PYTHON=$(command -v python3)
else
  PYTHON="$VENV/bin/python" OWN_VENV=1
fi
_ensure() {
  local own=()
  [ "$OWN_VENV" = 1 ] && own=(--own-venv)
  "$PYTHON" "$TITANLITE_ROOT/scripts/deps.py" ensure --extras "$TITANLITE_EXTRAS" "${own[@]+"${own[@]}"}" "$@"
}
# Ready (0, the usual case: a fraction of a second), something to install (3), or one line and exit code 2.
_rc=3
if [ -x "$PYTHON" ] || [ "$OWN_VENV" = 0 ]; then
  TITANLITE_OVERLAY=$(_ensure --check) && _rc=0 || _rc=$?
fi
if [ "$_rc" = 3 ]; then
  if [ -n "${SLURM_JOB_ID:-}" ]; then
    # Every node of the job would install into the same shared checkout at once.
    [ -x "$PYTHON" ] && _what="$PYTHON lacks ${TITANLITE_OVERLAY:-torch}" || _what="$VENV is not set up"
    _titanlite_fail "$_what; run 'bash scripts/env.sh' once on a login node, then submit the job"
  fi
  # One installer at a time (two launches on one machine): the second finds everything there.
  exec 9>"$TITANLITE_ROOT/.venv.lock"
  command -v flock >/dev/null && flock 9
  if [ "$OWN_VENV" = 1 ] && [ ! -x "$PYTHON" ]; then
    echo "titanlite: setting up $VENV (one time)" >&2
    SYS_PY=$(command -v python3 || command -v python) || _titanlite_fail "no python3 to create $VENV with"
    "$SYS_PY" -m venv "$VENV" >&2 || _titanlite_fail "'$SYS_PY -m venv $VENV' failed"
  fi
  TITANLITE_OVERLAY=$(_ensure) || exit 2
  exec 9>&-
elif [ "$_rc" != 0 ]; then
  exit "$_rc"
fi
export PYTHON
export PYTHONPATH="$TITANLITE_ROOT${TITANLITE_OVERLAY:+:$TITANLITE_OVERLAY}${PYTHONPATH:+:$PYTHONPATH}"
if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  echo "titanlite: environment ready: $PYTHON${TITANLITE_OVERLAY:+ (with $TITANLITE_OVERLAY)}"
fi
