"""Byte-level BPE tokenizer in tiktoken's format (the Llama 3 tokenizer's format).

A tiktoken file holds only the mergeable ranks: one line per token, `base64(bytes) rank`, where the
rank is the merge order (the 256 single bytes come first). Special tokens are not in the file;
like Llama 3 we append them after the last rank:

- a file with exactly 128,000 ranks is taken to be the Llama 3 `tokenizer.model` and gets Llama 3's
  256 special tokens (`<|begin_of_text|>` = 128000, `<|end_of_text|>` = 128001, ...), so Meta's
  checkpoints and ids line up;
- any other file (such as the bundled `assets/pydocs_2k.tiktoken`, 2048 ranks trained on the
  bundled corpus by `titanlite.tools.build_tokenizer`) gets a small set: BOS, EOS and 6 reserved.

Text that happens to contain a special-token string is encoded as plain text: data must never be
able to inject control tokens, and the loader must never crash on odd text.
"""

from __future__ import annotations

import base64
from collections.abc import Iterable
from pathlib import Path

import tiktoken

from titanlite.errors import ConfigError

BUNDLED_VOCAB = Path(__file__).resolve().parent / "assets" / "pydocs_2k.tiktoken"

# Llama 3's pre-tokenization regex (cl100k style): words with their leading space, numbers of at most
# 3 digits, punctuation runs, and whitespace, so that BPE merges never cross these boundaries.
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
LLAMA3_N_RANKS = 128_000
LLAMA3_N_SPECIAL = 256
BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
SMALL_N_RESERVED = 6


def special_tokens(n_ranks: int) -> dict[str, int]:
    """The special tokens appended after `n_ranks` BPE ranks, as {string: id}.

    The Llama 3 layout (Llama 3.1 names) for a 128,000-rank file, else BOS, EOS and a few reserved.
    """
    if n_ranks == LLAMA3_N_RANKS:
        named = [
            BOS_TOKEN,
            EOS_TOKEN,
            "<|reserved_special_token_0|>",
            "<|reserved_special_token_1|>",
            "<|finetune_right_pad_id|>",
            "<|step_id|>",
            "<|start_header_id|>",
            "<|end_header_id|>",
            "<|eom_id|>",
            "<|eot_id|>",
            "<|python_tag|>",
        ]
        reserved = [f"<|reserved_special_token_{i}|>" for i in range(2, 2 + LLAMA3_N_SPECIAL - len(named))]
    else:
        named = [BOS_TOKEN, EOS_TOKEN]
        reserved = [f"<|reserved_special_token_{i}|>" for i in range(SMALL_N_RESERVED)]
    return {token: n_ranks + i for i, token in enumerate(named + reserved)}


def load_ranks(path: str | Path) -> dict[bytes, int]:
    """Read a tiktoken BPE file: ranks must be exactly 0..n-1 with distinct byte strings, and every one of
    the 256 single bytes must be a token.

    Parsed here rather than with `tiktoken.load`, which keeps a cache keyed by path (a rebuilt
    file would be served stale) and may try to download.
    """
    ranks: dict[bytes, int] = {}
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                token, rank = line.split()
                ranks[base64.b64decode(token, validate=True)] = int(rank)
            except ValueError:
                raise ConfigError(f"{path}:{lineno}: not a tiktoken BPE file (expected 'base64 rank')") from None
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ConfigError(f"{path}: BPE ranks must be 0..n-1 over distinct tokens")
    # Byte-level BPE encodes any text only if every single byte is a token; without them tiktoken
    # panics (in Rust, in every rank) on the first text that needs a missing byte.
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        raise ConfigError(
            f"{path}: {len(missing)} of the 256 single bytes have no token (first: 0x{missing[0]:02x}); "
            "a byte-level BPE file needs all of them"
        )
    return ranks


class TiktokenTokenizer:
    """A tiktoken BPE with BOS/EOS: `encode(text, bos=, eos=)` and `decode(ids)` (`data/tokenizer.py`'s
    interface).

    `n_words` is the full vocabulary size (ranks + special tokens), the model's embedding size.
    `pad_id` is -1: packed sequences never need padding (the Llama 3 convention).
    """

    def __init__(self, path: str | Path) -> None:
        ranks = load_ranks(path)
        specials = special_tokens(len(ranks))
        self.path = str(path)
        self.model = tiktoken.Encoding(
            name=Path(path).name, pat_str=LLAMA3_PATTERN, mergeable_ranks=ranks, special_tokens=specials
        )
        self.n_words: int = self.model.n_vocab
        self.bos_id: int = specials[BOS_TOKEN]
        self.eos_id: int = specials[EOS_TOKEN]
        self.pad_id: int = -1

    def encode(self, text: str, *, bos: bool, eos: bool) -> list[int]:
        ids = self.model.encode_ordinary(text)  # special-token strings stay plain text
        if bos:
            ids.insert(0, self.bos_id)
        if eos:
            ids.append(self.eos_id)
        return ids

    def decode(self, ids: Iterable[int]) -> str:
        """Text of `ids` (a list or a tensor); invalid UTF-8 across token boundaries becomes U+FFFD."""
        return self.model.decode(ids.tolist() if hasattr(ids, "tolist") else list(ids))

    def __repr__(self) -> str:
        return f"TiktokenTokenizer({self.path!r}, n_words={self.n_words})"
