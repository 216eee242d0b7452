"""Float8 training as a user meets it: run_train.sh with float8 (tensorwise, the weights gathered as float8)
on two ranks, a run killed with SIGKILL resumed in float8 (exactly), its checkpoint resumed in bf16 and
the bf16 run's in float8, and exported to Hugging Face (transformers gives the checkpoint's logits). Its
numerics against a one-process reference are in test_parallel_parity.py; its refusals in
test_bad_input.py."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import subprocess
import sys

import pytest
from builders import config

from harness import (
    ROOT,
    SMALL,
    assert_resumed,
    child_env,
    copy_checkpoint,
    step_metric,
    tiny_args,
    train,
    train_in_one_launch,
)
from titanlite.faults import KILL_AT

# The debug model's layers are below the automatic filter's sizes (made for H100s): name-filtered only.
FLOAT8 = ["--float8.enable", "--float8.emulate", "--float8.recipe", "tensorwise", "--float8.all_gather"]
FLOAT8 += ["--float8.filter_fqns", "output"]
RUN = [*SMALL, "--training.steps", "4", "--checkpoint.enable", "--checkpoint.interval", "2"]


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_float8_run_resumes_exactly_after_a_kill_resumes_in_float32_and_exports(tmp_path):
    first = train(tmp_path / "float8", 2, *RUN, *FLOAT8, launcher="run_train").ok()
    assert "float8 tensorwise (emulated): 42 of 43 linear layers" in first.stderr
    assert "float8 all-gather: 42 weights gathered as float8 (1 byte per element)" in first.stderr
    # Every rank SIGKILLs itself once step 2's checkpoint is saved; the next launch in the same folder resumes.
    killed = train(tmp_path / "killed", 2, *RUN, *FLOAT8, env={KILL_AT: "2"})
    assert killed.returncode != 0 and f"{KILL_AT}=2: killing this process" in killed.stderr, killed.log[-3000:]
    # The step-2 checkpoint resumed in bf16 (no float8), whose step-4 checkpoint float8 resumes in turn.
    plain, back = copy_checkpoint(first.dump, tmp_path / "bf16", 2), tmp_path / "back"
    bf16 = [*RUN, "--training.mixed_precision_param", "bfloat16"]
    runs = train_in_one_launch(
        [(killed.dump, [*RUN, *FLOAT8]), (plain, bf16), (back, [*RUN, *FLOAT8, "--training.steps", "6"])],
        2,
        copy_before={back: plain / "checkpoint" / "step-4"},
    )
    for dump, step in ((killed.dump, 2), (plain, 2), (back, 4)):
        assert_resumed(runs[dump], step)
    losses = step_metric(first.dump)
    # Float8 again: every step exactly as the uninterrupted run; bf16: the same weights, other numerics.
    assert step_metric(killed.dump) == losses
    resumed = step_metric(plain)
    assert set(resumed) == {3, 4} and all(0 < abs(resumed[s] - losses[s]) / losses[s] < 1e-2 for s in (3, 4))
    assert set(step_metric(back)) == {5, 6}
    # The checkpoint holds the master weights under their usual names: the export is a plain Llama whose
    # logits are the checkpoint's, computed here in float32 by the model read back with DCP.
    out = tmp_path / "hf"
    cli = [sys.executable, "-m", "titanlite.tools.hf", "export", "--config", "train_configs/debug_model.toml"]
    export = [*cli, "--job.dump_folder", str(first.dump), "--out", str(out), *FLOAT8]
    proc = subprocess.run(export, cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    import torch
    import torch.distributed.checkpoint as dcp
    from transformers import AutoModelForCausalLM

    from titanlite.models.llama3 import Transformer, llama3_configs

    step4 = first.dump / "checkpoint" / "step-4"
    vocab = dcp.FileSystemReader(str(step4)).read_metadata().state_dict_metadata["tok_embeddings.weight"].size[0]
    model = Transformer(dataclasses.replace(llama3_configs["debugmodel"], vocab_size=vocab), seq_len=64)
    model.init_weights(seed=0)  # then every weight is read from the checkpoint
    state = model.state_dict()
    dcp.load(state, checkpoint_id=str(step4))
    model.load_state_dict(state)
    hf = AutoModelForCausalLM.from_pretrained(out, torch_dtype=torch.float32)
    tokens = torch.randint(0, vocab, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, model(tokens), rtol=1e-4, atol=1e-4)
        # Negative control: the initial weights are not the checkpoint's.
        fresh = Transformer(model.args, seq_len=64)
        fresh.init_weights(seed=0)
        assert not torch.allclose(fresh(tokens), model(tokens), atol=1e-2)


@pytest.mark.slow
def test_qwen3_moe_trains_its_dense_layers_in_float8_with_expert_parallelism(tmp_path):
    """The MoE debug model: attention and the dense FFN in float8 (rowwise), the router's gate and the
    experts in the training dtype, on 2 ranks with the experts sharded over them (ep 2), in one launch
    beside the same run without float8: float8 changes the losses, by less than 1%."""
    moe = ["--training.steps", "3", "--parallelism.expert_parallel_degree", "2", *SMALL]
    float8 = [*FLOAT8[:2], "--float8.recipe", "rowwise", "--float8.filter_fqns", "output"]
    plain, converted = tmp_path / "plain", tmp_path / "float8"
    runs = train_in_one_launch(
        [(plain, moe), (converted, [*moe, *float8])], 2, config="train_configs/qwen3_moe_debug.toml"
    )
    assert "float8 rowwise (emulated): 19 of 23 linear layers" in runs[converted].stderr
    want, got = step_metric(plain), step_metric(converted)
    assert set(got) == {1, 2, 3} and all(0 < abs(got[s] - want[s]) / want[s] < 1e-2 for s in got), (got, want)


def _built(cfg, world: int, args):
    """The model of `cfg` on `world` ranks as the trainer builds it (tiny `args`), this process rank 0 of
    torch's fake process group (collectives do nothing), initialised on the CPU."""
    import torch

    from titanlite.planning.run_plan import RunPlan
    from titanlite.run.build import build_model
    from titanlite.tools.dry_run import fake_process_group

    stack = contextlib.ExitStack()
    stack.enter_context(fake_process_group(0, world))
    plan = RunPlan.build(cfg, world, args=args)
    return stack, build_model(plan, torch.device("cpu"))


@pytest.mark.parametrize("param_dtype", ["float32", "bfloat16"])
def test_the_float8_refresh_casts_as_each_weight_alone_would(tmp_path, param_dtype):
    """`Float8Gathers.refresh` (one amax over every shard, one scale computation, casts in chunks of
    same-sized shards) writes the bits and scales the per-weight computation writes, bit for bit: the
    shard in the compute dtype, its amax, torchao's scale, `to_fp8_saturated(shard as fp32 * scale)`.
    With fp32 master weights computed in fp32 or bf16 (rounded before the amax and the cast), and a chunk
    bound that splits the shards of one size into several chunks and leaves the largest alone. Weights are
    spread over decades so that rounding and saturation matter."""
    import torch
    from torchao.float8.float8_utils import amax_to_scale, to_fp8_saturated

    from titanlite.parallelisms.float8.gather import float8_gathers_of

    cfg = config(
        tmp_path, float8__enable=True, float8__emulate=True, float8__all_gather=True, float8__filter_fqns=["output"]
    )
    cfg.training.mixed_precision_param = param_dtype
    stack, model = _built(cfg, 2, tiny_args(n_layers=5))
    with stack:
        gathers = float8_gathers_of(model).__self__
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for _, layer in gathers.wires:
                local = layer._parameters["weight"].to_local()
                local.copy_(
                    torch.randn(local.shape, generator=gen) * 10 ** torch.randint(-6, 4, local.shape, generator=gen)
                )
        largest = max(layer._parameters["weight"].to_local().numel() for _, layer in gathers.wires)
        gathers.chunk_bytes = 6 * largest * 2  # two of the largest shards per chunk at most: several chunks
        assert len(gathers._chunks([layer._parameters["weight"].to_local() for _, layer in gathers.wires])) > 3
        gathers.refresh()
        for wire, layer in gathers.wires:
            shard = layer._parameters["weight"].to_local().to(wire.compute_dtype)
            amax = torch._foreach_norm([shard], ord=math.inf)[0].float()
            scale = amax_to_scale(amax, wire.float8_dtype, wire.round_scales)
            bits = to_fp8_saturated(shard.to(torch.float32) * scale, wire.float8_dtype).view(torch.uint8)
            assert torch.equal(wire.scale, scale) and torch.equal(wire.bits, bits)
        assert len(gathers.wires) == 5 * 7


@pytest.mark.slow
@pytest.mark.parametrize("recipe,world", [("rowwise", 2), ("rowwise", 1), ("tensorwise", 2)])
def test_rowwise_compiles_with_emulated_precision_casts_in_its_own_compiles_only(tmp_path, monkeypatch, recipe, world):
    """A compiled rowwise float8 run hands inductor `emulate_precision_casts` (what torchao and TorchTitan
    set for the recipe) with its own units' compiles: SimpleFSDP's per-unit backends (2 ranks) and the plain
    `torch.compile` of a run without data parallelism (1 rank); tensorwise does not. Inductor's global
    config is never changed, so a later run in the process compiles with its defaults. (inductor's
    `compile_fx` is replaced by a recorder that runs the graph as it is: no code is generated here.)"""
    import torch
    import torch._inductor.compile_fx as compile_fx

    seen: list[dict] = []

    def recorded(gm, example_inputs, **kwargs):
        seen.append(dict(kwargs.get("config_patches") or {}))
        return gm

    monkeypatch.setattr(compile_fx, "compile_fx", recorded)
    cfg = config(
        tmp_path,
        compile__enable=True,
        compile__backend="inductor",
        float8__enable=True,
        float8__emulate=True,
        float8__recipe=recipe,
        float8__filter_fqns=["output"],
    )
    stack, model = _built(cfg, world, tiny_args(n_layers=2))
    with stack:
        tokens = torch.randint(0, 257, (1, 16))
        model(tokens).sum().backward()
    assert seen and all(p.get("emulate_precision_casts") is (True if recipe == "rowwise" else None) for p in seen)
    assert torch._inductor.config.emulate_precision_casts is False


def test_float8_that_converts_nothing_or_names_no_layer_says_so(tmp_path, caplog):
    """The debug model's layers are all below `auto_filter_small_kn`'s sizes: float8 with the default filters
    converts none, and the run is not float8: one WARNING says so (not the usual INFO count). A
    `float8.filter_fqns` entry that no linear layer's name contains (a typo) leaves nothing in high
    precision: one WARNING names it. Negative control: `output` matches, and 42 of 43 convert silently.
    The dry run builds the model as every rank does (`apply_float8`)."""
    from titanlite.config import load_config
    from titanlite.tools.dry_run import dry_run

    debug = ["--config", str(ROOT / "train_configs/debug_model.toml"), "--float8.enable", "--float8.emulate"]
    for filters, want in (
        ([], "float8.enable converts 0 of 43 linear layers (float8.filter_fqns output,auto_filter_small_kn): "
             "this run trains without float8; auto_filter_small_kn leaves out every layer below"),
        (["--float8.filter_fqns", "outptu"], "float8.filter_fqns entry 'outptu' matches no linear layer of this "
                                              "model (their names: layers.N.attention.wq, "),
        (["--float8.filter_fqns", "output"], None),
    ):  # fmt: skip
        caplog.clear()
        with caplog.at_level("INFO", logger="titanlite"):
            dry_run(load_config([*debug, *filters]))
        warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
        counts = [r.getMessage() for r in caplog.records if r.getMessage().startswith("float8 tensorwise")]
        assert warnings == [] if want is None else len(warnings) == 1 and warnings[0].startswith(want), warnings
        assert counts == ([] if filters == [] else [counts[0]])
        if filters:  # the output (vocab 2,056: no multiple of 16) stays in high precision either way
            assert counts[0].startswith("float8 tensorwise (emulated): 42 of 43 linear layers")
