"""Qwen3 (dense) against `transformers` itself: tiny random `Qwen3ForCausalLM`s made with `save_pretrained`
(no hub), tied and untied, imported by titanlite (one safetensors file, and sharded with an index) give
transformers' logits within 1e-5 in fp32; titanlite's export loads in transformers as `Qwen3ForCausalLM` with
the same logits. Negative controls: the q/k norms swapped move the logits far past the tolerance; a
checkpoint of another shape or without a tensor is refused naming the field or the tensor."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from builders import transformers_model

from titanlite.checkpoint.hf import INDEX, export_hf, import_hf
from titanlite.errors import CheckpointError
from titanlite.models.qwen3 import SPEC, ModelArgs, Transformer, qwen3_configs

transformers = pytest.importorskip("transformers")

SEQ = 32
ARGS = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32, vocab_size=300, ffn_dim=96, max_seq_len=SEQ)
"""head_dim 32 is not dim / n_heads (16): the model must take Qwen3's own head width."""


def hf_model(tied: bool) -> torch.nn.Module:
    config = transformers.Qwen3Config(
        vocab_size=ARGS.vocab_size,
        hidden_size=ARGS.dim,
        intermediate_size=ARGS.ffn_dim,
        num_hidden_layers=ARGS.n_layers,
        num_attention_heads=ARGS.n_heads,
        num_key_value_heads=ARGS.n_kv_heads,
        head_dim=ARGS.head_dim,
        rope_theta=ARGS.rope_theta,
        rms_norm_eps=ARGS.norm_eps,
        max_position_embeddings=SEQ,
        tie_word_embeddings=tied,
    )
    return transformers_model(transformers.Qwen3ForCausalLM, config)


def titan(args: ModelArgs, seed: int = 3) -> Transformer:
    model = Transformer(args, seq_len=SEQ)
    model.init_weights(seed=seed)
    return model.eval()


def ids() -> torch.Tensor:
    return torch.randint(0, ARGS.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(0))


def max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("sharded", [False, True])
@pytest.mark.parametrize("tied", [False, True])
def test_import_of_save_pretrained_matches_transformers(tmp_path, tied, sharded):
    hf = hf_model(tied)
    hf.save_pretrained(str(tmp_path), max_shard_size="100KB" if sharded else "1GB")
    assert (tmp_path / INDEX).is_file() is sharded
    model = titan(dataclasses.replace(ARGS, tie_embeddings=tied))
    import_hf(model, tmp_path, adapter=SPEC.hf_adapter)
    with torch.no_grad():
        assert max_rel(model(ids()), hf(ids()).logits) < 1e-5
    assert (model.output.weight is model.tok_embeddings.weight) is tied


@pytest.mark.parametrize("tied", [False, True])
def test_export_loads_in_transformers_with_the_same_logits(tmp_path, tied):
    model = titan(dataclasses.replace(ARGS, tie_embeddings=tied))
    export_hf(model, tmp_path / "hf", adapter=SPEC.hf_adapter, bos_id=1, eos_id=2, max_shard_bytes=60_000)
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["architectures"] == ["Qwen3ForCausalLM"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    assert type(hf).__name__ == "Qwen3ForCausalLM"
    assert (hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()) is tied
    with torch.no_grad():
        assert max_rel(hf(ids()).logits, model(ids())) < 1e-5


def test_negative_controls(tmp_path):
    """The comparison can fail: swapping the q and k norms (same shapes) moves the logits far past the
    tolerance; a mismatched config names the field, a missing tensor is named."""
    hf = hf_model(tied=False)
    hf.save_pretrained(str(tmp_path / "hf"))
    model = titan(ARGS)
    import_hf(model, tmp_path / "hf", adapter=SPEC.hf_adapter)
    attention = model.layers["0"].attention
    with torch.no_grad():
        attention.q_norm.weight, attention.k_norm.weight = attention.k_norm.weight, attention.q_norm.weight
        assert max_rel(model(ids()), hf(ids()).logits) > 1e-3
    with pytest.raises(CheckpointError, match=r"head_dim = 32 in its config.json, 16 in this model"):
        import_hf(titan(dataclasses.replace(ARGS, head_dim=16)), tmp_path / "hf", adapter=SPEC.hf_adapter)
    with pytest.raises(CheckpointError, match=r"tie_word_embeddings = False in its config.json, True in"):
        import_hf(titan(dataclasses.replace(ARGS, tie_embeddings=True)), tmp_path / "hf", adapter=SPEC.hf_adapter)
    export_hf(model, tmp_path / "ours", adapter=SPEC.hf_adapter, bos_id=1, eos_id=2, max_shard_bytes=60_000)
    index = json.loads((tmp_path / "ours" / INDEX).read_text())
    del index["weight_map"]["model.layers.1.self_attn.k_norm.weight"]
    (tmp_path / "ours" / INDEX).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"no tensor 'model.layers.1.self_attn.k_norm.weight'"):
        import_hf(titan(ARGS), tmp_path / "ours", adapter=SPEC.hf_adapter)


def test_published_flavors():
    """The flavors' parameter counts are the published sizes' (Qwen3-0.6B: 0.6B with its tied embedding;
    32B: 32.8B), and each flavor's config.json is transformers' own Qwen3Config of those shapes."""
    counts = {name: qwen3_configs[name].num_params() / 1e9 for name in ("0.6B", "1.7B", "4B", "8B", "14B", "32B")}
    assert [round(c, 1) for c in counts.values()] == [0.6, 1.7, 4.0, 8.2, 14.8, 32.8], counts
    config = SPEC.hf_adapter.config(qwen3_configs["8B"], torch.bfloat16, 151643, 151645)
    hf = transformers.Qwen3Config(**config)
    assert (hf.hidden_size, hf.num_hidden_layers, hf.intermediate_size, hf.head_dim) == (4096, 36, 12288, 128)
    assert not SPEC.hf_adapter.config_mismatches(hf.to_dict(), qwen3_configs["8B"])


def test_a_padded_vocabulary_is_named_on_import(tmp_path):
    """A published checkpoint's rows past its tokenizer's ids (`model.vocab_size`): a model built with the
    tokenizer's size alone is refused by name, the padded one loads."""
    padded = dataclasses.replace(ARGS, vocab_size=320)
    export_hf(titan(padded), tmp_path / "hf", adapter=SPEC.hf_adapter, bos_id=1, eos_id=2)
    with pytest.raises(CheckpointError, match=r"vocab_size = 320 in its config.json, 300 in"):
        import_hf(titan(ARGS), tmp_path / "hf", adapter=SPEC.hf_adapter)
    import_hf(titan(padded), tmp_path / "hf", adapter=SPEC.hf_adapter)
