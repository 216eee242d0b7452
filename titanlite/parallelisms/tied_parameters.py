"""Parameters a model shares between modules (tied embeddings: the output projection's weight is the
embedding's), kept one Parameter through parallelisation and materialisation.

torch replaces parameters module by module (tensor parallelism, SimpleFSDP, `to_empty`), which would turn one
shared Parameter into two that train apart. So `parallelize` records the model's ties (`TiedParameters.of`)
and ties the aliases back after the model-parallel units (`retie`), before data parallelism shards the one
Parameter once, and `build` ties them again after `to_empty`: a tied weight has one shard, one gradient, one
optimizer state and one checkpoint value. The run plan refuses tied embeddings under pipeline parallelism.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class TiedParameters:
    groups: tuple[tuple[str, ...], ...] = ()
    """FQNs that name one Parameter, the first (in module order) its owner."""

    @classmethod
    def of(cls, model: nn.Module) -> TiedParameters:
        """The ties of `model` as it is now."""
        by_id: dict[int, list[str]] = {}
        for fqn, param in model.named_parameters(remove_duplicate=False):
            by_id.setdefault(id(param), []).append(fqn)
        return cls(tuple(tuple(fqns) for fqns in by_id.values() if len(fqns) > 1))

    def retie(self, model: nn.Module) -> None:
        """Make every alias of each group hold its owner's Parameter (as it is now: a DTensor shard or
        plain). Sets the module's `_parameters` entry itself: a SimpleFSDP module's attribute is its
        gather, not the parameter."""
        for owner, *aliases in self.groups:
            param = _slot(model, owner)
            for alias in aliases:
                module, name = _module_and_name(model, alias)
                module._parameters[name] = param


def _module_and_name(model: nn.Module, fqn: str) -> tuple[nn.Module, str]:
    path, _, name = fqn.rpartition(".")
    return model.get_submodule(path), name


def _slot(model: nn.Module, fqn: str) -> nn.Parameter:
    module, name = _module_and_name(model, fqn)
    param = module._parameters[name]
    assert param is not None, fqn
    return param
