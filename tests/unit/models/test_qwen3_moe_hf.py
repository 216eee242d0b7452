"""Qwen3-MoE checkpoints as transformers writes them: a tiny random `Qwen3MoeForCausalLM` saved with
`save_pretrained` (one tensor per expert, the published checkpoints' layout; one file, and sharded with
an index) imports into titanlite with transformers' logits within 1e-5 in fp32, as does the stacked
layout (`save_original_format=False`); titanlite's export is per-expert too and loads in transformers
with the same logits. Negative controls: two experts' tensors swapped in the file move the logits past
the tolerance; a missing expert tensor and a wrong-shaped one are refused by name."""

from __future__ import annotations

import json

import pytest
import torch
from builders import transformers_model
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from test_qwen3_moe import ARGS, SEQ, tokens

from titanlite.checkpoint.hf import INDEX, SINGLE, export_hf, import_hf
from titanlite.errors import CheckpointError
from titanlite.models.qwen3_moe import SPEC, Transformer

transformers = pytest.importorskip("transformers")


def hf_model() -> torch.nn.Module:
    """transformers' own model of ARGS' shapes (its config is titanlite's export config)."""
    config = transformers.Qwen3MoeConfig(**SPEC.hf_adapter.config(ARGS, torch.float32, 1, 2))
    return transformers_model(transformers.Qwen3MoeForCausalLM, config)


def titan(seed: int = 3) -> Transformer:
    model = Transformer(ARGS, seq_len=SEQ)
    model.init_weights(seed=seed)
    return model.eval()


def max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def keys(folder) -> set[str]:
    files = json.loads((folder / INDEX).read_text())["weight_map"].values() if (folder / INDEX).is_file() else [SINGLE]
    out: set[str] = set()
    for f in set(files):
        with safe_open(str(folder / f), framework="pt") as st:
            out |= set(st.keys())
    return out


@pytest.mark.parametrize("layout", ["per_expert", "per_expert_sharded", "stacked"])
def test_import_of_save_pretrained_matches_transformers(tmp_path, layout):
    hf = hf_model()
    hf.save_pretrained(
        str(tmp_path), max_shard_size="100KB" if layout.endswith("sharded") else "1GB",
        save_original_format=layout != "stacked",
    )  # fmt: skip
    names = keys(tmp_path)
    assert ("model.layers.1.mlp.experts.7.up_proj.weight" in names) is (layout != "stacked")
    assert ("model.layers.1.mlp.experts.gate_up_proj" in names) is (layout == "stacked")
    assert (tmp_path / INDEX).is_file() is layout.endswith("sharded")
    model = titan()
    import_hf(model, tmp_path, adapter=SPEC.hf_adapter)
    with torch.no_grad():
        assert max_rel(model(tokens()), hf(tokens()).logits) < 1e-5


def test_export_is_per_expert_and_loads_in_transformers_with_the_same_logits(tmp_path):
    model = titan()
    export_hf(model, tmp_path / "hf", adapter=SPEC.hf_adapter, bos_id=1, eos_id=2, max_shard_bytes=60_000)
    names = keys(tmp_path / "hf")
    assert {f"model.layers.2.mlp.experts.{j}.down_proj.weight" for j in range(ARGS.num_experts)} <= names
    assert not any(n.endswith(("gate_up_proj", "experts.down_proj")) for n in names)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()
    assert type(hf).__name__ == "Qwen3MoeForCausalLM"
    with torch.no_grad():
        assert max_rel(hf(tokens()).logits, model(tokens())) < 1e-5


def test_negative_controls(tmp_path):
    """Expert 0's and 1's gate_proj swapped in the file: the import follows the names, so the logits move;
    an expert tensor removed, or of another shape, is refused with its name."""
    hf = hf_model()
    hf.save_pretrained(str(tmp_path))
    tensors = load_file(str(tmp_path / SINGLE))
    a, b = (f"model.layers.1.mlp.experts.{j}.gate_proj.weight" for j in (0, 1))
    tensors[a], tensors[b] = tensors[b], tensors[a]
    save_file(tensors, str(tmp_path / SINGLE), metadata={"format": "pt"})
    model = titan()
    import_hf(model, tmp_path, adapter=SPEC.hf_adapter)
    with torch.no_grad():
        assert max_rel(model(tokens()), hf(tokens()).logits) > 1e-3
    missing = "model.layers.2.mlp.experts.5.up_proj.weight"
    wrong = tensors.pop(missing)
    save_file(tensors, str(tmp_path / SINGLE), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=rf"has no tensor '{missing}'"):
        import_hf(titan(), tmp_path, adapter=SPEC.hf_adapter)
    tensors[missing] = wrong[:-1]
    save_file(tensors, str(tmp_path / SINGLE), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=rf"'{missing}' has shape \(31, 64\), this model \(32, 64\)"):
        import_hf(titan(), tmp_path, adapter=SPEC.hf_adapter)
