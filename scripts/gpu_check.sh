#!/usr/bin/env bash
# One-GPU check: a ~1B Llama 3 (train_configs/llama3_1b_gpu.toml: bf16, compiled blocks) for a few dozen
# steps, and the same with float8 linear layers (tensorwise with float8 weight gathers, rowwise); prints
# one table of tokens/s, MFU and the peak memory against the dry-run estimate, a row per case.
#
#   scripts/gpu_check.sh [--cases bf16,float8_tensorwise,float8_rowwise] [--steps 30] [--warmup 5]
#       [--json FILE] [--config FILE] [--section.key value ...]
#
# The float8 cases need torchao (TITANLITE_EXTRAS=float8). Uses GPU 0 (set CUDA_VISIBLE_DEVICES to
# choose). Without CUDA it runs a tiny CPU version of the same path (debug flavor, 3 steps, float8
# emulated) that only shows the script works. See benchmarks/gpu_check.py.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$TITANLITE_ROOT"
exec "$PYTHON" benchmarks/gpu_check.py "$@"
