"""A Hugging Face tokenizer (`tokenizer.json`, the format of Qwen3's and Llama 3's published tokenizers), read
through the `tokenizers` library.

`model.tokenizer_path` names the file or its folder; a `tokenizer_config.json` beside it gives BOS and EOS
(null for none, as Qwen3 has no BOS), else the usual names are looked up (`BOS_NAMES`, `EOS_NAMES`); EOS is
required. Special-token strings in text are encoded as plain text, as with the tiktoken format
(`encode_special_tokens`, set again after a pickle); added non-special tokens are vocabulary. `tokenizers` is
in the `hf` extra, imported only here; without it the preflight refuses the config in one line.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from titanlite.errors import ConfigError

TOKENIZER_JSON = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
BOS_NAMES = ("<|begin_of_text|>", "<s>", "<bos>")
"""BOS candidates when no `tokenizer_config.json` names it: Llama 3, Llama 2/Mistral, Gemma."""
EOS_NAMES = ("<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>")
"""EOS candidates when no `tokenizer_config.json` names it: Llama 3, Qwen/GPT-2, Llama 2/Mistral, Gemma."""
INSTALL = "pip install -e '.[hf]' (or pip install 'tokenizers>=0.20'; run_train.sh: TITANLITE_EXTRAS=hf)"


def is_tokenizer_json(path: str | Path) -> bool:
    """Whether `model.tokenizer_path` names this format: a `.json` file, or a folder."""
    return Path(path).is_dir() or Path(path).suffix.lower() == ".json"


def tokenizer_json_files(path: str | Path) -> tuple[Path, Path | None]:
    """The `tokenizer.json` that `path` names (the file, or the one in the folder) and the
    `tokenizer_config.json` beside it, None where there is none."""
    path = Path(path)
    file = path / TOKENIZER_JSON if path.is_dir() else path
    if not file.is_file():
        raise ConfigError(f"model.tokenizer_path {path}: a folder without a {TOKENIZER_JSON}")
    config = file.parent / TOKENIZER_CONFIG
    return file, config if config.is_file() else None


def _token_name(value: Any) -> str | None:
    """A config's token entry: a string, `{"content": str, ...}` (older transformers), or null; anything
    else (a number, a list, a dict without a string `content`) is an error: read as "no token", it would
    silently train without BOS."""
    name = value.get("content") if isinstance(value, dict) else value
    if value is None or isinstance(name, str):
        return name
    raise ValueError(f'{value!r} is not a token (a string, {{"content": "..."}} or null)')


class HFTokenizer:
    """A `tokenizer.json` with BOS/EOS from its config (module docstring); the same interface as
    `TiktokenTokenizer` (`data/tokenizer.py`). `n_words` is the largest id + 1, the model's embedding size;
    `bos_id` is None for a tokenizer without BOS (documents then start right after the previous EOS)."""

    def __init__(self, path: str | Path) -> None:
        try:
            import tokenizers
        except ImportError:
            raise ConfigError(
                f"model.tokenizer_path {path} is a Hugging Face tokenizer, which needs the tokenizers package: "
                f"{INSTALL}"
            ) from None
        self.path = str(path)
        file, config_file = tokenizer_json_files(path)
        try:
            self.model = tokenizers.Tokenizer.from_str(file.read_text(encoding="utf-8"))
        except Exception as e:  # the library's errors are plain Exceptions (serde's message)
            raise ConfigError(f"{file}: not a Hugging Face tokenizer.json ({str(e).splitlines()[0]})") from None
        self.model.encode_special_tokens = True
        config: dict = {}
        if config_file is not None:
            try:
                config = json.loads(config_file.read_text(encoding="utf-8"))
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise ConfigError(f"{config_file}: not JSON ({e})") from None
            if not isinstance(config, dict):
                raise ConfigError(f"{config_file}: not a JSON object")
        vocab = self.model.get_vocab(with_added_tokens=True)
        self.n_words: int = max(vocab.values()) + 1
        # `add_bos_token: false` (GPT-2's way: BOS and EOS are one `<|endoftext|>`) means documents get no
        # BOS; taking the named token would frame each packed document with it twice.
        add_bos = config.get("add_bos_token", True)
        if not isinstance(add_bos, bool):
            raise ConfigError(f"{config_file}: add_bos_token {add_bos!r} is not true or false")
        self.bos_id: int | None = (
            self._token_id(config, "bos_token", BOS_NAMES, config_file or file) if add_bos else None
        )
        eos_id = self._token_id(config, "eos_token", EOS_NAMES, config_file or file)
        if eos_id is None:
            raise ConfigError(
                f"model.tokenizer_path {path}: no EOS token (set eos_token in {TOKENIZER_CONFIG}, or add one of "
                f"{', '.join(EOS_NAMES)}); packed documents are separated by it"
            )
        self.eos_id: int = eos_id
        self.pad_id: int = -1

    def _token_id(self, config: dict, key: str, names: tuple[str, ...], where: Path) -> int | None:
        """The id of the config's `key` token (None for null), or else of the first of `names` there is."""
        if key in config:
            try:
                name = _token_name(config[key])
            except ValueError as e:
                raise ConfigError(f"{where}: {key} {e}") from None
            if name is None:
                return None
            token_id = self.model.token_to_id(name)
            if token_id is None:
                raise ConfigError(f"{where}: {key} {name!r} is not a token of {self.path}")
            return token_id
        return next((i for i in map(self.model.token_to_id, names) if i is not None), None)

    def encode(self, text: str, *, bos: bool, eos: bool) -> list[int]:
        ids = self.model.encode(text, add_special_tokens=False).ids  # special-token strings stay plain text
        if bos and self.bos_id is not None:
            ids.insert(0, self.bos_id)
        if eos:
            ids.append(self.eos_id)
        return ids

    def decode(self, ids: Iterable[int]) -> str:
        """Text of `ids` (a list or a tensor), special tokens included."""
        return self.model.decode(ids.tolist() if hasattr(ids, "tolist") else list(ids), skip_special_tokens=False)

    def __setstate__(self, state: dict) -> None:
        """Unpickled (the loader's workers): the library's pickle drops `encode_special_tokens`."""
        self.__dict__.update(state)
        self.model.encode_special_tokens = True

    def __repr__(self) -> str:
        return f"HFTokenizer({self.path!r}, n_words={self.n_words})"
