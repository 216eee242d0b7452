"""The folders show the layers: few modules directly under titanlite/ (a concept joins the package of its
layer), and each one and each package is a layer of import-linter's contract, so none imports upward
unchecked (`lint-imports` in run_tests.sh enforces the arrows themselves); the config's sections declared
beside their code import first and without torch."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys

import tomllib

from harness import ROOT
from titanlite.config.schema import SECTION_TYPES, DatasetSource

PACKAGE = ROOT / "titanlite"
COMPILE_READS = {"data_parallel"}
"""The parallelisms' folders the compile package imports: SimpleFSDP, whose collectives its graph passes
bucket and whose eager prefetcher it installs. What other parallelisms need of compiled code it reads
from their units (`parallelize.compile_options`, `parallelize.graph_break`)."""
MAX_TOP_LEVEL_MODULES = 4
"""Modules directly under titanlite/ besides `__init__.py` and the packages."""


def top_level_modules() -> list[str]:
    return sorted(p.stem for p in PACKAGE.glob("*.py") if p.name != "__init__.py")


def top_level_packages() -> list[str]:
    return sorted(p.parent.name for p in PACKAGE.glob("*/__init__.py"))


def contracts() -> list[dict]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]


def layered_names() -> set[str]:
    layers = next(c for c in contracts() if c["type"] == "layers")["layers"]
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
    assert {"parallelisms", "models", "launcher", "run", "planning", "compile", "fault_tolerance"} <= set(
        top_level_packages()
    )
    assert {"run", "parallelisms", "launcher", "fault_tolerance"} <= layered_names()


def section_modules() -> set[str]:
    """The modules declaring config sections beside their code, as the import contract on them lists them."""
    return set(next(c for c in contracts() if c["name"].startswith("A config section"))["source_modules"])


def imports_torch(module: str) -> bool:
    """Whether importing `module` first, in a fresh interpreter, loads torch (the import must succeed)."""
    code = f"import importlib, sys; importlib.import_module({module!r}); print('torch' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, f"importing {module} first fails:\n{proc.stderr}"
    return proc.stdout.split() == ["True"]


def test_the_contract_on_config_sections_names_every_module_that_declares_one():
    declaring = {
        base.__module__
        for cls in [*SECTION_TYPES.values(), DatasetSource]
        for base in cls.__mro__
        if dataclasses.is_dataclass(base)
    }
    assert declaring - {"titanlite.config.schema"} == section_modules()


def test_each_config_section_imports_first_and_without_torch():
    # What import-linter cannot see: a package's __init__ runs before its config module, and a section
    # module imported before the schema must not meet the schema half-built (through titanlite.config).
    loads_torch = [m for m in sorted(section_modules()) + ["titanlite.config"] if imports_torch(m)]
    assert not loads_torch, f"importing these loads torch: {', '.join(loads_torch)}"
    assert imports_torch("titanlite.metrics.logger")  # negative control: the probe sees torch


def parallelism_folders() -> set[str]:
    return {p.parent.name for p in (PACKAGE / "parallelisms").glob("*/__init__.py")}


def folders_imported(package: str) -> set[str]:
    """The parallelisms' folders that the modules of titanlite/<package> import."""
    pattern = re.compile(r"titanlite\.parallelisms\.(\w+)|from titanlite\.parallelisms import (\w+)")
    names = {n for path in (PACKAGE / package).rglob("*.py") for m in pattern.findall(path.read_text()) for n in m}
    return names & parallelism_folders()


def test_compilation_names_no_parallelism_but_data_parallelism():
    assert folders_imported("compile") == COMPILE_READS


def test_the_folder_check_sees_what_a_package_imports():
    # Negative control: the folders are found, and the order of the parallelisms (parallelize.py) names them.
    assert {"data_parallel", "expert_parallel", "float8", "tensor_parallel"} <= parallelism_folders()
    assert {"expert_parallel", "float8", "tensor_parallel"} <= folders_imported("parallelisms")
