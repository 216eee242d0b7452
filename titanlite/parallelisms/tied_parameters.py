"""Parameters a model shares between modules (tied embeddings: the output projection's weight is the
embedding's), kept one Parameter through parallelisation and materialisation.

torch replaces parameters module by module: tensor parallelism distributes each module's parameters
(`distribute_module`), SimpleFSDP shards each module's own, and `to_empty` materialises each module's
own; each would turn one shared Parameter into two that train apart. So `parallelize` records the ties
of the model it is given (`TiedParameters.of`), and ties the aliases back to the owner's parameter
after the model-parallel units (`retie`): tensor parallelism places a tied embedding and output
projection alike (both shard the vocabulary rows, `models/common/tensor_parallel.py`), data parallelism
then sees one Parameter in two modules (SimpleFSDP shards it once and gives both modules its one gather,
`simple_fsdp.data_parallel`; FSDP2 manages a shared parameter of one group once, and the embedding and
output are in the root's group), and `build` ties them again after `to_empty`. So a tied weight has one
shard, one gradient (both uses accumulate into it), one optimizer state and one checkpoint value.

Pipeline stages cannot tie a weight their first and last stage would each hold: the run plan refuses tied
embeddings under pipeline parallelism.
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
