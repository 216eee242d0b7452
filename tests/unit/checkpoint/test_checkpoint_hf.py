"""Hugging Face interop: names, the RoPE permutation, safetensors round trips, sharded layouts, the CLI.

Without `transformers` installed, the RoPE permutation is checked against a re-implementation of HF's
`rotate_half` attention; with it, `LlamaForCausalLM.from_pretrained` must reproduce the logits.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open

from harness import ROOT, assert_ok, child_env, launch_workers, tiny_args
from titanlite.checkpoint import hf
from titanlite.errors import CheckpointError, run_cli
from titanlite.models.common.hf_adapter import DECODER_BLOCK, hf_name
from titanlite.models.common.rope_pairs import apply_rope
from titanlite.models.llama3 import SPEC, ModelArgs, Transformer, llama3_configs
from titanlite.models.llama3.hf_adapter import from_hf_rope, hf_config, to_hf_rope
from titanlite.models.llama3.rope import rope_tables

# DCP warns on every single-process save/load (no process group), which is what these tests do.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
ARGS = tiny_args(n_layers=2)
SEQ = 16
INDEX = hf.INDEX


def export_hf(model, out, **kwargs):
    hf.export_hf(model, out, adapter=SPEC.hf_adapter, **kwargs)


def import_hf(model, path):
    hf.import_hf(model, path, adapter=SPEC.hf_adapter)


def model(args: ModelArgs = ARGS, seed: int = 0) -> Transformer:
    m = Transformer(args, seq_len=SEQ)
    m.init_weights(seed=seed)
    return m


def tokens(args: ModelArgs = ARGS) -> torch.Tensor:
    return torch.randint(0, args.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(0))


def test_names():
    assert hf_name("tok_embeddings.weight", DECODER_BLOCK) == "model.embed_tokens.weight"
    assert hf_name("layers.3.attention.wk.weight", DECODER_BLOCK) == "model.layers.3.self_attn.k_proj.weight"
    assert hf_name("layers.0.feed_forward.w1.weight", DECODER_BLOCK) == "model.layers.0.mlp.gate_proj.weight"
    assert hf_name("layers.0.feed_forward.w3.weight", DECODER_BLOCK) == "model.layers.0.mlp.up_proj.weight"
    assert hf_name("layers.0.feed_forward.w2.weight", DECODER_BLOCK) == "model.layers.0.mlp.down_proj.weight"
    assert hf_name("layers.1.attention_norm.weight", DECODER_BLOCK) == "model.layers.1.input_layernorm.weight"
    assert hf_name("layers.1.ffn_norm.weight", DECODER_BLOCK) == "model.layers.1.post_attention_layernorm.weight"
    assert hf_name("norm.weight", DECODER_BLOCK) == "model.norm.weight"
    assert hf_name("output.weight", DECODER_BLOCK) == "lm_head.weight"
    assert hf_name("output.weight", DECODER_BLOCK, tied=True) == "model.embed_tokens.weight"


def _hf_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF Llama's RoPE: x * cos + rotate_half(x) * sin with the angles repeated over both halves."""
    cos = torch.cat((cos, cos), -1)[None, : x.shape[1], None, :]
    sin = torch.cat((sin, sin), -1)[None, : x.shape[1], None, :]
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), -1) * sin


def test_rope_permutation_gives_the_same_attention_scores():
    args, hd = ARGS, ARGS.head_dim
    wq, wk = torch.randn(args.n_heads * hd, args.dim), torch.randn(args.kv_heads * hd, args.dim)
    assert torch.equal(from_hf_rope(to_hf_rope(wq, hd), hd), wq)
    x = torch.randn(1, SEQ, args.dim)
    cos, sin = rope_tables(args, SEQ)

    def scores(q, k):
        rep = args.n_heads // args.kv_heads
        return torch.einsum("bshd,bthd->bhst", q, k.repeat_interleave(rep, dim=2))

    meta_q = apply_rope((x @ wq.T).view(1, SEQ, -1, hd), cos, sin)
    meta_k = apply_rope((x @ wk.T).view(1, SEQ, -1, hd), cos, sin)
    hf_q = _hf_rope((x @ to_hf_rope(wq, hd).T).view(1, SEQ, -1, hd), cos, sin)
    hf_k = _hf_rope((x @ to_hf_rope(wk, hd).T).view(1, SEQ, -1, hd), cos, sin)
    torch.testing.assert_close(scores(hf_q, hf_k), scores(meta_q, meta_k), rtol=1e-5, atol=1e-4)
    # Without the permutation HF's convention would compute something else.
    wrong_q = _hf_rope((x @ wq.T).view(1, SEQ, -1, hd), cos, sin)
    wrong_k = _hf_rope((x @ wk.T).view(1, SEQ, -1, hd), cos, sin)
    assert not torch.allclose(scores(wrong_q, wrong_k), scores(meta_q, meta_k), atol=1e-2)


@pytest.mark.parametrize("tie", [False, True])
def test_round_trip_gives_identical_logits(tmp_path, tie):
    args = ModelArgs(**{**ARGS.__dict__, "tie_embeddings": tie})
    src = model(args, seed=1)
    export_hf(src, tmp_path / "hf", bos_id=1, eos_id=2, max_shard_bytes=40_000)
    files = sorted(p.name for p in (tmp_path / "hf").glob("*.safetensors"))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    index = json.loads((tmp_path / "hf" / INDEX).read_text())
    assert set(index["weight_map"].values()) == set(files)
    assert ("lm_head.weight" in index["weight_map"]) is not tie
    for name in files:  # each shard stays under the limit unless a single tensor is larger
        with safe_open(str(tmp_path / "hf" / name), framework="pt") as f:
            sizes = [f.get_tensor(k).nbytes for k in f.keys()]
        assert sum(sizes) <= 40_000 or len(sizes) == 1
    dst = model(args, seed=2)
    import_hf(dst, tmp_path / "hf")
    with torch.no_grad():
        assert torch.equal(dst(tokens(args)), src(tokens(args)))


def test_export_dtype_and_config(tmp_path):
    export_hf(model(), tmp_path / "hf", dtype=torch.bfloat16, bos_id=5, eos_id=6)
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["torch_dtype"] == "bfloat16"
    assert (cfg["hidden_size"], cfg["num_key_value_heads"], cfg["intermediate_size"]) == (64, 2, ARGS.ffn_hidden_dim)
    assert (cfg["bos_token_id"], cfg["eos_token_id"], cfg["rope_scaling"]) == (5, 6, None)
    with safe_open(str(next((tmp_path / "hf").glob("*.safetensors"))), framework="pt") as f:
        assert all(f.get_tensor(k).dtype == torch.bfloat16 for k in f.keys())
    scaled = hf_config(llama3_configs["8B"], torch.bfloat16, 128000, 128001)
    assert scaled["rope_scaling"]["rope_type"] == "llama3" and scaled["rope_scaling"]["factor"] == 8.0
    assert scaled["intermediate_size"] == 14336 and scaled["num_key_value_heads"] == 8
    with pytest.raises(CheckpointError, match="already exists"):
        export_hf(model(), tmp_path / "hf", bos_id=5, eos_id=6)


def test_import_of_another_shape_is_refused(tmp_path):
    export_hf(model(), tmp_path / "hf", bos_id=1, eos_id=2)
    other = model(ModelArgs(**{**ARGS.__dict__, "vocab_size": 300}))
    # config.json is compared first, before any tensor is read.
    with pytest.raises(CheckpointError, match=r"vocab_size = 257 in its config.json, 300 in this model"):
        import_hf(other, tmp_path / "hf")


def test_transformers_reproduces_the_logits(tmp_path):
    transformers = pytest.importorskip("transformers")
    args = ModelArgs(**{**ARGS.__dict__, "use_scaled_rope": True})
    src = model(args, seed=1)
    export_hf(src, tmp_path / "hf", bos_id=1, eos_id=2)
    hf = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "hf"), torch_dtype=torch.float32)
    hf.eval()
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens(args)).logits, src(tokens(args)), rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_sharded_export_and_import(tmp_path):
    """Export from dp2 x tp2 (streamed, many shards) and import into dp2 x tp2 and FSDP2 dp4: the same
    bits as one process, and logits within fp32 tolerance."""
    out = tmp_path / "result.json"
    assert_ok(launch_workers("tests/workers/ckpt_hf.py", [str(tmp_path / "hf"), str(out)], 4))
    result = json.loads(out.read_text())
    assert result["export_matches_single_process"], result
    assert result["shards"] > 2
    for layout in ("simple_fsdp dp2 x tp2", "fsdp2 dp4"):
        assert result[layout]["params_equal"], layout
        assert result[layout]["logits_max_diff"] < 1e-5, result


@pytest.mark.slow
def test_cli_export(tmp_path, capsys):
    """`python -m titanlite.tools.hf export` on a checkpoint of the debug model gives its weights."""
    from titanlite.checkpoint.manager import CheckpointManager
    from titanlite.config import load_config
    from titanlite.planning.run_plan import RunPlan
    from titanlite.tools import hf as hf_tool

    overrides = [
        "--config",
        "train_configs/debug_model.toml",
        "--job.dump_folder",
        str(tmp_path / "run"),
        "--training.seq_len",
        "32",
    ]
    cfg = load_config(overrides)
    args = ModelArgs(**{**llama3_configs["debugmodel"].__dict__, "vocab_size": 2056})
    src = model(args, seed=3)
    seed = CheckpointManager(
        RunPlan.build(cfg, 1, args=args),
        model=src,
        optimizer=None,
        lr_scheduler=None,
        dataloader=None,
        rank=0,
        device=torch.device("cpu"),
    )
    seed.save(0, force=True, model_only=True)
    seed.close()
    cli = subprocess.run(
        [
            sys.executable,
            "-m",
            "titanlite.tools.hf",
            "export",
            *overrides,
            "--step",
            "0",
            "--out",
            str(tmp_path / "hf"),
        ],
        env=child_env(),
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert_ok(cli)
    assert "exported" in cli.stdout
    dst = model(args, seed=4)
    import_hf(dst, tmp_path / "hf")
    assert all(torch.equal(v, dst.state_dict()[k]) for k, v in src.state_dict().items())
    assert {"tokenizer.json", "tokenizer_config.json", "generation_config.json"} <= {
        p.name for p in (tmp_path / "hf").iterdir()
    }
    # An explicit checkpoint folder, whatever the run's dump folder.
    step0 = str(tmp_path / "run" / "checkpoint" / "step-0")
    elsewhere = [*overrides[:2], "--job.dump_folder", str(tmp_path / "other"), *overrides[4:]]
    assert run_cli(hf_tool.main, ["export", *elsewhere, "--checkpoint", step0, "--out", str(tmp_path / "hf3")]) == 0
    capsys.readouterr()
    dst = model(args, seed=5)
    import_hf(dst, tmp_path / "hf3")
    assert all(torch.equal(v, dst.state_dict()[k]) for k, v in src.state_dict().items())
    # Errors are one line and exit code 2.
    assert run_cli(hf_tool.main, ["export", *overrides, "--step", "5", "--out", str(tmp_path / "hf2")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "step-5 does not exist" in err
    assert run_cli(hf_tool.main, ["export", *overrides, "--out", str(tmp_path / "hf")]) == 2
    assert "already exists" in capsys.readouterr().err
