"""A source of a weighted data mixture (`training.datasets`) as the config holds it, beside the loader that mixes
the sources (`loader.py`). Torch-free and importing nothing of titanlite: the config's schema
(titanlite/config/schema.py) types the `training` section's key with it, which the launcher and `--help` read
before any torch process exists."""

from __future__ import annotations

import re
from dataclasses import dataclass

SOURCE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
"""What a mixture source's name may be (it names metrics, `tokens_seen/<name>`, and checkpoint state)."""


@dataclass
class DatasetSource:
    """One source of a weighted mixture of training data (`training.datasets`)."""

    path: str = ""
    """Any form `training.dataset_path` takes; empty = the bundled corpus."""
    weight: float = 1.0
    """The source's share of the training tokens, relative to the other sources' weights (> 0)."""
    name: str = ""
    """What logs, metrics (`tokens_seen/<name>`) and checkpoints call the source; empty = the path's file stem."""

    @classmethod
    def parse(cls, text: str) -> DatasetSource:
        """The command-line form `[NAME=]PATH:WEIGHT` (the weight follows the last colon, so
        `hf://name:config:0.2` keeps its config; a name names a glob's or a shared file stem's source, as
        the TOML table's `name` does); ValueError when the weight is missing or not a number."""
        name, equals, rest = text.partition("=")
        if not (equals and SOURCE_NAME.fullmatch(name)):
            name, rest = "", text
        path, colon, weight = rest.rpartition(":")
        if not colon:
            raise ValueError(f"{text!r} has no weight (expected PATH:WEIGHT)")
        try:
            return cls(path=path, weight=float(weight), name=name)
        except ValueError:
            raise ValueError(f"{text!r}: the weight {weight!r} is not a number (expected PATH:WEIGHT)") from None
