"""Resuming from an older step starts a new line of training, through `run_train.sh` on two ranks: the
newer checkpoints are moved aside, never deleted or overwritten, pruning keeps the checkpoint just written,
and the next plain launch resumes the new line (the rule: titanlite/checkpoint/lineage.py).

One launch makes a folder with step-2, step-4 and step-6; each scenario trains in a copy of it:
`load_step 2` to step 4 with `keep_latest_k 1`, and without it followed by a plain launch to step 6;
and `load_step 2` to step 6 with a rank dying before step 6 and one restart, which resumes the new line.
"""

from __future__ import annotations

import json
import re
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from harness import GOODPUT_LINE, SHALLOW, SMALL, RunResult, launcher_lines, train
from titanlite.checkpoint import folders

pytestmark = pytest.mark.slow

BASE = [*SMALL, *SHALLOW, "--training.local_batch_size", "2", "--checkpoint.enable", "--checkpoint.interval", "2"]


def run(dump: Path, steps: int, *overrides: str, env: dict[str, str] | None = None) -> RunResult:
    return train(dump, 2, *BASE, "--training.steps", str(steps), *overrides, launcher="run_train", env=env)


def markers(root: Path) -> dict[str, str]:
    """`<folder>/step-N` -> its completion marker's text, for every checkpoint under `root`."""
    return {
        str(p.parent.relative_to(root)): p.read_text()
        for p in sorted(root.rglob(folders.MARKER))
        if p.parent.name.startswith("step-")
    }


def checkpoint_lines(result: RunResult) -> list[str]:
    """What rank 0 says about checkpoints, without time stamps and durations. The wait for the background
    deletion at the end is in it or not, depending on its speed: both lines or neither, then left out."""
    lines = [re.sub(r"^\[rank0\]: \d\d:\d\d:\d\d [A-Z]+ ", "", line) for line in result.stderr.splitlines()]
    lines = [line for line in lines if not GOODPUT_LINE.fullmatch(line)]  # the launcher's, naming checkpoint_load
    lines = [re.sub(r"\d+\.\d\ds", "T", line) for line in lines if "checkpoint" in line]
    waited = [line for line in lines if line.startswith(("checkpoint: waiting for", "checkpoint: old checkpoints"))]
    assert waited in (
        [],
        ["checkpoint: waiting for the deletion of step-2.deleting", "checkpoint: old checkpoints deleted (T waited)"],
    ), waited
    return [line for line in lines if line not in waited]


@pytest.fixture(scope="module")
def old_line(tmp_path_factory) -> Path:
    """Six steps with a checkpoint every two: step-2, step-4 and step-6."""
    dump = tmp_path_factory.mktemp("old_line")
    run(dump, 6).ok()
    assert folders.scan(dump / "checkpoint") == ([2, 4, 6], [])
    return dump


@pytest.fixture(scope="module")
def branches(old_line, tmp_path_factory) -> dict[str, tuple[Path, RunResult, dict[str, str]]]:
    """Copies of `old_line` resumed from step 2 to step 4, two launches at a time: with keep_latest_k 1,
    and without it (then a plain launch to step 6 in the same folder). Name -> (dump folder, result, the
    checkpoint folder's markers right after the launch)."""
    root = tmp_path_factory.mktemp("branches")
    results: dict[str, tuple[Path, RunResult, dict[str, str]]] = {}

    def launch(name: str, dump: Path, steps: int, *extra: str, env: dict[str, str] | None = None) -> None:
        result = run(dump, steps, *extra, env=env)
        results[name] = dump, result, markers(dump / "checkpoint")

    def branch(name: str, *extra: str) -> None:
        dump = root / name
        shutil.copytree(old_line / "checkpoint", dump / "checkpoint")
        launch(name, dump, 4, "--checkpoint.load_step", "2", *extra)
        if name == "keep_all":
            launch("plain", dump, 6)

    def restarted() -> None:
        dump = root / "restarted"
        shutil.copytree(old_line / "checkpoint", dump / "checkpoint")
        crash = {"TITANLITE_FAULT_EXIT_AT": "6", "TITANLITE_FAULT_ONCE": str(root / "fired")}
        launch("restarted", dump, 6, "--checkpoint.load_step", "2", "--comm.max_restarts", "1", env=crash)

    with ThreadPoolExecutor(max_workers=2) as pool:
        for future in [
            pool.submit(branch, "keep_1", "--checkpoint.keep_latest_k", "1"),
            pool.submit(branch, "keep_all"),
            pool.submit(restarted),
        ]:
            future.result()
    return results


def moved_aside(dump: Path) -> Path:
    (aside,) = [p for p in (dump / "checkpoint").iterdir() if p.name.startswith("abandoned-")]
    assert re.fullmatch(r"abandoned-\d{8}-\d{6}-from-step-2", aside.name), aside.name
    return aside


def assert_old_line_aside(old_line: Path, dump: Path) -> Path:
    """step-4 and step-6 of the old line are in one abandoned folder, unchanged (markers and files)."""
    aside = moved_aside(dump)
    old = markers(old_line / "checkpoint")
    assert markers(aside) == {k: v for k, v in old.items() if k != "step-2"}
    for step in (4, 6):
        assert folders.problem(aside / f"step-{step}") is None
        assert folders.checksum_problem(aside / f"step-{step}", folders.read_marker(aside / f"step-{step}")) is None
    return aside


def test_keep_latest_k_keeps_what_the_run_saved_and_the_old_line_is_moved_aside(old_line, branches):
    dump, result, _ = branches["keep_1"]
    assert result.returncode == 0, result.log[-3000:]
    aside = assert_old_line_aside(old_line, dump)
    ckpt = dump / "checkpoint"
    assert checkpoint_lines(result) == [
        f"checkpoint: settings changed since {ckpt}/step-2: training.steps 6 -> 4, checkpoint.keep_latest_k 0 -> 1 "
        "(the new values apply)",
        f"checkpoint: resumed from {ckpt}/step-2 at step 2 in T (checksums verified in T)",
        "checkpoint: resuming from step-2 starts a new line of training; the newer step-4, step-6 moved to "
        f"{aside} (kept, never resumed or pruned)",
        f"checkpoint step 4: training state saved to {ckpt}/step-4 in T; deleting step-2 in the background",
    ]
    assert not [line for line in result.log.splitlines() if "WARNING" in line] and not launcher_lines(result.log)
    assert folders.scan(ckpt) == ([4], [])  # what the run wrote, and only that: keep_latest_k 1
    assert [r["step"] for r in result.metrics] == [3, 4]


def test_without_keep_latest_k_nothing_is_overwritten_and_a_plain_launch_resumes_the_new_line(old_line, branches):
    dump, result, after = branches["keep_all"]
    assert result.returncode == 0, result.log[-3000:]
    ckpt = dump / "checkpoint"
    aside = moved_aside(dump)
    old = markers(old_line / "checkpoint")
    assert after == {  # step-2 as it was, the new step-4, the old line aside
        "step-2": old["step-2"],
        "step-4": after["step-4"],
        **{f"{aside.name}/{k}": v for k, v in old.items() if k != "step-2"},
    }
    new_step_4 = json.loads(after["step-4"])
    plain_dump, plain, _ = branches["plain"]
    assert plain_dump == dump and plain.returncode == 0, plain.log[-3000:]
    aside = assert_old_line_aside(old_line, dump)  # after both launches: untouched by the plain one
    assert checkpoint_lines(plain) == [
        f"checkpoint: settings changed since {ckpt}/step-4: training.steps 4 -> 6 (the new values apply)",
        f"checkpoint: resumed from {ckpt}/step-4 at step 4 in T (checksums verified in T)",
        f"checkpoint step 6: training state saved to {ckpt}/step-6 in T",
    ]
    assert not [line for line in plain.log.splitlines() if "WARNING" in line] and not launcher_lines(plain.log)
    assert folders.scan(ckpt) == ([2, 4, 6], [])
    assert folders.read_marker(ckpt / "step-4") == new_step_4  # the new line's step-4, resumed, not rewritten
    assert new_step_4["launch"] != folders.read_marker(aside / "step-4")["launch"]
    assert [r["step"] for r in plain.metrics[-2:]] == [5, 6]


def test_a_restart_resumes_the_new_line_not_load_step_again(old_line, branches):
    """The restart runs the same command line, load_step 2 included: it resumes the step-4 its launch
    saved, and moves nothing aside a second time."""
    dump, result, after = branches["restarted"]
    assert result.returncode == 0, result.log[-3000:]
    restart = [line for line in result.stderr.splitlines() if line.startswith("titanlite: restarting")]
    assert len(restart) == 1 and "(restart 1 of 1) after: rank 0 exited with code 17" in restart[0], restart
    ckpt = dump / "checkpoint"
    aside = assert_old_line_aside(old_line, dump)  # one abandoned folder: the first attempt's
    resumed = [line for line in checkpoint_lines(result) if "resumed from" in line]
    assert resumed == [
        f"checkpoint: resumed from {ckpt}/step-2 at step 2 in T (checksums verified in T)",
        f"checkpoint: resumed from {ckpt}/step-4 at step 4 in T (checksums verified in T)",
    ]
    assert folders.scan(ckpt) == ([2, 4, 6], []) and set(after) == {
        "step-2",
        "step-4",
        "step-6",
        *(f"{aside.name}/step-{s}" for s in (4, 6)),
    }
    assert [r["step"] for r in result.metrics] == [3, 4, 5, 5, 6]
