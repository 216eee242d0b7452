"""Model shapes beyond the flavors: `model.*` overrides reach the model args every tool builds from
(model, start-up log, HF config.json), and bad shapes stop the preflight with one line and exit code 2."""

from __future__ import annotations

import pytest
import torch

from titanlite.checkpoint.resume_policy import compare_settings
from titanlite.config import load_config
from titanlite.config.schema import shape_fields
from titanlite.errors import ConfigError, run_cli
from titanlite.launcher import preflight
from titanlite.models.llama3.hf_adapter import hf_config
from titanlite.models.registry import get_model_spec
from titanlite.planning.run_plan import RunPlan, describe_shape

CONFIG = "train_configs/debug_model.toml"
OVERRIDES = [
    "--model.n_layers", "2", "--model.dim", "128", "--model.n_heads", "8", "--model.n_kv_heads", "2",
    "--model.ffn_dim", "352", "--model.rope_theta", "10000", "--model.max_seq_len", "512",
    "--training.seq_len", "64",
]  # fmt: skip


TP4 = ["--parallelism.tensor_parallel_degree", "4"]


def plan(*overrides: str, world_size: int = 1) -> RunPlan:
    return RunPlan.build(load_config(list(overrides), default_config=CONFIG), world_size)


def test_overrides_reach_the_model_its_log_and_its_hf_config():
    built = plan(*OVERRIDES)
    args = built.model_args
    assert (args.n_layers, args.dim, args.n_heads, args.kv_heads) == (2, 128, 8, 2)
    assert (args.ffn_hidden_dim, args.rope_theta, args.max_seq_len) == (352, 10000.0, 512)
    assert describe_shape(built.spec, args) == (
        "n_layers 2, dim 128, n_heads 8, n_kv_heads 2, ffn_dim 352, rope_theta 10000, max_seq_len 512"
    )
    with torch.device("meta"):
        model = plan(*OVERRIDES).spec.model_cls(args, seq_len=64)
    assert len(model.layers) == 2 and model.layers["0"].feed_forward.w1.weight.shape == (352, 128)
    assert model.layers["0"].attention.wk.weight.shape == (2 * 16, 128)
    # The HF export writes config.json from the model's args (checkpoint/hf.py reads model.args).
    hf = hf_config(model.args, torch.float32, 0, 1)
    assert (hf["num_hidden_layers"], hf["hidden_size"], hf["num_attention_heads"]) == (2, 128, 8)
    assert (hf["num_key_value_heads"], hf["intermediate_size"], hf["rope_theta"]) == (2, 352, 10000.0)
    assert hf["max_position_embeddings"] == 512


def test_without_overrides_the_flavor_is_unchanged():
    default, flavor = plan("--training.seq_len", "64").model_args, plan().spec.flavors["debugmodel"]
    assert (default.dim, default.n_layers, default.ffn_hidden_dim) == (
        flavor.dim,
        flavor.n_layers,
        flavor.ffn_hidden_dim,
    )
    multiplied = plan("--model.ffn_dim_multiplier", "1.5").model_args
    assert multiplied.ffn_hidden_dim > default.ffn_hidden_dim


@pytest.mark.parametrize(
    "overrides,world,message",
    [
        (["--model.n_heads", "12"], 1, "dim 256 is not a multiple of n_heads 12"),
        (["--model.n_kv_heads", "3"], 1, "n_heads 16 is not a multiple of n_kv_heads 3"),
        (["--model.max_seq_len", "64"], 1, "training.seq_len 128 exceeds the model's max_seq_len 64"),
        (["--model.n_kv_heads", "2", *TP4], 4, "does not divide the model's n_kv_heads 2"),
        (["--model.n_heads", "2", "--model.n_kv_heads", "2", *TP4], 4, "does not divide the model's n_heads 2"),
    ],
)  # fmt: skip
def test_bad_shapes_are_one_line_and_exit_code_2(overrides, world, message, monkeypatch, capsys):
    with pytest.raises(ConfigError, match=message):
        plan(*overrides, world_size=world)
    monkeypatch.setenv("WORLD_SIZE", str(world))
    assert run_cli(preflight.main, ["--config", CONFIG, *overrides]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0] and err[0].startswith("titanlite: error:")


def test_a_shape_override_cannot_change_on_resume():
    config = load_config(OVERRIDES, default_config=CONFIG).to_dict()
    changed = load_config([*OVERRIDES, "--model.rope_theta", "500000"], default_config=CONFIG).to_dict()
    marker = {"config": config, "global_batch": 8, "virtual_shards": 8}
    inputs = {"config": changed, "global_batch": 8, "virtual_shards": 8, "tokenizer": None, "dataset": None}
    check = compare_settings("step-10", marker, inputs, allow_dataset_change=False)
    assert check.error and "model.rope_theta was 10000.0, this run has 500000.0" in check.error
    same = compare_settings("step-10", marker, {**inputs, "config": config}, allow_dataset_change=False)
    assert same.error is None


def test_every_shape_key_of_the_family_is_fixed_on_resume_and_is_a_config_key():
    """One list (`ModelSpec.shape.keys`) feeds the overrides and the resume policy: each key of it is a
    `model.*` config key, and changing any of them (max_seq_len included) stops a resume."""
    spec = plan().spec
    # Every `model.*` shape key belongs to a built-in family; the mixture-of-experts keys to qwen3_moe only.
    moe_keys = set(get_model_spec("qwen3_moe").shape.keys)
    assert set(spec.shape.keys) | moe_keys == set(shape_fields()) and set(spec.shape.keys) <= set(shape_fields())
    config = load_config(OVERRIDES, default_config=CONFIG).to_dict()
    marker = {"config": config, "global_batch": 8, "virtual_shards": 8}
    for key in spec.shape.keys:
        changed = load_config([*OVERRIDES, f"--model.{key}", "1024"], default_config=CONFIG).to_dict()
        inputs = {"config": changed, "global_batch": 8, "virtual_shards": 8, "tokenizer": None, "dataset": None}
        check = compare_settings("step-10", marker, inputs, allow_dataset_change=False)
        assert check.error and f"model.{key} was " in check.error, key
