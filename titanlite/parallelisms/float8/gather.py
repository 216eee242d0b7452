"""Float8 weight all-gather (`float8.all_gather`, tensorwise recipe): the data-parallel gathers of the float8
layers' weights move float8 bits, one byte per element instead of the training dtype's two or four.

A tensorwise layer casts its whole weight with one scale, so once the amax is global each rank casts its own
shard and the gathered bits are exactly what the layer would have cast. Once per step (`Float8Gathers.refresh`,
called by the step runner) every float8 weight's amax, scale and bits are computed at once: one all-reduce and
a handful of kernels per chunk of at most `CAST_CHUNK_BYTES`. Every gather of the step then all-gathers the
`bits` buffer and wraps it as torchao's float8 tensor. The layer's forward is one autograd function
(`_GatheredFloat8Matmul`), so the float8 tensor never carries a gradient and the weight's gradient goes back
as the plain gather's would. The buffers are graph inputs under compile and are not in the state dict;
FSDP2 uses torchao's own float8 all-gather. The whole mechanism: docs/float8.md.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from titanlite.parallelisms.data_parallel.replicate_compute import ReplicateComputation, ShardMeta
from titanlite.parallelisms.data_parallel.simple_fsdp import gathers_of

logger = logging.getLogger("titanlite")

_GATHERS = "_float8_gathers"
"""The attribute of a model holding its `Float8Gathers`; read through `float8_gathers_of` only."""


CAST_CHUNK_BYTES = 64 * 2**20
"""The temporaries `Float8Gathers.refresh` allocates to cast the shards, at most (or one shard's, if larger):
a chunk of shards in fp32 and, where the compute dtype is narrower, in the compute dtype."""


class Float8Wire(nn.Module):
    """The float8 form of one sharded weight (`ReplicateComputation.wire`): its shard's bits and the
    weight's scale, rewritten once per step by `Float8Gathers.refresh`."""

    itemsize = 1
    """Bytes per element on the wire."""

    def __init__(self, shard: DTensor, layer: nn.Module, compute_dtype: torch.dtype) -> None:
        super().__init__()
        local = shard.to_local()
        self.register_buffer("bits", torch.empty(local.shape, dtype=torch.uint8, device=local.device), persistent=False)
        self.register_buffer("scale", torch.ones((), dtype=torch.float32, device=local.device), persistent=False)
        self.float8_dtype: torch.dtype = layer.config.cast_config_weight.target_dtype
        self.round_scales: bool = layer.config.round_scales_to_power_of_2
        self.linear_mm_config = layer.linear_mm_config
        self.compute_dtype = compute_dtype

    def gather(self, gather: ReplicateComputation, x: DTensor) -> torch.Tensor:
        """The whole weight as torchao's float8 tensor: the shards' bits all-gathered (as bytes: not every
        backend carries float8 dtypes), with the weight's scale."""
        return self._float8(gather.gather_bytes(self.bits, x.shape, x.stride()))

    def shard_bytes(self, x: DTensor) -> torch.Tensor:
        """This rank's shard as it travels: its float8 bits."""
        return self.bits

    def from_bytes(self, data: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        """The gathered weight of `shape` from its gathered bytes (`data`, contiguous, one row per row)."""
        return self._float8(data.view(self.float8_dtype).reshape(shape))

    def _float8(self, data: torch.Tensor) -> torch.Tensor:
        from torchao.float8.float8_training_tensor import Float8TrainingTensor, GemmInputRole

        return Float8TrainingTensor(
            data.view(self.float8_dtype), self.scale, self.compute_dtype, self.linear_mm_config, GemmInputRole.WEIGHT
        )


class BytesWire(nn.Module):
    """A weight of a float8 run that stays in the training dtype, gathered as that dtype's raw bytes: every
    gather of the run then moves bytes, so torch's bucketing (one bucket per dtype) puts a block's float8
    and other weights in one bucket, as it does without float8."""

    def __init__(self, compute_dtype: torch.dtype) -> None:
        super().__init__()
        self.compute_dtype = compute_dtype
        self.itemsize = compute_dtype.itemsize
        """Bytes per element on the wire."""

    def gather(self, gather: ReplicateComputation, x: DTensor) -> torch.Tensor:
        # A trailing dim of the element's bytes: the shards along dim 0 are the parameter's own.
        shape = (*x.shape, self.itemsize)
        stride = tuple(s * self.itemsize for s in x.stride()) + (1,)
        return gather.gather_bytes(self.shard_bytes(x), shape, stride).view(self.compute_dtype).squeeze(-1)

    def shard_bytes(self, x: DTensor) -> torch.Tensor:
        """This rank's shard as it travels: its bytes in the compute dtype, one trailing dim of them."""
        return x.to_local().to(self.compute_dtype).unsqueeze(-1).view(torch.uint8)

    def from_bytes(self, data: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        """The gathered weight of `shape` from its gathered bytes (`data`, contiguous, one row per row)."""
        return data.view(self.compute_dtype).reshape(shape)


@dataclass
class Float8Gathers:
    """Every float8 weight gather of one model and the group their amax is reduced over; `refresh` before
    a step's (or an evaluation's) first forward."""

    wires: list[tuple[Float8Wire, nn.Module]]
    """(its wire, the float8 layer whose sharded master weight it casts), by the size of the shard (the
    order a chunk of `refresh` takes them in)."""
    group: dist.ProcessGroup | None
    """The sharded data-parallel dim's group (a replicated dim holds the same shards)."""
    fsdp2_root: nn.Module | None = None
    """FSDP2: the model torchao's precompute walks instead."""
    chunk_bytes: int = CAST_CHUNK_BYTES
    """The bound on the cast's temporaries (`CAST_CHUNK_BYTES`)."""

    def __post_init__(self) -> None:
        # One float8 config per run (`float8.apply_float8`): one dtype and one rounding for every scale.
        assert len({(w.float8_dtype, w.round_scales, w.compute_dtype) for w, _ in self.wires}) <= 1
        # Shards of one size side by side, so a chunk of them is one 2-D tensor with a scale per row.
        self.wires = sorted(self.wires, key=lambda pair: pair[1]._parameters["weight"].to_local().numel())

    @torch.no_grad()
    def refresh(self) -> None:
        """New scales and bits from the current master weights: one all-reduce for all of them (module
        docstring)."""
        if self.fsdp2_root is not None:
            from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

            precompute_float8_dynamic_scale_for_fsdp(self.fsdp2_root)
            return
        if not self.wires:
            return
        from torchao.float8.float8_utils import amax_to_scale

        wire0 = self.wires[0][0]
        shards = [layer._parameters["weight"].to_local() for _, layer in self.wires]
        # max |round(w)| = round(max |w|): the compute dtype's amax without a copy of any shard in it.
        amax = torch.stack(torch._foreach_norm(shards, ord=math.inf)).to(wire0.compute_dtype).float()
        if self.group is not None:
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=self.group)
        scales = amax_to_scale(amax, wire0.float8_dtype, wire0.round_scales)
        torch._foreach_copy_([wire.scale for wire, _ in self.wires], list(scales.unbind()))
        for start, stop in self._chunks(shards):
            self._cast(shards[start:stop], scales[start:stop], [wire for wire, _ in self.wires[start:stop]])

    def _chunks(self, shards: list[torch.Tensor]) -> list[tuple[int, int]]:
        """[start, stop) of each run of same-sized shards whose cast's temporaries (fp32, and the compute
        dtype where the shards are wider) stay within `chunk_bytes`; a larger shard is a chunk alone."""
        compute = self.wires[0][0].compute_dtype
        per_element = 4 + (compute.itemsize if shards[0].dtype != compute else 0)
        out: list[tuple[int, int]] = []
        start = 0
        for i in range(1, len(shards) + 1):
            size = shards[start].numel()
            if i == len(shards) or shards[i].numel() != size or (i + 1 - start) * size * per_element > self.chunk_bytes:
                out.append((start, i))
                start = i
        return out

    def _cast(self, shards: list[torch.Tensor], scales: torch.Tensor, wires: list[Float8Wire]) -> None:
        """Cast same-sized `shards` with their `scales` into their wires' bits: as torchao's
        `to_fp8_saturated(shard in the compute dtype, as fp32, * scale)`, a few kernels for all of them."""
        wire0 = wires[0]
        work = torch.empty((len(shards), shards[0].numel()), dtype=torch.float32, device=shards[0].device)
        flat = [s.reshape(-1) for s in shards]
        if shards[0].dtype != wire0.compute_dtype:  # the values the layer sees: rounded to the compute dtype
            rounded = torch.empty(work.shape, dtype=wire0.compute_dtype, device=work.device)
            torch._foreach_copy_(list(rounded.unbind()), flat)
            work.copy_(rounded)
            del rounded
        else:
            torch._foreach_copy_(list(work.unbind()), flat)
        work.mul_(scales.unsqueeze(1))
        top = torch.finfo(wire0.float8_dtype).max
        work.clamp_(min=-top, max=top)
        torch._foreach_copy_([w.bits.view(w.float8_dtype).reshape(-1) for w in wires], list(work.unbind()))


class _Saved:
    """The context torchao's float8 matmul forward and backward read and write, outside autograd."""

    def __init__(self, layer: nn.Module, saved: tuple[torch.Tensor, ...] = ()) -> None:
        self.linear_mm_config, self.config, self.saved_tensors = layer.linear_mm_config, layer.config, saved

    def save_for_backward(self, *tensors: torch.Tensor) -> None:
        self.saved_tensors = tensors


def _float8_weight(gather: ReplicateComputation, x: DTensor) -> torch.Tensor:
    """The whole weight in float8: the step's kept gather, or gathered now."""
    return gather.kept if gather.step_cache is not None else gather.gathered(x)


class _GatheredFloat8Matmul(torch.autograd.Function):
    """`input @ weight.t()` in float8 with the weight gathered as float8 bits; the weight's gradient goes to
    `target`: the sharded weight (reduced to its shard) or the step's unreduced sink (whole)."""

    @staticmethod
    def forward(ctx: Any, input: torch.Tensor, target: torch.Tensor, layer: nn.Module) -> torch.Tensor:
        gather: ReplicateComputation = gathers_of(layer)["weight"]
        x = layer._parameters["weight"]
        weight = _float8_weight(gather, x)
        out = layer._float8_mm[0](_Saved(layer), input, weight.t(), layer.linear_mm_config, layer.config)
        ctx.layer, ctx.like, ctx.to_sink = layer, ShardMeta.of(x), target is gather.sink
        # Eager reshard-after-forward: gather again in backward rather than keep the float8 weight (compiled,
        # the graph's recompute tags decide).
        ctx.regather = gather.reshard_after_forward and gather.step_cache is None and not torch.compiler.is_compiling()
        ctx.save_for_backward(input) if ctx.regather else ctx.save_for_backward(input, weight)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        layer = ctx.layer
        gather: ReplicateComputation = gathers_of(layer)["weight"]
        if ctx.regather:
            (input,) = ctx.saved_tensors
            weight = gather.gathered(layer._parameters["weight"])
        else:
            input, weight = ctx.saved_tensors
        grad_input, grad_weight_t, _, _ = layer._float8_mm[1](_Saved(layer, (input, weight.t())), grad)
        grad_weight = grad_weight_t.t()
        return grad_input, grad_weight if ctx.to_sink else gather.reduce_to_shard(grad_weight, ctx.like), None


def _gathered_forward(self: nn.Module, input: torch.Tensor) -> torch.Tensor:
    """The forward of a float8 layer whose weight is gathered as float8 (replaces torchao's)."""
    from torchao.float8.float8_linear import matmul_with_hp_or_float8_args

    gather: ReplicateComputation = gathers_of(self)["weight"]
    x = self._parameters["weight"]
    if x.requires_grad and torch.is_grad_enabled():
        target = gather.sink if gather.state.unreduced else x
        out = _GatheredFloat8Matmul.apply(input, target, self)
    else:
        out = matmul_with_hp_or_float8_args.apply(
            input, _float8_weight(gather, x).t(), self.linear_mm_config, self.config
        )
    return out if self.bias is None else out + self.bias.to(out.dtype)


def gather_in_float8(model: nn.Module, compute_dtype: torch.dtype) -> None:
    """Give every SimpleFSDP-sharded weight of a float8 layer of `model` its float8 wire and the layer the
    forward that uses it, and every other parameter the bytes wire (after `simple_fsdp.data_parallel`, on
    any device: the buffers are allocated where the shards are). Layers of one class share one new class,
    so identical blocks still share one compiled trace."""
    from torchao.float8.float8_linear import Float8Linear, matmul_with_hp_or_float8_args

    wires: list[tuple[Float8Wire, nn.Module]] = []
    classes: dict[type, type] = {}
    group = None
    for module in model.modules():
        gathers = gathers_of(module)
        if not isinstance(module, Float8Linear) or "weight" not in gathers:
            for gather in gathers.values():
                if gather.tp_mesh is None:  # (experts on an expert-parallel mesh: gathered as they are)
                    gather.wire = BytesWire(compute_dtype)
            continue
        gather = gathers["weight"]
        gather.wire = Float8Wire(module._parameters["weight"], module, compute_dtype)
        wires.append((gather.wire, module))
        group = gather.dp_mesh.get_group(gather.dp_mesh.ndim - 1)
        cls = module.__class__
        if cls not in classes:
            # torchao's float8 matmul, forward and backward, as plain functions: `_GatheredFloat8Matmul`
            # runs them inside its own forward and backward.
            matmul = (matmul_with_hp_or_float8_args.forward, matmul_with_hp_or_float8_args.backward)
            body = {"forward": _gathered_forward, "_float8_mm": matmul}
            classes[cls] = type(f"Float8Gathered{cls.__name__}", (cls,), body)
        module.__class__ = classes[cls]
    model.__dict__[_GATHERS] = Float8Gathers(wires, group)
    logger.info(f"float8 all-gather: {len(wires)} weights gathered as float8 (1 byte per element)")


def gather_in_float8_fsdp2(model: nn.Module) -> None:
    """FSDP2's float8 gathers (torchao's wrapper, set by `float8.apply_float8`): refresh their scales."""
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    wrapped = sum(
        isinstance(p, DTensor) and isinstance(p._local_tensor, WeightWithDynamicFloat8CastTensor)
        for p in model.parameters()
    )
    model.__dict__[_GATHERS] = Float8Gathers([], None, fsdp2_root=model)
    logger.info(f"float8 all-gather (FSDP2): {wrapped} weights gathered as float8 (1 byte per element)")


def float8_gathers_of(model: nn.Module) -> Callable[[], None] | None:
    """The refresh of `model`'s float8 gathers, or None when its weights are gathered in the training dtype."""
    gathers = model.__dict__.get(_GATHERS)
    return gathers.refresh if gathers is not None else None
