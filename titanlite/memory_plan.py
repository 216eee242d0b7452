"""Per-GPU memory estimate of a parallelized Llama 3: model state from real shard shapes, the rest modelled.

Parameters, gradients and AdamW state are counted from the local shapes of the parameters after the
parallelize plan ran (on the meta device in a dry run), so uneven shards and TP-replicated norms are
exact. Gradients have the parameter's dtype (fp32 master weights); AdamW keeps exp_avg and exp_avg_sq.

Collective buffers (compute dtype, TP-local full shapes): the weights gathered for forward that stay
alive until backward (`reshard_after_forward`: `never` = all, except SimpleFSDP's embedding weight,
whose backward needs only the token ids; `default` = the last block and the root's norm and output, or
FSDP2's whole root group; `always` = none) plus one gather unit in flight (a transformer block, or a
root weight if larger; FSDP2 prefetches the next unit, so two), plus one unit's unsharded gradients in
the reduce dtype before the reduce-scatter. Eager per-parameter gathers hold less than a block;
bucketed and compiled ones hold one.

Activations follow what autograd saves with the eager kernels, per token of one microbatch, measured op
by op on this model (see tests/test_dry_run.py): per RMSNorm the fp32 input and normalised input plus
the output in the compute dtype; q, k, v, the SDPA output and its logsumexp (flash kernels: no s x s
matrix); four FFN-wide tensors for SwiGLU; the logits held by the training step plus the fp32
log-softmax and two fp32 gradients of the loss (one more fp32 buffer under loss parallel). Sequence
parallelism divides the norm and residual parts by tp, head and FFN parts are divided by tp, and the
all-gathered inputs of the projections are full size. The peak is the larger of the start of backward
(everything saved, loss gradients live) and the last block's backward (the block's full activations,
recomputed under AC, plus gradients of its activations). Compiled blocks usually save less (fused norms
and SwiGLU), so this is an upper bound for them; the total adds every part as if all peaked together,
which is conservative too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from titanlite.config import JobConfig
from titanlite.models.llama3 import ModelArgs
from titanlite.parallelisms.parallel_dims import ParallelDims

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
GiB = 2**30


@dataclass(frozen=True)
class Layout:
    """What the estimate needs to know about a run beyond the parameters' shapes."""

    tp: int
    dp_mode: str | None
    """SimpleFSDP mode (`fully_shard`, `replicate`, `hybrid_shard`), or None without data parallelism."""
    dp_impl: str
    compute_dtype: torch.dtype
    reduce_dtype: torch.dtype
    reshard: str
    loss_parallel: bool
    ac_mode: str
    ac_option: str
    local_batch: int
    seq_len: int

    @classmethod
    def from_config(cls, cfg: JobConfig, dims: ParallelDims) -> "Layout":
        """The layout the trainer builds: mixed precision only exists through data parallelism."""
        p, t = cfg.parallelism, cfg.training
        dp = dims.dp_enabled
        return cls(
            tp=dims.tp, dp_mode=dims.dp_mode if dp else None, dp_impl=p.dp_impl,
            compute_dtype=DTYPES[t.mixed_precision_param] if dp else torch.float32,
            reduce_dtype=DTYPES[t.mixed_precision_reduce] if dp else torch.float32,
            reshard=p.fsdp_reshard_after_forward, loss_parallel=dims.tp_enabled and not p.disable_loss_parallel,
            ac_mode=cfg.activation_checkpoint.mode, ac_option=cfg.activation_checkpoint.selective_ac_option,
            local_batch=t.local_batch_size, seq_len=t.seq_len,
        )

    def block_ac(self, layer: int) -> str:
        """`none`, `full` or `op` for one block, as activation_checkpoint.apply_ac wraps it."""
        if self.ac_mode == "none":
            return "none"
        if self.ac_mode == "full":
            return "full"
        if self.ac_option == "op":
            return "op"
        return "full" if layer % int(self.ac_option) == 0 else "none"


@dataclass
class MemoryEstimate:
    """Bytes per GPU; `total` sums every part."""

    local_numel: dict[str, int]
    params: int
    grads: int
    optimizer: int
    gather_held: int
    gather_in_flight: int
    reduce_buffer: int
    activations: int
    activation_parts: dict[str, int] = field(default_factory=dict)

    @property
    def collective_buffers(self) -> int:
        return self.gather_held + self.gather_in_flight + self.reduce_buffer

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.collective_buffers + self.activations


def local_tensor(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if isinstance(p, DTensor) else p


def gathered_numel(p: torch.Tensor) -> int:
    """Elements of `p` after gathering over the data-parallel mesh dims: TP shards stay sharded."""
    if not isinstance(p, DTensor):
        return p.numel()
    shape = list(p.shape)
    mesh = p.device_mesh
    for i, (name, placement) in enumerate(zip(mesh.mesh_dim_names or (), p.placements)):
        if not name.startswith("dp") and placement.is_shard():
            shape[placement.dim] = math.ceil(shape[placement.dim] / mesh.size(i))
    return math.prod(shape)


def gather_unit(fqn: str, dp_impl: str) -> str:
    """The gather unit of a parameter: its transformer block; outside the blocks the parameter itself
    (SimpleFSDP gathers per parameter) or FSDP2's root group (embedding, final norm and output together)."""
    parts = fqn.split(".")
    if parts[0] == "layers":
        return ".".join(parts[:2])
    return "root" if dp_impl == "fsdp2" else fqn


def _collective_buffers(model: nn.Module, layout: Layout) -> tuple[int, int, int]:
    """(gathered weights held from forward to backward, gathers in flight, reduce-scatter input) in bytes."""
    if layout.dp_mode is None:
        return 0, 0, 0
    gathered_bytes = layout.compute_dtype.itemsize
    units: dict[str, int] = {}
    for fqn, p in model.named_parameters():
        unit = gather_unit(fqn, layout.dp_impl)
        units[unit] = units.get(unit, 0) + gathered_numel(p)
    # The embedding's backward needs only the token ids: SimpleFSDP frees its gathered weight after forward.
    kept = [u for u in units if u != "tok_embeddings.weight"]
    if layout.dp_mode == "replicate":
        # No gather: at most a cast of each full weight, kept for backward like an unresharded gather.
        if layout.compute_dtype == next(model.parameters()).dtype:
            return 0, 0, 0
        held = set(kept)
    elif layout.reshard == "never":
        held = set(kept)
    elif layout.reshard == "default":
        blocks = [u for u in kept if u.startswith("layers.")]
        held = {u for u in kept if not u.startswith("layers.")} | set(blocks[-1:])
    else:
        held = set()
    free = sorted((n for u, n in units.items() if u not in held), reverse=True)
    in_flight = sum(free[: 2 if layout.dp_impl == "fsdp2" else 1])
    reduce_elems = 0 if layout.dp_mode == "replicate" else max(units.values())
    return (sum(units[u] for u in held) * gathered_bytes, in_flight * gathered_bytes,
            reduce_elems * layout.reduce_dtype.itemsize)


def activation_bytes(args: ModelArgs, layout: Layout) -> dict[str, int]:
    """Peak activation bytes of one microbatch and its parts (module docstring)."""
    d, h, kv, hd, f = args.dim, args.n_heads, args.kv_heads, args.head_dim, args.ffn_hidden_dim
    t = layout.tp
    e = layout.compute_dtype.itemsize
    tokens = layout.local_batch * layout.seq_len
    # Per token. RMSNorm saves its fp32 input and normalised input (SP-sharded) and rstd; the norm output,
    # all-gathered for the projections, is saved full size.
    norm = (8 * d + 4) / t + d * e
    qkv = (h + 2 * kv) * hd * e / t
    sdpa = h * hd * e / t + 4 * h / t
    per_block = {
        "none": 2 * norm + qkv + sdpa + 4 * f * e / t,
        "full": d * e / t,
        # Selective op: the block input, every matmul output (row-parallel ones as full-size partial sums,
        # plus their reduce-scattered outputs under TP) and the SDPA outputs.
        "op": d * e / t + qkv + sdpa + 2 * f * e / t + 2 * d * e + (2 * d * e / t if t > 1 else 0),
    }
    # Gradients of one block's activations while it runs backward.
    block_grads = (2 * f + d) * e / t + (d * e if t > 1 else 0)
    vocab = args.vocab_size / t if layout.loss_parallel else args.vocab_size
    saved = [per_block[layout.block_ac(i)] for i in range(args.n_layers)]
    final_norm = norm
    logits = vocab * e
    # fp32 log-softmax output and two fp32 gradients; loss parallel's sharded log-softmax keeps one more.
    loss = vocab * (16 if layout.loss_parallel else 12)
    start_of_backward = sum(saved) + final_norm + logits + loss
    last_block_backward = sum(saved[:-1]) + per_block["none"] + block_grads + logits
    parts = {
        f"saved by {args.n_layers} blocks": sum(saved),
        "final norm + output input": final_norm,
        "logits + fp32 loss": logits + loss,
    }
    if last_block_backward > start_of_backward:
        parts = {
            f"saved by {args.n_layers - 1} blocks": sum(saved[:-1]),
            "last block in backward (recomputed + grads)": per_block["none"] + block_grads,
            "logits": logits,
        }
    out = {name: round(v * tokens) for name, v in parts.items()}
    out["peak"] = round(max(start_of_backward, last_block_backward) * tokens)
    return out


def estimate(model: nn.Module, args: ModelArgs, layout: Layout) -> MemoryEstimate:
    """Memory per GPU of `model` (already parallelized, on any device including meta) under `layout`."""
    local = {fqn: local_tensor(p).numel() for fqn, p in model.named_parameters()}
    param_bytes = sum(local_tensor(p).nbytes for p in model.parameters())
    trainable = sum(local_tensor(p).nbytes for p in model.parameters() if p.requires_grad)
    held, in_flight, reduce = _collective_buffers(model, layout)
    acts = activation_bytes(args, layout)
    peak = acts.pop("peak")
    return MemoryEstimate(
        local_numel=local, params=param_bytes, grads=trainable, optimizer=2 * trainable,
        gather_held=held, gather_in_flight=in_flight, reduce_buffer=reduce, activations=peak, activation_parts=acts,
    )
