"""The folders show the layers: few modules directly under titanlite/ (a concept joins the package of its
layer), and each one and each package is a layer of import-linter's contract, so none imports upward
unchecked (`lint-imports` in run_tests.sh enforces the arrows themselves)."""

from __future__ import annotations

import tomllib

from harness import ROOT

PACKAGE = ROOT / "titanlite"
MAX_TOP_LEVEL_MODULES = 4
"""Modules directly under titanlite/ besides `__init__.py` and the packages."""


def top_level_modules() -> list[str]:
    return sorted(p.stem for p in PACKAGE.glob("*.py") if p.name != "__init__.py")


def top_level_packages() -> list[str]:
    return sorted(p.parent.name for p in PACKAGE.glob("*/__init__.py"))


def layered_names() -> set[str]:
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    layers = next(c for c in contracts if c["type"] == "layers")["layers"]
    return {name.strip().removeprefix("titanlite.") for layer in layers for name in layer.split(":")}


def test_at_most_four_modules_sit_directly_under_titanlite():
    modules = top_level_modules()
    assert len(modules) <= MAX_TOP_LEVEL_MODULES, (
        f"{len(modules)} modules directly under titanlite/ (at most {MAX_TOP_LEVEL_MODULES}): "
        f"{', '.join(modules)}; move the new one into the package of its layer "
        f"({', '.join(top_level_packages())})"
    )


def test_every_top_level_module_and_package_is_a_layer_of_the_import_contract():
    unlayered = sorted(set(top_level_modules() + top_level_packages()) - layered_names())
    assert not unlayered, (
        f"not in pyproject.toml's import-linter layers, so their imports are unchecked: {', '.join(unlayered)}"
    )


def test_the_checks_see_the_tree_they_guard():
    # Negative control: the globs find the known modules and packages, and the contract names them.
    assert {"train", "errors"} <= set(top_level_modules())
    assert {"parallelisms", "models", "launcher", "run", "planning", "compile"} <= set(top_level_packages())
    assert {"run", "parallelisms", "launcher"} <= layered_names()
