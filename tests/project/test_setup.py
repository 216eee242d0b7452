"""The set-up (scripts/env.sh, scripts/deps.py) and the launch's environment checks (run_train.sh,
titanlite/tools/visible_gpus.py, titanlite/torch_support.py), without network: an existing environment is
used as it is, what it lacks comes from a wheel folder or is one line within seconds, a torch outside the
supported range or a CPU torch on a GPU node is one line and exit code 2 before any rank starts."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
import torch
from packaging.requirements import Requirement

from harness import ROOT, child_env

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib
from titanlite import torch_support
from titanlite.config import load_config
from titanlite.errors import ConfigError
from titanlite.planning.run_plan import RunPlan

OFFLINE = {
    "PIP_NO_INDEX": "1",
    "PIP_INDEX_URL": "http://127.0.0.1:9",
    "PIP_FIND_LINKS": "",
    "PIP_CONFIG_FILE": os.devnull,
}
"""pip with no index to ask (a port that refuses at once) and no wheel cache, and none of the machine's pip
configuration files (a `find-links` there, holding torch, would let the resolution succeed and a real
install start)."""


def checkout(tmp_path: Path, dependencies: list[str] | None = None) -> Path:
    """The set-up's files in a fresh folder; `dependencies` replace pyproject.toml's runtime requirements."""
    root = tmp_path / "checkout"
    for rel in (
        "scripts/env.sh",
        "scripts/deps.py",
        "titanlite/__init__.py",
        "titanlite/torch_support.py",
        "titanlite/tools/__init__.py",
        "titanlite/tools/visible_gpus.py",
    ):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / rel, root / rel)
    shutil.copy(ROOT / "titanlite" / "errors.py", root / "titanlite" / "errors.py")
    text = (ROOT / "pyproject.toml").read_text()
    if dependencies is not None:
        start = text.index("dependencies = [")
        end = text.index("]", start) + 1
        text = text[:start] + "dependencies = [" + ", ".join(f'"{d}"' for d in dependencies) + "]" + text[end:]
    (root / "pyproject.toml").write_text(text)
    return root


def wheel(folder: Path, name: str, version: str, requires: tuple[str, ...] = ()) -> None:
    """A pure-Python wheel holding a module named like the distribution."""
    module = name.replace("-", "_")
    info = f"{module}-{version}.dist-info"
    folder.mkdir(parents=True, exist_ok=True)
    files = {
        f"{module}/__init__.py": f"VERSION = {version!r}\n",
        f"{info}/METADATA": "".join(
            [f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n", *(f"Requires-Dist: {r}\n" for r in requires)]
        ),
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    files[f"{info}/RECORD"] = "".join(f"{path},,\n" for path in [*files, f"{info}/RECORD"])
    with zipfile.ZipFile(folder / f"{module}-{version}-py3-none-any.whl", "w") as z:
        for path, text in files.items():
            z.writestr(path, text)


def fake_torch(folder: Path, version: str, cuda: str | None = None) -> Path:
    """A torch that the set-up and the launch check read (torch/version.py) without importing it."""
    (folder / "torch").mkdir(parents=True)
    (folder / "torch" / "__init__.py").write_text("")
    (folder / "torch" / "version.py").write_text(f"__version__ = {version!r}\ncuda = {cuda!r}\nhip = None\n")
    return folder


def run_env_sh(root: Path, timeout: float = 120, **env: str) -> tuple[subprocess.CompletedProcess, float]:
    environ = child_env(PYTHON=sys.executable)
    environ.pop("TITANLITE_WHEELHOUSE", None)
    environ.update(env)
    start = time.perf_counter()
    proc = subprocess.run(
        ["bash", "scripts/env.sh"], cwd=root, env=environ, capture_output=True, text=True, timeout=timeout
    )
    return proc, time.perf_counter() - start


@pytest.mark.slow  # pip in a subprocess
def test_an_environment_lacking_a_package_gets_it_from_the_wheel_folder_into_the_checkout_alone(tmp_path):
    # torch counts as there (this Python's); probe-a needs probe-b, and torch, which is never installed.
    root = checkout(tmp_path, ["torch>=2.11,<2.16", "titanlite-probe-a>=1.0"])
    # The wheel folder beside the checkout's files, as copied onto a GPU machine without internet.
    wheel(root / ".wheelhouse", "titanlite-probe-a", "1.0", ("titanlite-probe-b", "torch>=2"))
    wheel(root / ".wheelhouse", "titanlite-probe-b", "2.0")
    proc, _ = run_env_sh(root, **OFFLINE)
    assert proc.returncode == 0, proc.stderr
    overlay = next((root / ".deps").iterdir())
    assert proc.stderr.splitlines() == [
        f"titanlite: installing into {overlay}: titanlite-probe-a 1.0, titanlite-probe-b 2.0"
    ]
    assert proc.stdout == f"titanlite: environment ready: {sys.executable} (with {overlay})\n"
    assert sorted(p.name for p in overlay.iterdir() if p.suffix != ".dist-info") == [
        ".titanlite-deps",
        "titanlite_probe_a",
        "titanlite_probe_b",
    ]
    assert not (root / ".venv").exists()
    # The next launch finds everything at once (nothing to install, no pip), and without the wheel folder.
    shutil.rmtree(root / ".wheelhouse")
    proc, seconds = run_env_sh(root, **OFFLINE)
    assert proc.returncode == 0 and proc.stderr == "" and f"(with {overlay})" in proc.stdout
    assert seconds < 5


@pytest.mark.slow  # pip in a subprocess
def test_a_missing_package_offline_is_one_line_within_seconds(tmp_path):
    root = checkout(tmp_path, ["torch>=2.11,<2.16", "titanlite-probe-a>=1.0"])
    (tmp_path / "empty").mkdir()
    given, beside = f"the wheel folder {tmp_path / 'empty'}: ", f"the wheel folder {root / '.wheelhouse'}: "
    for env, tried in (
        ({"TITANLITE_WHEELHOUSE": str(tmp_path / "empty")}, [given]),  # the only source
        ({}, ["the package index: "]),
        ({"MAKE_BESIDE": "1"}, [beside, "the package index: "]),  # the checkout's folder first, then the index
    ):
        if env.pop("MAKE_BESIDE", None):
            (root / ".wheelhouse").mkdir()
        proc, seconds = run_env_sh(root, **OFFLINE, **env)
        assert proc.returncode == 2 and proc.stdout == ""
        assert len(proc.stderr.splitlines()) == 1, proc.stderr
        assert proc.stderr.startswith(f"titanlite: error: cannot install titanlite-probe-a for {sys.executable}: ")
        assert [t in proc.stderr for t in (given, beside, "the package index: ")].count(True) == len(tried)
        assert all(t in proc.stderr for t in tried) and "run `scripts/wheelhouse.sh .wheelhouse`" in proc.stderr
        assert seconds < 20
    assert not (root / ".venv").exists() and not list((root / ".deps").glob("*/titanlite_probe_a"))


def test_a_torch_outside_the_range_or_missing_is_refused_never_reinstalled(tmp_path):
    root = checkout(tmp_path)
    old = fake_torch(tmp_path / "old", "2.9.1+cu128", "12.8")
    proc, _ = run_env_sh(root, PYTHONPATH=str(old), **OFFLINE)
    assert proc.returncode == 2 and proc.stderr == (
        f"titanlite: error: torch 2.9.1+cu128 is older than 2.11, the oldest supported (supported: 2.11 to 2.15), "
        f"in {sys.executable}: upgrade torch there, or leave PYTHON unset to use .venv\n"
    )
    # A newer torch than the newest tested runs, with a warning.
    new = fake_torch(tmp_path / "new", "2.16.0+cu132", "13.2")
    proc, _ = run_env_sh(root, PYTHONPATH=str(new), **OFFLINE)
    assert proc.returncode == 0, proc.stderr
    assert (
        proc.stderr
        == "titanlite: warning: torch 2.16.0+cu132 is newer than 2.15, the newest tested (supported: 2.11 to 2.15)\n"
    )
    assert not (root / ".venv").exists()


def test_setup_inside_a_slurm_job_is_one_line_and_exit_2(tmp_path):
    root = checkout(tmp_path)
    # No PYTHON, no active environment, and a python3 without torch: the set-up would create .venv.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text(f'#!/bin/sh\nexec {sys.executable} -S "$@"\n')  # -S: no site-packages
    (bin_dir / "python3").chmod(0o755)
    env = child_env(SLURM_JOB_ID="1234", PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    for key in ("PYTHON", "VIRTUAL_ENV", "CONDA_PREFIX"):
        env.pop(key, None)
    proc = subprocess.run(["bash", "scripts/env.sh"], cwd=root, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr == (
        f"titanlite: error: {root}/.venv is not set up; run 'bash scripts/env.sh' once on a login node, "
        "then submit the job\n"
    )
    assert not (root / ".venv").exists()


def test_pyproject_states_the_supported_torch_range():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    (torch_req,) = [r for r in map(Requirement, project["dependencies"]) if r.name == "torch"]
    lo, hi = torch_support.OLDEST, torch_support.NEWEST
    assert torch_req.specifier.contains(f"{lo[0]}.{lo[1]}.0") and torch_req.specifier.contains(f"{hi[0]}.{hi[1]}.9")
    assert not torch_req.specifier.contains(f"{lo[0]}.{lo[1] - 1}.9")
    assert not torch_req.specifier.contains(f"{hi[0]}.{hi[1] + 1}.0")
    assert torch_support.release(torch_support.SETUP_VERSION) >= lo


def test_a_feature_newer_than_the_running_torch_is_one_config_error_naming_the_release(monkeypatch):
    auto = load_config(["--compile.enable", "--compile.bucketing", "auto"])
    block = load_config(["--compile.enable", "--compile.bucketing", "transformer_block"])
    with pytest.raises(
        ConfigError, match=r"^compile.bucketing = auto needs torch 2.13 or newer \(.*\); this is torch 2.11.0"
    ):
        torch_support.check(auto, "2.11.0+cu130")
    torch_support.check(auto, "2.13.0+cpu")
    torch_support.check(block, "2.11.0+cu130")
    # Through the plan every entry point builds (the launcher's preflight, the ranks, the dry run).
    monkeypatch.setattr(torch, "__version__", "2.12.1")
    with pytest.raises(ConfigError, match="this is torch 2.12.1"):
        RunPlan.build(auto, 2)


def run_train(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "nvidia-smi").write_text('#!/bin/sh\nfor i in 0 1; do echo "GPU $i: NVIDIA H100 (UUID: GPU-$i)"; done\n')
    (bin_dir / "nvidia-smi").chmod(0o755)
    environ = child_env(PYTHON=sys.executable, **env)
    environ["PATH"] = f"{bin_dir}{os.pathsep}{environ['PATH']}"
    for key in [k for k in environ if k.startswith("SLURM_")] + ["NGPU", "CUDA_VISIBLE_DEVICES"]:
        environ.pop(key, None)
    environ.update(env)
    return subprocess.run(
        [str(ROOT / "run_train.sh"), "--job.dump_folder", str(tmp_path / "dump"), *args],
        env=environ,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_cpu_torch_on_a_gpu_node_is_one_line_and_exit_2_before_any_rank(tmp_path):
    cpu_torch = str(fake_torch(tmp_path / "site", "2.11.0+cpu"))
    want = (
        "titanlite: error: nvidia-smi lists 2 GPU(s) but torch 2.11.0+cpu is a CPU build: every rank would train "
        "on CPU. Install a CUDA build of torch (titanlite's .venv: `TITANLITE_TORCH=cuda bash scripts/env.sh`), "
        "or set TITANLITE_DEVICE=cpu to train on CPU on purpose\n"
    )
    for ngpu in ({}, {"NGPU": "2"}):
        start = time.perf_counter()
        proc = run_train(tmp_path, PYTHONPATH=f"{ROOT}{os.pathsep}{cpu_torch}", **ngpu)
        assert (proc.returncode, proc.stdout, proc.stderr) == (2, "", want)
        assert time.perf_counter() - start < 10  # torch is not imported for the check
    assert not (tmp_path / "dump").exists()
    # SLURM's allocation says so too where nvidia-smi is not on PATH.
    proc = run_train(
        tmp_path, PYTHONPATH=f"{ROOT}{os.pathsep}{cpu_torch}", PATH="/usr/bin:/bin", SLURM_GPUS_ON_NODE="4"
    )
    assert proc.returncode == 2 and proc.stderr.startswith("titanlite: error: SLURM allocated 4 GPU(s) but torch")
    proc = run_train(tmp_path, PYTHONPATH=f"{ROOT}{os.pathsep}{cpu_torch}", TITANLITE_DEVICE="gpu")
    assert (proc.returncode, proc.stderr) == (2, "titanlite: error: TITANLITE_DEVICE must be cpu or auto, got 'gpu'\n")


@pytest.mark.slow
def test_cpu_on_purpose_on_a_gpu_node_launches_with_the_gpus_hidden(tmp_path):
    proc = run_train(tmp_path, TITANLITE_DEVICE="cpu", DRY_LAUNCH="1", MAX_RESTARTS="0")
    assert proc.returncode == 0 and "--nproc_per_node=2 " in proc.stdout, proc.stdout + proc.stderr


def test_config_mistakes_are_one_line_and_exit_2(tmp_path):
    for args, line in (
        (["--config"], "--config needs a TOML file"),
        (["--config", "--dry-run"], "--config needs a TOML file"),
        (["--config", str(tmp_path)], f"--config {tmp_path} is a folder; give a TOML file such as "),
    ):
        proc = run_train(tmp_path, *args)
        assert proc.returncode == 2 and proc.stdout == "", args
        assert proc.stderr.startswith(f"titanlite: error: {line}") and proc.stderr.count("\n") == 1, proc.stderr


def own_venv_without_torch(root: Path) -> Path:
    """`root`'s .venv as a bare venv of the base Python, seeing its site-packages (pip) but no torch."""
    venv = root / ".venv"
    subprocess.run(
        [sys._base_executable, "-m", "venv", "--without-pip", "--system-site-packages", str(venv)], check=True
    )
    has = subprocess.run(
        [
            str(venv / "bin" / "python"),
            "-c",
            "import importlib.util as u; print(u.find_spec('torch'), u.find_spec('pip'))",
        ],
        capture_output=True,
        text=True,
    ).stdout.split()
    if has[0] != "None" or has[1] == "None":
        pytest.skip(f"the base Python {sys._base_executable} has torch, or no pip: {has}")
    return venv


def test_a_bad_torch_choice_is_one_line_naming_the_variable_whatever_the_python(tmp_path):
    """TITANLITE_TORCH is checked before anything is chosen or created: with a user's Python, with a
    .venv that exists, and on a fresh machine (where a .venv would be created first)."""
    want = "titanlite: error: TITANLITE_TORCH must be auto, cpu or cuda, got 'bogus'\n"
    root = checkout(tmp_path)
    proc, _ = run_env_sh(root, TITANLITE_TORCH="bogus", **OFFLINE)
    assert (proc.returncode, proc.stdout, proc.stderr) == (2, "", want)
    # No PYTHON, no active environment, a python3 without torch: a fresh machine.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text(f'#!/bin/sh\nexec {sys._base_executable} -S "$@"\n')
    (bin_dir / "python3").chmod(0o755)
    env = child_env(TITANLITE_TORCH="bogus", PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", **OFFLINE)
    for key in ("PYTHON", "VIRTUAL_ENV", "CONDA_PREFIX"):
        env.pop(key, None)
    fresh = subprocess.run(["bash", "scripts/env.sh"], cwd=root, env=env, capture_output=True, text=True, timeout=120)
    assert (fresh.returncode, fresh.stdout, fresh.stderr) == (2, "", want)
    assert not (root / ".venv").exists()
    own_venv_without_torch(root)  # a .venv that exists
    proc = subprocess.run(["bash", "scripts/env.sh"], cwd=root, env=env, capture_output=True, text=True, timeout=120)
    assert (proc.returncode, proc.stdout, proc.stderr) == (2, "", want)


def test_an_active_environment_with_an_unsupported_torch_is_told_to_deactivate_not_to_unset_python(tmp_path):
    root = checkout(tmp_path)
    old = fake_torch(tmp_path / "old", "2.9.1+cu128", "12.8")
    bin_dir = tmp_path / "active" / "bin"  # an activated virtualenv: its python first on PATH
    bin_dir.mkdir(parents=True)
    (bin_dir / "python").symlink_to(sys.executable)
    env = child_env(
        VIRTUAL_ENV=str(bin_dir.parent), PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", PYTHONPATH=str(old)
    )
    env.pop("PYTHON", None)
    env.update(OFFLINE)
    proc = subprocess.run(["bash", "scripts/env.sh"], cwd=root, env=env, capture_output=True, text=True, timeout=60)
    assert (proc.returncode, proc.stderr) == (
        2,
        f"titanlite: error: torch 2.9.1+cu128 is older than 2.11, the oldest supported (supported: 2.11 to 2.15), "
        f"in {bin_dir / 'python'}: upgrade torch there, or deactivate that environment (`deactivate`, "
        "`conda deactivate`) to use .venv\n",
    )


@pytest.mark.slow  # pip in a subprocess
def test_torch_is_announced_once_however_many_sources_are_tried(tmp_path):
    """The own .venv lacks torch; the checkout's wheel folder has no torch and the index is unreachable:
    both sources are tried, torch is announced once and the failure names torch first."""
    root = checkout(tmp_path)
    venv = own_venv_without_torch(root)
    (root / ".wheelhouse").mkdir()
    env = child_env(TITANLITE_TORCH="cpu", **OFFLINE)
    for key in ("PYTHON", "VIRTUAL_ENV", "CONDA_PREFIX", "TITANLITE_WHEELHOUSE"):
        env.pop(key, None)
    proc = subprocess.run(["bash", "scripts/env.sh"], cwd=root, env=env, capture_output=True, text=True, timeout=120)
    lines = proc.stderr.splitlines()
    assert proc.returncode == 2 and len(lines) == 2, proc.stderr
    assert lines[0] == f"titanlite: installing torch {torch_support.SETUP_VERSION} (CPU build) into {venv}", lines
    assert lines[1].startswith("titanlite: error: cannot install torch, torchdata, ") and ".wheelhouse: " in lines[1]


@pytest.mark.parametrize("handler", ["deps.stop", "lambda signum, frame: sys.exit(128 + signum)"])
def test_a_second_stop_signal_while_the_setup_check_exits_prints_nothing(handler):
    """A stop signal to run_train.sh's process group reaches scripts/deps.py twice (from the group, then
    from the shell's trap); the second may land while the interpreter shuts down (simulated by an atexit
    callback). deps.stop exits 143 silently; a handler that raises again (the negative control) prints a
    traceback into the user's one line."""
    code = (
        "import atexit, os, signal, sys; sys.path.insert(0, 'scripts'); import deps; "
        f"signal.signal(signal.SIGTERM, {handler}); "
        "atexit.register(lambda: os.kill(os.getpid(), signal.SIGTERM)); os.kill(os.getpid(), signal.SIGTERM)"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 143
    if handler == "deps.stop":
        assert proc.stderr == ""
    else:
        assert "SystemExit: 143" in proc.stderr
