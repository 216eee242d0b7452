"""Continued pretraining from a Hugging Face folder through the trainer, for every family: a folder
exported from a model initialised with the run's seed (`init_weights(seed=0)`, as the trainer draws
it) is imported by `--checkpoint.initial_load_path DIR --checkpoint.initial_load_in_hf`, and the first
step's loss equals that of the run that draws those weights itself (same data, same weights); a folder of
other weights (seed 5, the negative control) gives another loss. All runs in one torchrun launch."""

from __future__ import annotations

import pytest
from builders import config

from harness import SMALL, step_metric, train_in_one_launch
from titanlite.checkpoint.hf import export_hf
from titanlite.planning.run_plan import RunPlan

FAMILIES = ("llama3", "qwen3", "qwen3_moe", "deepseek_v3")
PADDED = 2112
"""The bundled tokenizer's 2,056 ids padded to a multiple of 64, as a published checkpoint's vocabulary is."""


def export(family: str, seed: int, out, vocab_size: int = 0) -> None:
    plan = RunPlan.build(config(None, model__name=family, model__flavor="debugmodel", model__vocab_size=vocab_size), 1)
    model = plan.spec.model_cls(plan.model_args)
    model.init_weights(seed=seed)
    tok = plan.tokenizer
    export_hf(model, out, adapter=plan.spec.require_hf_adapter(), bos_id=tok.bos_id, eos_id=tok.eos_id)


@pytest.mark.slow
def test_first_step_of_an_imported_run_is_the_imported_weights_step(tmp_path):
    runs, pairs = [], {}
    for family in FAMILIES:
        base = [*SMALL, "--training.steps", "1", "--model.name", family, "--model.flavor", "debugmodel"]
        folders = {seed: tmp_path / f"hf-{family}-{seed}" for seed in ((0, 5) if family == "qwen3_moe" else (0,))}
        for seed, folder in folders.items():
            export(family, seed, folder)
        plain = tmp_path / f"{family}-plain"
        runs.append((plain, base))
        for seed, folder in folders.items():
            dump = tmp_path / f"{family}-hf{seed}"
            load = ["--checkpoint.initial_load_path", str(folder), "--checkpoint.initial_load_in_hf"]
            runs.append((dump, [*base, *load]))
            pairs[dump] = (plain, seed)
    # A published checkpoint's vocabulary is padded past its tokenizer's ids (Qwen3: 151,936 rows, 151,669
    # ids): model.vocab_size gives the run those rows, so the weights load.
    padded, plain = tmp_path / "hf-qwen3-padded", tmp_path / "qwen3-padded-plain"
    export("qwen3", 0, padded, vocab_size=PADDED)
    base = [*SMALL, "--training.steps", "1", "--model.name", "qwen3", "--model.vocab_size", str(PADDED)]
    runs += [(plain, base), (tmp_path / "qwen3-padded-hf0", [*base, "--checkpoint.initial_load_path", str(padded),
                                                               "--checkpoint.initial_load_in_hf"])]  # fmt: skip
    pairs[tmp_path / "qwen3-padded-hf0"] = (plain, 0)
    results = train_in_one_launch(runs, 1)
    for dump, (plain, seed) in pairs.items():
        folder = tmp_path / f"hf-{dump.name.split('-hf')[0]}-{seed}"
        folder = tmp_path / "hf-qwen3-padded" if "padded" in dump.name else folder
        assert f"checkpoint: loading Hugging Face weights from {folder}" in results[dump].stderr
        imported, drawn = step_metric(dump)[1], step_metric(plain)[1]
        if seed == 0:
            assert imported == pytest.approx(drawn, rel=1e-6), (dump.name, imported, drawn)
        else:
            assert abs(imported - drawn) > 1e-3 * drawn, (dump.name, imported, drawn)
