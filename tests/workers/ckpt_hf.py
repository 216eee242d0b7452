"""HF export/import across layouts, run by test_checkpoint_hf.py on 4 ranks (`harness.launch_workers`).

Exports a dp2 x tp2 SimpleFSDP model (streamed, small shards), checks on rank 0 that every exported
tensor equals the single-process model's (the init is layout-independent), then imports the folder into
a differently initialised dp2 x tp2 SimpleFSDP model and an FSDP2 dp4 model and compares their full
parameters (bitwise) and logits with the single-process model. Rank 0 writes a JSON result.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open
from torch.distributed.tensor import DTensor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from builders import config  # noqa: E402

from harness import end_worker, tiny_args  # noqa: E402
from titanlite.checkpoint.hf import INDEX, export_hf, import_hf  # noqa: E402
from titanlite.models.llama3 import SPEC, Transformer  # noqa: E402
from titanlite.planning.run_plan import RunPlan  # noqa: E402
from titanlite.run.build import build_model  # noqa: E402

# Uneven shards on purpose: vocab 257 does not divide by 4.
ARGS = tiny_args(n_layers=2)
SEQ = 16
ADAPTER = SPEC.hf_adapter


def build(dp_shard: int, tp: int, dp_impl: str, seed: int) -> torch.nn.Module:
    cfg = config(
        parallelism__dp_impl=dp_impl,
        parallelism__data_parallel_shard_degree=dp_shard,
        parallelism__tensor_parallel_degree=tp,
        training__seq_len=SEQ,
        training__seed=seed,
    )
    return build_model(RunPlan.build(cfg, dist.get_world_size(), args=dataclasses.replace(ARGS)), torch.device("cpu"))


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def main(folder: str, out: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    reference = Transformer(ARGS, seq_len=SEQ)
    reference.init_weights(seed=1)
    tokens = torch.randint(0, ARGS.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref_logits = reference(tokens)
    result: dict = {}

    export_hf(build(2, 2, "simple_fsdp", seed=1), folder, adapter=ADAPTER, bos_id=1, eos_id=2, max_shard_bytes=30_000)
    if rank == 0:
        weight_map = json.loads((Path(folder) / INDEX).read_text())["weight_map"]
        result["shards"] = len(set(weight_map.values()))
        same = True
        for fqn, param in reference.state_dict().items():
            name = ADAPTER.hf_name(fqn, ARGS)
            with safe_open(str(Path(folder) / weight_map[name]), framework="pt") as f:
                stored = f.get_tensor(name)
            expected = ADAPTER.to_hf(fqn, param, ARGS)
            same &= torch.equal(stored, expected)
        result["export_matches_single_process"] = same

    for layout, (dp_shard, tp, impl) in {
        "simple_fsdp dp2 x tp2": (2, 2, "simple_fsdp"),
        "fsdp2 dp4": (4, 1, "fsdp2"),
    }.items():
        model = build(dp_shard, tp, impl, seed=2)
        import_hf(model, folder, adapter=ADAPTER)
        equal = all(torch.equal(full(v), reference.state_dict()[k]) for k, v in model.state_dict().items())
        with torch.no_grad():
            logits = full(model(tokens))
        result[layout] = {"params_equal": equal, "logits_max_diff": (logits - ref_logits).abs().max().item()}
    if rank == 0:
        Path(out).write_text(json.dumps(result))
    end_worker()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
