"""`python -m titanlite.config [--help] [--config FILE] [overrides]`: the schema in words, or the merged
config as JSON (run_train.sh's `--help`; it needs no torch, so it answers at once)."""

from __future__ import annotations

import os
import sys

from titanlite.config.help import help_requested, help_text
from titanlite.config.loading import load_config
from titanlite.config.schema import DEFAULT_CONFIG
from titanlite.errors import run_cli


def main(argv: list[str]) -> int:
    text = help_text() if help_requested(argv) else load_config(argv, default_config=DEFAULT_CONFIG).to_json()
    try:
        print(text, flush=True)
    except BrokenPipeError:  # `--help | head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
