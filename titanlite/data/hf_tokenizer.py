"""A run's tokenizer as Hugging Face tokenizer files (`tokenizer.json` + `tokenizer_config.json`), for the export.

`AutoTokenizer.from_pretrained` on the export folder must give the ids training gave (BOS first exactly where
the run's tokenizer has one), whatever the model family. A tiktoken-format tokenizer is converted to a
byte-level BPE (`transformers`' `TikTokenConverter`); one read from Hugging Face files keeps its model,
normalizer and pre-tokenizer. Either way the post-processor prepends BOS only where the run does, and
`tokenizer_config.json` is written anew as `PreTrainedTokenizerFast` (a family's own class may rebuild the
pre-tokenization), without EOS on encode and without a chat template: these are base models. Special-token
strings in text differ by design (plain text here, special tokens in HF; `split_special_tokens=True` agrees).
The files need the `hf` extra. What the export writes: docs/hf.md#export.
"""

from __future__ import annotations

import json
from typing import Any

from titanlite.data.tiktoken_bpe import LLAMA3_PATTERN, load_ranks, special_tokens
from titanlite.data.tokenizer import Tokenizer
from titanlite.data.tokenizer_json import TOKENIZER_CONFIG, TOKENIZER_JSON, HFTokenizer, tokenizer_json_files
from titanlite.errors import UserError

ADDS_TOKENS = ("TemplateProcessing", "BertProcessing", "RobertaProcessing")
"""Post-processors that add tokens to an encoding (the others only adjust offsets)."""


def hf_tokenizer_files(tokenizer: Tokenizer, model_max_length: int) -> dict[str, str]:
    """{file name: content} of the HF tokenizer equivalent to `tokenizer` (module docstring)."""
    try:
        from tokenizers import Tokenizer as Backend
        from tokenizers import processors
    except ImportError:
        raise _missing() from None
    if isinstance(tokenizer, HFTokenizer):
        backend = Backend.from_str(tokenizer_json_files(tokenizer.path)[0].read_text(encoding="utf-8"))
    else:
        backend = _converted(tokenizer.path)
    bos = backend.id_to_token(tokenizer.bos_id) if tokenizer.bos_id is not None else None
    eos = backend.id_to_token(tokenizer.eos_id)
    data = json.loads(backend.to_str())
    kept = _offset_processors(data.get("post_processor"))
    # The template, serialised by the library itself: `Sequence` of what is kept and it.
    backend.post_processor = processors.TemplateProcessing(
        single=f"{bos}:0 $A:0" if bos else "$A:0",
        pair=f"{bos}:0 $A:0 {bos}:1 $B:1" if bos else "$A:0 $B:1",
        special_tokens=[(bos, tokenizer.bos_id)] if bos else [],
    )
    template = json.loads(backend.to_str())["post_processor"]
    data["post_processor"] = {"type": "Sequence", "processors": [*kept, template]}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": eos,
        "add_bos_token": bos is not None,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_input_names": ["input_ids", "attention_mask"],
        "model_max_length": model_max_length,
    }
    return {
        TOKENIZER_JSON: json.dumps(data, indent=2, ensure_ascii=False),
        TOKENIZER_CONFIG: json.dumps(config, indent=2),
    }


def _offset_processors(processor: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The parts of a serialised post-processor that add no tokens (`ADDS_TOKENS`)."""
    if processor is None:
        return []
    parts = processor["processors"] if processor["type"] == "Sequence" else [processor]
    return [p for p in parts if p["type"] not in ADDS_TOKENS]


def _converted(path: str) -> Any:
    """The tiktoken file at `path` as a `tokenizers.Tokenizer` with the same ids (module docstring)."""
    try:
        from transformers.convert_slow_tokenizer import TikTokenConverter
    except ImportError:
        raise _missing() from None
    ranks = load_ranks(path)
    specials = special_tokens(len(ranks))

    class Converter(TikTokenConverter):
        # Ranks read by titanlite's own parser: tiktoken's loader caches by path and may download.
        @staticmethod
        def load_tiktoken_bpe(tiktoken_url: str) -> dict[bytes, int]:
            return ranks

    names = sorted(specials, key=specials.get)
    hf = Converter(vocab_file=path, pattern=LLAMA3_PATTERN, extra_special_tokens=names).converted()
    got = {name: hf.token_to_id(name) for name in names}
    if got != specials:  # added tokens take the ids after the ranks, in order: a converter change would show here
        raise RuntimeError(f"special token ids differ after conversion: {got} != {specials}")
    return hf


def _missing() -> UserError:
    return UserError("writing Hugging Face tokenizer files needs transformers and tokenizers: pip install -e '.[hf]'")
