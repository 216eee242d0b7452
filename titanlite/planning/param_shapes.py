"""The model's parameters per tensor-parallel degree, from meta-device builds: what the layout search sizes.

A layout search asks the memory and the data-parallel traffic of thousands of layouts; building the model
for each is out of the question, and what they need of it is each parameter's tensor-parallel local
shape, dtype and place (its block, or before or after the blocks). `ShapeTable` builds the model once per
tensor-parallel degree on the meta device, with TP alone, by the builder its caller hands it (`MetaBuild`:
building is the run's, a layer above planning), and keeps one `ParamShape` per parameter; data-parallel
sharding is then arithmetic (`ParamShape.local_numel`), in `layout_memory.py`.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from titanlite.config import JobConfig
from titanlite.parallelisms.expert_parallel.unit import expert_modules
from titanlite.parallelisms.float8.unit import converted_weights
from titanlite.parallelisms.parallel_dims import reset_to_data_parallel
from titanlite.planning.run_plan import RunPlan


@dataclass(frozen=True)
class ParamShape:
    fqn: str
    unit: str
    """Its block's FQN, or "" outside the blocks."""
    block: int
    """Its block's index, or -1 outside the blocks."""
    before: bool
    """A root module before the blocks (the embedding): held by the first pipeline stage."""
    shape: tuple[int, ...]
    """The tensor-parallel local shape (what a data-parallel gather produces)."""
    itemsize: int
    trainable: bool
    float8: bool = False
    """The weight of a float8 layer (`float8.converted_weights`)."""
    expert: bool = False
    """A weight of routed experts (a module with expert parallelism's seam): under expert parallelism it is
    split over the ep ranks first, and its data-parallel gather runs over the rest (efsdp)."""

    def local_numel(self, shard: int) -> int:
        if not self.shape:
            return 1
        return math.ceil(self.shape[0] / shard) * math.prod(self.shape[1:])

    @property
    def gathered_numel(self) -> int:
        return math.prod(self.shape)


MetaBuild = Callable[[RunPlan], nn.Module]
"""Builds the model of a run plan without pipeline parallelism on the meta device, as rank 0 of the plan's
world builds it (the dry run's `meta_model`: the builder is the run's, a layer above planning)."""


class ShapeTable:
    """The model's parameters per tensor-parallel degree, read from meta-device builds (one per degree)."""

    def __init__(self, cfg: JobConfig, plan: RunPlan, build: MetaBuild):
        self.cfg, self.plan, self.build = cfg, plan, build
        self._tables: dict[int, list[ParamShape]] = {}

    @staticmethod
    def key(cfg: JobConfig, plan: RunPlan) -> str:
        """What the table depends on, for sharing it between configs: the model's arguments and which of its
        layers are float8 (`ParamShape.float8`)."""
        f8 = cfg.float8
        return repr((plan.model_args, f8.enable and (f8.recipe, tuple(f8.filter_fqns))))

    def params(self, tp: int) -> list[ParamShape]:
        if tp not in self._tables:
            self._tables[tp] = self._build(tp)
        return self._tables[tp]

    def _build(self, tp: int) -> list[ParamShape]:
        cfg = copy.deepcopy(self.cfg)
        reset_to_data_parallel(cfg.parallelism)  # on a world of `tp` ranks: tensor parallelism alone
        cfg.parallelism.tensor_parallel_degree = tp
        cfg.compile.enable, cfg.activation_checkpoint.mode = False, "none"
        cfg.training.global_batch_size = -1
        plan = RunPlan.build(cfg, tp, tokenizer=self.plan.tokenizer, args=self.plan.model_args)
        model = self.build(plan)
        units = plan.spec.units(model)
        index = {fqn: i for i, fqn in enumerate(units.blocks)}
        float8 = converted_weights(model) if cfg.float8.enable else frozenset()
        experts = {id(p) for module in expert_modules(model) for p in module.parameters(recurse=False)}
        out = []
        for fqn, param in model.named_parameters():
            local = param.to_local() if hasattr(param, "to_local") else param
            unit = units.unit_of(fqn)
            before = not unit and any(fqn.startswith(b + ".") for b in units.before)
            out.append(
                ParamShape(
                    fqn,
                    unit,
                    index.get(unit, -1),
                    before,
                    tuple(local.shape),
                    local.element_size(),
                    param.requires_grad,
                    fqn in float8,
                    id(param) in experts,
                )
            )
        return out
