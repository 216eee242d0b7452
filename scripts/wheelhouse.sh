#!/usr/bin/env bash
# On a machine with internet: download the wheels titanlite's set-up installs, for a machine without it (an
# air-gapped cluster, a GPU image). Copy the folder into that machine's checkout as .wheelhouse/ (git-ignored;
# scripts/env.sh uses it without asking any index) or point TITANLITE_WHEELHOUSE at it.
#
#   scripts/wheelhouse.sh DIR [--python-version 3.12] [--platform TAG ...] [--extras hf,...] [--have FILE]
#                             [--torch torch==2.11.0]
#
# The runtime requirements of pyproject.toml and what they need, for CPython of --python-version (default:
# this Python's) on Linux x86-64 (manylinux wheels; --platform for others), as wheels only. torch is left
# out (the target has one, or brings its own build) unless --torch names one: with a CUDA build, that is
# gigabytes. --have takes the target's `python3 -m pip freeze` (or names, one a line): what it lists is not
# downloaded, which keeps the folder small. Extras: dev (the tests), hf, wandb, data.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
exec "${PYTHON:-python3}" "$ROOT/scripts/deps.py" wheelhouse "$@"
