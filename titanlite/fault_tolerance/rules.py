"""What a replica group can run, checked with the run plan before any rank starts: each rule one `ConfigError`
line. torchft is looked up, not imported, so the launcher's preflight stays light."""

from __future__ import annotations

import importlib.util
from typing import Any

from titanlite.config import JobConfig
from titanlite.config.schema import first_set_key
from titanlite.errors import ConfigError

INSTALL = "run with TITANLITE_EXTRAS=ft (run_train.sh installs it), or pip install 'titanlite[ft]'"


def check(cfg: JobConfig, pipeline_degree: int, spec: Any) -> None:
    """Why these settings cannot run as a replica group (or set a fault_tolerance key while it is off)."""
    ft = cfg.fault_tolerance
    if not ft.enable:
        if (stray := first_set_key(ft)) is not None:
            raise ConfigError(
                f"fault_tolerance.{stray} is set but fault_tolerance.enable is not: add --fault_tolerance.enable, "
                "or drop it"
            )
        return
    if importlib.util.find_spec("torchft") is None:
        raise ConfigError(f"fault_tolerance.enable needs torchft, the `ft` extra: {INSTALL}")
    if ft.replica_id >= ft.group_size:
        raise ConfigError(
            f"fault_tolerance.replica_id {ft.replica_id} is outside fault_tolerance.group_size {ft.group_size} "
            f"(the groups are numbered 0 .. {ft.group_size - 1})"
        )
    if ft.min_replica_size > ft.group_size:
        raise ConfigError(
            f"fault_tolerance.min_replica_size {ft.min_replica_size} is more than fault_tolerance.group_size "
            f"{ft.group_size}: no step could ever commit"
        )
    if pipeline_degree > 1:
        raise ConfigError(
            "fault_tolerance.enable does not combine with pipeline_parallel_degree > 1: the pipeline schedule "
            "reduces and clips the gradients itself, without the average across replica groups"
        )
    if spec.hooks.after_step is not None:
        raise ConfigError(
            f"fault_tolerance.enable does not combine with model {spec.name}'s update after each step (e.g. "
            "aux-loss-free balancing, model.router_bias_update_rate > 0): each group would update it from its "
            "own tokens, and the groups' weights would part"
        )
    if cfg.checkpoint.create_seed_checkpoint:
        raise ConfigError("checkpoint.create_seed_checkpoint is one process, not a replica group: drop one of them")
    if cfg.checkpoint.local_interval:
        raise ConfigError(
            "checkpoint.local_interval does not combine with fault_tolerance.enable: a failed group receives "
            "the state from a live group instead (docs/fault_tolerance.md)"
        )
