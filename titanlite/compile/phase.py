"""Compilation's place in the order of the parallelisms, as the order takes it (`parallelize.CompilePhase`).

`run/build.py` gives `parallelize` the phase this module builds, so the parallelisms import no compiler
and compilation sits above them as a layer: `apply` compiles the model after activation checkpointing and
before data parallelism (`compiler.apply_compile`), `after_data_parallel` installs compile scope
`prefetch`'s eager prefetcher on the wrapped model (`prefetch.apply_prefetch`). What the parallelisms
ask of the compiled code (inductor settings, graph breaks) the compiler reads from their units.
The compiler (torch._dynamo: seconds of import) is imported by compiled runs only, when the phase runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch import nn

from titanlite.config import JobConfig
from titanlite.parallelisms.parallel_dims import ParallelDims
from titanlite.parallelisms.units import Units

if TYPE_CHECKING:
    from titanlite.compile.report import CompileReport
    from titanlite.parallelisms.activation_checkpoint import CheckpointedBlock
    from titanlite.parallelisms.data_parallel.reshard import ReshardPolicy


def compiles_model(cfg: JobConfig) -> bool:
    """Whether the run compiles its model (`compile.enable` with `model` among `compile.components`)."""
    return cfg.compile.enable and "model" in cfg.compile.components


@dataclass
class Compilation:
    """One model's compile phase (`parallelize.CompilePhase`); `report` is its compile report, once
    `apply` installed graph passes."""

    cfg: JobConfig
    dims: ParallelDims
    report: CompileReport | None = None

    @classmethod
    def of(cls, cfg: JobConfig, dims: ParallelDims) -> Compilation | None:
        """The phase for a run of `cfg` on `dims`; None where the model runs eager."""
        return cls(cfg, dims) if compiles_model(cfg) else None

    def apply(self, model: nn.Module, units: Units, ac: dict[str, CheckpointedBlock], reshard: ReshardPolicy) -> None:
        from titanlite.compile.compiler import apply_compile

        self.report = apply_compile(model, units, ac, self.cfg, self.dims, reshard)

    def after_data_parallel(self, model: nn.Module, units: Units, reshard: ReshardPolicy) -> None:
        if self.report is not None:
            from titanlite.compile.prefetch import apply_prefetch

            apply_prefetch(model, units, reshard, self.report)
