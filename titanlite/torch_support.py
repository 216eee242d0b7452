"""The torch releases titanlite supports, and the features that need a newer one than the oldest.

One place for the range: `pyproject.toml` states it to pip (a test checks that the two agree),
`scripts/deps.py` reads it here to accept or refuse an environment's torch without importing torch, and
`check` (run by `RunPlan.build`, so in the launcher's preflight before any rank starts, and in the dry
run) refuses, in one line naming the release, a run that asks for a feature the running torch lacks.
The oldest release is the one in common GPU images and site containers; the newest is the newest
release at the time of writing. Every release in between is tested with `scripts/torch_matrix.sh`.

This module imports neither torch nor titanlite's modules that do: the set-up scripts read it before they
know whether torch can be imported at all.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from titanlite.errors import ConfigError

OLDEST = (2, 11)
"""The oldest supported torch release (major, minor)."""
NEWEST = (2, 15)
"""The newest torch release titanlite is tested with; newer releases run with a warning."""
SETUP_VERSION = "2.13.0"
"""The torch that `scripts/env.sh` installs into a project-local `.venv` that has none."""


@dataclass(frozen=True)
class Feature:
    """A setting that needs a newer torch than `OLDEST`; `used(cfg)` says whether a config asks for it."""

    setting: str
    minimum: tuple[int, int]
    why: str
    used: Callable[[Any], bool]


FEATURES: tuple[Feature, ...] = (
    Feature(
        "compile.bucketing = auto",
        (2, 13),
        "torch's FSDP bucketing passes, torch._inductor.fx_passes.fsdp.identify_fsdp_groups, arrived in 2.13",
        lambda cfg: cfg.compile.enable and cfg.compile.bucketing == "auto",
    ),
)
"""Settings that need more than the oldest release, found by running the test suite on every release of
the range (scripts/torch_matrix.sh); each refused in one line where the running torch is older."""


def release(version: str) -> tuple[int, int]:
    """'2.11.0+cu130' -> (2, 11); an unreadable version counts as the newest."""
    m = re.match(r"(\d+)\.(\d+)", version)
    return (int(m.group(1)), int(m.group(2))) if m else NEWEST


def name(r: tuple[int, int]) -> str:
    return f"{r[0]}.{r[1]}"


def range_text() -> str:
    return f"{name(OLDEST)} to {name(NEWEST)}"


def problem(version: str) -> str | None:
    """Why a torch of this version cannot run titanlite (one line), or None."""
    if release(version) < OLDEST:
        return f"torch {version} is older than {name(OLDEST)}, the oldest supported (supported: {range_text()})"
    return None


def warning(version: str) -> str | None:
    """A line to show for a torch newer than the newest tested, or None."""
    if release(version) > NEWEST:
        return f"torch {version} is newer than {name(NEWEST)}, the newest tested (supported: {range_text()})"
    return None


def supports(setting: str, version: str) -> bool:
    """Whether torch `version` has what the feature named `setting` needs (tests skip what it lacks)."""
    return all(release(version) >= f.minimum for f in FEATURES if f.setting == setting)


def check(cfg: Any, version: str) -> None:
    """Refuse a config that asks for a feature torch `version` lacks: a ConfigError naming the release."""
    have = release(version)
    for f in FEATURES:
        if have < f.minimum and f.used(cfg):
            raise ConfigError(f"{f.setting} needs torch {name(f.minimum)} or newer ({f.why}); this is torch {version}")


def flat_all_gather() -> Callable:
    """`torch.distributed`'s flat all-gather: `all_gather_single` where torch has it (2.13 deprecates the
    older name, which 2.11 and 2.12 alone have), with the same signature. torch is imported when called."""
    import torch.distributed as dist

    return getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def dtype(name: str) -> Any:
    """The torch dtype a config's dtype name (`config.DtypeName`: `float32`, `bfloat16`, `float16`) names.
    torch is imported when this is called, by a rank or a tool, never when this module is."""
    import torch

    return getattr(torch, name)
