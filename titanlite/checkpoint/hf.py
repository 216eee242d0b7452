"""Hugging Face interop: a model as sharded safetensors in the `transformers` layout, and back.

Model-agnostic: the names, conversions and `config.json` come from the model family's adapter
(`ModelSpec.hf_adapter`, e.g. `models/llama3/hf_adapter.py`), which provides `params(model)`,
`hf_name(fqn, args)`, `to_hf(fqn, full, args)`, `row_group(fqn, args)`, `from_hf(fqn, rows, args)` and
`config(args, dtype, bos_id, eos_id)`.

Export streams: parameters are gathered one at a time (`full_tensor()`, a collective on every rank),
rank 0 converts each into its buffer and writes a shard whenever the next tensor would take the buffer
past `max_shard_bytes`; no rank ever holds more than one gathered parameter plus one shard.
Import: each rank reads only the rows and columns of its own block of every parameter (a DTensor
shard under FSDP/TP), with safetensors' lazy slices; rows the adapter permutes within groups (RoPE
heads) are read as whole groups.

The command line is `python -m titanlite.tools.hf` (`tools/hf.py`).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn
from torch.distributed.tensor import DTensor

from titanlite.errors import CheckpointError
from titanlite.models.init import local_block

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


def export_hf(
    model: nn.Module,
    out: str | Path,
    *,
    adapter: Any,
    dtype: torch.dtype = torch.float32,
    bos_id: int,
    eos_id: int,
    max_shard_bytes: int = 2 << 30,
) -> None:
    """Write `model` (any layout) to `out` as HF safetensors shards + index + config; collective.

    The folder is written as `<out>.partial` and renamed when complete; `out` must not exist yet.
    """
    out = Path(out)
    rank = dist.get_rank() if dist.is_initialized() else 0
    tmp = out.with_name(out.name + ".partial")
    error = None
    if rank == 0:
        if out.exists():
            error = f"export folder {out} already exists"
        else:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
    if dist.is_initialized():
        box = [error]
        dist.broadcast_object_list(box, src=0)
        error = box[0]
    if error:
        raise CheckpointError(error)
    args = model.args
    names_per_shard: list[list[str]] = []
    buffer: dict[str, torch.Tensor] = {}
    size = total = 0

    def flush() -> None:
        nonlocal buffer, size
        if buffer:
            save_file(buffer, str(tmp / f"shard-{len(names_per_shard):05d}.safetensors"), metadata={"format": "pt"})
            names_per_shard.append(list(buffer))
            buffer, size = {}, 0

    for fqn, param in adapter.params(model):
        full = param.full_tensor() if isinstance(param, DTensor) else param
        if rank == 0:
            t = adapter.to_hf(fqn, full.detach().to("cpu", dtype), args).contiguous()
            if size and size + t.nbytes > max_shard_bytes:
                flush()
            buffer[adapter.hf_name(fqn, args)] = t
            size += t.nbytes
            total += t.nbytes
        del full
    if rank == 0:
        flush()
        n = len(names_per_shard)
        weight_map = {}
        for i, names in enumerate(names_per_shard):
            name = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.rename(tmp / f"shard-{i:05d}.safetensors", tmp / name)
            weight_map.update({k: name for k in names})
        (tmp / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
        (tmp / "config.json").write_text(json.dumps(adapter.config(args, dtype, bos_id, eos_id), indent=2))
        os.rename(tmp, out)
    if dist.is_initialized():
        dist.barrier()


class _HFReader:
    """Lazy access to the tensors of an HF safetensors folder (sharded with an index, or one file)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if (self.path / INDEX).is_file():
            self.weight_map = json.loads((self.path / INDEX).read_text())["weight_map"]
        elif (self.path / SINGLE).is_file():
            with safe_open(str(self.path / SINGLE), framework="pt") as f:
                self.weight_map = {k: SINGLE for k in f.keys()}
        else:
            raise CheckpointError(f"Hugging Face checkpoint {path}: neither {INDEX} nor {SINGLE} found")
        self._files: dict[str, object] = {}

    def slice(self, name: str):
        if name not in self.weight_map:
            raise CheckpointError(f"Hugging Face checkpoint {self.path} has no tensor {name!r}")
        file = self.weight_map[name]
        if file not in self._files:
            try:
                self._files[file] = safe_open(str(self.path / file), framework="pt")
            except Exception as e:  # safetensors raises its own error type for a damaged file
                raise CheckpointError(f"Hugging Face checkpoint {self.path}: cannot open {file} ({e})") from None
        return self._files[file].get_slice(name)


@torch.no_grad()
def import_hf(model: nn.Module, path: str | Path, *, adapter: Any) -> None:
    """Load HF weights into `model` (any layout); each rank reads only its own blocks."""
    args = model.args
    reader = _HFReader(path)
    for fqn, param in adapter.params(model):
        name = adapter.hf_name(fqn, args)
        sl = reader.slice(name)
        shape = tuple(sl.get_shape())
        if shape != tuple(param.shape):
            raise CheckpointError(
                f"Hugging Face checkpoint {path}: {name!r} has shape {shape}, this model {tuple(param.shape)} "
                "(another model flavor?)"
            )
        local, offset = local_block(param)
        if local.numel() == 0:
            continue
        rows = slice(offset[0], offset[0] + local.shape[0])
        cols = slice(offset[1], offset[1] + local.shape[1]) if local.dim() == 2 else None
        group = adapter.row_group(fqn, args)
        if group > 1:
            # Rows are permuted within groups: read the whole groups covering this block's rows.
            first, last = rows.start // group * group, -(-rows.stop // group) * group
            block = adapter.from_hf(fqn, sl[first:last, cols], args)[rows.start - first : rows.stop - first]
        else:
            block = sl[rows, cols] if cols is not None else sl[rows]
        local.copy_(block)
