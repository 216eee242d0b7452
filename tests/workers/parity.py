"""Multi-process parity worker: train the tiny Llama under several layouts and compare with one process.

Run by tests on N ranks (`harness.parity`, through `harness.launch_workers`). Each case (a `harness.Case`: the
trainer's command-line overrides, applied to `base_config` as a run applies them) builds the trainer as a run does
(`Trainer(cfg, plan)` with the tiny model) and trains with the shipped `Trainer.train_step` on random
tokens, each rank on its data-parallel slice of the global batch. Every rank also trains the
one-process reference itself (the plain module, the whole global batch, a plain PyTorch loop written
in `reference`, independent of the trainer's step code), once per model depth, shared by all cases.
Rank 0 writes one JSON record per case: max relative loss difference over the steps, and max abs
difference of gradients and updated parameters after step 1 over every rank's parameters (a pipeline
stage holds only some; `missing` lists reference parameters no rank held).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
import time
from unittest import mock

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from builders import config  # noqa: E402

from harness import TINY, Case, end_worker, tiny_args  # noqa: E402
from titanlite.config import JobConfig, apply_dict  # noqa: E402
from titanlite.data.batch import Batch  # noqa: E402
from titanlite.models.deepseek_v3 import ModelArgs as DeepSeekArgs  # noqa: E402
from titanlite.models.deepseek_v3 import Transformer as DeepSeekTransformer  # noqa: E402
from titanlite.models.llama3 import Transformer  # noqa: E402
from titanlite.models.qwen3 import ModelArgs as Qwen3Args  # noqa: E402
from titanlite.models.qwen3 import Transformer as Qwen3Transformer  # noqa: E402
from titanlite.parallelisms.context_parallel.unit import PendingGather, SequenceShard, unshard_sequence  # noqa: E402
from titanlite.planning.run_plan import RunPlan  # noqa: E402
from titanlite.run.build import apply_train_timeout  # noqa: E402
from titanlite.run.trainer import Trainer  # noqa: E402

SEQ, GLOBAL_BATCH, STEPS, SEED = 16, 8, 4, 1234
QWEN3 = Qwen3Args(
    dim=64,
    n_layers=3,
    n_heads=4,
    n_kv_heads=2,
    head_dim=32,
    vocab_size=257,
    ffn_dim=192,
    max_seq_len=64,
    tie_embeddings=True,
)
"""The tiny Qwen3 of the `--model.name qwen3` cases: QK-norm, head_dim 32 (not dim / n_heads), tied embeddings."""
DEEPSEEK = DeepSeekArgs(
    dim=64,
    n_layers=3,
    n_heads=4,
    vocab_size=257,
    ffn_dim=192,
    moe_ffn_dim=32,
    q_lora_rank=32,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    num_experts=8,
    n_shared_experts=1,
    top_k=2,
    first_k_dense_replace=1,
    n_group=2,
    topk_group=1,
    routed_scaling_factor=1.5,
    router_bias_update_rate=0.001,
    max_seq_len=64,
)
"""The tiny DeepSeek-V3 of the `--model.name deepseek_v3` cases: a query latent, group-limited sigmoid routing,
a shared expert, the first block dense, the balancing bias moving after every step."""
MODELS = {DeepSeekArgs: DeepSeekTransformer, Qwen3Args: Qwen3Transformer}


def make_batches() -> list[Batch]:
    """Random tokens; positions as packed documents of 2-7 tokens, a row's first one often continuing a
    document (read only by the block_causal cases)."""
    g = torch.Generator().manual_seed(SEED)
    out = []
    for _ in range(STEPS):
        tokens = torch.randint(0, TINY.vocab_size, (GLOBAL_BATCH, SEQ + 1), generator=g)
        positions = []
        for _ in range(GLOBAL_BATCH):
            row = list(range(int(torch.randint(0, 4, (), generator=g)), 8))
            while len(row) < SEQ:
                row += range(int(torch.randint(2, 8, (), generator=g)))
            positions.append(row[:SEQ])
        out.append(Batch(tokens[:, :-1], tokens[:, 1:], torch.tensor(positions)))
    return out


def batch_loss(model: torch.nn.Module, batch: Batch, mask: str) -> torch.Tensor:
    """Mean token cross-entropy of the batch; under block_causal each document runs alone (causal, at its
    positions), so no mask of the trainer's is involved."""
    ce = torch.nn.functional.cross_entropy
    if mask == "causal":
        return ce(model(batch.inputs).flatten(0, 1).float(), batch.labels.flatten())
    total = torch.zeros(())
    for x, y, pos in zip(*batch):
        starts = [i for i, p in enumerate(pos.tolist()) if p == 0 or i == 0] + [len(pos)]
        for a, b in zip(starts, starts[1:]):
            logits = model(x[None, a:b], positions=pos[None, a:b])
            total = total + ce(logits[0].float(), y[a:b], reduction="sum")
    return total / batch.labels.numel()


def base_config() -> JobConfig:
    """What every case shares (the model alone compiled, by aot_eager); `reference` writes out this schedule
    (linear warmup, linear decay to 0)."""
    return config(
        None,
        {"optimizer__lr": 1e-2, "training__steps": STEPS, "training__seed": SEED, "training__seq_len": SEQ},
        {"lr_scheduler__warmup_steps": 1, "lr_scheduler__decay_type": "linear", "lr_scheduler__decay_ratio": 1.0},
        {"lr_scheduler__min_lr_factor": 0.0, "training__global_batch_size": GLOBAL_BATCH},
        {"compile__backend": "aot_eager", "compile__components": ["model"]},
    )


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def snapshot(model: torch.nn.Module) -> tuple[dict, dict]:
    grads = {n: full(p.grad).clone() for n, p in model.named_parameters()}
    params = {n: full(p.detach()).clone() for n, p in model.named_parameters()}
    return grads, params


def reference(batches, args, mask: str = "causal", float8: str = ""):
    """One process, plain module, whole global batch, a plain PyTorch loop written here (none of the
    trainer's step code): mean token cross-entropy, clipping by the total norm, AdamW, and the schedule
    `base_config` sets (linear warmup from 1/(warmup+1), then linear decay to 0 at the last step). With a
    `float8` recipe, torchao's float8 training (emulated) on every linear layer but the output."""
    cfg = base_config()
    o, warmup = cfg.optimizer, cfg.lr_scheduler.warmup_steps
    model = MODELS.get(type(args), Transformer)(args, seq_len=SEQ)
    model.init_weights(seed=SEED)
    loads = record_loads(model)
    if float8:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        config = dataclasses.replace(Float8LinearConfig.from_recipe_name(float8), emulate=True)
        convert_to_float8_training(model, config=config, module_filter_fn=lambda m, name: name != "output")
    opt = torch.optim.AdamW(
        model.parameters(), lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay
    )
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / (warmup + 1) if s < warmup else 1 - (s - warmup) / (STEPS - warmup)
    )
    losses, first = [], None
    for batch in batches:
        opt.zero_grad()
        loss = batch_loss(model, batch, mask)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.training.max_norm)
        opt.step()
        for moe, load in loads.items():  # aux-loss-free balancing: each bias a step towards the mean load
            moe.expert_bias += args.router_bias_update_rate * torch.sign(load.mean() - load)
            load.zero_()
        sched.step()
        losses.append(loss.item())
        first = first or snapshot(model)
    return losses, *first


def record_loads(model: torch.nn.Module) -> dict[torch.nn.Module, torch.Tensor]:
    """Per MoE layer whose balancing bias moves (a DeepSeek-V3 model), the tokens each expert is chosen by
    in the training forwards since the last reset, counted from the router's choices."""
    loads = {}
    for moe in model.modules():
        if getattr(moe, "step_tokens", None) is None:
            continue
        loads[moe] = load = torch.zeros(moe.num_experts)

        def route(x, route=moe.route, load=load):
            probs, weights, experts = route(x)
            load += torch.bincount(experts.flatten(), minlength=len(load))
            return probs, weights, experts

        moe.route = route
    return loads


def case_config(case: Case, dump: str, world_size: int) -> JobConfig:
    """`base_config` with the case's overrides applied as the command line's are, writing into `dump`. The
    global batch is one microbatch per data-parallel rank unless the case sets `training.local_batch_size`
    (a smaller one accumulates)."""
    cfg = base_config()
    cfg.job.dump_folder = dump
    apply_dict(cfg, case.sections(), "a parity case")
    if "training.local_batch_size" not in case.settings():
        p = cfg.parallelism
        dp = world_size // (p.tensor_parallel_degree * p.pipeline_parallel_degree * p.context_parallel_degree)
        cfg.training.local_batch_size = GLOBAL_BATCH // dp
    return cfg


def start_without_grad_reduction(self, t: torch.Tensor, dim: int) -> PendingGather:
    """A negative control's K/V gather, issued where `finish_without_grad_reduction` runs it."""
    return PendingGather(t, t)


def finish_without_grad_reduction(self, pending: PendingGather, dim: int) -> torch.Tensor:
    """A negative control's K/V gather: the other ranks' parts arrive detached, so no rank receives the
    gradient other ranks' queries give its keys and values (no reduce-scatter in backward)."""
    t = pending.local
    parts = list(funcol.all_gather_single(t.detach().contiguous(), dim, self.group_name).chunk(self.degree, dim))
    parts[self.rank] = t
    return unshard_sequence(torch.cat(parts, dim), self.degree, dim)


def run(case: Case, cfg: JobConfig, batches):
    if case.control == "no_kv_grad":
        with (
            mock.patch.object(SequenceShard, "start_gather", start_without_grad_reduction),
            mock.patch.object(SequenceShard, "finish_gather", finish_without_grad_reduction),
        ):
            return run(dataclasses.replace(case, control=""), cfg, batches)
    torch._dynamo.reset()  # each case compiles fresh models: drop the previous cases' cache entries
    trainer = Trainer(cfg, RunPlan.build(cfg, dist.get_world_size(), args=case_args(case, cfg)))
    dims = trainer.dims
    per = GLOBAL_BATCH // dims.dp
    r = dims.dp_rank_of(dist.get_rank())
    rank_slice = slice(0, per) if case.control == "same_data" else slice(r * per, (r + 1) * per)
    losses, first = [], None
    gathers = CountGathers()
    for i, batch in enumerate(batches):
        micro = [Batch(*parts) for parts in zip(*(t[rank_slice].chunk(trainer.grad_accum) for t in batch))]
        # The last step's all-gathers are counted (eager only: no dispatch mode inside compiled code).
        with gathers if i == len(batches) - 1 and not cfg.compile.enable else contextlib.nullcontext():
            loss, _ = trainer.train_step(micro)
        losses.append(trainer.verdict.loss)
        first = first or snapshot(trainer.model)
    before = group_timeouts(dims)
    apply_train_timeout(cfg, dims)
    timeouts = {"before": before, "after": group_timeouts(dims)}
    # Gradients went through SimpleFSDP's once-per-step path: its gathers made gradient sinks.
    unreduced = any(getattr(m, "sink", None) is not None for m in trainer.model.modules())
    step = dict(policy=dataclasses.asdict(trainer.step_choice.policy), all_gathers=gathers.count)
    trainer.close()
    return losses, *first, timeouts, unreduced, step


class CountGathers(TorchDispatchMode):
    """All-gathers issued while active: SimpleFSDP's functional ones and FSDP2's process-group ones."""

    count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace in ("_c10d_functional", "c10d") and "all_gather" in func.__name__.replace(
            "allgather", "all_gather"
        ):
            self.count += 1
        return func(*args, **(kwargs or {}))


def case_args(case: Case, cfg: JobConfig):
    """The tiny model of the case's family: Qwen3 tied or not, DeepSeek-V3 (its bias fixed under pipeline
    stages, which refuse its update), Llama at the case's depth."""
    if cfg.model.name == "qwen3":
        return dataclasses.replace(QWEN3, tie_embeddings=case.tied)
    if cfg.model.name == "deepseek_v3":
        staged = cfg.parallelism.pipeline_parallel_degree > 1
        return dataclasses.replace(
            DEEPSEEK, router_bias_update_rate=0.0 if staged else DEEPSEEK.router_bias_update_rate
        )
    return tiny_args(n_layers=case.layers)


def max_diffs(mine: dict, ref: dict) -> tuple[float, set[str]]:
    """Max abs difference over this rank's parameters, and their names."""
    return max((mine[n] - ref[n]).abs().max().item() for n in mine), set(mine)


def group_timeouts(dims) -> dict[str, float]:
    """The timeout of every process group a step uses, read back from the gloo backends."""
    groups = {"world": dist.group.WORLD, **dims.process_groups()}
    return {n: g._get_backend(torch.device("cpu")).options._timeout.total_seconds() for n, g in groups.items()}


def main() -> None:
    cases = [Case(**c) for c in json.loads(sys.argv[1])]
    out_path = sys.argv[2]
    dist.init_process_group("gloo")
    batches = make_batches()
    refs: dict[tuple[str, str, str, str], tuple] = {}
    records = []
    for case in cases:
        dump = os.path.join(os.path.dirname(out_path), f"case{len(records)}")
        cfg = case_config(case, dump, dist.get_world_size())
        args, mask = case_args(case, cfg), cfg.model.attn_mask_type
        float8 = cfg.float8.recipe if cfg.float8.enable else ""
        key = (cfg.model.name, repr(args), mask, float8)  # the shape, tying included
        if key not in refs:
            refs[key] = reference(batches, args, mask, float8)
        r_losses, r_grads, r_params = refs[key]
        config_values = cfg.to_dict()  # before the run: what the case asked for
        start = time.perf_counter()
        losses, grads, params, timeouts, unreduced, step = run(case, cfg, batches)
        seconds = time.perf_counter() - start
        (grad_abs, names), (param_abs, _) = max_diffs(grads, r_grads), max_diffs(params, r_params)
        every: list = [None] * dist.get_world_size()
        dist.all_gather_object(every, (grad_abs, param_abs, names, step["all_gathers"]))
        rec = dict(
            case=dataclasses.asdict(case),
            config=config_values,
            losses=losses,
            ref_losses=r_losses,
            timeouts=timeouts,
            unreduced=unreduced,
            step=step,
            seconds=seconds,
            loss_rel=max(abs(a - b) / abs(b) for a, b in zip(losses, r_losses)),
            grad_abs=max(g for g, _, _, _ in every),
            param_abs=max(p for _, p, _, _ in every),
            missing=sorted(set(r_grads) - set().union(*(n for _, _, n, _ in every))),
            all_gathers=[n for _, _, _, n in every],
        )
        report = os.path.join(dump, "compile_report.json")
        if dist.get_rank() == 0 and os.path.exists(report):
            with open(report) as f:
                rec["compile_report"] = json.load(f)
        records.append(rec)
        dist.barrier()
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(records, f)
    end_worker()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
