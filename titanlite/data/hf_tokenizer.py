"""A run's tokenizer as Hugging Face tokenizer files (`tokenizer.json` + `tokenizer_config.json`), for the export.

A tokenizer read from Hugging Face files (`data/tokenizer_json.py`) is written as it was read. A
tiktoken-format one is converted, so that `AutoTokenizer.from_pretrained` on the export folder gives
titanlite's ids: the BPE ranks become a byte-level BPE with titanlite's pre-tokenization regex
(`transformers`' `TikTokenConverter`), the special tokens keep their ids, and encoding prepends BOS as
training does (`encode(text, bos=True, eos=False)`). No chat template is written: these are base models.

One difference is deliberate: titanlite encodes a special-token string found in text as plain text (data
must not inject control tokens), while HF tokenizers turn it into the special token, as users of Llama 3
expect; `tokenizer(text, split_special_tokens=True)` gives titanlite's ids for such text.

The conversion needs `transformers` and `tokenizers` (the `hf` extra); the core install does not.
"""

from __future__ import annotations

import json

from titanlite.data.tiktoken_bpe import BOS_TOKEN, EOS_TOKEN, LLAMA3_PATTERN, load_ranks, special_tokens
from titanlite.data.tokenizer import Tokenizer
from titanlite.data.tokenizer_json import TOKENIZER_CONFIG, TOKENIZER_JSON, HFTokenizer, tokenizer_json_files
from titanlite.errors import UserError


def hf_tokenizer_files(tokenizer: Tokenizer, model_max_length: int) -> dict[str, str]:
    """{file name: content} of the HF tokenizer equivalent to `tokenizer`."""
    if isinstance(tokenizer, HFTokenizer):
        file, config = tokenizer_json_files(tokenizer.path)
        files = {TOKENIZER_JSON: file.read_text(encoding="utf-8")}
        return files if config is None else {**files, TOKENIZER_CONFIG: config.read_text(encoding="utf-8")}
    try:
        from tokenizers import processors
        from transformers.convert_slow_tokenizer import TikTokenConverter
    except ImportError:
        raise UserError(
            "writing Hugging Face tokenizer files needs transformers and tokenizers: pip install -e '.[hf]'"
        ) from None
    ranks = load_ranks(tokenizer.path)
    specials = special_tokens(len(ranks))

    class Converter(TikTokenConverter):
        # Ranks read by titanlite's own parser: tiktoken's loader caches by path and may download.
        @staticmethod
        def load_tiktoken_bpe(tiktoken_url: str) -> dict[bytes, int]:
            return ranks

    names = sorted(specials, key=specials.get)
    hf = Converter(vocab_file=tokenizer.path, pattern=LLAMA3_PATTERN, extra_special_tokens=names).converted()
    got = {name: hf.token_to_id(name) for name in names}
    if got != specials:  # added tokens take the ids after the ranks, in order: a converter change would show here
        raise RuntimeError(f"special token ids differ after conversion: {got} != {specials}")
    bos = BOS_TOKEN
    hf.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1", special_tokens=[(bos, specials[bos])]
            ),
        ]
    )
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "clean_up_tokenization_spaces": False,
        "model_input_names": ["input_ids", "attention_mask"],
        "model_max_length": model_max_length,
    }
    return {TOKENIZER_JSON: hf.to_str(pretty=True), TOKENIZER_CONFIG: json.dumps(config, indent=2)}
