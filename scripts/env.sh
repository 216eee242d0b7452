# Sourced by run_train.sh and run_tests.sh: find or build a Python environment with titanlite's
# dependencies and export PYTHON. On a cluster run it once on a login node (`bash scripts/env.sh`): inside
# a SLURM job it refuses to set up, since every node would install into the shared checkout at once. An active environment that already has them is used as is; otherwise
# a project-local .venv is created. Machines without an NVIDIA GPU get torch's CPU wheel, never the
# multi-GB CUDA build.
TITANLITE_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
TORCH_VERSION=2.13.0
# Extras to install besides the core: `dev` always (pytest, ruff, import-linter); run_tests.sh adds `hf`
# (transformers, tokenizers, datasets), which the tests of the Hugging Face export use as a real client.
TITANLITE_EXTRAS=${TITANLITE_EXTRAS:-dev}
_have_deps() {
  TITANLITE_EXTRAS="$TITANLITE_EXTRAS" "$1" - <<'PY' >/dev/null 2>&1
import importlib.util as u, os, sys
mods = ["torch", "torchdata", "tiktoken", "tensorboard", "safetensors", "pytest", "ruff", "importlinter"]
if "hf" in os.environ["TITANLITE_EXTRAS"].split(","):
    mods += ["transformers", "tokenizers", "datasets"]
sys.exit(0 if all(u.find_spec(m) for m in mods) else 1)
PY
}
if [ -n "${PYTHON:-}" ] && _have_deps "$PYTHON"; then
  :
elif command -v python >/dev/null && _have_deps python && [ -n "${VIRTUAL_ENV:-}${CONDA_PREFIX:-}" ]; then
  PYTHON=$(command -v python)
else
  VENV="$TITANLITE_ROOT/.venv"
  PYTHON="$VENV/bin/python"
  STAMP="$VENV/.titanlite-deps"
  WANT=$(cat "$TITANLITE_ROOT/pyproject.toml" | cksum)
  _venv_ready() { [ -x "$PYTHON" ] && [ "$(cat "$STAMP" 2>/dev/null)" = "$WANT" ] && _have_deps "$PYTHON"; }
  if ! _venv_ready && [ -n "${SLURM_JOB_ID:-}" ]; then
    # Every node of a job would create and pip-install the same folder on the shared filesystem at once.
    echo "titanlite: error: $VENV is not set up; run 'bash scripts/env.sh' once on a login node, then submit the job" >&2
    exit 2
  fi
  # One installer at a time (two launches on one machine); the second finds the environment ready.
  exec 9>"$TITANLITE_ROOT/.venv.lock"
  command -v flock >/dev/null && flock 9
  if ! _venv_ready; then
    echo "titanlite: setting up $VENV (one time)" >&2
    SYS_PY=$(command -v python3 || command -v python)
    [ -x "$PYTHON" ] || "$SYS_PY" -m venv "$VENV"
    # Bytecode is compiled at install: environments often set PYTHONDONTWRITEBYTECODE, and then every
    # process would compile torch's modules again at import.
    PIP=("$PYTHON" -m pip install -q --disable-pip-version-check)
    if ! "$PYTHON" -c "import torch" >/dev/null 2>&1; then
      if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then
        "${PIP[@]}" "torch==$TORCH_VERSION"
      else
        # The CPU wheel: from a local wheel cache if pip is configured with one, else PyTorch's CPU index.
        "${PIP[@]}" "torch==$TORCH_VERSION+cpu" 2>/dev/null \
          || "${PIP[@]}" "torch==$TORCH_VERSION+cpu" --index-url https://download.pytorch.org/whl/cpu \
               --extra-index-url https://pypi.org/simple
      fi
    fi
    "${PIP[@]}" -e "$TITANLITE_ROOT[$TITANLITE_EXTRAS]"
    echo "$WANT" > "$STAMP"
  fi
  exec 9>&-
fi
export PYTHON
export PYTHONPATH="$TITANLITE_ROOT${PYTHONPATH:+:$PYTHONPATH}"
if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  echo "titanlite: environment ready: $PYTHON"
fi
