"""`--help`: every section and key of the schema in words, read from the schema itself (types, defaults,
ranges and the attribute docstrings), so the help cannot drift from what the loader accepts."""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import json
import re
import textwrap
from typing import Any, Literal, get_args, get_origin

from titanlite.config.ranges import Range
from titanlite.config.schema import FIELD_TYPES, DatasetSource, sections

USAGE = (
    "usage: ./run_train.sh [--config FILE] [--dry-run | --plan] [--section.key VALUE | --section.key=VALUE | "
    "--section.flag | --no-section.flag ...]"
)


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """A dataclass's attribute docstrings (the string under each field), read from its source and its
    dataclass bases' (`parallelism` holds the keys each unit declares): Python keeps them nowhere at run
    time, and the schema's own docstrings are the one place keys are described."""
    docs: dict[str, str] = {}
    for base in reversed(cls.__mro__):
        if dataclasses.is_dataclass(base):
            docs.update(_own_field_docs(base))
    return docs


def _own_field_docs(cls: type) -> dict[str, str]:
    """The attribute docstrings in one class's own body."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[node.target.id] = inspect.cleandoc(nxt.value.value)
    return docs


def first_sentence(text: str) -> str:
    """The first sentence of a docstring's first paragraph, on one line."""
    para = " ".join(text.split("\n\n")[0].split())
    return re.split(r"(?<!e\.g)(?<!i\.e)\.\s+(?=[A-Z`(])", para, maxsplit=1)[0].rstrip(".") + "."


def describe_type(typ: Any, domain: Range | None) -> str:
    """A field's type for people: `int, positive`, `one of a|b`, `list of str`."""
    if get_origin(typ) is Literal:
        return "one of " + "|".join(get_args(typ))
    if get_origin(typ) is list and get_args(typ)[0] is DatasetSource:
        return "list of PATH:WEIGHT (comma-separated), or TOML tables {path, weight, name}"
    if get_origin(typ) is list:
        return f"list of {get_args(typ)[0].__name__} (comma-separated)"
    name = getattr(typ, "__name__", str(typ))
    return f"{name}, {domain.describe()}" if domain is not None else name


def help_text() -> str:
    """Every section and key of the schema with its type, default and one-line description."""
    out = [
        USAGE,
        "",
        "Train a model from a TOML config (default train_configs/debug_model.toml) plus overrides of any key below;",
        "bad input stops with one line and exit code 2 before any process starts. --dry-run plans memory on a fake",
        "process group instead of training; --plan searches the parallel layouts for the fastest that fits.",
        "Environment: NGPU, NNODES, RDZV_ENDPOINT, LOG_RANK, MAX_RESTARTS",
        "(see the header of run_train.sh). --job.print_config prints the merged config and exits.",
    ]
    for section, cls in sections().items():
        hints, docs = FIELD_TYPES[section], field_docs(cls)
        out += ["", f"[{section}]  {first_sentence(inspect.getdoc(cls) or '')}"]
        for f in dataclasses.fields(cls):
            if f.name == "config_file":
                continue  # set by --config
            default = f.default_factory() if f.default is dataclasses.MISSING else f.default  # type: ignore[misc]
            shown = ",".join(default) if isinstance(default, list) else json.dumps(default)
            typ = describe_type(hints[f.name], f.metadata.get("range"))
            out.append(f"  --{section}.{f.name} ({typ}; default {shown})")
            out.append(f"      {first_sentence(docs.get(f.name, ''))}")
    return "\n".join(out)


def help_requested(argv: list[str]) -> bool:
    return any(a in ("-h", "--help") for a in argv)
