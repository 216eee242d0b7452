"""Model weights alone from a checkpoint: the tools' loads, `initial_load_path` and model-only resumes.

Protocol: every DCP checkpoint (seed, full or model-only) stores the model's parameters at the top level
under their FQNs, so one model-only load reads any of them. Before a tensor is read, a folder is
verified (sizes and checksums, each rank its share of the files, `verify_checksums`), every entry of
the model's state dict must exist in it with the same global shape, and every parameter it holds must be
one of the model's (`check_compatible`), so a damaged folder or another model's checkpoint fails in one
line with the model untouched; a tool and a model-only resume also refuse a model whose name, flavor or
shape differs from the one the checkpoint recorded (`resume_policy.model_change`). State dicts are taken
with SimpleFSDP parameters seen as shards (`sharded`): DCP then reshards them to any layout.

A tool (HF export, generation) names a folder or a step of the run (`load_tool_weights`); a damaged one
is refused, never replaced by an older one behind the user's back. `initial_load_path` reads a DCP
folder or, with `initial_load_in_hf`, a Hugging Face safetensors folder (`load_initial_weights`).
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

from titanlite.checkpoint import folders
from titanlite.checkpoint.hf import configured_model, hf_without_flag, import_hf, is_hf_folder
from titanlite.checkpoint.resume_policy import model_change
from titanlite.config import JobConfig
from titanlite.errors import CheckpointError
from titanlite.parallelisms.parallelize import sharded_view
from titanlite.planning.run_plan import RunPlan

logger = logging.getLogger("titanlite")


def quiet_single_process_dcp() -> None:
    """A single process has no process group; DCP then saves and loads alone, as intended, but warns each
    time (also from the async writer thread, where a local catch_warnings would not apply), so the filter
    is process-wide; installed when checkpoint I/O is first set up, never by importing this module (adding
    the same filter again replaces it)."""
    warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


def sharded(fn, model, *args, **kwargs):
    """Call a torch state-dict API on `model` (a module or a list of pipeline parts) with its parameters
    seen as stored, SimpleFSDP's as shards (it resolves names by attribute access, which would otherwise
    all-gather every parameter: `parallelize.sharded_view`)."""
    with sharded_view(model):
        return fn(model, *args, **kwargs)


NOT_MODEL = ("optimizer", "lr_scheduler", "train_state")
"""The top-level entries a full checkpoint holds beside the model's parameters (`TrainingState.full`)."""


def check_compatible(path: str, state: dict) -> None:
    """Before anything loads, on every rank alike (a collective over the default process group, if there is
    one): every tensor of `state` exists in checkpoint `path` with the same global shape, and every model
    parameter the checkpoint holds is one of the model's (over every rank's part: pipeline stages); a rank
    whose own part fits stops too when another's does not.

    DCP would otherwise fail half-way, load a prefix of the keys, or load a smaller model from a larger
    one's checkpoint and leave its other parameters unread; a model of another shape is reported as such,
    naming the folder and the first mismatching key.
    """
    try:
        metadata = FileSystemReader(path).read_metadata().state_dict_metadata
    except Exception as e:
        raise CheckpointError(f"checkpoint {path}: unreadable DCP metadata ({type(e).__name__}: {e})") from None
    flat, _ = flatten_state_dict(state)
    why = _missing_or_reshaped(path, metadata, flat)
    # One MAX all-reduce of a byte per checkpointed parameter (the same list on every rank: the metadata's),
    # whatever the world's size: whether some rank holds it, and whether some rank found a mismatch.
    params = sorted(k for k in metadata if k.split(".", 1)[0] not in NOT_MODEL)
    device = next((t.device for t in flat.values() if isinstance(t, torch.Tensor)), torch.device("cpu"))
    flags = torch.tensor([why is not None, *(k in flat for k in params)], dtype=torch.uint8, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    held = flags[1:].tolist()
    extra = [k for k, h in zip(params, held) if not h]
    if why is None and flags[0]:
        why = f"checkpoint {path} does not fit another rank's part of this model (that rank's line names the key)"
    if why is None and extra:
        why = f"checkpoint {path} holds {extra[0]!r}, which this model lacks (another model flavor or shape?)"
    if why is not None:
        raise CheckpointError(why)


def _missing_or_reshaped(path: str, metadata: dict, flat: dict) -> str | None:
    """The first entry of `flat` that checkpoint `path` lacks or holds in another shape, in one line."""
    for key, value in flat.items():
        stored = metadata.get(key)
        if stored is None:
            return f"checkpoint {path} has no entry {key!r} (another model or optimizer?)"
        if isinstance(value, torch.Tensor):
            if not isinstance(stored, TensorStorageMetadata):
                return f"checkpoint {path}: entry {key!r} is not a tensor"
            if tuple(stored.size) != tuple(value.shape):
                return (
                    f"checkpoint {path}: {key!r} has shape {tuple(stored.size)}, this model {tuple(value.shape)} "
                    "(another model flavor?)"
                )
    return None


def verify_checksums(path: str, marker: dict) -> str | None:
    """Collective over the default process group, if there is one: every rank verifies the checksums of its
    share of the files of checkpoint `path` (`folders.checksum_problem`); the first problem found, or None."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    why = folders.checksum_problem(Path(path), marker, rank, world)
    if world == 1:
        return why
    found: list[str | None] = [None] * world
    dist.all_gather_object(found, why)
    return next((w for w in found if w), None)


def verified_marker(path: Path) -> dict:
    """The completion marker of checkpoint folder `path`, once the folder is complete and its files' sizes and
    checksums are the marker's (`verify_checksums`: a collective); else one line, `CheckpointError`."""
    why = folders.problem(path)
    marker = {} if why else folders.read_marker(path)
    if why := why or verify_checksums(str(path), marker):
        raise CheckpointError(f"checkpoint {path} is unusable: {why}")
    return marker


def load_model_weights(model: torch.nn.Module, path: str) -> None:
    """Load only the model's parameters from a DCP folder (seed, full or model-only checkpoint)."""
    quiet_single_process_dcp()
    state = sharded(get_model_state_dict, model)
    check_compatible(path, state)
    dcp.load(state, checkpoint_id=path)
    sharded(set_model_state_dict, model, state)


def load_tool_weights(model: torch.nn.Module, cfg: JobConfig, checkpoint: str = "", step: int = -1) -> Path:
    """Load the model weights a tool (HF export, generation) asks for: the explicit `checkpoint` folder, else
    step `step` (newest if < 0) of the run's `<dump_folder>/<checkpoint.folder>`. The folder is verified
    (sizes and checksums); a damaged one is refused in one line, never replaced by an older one behind the
    user's back. Returns the folder."""
    root = Path(cfg.job.dump_folder) / cfg.checkpoint.folder
    if checkpoint:
        path: Path | None = Path(checkpoint)
        if not path.is_dir():
            raise CheckpointError(f"checkpoint {path} is not a folder")
    else:
        path = folders.newest(root) if step < 0 else folders.step_dir(root, step)
        if path is None:
            raise CheckpointError(f"no complete checkpoint in {root} (job.dump_folder = {cfg.job.dump_folder!r})")
        if not path.is_dir():
            raise CheckpointError(f"checkpoint {path} does not exist")
    marker = verified_marker(path)
    if change := model_change(marker, cfg.to_dict()):
        key, was, now = change
        raise CheckpointError(
            f"checkpoint {path}: {key} was {was}, this config has {now}: a tool reads the model as it was "
            "trained (give the run's model settings)"
        )
    load_model_weights(model, str(path))
    return path


def load_initial_weights(model: torch.nn.Module, plan: RunPlan, path: str, log: Callable[[str], None]) -> None:
    """`checkpoint.initial_load_path`: model weights only, from a DCP folder (seed or any checkpoint) or an
    HF safetensors folder (`initial_load_in_hf`); `log` writes rank 0's lines."""
    cfg = plan.cfg
    if cfg.checkpoint.initial_load_in_hf:
        adapter = plan.spec.require_hf_adapter()
        log(f"checkpoint: loading Hugging Face weights from {path}")
        config = import_hf(model, path, adapter=adapter, what=configured_model(cfg, plan.spec.shape.keys))
        if config.get("tie_word_embeddings") and not getattr(model.args, "tie_embeddings", True):
            log("checkpoint: the checkpoint ties its embeddings: copied into the untied output layer")
        return
    if not Path(path).is_dir():
        raise CheckpointError(f"checkpoint.initial_load_path {path} is not a folder")
    if is_hf_folder(path):
        raise CheckpointError(hf_without_flag(path))
    if (Path(path) / folders.MARKER).exists() and (why := another_model(verified_marker(Path(path)), plan)):
        raise CheckpointError(f"checkpoint {path} is unusable: {why}")
    log(f"checkpoint: loading initial model weights from {path}")
    load_model_weights(model, path)


def another_model(marker: dict, plan: RunPlan) -> str | None:
    """Why a checkpoint of another run cannot start this one though its tensors may fit: another model
    family, or untied embeddings loaded into a model that ties them (both matrices would load into its one
    parameter, and one would be lost). Other settings may change: the tensors are checked one by one."""
    if "config" not in marker:
        return None
    recorded = marker["config"]["model"]
    if recorded["name"] != plan.cfg.model.name:
        return f"it holds a {recorded['name']!r} model, this run trains {plan.cfg.model.name!r}"
    tied, args = plan.spec.shape.tied_embeddings, plan.spec.flavors.get(recorded["flavor"])
    if args is not None and tied(plan.model_args) and not tied(args):
        return f"its model.flavor {recorded['flavor']!r} has untied embeddings, this run's ties them"
    return None
