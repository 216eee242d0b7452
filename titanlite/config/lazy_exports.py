"""A package's names that load on first use (PEP 562): the package maps each module to the names it
exports, and gets back the name -> module map, its `__all__` and the module `__getattr__` that imports a
name from its home when first read. `titanlite.config` and `titanlite.metrics` export this way, so that a
config section module beside its code imports without torch, or the schema that composes it (a cycle)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_exports(
    package: str, homes: dict[str, tuple[str, ...]]
) -> tuple[dict[str, str], list[str], Callable[[str], Any]]:
    """(each exported name -> the module that defines it, the sorted `__all__`, the `__getattr__` of
    `package`) for `homes` (module -> the names it exports)."""
    home = {name: module for module, names in homes.items() for name in names}

    def __getattr__(name: str) -> Any:
        """A name of `__all__`, imported from its module on first use (PEP 562)."""
        if name not in home:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(home[name]), name)

    return home, sorted(home), __getattr__
