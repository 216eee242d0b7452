"""Hugging Face interop: a model as sharded safetensors in the `transformers` layout, and back.

Model-agnostic: the names, conversions and `config.json` come from the model family's adapter
(`ModelSpec.hf_adapter`, e.g. `models/llama3/hf_adapter.py`: `params`, `hf_name`, `to_hf`, `row_group`,
`from_hf`, `config`, `config_mismatches`, `import_name`, optionally `split_names` for a stacked parameter
stored as one tensor per expert and `keep_fp32`, the tensors written in fp32 whatever the export dtype). An
export is a folder `transformers` loads whole, written streaming: one gathered parameter at a time, rank 0
writing a shard whenever the next tensor would pass `max_shard_bytes`. An import checks `config.json` against
the model first (`check_hf_config`, one line), then each rank reads only the rows and columns of its own block
of every parameter through safetensors' lazy slices. The command line is `python -m titanlite.tools.hf`
(`tools/hf.py`); the folder and the checks: docs/hf.md.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from titanlite.errors import CheckpointError
from titanlite.models.common.init import local_block

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
CONFIG = "config.json"


def generation_config(bos_id: int, eos_id: int) -> dict:
    """`generation_config.json`: greedy by default (what `titanlite.tools.generate` does at temperature 0),
    stopping at EOS; the pad id is EOS so `generate()` does not warn about a missing one."""
    return {"bos_token_id": bos_id, "eos_token_id": eos_id, "pad_token_id": eos_id, "do_sample": False}


def _user_file_modes(folder: Path) -> None:
    """Give every file in `folder` the mode a new file of the user's gets (0666 minus the umask)."""
    umask = os.umask(0)
    os.umask(umask)
    for f in folder.iterdir():
        f.chmod(0o666 & ~umask)


def export_hf(
    model: nn.Module,
    out: str | Path,
    *,
    adapter: Any,
    dtype: torch.dtype = torch.float32,
    bos_id: int,
    eos_id: int,
    max_shard_bytes: int = 2 << 30,
    write_extra: Callable[[Path], None] | None = None,
) -> None:
    """Write `model` (any layout) to `out` as HF safetensors shards + index + config + generation config;
    collective. `write_extra(folder)` (rank 0) adds files such as the tokenizer.

    The folder is written as `<out>.partial` and renamed when complete; `out` must not exist yet. The
    adapter is asked for the tensors first, so a model it refuses leaves no folder. Tensors whose name holds
    a fragment of the adapter's `keep_fp32` (a router transformers keeps in fp32) are written in fp32.
    """
    out = Path(out)
    params = adapter.params(model)  # every rank: a refusal raises before any folder or collective
    keep_fp32 = getattr(adapter, "keep_fp32", ())
    rank = dist.get_rank() if dist.is_initialized() else 0
    tmp = out.with_name(out.name + ".partial")
    error = None
    if rank == 0:
        if out.exists():
            error = f"export folder {out} already exists"
        else:
            shutil.rmtree(tmp, ignore_errors=True)
            try:
                tmp.mkdir(parents=True)
            except OSError as e:  # told to every rank below, which would otherwise wait in the broadcast
                error = f"export folder {out}: cannot create {tmp} ({e.strerror})"
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

    # Imported here: the launcher's preflight reads HF configs (`check_hf_config`) without DTensor.
    from torch.distributed.tensor import DTensor

    for fqn, param in params:
        full = param.full_tensor() if isinstance(param, DTensor) else param
        if rank == 0:
            written = torch.float32 if any(f in fqn for f in keep_fp32) else dtype
            for name, t in _hf_tensors(adapter, fqn, full.detach().to("cpu", written), args):
                if size and size + t.nbytes > max_shard_bytes:
                    flush()
                buffer[name] = t
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
        (tmp / CONFIG).write_text(json.dumps(adapter.config(args, dtype, bos_id, eos_id), indent=2))
        (tmp / "generation_config.json").write_text(json.dumps(generation_config(bos_id, eos_id), indent=2))
        if write_extra is not None:
            write_extra(tmp)
        _user_file_modes(tmp)
        os.rename(tmp, out)
    if dist.is_initialized():
        dist.barrier()


def _split_names(adapter: Any, fqn: str, args: Any) -> list[list[str]] | None:
    """The per-index piece names of a stacked parameter (module docstring), or None for a whole tensor."""
    return adapter.split_names(fqn, args) if hasattr(adapter, "split_names") else None


def _hf_tensors(adapter: Any, fqn: str, full: torch.Tensor, args: Any) -> list[tuple[str, torch.Tensor]]:
    """The HF tensors (name, contiguous tensor) that the whole parameter `fqn` is written as."""
    t = adapter.to_hf(fqn, full, args)
    parts = _split_names(adapter, fqn, args)
    if parts is None:
        return [(adapter.hf_name(fqn, args), t.contiguous())]
    pieces = [zip(names, t[j].chunk(len(names))) for j, names in enumerate(parts)]
    return [(name, piece.contiguous()) for expert in pieces for name, piece in expert]


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


def is_hf_folder(path: str | Path) -> bool:
    """Whether `path` holds a Hugging Face model (its `config.json` and safetensors) rather than a DCP
    checkpoint (which has no `config.json`)."""
    folder = Path(path)
    return (folder / CONFIG).is_file() and any(folder.glob("*.safetensors"))


def hf_without_flag(path: str | Path) -> str:
    """The one line for a Hugging Face folder given as a DCP `initial_load_path` (the preflight's and the
    rank's)."""
    return (
        f"checkpoint.initial_load_path {path} holds a Hugging Face model (config.json, safetensors), not a DCP "
        "checkpoint: set checkpoint.initial_load_in_hf"
    )


def configured_model(cfg: Any, shape_keys: tuple[str, ...]) -> str:
    """The model a config asks for, as a mismatch names it: `model.flavor 'debugmodel'`, with the shape
    overrides it sets (`shape_keys`: the family's; 0 is the flavor's value)."""
    overrides = [f"model.{k} {getattr(cfg.model, k)}" for k in shape_keys if getattr(cfg.model, k, 0)]
    return f"model.flavor {cfg.model.flavor!r}" + (f" with {', '.join(overrides)}" if overrides else "")


def check_hf_config(path: str | Path, args: Any, adapter: Any, what: str = "this model") -> dict:
    """The checkpoint's `config.json`, checked against the model `args` (`what` names them in the error):
    one line naming every field that differs with both values, before any tensor is read."""
    file = Path(path) / CONFIG
    try:
        config = json.loads(file.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"Hugging Face checkpoint {path}: no {CONFIG}") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"Hugging Face checkpoint {path}: cannot read {CONFIG} ({e})") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"Hugging Face checkpoint {path}: {CONFIG} is not a JSON object")
    if wrong := adapter.config_mismatches(config, args):
        fields = "; ".join(f"{name} = {theirs!r} in its {CONFIG}, {ours!r} in {what}" for name, theirs, ours in wrong)
        if any(name == "vocab_size" for name, _, _ in wrong):
            fields += " (the vocabulary size comes from model.tokenizer_path)"
        raise CheckpointError(f"Hugging Face checkpoint {path} does not match {what}: {fields}")
    return config


@torch.no_grad()
def import_hf(model: nn.Module, path: str | Path, *, adapter: Any, what: str = "this model") -> dict:
    """Load HF weights into `model` (any layout) after checking its `config.json`; each rank reads only
    its own blocks. Returns the checkpoint's config."""
    args = model.args
    reader = _HFReader(path)
    config = check_hf_config(path, args, adapter, what)
    for fqn, param in adapter.params(model):
        name = adapter.import_name(fqn, args, config)
        parts = _split_names(adapter, fqn, args)
        if parts is not None and name not in reader.weight_map:
            _import_pieces(param, parts, reader)
            continue
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
    return config


def _import_pieces(param: torch.Tensor, parts: list[list[str]], reader: _HFReader) -> None:
    """Assemble this rank's block of a stacked parameter (sharded by its first dim only) from the
    checkpoint's per-index pieces, each checked for its shape."""
    local, offset = local_block(param)
    if local.numel() == 0:
        return
    if tuple(local.shape[1:]) != tuple(param.shape[1:]):
        raise CheckpointError(f"stacked parameters ({tuple(param.shape)}) are read sharded by their first dim only")
    for i in range(local.shape[0]):
        names = parts[offset[0] + i]
        want = (param.shape[1] // len(names), *param.shape[2:])
        pieces = []
        for name in names:
            sl = reader.slice(name)
            if tuple(sl.get_shape()) != want:
                raise CheckpointError(
                    f"Hugging Face checkpoint {reader.path}: {name!r} has shape {tuple(sl.get_shape())}, "
                    f"this model {want} (another model flavor?)"
                )
            pieces.append(sl[:])
        local[i].copy_(torch.cat(pieces))
