"""A tool's own command-line options, split from the config's (`--config` and `--section.key` overrides).

The tools (HF export, generation) take the same config arguments as training, so the run they act on is
named the same way; their own options are `--name value` or `--name=value` pairs with defaults.
"""

from __future__ import annotations

import math

from titanlite.errors import ConfigError


def split_options(argv: list[str], defaults: dict[str, str]) -> tuple[dict[str, str], list[str]]:
    """(this tool's options, with `defaults` for those not given; the remaining arguments for
    `load_config`, which checks them)."""
    opts, rest, i = dict(defaults), [], 0
    while i < len(argv):
        name, eq, value = argv[i].partition("=")
        if name in opts:
            if not eq:
                if i + 1 >= len(argv):
                    raise ConfigError(f"{name} needs a value")
                value, i = argv[i + 1], i + 1
            opts[name] = value
        else:
            rest.append(argv[i])
        i += 1
    return opts, rest


def number(opts: dict[str, str], name: str, kind: type = int) -> int | float:
    """Option `name` as an int or a finite float, or one line naming it."""
    try:
        value = kind(opts[name])
    except ValueError:
        value = None
    if value is None or not math.isfinite(value):
        raise ConfigError(f"{name} {opts[name]!r} is not {'an integer' if kind is int else 'a finite number'}")
    return value
