"""CI (`.ci/run`) fails when a part fails and names it: the shipped script runs in a copy of its folder
layout where `run_tests.sh` and `scripts/torch_matrix.sh` are stand-ins that log their calls and exit as
told, so the suite never runs itself; and `scripts/torch_matrix.sh --smoke-only` itself exits non-zero
when its 2-rank run fails (a side environment whose Python has no torch)."""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

from titanlite import torch_support

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
OLDEST, NEWEST = torch_support.name(torch_support.OLDEST), torch_support.name(torch_support.NEWEST)


def _script(path: Path, body: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/usr/bin/env bash\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def _ci(tmp_path: Path, tests_rc: int, smoke_rc: dict[str, int], limit: int = 60) -> tuple[int, str, list[str]]:
    """Run the shipped .ci/run with stand-ins: (exit code, its output, the stand-ins' calls in order)."""
    (tmp_path / ".ci").mkdir()
    shutil.copy(ROOT / ".ci" / "run", tmp_path / ".ci" / "run")
    calls = tmp_path / "calls"
    _script(tmp_path / "run_tests.sh", f'echo "run_tests.sh $*" >> {calls}\nexit {tests_rc}\n')
    cases = "".join(f"  {v}) {'sleep 30' if rc == 124 else f'exit {rc}'} ;;\n" for v, rc in smoke_rc.items())
    _script(
        tmp_path / "scripts" / "torch_matrix.sh",
        f'echo "torch_matrix.sh $*" >> {calls}\ncase "$2" in\n{cases}esac\nexit 0\n',
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT), "SMOKE_LIMIT": str(limit)}
    out = subprocess.run(["bash", str(tmp_path / ".ci" / "run")], env=env, capture_output=True, text=True, timeout=120)
    return out.returncode, out.stdout + out.stderr, calls.read_text().splitlines()


def test_ci_passes_when_every_part_passes(tmp_path):
    # The negative control: the stand-ins pass, so does CI, having run every part in order.
    rc, out, calls = _ci(tmp_path, 0, {})
    assert rc == 0, out
    smokes = [f"torch_matrix.sh --smoke-only {v}" for v in (OLDEST, NEWEST)]
    assert calls == ["run_tests.sh ", *smokes]
    assert "failed" not in out


@pytest.mark.parametrize("version", [OLDEST, NEWEST])
def test_a_failed_smoke_fails_ci_and_is_named(tmp_path, version):
    rc, out, calls = _ci(tmp_path, 0, {version: 1})
    assert rc != 0
    assert f"torch {version}: smoke failed (exit 1)" in out
    assert len(calls) == 3  # the other smoke still ran


def test_a_failed_suite_fails_ci_and_the_smokes_still_run(tmp_path):
    rc, out, calls = _ci(tmp_path, 1, {})
    assert rc != 0
    assert calls[1:] == [f"torch_matrix.sh --smoke-only {OLDEST}", f"torch_matrix.sh --smoke-only {NEWEST}"]


def test_a_smoke_over_its_limit_fails_ci_and_is_named(tmp_path):
    rc, out, _ = _ci(tmp_path, 0, {NEWEST: 124}, limit=1)
    assert rc != 0
    assert f"torch {NEWEST}: smoke stopped after 1 s (set-up included)" in out


def test_torch_matrix_smoke_exits_non_zero_when_its_run_fails(tmp_path):
    # A cached side environment whose Python answers the matrix's own questions but has no torch to train
    # with: the 2-rank run fails, and so does the script, with its summary line naming the release.
    release = NEWEST if NEWEST.count(".") == 2 else NEWEST + ".0"  # the folder the script names
    env_dir = tmp_path / f"torch-{release}"
    _script(
        env_dir / "bin" / "python",
        'case "$*" in\n'
        f'  *"print(torch.__version__)"*) echo {NEWEST} ;;\n'
        '  *"import torch"*|*deps.py*) exit 0 ;;\n'
        '  *) echo "stand-in python: no torch" >&2; exit 1 ;;\n'
        "esac\n",
    )
    # Should the script not find the stand-in, it must not reach a package index to build a real one.
    env = {**os.environ, "TITANLITE_MATRIX_DIR": str(tmp_path), "PIP_NO_INDEX": "1"}
    out = subprocess.run(
        [str(ROOT / "scripts" / "torch_matrix.sh"), "--smoke-only", NEWEST],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode != 0, out.stdout + out.stderr
    assert "building" not in out.stderr
    summary = out.stdout.strip().splitlines()[-1]
    assert summary.startswith(f"torch {NEWEST}: 2-rank compiled bucketed run_train.sh: exit "), summary
    assert not summary.startswith(f"torch {NEWEST}: 2-rank compiled bucketed run_train.sh: exit 0,")


SUITE_EXTRAS = {"run_tests.sh": r"^TITANLITE_EXTRAS=(\S+)$", "scripts/torch_matrix.sh": r"^EXTRAS=\(--extras (\S+)\)$"}
"""Where each script that runs the suite names the extras it installs."""


def uninstalled(script: str, pattern: str) -> set[str]:
    """pyproject.toml's extras that `script` (its text) leaves out: an extra counts as installed when each of
    its requirements comes with one the script names (the `data` extra's zstandard comes with `dev`)."""
    optional = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    named = re.search(pattern, script, re.MULTILINE)
    installed = {r for extra in (named.group(1).split(",") if named else []) for r in optional.get(extra, [])}
    return {extra for extra, requirements in optional.items() if not set(requirements) <= installed}


@pytest.mark.parametrize("script", sorted(SUITE_EXTRAS))
def test_the_suite_installs_every_extra_so_every_optional_feature_is_tested(script):
    text = (ROOT / script).read_text()
    assert not uninstalled(text, SUITE_EXTRAS[script])
    # The negative control: the script without its `ft` would leave torchft, so the replica groups, untested.
    assert uninstalled(text.replace("float8,ft", "float8"), SUITE_EXTRAS[script]) == {"ft"}
