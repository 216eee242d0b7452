"""DeepSeek-V3 checkpoints as transformers writes and reads them, in fp32, for a tiny model with YaRN
(mscale != mscale_all_dim: cos/sin and the softmax scale both scaled), 4 expert groups of which 2 are
kept, a dense first layer, and non-zero balancing biases, with and without the query latent:

- a random `DeepseekV3ForCausalLM` (config written here from transformers' field names) saved with
  `save_pretrained` (per-expert tensors in one file, sharded with an index, and stacked) imports with
  transformers' logits within 1e-5 (relative to the largest logit);
- titanlite's export is per-expert and loads in transformers with the same logits, and transformers'
  greedy `generate` gives titanlite's `generate` tokens, token for token.

Negative controls: the balancing bias zeroed in the file, or the export read with `rope_interleave`
false (the other RoPE layout), moves the logits past 1e-3; another model's tokens differ; a config that
does not match, FP8 weights and a softmax router are refused in one line."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from builders import transformers_model
from safetensors.torch import load_file, save_file

from titanlite.checkpoint.hf import INDEX, SINGLE, check_hf_config, export_hf, import_hf
from titanlite.errors import CheckpointError
from titanlite.models.deepseek_v3 import SPEC, ModelArgs, Transformer
from titanlite.models.deepseek_v3.rope import YaRN
from titanlite.tools.generate import generate

transformers = pytest.importorskip("transformers")

ARGS = dataclasses.replace(
    SPEC.flavors["debugmodel"], dim=64, n_layers=3, n_heads=4, ffn_dim=96, moe_ffn_dim=32, q_lora_rank=0,
    kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16, num_experts=8,
    n_shared_experts=1, top_k=3, first_k_dense_replace=1, n_group=4, topk_group=2, routed_scaling_factor=2.5,
    vocab_size=257, max_seq_len=256,
    rope_scaling=YaRN(factor=4, original_max_position_embeddings=64, mscale=0.9, mscale_all_dim=0.8),
)  # fmt: skip
"""Layer 0 dense, layers 1-2 MoE; q_lora_rank 0 (`wq`) or set (`Q_LORA`)."""
Q_LORA = 24
SEQ = 32


def args_of(q_lora: int) -> ModelArgs:
    return dataclasses.replace(ARGS, q_lora_rank=q_lora)


def hf_config(args: ModelArgs) -> transformers.DeepseekV3Config:
    """transformers' config of `args`, written out from its own field names (not the adapter's)."""
    yarn = args.rope_scaling
    return transformers.DeepseekV3Config(
        vocab_size=args.vocab_size, hidden_size=args.dim, intermediate_size=args.ffn_dim,
        moe_intermediate_size=args.moe_ffn_dim, num_hidden_layers=args.n_layers,
        num_attention_heads=args.n_heads, num_key_value_heads=args.n_heads,
        n_shared_experts=args.n_shared_experts, n_routed_experts=args.num_experts,
        routed_scaling_factor=args.routed_scaling_factor, kv_lora_rank=args.kv_lora_rank,
        q_lora_rank=args.q_lora_rank or None, qk_rope_head_dim=args.qk_rope_head_dim,
        v_head_dim=args.v_head_dim, qk_nope_head_dim=args.qk_nope_head_dim, n_group=args.n_group,
        topk_group=args.topk_group, num_experts_per_tok=args.top_k,
        first_k_dense_replace=args.first_k_dense_replace, norm_topk_prob=args.norm_topk_prob,
        max_position_embeddings=args.max_seq_len, rms_norm_eps=args.norm_eps,
        rope_parameters={
            "rope_type": "yarn", "rope_theta": args.rope_theta, "factor": yarn.factor,
            "original_max_position_embeddings": yarn.original_max_position_embeddings,
            "beta_fast": yarn.beta_fast, "beta_slow": yarn.beta_slow, "mscale": yarn.mscale,
            "mscale_all_dim": yarn.mscale_all_dim,
        },
        bos_token_id=1, eos_token_id=2,
    )  # fmt: skip


def hf_model(args: ModelArgs) -> torch.nn.Module:
    """transformers' own model of `args`: random weights, norms in [0.5, 1.5], balancing biases in
    [-0.1, 0.1] (enough to change which experts the router picks)."""
    model = transformers_model(transformers.DeepseekV3ForCausalLM, hf_config(args))
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.uniform_(-0.1, 0.1)
    return model


def titan(args: ModelArgs, seed: int = 3) -> Transformer:
    """titanlite's model, initialised as training does, then norms in [0.5, 1.5] and biases in
    [-0.1, 0.1], so that a norm or bias put in the wrong place moves the logits."""
    model = Transformer(args, seq_len=SEQ)
    model.init_weights(seed=seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in model.state_dict().items():
            if name.endswith("norm.weight"):
                t.copy_(torch.rand(t.shape, generator=g) + 0.5)
            elif name.endswith("expert_bias"):
                t.copy_(torch.rand(t.shape, generator=g) * 0.2 - 0.1)
    return model.eval()


def tokens(args: ModelArgs = ARGS) -> torch.Tensor:
    return torch.randint(0, args.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(0))


def max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("q_lora", [0, Q_LORA])
@pytest.mark.parametrize("layout", ["per_expert", "per_expert_sharded", "stacked"])
def test_import_of_save_pretrained_matches_transformers(tmp_path, layout, q_lora):
    args = args_of(q_lora)
    hf = hf_model(args)
    hf.save_pretrained(
        str(tmp_path), max_shard_size="100KB" if layout.endswith("sharded") else "1GB",
        save_original_format=layout != "stacked",
    )  # fmt: skip
    names = set(json.loads((tmp_path / INDEX).read_text())["weight_map"]) if layout.endswith("sharded") else None
    assert (tmp_path / INDEX).is_file() is layout.endswith("sharded")
    if names is not None:
        assert "model.layers.2.mlp.experts.7.down_proj.weight" in names
        assert "model.layers.1.mlp.gate.e_score_correction_bias" in names
        assert ("model.layers.0.self_attn.q_a_proj.weight" in names) is bool(q_lora)
    model = titan(args)
    import_hf(model, tmp_path, adapter=SPEC.hf_adapter)
    torch.testing.assert_close(model.layers["1"].moe.expert_bias, hf.model.layers[1].mlp.gate.e_score_correction_bias)
    with torch.no_grad():
        assert max_rel(model(tokens()), hf(tokens()).logits) < 1e-5


@pytest.mark.parametrize("q_lora", [0, Q_LORA])
def test_export_loads_in_transformers_with_the_same_logits_and_greedy_tokens(tmp_path, q_lora):
    args = args_of(q_lora)
    model = titan(args)
    export_hf(model, tmp_path / "hf", adapter=SPEC.hf_adapter, bos_id=1, eos_id=2, max_shard_bytes=100_000)
    names = set(json.loads((tmp_path / "hf" / INDEX).read_text())["weight_map"])
    assert {f"model.layers.2.mlp.experts.{j}.up_proj.weight" for j in range(args.num_experts)} <= names
    assert not any(n.endswith(("gate_up_proj", "experts.down_proj")) for n in names)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()
    assert type(hf).__name__ == "DeepseekV3ForCausalLM"
    assert hf.config.q_lora_rank == (q_lora or None) and hf.config.head_dim == args.qk_rope_head_dim
    with torch.no_grad():
        assert max_rel(hf(tokens()).logits, model(tokens())) < 1e-5
        prompt = tokens()[0, :8].tolist()
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, eos_token_id=None)
    got = generate(model, prompt, 16)
    assert got == want[0, 8:].tolist()
    assert generate(titan(args, seed=7), prompt, 16) != got  # negative control: another model's tokens
    back = Transformer(args, seq_len=SEQ)
    back.init_weights(seed=11)
    import_hf(back, tmp_path / "hf", adapter=SPEC.hf_adapter)
    with torch.no_grad():
        assert torch.equal(back.eval()(tokens()), model(tokens()))


def test_negative_controls(tmp_path):
    """The balancing bias zeroed in the file, and the export read in the other RoPE layout, move the
    logits past 1e-3: the comparisons above see both."""
    hf = hf_model(ARGS)
    hf.save_pretrained(str(tmp_path / "hf"))
    tensors = load_file(str(tmp_path / "hf" / SINGLE))
    for name in tensors:
        if name.endswith("e_score_correction_bias"):
            tensors[name] = torch.zeros_like(tensors[name])
    save_file(tensors, str(tmp_path / "hf" / SINGLE), metadata={"format": "pt"})
    model = titan(ARGS)
    import_hf(model, tmp_path / "hf", adapter=SPEC.hf_adapter)
    with torch.no_grad():
        assert max_rel(model(tokens()), hf(tokens()).logits) > 1e-3

    export_hf(model, tmp_path / "out", adapter=SPEC.hf_adapter, bos_id=1, eos_id=2)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    (tmp_path / "out" / "config.json").write_text(json.dumps({**config, "rope_interleave": False}))
    halves = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), dtype=torch.float32).eval()
    with torch.no_grad():
        assert max_rel(halves(tokens()).logits, model(tokens())) > 1e-3


def test_what_transformers_cannot_compute_is_refused_in_one_line(tmp_path):
    """A config of other shapes names each field with both values; published FP8 weights and a
    softmax-routed model are refused."""
    export_hf(titan(ARGS), tmp_path / "hf", adapter=SPEC.hf_adapter, bos_id=1, eos_id=2)
    other = dataclasses.replace(
        args_of(Q_LORA), rope_scaling=dataclasses.replace(ARGS.rope_scaling, mscale_all_dim=1.0)
    )
    with pytest.raises(CheckpointError) as e:
        check_hf_config(tmp_path / "hf", other, SPEC.hf_adapter)
    assert "\n" not in str(e.value)
    assert "q_lora_rank = 0 in its config.json, 24 in this model" in str(e.value)
    assert "rope_scaling.mscale_all_dim = 0.8 in its config.json, 1.0 in this model" in str(e.value)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "fp8"}}))
    with pytest.raises(CheckpointError, match="quantization_config = {'quant_method': 'fp8'} in its config.json"):
        import_hf(titan(ARGS), tmp_path / "hf", adapter=SPEC.hf_adapter)
    softmax = titan(dataclasses.replace(ARGS, score_func="softmax"))
    with pytest.raises(CheckpointError, match="score_func 'softmax' routes differently .* sigmoid only"):
        export_hf(softmax, tmp_path / "softmax", adapter=SPEC.hf_adapter, bos_id=1, eos_id=2)
    assert not list(tmp_path.glob("softmax*"))  # nor its `.partial` folder: refused before it is made


def test_a_bf16_export_keeps_the_router_and_its_bias_in_fp32(tmp_path):
    """With export dtype bf16 every tensor is bf16 but the router's weight and balancing bias, written in fp32
    as transformers holds them: the bias exactly, where bf16 would round it (the negative control)."""
    model = titan(ARGS)
    export_hf(model, tmp_path / "hf", adapter=SPEC.hf_adapter, dtype=torch.bfloat16, bos_id=1, eos_id=2)
    tensors = {n: t for f in (tmp_path / "hf").glob("*.safetensors") for n, t in load_file(str(f)).items()}
    fp32 = {n for n, t in tensors.items() if t.dtype == torch.float32}
    assert fp32 == {f"model.layers.{i}.mlp.gate.{w}" for i in (1, 2) for w in ("weight", "e_score_correction_bias")}
    assert all(t.dtype == torch.bfloat16 for n, t in tensors.items() if n not in fp32)
    bias = model.layers["1"].moe.expert_bias
    assert torch.equal(tensors["model.layers.1.mlp.gate.e_score_correction_bias"], bias)
    assert not torch.equal(bias.bfloat16().float(), bias)


PUBLISHED = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "attention_bias": False,
    "first_k_dense_replace": 3, "hidden_act": "silu", "hidden_size": 7168, "intermediate_size": 18432,
    "kv_lora_rank": 512, "max_position_embeddings": 163840, "moe_intermediate_size": 2048, "moe_layer_freq": 1,
    "n_group": 8, "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": True,
    "num_attention_heads": 128, "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1, "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "weight_block_size": [128, 128]},
    "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "tie_word_embeddings": False,
    "topk_group": 4, "topk_method": "noaux_tc", "v_head_dim": 128, "vocab_size": 129280,
}  # fmt: skip
"""The fields of DeepSeek-V3's published `config.json` that describe the model (FP8 weights)."""


def test_the_published_config_is_the_671B_flavor_and_its_fp8_weights_are_refused():
    flavor = SPEC.flavors["671B"]
    assert SPEC.hf_adapter.config_mismatches(PUBLISHED, flavor) == [
        ("quantization_config", PUBLISHED["quantization_config"], None)
    ]
    bf16 = {k: v for k, v in PUBLISHED.items() if k != "quantization_config"}
    assert SPEC.hf_adapter.config_mismatches(bf16, flavor) == []
    # The flavor's own export config reads back as the flavor, and transformers takes it as the published one.
    ours = SPEC.hf_adapter.config(flavor, torch.bfloat16, 0, 1)
    assert SPEC.hf_adapter.config_mismatches(ours, flavor) == []
    theirs, published = transformers.DeepseekV3Config(**ours), transformers.DeepseekV3Config(**bf16)
    for field in ("head_dim", "qk_head_dim", "q_lora_rank", "n_group", "topk_group", "routed_scaling_factor"):
        assert getattr(theirs, field) == getattr(published, field), field
    legacy = {k: v for k, v in published.rope_parameters.items() if k != "type"}  # the published "type" key
    assert theirs.rope_parameters == legacy
