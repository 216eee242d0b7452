#!/usr/bin/env bash
# One-GPU smoke test through the user's path: `NGPU=1 ./run_train.sh` trains the 1B config
# (train_configs/llama3_1b_gpu.toml: bf16, compiled and bucketed blocks, async checkpoints) for 20 steps, a
# second launch resumes from the step-10 checkpoint, and one table gives tokens/s, MFU, peak memory against
# the dry run, compile seconds, resume OK and flash attention OK. Exit code 0 only if every check passed.
#
#   scripts/gpu_smoke.sh [--steps 20] [--json FILE] [--dump DIR] [--config FILE] [--section.key value ...]
#
# Uses GPU 0 (set CUDA_VISIBLE_DEVICES to choose). Without CUDA it runs the same steps on CPU in seconds
# (debug flavor, 4 steps, resume from step 2) so that the script keeps working. See benchmarks/gpu_smoke.py.
# All of it ends within --time-limit (7.5 minutes). It needs the runtime requirements only: on a GPU
# machine without internet, `PYTHON=python3 scripts/gpu_smoke.sh` uses the preinstalled torch as it is and
# installs what is missing (torchdata) from .wheelhouse/ in the checkout (docs/gpu.md: set-up).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
# No cd: --json, --dump and --config are relative to the current folder (the default config to the checkout).
exec "$PYTHON" "$TITANLITE_ROOT/benchmarks/gpu_smoke.py" "$@"
