"""Weighted mixtures (`training.datasets`, `titanlite/data/mixture.py`), in process: the config's forms and
refusals, the interleaving's proportions, layout independence, exact resume and resharding, per-source
token counts, and the resume policy's line for a changed mixture. The run through `run_train.sh` (kill -9,
dp2 x tp2) is `test_mixture_run.py`."""

from __future__ import annotations

import json
import math
import pickle
from itertools import islice
from pathlib import Path

import pytest
import torch

from titanlite.checkpoint.fingerprint import mixture_fingerprint
from titanlite.checkpoint.resume_policy import compare_settings
from titanlite.config import DatasetSource, load_config
from titanlite.data.loader import build_dataloader, merge_loader_states
from titanlite.data.mixture import Mixture
from titanlite.data.tokenizer import build_tokenizer
from titanlite.errors import CheckpointError, ConfigError, run_cli
from titanlite.launcher import preflight
from titanlite.metrics.logger import MetricsLogger

TOK = build_tokenizer(None)
SEQ = 16
CONFIG = "train_configs/debug_model.toml"


def write_jsonl(path: Path, prefix: str, n: int) -> Path:
    path.write_text("".join(json.dumps({"text": f"{prefix} {i}: " + "word " * (i % 7 + 2)}) + "\n" for i in range(n)))
    return path


@pytest.fixture
def sources(tmp_path) -> list[DatasetSource]:
    web = write_jsonl(tmp_path / "web.jsonl", "web page", 40)
    code = write_jsonl(tmp_path / "code.jsonl", "def f", 24)
    return [DatasetSource(str(web), 0.8, "web"), DatasetSource(str(code), 0.2, "code")]


def mixed(sources, *, rank=0, dp=1, gbs=8, lbs=0, seed=0, shards=0):
    return build_dataloader(
        tokenizer=TOK,
        dataset_path="",
        text_field="text",
        seq_len=SEQ,
        local_batch_size=lbs or gbs // dp,
        global_batch_size=gbs,
        dp_rank=rank,
        dp_degree=dp,
        virtual_shards=shards,
        mixture=sources,
        seed=seed,
    )


def single(path: str, gbs=8):
    return build_dataloader(
        tokenizer=TOK,
        dataset_path=path,
        text_field="text",
        seq_len=SEQ,
        local_batch_size=1,
        global_batch_size=gbs,
        dp_rank=0,
        dp_degree=1,
        virtual_shards=gbs,
    )


def rows(batch) -> list[tuple[int, ...]]:
    return [tuple(i) + tuple(p) for i, p in zip(batch.inputs.tolist(), batch.positions.tolist())]


def global_steps(loaders, steps: int) -> list[list[tuple[int, ...]]]:
    """Per step, every rank's samples, sorted (one microbatch per rank and step)."""
    iters = [iter(dl) for dl in loaders]
    return [sorted(r for it in iters for r in rows(next(it))) for _ in range(steps)]


def test_config_takes_toml_tables_and_the_command_line_form(tmp_path):
    toml = tmp_path / "mix.toml"
    toml.write_text(
        '[[training.datasets]]\npath = "data/web.jsonl.gz"\nweight = 3\n'
        '[[training.datasets]]\npath = "hf://allenai/c4:en@train"\nweight = 1\nname = "c4en"\n'
    )
    cfg = load_config(["--config", str(toml)])
    assert cfg.training.datasets == [
        DatasetSource("data/web.jsonl.gz", 3.0, "web"),
        DatasetSource("hf://allenai/c4:en@train", 1.0, "c4en"),
    ]
    cli = load_config(["--training.datasets", "hf://allenai/c4:en:0.2,:0.8"]).training.datasets
    assert cli == [DatasetSource("hf://allenai/c4:en", 0.2, "c4"), DatasetSource("", 0.8, "corpus")]
    # NAME=PATH:WEIGHT names a source on the command line: a glob, or two files of one stem; a path whose
    # first folder has '=' in its name (year=2024/) is written ./year=2024/ and stays a path.
    named = "web=d/*.jsonl:1,x=x/a.jsonl:2,y=y/a.jsonl:3,k=v/b.jsonl:1"
    assert load_config(["--training.datasets", named]).training.datasets == [
        DatasetSource("d/*.jsonl", 1.0, "web"),
        DatasetSource("x/a.jsonl", 2.0, "x"),
        DatasetSource("y/a.jsonl", 3.0, "y"),
        DatasetSource("v/b.jsonl", 1.0, "k"),
    ]
    assert load_config(["--training.datasets", "k=v/b.jsonl:1,./year=2024/b.jsonl:1"]).training.datasets[1] == (
        DatasetSource("./year=2024/b.jsonl", 1.0, "b")
    )


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--training.datasets", "a.jsonl"], "'a.jsonl' has no weight (expected PATH:WEIGHT)"),
        (["--training.datasets", "a.jsonl:heavy"], "the weight 'heavy' is not a number"),
        (
            ["--training.datasets", "a.jsonl:0,b.jsonl:1"],
            "source 'a' (a.jsonl) has weight 0.0: weights must be positive",
        ),
        (["--training.datasets", "a.jsonl:-1"], "has weight -1.0"),
        (["--training.datasets", "x/a.jsonl:1,y/a.txt:1"], "two sources are named 'a' ('x/a.jsonl' and 'y/a.txt')"),
        (["--training.datasets", "d/*.jsonl:1"], "source 'd/*.jsonl' needs a name"),
        (["--training.datasets", "a.jsonl:1e308,b.jsonl:1e308"], "the weights add up to more than a float holds"),
        (
            ["--training.datasets", "a.jsonl:1", "--training.dataset_path", "b.jsonl"],
            "'training.dataset_path' and 'training.datasets' are both set",
        ),
    ],
)
def test_bad_mixtures_are_refused_in_one_line_before_any_rank(argv, message, monkeypatch, capsys):
    with pytest.raises(ConfigError, match=None) as e:
        load_config(argv)
    assert message in str(e.value)
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert run_cli(preflight.main, ["--config", CONFIG, *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0] and err[0].startswith("titanlite: error:")


def test_a_missing_source_and_a_holdout_are_refused_naming_the_key(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "2")
    dump = ["--job.dump_folder", str(tmp_path / "out")]
    argv = ["--config", CONFIG, *dump, "--training.datasets", f":1,{tmp_path}/none.jsonl:1"]
    assert run_cli(preflight.main, argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "training.datasets source 'none': " in err[0] and "matches no" in err[0], err
    argv = ["--config", CONFIG, *dump, "--training.datasets", ":1", "--validation.holdout_documents", "8"]
    assert run_cli(preflight.main, argv) == 2
    assert "validation.holdout_documents cannot hold documents out of a mixture" in capsys.readouterr().err


def test_the_interleaving_follows_the_weights_at_every_step():
    """Every shard within ceil(log2 K) samples of its weights at every n, each sample raising its source's
    count; the seed changes the order."""
    for weights in ([0.8, 0.2], [5, 3, 2], [1, 1, 1, 1], [3, 1, 1, 1, 1, 1, 1, 1]):
        mixture = Mixture([f"s{i}" for i in range(len(weights))], weights, seed=3, num_shards=16)
        share = [w / sum(weights) for w in weights]
        depth = math.ceil(math.log2(len(weights)))
        for n in range(0, 60):
            for shard in (0, 7, 15):
                counts = mixture.counts(shard, n)
                assert sum(counts) == n and all(abs(c - n * p) < depth for c, p in zip(counts, share)), counts
                if n:
                    assert (
                        counts[mixture.source_of(shard, n - 1)]
                        == mixture.counts(shard, n - 1)[mixture.source_of(shard, n - 1)] + 1
                    )
    orders = {tuple(Mixture(["x", "y"], [0.7, 0.3], seed, 4).source_of(0, n) for n in range(32)) for seed in range(4)}
    assert len(orders) > 1


@pytest.mark.parametrize(
    "weights, bound",
    [([0.5, 0.3, 0.2], 2), ([0.4, 0.3, 0.2, 0.1], 2), ([0.3, 0.25, 0.2, 0.15, 0.1], 10), ([1] * 5, 10)],
)
def test_all_shards_together_follow_the_weights_at_every_step(weights, bound):
    """A step's samples over all V shards: within `bound` samples of the weights (docs/configuration.md),
    however many virtual shards; the spread does not grow with V."""
    share = [w / sum(weights) for w in weights]
    for shards in (1, 7, 48, 256, 1000, 1024):
        mixture = Mixture([f"s{i}" for i in range(len(weights))], weights, seed=0, num_shards=shards)
        for n in range(1, 41):
            total = mixture.samples(n)
            assert sum(total.values()) == n * shards
            errors = [abs(total[f"s{i}"] - n * shards * p) for i, p in enumerate(share)]
            assert max(errors) <= bound, (shards, n, total)


def test_each_sample_is_its_sources_next_window_in_the_order_the_mixture_names(sources):
    """Shard v's mixed samples are, in the mixture's order, the windows of each source's own shard-v stream:
    the mixture only chooses; each source packs, epochs and positions its documents as it would alone."""
    gbs, steps = 8, 30  # code (24 documents, 3 per shard) wraps around several times
    it = iter(mixed(sources, gbs=gbs, lbs=1))
    got = [rows(next(it))[0] for _ in range(gbs * steps)]  # shard v's samples are every gbs-th
    alone = {s.name: [rows(b)[0] for b in islice(iter(single(s.path, gbs)), gbs * steps)] for s in sources}
    mixture = Mixture(["web", "code"], [0.8, 0.2], 0, gbs)
    used = {"web": [0] * gbs, "code": [0] * gbs}
    for k, sample in enumerate(got):
        v, n = k % gbs, k // gbs
        name = mixture.names[mixture.source_of(v, n)]
        assert sample == alone[name][used[name][v] * gbs + v]
        used[name][v] += 1
    assert {name: sum(c) * SEQ for name, c in used.items()} == mixed(sources, gbs=gbs).dataset.tokens_seen(steps)


def test_the_mixture_does_not_depend_on_the_layout(sources):
    reference = global_steps([mixed(sources)], 12)
    for dp in (2, 4):
        assert global_steps([mixed(sources, rank=r, dp=dp) for r in range(dp)], 12) == reference
    assert global_steps([mixed(sources, seed=1)], 12) != reference  # the seed orders it


@pytest.mark.parametrize("consumed", [3, 8])  # mid-step and at a step boundary
def test_resume_continues_exactly(sources, consumed):
    reference = [rows(b) for b in islice(iter(mixed(sources, rank=1, dp=2, lbs=2)), 12)]
    first = mixed(sources, rank=1, dp=2, lbs=2)
    it = iter(first)
    for _ in range(consumed):
        next(it)
    state = json.loads(json.dumps(first.state_dict()))
    resumed = mixed(sources, rank=1, dp=2, lbs=2)
    resumed.load_state_dict(pickle.loads(pickle.dumps(state)))
    assert [rows(b) for b in islice(iter(resumed), 12 - consumed)] == reference[consumed:]


@pytest.mark.parametrize("new_dp", [4, 1])
def test_resume_on_another_dp_degree_and_tokens_seen_survive(sources, new_dp):
    before, after = 7, 9
    reference = global_steps([mixed(sources)], before + after)
    old = [mixed(sources, rank=r, dp=2) for r in range(2)]
    first = global_steps(old, before)
    merged = merge_loader_states([dl.state_dict() for dl in old])
    new = [mixed(sources, rank=r, dp=new_dp) for r in range(new_dp)]
    for dl in new:
        dl.load_state_dict(merged)
    assert first + global_steps(new, after) == reference
    # tokens_seen counts from the start of the run, whatever the layout and resume point.
    assert new[0].dataset.tokens_seen(after) == mixed(sources).dataset.tokens_seen(before + after)


def test_a_state_of_another_mixture_or_of_one_dataset_is_refused(sources):
    dl = mixed(sources)
    next(iter(dl))
    state = dl.state_dict()
    with pytest.raises(CheckpointError, match="holds code, web; this run mixes web, other"):
        mixed([sources[0], DatasetSource(sources[1].path, 0.2, "other")]).load_state_dict(state)
    with pytest.raises(CheckpointError, match="a mixture's"):
        single(sources[0].path).load_state_dict(state)


def test_a_changed_mixture_is_refused_on_resume_naming_what_changed(sources, tmp_path):
    def inputs(mix, seed=0) -> dict:
        fp = mixture_fingerprint(mixed(mix).dataset.source, "text", seed)
        return {
            "config": load_config([]).to_dict(),
            "global_batch": 8,
            "virtual_shards": 8,
            "tokenizer": None,
            "dataset": fp,
        }

    web, code = sources
    saved = inputs(sources)
    marker = {**saved, "dataset": saved["dataset"]}
    other = write_jsonl(tmp_path / "other.jsonl", "other", 24)
    cases = {
        "training.datasets source 'code' had weight 0.2, this run 0.3": [web, DatasetSource(code.path, 0.3, "code")],
        "training.datasets source 'code' was removed": [web],
        "training.datasets source 'new' was added": [*sources, DatasetSource(str(other), 1, "new")],
        f"training.datasets source 'code' was {code.path}": [web, DatasetSource(str(other), 0.2, "code")],
    }
    for message, mix in cases.items():
        check = compare_settings("step-4", marker, inputs(mix), allow_dataset_change=False)
        assert check.error and message in check.error and "allow_dataset_change" in check.error, check.error
        allowed = compare_settings("step-4", marker, inputs(mix), allow_dataset_change=True)
        assert allowed.error is None and message in allowed.dataset_changed
    check = compare_settings("step-4", marker, inputs(sources, seed=1), allow_dataset_change=False)
    assert "training.seed was 0, this run has 1 (it interleaves the mixture)" in check.error
    # The same data moved elsewhere is no change.
    (tmp_path / "moved").mkdir()
    moved = [
        DatasetSource(str(Path(s.path).rename(tmp_path / "moved" / Path(s.path).name)), s.weight, s.name)
        for s in sources
    ]
    assert compare_settings("step-4", marker, inputs(moved), allow_dataset_change=False).error is None


def test_tokens_seen_reach_metrics_jsonl_and_tensorboard(tmp_path, sources):
    cfg = load_config(["--metrics.log_freq", "1"]).metrics
    log = MetricsLogger(cfg, str(tmp_path), torch.device("cpu"), 1.0, enabled=True, sources=("web", "code"))
    log.begin(0, 4)
    from titanlite.metrics.schema import StepStats

    log.log(StepStats(1, 2.0, 1.0, 1e-3, 64, 1.0, 0.1, tokens_seen={"web": 96, "code": 32}), 1)
    log.close()
    row = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    assert row["tokens_seen/web"] == 96 and row["tokens_seen/code"] == 32
    assert "Tokens seen: web (tokens)" in log.layout()["data"]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (events,) = (tmp_path / "tb").rglob("events.out.tfevents.*")
    acc = EventAccumulator(str(events.parent), size_guidance={"tensors": 0})
    acc.Reload()
    assert "data/tokens_seen/code" in acc.Tags()["tensors"]


def test_a_changed_mixture_names_the_first_source_in_list_order():
    """With several sources removed or added, the line names the first in the mixture's order, the same on
    every run (not whichever a set of names yields first)."""
    from titanlite.checkpoint.fingerprint import describe_mixture_change

    def fp(names: list[str]) -> dict:
        parts = [{"source": n, "weight": 1.0, "digest": n} for n in names]
        return {"name": " + ".join(names), "sources": parts, "seed": 0}

    many = [f"src{i}" for i in range(12)]
    assert "source 'src1' was removed" in describe_mixture_change(fp(many), fp(many[:1]))
    assert "source 'src1' was added" in describe_mixture_change(fp(many[:1]), fp(many))
