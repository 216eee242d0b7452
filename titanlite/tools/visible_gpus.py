"""How many GPUs the ranks of this node can use: `python -m titanlite.tools.visible_gpus` prints the number.

`run_train.sh` starts one rank per GPU when `NGPU` is unset, and counts them here rather than with
`nvidia-smi -L`, whose lines ignore `CUDA_VISIBLE_DEVICES` (a scheduler's or the user's choice of GPUs)
and list a MIG-partitioned GPU once plus once per instance. torch's own count is what each rank will
see: `torch.cuda.device_count()` honours `CUDA_VISIBLE_DEVICES` (indices, GPU and MIG UUIDs, an empty
value) without initialising CUDA. A torch without CUDA (the CPU wheel) or without a working driver
sees 0, and run_train.sh then starts CPU processes.
"""

from __future__ import annotations

import sys

import torch


def visible_gpus() -> int:
    """CUDA devices a process started with this environment can use; 0 where CUDA is unusable."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def main() -> int:
    print(visible_gpus())
    return 0


if __name__ == "__main__":
    sys.exit(main())
