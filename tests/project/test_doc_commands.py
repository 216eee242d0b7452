"""Every command in README.md and docs/ is run as written, so a documented command cannot rot.

A command is a line of a page's code block (fenced or indented; continuation lines joined) that starts a
program: `./run_train.sh`, `scripts/...`, `python`, `bash`, `sbatch`, after environment assignments and an
optional `$ ` prompt (a transcript: the lines after it up to the next `$ ` are its output, and a comment
`# exit N` its exit code). Each distinct command is handled by the first rule of RULES whose pattern it
contains, in the pages' order:

* `run`: as written, in a shell without this checkout on PYTHONPATH (a fresh shell's), from a checkout
  whose files are this one's but whose `outputs/` is the test's (the configs' dump folders land there;
  `/tmp/demo` is moved there too), with `[optional]` parts left out and the rule's arguments added (a
  training run: `--training.steps 2`). The exit code is the documented one (0 unless the page or the rule
  says otherwise), a transcript's lines are in what it prints, and a refusal prints only those lines.
  Commands of a `chain` (the tools: export, generate, dashboard) run one at a time after its training
  runs, on what they wrote (`seed`: a checkpoint of another run of the chain, copied in first).
* `preflight`: the checks run_train.sh runs before it starts the ranks (titanlite.launcher.preflight: config, run
  plan, mesh of NGPU x NNODES ranks, model, tokenizer, data, folders), with exit code and line checked, for
  the other training commands, all in one process (tests/workers/preflights.py): training them adds
  nothing that the parity tests and the runs above do not check.
* `config`: the config file and every key, as run_train.sh loads them first, in the same process: for
  commands whose run costs more than the suite can spend (the rule says where they are checked).
* `listed`: not run, for the reason the rule gives (a GPU, a cluster, a benchmark, the suite itself).

One `--plan` command's output, shown in full on docs/layout_search.md, is also compared line for line
with what the search prints (test_the_page_shows_what_the_layout_search_prints).

A command that no rule matches fails the unit tier (test_every_documented_command_has_a_rule), so a
command added to a page is run or listed with a reason.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

import pytest

from harness import ROOT, child_env, threads

PAGES = ["README.md", *sorted(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md"))]
# A program a documented command starts, after `$ `, `time ` and VAR=value assignments.
_ENV = r"(?:[A-Z_][A-Z0-9_]*=\S*\s+)*"
_START = re.compile(
    rf"^(?:\$ )?(?:time )?{_ENV}(\./run_train\.sh|\./run_tests\.sh|scripts/\S+|python3?|bash|sbatch)(\s|$)"
)
_EXIT = re.compile(r"#.*\bexit(?: code)? (\d+)")


@dataclass(frozen=True)
class Command:
    page: str
    line: int
    shell: str  # as written, without its prompt and comment
    exit_code: int  # the page's `# exit N`, else 0
    output: tuple[str, ...] = ()  # a transcript's lines after the command

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


@dataclass(frozen=True)
class Rule:
    pattern: str  # a regular expression searched in the command
    how: Literal["run", "preflight", "config", "listed"]
    reason: str
    exit_code: int | None = None  # instead of the page's
    says: str = ""  # a text its output holds
    append: str = ""  # arguments added to the command (`run`)
    chain: str = ""  # commands of one chain use what its training runs wrote: run after them, one at a time
    seed: str = ""  # a dump folder of another command whose checkpoints are copied into this one's first
    last: bool = False  # a training run of a chain that reads what its tools wrote: run after them


def _blocks(text: str) -> list[tuple[int, list[str]]]:
    """(first line number, lines) of each fenced or indented code block of a Markdown page."""
    lines, out, i, blank = text.split("\n"), [], 0, True
    while i < len(lines):
        if lines[i].startswith("```"):
            j = i + 1
            while j < len(lines) and not lines[j].startswith("```"):
                j += 1
            out.append((i + 2, lines[i + 1 : j]))
            i, blank = j + 1, False
        elif blank and lines[i].startswith("    ") and lines[i].strip():
            j = i
            while j < len(lines) and (lines[j].startswith("    ") or not lines[j].strip()):
                j += 1
            out.append((i + 1, [line[4:] for line in lines[i:j]]))
            i = j
        else:
            blank, i = not lines[i].strip(), i + 1
    return out


def _split_comment(line: str) -> tuple[str, str]:
    """(command, comment): the comment starts at a `#` after whitespace, outside quotes."""
    quote = ""
    for k, ch in enumerate(line):
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and k and line[k - 1] in " \t":
            return line[:k].rstrip(), line[k:]
    return line.rstrip(), ""


def page_commands(page: str) -> list[Command]:
    commands: list[Command] = []
    for start, body in _blocks((ROOT / page).read_text()):
        k = 0
        while k < len(body):
            number, line = start + k, body[k]
            while line.rstrip().endswith("\\") and k + 1 < len(body):
                k += 1
                line = line.rstrip()[:-1].rstrip() + " " + body[k].strip()
            k += 1
            if not _START.match(line.strip()):
                continue
            shell, comment = _split_comment(line.strip())
            output: list[str] = []
            if shell.startswith("$ "):
                shell = shell[2:]
                while k < len(body) and not body[k].startswith("$ "):
                    output.append(body[k])
                    k += 1
            exit_code = next((int(m[1]) for m in map(_EXIT.search, [comment, *output]) if m), 0)
            if shell.startswith("time "):  # `time`'s own lines are not the command's output
                shell, output = shell[5:], [o for o in output if not re.match(r"(real|user|sys)\s", o)]
            commands.append(Command(page, number, shell, exit_code, tuple(o for o in output if o.strip())))
    return commands


def documented_commands() -> list[Command]:
    """Every page's commands in the pages' order, each distinct command once: where it is written again
    (README.md and a page of docs/), with the exit code of its first place and the output of every place."""
    seen: dict[str, Command] = {}
    for page in PAGES:
        for c in page_commands(page):
            first = seen.setdefault(c.shell, c)
            if first is not c:
                assert first.exit_code == c.exit_code, f"{first.where} and {c.where} give {c.shell} two exit codes"
                seen[c.shell] = replace(first, output=first.output + c.output)
    return list(seen.values())


# First match wins; the last rules are the defaults for what a page adds later.
DRY_RUNS = "tests/unit/planning/test_dry_run.py plans every shipped config at its world, in one process"
PLANS = "a search of 10 s to a minute; tests/unit/planning/test_layout_search.py searches through run_train.sh"
RULES: list[Rule] = [
    Rule(r"^\./run_tests\.sh", "listed", "the suite itself, which runs this test"),
    Rule(r"scripts/gpu_smoke\.sh", "listed", "one GPU; its CPU form runs in tests/project/test_gpu_smoke.py"),
    Rule(r"^(\w+=\S+ )?scripts/gpu_check\.sh", "listed", "one GPU; its CPU form runs in tests/runs/test_launch.py"),
    Rule(
        r"^(TORCHFT_LIGHTHOUSE=\S+ )?sbatch ",
        "listed",
        "needs SLURM; tests/runs/test_launch.py runs the script's launch line",
    ),
    Rule(
        r"^(TITANLITE_EXTRAS=ft )?scripts/python\.sh -m titanlite\.tools\.lighthouse ",
        "listed",
        "a server that runs until stopped; tests/runs/test_replica_groups.py starts it so",
    ),
    Rule(
        r"pip freeze|scripts/wheelhouse\.sh",
        "listed",
        "two machines, one offline; tests/project/test_setup.py: wheelhouses",
    ),
    Rule(r"benchmarks/", "listed", "a measurement that takes minutes"),
    Rule(
        r"-m titanlite\.tools\.(calibration|reconciliation)$",
        "listed",
        "tests/unit/planning/test_calibration.py: the tables",
    ),
    Rule(
        r"-m titanlite\.tools\.tokenize --config CONFIG",
        "listed",
        "placeholders; tests/unit/data/test_token_shards.py runs it",
    ),
    # TorchTitan's published runs as the reconciliation plans them (tests/unit/planning/test_calibration.py: the
    # block is `reconciliation.commands()`, their memory its table's).
    Rule(r"--comm\.fake_gpu_memory_gib 95 --parallelism\.dp_impl fsdp2", "config", "17 dry runs of 8B-405B"),
    # The newcomer's first run and one run of each model family with checkpoints, trained for real (two
    # steps), then the tools on what they wrote.
    Rule(r"^\./run_train\.sh$", "run", "", chain="llama", append="--training.steps 2"),
    Rule(r"--job\.dump_folder /tmp/demo/run$", "run", "", chain="llama", append="--training.steps 2"),
    Rule(r"qwen3_moe_debug\.toml --checkpoint\.enable$", "run", "", chain="moe", append="--training.steps 2"),
    Rule(
        r"-m titanlite\.tools\.generate .*--job\.dump_folder outputs/sample ",
        "run",
        "",
        chain="llama",
        seed="/tmp/demo/run",
    ),
    Rule(r"-m titanlite\.tools\.hf export --config \S+qwen3_moe", "run", "", chain="moe"),
    # DeepSeek-V3 to Hugging Face and back (docs/deepseek_v3.md): trained, exported, sampled, trained from it.
    Rule(
        r"deepseek_v3_debug\.toml --training\.steps 20 --checkpoint\.enable",
        "run",
        "",
        chain="dsv3",
        append="--training.steps 2",
    ),
    Rule(r"-m titanlite\.tools\.(hf export|generate) --config \S+deepseek_v3", "run", "", chain="dsv3"),
    Rule(
        r"--checkpoint\.initial_load_path /tmp/demo/dsv3/hf",
        "run",
        "",
        chain="dsv3",
        append="--training.steps 2",
        last=True,
    ),
    Rule(r"-m titanlite\.tools\.(generate|hf export) --config ", "run", "", chain="llama"),
    Rule(r"-m titanlite\.tools\.dashboard ", "run", "", chain="llama"),
    Rule(r"-m tensorboard\.main ", "run", "a server: its version only", chain="llama", append="--version_tb"),
    Rule(r"^scripts/python\.sh -m titanlite\.[\w. ]+ --help$", "run", ""),
    Rule(r"^bash scripts/env\.sh$", "run", ""),
    Rule(r"^\./run_train\.sh (--help|--job\.print_config|--training\.step 20)$", "run", ""),
    # The plans whose lines the page shows, and the dry runs of a world of NGPU x NNODES.
    Rule(r"405b\.toml --plan --comm\.fake_world_size 8$|--layout_search\.gpu x100$|fake_world_size 7 ", "run", ""),
    Rule(r"--plan\b", "config", PLANS),
    Rule(r"^NGPU=8 NNODES=\d+ \./run_train\.sh .*--dry-run", "run", ""),
    Rule(r"--dry-run\b", "config", DRY_RUNS),
    # Llama 3's own vocabulary, which titanlite does not ship: where a run would start, one line names it.
    Rule(r"llama3_(8b|70b|405b)(_pp)?\.toml$", "preflight", "", exit_code=2, says="model.tokenizer_path"),
    Rule(
        r"^(NGPU=\d+ |NNODES=\d+ |RDZV_\w+=\S+ |TITANLITE_EXTRAS=\S+ |TORCHFT_LIGHTHOUSE=\S+ )*\./run_train\.sh",
        "preflight",
        "",
    ),
]


def rule_of(command: Command) -> Rule | None:
    return next((r for r in RULES if re.search(r.pattern, command.shell)), None)


def test_every_documented_command_has_a_rule():
    commands = documented_commands()
    assert len(commands) > 50, "the pages' commands were not found"
    missing = [f"{c.where}: {c.shell}" for c in commands if rule_of(c) is None]
    assert not missing, "documented commands neither run nor listed with a reason:\n" + "\n".join(missing)
    unused = [r.pattern for r in RULES if not any(re.search(r.pattern, c.shell) for c in commands)]
    assert not unused, f"rules that no documented command matches: {unused}"


def test_documented_python_commands_use_scripts_python_sh():
    """A bare `python` has neither titanlite nor its environment in a fresh shell (ModuleNotFoundError):
    every documented Python command goes through scripts/python.sh. The offline set-up's `python3 -m pip
    freeze` lists what the GPU machine's own Python has, on purpose."""
    bare = [
        f"{c.where}: {c.shell}"
        for c in documented_commands()
        if re.match(rf"^{_ENV}python3?\s", c.shell) and "pip freeze" not in c.shell or "PYTHONPATH=" in c.shell
    ]
    assert not bare, "documented commands with a bare python:\n" + "\n".join(bare)


# Absolute paths a documented command writes, moved into the test's folder.
_MOVED = [(r"/tmp/demo\b", "{tmp}/demo")]


@dataclass
class Outcome:
    command: Command
    rule: Rule
    line: str  # what ran
    returncode: int
    output: str

    def problems(self) -> list[str]:
        want = self.command.exit_code if self.rule.exit_code is None else self.rule.exit_code
        found = [f"exit code {self.returncode}, expected {want}"] if self.returncode != want else []
        shown = (self.rule.says, *self.command.output)
        found += [f"output lacks {text.strip()!r}" for text in shown if text.strip() not in self.output]
        lines = [line for line in self.output.splitlines() if line.strip()]
        if want and self.command.output and len(lines) != len(self.command.output):
            found.append(f"{len(lines)} lines where the page shows {len(self.command.output)}")  # a refusal's line
        return found


def checkout(where: Path) -> Path:
    """A checkout in `where` whose files are this one's (symbolic links) but for `outputs/`: a command run
    there writes its relative paths (`outputs/...`, the configs' dump folders) into the test's folder."""
    where.mkdir(parents=True)
    for entry in ROOT.iterdir():
        if entry.name != "outputs":
            (where / entry.name).symlink_to(entry)
    return where


def moved(text: str, tmp: Path) -> str:
    """`text` with the absolute paths commands write (`/tmp/demo`) moved into `tmp`."""
    return re.sub(r"/tmp/demo\b", f"{tmp}/demo", text)


def shell_line(command: Command, rule: Rule, tmp: Path, cwd: Path) -> str:
    """The command as written, with its absolute paths moved into `tmp`, optional `[...]` parts left
    out, `<run>` the newest TensorBoard run and the rule's arguments added."""
    line = moved(re.sub(r"\s*\[[^\]]*\]", "", command.shell), tmp)
    if "<run>" in line:
        tb = cwd / re.search(r"(\S+)/<run>", line)[1]
        newest = max(tb.iterdir(), key=lambda p: p.stat().st_mtime).name if tb.is_dir() else "none"
        line = line.replace("<run>", newest)
    return f"{line} {rule.append}".rstrip()


def run(command: Command, rule: Rule, tmp: Path, cwd: Path) -> Outcome:
    """`command` in a shell in `cwd` whose environment has neither this checkout on PYTHONPATH nor the
    launch variables the test process may have."""
    line = shell_line(command, rule, tmp, cwd)
    if rule.seed:
        dump = Path(re.search(r"--job\.dump_folder (\S+)", line)[1])
        shutil.copytree(cwd / moved(rule.seed, tmp) / "checkpoint", cwd / dump / "checkpoint")
    drop = ("PYTHONPATH", "NGPU", "NNODES", "DRY_LAUNCH", "RDZV_ENDPOINT", "WORLD_SIZE")
    env = {k: v for k, v in child_env(OMP_NUM_THREADS=str(threads(2))).items() if k not in drop}
    proc = subprocess.run(["bash", "-c", line], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    return Outcome(command, rule, line, proc.returncode, proc.stdout + proc.stderr)


def check_in_one_process(commands: list[tuple[Command, Rule]], cwd: Path) -> list[Outcome]:
    """The `preflight` and `config` checks of run_train.sh commands, all in one process (workers/preflights.py):
    the command line as run_train.sh passes it on, for a world of NGPU (default 2 on a CPU) x NNODES."""
    specs = []
    for command, rule in commands:
        words = shlex.split(re.sub(r"\s*\[[^\]]*\]", "", command.shell))
        env = dict(w.split("=", 1) for w in words[: words.index("./run_train.sh")])
        argv = [w for w in words[words.index("./run_train.sh") + 1 :] if w not in ("--dry-run", "--plan")]
        world = int(env.get("NGPU", 2)) * int(env.get("NNODES", 1))
        specs.append({"argv": argv, "world": world, "how": rule.how})
    (cwd / "checks.json").write_text(json.dumps(specs))
    env = {k: v for k, v in child_env(OMP_NUM_THREADS=str(threads(2))).items() if k != "PYTHONPATH"}
    proc = subprocess.run(
        ["scripts/python.sh", "tests/workers/preflights.py", "checks.json"],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.splitlines()[-1])
    return [
        Outcome(c, r, f"{r.how}: {c.shell}", code, text) for (c, r), (code, text) in zip(commands, results, strict=True)
    ]


@pytest.mark.slow
def test_documented_commands_run_as_written(tmp_path):
    """Every documented command by its rule (the module's docstring), exit code and output checked: 52 s
    on 2 cores (`-n 0`, nothing else running): three training launches of two steps and seven tools on
    what they wrote, beside eleven other commands and one process checking 55 more."""
    commands = [(c, rule_of(c)) for c in documented_commands()]
    assert all(r is not None for _, r in commands), "test_every_documented_command_has_a_rule fails"
    # The training runs, then the tools on what they wrote, in one checkout; the rest in another.
    ordered, alone = checkout(tmp_path / "ordered"), checkout(tmp_path / "alone")
    held_out = (ROOT / "titanlite/data/corpus/pydocs_008.txt").read_text().split("\n\n")
    (alone / "held_out.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in held_out if t.strip()))
    chains: dict[str, list[tuple[Command, Rule]]] = {}
    # Training runs first, then the tools on what they wrote, then the runs that read what the tools wrote.
    for c, r in sorted(commands, key=lambda cr: (cr[1].last, "--training.steps" not in cr[1].append)):
        if r.chain:
            chains.setdefault(r.chain, []).append((c, r))
    free = [(c, r) for c, r in commands if r.how == "run" and not r.chain]
    with ThreadPoolExecutor(2) as pool:
        chained = [pool.submit(lambda ch=ch: [run(c, r, tmp_path, ordered) for c, r in ch]) for ch in chains.values()]
        each = [pool.submit(run, c, r, tmp_path, alone) for c, r in free]
        checked = check_in_one_process([(c, r) for c, r in commands if r.how in ("preflight", "config")], alone)
        outcomes = [*(o for f in chained for o in f.result()), *(f.result() for f in each), *checked]
    failed = [
        f"{o.command.where}: {o.line}\n  " + "; ".join(o.problems()) + "\n  " + o.output[-1500:].replace("\n", "\n  ")
        for o in outcomes
        if o.problems()
    ]
    assert not failed, f"{len(failed)} of {len(outcomes)} documented commands failed:\n" + "\n".join(failed)
    listed = [c for c, r in commands if r.how == "listed"]
    assert len(outcomes) + len(listed) == len(commands)


# A search whose output docs/layout_search.md shows in full, compared line for line; the cheapest of the
# page's searches (the others take 10 s to a minute, beyond what the suite can spend).
SHOWN_SEARCH = "./run_train.sh --config train_configs/llama3_8b_128k.toml --plan --comm.fake_world_size 64"


def shown_output(page: str, command: str) -> list[str]:
    """The fenced block that follows the block holding only `command` on `page`: its output as shown."""
    blocks = _blocks((ROOT / page).read_text())
    at = next(i for i, (_, body) in enumerate(blocks) if [line.strip() for line in body if line.strip()] == [command])
    return blocks[at + 1][1]


@pytest.mark.slow
def test_the_page_shows_what_the_layout_search_prints(capsys, tmp_path):
    """docs/layout_search.md's output of 8B at 131,072 tokens on 64 GPUs is what the search prints, from
    its first line to `best:` (the folder written and the seconds taken are the run's own): the search
    that run_train.sh's `--plan` starts, in this process (5 s on 2 cores, torch's import included), on
    the page's own command line."""
    from titanlite.errors import run_cli  # torch's import, only in the test that searches
    from titanlite.tools import layout_search

    shown = shown_output("docs/layout_search.md", SHOWN_SEARCH)
    argv = [w for w in shlex.split(SHOWN_SEARCH)[1:] if w != "--plan"]
    assert run_cli(layout_search.main, [*argv, "--job.dump_folder", str(tmp_path)]) == 0
    printed = capsys.readouterr().out.splitlines()
    best = next(i for i, line in enumerate(shown) if line.startswith("best: "))
    assert printed[: best + 1] == shown[: best + 1]
    assert [line.split()[0] for line in shown[best + 1 :]] == ["wrote", "searched"]
    assert (
        printed[best + 1]
        == f"wrote {tmp_path / 'plan.toml'} (check it: ./run_train.sh --config {tmp_path / 'plan.toml'} --dry-run)"
    )
