"""What a rank holds of a run, for the estimates of its memory and step time: the mesh's degrees, the data
parallelism's mode and implementation, the compute and reduce dtypes, the reshard and AC policies, the
microbatch and sequence, the pipeline stage's blocks and the step policy.

The run plan fills it (`RunPlan.layout`); the memory estimate (`titanlite/planning/memory.py`), the
step-time model and each model family's activation model (`ModelSpec.planning.activation_bytes`) read it.
It sits with the parallelisms because every field is one of theirs, and below the models, which read it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from titanlite.config import ActivationCheckpoint
from titanlite.parallelisms.activation_checkpoint import BlockAC, block_ac
from titanlite.parallelisms.parallel_dims import ParallelDims


@dataclass(frozen=True)
class Layout:
    """What the estimate needs to know about a run beyond the parameters' shapes."""

    dims: ParallelDims
    """The mesh's degrees: the family's activation model and the reduction's buckets read them here
    (`tp`, `cp`, `ep`, `shard_ranks`, `rank_seq_len`, `vocab_shards`)."""
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
    """Samples per microbatch: the local batch, or the pipeline microbatch size under PP."""
    seq_len: int
    blocks: tuple[int, ...] | None = None
    """The blocks a pipeline stage holds (None: every block)."""
    output: bool = True
    """Whether the stage computes the output and the loss (the last pipeline stage, or no PP)."""
    unreduced_grads: bool = False
    """Gradients accumulate unsharded over the step's backwards, reduced once at its end
    (`StepPolicy.reduce_once` with gradient accumulation or pipeline microbatches)."""
    keep_gathers: bool = False
    """Gathered weights are kept from the step's first forward to its last backward (`StepPolicy.keep_gathers`)."""
    attn_mask: str = "causal"
    """`model.attn_mask_type`: block_causal holds one mask per microbatch (`models/common/attention.py`)."""
    device_type: str = "cuda"
    """Where the step runs: the mask is a flex BlockMask on CUDA, a dense boolean matrix elsewhere."""
    float8_gather: bool = False
    """The float8 layers' weights are gathered in float8 (`float8.all_gather`): `gathered_bytes`."""

    @property
    def tp(self) -> int:
        """Tensor-parallel ranks: the blocks' activations are split over them (sequence parallel)."""
        return self.dims.tp

    @property
    def cp(self) -> int:
        """Context-parallel ranks: each holds seq_len / cp tokens of every sequence and gathers all keys and
        values in attention."""
        return self.dims.cp

    @property
    def ep(self) -> int:
        """Expert-parallel ranks: a MoE layer's routed rows go to their experts' ranks and back through
        all-to-all buffers (the family's activation model counts them)."""
        return self.dims.ep

    @property
    def shard_ranks(self) -> int:
        """Ranks of the data-parallel shard dim: the per-step reduction's output is a bucket over them."""
        return self.dims.shard_degree

    @property
    def rank_seq_len(self) -> int:
        """Tokens of each sequence a rank holds (its part under context parallelism)."""
        return self.dims.rank_tokens(self.seq_len)

    @property
    def vocab_shards(self) -> int:
        """Ranks the logits' vocabulary is split over: the tensor-parallel ones under loss parallelism."""
        return self.dims.tp if self.loss_parallel else 1

    def stage(self, blocks: range, output: bool, microbatch: int) -> Layout:
        """The layout of one pipeline stage, one microbatch at a time."""
        return dataclasses.replace(self, blocks=tuple(blocks), output=output, local_batch=microbatch)

    def block_ac(self, layer: int) -> BlockAC:
        """`none`, `full` or `op` for one block, as activation_checkpoint.apply_ac wraps it."""
        return block_ac(ActivationCheckpoint(self.ac_mode, self.ac_option), layer)
