"""Multi-process parity worker: train a tiny Llama under several layouts and compare with one process.

Run by tests through torchrun. Every rank also trains the single-process reference itself (plain
module, whole global batch), so no second launch is needed. Writes one JSON record per case from rank 0:
max relative loss difference over the steps, and max abs difference of gradients and updated parameters
after step 1.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from titanlite.config import JobConfig
from titanlite.models.llama3 import ModelArgs, Transformer
from titanlite.models.llama3.parallelize import parallelize_llama
from titanlite.optim import build_lr_scheduler, build_optimizer
from titanlite.parallelisms.parallel_dims import ParallelDims
from titanlite.step import cross_entropy_loss, training_step

# Uneven on purpose: vocab 257 and ffn 160 don't divide by 4 or 3.
ARGS = ModelArgs(dim=64, n_layers=3, n_heads=4, n_kv_heads=2, vocab_size=257, multiple_of=32, max_seq_len=64)
SEQ, GLOBAL_BATCH, STEPS, SEED = 16, 8, 5, 1234


def make_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(SEED)
    out = []
    for _ in range(STEPS):
        tokens = torch.randint(0, ARGS.vocab_size, (GLOBAL_BATCH, SEQ + 1), generator=g)
        out.append((tokens[:, :-1], tokens[:, 1:]))
    return out


def build(cfg: JobConfig, dims: ParallelDims | None) -> tuple[torch.nn.Module, torch.optim.Optimizer, object]:
    with torch.device("meta"):
        model = Transformer(ARGS, seq_len=SEQ)
    if dims is not None:
        dims.build_mesh("cpu")
        model = parallelize_llama(model, dims, cfg)
    model.to_empty(device="cpu")
    model.init_weights(seed=SEED)
    opt = build_optimizer(model, cfg.optimizer)
    sched = build_lr_scheduler(opt, cfg.lr_scheduler, STEPS)
    return model, opt, sched


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def run(cfg: JobConfig, dims: ParallelDims | None, batches, accum: int = 1, corrupt: bool = False):
    model, opt, sched = build(cfg, dims)
    rank_slice = slice(None)
    if dims is not None and dims.dp > 1:
        per = GLOBAL_BATCH // dims.dp
        r = dist.get_rank() // dims.tp
        rank_slice = slice(r * per, (r + 1) * per) if not corrupt else slice(0, per)
    use_lp = dims is not None and dims.tp > 1 and not cfg.parallelism.disable_loss_parallel
    losses, grads, params = [], None, None
    for step, (x, y) in enumerate(batches):
        x, y = x[rank_slice], y[rank_slice]
        micro = list(zip(x.chunk(accum), y.chunk(accum)))
        loss, _ = training_step(model, opt, sched, micro, cross_entropy_loss, use_lp, 1.0, torch.device("cpu"))
        if dims is not None and dims.dp > 1:
            dist.all_reduce(loss, op=dist.ReduceOp.AVG)  # tp ranks hold equal values: world avg == dp avg
        losses.append(loss.item())
        if step == 0:
            grads = {n: full(p.grad).clone() for n, p in model.named_parameters()}
            params = {n: full(p.detach()).clone() for n, p in model.named_parameters()}
    return losses, grads, params


def main() -> None:
    cases = json.loads(sys.argv[1])
    out_path = sys.argv[2]
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    batches = make_batches()
    world = dist.get_world_size()
    ref_cfg = JobConfig()
    ref_cfg.optimizer.lr = 1e-2
    ref_cfg.lr_scheduler.warmup_steps = 1
    ref = {}
    records = []
    for case in cases:
        cfg = JobConfig()
        cfg.optimizer.lr = 1e-2
        cfg.lr_scheduler.warmup_steps = 1
        cfg.training.mixed_precision_param = case.get("param_dtype", "float32")
        cfg.training.mixed_precision_reduce = case.get("reduce_dtype", "float32")
        cfg.parallelism.dp_impl = case.get("dp_impl", "simple_fsdp")
        cfg.parallelism.fsdp_reshard_after_forward = case.get("reshard", "default")
        cfg.activation_checkpoint.mode = case.get("ac", "none")
        cfg.activation_checkpoint.selective_ac_option = case.get("ac_option", "op")
        torch._dynamo.reset()  # each case compiles fresh models: drop the previous cases' cache entries
        cfg.compile.enable = case.get("compile", False)
        cfg.compile.backend = case.get("backend", "aot_eager")
        cfg.compile.bucketing = case.get("bucketing", "none")
        cfg.compile.scope = case.get("scope", "block")
        cfg.job.dump_folder = os.path.join(os.path.dirname(out_path), f"case{len(records)}")
        dims = ParallelDims(dp_replicate=case.get("rep", 1), dp_shard=case.get("shard", -1), tp=case.get("tp", 1),
                            world_size=world, n_heads=ARGS.n_heads, n_kv_heads=ARGS.kv_heads,
                            dp_impl=cfg.parallelism.dp_impl)
        accum = case.get("accum", 1)
        losses, grads, params = run(cfg, dims, batches, accum, case.get("corrupt", False))
        if not ref:
            ref["fp32"] = run(ref_cfg, None, batches)
        r_losses, r_grads, r_params = ref["fp32"]
        rec = dict(case=case, losses=losses, ref_losses=r_losses,
                   loss_rel=max(abs(a - b) / abs(b) for a, b in zip(losses, r_losses)),
                   grad_abs=max((grads[n] - r_grads[n]).abs().max().item() for n in r_grads),
                   param_abs=max((params[n] - r_params[n]).abs().max().item() for n in r_params))
        report = os.path.join(cfg.job.dump_folder, "compile_report.json")
        if dist.get_rank() == 0 and os.path.exists(report):
            with open(report) as f:
                rec["compile_report"] = json.load(f)
        records.append(rec)
        dist.barrier()
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(records, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
