"""The step-time and memory estimates against TorchTitan's published Llama 3 runs.

    python -m titanlite.tools.calibration          the table of docs/layout_search.md

Each row of pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md (8 to 512 H100s of 96 GB)
and docs/performance.md (64 A100s) is evaluated as titanlite would run it: the shipped config of its
model with the row's degrees, batch, sequence, AC and compile, FSDP2 with TorchTitan's reshard policy and
fp32 gradient reduction; Float8 rows without TP or PP run titanlite's float8 (`FLOAT8`), the others and
async TP are modelled (`step_time.Features`). `fit()` solves for the training efficiency that makes a
row exact; `titanlite/planning/gpus.py` holds the fitted values. docs/layout_search.md's calibration
section gives the rows, their sources and the errors.
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass, field

from titanlite.config import load_config
from titanlite.parallelisms.parallel_dims import layout_overrides
from titanlite.planning.gpus import GPU_KINDS, GpuKind, gpu_kind
from titanlite.planning.layout_search import Estimate, LayoutSearch
from titanlite.planning.step_time import Features
from titanlite.tools.dry_run import meta_model

CONFIGS = {
    "8B": "train_configs/llama3_8b.toml",
    "70B": "train_configs/llama3_70b.toml",
    "405B": "train_configs/llama3_405b.toml",
}
H100_TT = "h100-96gb-500w"
FSDP2 = [
    "--parallelism.dp_impl",
    "fsdp2",
    "--compile.bucketing",
    "none",
    "--training.mixed_precision_reduce",
    "float32",
]


@dataclass(frozen=True)
class Row:
    name: str
    flavor: str
    world: int
    overrides: list[str]
    tps: float
    """Published tokens/s per GPU."""
    gib: float | None
    """Published peak memory per GPU (None: not published)."""
    gpu: str = H100_TT
    features: Features = Features()
    calibrates: bool = False
    """The row fixes its GPU kind's training efficiency."""
    tags: tuple[str, ...] = field(default=())

    @property
    def float8_run(self) -> bool:
        """Estimated as titanlite's own float8 run (its config has `FLOAT8`), not modelled."""
        return "--float8.enable" in self.overrides


def _args(
    local: int, global_: int, ac: str, compile_: bool, seq: int = 8192, reshard: str = "default", **degrees: int
) -> list[str]:
    """A row's overrides; `degrees` by dim name (`parallel_dims.DEGREE_KEYS`), FSDP over the rest of the world."""
    mode, option = ("selective", ac) if ac in ("op", "2") else (ac, "op")
    out = [*FSDP2, "--training.seq_len", str(seq), "--training.local_batch_size", str(local)]
    out += ["--training.global_batch_size", str(global_), "--activation_checkpoint.mode", mode]
    out += ["--activation_checkpoint.selective_ac_option", option, "--parallelism.fsdp_reshard_after_forward", reshard]
    out += layout_overrides(**degrees)
    if seq > MAX_SEQ_LEN:
        out += ["--model.max_seq_len", str(seq)]
    return out + ["--compile.enable" if compile_ else "--no-compile.enable"]


F8 = Features(float8=True)
F8_ATP = Features(float8=True, async_tp=True)
FLOAT8 = [
    "--float8.enable",
    "--float8.recipe",
    "tensorwise",
    "--float8.all_gather",
    "--float8.filter_fqns",
    "output",
]
"""The float8 of TorchTitan's runs (torchao, December 2024) as titanlite's keys: tensorwise scales, weights
gathered in float8 by FSDP2's float8 all-gather, every linear layer but the output projection converted."""
MAX_SEQ_LEN = 131072
"""The shipped flavors' `max_seq_len` (RoPE scaling's context): longer rows raise it (no parameter changes)."""


def _cp(context: int, seq: int) -> list[str]:
    """TorchTitan's 8B context-parallel rows: 8 GPUs, FSDP 8 / `context`, local batch 1, full AC, compile,
    Float8."""
    return [*_args(1, 8 // context, "full", True, seq, dp_shard=8 // context, cp=context), *FLOAT8]


def _pp(schedule: str, v: int, local: int, global_: int, seq: int = 8192, context: int = 1) -> list[str]:
    """TorchTitan's pipeline of that time split the local batch into as many microbatches as pipeline ranks,
    whatever the schedule (`experimental.pipeline_parallel_microbatches` defaulted to
    `pipeline_parallel_degree`; its interleaved schedule ran 2 stages per rank over those 8)."""
    out = _args(local, global_, "full", True, seq, "never", pp=8, dp_shard=8 // context, tp=8, cp=context)
    out += ["--parallelism.pipeline_parallel_schedule", schedule, "--parallelism.pipeline_parallel_stages_per_rank"]
    microbatch = local // 8
    return out + [
        str(v),
        "--parallelism.pipeline_parallel_microbatch_size",
        str(microbatch),
        "--parallelism.gradient_reduction",
        "per_step",
    ]


ROWS: tuple[Row, ...] = (
    Row("8B, 8 GPUs, FSDP", "8B", 8, _args(2, 16, "op", False), 5762, 82.4),
    Row("8B, 8 GPUs, FSDP + compile", "8B", 8, _args(2, 16, "op", True), 6667, 77.0, calibrates=True),
    Row("8B, 8 GPUs, FSDP + compile + Float8", "8B", 8, [*_args(2, 16, "op", True), *FLOAT8], 8532, 76.8, features=F8),
    Row(
        "8B, 8 GPUs, FSDP 8 CP 1, seq 32768, full AC, + compile + Float8",
        "8B",
        8,
        _cp(1, 32768),
        3890,
        83.9,
        features=F8,
    ),
    *(
        Row(
            f"8B, 8 GPUs, FSDP {8 // context} CP {context}, seq {seq}, full AC, compile + Float8",
            "8B",
            8,
            _cp(context, seq),
            tps,
            gib,
            features=F8,
        )
        for context, seq, tps, gib in ((2, 65536, 2540, 84.2), (4, 131072, 1071, 84.0), (8, 262144, 548, 84.5))
    ),
    Row("8B, 128 GPUs, FSDP", "8B", 128, _args(2, 256, "op", False), 5605, 67.0),
    Row("8B, 128 GPUs, FSDP + compile", "8B", 128, _args(2, 256, "op", True), 6514, 62.0),
    Row(
        "8B, 128 GPUs, FSDP + compile + Float8",
        "8B",
        128,
        [*_args(2, 256, "op", True), *FLOAT8],
        8380,
        61.8,
        features=F8,
    ),
    Row(
        "70B, 256 GPUs, FSDP 32 TP 8, full AC, compile + Float8",
        "70B",
        256,
        _args(16, 512, "full", True, dp_shard=32, tp=8),
        829,
        71.9,
        features=F8,
    ),
    Row(
        "70B, 256 GPUs, FSDP 32 TP 8, full AC, compile + Float8 + async TP",
        "70B",
        256,
        _args(16, 512, "full", True, dp_shard=32, tp=8),
        876,
        67.6,
        features=F8_ATP,
    ),
    Row(
        "405B, 512 GPUs, FSDP 8 TP 8 PP 8, 1F1B, full AC, compile + Float8 + async TP",
        "405B",
        512,
        _pp("1F1B", 1, 32, 256),
        100,
        82.5,
        features=F8_ATP,
    ),
    Row(
        "405B, 512 GPUs, FSDP 8 TP 8 PP 8, Interleaved 1F1B, full AC, compile + Float8 + async TP",
        "405B",
        512,
        _pp("Interleaved1F1B", 2, 32, 256),
        128,
        72.7,
        features=F8_ATP,
    ),
    Row(
        "405B, 512 GPUs, FSDP 8 TP 8 PP 8 CP 1, seq 32768, 1F1B, compile + Float8 + async TP",
        "405B",
        512,
        _pp("1F1B", 1, 8, 64, seq=32768),
        76,
        75.3,
        features=F8_ATP,
    ),
    *(
        Row(
            f"405B, 512 GPUs, FSDP {8 // context} TP 8 PP 8 CP {context}, seq {seq}, 1F1B, compile + Float8 + async TP",
            "405B",
            512,
            _pp("1F1B", 1, 8, 64 // context, seq=seq, context=context),
            tps,
            gib,
            features=F8_ATP,
        )
        for context, seq, tps, gib in ((2, 65536, 47, 75.9), (4, 131072, 31, 77.1), (8, 262144, 16, 84.9))
    ),
    Row("A100: 8B, 64 GPUs, FSDP, selective layer AC", "8B", 64, _args(1, 64, "2", False), 2904, None, gpu="a100"),
    Row(
        "A100: 8B, 64 GPUs, FSDP, selective op AC",
        "8B",
        64,
        _args(1, 64, "op", False),
        2973,
        None,
        gpu="a100",
        calibrates=True,
    ),
    Row("A100: 70B, 64 GPUs, FSDP, full AC", "70B", 64, _args(1, 64, "full", False), 331, None, gpu="a100"),
)


@dataclass
class Result:
    row: Row
    tps: float
    gib: float

    @property
    def tps_error(self) -> float:
        return self.tps / self.row.tps - 1

    @property
    def gib_error(self) -> float | None:
        return None if self.row.gib is None else self.gib / self.row.gib - 1


def kind_of(row: Row, efficiency: float | None = None) -> GpuKind:
    kind = gpu_kind(row.gpu)
    return kind if efficiency is None else dataclasses.replace(kind, training_efficiency=efficiency)


def estimate(row: Row, efficiency: float | None = None, shapes: dict | None = None) -> Estimate:
    """The row as titanlite's estimates see it (the given layout of the layout search); `shapes` shares
    the parameter shapes read between rows of one model."""
    cfg = load_config(["--config", CONFIGS[row.flavor], *row.overrides])
    est = LayoutSearch(cfg, row.world, kind_of(row, efficiency), meta_model, row.features, shapes).given()
    if not isinstance(est, Estimate):
        raise ValueError(f"{row.name}: {est}")
    return est


def evaluate(row: Row, efficiency: float | None = None, shapes: dict | None = None) -> Result:
    """`estimate`'s tokens/s and peak GiB."""
    est = estimate(row, efficiency, shapes)
    return Result(row, est.time.tokens_per_s, est.gib)


def fit(row: Row, shapes: dict | None = None) -> float:
    """The training efficiency at which `row`'s estimate equals its published tokens/s (bisection: the
    estimate grows with the efficiency)."""
    shapes = {} if shapes is None else shapes
    low, high = 0.05, 1.5
    for _ in range(40):
        mid = (low + high) / 2
        if evaluate(row, mid, shapes).tps < row.tps:
            low = mid
        else:
            high = mid
    return (low + high) / 2


def results(shapes: dict | None = None) -> list[Result]:
    """Every row's estimate."""
    shapes = {} if shapes is None else shapes
    return [evaluate(row, shapes=shapes) for row in ROWS]


def _modelled(f: Features) -> str:
    """How a row's Float8 / async TP enters the estimate."""
    return " + ".join(n for n, on in (("fp8 block matmuls", f.float8), ("TP collectives hidden", f.async_tp)) if on)


def table(estimates: list[Result]) -> str:
    """The markdown table of every row against `estimates` (`results()`)."""
    lines = [
        "| run | published tok/s | estimated | error | published GiB | estimated | error |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for row, r in zip(ROWS, estimates):
        tag = " (calibration)" if row.calibrates else ""
        if row.float8_run:
            tag += " [float8 run]"
        elif row.features.float8 or row.features.async_tp:
            tag += f" [modelled: {_modelled(row.features)}]"
        gib_pub = f"{row.gib:.1f}" if row.gib is not None else "-"
        gib_err = f"{100 * r.gib_error:+.0f}%" if r.gib_error is not None else "-"
        lines.append(
            f"| {row.name}{tag} | {row.tps:,.0f} | {r.tps:,.0f} | {100 * r.tps_error:+.0f}% | {gib_pub} | "
            f"{r.gib:.1f} | {gib_err} |"
        )
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if "--fit" in argv:
        shapes: dict = {}
        for row in ROWS:
            if row.calibrates:
                print(f"{row.gpu}: training_efficiency {fit(row, shapes):.3f} ({row.name})")
        return 0
    print(f"GPU kinds: {', '.join(GPU_KINDS)}")
    print(table(results()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
