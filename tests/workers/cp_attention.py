"""Context-parallel attention against plain PyTorch, on the ranks of one cp group.

Run by tests/unit/parallelisms/test_context_parallel.py on 2 ranks (`harness.launch_workers`). Every rank builds the
same Llama attention (GQA) and the same input; the reference runs it over the whole sequence in one process (no
seam); the context-parallel copy runs on this rank's head-tail part under its queries' causal mask, with keys and
values all-gathered over the world. Rank 0 writes the max abs differences of the output, the input's
gradient (this rank's part) and the weights' gradients (summed over the ranks, as the data-parallel
plan's reduction does), and the overlap of the K/V gather and of its gradient's reduce-scatter: the
matmuls run between each collective's issue and its wait (`OpOrder`), as JSON.
"""

from __future__ import annotations

import copy
import json
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from harness import end_worker, tiny_args  # noqa: E402
from titanlite.models.common.attention import causal_mask  # noqa: E402
from titanlite.models.llama3.model import attention  # noqa: E402
from titanlite.models.llama3.rope import rope_tables  # noqa: E402
from titanlite.parallelisms.context_parallel.unit import apply_context_parallel  # noqa: E402

SEQ, BATCH = 24, 2
C10D = torch.ops._c10d_functional


class OpOrder(TorchDispatchMode):
    """The collectives, their waits and the matmuls, in the order they run."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        names = {
            C10D.all_gather_into_tensor.default: "all_gather",
            C10D.reduce_scatter_tensor.default: "reduce_scatter",
            C10D.wait_tensor.default: "wait",
            torch.ops.aten.mm.default: "mm",
        }
        if func in names:
            self.ops.append(names[func])
        return func(*args, **(kwargs or {}))

    def mms_in_flight(self, collective: str) -> int:
        """The matmuls between the (one) `collective` and the next wait."""
        start = self.ops.index(collective)
        return self.ops[start : self.ops.index("wait", start)].count("mm")


def main() -> None:
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    torch.manual_seed(0)
    args = tiny_args()
    reference = attention(args)
    x = torch.randn(BATCH, SEQ, args.dim, requires_grad=True)
    grad_out = torch.randn(BATCH, SEQ, args.dim)
    cos, sin = rope_tables(args, SEQ)
    cp_attention = copy.deepcopy(reference)
    out = reference(x, cos, sin)
    out.backward(grad_out)

    shard = apply_context_parallel(cp_attention, init_device_mesh("cpu", (world,), mesh_dim_names=("cp",)))
    x_local = shard.shard(x.detach()).requires_grad_()
    held = shard.positions(SEQ // world, x.device)
    with OpOrder() as forward:
        out_local = cp_attention(x_local, cos[held], sin[held], causal_mask(BATCH, SEQ, held))
    with OpOrder() as backward:
        out_local.backward(shard.shard(grad_out))
    # The query projection runs while the keys and values are gathered; its two backward matmuls while
    # their gradient is reduce-scattered.
    overlap = {
        "gather": forward.mms_in_flight("all_gather"),
        "reduce_scatter": backward.mms_in_flight("reduce_scatter"),
    }
    diffs = {
        "out": (out_local - shard.shard(out.detach())).abs().max().item(),
        "input_grad": (x_local.grad - shard.shard(x.grad)).abs().max().item(),
    }
    for (name, p), (_, p_ref) in zip(cp_attention.named_parameters(), reference.named_parameters()):
        grad = p.grad.clone()
        dist.all_reduce(grad)
        diffs[f"{name}.grad"] = (grad - p_ref.grad).abs().max().item()
    every: list = [None] * world
    dist.all_gather_object(every, diffs)
    if dist.get_rank() == 0:
        with open(sys.argv[1], "w") as f:
            json.dump({"diffs": {k: max(d[k] for d in every) for k in diffs}, "mms_in_flight": overlap}, f)
    end_worker()


if __name__ == "__main__":
    main()
