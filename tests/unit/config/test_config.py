"""Config loading: TOML, command-line overrides, and one-line errors for bad input."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
import typing

import pytest

from harness import ROOT, child_env
from titanlite.config import ConfigError, JobConfig, Range, load_config


def test_defaults_and_toml(tmp_path):
    cfg = load_config([], default_config=str(ROOT / "train_configs/debug_model.toml"))
    assert cfg.model.flavor == "debugmodel" and cfg.training.steps == 100
    assert cfg.job.config_file.endswith("debug_model.toml")


@pytest.mark.parametrize("configs", ["debug_model", "llama3_8b", "llama3_70b", "llama3_405b"])
def test_shipped_configs_load(configs):
    cfg = load_config(["--config", str(ROOT / f"train_configs/{configs}.toml")])
    assert isinstance(cfg, JobConfig)


def test_overrides_all_forms():
    cfg = load_config(
        [
            "--training.steps",
            "7",
            "--optimizer.lr=0.5",
            "--compile.enable",
            "--no-metrics.enable_tensorboard",
            "--training.deterministic=true",
            "--compile.components",
            "model",
            "--parallelism.tensor_parallel_degree=2",
        ]
    )
    assert cfg.training.steps == 7 and cfg.optimizer.lr == 0.5
    assert cfg.compile.enable is True and cfg.metrics.enable_tensorboard is False
    assert cfg.training.deterministic is True and cfg.compile.components == ["model"]
    assert cfg.parallelism.tensor_parallel_degree == 2


def test_override_beats_file(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text("[training]\nsteps = 3\nseq_len = 64\n")
    cfg = load_config(["--config", str(f), "--training.steps", "9"])
    assert (cfg.training.steps, cfg.training.seq_len) == (9, 64)


BAD = [
    # (file text or None, overrides, expected fragments)
    ("[training]\nstepz = 3\n", [], ["training.stepz", "c.toml", "did you mean 'training.steps'"]),
    ("[trainig]\nsteps = 3\n", [], ["section 'trainig'", "c.toml", "did you mean 'training'"]),
    ("[training]\nsteps = 'ten'\n", [], ["training.steps", "expected int", "'ten'"]),
    ("[training]\nsteps = 3\n", ["--training.seq_len", "abc"], ["training.seq_len", "expected int", "command line"]),
    ("[training]\nsteps = -1\n", [], ["training.steps", "positive"]),
    ("[training\nsteps = 3\n", [], ["invalid TOML", "c.toml", "line 1"]),
    ("[compile]\nbackend = 'tvm'\n", [], ["compile.backend", "inductor"]),
    ("[compile]\nenable = 'maybe'\n", [], ["compile.enable", "expected bool"]),
    ("[parallelism]\ndata_parallel_shard_degree = 0\n", [], ["data_parallel_shard_degree", "-1"]),
    ("[activation_checkpoint]\nselective_ac_option = 'sometimes'\n", [], ["selective_ac_option", "'op'"]),
    ("[lr_scheduler]\ndecay_ratio = 1.5\n", [], ["decay_ratio", "[0, 1]"]),
    ("steps = 3\n", [], ["'steps'", "not a [section]"]),
    ("", ["--optimizer.lr"], ["--optimizer.lr", "needs a value"]),
    ("", ["training.steps", "3"], ["unexpected command-line argument"]),
    ("[compile]\ncomponents = ['model', 'optimizer']\n", [], ["compile.components", "optimizer"]),
    ("[training]\nlocal_batch_size = 2.5\n", [], ["training.local_batch_size", "expected int"]),
]


@pytest.mark.parametrize("text,overrides,fragments", BAD)
def test_bad_configs(tmp_path, text, overrides, fragments):
    f = tmp_path / "c.toml"
    f.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_config(["--config", str(f), *overrides])
    msg = str(e.value)
    assert "\n" not in msg
    for frag in fragments:
        assert frag in msg, (frag, msg)


# Numeric keys that legitimately take any value of their type, or whose domain depends on the model. A
# key added here needs a comment saying why.
UNBOUNDED: set[str] = {
    # Block indices: checked against the model's block count and the stage count (pipeline.StageLayout.of).
    "parallelism.pipeline_parallel_split_points",
}


def test_every_numeric_key_has_a_range_or_is_listed_as_unbounded():
    """A new int/float key must declare its domain (`metadata=POSITIVE`, `_range(...)`) or be listed above."""
    missing = []
    for section, cls in typing.get_type_hints(JobConfig).items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            kinds = {hints[f.name], *typing.get_args(hints[f.name])}  # `int | None` counts as numeric too
            numeric = bool(kinds & {int, float}) and hints[f.name] is not bool
            key = f"{section}.{f.name}"
            if numeric and not isinstance(f.metadata.get("range"), Range) and key not in UNBOUNDED:
                missing.append(key)
    assert not missing, f"numeric config keys without a Range: {missing}"
    assert not UNBOUNDED - {
        f"{s}.{f.name}" for s, c in typing.get_type_hints(JobConfig).items() for f in dataclasses.fields(c)
    }


@pytest.mark.parametrize(
    "override,message",
    [
        (["--optimizer.beta1", "1.5"], "config key 'optimizer.beta1' must be in [0, 1), got 1.5"),
        (["--optimizer.lr", "nan"], "config key 'optimizer.lr' must be a finite number, got nan"),
        (["--compile.cpu_gflops", "inf"], "config key 'compile.cpu_gflops' must be a finite number, got inf"),
        (["--optimizer.eps", "0"], "config key 'optimizer.eps' must be positive, got 0.0"),
        (["--training.gc_freq", "-1"], "config key 'training.gc_freq' must be non-negative, got -1"),
        (["--training.global_batch_size", "-4"], "must be -1 (local x dp) or positive, got -4"),
        (["--checkpoint.load_step", "-2"], "must be -1 (the newest) or non-negative, got -2"),
        (["--training.seed", str(2**64)], "must be in [0, 18446744073709551615]"),
    ],
)
def test_ranges_and_non_finite_values(override, message):
    with pytest.raises(ConfigError) as e:
        load_config(override)
    assert message in str(e.value)


def test_range_bounds_are_inclusive_or_open_as_declared():
    unit = Range(low=0, high=1, high_open=True)
    assert 0 in unit and 0.999 in unit and 1 not in unit and -0.0 in unit
    sentinel = Range(low=0, low_open=True, also=-1)
    assert -1 in sentinel and 0 not in sentinel and -2 not in sentinel and 1 in sentinel
    load_config(["--optimizer.beta1", "0", "--optimizer.lr", "0", "--training.max_norm", "0"])  # edges pass


def test_missing_config_file():
    with pytest.raises(ConfigError, match="not found"):
        load_config(["--config", "/nonexistent/x.toml"])


@pytest.mark.slow
def test_cli_error_is_one_line_exit_2(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text("[training]\nstepz = 3\n")
    proc = subprocess.run(
        [sys.executable, "-m", "titanlite.train", "--config", str(f)],
        env=child_env(),
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert proc.returncode == 2
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "training.stepz" in lines[0] and "Traceback" not in proc.stderr


def test_an_unknown_section_is_named_whatever_follows_it(tmp_path):
    """run_train.sh checks the config before importing torch (under a second a launch): one line naming
    the section and exit code 2, whether the unknown key has another option after it, nothing, a `no-`
    or a value."""
    cases = [
        "--fp4.enable --job.dump_folder X",
        "--job.dump_folder X --fp4.enable",
        "--no-fp4.enable --job.dump_folder X",
        "--fp4.enable 1",
    ]
    script = "".join(f"{ROOT}/run_train.sh {case} 2>&1; echo rc=$?\n" for case in cases)
    proc = subprocess.run(["bash", "-c", script], cwd=tmp_path, env=child_env(), capture_output=True, text=True)
    line = "titanlite: error: unknown config section 'fp4' in the command line"
    assert proc.stdout.splitlines() == [line, "rc=2"] * len(cases), proc.stdout


def test_print_config_roundtrip():
    cfg = load_config(["--training.steps", "11"])
    assert '"steps": 11' in cfg.to_json()


def test_a_config_file_that_cannot_be_read_as_utf8_toml_is_one_line(tmp_path):
    """A UTF-16 file (an editor's choice) or a folder is one line naming it; a UTF-8 byte-order mark is
    skipped, so that file loads as the same text without it does."""
    utf16, bom = tmp_path / "utf16.toml", tmp_path / "bom.toml"
    utf16.write_text("[training]\nsteps = 3\n", encoding="utf-16")
    bom.write_bytes(b"\xef\xbb\xbf[training]\nsteps = 3\n")
    for path, message in ((utf16, "is not UTF-8 text (byte 0): save it as UTF-8"), (tmp_path, "is a folder")):
        with pytest.raises(ConfigError) as e:
            load_config(["--config", str(path)])
        assert message in str(e.value) and str(path) in str(e.value) and "\n" not in str(e.value)
    assert load_config(["--config", str(bom)]).training.steps == 3


@pytest.mark.parametrize(
    "overrides,message,needed",
    [
        (["--checkpoint.load_step", "3"], "checkpoint.load_step 3 needs checkpoint.enable", ["--checkpoint.enable"]),
        (
            ["--checkpoint.initial_load_in_hf"],
            "checkpoint.initial_load_in_hf needs checkpoint.initial_load_path",
            ["--checkpoint.initial_load_path", "hf"],
        ),
        (
            ["--checkpoint.local_interval", "5"],
            "checkpoint.local_interval 5 needs checkpoint.enable",
            ["--checkpoint.enable"],
        ),
        (
            ["--checkpoint.enable", "--checkpoint.local_folder", "/scratch/x"],
            "checkpoint.local_folder '/scratch/x' is set but checkpoint.local_interval is 0",
            ["--checkpoint.local_interval", "5"],
        ),
    ],
)
def test_a_load_setting_that_would_be_ignored_is_refused(overrides, message, needed):
    """Keys that choose what a run loads or saves take effect or stop the run before any rank: never
    ignored. With what they need, the same keys plan."""
    from titanlite.planning.run_plan import RunPlan

    with pytest.raises(ConfigError, match=re.escape(message)):
        RunPlan.build(load_config(overrides), 1)
    assert (
        RunPlan.build(load_config([*overrides, *needed]), 1).cfg.checkpoint
        == load_config([*overrides, *needed]).checkpoint
    )
