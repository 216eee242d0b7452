"""The tokenizer a run reads: the interface the data loader, generation and the export use, and the one
place that picks its implementation from `model.tokenizer_path`.

- empty: the bundled 2k vocabulary (`assets/pydocs_2k.tiktoken`);
- a `.json` file or a folder: a Hugging Face `tokenizer.json` (`data/tokenizer_json.py`, the `tokenizers`
  library: Qwen3's and Llama 3's published tokenizers);
- any other file: tiktoken's format (`data/tiktoken_bpe.py`, such as Llama 3's `original/tokenizer.model`).

Both encode a special token's string found in text as plain text: data can never inject control tokens.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from pathlib import Path
from typing import Protocol

from titanlite.data.tiktoken_bpe import BUNDLED_VOCAB, TiktokenTokenizer
from titanlite.data.tokenizer_json import HFTokenizer, is_tokenizer_json, tokenizer_json_files
from titanlite.errors import ConfigError


class Tokenizer(Protocol):
    """`encode(text, bos=, eos=)` and `decode(ids)`; `n_words` is the vocabulary size (the model's embedding
    rows), `bos_id` None where the tokenizer has no BOS, `pad_id` -1 (packed sequences never pad)."""

    path: str
    n_words: int
    bos_id: int | None
    eos_id: int
    pad_id: int

    def encode(self, text: str, *, bos: bool, eos: bool) -> list[int]: ...

    def decode(self, ids: Iterable[int]) -> str: ...


def tokenizer_files(path: str) -> list[Path]:
    """The files that make the tokenizer at `path` ("" = the bundled one): what its fingerprint hashes."""
    if not path:
        return [BUNDLED_VOCAB]
    if is_tokenizer_json(path):
        file, config = tokenizer_json_files(path)
        return [file] if config is None else [file, config]
    return [Path(path)]


def tokenizer_digest(path: str) -> str:
    """A hash of the tokenizer's files (`tokenizer_files`): the content of a one-file tokenizer; each file's
    size and content in order where there are more. Checkpoints and pre-tokenized data record it: token
    ids mean something only under the vocabulary that made them."""
    files = tokenizer_files(path)
    if len(files) == 1:
        return hashlib.blake2b(files[0].read_bytes(), digest_size=8).hexdigest()
    digest = hashlib.blake2b(digest_size=8)
    for file in files:
        digest.update(f"{file.stat().st_size}\0".encode())
        digest.update(file.read_bytes())
    return digest.hexdigest()


def build_tokenizer(path: str | None) -> Tokenizer:
    """The tokenizer at `path` (module docstring), or the bundled 2k vocabulary for None/""."""
    if not path:
        return TiktokenTokenizer(BUNDLED_VOCAB)
    if not Path(path).exists():
        raise ConfigError(f"model.tokenizer_path: no such file {path}")
    if is_tokenizer_json(path):
        return HFTokenizer(path)
    return TiktokenTokenizer(path)
