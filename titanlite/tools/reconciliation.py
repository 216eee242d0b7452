"""TorchTitan's published H100 rows against titanlite's estimate of the same layout, and why they differ.

    python -m titanlite.tools.reconciliation        the table of docs/dry_run.md, and the commands

Every H100 row of the calibration (`calibration.ROWS`) is estimated at its own layout. Where an estimate
is more than `BOUND` off, the table gives what the run had that the estimate leaves out, computed here from
the same model, never typed in: tokens/s without and with Float8 and async TP; memory with the runs'
float8 weight gathers and their torch's pipeline outputs kept to the step's end, and beyond 10% the
nearest row's published figure; and the planner's margin (`COMFORT_FRACTION`): by how much a run's
published peak exceeds what the planner would have let through. docs/dry_run.md explains each column.
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass

from titanlite.planning.layout_search import Estimate
from titanlite.planning.memory import COMFORT_FRACTION, GiB
from titanlite.planning.step_time import Features
from titanlite.tools.calibration import CONFIGS, FLOAT8, ROWS, Result, Row, estimate, evaluate

BOUND = 0.10
"""Within this relative difference a row needs no explanation."""
LOGITS_BYTES = 2
"""The runs' logits dtype (bf16: the output layer's compute dtype)."""


@dataclass(frozen=True)
class Reconciled:
    row: Row
    estimate: Result
    bf16_tps: float | None
    """The estimate without Float8 and async TP (rows that had them)."""
    float8_tps: float | None
    """With Float8 alone (rows that also had async TP)."""
    float8_gib: float
    """Change on the worst rank as run from gathered block weights at 1 byte (<= 0; 0 where the estimate
    is a float8 run's, which counts them)."""
    retained_gib: float
    """Change on the worst rank as run from December 2024 torch's kept stage outputs (>= 0)."""
    as_run_gib: float
    """The worst rank with both changes."""

    @property
    def margin_short_gib(self) -> float:
        """How far the published peak exceeds what the planner's comfort margin leaves above the estimate
        (<= 0: covered)."""
        assert self.row.gib is not None
        return self.row.gib - self.estimate.gib / COMFORT_FRACTION


def _rank_changes(est: Estimate, vocab: int) -> list[tuple[int, int, int]]:
    """Per pipeline rank (the only one without PP): (estimated total, Float8 weights' change, December
    2024 torch's kept stage outputs), in bytes."""
    out = []
    lay = est.memory.layout
    e = lay.compute_dtype.itemsize
    for rank in est.memory.ranks:
        tokens = lay.local_batch // rank.microbatches * lay.rank_seq_len  # one microbatch's, on this rank
        logits = tokens * vocab // lay.vocab_shards * LOGITS_BYTES
        held_blocks = sum(u.gathered[b] for u in rank.stages for b in u.block_units if b in u.held)
        in_flight = max(u.memory.gather_in_flight for u in rank.stages)
        float8 = -(held_blocks * (e - 1) + in_flight * (e - 1) // e)
        kept = 0
        if rank.pipelined:
            for u, k in zip(rank.stages, rank.in_flight):
                kept += (rank.microbatches - k) * (logits if u.last else u.boundary)
        out.append((rank.total, float8, kept))
    return out


def per_stage_reduction_gib(est: Estimate) -> float:
    """The worst rank's estimate where torch's schedule reduces each stage's gradients after its last
    backward: on a rank of several stages the last (highest) one runs all its backwards before the others
    start theirs, so its unreduced gradients are gone before theirs exist (one stage per rank: no change)."""
    worst = 0
    for rank in est.memory.ranks:
        first_done = max(rank.stages, key=lambda u: u.stage) if len(rank.stages) > 1 else None
        worst = max(worst, rank.total - (first_done.memory.reduce_buffer if first_done else 0))
    return worst / GiB


def _tps(row: Row, features: Features, shapes: dict) -> float:
    """The row's tokens/s with `features`; a float8 run without Float8 is the same run without float8."""
    overrides = row.overrides if features.float8 else [o for o in row.overrides if o not in FLOAT8]
    return evaluate(dataclasses.replace(row, features=features, overrides=overrides), shapes=shapes).tps


def reconcile(shapes: dict | None = None) -> list[Reconciled]:
    """Every row with a published memory, estimated and reconciled (`shapes` as `calibration.evaluate`'s)."""
    shapes = {} if shapes is None else shapes
    out = []
    for row in (r for r in ROWS if r.gib is not None):
        est, f = estimate(row, shapes=shapes), row.features
        bf16 = _tps(row, Features(), shapes) if f != Features() else None
        float8 = _tps(row, Features(float8=True), shapes) if f.async_tp else None
        modelled = f.float8 and not row.float8_run
        changes = [(t, w if modelled else 0, k) for t, w, k in _rank_changes(est, est.plan.model_args.vocab_size)]
        worst = max(changes, key=sum)
        result = Result(row, est.time.tokens_per_s, est.gib)
        out.append(Reconciled(row, result, bf16, float8, worst[1] / GiB, worst[2] / GiB, sum(worst) / GiB))
    return out


def _pct(x: float, ref: float) -> str:
    return f"{100 * (x / ref - 1):+.0f}%"


def _half_sequence(r: Reconciled, recs: list[Reconciled]) -> Reconciled | None:
    """The row of the same model, GPUs and techniques at half this row's sequence, if published."""
    seq = _seq(r.row)
    for o in recs:
        if (o.row.flavor, o.row.world, o.row.features) == (r.row.flavor, r.row.world, r.row.features):
            if 2 * _seq(o.row) == seq:
                return o
    return None


def _seq(row: Row) -> int:
    return int(row.overrides[row.overrides.index("--training.seq_len") + 1])


def _tps_note(r: Reconciled, recs: list[Reconciled]) -> str:
    row, est = r.row, r.estimate
    if abs(est.tps_error) <= BOUND or r.bf16_tps is None:
        return ""
    what = "Float8 and async TP" if row.features.async_tp else "Float8"
    parts = [f"without {what} {r.bf16_tps:,.0f} ({_pct(r.bf16_tps, row.tps)})"]
    if r.float8_tps is not None:
        parts.append(f"Float8 alone {r.float8_tps:,.0f} ({_pct(r.float8_tps, row.tps)})")
    low, high = sorted((r.bf16_tps, est.tps))
    where = "between them" if low <= row.tps <= high else ("above both" if row.tps > high else "below both")
    note = "tok/s " + ", ".join(parts) + f": published {where}"
    half = _half_sequence(r, recs)
    if half is not None and where != "between them":
        note += (
            f"; from #{recs.index(half) + 1} (half the sequence) published x{row.tps / half.row.tps:.2f}, "
            f"estimated x{est.tps / half.estimate.tps:.2f}"
        )
    return note


def _gib_note(r: Reconciled, recs: list[Reconciled]) -> str:
    row = r.row
    assert row.gib is not None
    if abs(r.estimate.gib / row.gib - 1) <= BOUND and abs(r.as_run_gib / row.gib - 1) <= BOUND:
        return ""
    others = [o for o in recs if o is not r and (o.row.flavor, o.row.world) == (row.flavor, row.world)]
    near = min(others, key=lambda o: abs(o.estimate.gib - r.estimate.gib))
    assert near.row.gib is not None
    note = (
        f"GiB: #{recs.index(near) + 1}, estimated {near.estimate.gib - r.estimate.gib:+.1f} GiB from this row, "
        f"published {near.row.gib - row.gib:+.1f}"
    )
    if near.row.gib < row.gib:
        note += f"; as run vs its {near.row.gib:.1f}: {_pct(r.as_run_gib, near.row.gib)}"
    return note


def _margin(r: Reconciled) -> str:
    covers = r.estimate.gib / COMFORT_FRACTION
    short = r.margin_short_gib
    return f"{covers:.1f}, covers" if short <= 0 else f"{covers:.1f}, {short:.1f} short"


def _float8_weights(r: Reconciled) -> str:
    return "in estimate" if r.row.float8_run else f"{r.float8_gib:+.1f}"


def table(recs: list[Reconciled]) -> str:
    """The markdown table of docs/dry_run.md (`reconcile()`'s rows)."""
    lines = [
        "| # | run | tok/s published | estimated | diff | GiB published | estimated | diff | Float8 weights | "
        f"torch 2024 outputs | as run | diff | estimate / {COMFORT_FRACTION:.0%} | beyond 10% |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for i, r in enumerate(recs, 1):
        row, est = r.row, r.estimate
        assert row.gib is not None
        note = "; ".join(n for n in (_tps_note(r, recs), _gib_note(r, recs)) if n) or "-"
        lines.append(
            f"| {i} | {row.name} | {row.tps:,.0f} | {est.tps:,.0f} | {_pct(est.tps, row.tps)} | {row.gib:.1f} | "
            f"{est.gib:.1f} | {_pct(est.gib, row.gib)} | {_float8_weights(r)} | {r.retained_gib:+.1f} | "
            f"{r.as_run_gib:.1f} | {_pct(r.as_run_gib, row.gib)} | {_margin(r)} | {note} |"
        )
    return "\n".join(lines)


def commands() -> str:
    """The dry run of each row's layout (its memory estimate; tokens/s come only from here)."""
    out = []
    for row in ROWS:
        if row.gib is None:
            continue
        args = " ".join(row.overrides)
        extras = "TITANLITE_EXTRAS=float8 " if row.float8_run else ""  # torchao
        out.append(
            f"{extras}./run_train.sh --config {CONFIGS[row.flavor]} --dry-run --comm.fake_world_size {row.world} "
            f"--comm.fake_gpu_memory_gib 95 {args}"
        )
    return "\n".join(out)


def main(argv: list[str]) -> int:
    del argv
    print(table(reconcile()))
    print()
    print(commands())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
