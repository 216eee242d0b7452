"""The tests' one config builder, one data-loader builder and one Llama 3-sized tokenizer file.

`config` is a run's `JobConfig` as the tests use it: the shipped defaults, computed in fp32 (the CPU's
dtype: bf16 compute is the CUDA default), no TensorBoard, the given dump folder, and any key set as
`section__name=value` (e.g. `training__seq_len=8`), after any presets a test file shares among its
cases. `loader` is a data loader of the byte tokenizer over
a path, with the keys the tests vary. `llama3_sized_tiktoken` writes a 128,000-rank `tokenizer.model`.
`transformers_model` is transformers' own model of a config, the reference of the HF round-trip tests.
"""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import torch

from titanlite.config import JobConfig
from titanlite.data.loader import TokenLoader, build_dataloader
from titanlite.data.tiktoken_bpe import BUNDLED_VOCAB, LLAMA3_N_RANKS, TiktokenTokenizer, load_ranks
from titanlite.data.tokenizer import Tokenizer, build_tokenizer


def config(dump: str | Path | None = None, *presets: dict[str, Any], **keys: Any) -> JobConfig:
    """A `JobConfig` with the tests' defaults (module docstring), then each of `presets` (a file's shared
    keys, as `{"section__name": value}`), then `keys` (`section__name=value`): a later value wins."""
    cfg = JobConfig()
    cfg.training.mixed_precision_param = "float32"
    cfg.metrics.enable_tensorboard = False
    if dump is not None:
        cfg.job.dump_folder = str(dump)
    for key, value in {k: v for preset in (*presets, keys) for k, v in preset.items()}.items():
        section, name = key.split("__")
        if not hasattr(getattr(cfg, section), name):
            raise AttributeError(f"no config key {section}.{name}")
        setattr(getattr(cfg, section), name, value)
    return cfg


def loader(
    path: str | Path,
    *,
    rank: int = 0,
    dp: int = 1,
    gbs: int = 8,
    lbs: int = 1,
    seq_len: int = 32,
    shards: int = 0,
    workers: int = 0,
    field: str = "text",
    tokenizer: Tokenizer | None = None,
) -> TokenLoader:
    """The data loader of dp rank `rank` of `dp` over `path` (`tokenizer`: the byte tokenizer unless
    given), global batch `gbs` of local batches `lbs`."""
    return build_dataloader(
        tokenizer=tokenizer or build_tokenizer(None),
        dataset_path=str(path),
        text_field=field,
        seq_len=seq_len,
        local_batch_size=lbs,
        global_batch_size=gbs,
        dp_rank=rank,
        dp_degree=dp,
        virtual_shards=shards,
        num_workers=workers,
    )


def llama3_sized_tiktoken(folder: Path) -> TiktokenTokenizer:
    """`folder/tokenizer.model` with 128,000 ranks (so Llama 3's size and 256 special tokens, ids 128000+): the
    bundled ranks padded with tokens no UTF-8 text can produce (0xf8 never occurs in UTF-8)."""
    ranks = load_ranks(BUNDLED_VOCAB)
    pad = [b"\xf8" + i.to_bytes(3, "big") for i in range(len(ranks), LLAMA3_N_RANKS)]
    tokens = [*sorted(ranks, key=ranks.get), *pad]
    path = folder / "tokenizer.model"
    path.write_text("\n".join(f"{base64.b64encode(t).decode()} {r}" for r, t in enumerate(tokens)))
    return TiktokenTokenizer(path)


def transformers_model(model_class: Any, hf_config: Any) -> torch.nn.Module:
    """`model_class(hf_config)` (a transformers `...ForCausalLM`), seeded 0, in eval mode, with every norm
    weight drawn from [0.5, 1.5] instead of 1, so a norm weight put in the wrong place moves the logits."""
    torch.manual_seed(0)
    model = model_class(hf_config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return model
