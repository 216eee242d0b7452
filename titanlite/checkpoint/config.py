"""The `checkpoint` section of the config: saving, resuming and initial weights, beside the manager that reads it
(`manager.py`). Torch-free, importing only `titanlite.config.ranges`: the config's schema
(titanlite/config/schema.py) composes it into `JobConfig`, which the launcher and `--help` read before any torch
process exists."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from titanlite.config.ranges import NON_NEGATIVE, POSITIVE, DtypeName, _range


@dataclass
class Checkpoint:
    """Saving, resuming and initial weights."""

    enable: bool = False
    """Save checkpoints and resume from the newest one at start-up."""
    folder: str = "checkpoint"
    """Checkpoint folder, relative to `job.dump_folder`."""
    interval: int = field(default=500, metadata=POSITIVE)
    """Save every this many steps (and at the last step)."""
    keep_latest_k: int = field(default=0, metadata=NON_NEGATIVE)
    """Keep only the newest k complete checkpoints (0 = keep all)."""
    async_mode: Literal["disabled", "async", "async_with_pinned_mem"] = "disabled"
    """`disabled` (save blocks the step), `async` (save in the background) or `async_with_pinned_mem`."""
    load_step: int = field(default=-1, metadata=_range(low=0, also=-1, also_means="the newest"))
    """-1 = the newest complete checkpoint."""
    initial_load_path: str = ""
    """A checkpoint folder to start from when the run has none of its own (fine-tuning)."""
    initial_load_in_hf: bool = False
    """`initial_load_path` is a Hugging Face folder (safetensors + config.json)."""
    last_save_model_only: bool = False
    """The final save keeps only the model weights (no optimizer or data state)."""
    export_dtype: DtypeName = "float32"
    """Dtype of model-only saves and exports."""
    create_seed_checkpoint: bool = False
    """Write the initialised model as step 0 and exit."""
    stop_on_save_error: bool = False
    """If a save fails (disk full, permissions), stop instead of warning and training on."""
    local_interval: int = field(default=0, metadata=NON_NEGATIVE)
    """Also save each rank's own state to node-local storage every this many steps, in the background
    (0 = off): a restart or relaunch resumes from the newest step every rank holds there, when newer than
    the durable checkpoint (docs/checkpoints.md#node-local-checkpoints)."""
    local_folder: str = ""
    """Node-local folder of those saves, relative to `job.dump_folder` (an absolute path on each node's own
    storage); empty = `/dev/shm/titanlite/<digest of the checkpoint folder's absolute path>`."""
