"""The construction module: one process is a world of one with the full plan; NCCL defaults; timeouts."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from harness import tiny_args
from titanlite.config import JobConfig
from titanlite.errors import ConfigError
from titanlite.planning.run_plan import RunPlan
from titanlite.run.build import apply_train_timeout, build_model, init_distributed, nccl_env_defaults


def test_one_process_without_torchrun_gets_a_one_rank_group_and_the_full_plan(monkeypatch, tmp_path):
    for key in ("MASTER_ADDR", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    cfg = JobConfig()
    cfg.job.dump_folder = str(tmp_path)
    cfg.training.seq_len = 16
    cfg.activation_checkpoint.mode = "full"
    init_distributed(cfg, torch.device("cpu"))
    try:
        assert dist.get_world_size() == 1 and dist.get_backend() == "gloo"
        plan = RunPlan.build(cfg, 1, args=tiny_args())
        assert plan.dims.dp_enabled and plan.dims.dp_mode == "fully_shard" and plan.dims.dim_names == ("dp_shard",)
        model = build_model(plan, torch.device("cpu"))
        # SimpleFSDP on the one-rank mesh: DTensor parameters, bf16 compute (the default), fp32 master weights.
        param = dict(model.named_parameters())["layers.0.attention.wq.weight"]
        assert isinstance(param, DTensor) and param.dtype == torch.float32
        assert model.layers["0"].attention.wq.weight.dtype == torch.bfloat16  # gathered for compute
        assert model(torch.randint(0, 257, (1, 16))).dtype == torch.bfloat16
        timeouts = apply_train_timeout(cfg, plan.dims)
        assert set(timeouts) == {"world", "dp_shard"}
    finally:
        dist.destroy_process_group()


def test_an_existing_process_group_is_kept(process_group):
    world = dist.group.WORLD
    init_distributed(JobConfig(), torch.device("cpu"))
    assert dist.group.WORLD is world


def test_nccl_flight_recorder_defaults_point_into_the_dump_folder(tmp_path):
    """20,000 entries: at scale a step issues thousands of collectives (`build.FLIGHT_RECORDER_ENTRIES`)."""
    env = nccl_env_defaults(str(tmp_path), rank=3)
    assert env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1" and env["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "20000"
    assert env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == str(tmp_path / "comm_traces" / "rank_")


def test_unknown_model_family_and_flavor_are_config_errors():
    cfg = JobConfig()
    cfg.model.name = "gpt2"
    with pytest.raises(ConfigError, match="model.name.*llama3"):
        RunPlan.build(cfg, 1)
    cfg.model.name, cfg.model.flavor = "llama3", "7B"
    with pytest.raises(ConfigError, match="model.flavor.*8B"):
        RunPlan.build(cfg, 1)


def test_tokens_per_gpu_do_not_depend_on_the_layout():
    """The same global batch on 2 GPUs counts the same tokens per GPU under dp=2 and under tp=2."""

    def plan(*, tp: int, local: int) -> RunPlan:
        cfg = JobConfig()
        cfg.training.seq_len, cfg.training.local_batch_size, cfg.training.global_batch_size = 64, local, 8
        cfg.parallelism.tensor_parallel_degree = tp
        return RunPlan.build(cfg, 2, args=tiny_args())

    dp2, tp2 = plan(tp=1, local=4), plan(tp=2, local=8)
    assert dp2.tokens_per_gpu_step == tp2.tokens_per_gpu_step == 8 * 64 / 2
    # Per-rank counting (local batch x seq x accumulation) would give tp=2 twice the tokens.
    assert tp2.cfg.training.local_batch_size * 64 * tp2.grad_accum == 2 * tp2.tokens_per_gpu_step


@pytest.mark.parametrize("public", [True, False], ids=["set_timeout", "private_setter"])
def test_train_timeouts_are_set_through_the_public_api_where_torch_has_one(process_group, monkeypatch, public):
    """torch >= 2.15 deprecates `_set_pg_timeout` with a FutureWarning every rank printed; where the public
    `dist.set_timeout` exists it is the one called, and the older torch's private setter warns nothing."""
    import warnings

    calls = []
    if public:
        monkeypatch.setattr(dist, "set_timeout", lambda timeout, group: calls.append(timeout), raising=False)
    else:
        monkeypatch.delattr(dist, "set_timeout", raising=False)
        monkeypatch.setattr(dist.distributed_c10d, "_set_pg_timeout", lambda t, g: calls.append(t))
    cfg = JobConfig()
    plan = RunPlan.build(cfg, 1, args=tiny_args())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        timeouts = apply_train_timeout(cfg, plan.dims)
    assert len(calls) == len(timeouts) >= 1
    assert {t.total_seconds() for t in calls} == {cfg.comm.train_timeout_seconds}


def test_dtensors_sequential_redistribution_advice_is_not_in_a_ranks_output(caplog):
    """DTensor logs "While redistributing from ... may give inconsistent results between ranks" once per
    mesh for a tensor-parallel run's gradient norm; the ranks' logging drops that one record of torch's
    logger and keeps every other (the negative control), and torch still words it so."""
    import inspect
    import logging

    from torch.distributed.tensor import _redistribute

    from titanlite.run.rank_logging import REDISTRIBUTE_LOGGER, init_logging

    assert '"While redistributing from %s to %s' in inspect.getsource(_redistribute)
    assert _redistribute.logger.name == REDISTRIBUTE_LOGGER
    init_logging(0)
    init_logging(0)  # a second trainer in one process adds no second filter
    torch_logger = logging.getLogger(REDISTRIBUTE_LOGGER)
    assert len(torch_logger.filters) == 1
    torch_logger.warning("While redistributing from %s to %s, %d sequential %s operations", "P", "R", 2, "ar")
    torch_logger.warning("another DTensor warning")
    assert [r.getMessage() for r in caplog.records if r.name == REDISTRIBUTE_LOGGER] == ["another DTensor warning"]
