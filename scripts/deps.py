"""What titanlite needs of a Python environment, and how the missing part is brought without touching the rest.

Run with the Python in question; it uses the standard library and pip only (it imports neither torch nor
anything of titanlite that does), so it answers in a fraction of a second where nothing is missing.

    deps.py ensure [--extras dev,hf] [--own-venv]
        This Python's torch must be a supported release (titanlite/torch_support.py); the requirements of
        pyproject.toml (and of the extras) that are missing are installed. Where the Python is titanlite's
        own .venv (--own-venv) they go into it, and torch too if it has none (TITANLITE_TORCH=cpu|cuda
        chooses the build; by default CUDA where nvidia-smi lists GPUs). Any other environment is used as it
        is: the missing packages go into a folder of the checkout, .deps/<python>, printed on stdout for
        PYTHONPATH; its torch is never reinstalled and nothing in it is upgraded.
    deps.py wheelhouse DIR [--python-version 3.12] [--platform TAG ...] [--extras E] [--have FILE] [--torch SPEC]
        Download the wheels that `ensure` would install, for another machine (see scripts/wheelhouse.sh).

Sources: a wheel folder when TITANLITE_WHEELHOUSE names one or the checkout has `.wheelhouse/` (then no
index is asked), else pip's own configuration. The first request to it has a 5 s timeout and no retry: an
unreachable index or a folder without a needed wheel is one line naming what is missing, within seconds.

pip resolves; what is reached only through torch (torchdata -> torch -> its CUDA libraries) is never
installed.
"""

from __future__ import annotations

import argparse
import importlib.metadata as metadata
import importlib.util
import json
import os
import platform
import re
import runpy
import signal
import subprocess
import sys
import tempfile
import zlib
from pathlib import Path

try:
    from packaging.markers import default_environment
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
except ImportError:  # pip carries its own copy
    from pip._vendor.packaging.markers import default_environment
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from titanlite import torch_support  # noqa: E402  (stdlib only; the checkout is not installed)
from titanlite.tools.visible_gpus import listed_gpus  # noqa: E402  (stdlib only)

STAMP = ".titanlite-deps"
QUICK = ["--timeout", "5", "--retries", "0"]
"""The first request: an index that does not answer at once is taken as unreachable."""
CPU_TORCH_INDEX = [
    "--index-url",
    "https://download.pytorch.org/whl/cpu",
    "--extra-index-url",
    "https://pypi.org/simple",
]
MANYLINUX = ["manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64"]


class SetupError(Exception):
    """One line for the user; exit code 2."""


class NeedsInstall(Exception):
    """`ensure --check`: something is missing (exit code 3); nothing was installed."""


# --- what is needed, what is there --------------------------------------------------------------------------


def pyproject() -> dict:
    try:
        import tomllib
    except ImportError:  # Python 3.10
        try:
            import tomli as tomllib
        except ImportError:
            from pip._vendor import tomli as tomllib
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]


def requirements(extras: list[str], env: dict[str, str] | None = None) -> list[Requirement]:
    """The core requirements and those of `extras` whose markers hold for `env` (default: this Python)."""
    project = pyproject()
    optional = project.get("optional-dependencies", {})
    if unknown := [e for e in extras if e not in optional]:
        raise SetupError(f"unknown extra {', '.join(unknown)} (pyproject.toml has {', '.join(optional)})")
    reqs = [Requirement(r) for r in project["dependencies"] + [r for e in extras for r in optional[e]]]
    env = env or default_environment()
    return [r for r in reqs if r.marker is None or r.marker.evaluate({**env, "extra": ""})]


def installed_version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def missing(reqs: list[Requirement]) -> list[Requirement]:
    """The requirements (torch aside) that no installed distribution satisfies."""
    out = []
    for r in reqs:
        if canonicalize_name(r.name) == "torch":
            continue
        have = installed_version(r.name)
        if have is None or not r.specifier.contains(have, prereleases=True):
            out.append(r)
    return out


def torch_build() -> dict[str, str | None] | None:
    """torch's version and CUDA/ROCm versions from torch/version.py, without importing torch (seconds)."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return None
    version = Path(list(spec.submodule_search_locations)[0]) / "version.py"
    if not version.exists():
        return {"torch": installed_version("torch") or "unknown", "cuda": None, "hip": None}
    v = runpy.run_path(str(version))
    return {"torch": v.get("__version__", "unknown"), "cuda": v.get("cuda"), "hip": v.get("hip")}


def overlay_dir() -> Path:
    """The folder of packages this Python lacks: one per environment (sys.prefix) and Python version."""
    key = zlib.crc32(os.path.realpath(sys.prefix).encode()) & 0xFFFFFFFF
    v = sys.version_info
    return ROOT / ".deps" / f"py{v.major}.{v.minor}-{platform.machine()}-{key:08x}"


def sources() -> list[Path | None]:
    """Where packages come from, in order: a wheel folder (no index is asked), None for pip's own index.
    TITANLITE_WHEELHOUSE is the only source; a .wheelhouse/ folder in the checkout comes before the index."""
    given = os.environ.get("TITANLITE_WHEELHOUSE")
    if given:
        if not Path(given).is_dir():
            raise SetupError(f"TITANLITE_WHEELHOUSE={given} is not a folder")
        return [Path(given).resolve()]
    default = ROOT / ".wheelhouse"
    return [default, None] if default.is_dir() else [None]


# --- pip -----------------------------------------------------------------------------------------------------


def pip(args: list[str], source: list[str], quick: bool = False) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "pip", *args, "--disable-pip-version-check", "--no-input", *source]
    return subprocess.run(cmd + (QUICK if quick else []), capture_output=True, text=True)


def pip_error(proc: subprocess.CompletedProcess) -> str:
    """pip's own reason in one line: its first ERROR line (the ones after it are advice)."""
    lines = [ln.strip() for ln in (proc.stderr + proc.stdout).splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("ERROR:")]
    line = errors[0] if errors else (lines[-1] if lines else f"pip exited with code {proc.returncode}")
    return line.removeprefix("ERROR: ")[:300]


def source_options(wheels: Path | None) -> list[str]:
    return ["--no-index", "--find-links", str(wheels)] if wheels else []


HOW_TO_BRING = (
    "without internet, run `scripts/wheelhouse.sh .wheelhouse` on a machine with it (--python-version, --have: "
    "see the script), copy .wheelhouse/ into this checkout or set TITANLITE_WHEELHOUSE=DIR"
)


def resolve(roots: list[str], source: list[str], target: list[str], quick: bool) -> list[dict]:
    """pip's resolution of `roots` (with their dependencies) as installation-report items; `target` holds
    the platform options for another machine (empty: this environment, whose installed packages count)."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        dry = ["install", "--dry-run", "--quiet", "--report", str(report)]
        if target:
            dry += ["--ignore-installed", "--target", str(Path(tmp) / "t"), *target]
        proc = pip([*dry, *roots], source, quick=quick)
        if proc.returncode != 0:
            raise SetupError(pip_error(proc))
        return json.loads(report.read_text())["install"]


def plan(
    roots: list[Requirement], source: list[str], target: list[str], env: dict[str, str], keep_torch: bool = False
) -> list[tuple[str, str]]:
    """(name, version) of every distribution to install for `roots`: pip's resolution, less torch and what is
    reached only through torch (its CUDA libraries) unless `keep_torch`."""
    if not roots:
        return []
    wanted = [unmarked(r) for r in roots]
    items = reachable(resolve(wanted, source, target, quick=True), wanted, set() if keep_torch else {"torch"}, env)
    return sorted((i["metadata"]["name"], i["metadata"]["version"]) for i in items)


def unmarked(r: Requirement) -> str:
    """The requirement without its marker, which was evaluated for the target (pip would use this Python)."""
    extras = f"[{','.join(sorted(r.extras))}]" if r.extras else ""
    return f"{r.name}{extras}{r.specifier}"


def reachable(items: list[dict], roots: list[str], skip: set[str], env: dict[str, str]) -> list[dict]:
    """The report items that `roots` need without passing through a name in `skip` (extras followed)."""
    by_name = {canonicalize_name(i["metadata"]["name"]): i for i in items}
    seen: dict[str, set[str]] = {}
    todo = [Requirement(r) for r in roots]
    while todo:
        r = todo.pop()
        name = canonicalize_name(r.name)
        if name in skip or name not in by_name or (name in seen and set(r.extras) <= seen[name]):
            continue
        extras = seen[name] = seen.get(name, set()) | set(r.extras)
        for text in by_name[name]["metadata"].get("requires_dist") or []:
            dep = Requirement(text)
            if dep.marker is None or any(dep.marker.evaluate({**env, "extra": e}) for e in {"", *extras}):
                todo.append(dep)
    return [by_name[n] for n in seen]


# --- ensure ---------------------------------------------------------------------------------------------------


def say(line: str) -> None:
    print(f"titanlite: {line}", file=sys.stderr, flush=True)


TORCH_CHOICES = ("auto", "cpu", "cuda")

OTHER_PYTHON = {
    "variable": "or leave PYTHON unset to use .venv",
    "active": "or deactivate that environment (`deactivate`, `conda deactivate`) to use .venv",
    "path": "or set PYTHON to a Python that has a supported torch",
}
"""The way out of an unusable torch, by where env.sh found the Python (`--python-from`)."""


def torch_choice() -> str:
    """TITANLITE_TORCH: the torch build for titanlite's own .venv (auto: CUDA where nvidia-smi lists GPUs)."""
    choice = os.environ.get("TITANLITE_TORCH", "auto")
    if choice not in TORCH_CHOICES:
        raise SetupError(f"TITANLITE_TORCH must be auto, cpu or cuda, got '{choice}'")
    return choice


def check_torch(own_venv: bool, python_from: str) -> dict[str, str | None] | None:
    """The torch build; None where titanlite's own .venv has no usable torch (it is installed then)."""
    wanted = torch_choice()
    build = torch_build()
    if build is None:
        if own_venv:
            return None
        raise SetupError(
            f"{sys.executable} has no torch: install torch {torch_support.range_text()} (a CUDA or CPU build) "
            "into it, or leave PYTHON unset and run_train.sh sets up .venv"
        )
    if own_venv and (wanted, build["cuda"] is None) in (("cuda", True), ("cpu", False)):
        return None  # the other build was asked for: replaced
    if why := torch_support.problem(build["torch"]):
        if own_venv:
            return None
        raise SetupError(f"{why}, in {sys.executable}: upgrade torch there, {OTHER_PYTHON[python_from]}")
    if warn := torch_support.warning(build["torch"]):
        say(f"warning: {warn}")
    return build


def wants_cuda() -> bool:
    choice = torch_choice()
    return choice == "cuda" or (choice == "auto" and listed_gpus() > 0)


def install_torch(source: list[str], cuda: bool) -> None:
    """torch for titanlite's own .venv: the CUDA build where GPUs are (or TITANLITE_TORCH=cuda: a cluster's
    login node), else the CPU build, which is a tenth of the size."""
    v = torch_support.SETUP_VERSION
    install = ["install", "--quiet"]
    if cuda:
        attempts = [[f"torch=={v}"]]
    elif source:  # a wheel folder
        attempts = [[f"torch=={v}+cpu"]]
    else:  # from a local wheel cache if pip is configured with one, else PyTorch's CPU index
        attempts = [[f"torch=={v}+cpu"], [f"torch=={v}+cpu", *CPU_TORCH_INDEX]]
    why = ""
    for args in attempts:
        try:  # the index pages only, with the quick settings: offline, this answers within seconds
            resolve(["--no-deps", *args], source, [], quick=True)
        except SetupError as e:
            why = str(e)
            continue
        if torch_build() is not None:  # the other build, or an unsupported release (pip takes 2.13.0+cpu for 2.13.0)
            pip(["uninstall", "--quiet", "--yes", "torch"], [])
        proc = pip([*install, *args], source)
        if proc.returncode == 0:
            return
        why = pip_error(proc)
    raise SetupError(f"torch {v}: {why}")


def ensure(extras: list[str], own_venv: bool, check_only: bool = False, python_from: str = "variable") -> str:
    """Make this Python ready; returns the overlay folder to put on PYTHONPATH ('' for none). `python_from`
    says how env.sh found a Python other than the own .venv (`OTHER_PYTHON`)."""
    overlay = overlay_dir()
    if not own_venv and overlay.is_dir():
        sys.path.insert(0, str(overlay))  # what an earlier run installed there counts as installed
    build = check_torch(own_venv, python_from)
    reqs = requirements(extras)
    lacking = missing(reqs)
    if build is not None and not lacking:
        return str(overlay) if not own_venv and overlay.is_dir() else ""
    names = ", ".join(["torch"] * (build is None) + [r.name for r in lacking])
    if check_only:
        raise NeedsInstall(names)
    if importlib.util.find_spec("pip") is None:
        raise SetupError(f"{sys.executable} lacks {names} and has no pip to install them: install them into it")
    cuda = build is None and wants_cuda()
    if build is None:  # said once, whichever source has it
        say(f"installing torch {torch_support.SETUP_VERSION} ({'CUDA' if cuda else 'CPU'} build) into {sys.prefix}")
    failures = []
    for wheels in sources():
        source = source_options(wheels)
        try:
            if build is None:
                install_torch(source, cuda)
                build = torch_build()
            pins = plan(lacking, source, [], default_environment())
            break
        except SetupError as e:
            failures.append(f"{f'the wheel folder {wheels}' if wheels else 'the package index'}: {e}")
    else:
        raise SetupError(f"cannot install {names} for {sys.executable}: {'; '.join(failures)}; {HOW_TO_BRING}")
    where = sys.prefix if own_venv else str(overlay)
    if pins:
        say(f"installing into {where}: {', '.join(f'{n} {v}' for n, v in pins)}")
        target = [] if own_venv else ["--target", str(overlay), "--upgrade"]
        proc = pip(["install", "--quiet", "--no-deps", *target, *(f"{n}=={v}" for n, v in pins)], source)
        if proc.returncode != 0:
            raise SetupError(f"cannot install {names} into {where}: {pip_error(proc)}")
    stamp = Path(sys.prefix if own_venv else overlay) / STAMP
    stamp.parent.mkdir(parents=True, exist_ok=True)
    try:  # what earlier set-ups installed stays on record
        before = json.loads(stamp.read_text())
    except (OSError, ValueError):
        before = {}
    record = {
        "python": sys.version.split()[0],
        "torch": build["torch"],
        "torch_cuda": build["cuda"],
        "extras": sorted(set(before.get("extras", [])) | set(extras)),
        "installed": {**before.get("installed", {}), **dict(pins)},
    }
    stamp.write_text(json.dumps(record, indent=1) + "\n")
    return "" if own_venv else str(overlay)


# --- wheelhouse -----------------------------------------------------------------------------------------------


def target_environment(python_version: str) -> dict[str, str]:
    """The marker environment of a Linux x86-64 CPython `python_version` (what the wheels are for)."""
    env = default_environment()
    full = python_version if python_version.count(".") >= 2 else f"{python_version}.0"
    return {**env, "python_version": ".".join(full.split(".")[:2]), "python_full_version": full}


def installed_on_target(path: str) -> dict[str, str | None]:
    """{name: version or None} from a `pip freeze` or `pip list` output, or from names one a line."""
    have: dict[str, str | None] = {}
    for line in Path(path).read_text().splitlines():
        m = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)(?:\s*==\s*|\s+)?([0-9][^\s;]*)?\s*$", line)
        if m and not line.lstrip().startswith(("#", "Package", "---")):
            have[canonicalize_name(m.group(1))] = m.group(2)
    return have


def make_wheelhouse(args: argparse.Namespace) -> None:
    env = target_environment(args.python_version)
    reqs = requirements(args.extras, env)
    reqs = [r for r in reqs if canonicalize_name(r.name) != "torch"]
    if args.torch:
        reqs.append(Requirement(args.torch))
    target = ["--only-binary=:all:", "--implementation", "cp", "--python-version", args.python_version]
    for tag in args.platform or MANYLINUX:
        target += ["--platform", tag]
    have = installed_on_target(args.have) if args.have else {}
    # The target's versions bind the resolution (a wheel that needs a newer version of something the target
    # has would not install there); a list of names only leaves them out of the download.
    pinned = [f"{n}=={v}" for n, v in have.items() if v and "+" not in v and n != "torch"]
    constraints = Path(tempfile.mkdtemp()) / "target.txt"
    constraints.write_text("\n".join(pinned) + "\n")
    target += ["--constraint", str(constraints)]
    pins = [
        (n, v) for n, v in plan(reqs, [], target, env, keep_torch=bool(args.torch)) if canonicalize_name(n) not in have
    ]
    out = Path(args.dir)
    out.mkdir(parents=True, exist_ok=True)
    if pins:
        proc = pip(["download", "--quiet", "--no-deps", "-d", str(out), *target, *(f"{n}=={v}" for n, v in pins)], [])
        if proc.returncode != 0:
            raise SetupError(f"download failed: {pip_error(proc)}")
    size = sum(f.stat().st_size for f in out.glob("*.whl"))
    print(
        f"titanlite: {len(pins)} wheels for Python {args.python_version} in {out} ({size / 2**20:.1f} MiB): "
        + ", ".join(f"{n} {v}" for n, v in pins)
    )


def stop(signum: int, frame: object) -> None:
    """env.sh ends this process with SIGTERM on a stop signal: pip, if running, is ended with it
    (subprocess.run kills its child on the way out), and nothing is printed (the shell prints the one line).
    The signal often comes twice (to the process group, then from the shell's trap): the second is ignored,
    as one raised during the interpreter's shutdown would print a traceback."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    sys.exit(128 + signum)


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGTERM, stop)
    parser = argparse.ArgumentParser(prog="deps.py", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    e = sub.add_parser("ensure")
    e.add_argument("--extras", default="")
    e.add_argument("--own-venv", action="store_true")
    e.add_argument("--python-from", choices=sorted(OTHER_PYTHON), default="variable", help="how env.sh found it")
    e.add_argument("--check", action="store_true", help="install nothing: exit code 3 if something is missing")
    w = sub.add_parser("wheelhouse")
    w.add_argument("dir")
    w.add_argument("--extras", default="")
    w.add_argument("--python-version", default=f"{sys.version_info.major}.{sys.version_info.minor}")
    w.add_argument("--platform", action="append", help=f"wheel platform tag (repeat; default {' '.join(MANYLINUX)})")
    w.add_argument("--have", help="the target's `pip freeze` or names, one a line: those are not downloaded")
    w.add_argument("--torch", help="also torch and what it needs, e.g. torch==2.11.0 (the CUDA build: GBs)")
    args = parser.parse_args(argv)
    args.extras = [x for x in args.extras.split(",") if x]
    try:
        if args.command == "ensure":
            print(ensure(args.extras, args.own_venv, check_only=args.check, python_from=args.python_from))
        else:
            make_wheelhouse(args)
    except SetupError as err:
        print(f"titanlite: error: {err}", file=sys.stderr, flush=True)
        return 2
    except NeedsInstall as lacking:
        print(lacking)
        return 3
    return 0


if __name__ == "__main__":
    code = main(sys.argv[1:])
    # The work is done: a stop signal now would only interrupt the interpreter's shutdown.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    sys.exit(code)
