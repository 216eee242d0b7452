"""Help from the config schema (`run_train.sh --help` / `-h`) and `--job.print_config`: both print and
exit 0 without launching anything."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import typing

import pytest

from harness import ROOT, child_env
from titanlite import train
from titanlite.config import JobConfig, field_docs, first_sentence, help_text
from titanlite.launcher import agent, launch
from titanlite.run import trainer
from titanlite.run.signals import Preemption


def schema_keys() -> list[tuple[str, dataclasses.Field]]:
    return [
        (f"{section}.{f.name}", f)
        for section, cls in typing.get_type_hints(JobConfig).items()
        for f in dataclasses.fields(cls)
        if f.name != "config_file"
    ]


def test_help_lists_every_key_with_type_default_and_description():
    text = help_text().splitlines()
    for key, _ in schema_keys():
        [i] = [n for n, line in enumerate(text) if line.startswith(f"  --{key} (")]
        assert "; default " in text[i], key
        description = text[i + 1].strip()
        assert len(description) > 5 and not text[i + 1].startswith("  --"), f"{key} has no description"
    for section in typing.get_type_hints(JobConfig):
        assert any(line.startswith(f"[{section}]  ") and len(line) > len(section) + 8 for line in text), section
    assert '  --optimizer.implementation (one of foreach|fused|for-loop; default "fused")' in text
    assert "  --training.steps (int, positive; default 10000)" in text
    assert "  --compile.components (list of str (comma-separated); default model,loss)" in text


def test_every_key_has_a_docstring_and_a_field_without_one_is_caught():
    for key, _ in schema_keys():
        section, name = key.split(".")
        assert field_docs(type(getattr(JobConfig(), section))).get(name), f"{key} has no docstring"

    @dataclasses.dataclass
    class Undocumented:
        documented: int = 0
        """Says why."""
        bare: int = 0

    assert field_docs(Undocumented) == {"documented": "Says why."}
    assert first_sentence("Tokens per step (e.g. 8). Must fit.") == "Tokens per step (e.g. 8)."


def test_run_train_help_and_h_print_the_schema_and_launch_nothing():
    proc = subprocess.run(
        ["bash", "-c", "./run_train.sh --help && echo ===== && ./run_train.sh -h --training.steps 3"],
        cwd=ROOT,
        env=child_env(NGPU="1"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    long, short = proc.stdout.split("=====\n")
    assert long == short and long.startswith("usage: ./run_train.sh")
    assert long.strip() == help_text().strip()
    assert "titanlite rank" not in proc.stderr and "training" not in proc.stderr


@pytest.mark.parametrize("entry", ["launcher", "trainer"])
def test_print_config_prints_the_merged_config_and_exits(entry, monkeypatch, capsys, tmp_path):
    def no_launch(*args):
        raise AssertionError("nothing may be built or launched")

    monkeypatch.setattr(agent, "launch", no_launch)
    monkeypatch.setattr(trainer, "Trainer", no_launch)
    overrides = ["--job.print_config", "--training.steps", "11", "--job.dump_folder", str(tmp_path)]
    if entry == "launcher":
        rc = launch.main(["--standalone", "--nproc_per_node=2", "-m", "titanlite.train", *overrides])
    else:
        rc = train.main(overrides, Preemption())
    assert rc == 0
    config = json.loads(capsys.readouterr().out)
    assert config["training"]["steps"] == 11 and config["model"]["flavor"] == "debugmodel"
    assert not any(tmp_path.iterdir())
