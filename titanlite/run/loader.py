"""A run's data loaders, built from its run plan: the training and the held-out (validation) loader of a
data-parallel rank.

The launcher's preflight builds them too (it indexes the local data files and verifies pre-tokenized shards
once for the ranks, and reports bad data before any rank starts), so this module imports only the plan and
the data package, nothing of the model build (`build.py`: the parallelisms, the compiler). A data error names
the config key of the path it is about (`training.dataset_path`, `validation.dataset_path`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

from titanlite.config import JobConfig
from titanlite.data.loader import TokenLoader, build_dataloader
from titanlite.errors import DataError
from titanlite.planning.run_plan import RunPlan

AUTO_CUDA_WORKERS = 2
"""`training.dataloader_num_workers = -1` on CUDA: at most this many workers per rank."""


def loader_workers(plan: RunPlan, device_type: str) -> int:
    """The configured worker count, or for -1 (auto) on CUDA the largest count up to `AUTO_CUDA_WORKERS`
    that the data layout allows (workers serve whole microbatches: the count must divide the
    microbatches per step and a microbatch must hold whole virtual-shard contributions; one worker
    already overlaps loading with the GPU), and 0 on CPU, where workers would compete with the ranks for
    cores."""
    t = plan.cfg.training
    if t.dataloader_num_workers >= 0:
        return t.dataloader_num_workers
    if device_type != "cuda" or t.local_batch_size % plan.samples_per_shard:
        return 0
    return max(w for w in range(1, AUTO_CUDA_WORKERS + 1) if plan.grad_accum % w == 0)


def data_index_dir(cfg: JobConfig) -> str:
    """Where the local data files' indexes are kept for every process of a run (`data/index.py`)."""
    return os.path.join(cfg.job.dump_folder, "data_index")


@contextlib.contextmanager
def naming_key(section: str) -> Iterator[None]:
    """The data package's errors about `dataset_path` (or a mixture's `datasets`) name the key in full:
    `section.dataset_path`."""
    try:
        yield
    except DataError as e:
        if str(e).startswith(("dataset_path", "datasets ")):
            raise DataError(f"{section}.{e}") from None
        raise


def build_loader(
    plan: RunPlan, dp_rank: int, device_type: str = "cpu", report: bool = True, verify: bool = False
) -> Any:
    """The data loader of data-parallel rank `dp_rank` (tensor-parallel peers share it; in replica group K,
    the data of the job's dp rank `plan.data_dp_rank(dp_rank)`), as configured,
    for a rank computing on `device_type` (CUDA: pinned batches and, by default, worker processes);
    `report`: print the data's warnings (the launcher's preflight does, its ranks need not repeat them);
    `verify`: read the pre-tokenized shards not verified as they are now (the preflight does, its ranks
    trust what it recorded: `data/verified_shards.py`).

    Built before the process group: a bad dataset path is reported before any rank starts work."""
    t = plan.cfg.training
    with naming_key("training"):
        return build_dataloader(
            tokenizer=plan.tokenizer,
            dataset_path=t.dataset_path,
            text_field=t.dataset_text_field,
            seq_len=t.seq_len,
            local_batch_size=t.local_batch_size,
            global_batch_size=plan.global_batch * plan.replica_groups,
            dp_rank=plan.data_dp_rank(dp_rank),
            dp_degree=plan.data_dp_degree,
            virtual_shards=plan.virtual_shards,
            num_workers=loader_workers(plan, device_type),
            pin_memory=device_type == "cuda",
            holdout_documents=plan.cfg.validation.holdout_documents,
            index_dir=data_index_dir(plan.cfg),
            report=report,
            verify=verify,
            mixture=t.datasets,
            seed=t.seed,
        )


def build_validation_loader(plan: RunPlan, dp_rank: int, verify: bool = False) -> TokenLoader:
    """The held-out loader of data-parallel rank `dp_rank` (`validation.py`): `validation.dataset_path`, or
    the training data's last `validation.holdout_documents` documents. It logs no `data: epoch` lines:
    every evaluation starts it over (a held-out set smaller than one evaluation is reported once, by the
    validator). `verify`: `build_loader`'s, for `validation.dataset_path` (the training data's shards are
    verified by its training loader)."""
    t, v = plan.cfg.training, plan.cfg.validation
    with naming_key("validation" if v.dataset_path else "training"):
        return build_dataloader(
            tokenizer=plan.tokenizer,
            dataset_path=v.dataset_path or t.dataset_path,
            text_field=t.dataset_text_field,
            seq_len=t.seq_len,
            local_batch_size=v.local_batch_size,
            global_batch_size=plan.dims.sequences(v.local_batch_size),
            dp_rank=dp_rank,
            dp_degree=plan.dims.dp,
            holdout_documents=0 if v.dataset_path else v.holdout_documents,
            heldout=not v.dataset_path,
            index_dir=data_index_dir(plan.cfg),
            report=bool(v.dataset_path),  # the training data's warnings are printed by its own loader
            verify=verify and bool(v.dataset_path),
            log_epochs=False,
        )
