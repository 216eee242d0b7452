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
# runtime requirements are needed to train; TITANLITE_EXTRAS adds extras (run_tests.sh: dev,hf,wandb,float8,ft).
# Offline: TITANLITE_WHEELHOUSE=DIR (or a .wheelhouse/ folder in the checkout) is the only source, made by
# scripts/wheelhouse.sh on a connected machine; without one, an unreachable index is one line within seconds.
#
# A stop signal during the set-up (Ctrl-C, SIGTERM, SIGUSR1, to the script or its process group) is one line
# and exit code 128 + signal, with no child left behind: every Python child runs in the background through
# _titanlite_run (a background child of a non-interactive shell ignores SIGINT: no KeyboardInterrupt
# traceback), so the trap below runs at once, ends the child and waits for it. A script sourcing this file
# may set TITANLITE_STOPPED, the rest of the line (run_train.sh: nothing was trained before any rank).
TITANLITE_STOPPED=${TITANLITE_STOPPED:-during the set-up}
_titanlite_child=""
_titanlite_out=""
_titanlite_stop() {
  if [ -n "$_titanlite_child" ]; then
    kill -TERM "$_titanlite_child" 2>/dev/null || true
    wait "$_titanlite_child" 2>/dev/null || true
  fi
  [ -z "$_titanlite_out" ] || rm -f "$_titanlite_out"
  echo "titanlite: SIG$1 $TITANLITE_STOPPED" >&2
  exit "$2"
}
trap '_titanlite_stop INT 130' INT
trap '_titanlite_stop TERM 143' TERM
trap '_titanlite_stop USR1 138' USR1
# _titanlite_run CMD...: run CMD in the background and wait for it (a stop signal interrupts the wait);
# its stdout is left in _TITANLITE_STDOUT, its exit code returned.
_titanlite_run() {
  _titanlite_out=$(mktemp "${TMPDIR:-/tmp}/titanlite-setup.XXXXXX")
  "$@" >"$_titanlite_out" &
  _titanlite_child=$!
  local rc=0
  wait "$_titanlite_child" || rc=$?
  _titanlite_child=""
  _TITANLITE_STDOUT=$(<"$_titanlite_out")
  rm -f "$_titanlite_out"
  _titanlite_out=""
  return "$rc"
}
TITANLITE_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
TITANLITE_EXTRAS=${TITANLITE_EXTRAS:-}
_titanlite_fail() { echo "titanlite: error: $1" >&2; exit 2; }
_has_torch() { "$1" -c 'import importlib.util as u, sys; sys.exit(0 if u.find_spec("torch") else 1)' >/dev/null 2>&1; }
VENV="$TITANLITE_ROOT/.venv"
# Before anything is chosen or created (deps.py, which may run alone, checks it too).
case "${TITANLITE_TORCH:-auto}" in
  auto|cpu|cuda) ;;
  *) _titanlite_fail "TITANLITE_TORCH must be auto, cpu or cuda, got '$TITANLITE_TORCH'" ;;
esac
# Where the Python came from (deps.py --python-from): its hints name what the user can change.
if [ -n "${PYTHON:-}" ]; then
  command -v "$PYTHON" >/dev/null || _titanlite_fail "PYTHON=$PYTHON is not a program"
  _from=variable
elif [ -n "${VIRTUAL_ENV:-}${CONDA_PREFIX:-}" ] && command -v python >/dev/null && _has_torch python; then
  PYTHON=$(command -v python) _from=active
elif [ -x "$VENV/bin/python" ]; then
  PYTHON="$VENV/bin/python" _from=own
elif command -v python3 >/dev/null && _has_torch python3; then
  PYTHON=$(command -v python3) _from=path
else
  PYTHON="$VENV/bin/python" _from=own
fi
OWN_VENV=0 _from_arg=(--python-from "$_from")
[ "$_from" = own ] && OWN_VENV=1 _from_arg=(--own-venv)
_ENSURE=("$PYTHON" "$TITANLITE_ROOT/scripts/deps.py" ensure --extras "$TITANLITE_EXTRAS" "${_from_arg[@]}")
# Ready (0, the usual case: a fraction of a second), something to install (3), or one line and exit code 2.
_rc=3
if [ -x "$PYTHON" ] || [ "$OWN_VENV" = 0 ]; then
  _titanlite_run "${_ENSURE[@]}" --check && _rc=0 || _rc=$?
  TITANLITE_OVERLAY=$_TITANLITE_STDOUT
fi
if [ "$_rc" = 3 ]; then
  if [ -n "${SLURM_JOB_ID:-}" ]; then
    # Every node of the job would install into the same shared checkout at once.
    [ -x "$PYTHON" ] && _what="$PYTHON lacks ${TITANLITE_OVERLAY:-torch}" || _what="$VENV is not set up"
    _titanlite_fail "$_what; run 'bash scripts/env.sh' once on a login node, then submit the job"
  fi
  # One installer at a time (two launches on one machine): the second finds everything there.
  exec 9>"$TITANLITE_ROOT/.venv.lock"
  command -v flock >/dev/null && _titanlite_run flock 9
  if [ "$OWN_VENV" = 1 ] && [ ! -x "$PYTHON" ]; then
    echo "titanlite: setting up $VENV (one time)" >&2
    SYS_PY=$(command -v python3 || command -v python) || _titanlite_fail "no python3 to create $VENV with"
    _titanlite_run "$SYS_PY" -m venv "$VENV" || _titanlite_fail "'$SYS_PY -m venv $VENV' failed"
  fi
  _titanlite_run "${_ENSURE[@]}" || exit 2
  TITANLITE_OVERLAY=$_TITANLITE_STDOUT
  exec 9>&-
elif [ "$_rc" != 0 ]; then
  exit "$_rc"
fi
export PYTHON
export PYTHONPATH="$TITANLITE_ROOT${TITANLITE_OVERLAY:+:$TITANLITE_OVERLAY}${PYTHONPATH:+:$PYTHONPATH}"
if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  echo "titanlite: environment ready: $PYTHON${TITANLITE_OVERLAY:+ (with $TITANLITE_OVERLAY)}"
fi
