"""The step-time and memory estimates against TorchTitan's published Llama 3 runs (titanlite/tools/calibration.py).

Pure arithmetic on parameter shapes read once per model: the calibration rows reproduce their published
tokens/s with the efficiencies titanlite/planning/gpus.py holds (so the table is the fit), every comparable
row stays within the error docs/layout_search.md reports, and that page's table is this model's output.
"""

from __future__ import annotations

import pytest

from harness import ROOT
from titanlite.planning.memory import GiB
from titanlite.tools import calibration, reconciliation

pytestmark = pytest.mark.slow  # a second of arithmetic over 8B, 70B and 405B shapes


@pytest.fixture(scope="module")
def shapes():
    return {}


@pytest.fixture(scope="module")
def results(shapes):
    return calibration.results(shapes)


BF16_TPS, FEATURE_TPS, GIB = 0.05, 0.40, 0.20
"""Largest relative errors on the comparable rows: tokens/s of bf16 rows, of rows with float8 / async
TP (techniques titanlite lacks, modelled coarsely), and peak memory where published."""


def test_calibration_rows_reproduce_their_published_throughput(results):
    rows = [(row, r) for row, r in zip(calibration.ROWS, results) if row.calibrates]
    assert {row.gpu for row, _ in rows} == {"h100-96gb-500w", "a100"}
    for row, r in rows:
        assert abs(r.tps_error) < 0.005, row.name


def test_every_comparable_row_is_within_the_reported_error(results):
    compared = 0
    for row, r in zip(calibration.ROWS, results):
        compared += 1
        bound = FEATURE_TPS if (row.features.float8 or row.features.async_tp) else BF16_TPS
        assert abs(r.tps_error) <= bound, (row.name, r.tps_error)
        if r.gib_error is not None:
            assert abs(r.gib_error) <= GIB, (row.name, r.gib_error)
    assert compared == len(calibration.ROWS) == 21


def test_the_documented_table_is_the_models_output(results):
    doc = (ROOT / "docs" / "layout_search.md").read_text()
    assert calibration.table(results) in doc


def test_the_reconciliation_table_is_the_models_output(shapes):
    """docs/dry_run.md's table is `reconciliation.table`'s; its December 2024 stage outputs are hand counts:
    the interleaved 405B row's worst rank as run is the last (its last stage runs each backward right after
    the forward, so 7 of 8 microbatches' logits are kept beyond the model's: 4 x 8192 tokens x 128,256 / 8
    vocabulary x 2 B each), and a 1F1B row's rank 0 (all 8 in flight) keeps none."""
    recs = reconciliation.reconcile(shapes)
    assert [r.row for r in recs] == [row for row in calibration.ROWS if row.gib is not None]
    by_name = {r.row.name: r for r in recs}
    interleaved = by_name["405B, 512 GPUs, FSDP 8 TP 8 PP 8, Interleaved 1F1B, full AC, compile + Float8 + async TP"]
    assert interleaved.retained_gib * GiB == 7 * 4 * 8192 * 128256 // 8 * 2
    assert by_name["405B, 512 GPUs, FSDP 8 TP 8 PP 8, 1F1B, full AC, compile + Float8 + async TP"].retained_gib == 0
    assert all(r.float8_gib == 0 for r in recs if not r.row.features.float8)
    doc = (ROOT / "docs" / "dry_run.md").read_text()
    assert reconciliation.table(recs) in doc
    assert reconciliation.commands() in doc


def test_the_planners_margin_and_the_interleaved_rows_staged_reduction(shapes):
    """docs/dry_run.md's figures beyond the table: the comfort margin covers every published peak but rows
    11, 13 and 18 (by 0.3, 2.8 and 4.9 GiB), and the interleaved 405B layout, with each stage reduced after
    its last backward, holds 63.8 GiB on its worst rank (11.9 GiB of stage 9's gradients less)."""
    recs = reconciliation.reconcile(shapes)
    short = {i: round(r.margin_short_gib, 1) for i, r in enumerate(recs, 1) if r.margin_short_gib > 0}
    assert short == {11: 0.3, 13: 2.8, 18: 4.9}
    rows = [row for row in calibration.ROWS if row.gib is not None]
    interleaved, one_f_one_b = (calibration.estimate(rows[i], shapes=shapes) for i in (13, 12))
    assert round(reconciliation.per_stage_reduction_gib(interleaved), 1) == 63.8
    assert reconciliation.per_stage_reduction_gib(one_f_one_b) == one_f_one_b.memory.peak_total / GiB
    doc = (ROOT / "docs" / "dry_run.md").read_text()
    assert "held at most 63.8 GiB" in doc and "2.8 GiB short of row 13" in doc
