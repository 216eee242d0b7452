"""The model seam: a family registered outside titanlite (tests/workers/mlp_lm.py, an MLP language
model given as data only: no parallelism code) gets AC, compile and SimpleFSDP or FSDP2 from the
framework's `parallelize`, trains on 2 ranks through the unchanged trainer, saves a checkpoint and
resumes from it compiled, under FSDP2 and full AC. The family hooks (`extra_loss`, `tp_styles`) are
checked on one process."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
from builders import config
from torch.distributed.fsdp import FSDPModule
from workers.mlp_lm import SPEC

from harness import SMALL, assert_ok, launch_workers
from titanlite.checkpoint import folders
from titanlite.data.batch import Batch
from titanlite.errors import ConfigError
from titanlite.models.registry import TrainingHooks, register_model
from titanlite.parallelisms.step_context import StepContext
from titanlite.planning.run_plan import RunPlan
from titanlite.run.build import build_model
from titanlite.run.step import LocalRunner, cross_entropy_loss

MLP = {
    "model__name": "mlp_lm",
    "model__flavor": "tiny",
    "training__seq_len": 16,
    "training__mixed_precision_param": "bfloat16",
}
"""The test family, tiny, computing in bf16 (the shipped default)."""


def test_the_framework_gives_a_data_only_family_fsdp2_compile_and_ac(process_group, tmp_path):
    """No glue in the family: FSDP2 wraps every block and the root, full AC wraps each block's forward in
    a checkpoint and Dynamo compiles the blocks' bodies (new graphs at the first call); without compile
    (the negative control) nothing is traced."""
    register_model(SPEC)
    graphs = []
    for enable in (True, False):
        cfg = config(tmp_path, MLP, parallelism__dp_impl="fsdp2")
        cfg.compile.enable, cfg.compile.backend = enable, "eager"
        cfg.activation_checkpoint.mode = "full"
        model = build_model(RunPlan.build(cfg, 1), torch.device("cpu"))
        assert isinstance(model, FSDPModule) and all(isinstance(b, FSDPModule) for b in model.layers.values())
        assert all(b.forward.__qualname__.startswith("_checkpoint_block") for b in model.layers.values())
        before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        model(torch.randint(0, 100, (1, 16))).float().sum().backward()
        graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"] - before)
    assert graphs[0] > 0 and graphs[1] == 0


def test_a_family_extra_loss_is_added_to_training_not_to_validation(process_group, tmp_path):
    """The runner adds `ModelSpec.hooks.extra_loss` to each microbatch's loss (its gradient reaches the
    parameters it reads) and leaves it out of `evaluate`; pipeline parallelism refuses it."""
    hooks = TrainingHooks(extra_loss=lambda m: 3.0 * m.norm.weight.sum())
    spec = dataclasses.replace(SPEC, name="mlp_lm_extra", hooks=hooks)
    register_model(spec)
    cfg = config(tmp_path, MLP)
    cfg.model.name = spec.name
    plan = RunPlan.build(cfg, 1)
    torch.manual_seed(0)
    model = spec.model_cls(plan.model_args)
    model.init_weights(seed=0)
    batch = Batch.of_windows(torch.randint(0, 100, (2, 17)))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)

    def run(extra):
        context = StepContext(cross_entropy_loss, extra_loss=extra)
        runner = LocalRunner(model, torch.device("cpu"), context)
        loss, _ = runner.forward_backward(opt, [batch])
        return loss, model.norm.weight.grad.clone(), runner.evaluate(batch)

    plain, plain_grad, plain_eval = run(None)
    extra, extra_grad, extra_eval = run(spec.hooks.extra_loss)
    assert extra.item() == pytest.approx(plain.item() + 3.0 * model.args.dim)
    assert torch.allclose(extra_grad, plain_grad + 3.0)
    assert extra_eval.item() == plain_eval.item()
    cfg.parallelism.pipeline_parallel_degree = 2
    with pytest.raises(ConfigError, match="extra loss term"):
        RunPlan.build(cfg, 2)


def test_a_family_without_a_tensor_parallel_plan_refuses_tp():
    register_model(SPEC)
    with pytest.raises(ConfigError, match="no tensor-parallel styles"):
        RunPlan.build(config(".", MLP, parallelism__tensor_parallel_degree=2), 2)


def test_a_family_without_the_context_parallel_seam_refuses_cp():
    register_model(SPEC)
    with pytest.raises(ConfigError, match="does not support context parallelism"):
        RunPlan.build(config(".", MLP, parallelism__context_parallel_degree=2), 2)


@pytest.mark.slow
def test_a_second_model_family_trains_checkpoints_and_resumes(tmp_path):
    def run(steps: int, *extra: str):
        return launch_workers(
            "tests/workers/mlp_lm.py",
            [
                "--model.name",
                "mlp_lm",
                "--model.flavor",
                "tiny",
                "--job.dump_folder",
                str(tmp_path),
                *SMALL,
                "--training.steps",
                str(steps),
                "--training.local_batch_size",
                "2",
                "--checkpoint.enable",
                "--checkpoint.interval",
                "3",
                *extra,
            ],
            2,
        )

    first = run(3)
    assert_ok(first)
    assert "model mlp_lm tiny" in first.stderr
    assert folders.scan(tmp_path / "checkpoint") == ([3], [])
    # Resumed compiled, under FSDP2 and full AC: what the framework gives a family without glue.
    second = run(
        5,
        *("--parallelism.dp_impl", "fsdp2", "--compile.enable", "--compile.backend", "aot_eager"),
        *("--activation_checkpoint.mode", "full"),
    )
    assert_ok(second)
    assert "(fsdp2, fully_shard)" in second.stderr and "compile aot_eager" in second.stderr
    assert "resumed from" in second.stderr and "step-3 at step 3" in second.stderr
    assert folders.scan(tmp_path / "checkpoint") == ([3, 5], [])
    steps = [int(m.group(1)) for m in re.finditer(r"rank0\].* step +(\d+)/5 ", second.stderr)]
    assert steps == [4, 5]
