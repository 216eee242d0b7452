"""Loading a config: defaults < TOML file < command-line overrides, each key checked alone.

Every key is typed by its schema field, so an unknown key or a value of the wrong type is reported in one
line (naming the key, the file and the closest valid key) as a `ConfigError`, before anything is built.

Command-line forms: `--section.key value`, `--section.key=value`, `--section.flag` / `--no-section.flag`
for booleans, comma-separated lists.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import sys
import typing
from collections.abc import Iterator
from typing import Any, Literal, get_args, get_origin

from titanlite.config.ranges import Range
from titanlite.config.schema import (
    CHOICES,
    FIELD_TYPES,
    SOURCE_NAME,
    DatasetSource,
    JobConfig,
    all_keys,
    sections,
)
from titanlite.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib


def _suggest(name: str, candidates: list[str]) -> str:
    close = difflib.get_close_matches(name, candidates, n=1, cutoff=0.5)
    return f"; did you mean '{close[0]}'?" if close else ""


def _coerce(key: str, value: Any, typ: Any, origin: str) -> Any:
    """Convert a TOML or command-line value to the field's type, or raise a one-line ConfigError."""
    where = f" in {origin}" if origin else ""
    if get_origin(typ) is Literal:
        typ = str  # the value is checked against the choices by `validate`
    if get_origin(typ) is list:
        (item,) = get_args(typ)
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, list):
            raise ConfigError(f"config key '{key}'{where}: expected a list, got {value!r}")
        return [_coerce(key, v, item, origin) for v in value]
    if typ is DatasetSource:
        return _dataset_source(key, value, where)
    if typ is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "false", "0", "no"):
            return value.lower() in ("true", "1", "yes")
    elif typ in (int, float):
        # A number of the field's kind (an int too for a float), or its text.
        if isinstance(value, (int,) if typ is int else (int, float)) and not isinstance(value, bool):
            return typ(value)
        if isinstance(value, str):
            try:
                return typ(value)
            except ValueError:
                pass
    elif typ is str:
        if isinstance(value, str):
            return value
        if isinstance(value, int) and not isinstance(value, bool):
            return str(value)
    raise ConfigError(f"config key '{key}'{where}: expected {getattr(typ, '__name__', typ)}, got {value!r}")


def _dataset_source(key: str, value: Any, where: str) -> DatasetSource:
    """A mixture's source from a TOML table {path, weight, name} or the command line's `PATH:WEIGHT`."""
    if isinstance(value, str):
        try:
            return DatasetSource.parse(value)
        except ValueError as e:
            raise ConfigError(f"config key '{key}'{where}: {e}") from None
    if not isinstance(value, dict):
        raise ConfigError(f"config key '{key}'{where}: expected a table {{path, weight, name}}, got {value!r}")
    hints = typing.get_type_hints(DatasetSource)
    for name in value:
        if name not in hints:
            raise ConfigError(f"config key '{key}'{where}: unknown field {name!r} (a source has path, weight, name)")
    return DatasetSource(**{name: _coerce(f"{key}.{name}", v, hints[name], "") for name, v in value.items()})


def _type_of(key: str, origin: str) -> Any:
    """The schema's type of `section.key`, or one line naming the unknown section or key."""
    where = f" in {origin}" if origin else ""
    section, _, name = key.partition(".")
    if section not in FIELD_TYPES:
        raise ConfigError(f"unknown config section '{section}'{where}{_suggest(section, list(FIELD_TYPES))}")
    hints = FIELD_TYPES[section]
    if not name or name not in hints:
        raise ConfigError(f"unknown config key '{key}'{where}{_suggest(key, all_keys())}")
    return hints[name]


def _set(cfg: JobConfig, key: str, value: Any, origin: str) -> None:
    typ = _type_of(key, origin)
    section, _, name = key.partition(".")
    setattr(getattr(cfg, section), name, _coerce(key, value, typ, origin))


def load_toml(path: str) -> dict[str, Any]:
    """The TOML file `path` as a dict; whatever keeps it from being read is one line (`ConfigError`). A UTF-8
    byte-order mark, which some editors write, is skipped."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except IsADirectoryError:
        raise ConfigError(f"config file {path} is a folder: give a .toml file") from None
    except OSError as e:
        raise ConfigError(f"config file {path} cannot be read: {e.strerror}") from None
    try:
        text = raw.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file {path} is not UTF-8 text (byte {e.start}): save it as UTF-8") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"invalid TOML in {path}: {e}") from None


def apply_dict(cfg: JobConfig, data: dict[str, Any], origin: str) -> None:
    for section, body in data.items():
        if not isinstance(body, dict):
            raise ConfigError(
                f"config entry '{section}' in {origin} is not a [section]{_suggest(section, list(sections()))}"
            )
        for name, value in body.items():
            _set(cfg, f"{section}.{name}", value, origin)


def parse_overrides(args: list[str]) -> list[tuple[str, Any]]:
    """Turn `--a.b v`, `--a.b=v`, `--a.flag`, `--no-a.flag` into (key, raw value) pairs."""
    bool_keys = {f"{s}.{k}" for s, hints in FIELD_TYPES.items() for k, t in hints.items() if t is bool}
    out: list[tuple[str, Any]] = []
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected command-line argument '{arg}' (overrides look like --section.key value)")
        key, eq, value = arg[2:].partition("=")
        if eq:
            out.append((key, value))
        elif key.startswith("no-") and key[3:] in bool_keys:
            out.append((key[3:], False))
        elif key in bool_keys and (i + 1 == len(args) or args[i + 1].startswith("--")):
            out.append((key, True))
        else:
            # An unknown key is named before a value is looked for: `--fp4.enable --job.dump_folder X`
            # says fp4 is no section, as `--fp4.enable 1` does (not that X is unexpected).
            _type_of(key.removeprefix("no-"), "the command line")
            if i + 1 == len(args):
                raise ConfigError(f"command-line option '--{key}' needs a value")
            out.append((key, args[i + 1]))
            i += 1
        i += 1
    return out


def load_config(argv: list[str], default_config: str = "") -> JobConfig:
    """Build the JobConfig from `--config PATH` (or `default_config`) and the remaining overrides."""
    argv = list(argv)
    path = default_config
    for i, arg in enumerate(argv):
        if arg == "--config" or arg == "--job.config_file":
            if i + 1 >= len(argv):
                raise ConfigError(f"{arg} needs a path")
            path = argv[i + 1]
            del argv[i : i + 2]
            break
        if arg.startswith("--config=") or arg.startswith("--job.config_file="):
            path = arg.split("=", 1)[1]
            del argv[i]
            break
    cfg = JobConfig()
    if path:
        apply_dict(cfg, load_toml(path), path)
        cfg.job.config_file = path
    for key, value in parse_overrides(argv):
        _set(cfg, key, value, "the command line")
    validate(cfg)
    return cfg


def _numeric_values(cfg: JobConfig) -> Iterator[tuple[str, float, Range | None]]:
    """(`section.key`, value, its `Range` or None) for every int and float field of the schema."""
    for section, cls in sections().items():
        hints = FIELD_TYPES[section]
        for f in dataclasses.fields(cls):
            if hints[f.name] in (int, float):
                yield f"{section}.{f.name}", getattr(getattr(cfg, section), f.name), f.metadata.get("range")


def validate(cfg: JobConfig) -> None:
    """Check each key alone where its type cannot: choices, every numeric key's `Range`, finite floats,
    the forms of string and list keys. Rules between keys are the run plan's (`titanlite/planning/run_plan.py`), which
    also sees the world size and the model."""
    for key, allowed in CHOICES.items():
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        if value not in allowed:
            raise ConfigError(f"config key '{key}' = {value!r}: expected one of {', '.join(allowed)}")
    for key, value, domain in _numeric_values(cfg):
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"config key '{key}' must be a finite number, got {value}")
        if domain is not None and value not in domain:
            raise ConfigError(f"config key '{key}' must be {domain.describe()}, got {value}")
        unbounded = domain is None or domain.high == math.inf  # a key's own bound (the seed's 2**64 - 1) rules
        if isinstance(value, int) and unbounded and not -(2**63) <= value < 2**63:
            raise ConfigError(f"config key '{key}' must fit a 64-bit integer, got {value}")
    if cfg.optimizer.name != "AdamW":
        raise ConfigError(f"config key 'optimizer.name' = {cfg.optimizer.name!r}: expected AdamW")
    option = cfg.activation_checkpoint.selective_ac_option
    if option not in ("op", "op_all_mm") and not (option.isdigit() and int(option) > 0):
        raise ConfigError(
            f"config key 'activation_checkpoint.selective_ac_option' = {option!r}: "
            "expected 'op', 'op_all_mm' or a positive integer"
        )
    check_datasets(cfg)
    for component in cfg.compile.components:
        if component not in ("model", "loss"):
            raise ConfigError(f"config key 'compile.components' has {component!r}: expected model and/or loss")


BUNDLED_NAME = "corpus"
"""The default name of the bundled corpus (path "") in a mixture: its folder's name."""


def source_stem(path: str) -> str:
    """A mixture source's default name: the file or folder name of `path` up to its first dot (`web.jsonl.gz`
    -> `web`), a Hugging Face dataset's name without its owner, config and split, `corpus` for the bundled
    corpus."""
    if not path:
        return BUNDLED_NAME
    if path.startswith("hf://"):
        return path.removeprefix("hf://").partition("@")[0].partition(":")[0].rstrip("/").rpartition("/")[2]
    return path.rstrip("/").rpartition("/")[2].partition(".")[0]


NAME_IT = "`name` in its TOML table, NAME=PATH:WEIGHT on the command line"
"""How a mixture source gets a name of its own."""


def check_datasets(cfg: JobConfig) -> None:
    """`training.datasets`: each source named (by default after its file stem), with a positive weight and a
    name of its own, and not together with `training.dataset_path`."""
    t = cfg.training
    if not t.datasets:
        return
    if t.dataset_path:
        raise ConfigError(
            "config keys 'training.dataset_path' and 'training.datasets' are both set: train on one dataset or "
            "on a mixture, not both"
        )
    seen: dict[str, str] = {}
    for source in t.datasets:
        source.name = source.name or source_stem(source.path)
        what = f"config key 'training.datasets': source {source.name!r} ({source.path or 'the bundled corpus'})"
        if not math.isfinite(source.weight) or source.weight <= 0:
            raise ConfigError(f"{what} has weight {source.weight}: weights must be positive numbers")
        if not SOURCE_NAME.fullmatch(source.name):
            raise ConfigError(
                f"config key 'training.datasets': source {source.path!r} needs a name of letters, digits, '_', "
                f"'.' and '-' (got {source.name!r}; {NAME_IT})"
            )
        if source.name in seen:
            raise ConfigError(
                f"config key 'training.datasets': two sources are named {source.name!r} ({seen[source.name]!r} "
                f"and {source.path!r}); give them names of their own ({NAME_IT})"
            )
        seen[source.name] = source.path
    if not math.isfinite(sum(source.weight for source in t.datasets)):
        raise ConfigError(
            "config key 'training.datasets': the weights add up to more than a float holds; scale them down "
            "(only their ratios matter)"
        )
