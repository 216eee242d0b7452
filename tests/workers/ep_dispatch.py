"""Expert-parallel dispatch and combine against plain PyTorch, on the ranks of one ep group.

Run by tests/unit/parallelisms/test_expert_parallel.py on 2 ranks (`harness.launch_workers`). Every rank builds the same
Qwen3-MoE layer and every rank's input; the reference runs the layer over all ranks' tokens in one process
(no seam), its loss the sum over the ranks of each rank's output against its own output gradient; the
expert-parallel copy holds num_experts / ep experts and runs this rank's tokens only. Compared (max abs
difference): the output, the input's gradient (this rank's tokens), the router's gradient summed over the
ranks (as the data-parallel plan's reduction sums before it averages), and this rank's experts' gradients
times ep (`ExpertShard.run` scales them by 1 / ep so that the data-parallel average is the mean over ranks).
Both expert kernels (grouped GEMM and the loop) run. Negative controls: a dispatch whose rows carry no
gradient back (no backward all-to-all), and expert gradients without the 1 / ep scale. Rank 0 writes {case:
{quantity: max difference over the ranks}} as JSON.
"""

from __future__ import annotations

import copy
import json
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from harness import end_worker  # noqa: E402
from titanlite.models.common.moe import MoE  # noqa: E402
from titanlite.parallelisms.expert_parallel.unit import ExpertShard, apply_expert_parallel  # noqa: E402

DIM, HIDDEN, EXPERTS, TOP_K, TOKENS = 32, 16, 8, 2, 24


class _NoBackwardDispatch(ExpertShard):
    """Negative control: the dispatched rows are detached, so no gradient returns through the all-to-all."""

    def dispatch(self, rows, counts):
        return super().dispatch(rows.detach(), counts)


def run_case(mesh: DeviceMesh, grouped: bool, control: str | None) -> dict[str, float]:
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    reference = MoE(DIM, HIDDEN, EXPERTS, TOP_K, norm_topk_prob=True, grouped=grouped)
    for p in reference.parameters():
        torch.nn.init.normal_(p, std=0.3)
    xs = torch.randn(world, TOKENS, DIM)
    grads = torch.randn(world, TOKENS, DIM)
    ep = copy.deepcopy(reference)
    x_ref = xs.clone().requires_grad_()
    out_ref = reference(x_ref.view(1, -1, DIM)).view_as(xs)
    (out_ref * grads).sum().backward()

    [experts] = apply_expert_parallel(ep, mesh)
    if control == "no_backward_dispatch":
        shard = experts.expert_parallel
        experts.expert_parallel = _NoBackwardDispatch(shard.degree, shard.rank, shard.group_name)
    x = xs[rank].clone().requires_grad_()
    out = ep(x.view(1, TOKENS, DIM)).view(TOKENS, DIM)
    (out * grads[rank]).sum().backward()
    gate_grad = ep.gate.weight.grad.clone()
    dist.all_reduce(gate_grad)
    scale = 1 if control == "unscaled" else world
    local = slice(rank * EXPERTS // world, (rank + 1) * EXPERTS // world)
    diffs = {
        "out": (out - out_ref[rank]).abs().max().item(),
        "input_grad": (x.grad - x_ref.grad[rank]).abs().max().item(),
        "gate.grad": (gate_grad - reference.gate.weight.grad).abs().max().item(),
    }
    for name in ("gate_up_proj", "down_proj"):
        grad = getattr(experts, name).grad.to_local() * scale
        diffs[f"experts.{name}.grad"] = (grad - getattr(reference.experts, name).grad[local]).abs().max().item()
    return diffs


def main() -> None:
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    cases = {"grouped": (True, None), "loop": (False, None)}
    cases |= {"no_backward_dispatch": (True, "no_backward_dispatch"), "unscaled": (True, "unscaled")}
    mesh, result = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",)), {}
    for case, (grouped, control) in cases.items():
        diffs = run_case(mesh, grouped, control)
        every: list = [None] * world
        dist.all_gather_object(every, diffs)
        result[case] = {k: max(d[k] for d in every) for k in diffs}
    if dist.get_rank() == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(result, f)
    end_worker()


if __name__ == "__main__":
    main()
