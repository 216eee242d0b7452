"""Generation with the KV cache: the same logits and tokens as running the model over the whole sequence, for
every family (Llama 3, dense Qwen3, Qwen3-MoE, whose routing depends on each token's hidden state only)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from harness import tiny_args
from titanlite.models import qwen3, qwen3_moe
from titanlite.models.llama3.model import Transformer
from titanlite.tools.generate import generate

SMALL = {"dim": 64, "n_heads": 4, "n_kv_heads": 2, "head_dim": 16, "vocab_size": 257, "ffn_dim": 96}


def build(family: str) -> torch.nn.Module:
    if family == "llama3":
        return Transformer(tiny_args(n_layers=2), seq_len=48)
    if family == "qwen3":
        return qwen3.Transformer(dataclasses.replace(qwen3.SPEC.flavors["debugmodel"], n_layers=2, **SMALL), seq_len=48)
    args = dataclasses.replace(qwen3_moe.SPEC.flavors["debugmodel"], n_layers=3, moe_ffn_dim=32, top_k=2, **SMALL)
    assert args.moe_layers == 2
    return qwen3_moe.Transformer(args, seq_len=48)


@pytest.fixture(scope="module", params=["llama3", "qwen3", "qwen3_moe"])
def model(request) -> torch.nn.Module:
    torch.manual_seed(0)
    m = build(request.param)
    m.init_weights(seed=1)
    return m.eval()


@torch.no_grad()
def test_cached_logits_equal_the_whole_sequence(model):
    tokens = torch.randint(0, model.args.vocab_size, (2, 40))
    full = model(tokens)
    cache = model.new_cache(2, 40)
    steps = [model(tokens[:, :25], cache=cache)]  # the prompt, then one position at a time
    steps += [model(tokens[:, i : i + 1], cache=cache) for i in range(25, 40)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-5, atol=1e-5)
    # Negative control: a cache that believes the new token sits elsewhere (wrong RoPE angle, wrong keys).
    shifted = model.new_cache(2, 40)
    model(tokens[:, :25], cache=shifted)
    shifted.pos += 1
    wrong = model(tokens[:, 25:26], cache=shifted)
    assert not torch.allclose(wrong, full[:, 25:26], rtol=1e-5, atol=1e-5)  # the check above would fail
    with pytest.raises(ValueError, match="a prompt at position 0"):
        model(tokens[:, :2], cache=cache)


def test_generate_gives_the_same_tokens_with_and_without_the_cache(model):
    prompt = list(range(3, 20))
    for temperature, top_k in ((0.0, 0), (1.0, 20)):
        got = [
            generate(
                model,
                prompt,
                24,
                temperature=temperature,
                top_k=top_k,
                generator=torch.Generator().manual_seed(5),
                use_cache=use_cache,
            )
            for use_cache in (True, False)
        ]
        assert got[0] == got[1] and len(got[0]) == 24
