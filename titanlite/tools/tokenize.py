"""Tokenize a run's training data once, into binary token shards that training reads without tokenizing.

    python -m titanlite.tools.tokenize --config CONFIG --out DIR [--workers N] [--documents_per_shard C]
                                       [--section.key value ...]

It reads the config's training data (`training.dataset_path`, "" = the bundled corpus; or each source of
`training.datasets`, into DIR/<name>) and its tokenizer (`model.tokenizer_path`), and writes the folder
`data/token_shards.py` describes: every document as BOS + tokens + EOS, exactly as training tokenizes it
on the fly, in the data's own document order. Point `training.dataset_path` (or a source's path) at the
folder: the run reads the same tokens in the same order, without tokenizing.

Shards of C documents (default 16,384) are tokenized by N processes (default: the machine's cores), each
given a contiguous run of them (so a compressed file is decompressed forward once per process, not once per
document or shard), with a progress line on stderr. Each shard is renamed into place once whole, so an
interrupted run (killed, out of time) continues where it stopped when the same command is run again, and
the folder ends up byte for byte the same, also where the data or the tokenizer has moved since (the
plan compares their content digests, not their paths). A folder begun for other data, another tokenizer or
another shard size is refused. Local data only: `hf://` datasets stream during training.
"""

from __future__ import annotations

import itertools
import multiprocessing
import os
import queue
import sys
import time
import traceback
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

from titanlite.checkpoint.fingerprint import dataset_fingerprint, tokenizer_fingerprint
from titanlite.config import DEFAULT_CONFIG, load_config
from titanlite.data.local_files import counted
from titanlite.data.local_source import LocalSource
from titanlite.data.sources import open_source
from titanlite.data.token_shards import (
    FORMAT,
    INDEX,
    PLAN,
    VERSION,
    WrittenShard,
    read_json,
    read_shard,
    shard_name,
    token_dtype,
    write_json,
    write_shard,
)
from titanlite.data.tokenizer import Tokenizer, build_tokenizer
from titanlite.errors import ConfigError, DataError, UserError, exit_now, run_tool
from titanlite.faults import tokenize_kill
from titanlite.tools.options import number, split_options

OPTIONS = {"--out": "", "--workers": "0", "--documents_per_shard": "16384"}
PROGRESS_INTERVAL_S = 0.2


class ShardTask:
    """What a worker process needs to write shards: the source's index and the tokenizer's path (each
    worker builds its tokenizer once)."""

    def __init__(self, source: LocalSource, tokenizer_path: str, out: Path, per_shard: int, dtype: str) -> None:
        self.source, self.tokenizer_path, self.out = source, tokenizer_path, out
        self.per_shard, self.dtype = per_shard, dtype

    def _documents(self, k: int) -> range:
        """Shard k's documents: [k C, (k + 1) C)."""
        return range(k * self.per_shard, min((k + 1) * self.per_shard, self.source.num_documents))

    def write(self, shards: list[int]) -> Iterator[tuple[int, WrittenShard]]:
        """Tokenize and write `shards` (increasing), yielding each once written. Their documents are read in
        one forward pass (`LocalSource.documents`): a compressed file is decompressed once for a run of
        shards, not from its start for every document."""
        tokenizer = build_tokenizer(self.tokenizer_path or None)
        texts = self.source.documents(d for k in shards for d in self._documents(k))
        try:
            for k in shards:
                docs = (
                    tokenizer.encode(t, bos=True, eos=True) for t in itertools.islice(texts, len(self._documents(k)))
                )
                yield k, write_shard(self.out / shard_name(k), docs, self.dtype)
        finally:
            texts.close()

    def run(self, shards: list[int], results: multiprocessing.Queue) -> None:
        """A worker process: `write(shards)` onto `results`, then (None, the error) if one stopped it. It
        stops after the shard it is writing when the tool's process is gone (killed), as a pool's would."""
        parent = multiprocessing.parent_process()
        try:
            for written in self.write(shards):
                results.put(written)
                if parent is not None and not parent.is_alive():
                    return
        except Exception as e:
            results.put((None, e if isinstance(e, UserError) else RuntimeError(traceback.format_exc())))


def _written(task: ShardTask, todo: list[int], workers: int) -> Iterator[tuple[int, WrittenShard]]:
    """(k, shard) for the shards `todo` as they are written: here for one worker, else by up to `workers`
    processes, each given a contiguous run of them, so that it reads each file forward once."""
    runs = [r for w in range(workers) if (r := todo[len(todo) * w // workers : len(todo) * (w + 1) // workers])]
    if len(runs) <= 1:
        yield from task.write(todo)
        return
    context = multiprocessing.get_context("forkserver")
    results = context.Queue()
    procs = [context.Process(target=task.run, args=(run, results), daemon=True) for run in runs]
    for proc in procs:
        proc.start()
    try:
        for _ in todo:
            while True:
                try:
                    k, shard = results.get(timeout=1.0)
                    break
                except queue.Empty:
                    failed = [p.exitcode for p in procs if p.exitcode]
                    if failed or all(p.exitcode is not None for p in procs):
                        raise RuntimeError(f"a tokenize worker exited (codes {failed}) before its shards") from None
            if k is None:
                raise shard
            yield k, shard
    finally:
        for proc in procs:
            proc.kill()
            proc.join()


class Progress:
    """One updating line on stderr: documents, tokens and the rate so far."""

    def __init__(self, what: str, documents: int, done: int) -> None:
        self.what, self.documents, self.done, self.tokens = what, documents, done, 0
        self.start = self._last = time.perf_counter()

    def add(self, shard: WrittenShard, force: bool = False) -> None:
        self.done += shard.documents
        self.tokens += shard.tokens
        now = time.perf_counter()
        if force or now - self._last >= PROGRESS_INTERVAL_S or self.done == self.documents:
            self._last = now
            rate = self.tokens / max(now - self.start, 1e-9)
            pct = 100 * self.done / max(self.documents, 1)
            print(
                f"\rtokenize {self.what}: {self.done:,}/{self.documents:,} documents ({pct:.0f}%), "
                f"{rate:,.0f} tokens/s",
                end="",
                file=sys.stderr,
                flush=True,
            )

    def close(self) -> None:
        print(file=sys.stderr, flush=True)


def _plan(
    dataset_path: str, source: LocalSource, text_field: str, tokenizer_path: str, tokenizer: Tokenizer, per_shard: int
) -> dict:
    """What a folder holds, as its plan records it: independent of where the data lives (its content digest)."""
    data = dataset_fingerprint(source, text_field)
    return {
        "format": FORMAT,
        "version": VERSION,
        "tokenizer": tokenizer_fingerprint(tokenizer_path),
        "vocab_size": tokenizer.n_words,
        "dtype": token_dtype(tokenizer.n_words),
        "source": {"name": dataset_path or "bundled", "digest": data["digest"], "text_field": text_field},
        "documents": source.num_documents,
        "documents_per_shard": per_shard,
    }


def _what(plan: dict) -> dict:
    """The part of a plan that says what a folder holds: all but the names of the data and the tokenizer
    (where they are, as spelled on the command line; kept for display)."""
    return {
        **plan,
        "tokenizer": {k: v for k, v in plan["tokenizer"].items() if k != "name"},
        "source": {k: v for k, v in plan["source"].items() if k != "name"},
    }


def _begin(out: Path, plan: dict) -> dict:
    """Record the plan, or check that a folder already begun holds the same (a resume, perhaps of data or a
    tokenizer moved since, or named otherwise); returns the folder's plan."""
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        file = next((p for p in (out, *out.parents) if p.exists() and not p.is_dir()), None)
        if file is not None:
            what = f"--out {out}" if file == out else f"--out {out}: {file}"
            raise DataError(f"{what} is a file, not a folder: name a new or empty folder") from None
        raise DataError(f"--out {out} cannot be created ({e.strerror})") from None
    if (out / PLAN).exists():
        was = read_json(out / PLAN, f"--out {out}", "use another folder or delete it")
        try:
            begun = _what(was)
        except (KeyError, TypeError, AttributeError):
            raise DataError(
                f"--out {out}: {PLAN} is not a tokenization plan; use another folder or delete it"
            ) from None
        changed = [key for key in plan if begun.get(key) != _what(plan)[key]]
        if changed:
            raise DataError(
                f"--out {out} holds a tokenization of other {', '.join(changed)} ({PLAN}); use another folder or "
                "delete it"
            )
        plan = was
    elif any(out.iterdir()):
        raise DataError(f"--out {out} is not empty and holds no tokenization: use an empty or new folder")
    else:
        write_json(out / PLAN, plan)
    for tmp in out.glob(".*.tmp"):  # a write an interruption cut short
        tmp.unlink(missing_ok=True)
    return plan


def tokenize_source(
    dataset_path: str, text_field: str, tokenizer_path: str, out: Path, workers: int, per_shard: int
) -> dict:
    """Tokenize one dataset into `out` (module docstring), resuming a folder begun with the same plan;
    returns its `tokens.json`."""
    source = open_source(dataset_path, text_field)
    if not isinstance(source, LocalSource):
        raise DataError(f"dataset_path {source.name}: only local text data can be tokenized ahead (not hf://, tokens)")
    if not source.num_documents:
        raise DataError(f"dataset_path {source.name}: no usable documents")
    tokenizer = build_tokenizer(tokenizer_path or None)
    plan = _plan(dataset_path, source, text_field, tokenizer_path, tokenizer, per_shard)
    plan = _begin(out, plan)
    num_shards = -(-source.num_documents // per_shard)
    shards: dict[int, WrittenShard] = {
        k: read_shard(out / shard_name(k)) for k in range(num_shards) if (out / shard_name(k)).exists()
    }
    todo = [k for k in range(num_shards) if k not in shards]
    progress = Progress(source.name, source.num_documents, sum(s.documents for s in shards.values()))
    task = ShardTask(source, tokenizer_path, out, per_shard, plan["dtype"])
    for written, (k, shard) in enumerate(_written(task, todo, workers), 1):
        shards[k] = shard
        progress.add(shard)
        tokenize_kill(written)
    if not todo:
        progress.add(WrittenShard("", 0, 0, 0, ""), force=True)
    progress.close()
    entries = [asdict(shards[k]) for k in range(num_shards)]
    index = {**plan, "tokens": sum(e["tokens"] for e in entries), "shards": entries}
    write_json(out / INDEX, index)
    return index


def main(argv: list[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__.strip())
        return 0
    opts, rest = split_options(argv, OPTIONS)
    if not opts["--out"]:
        raise ConfigError("--out DIR is required (python -m titanlite.tools.tokenize --help)")
    workers, per_shard = int(number(opts, "--workers")), int(number(opts, "--documents_per_shard"))
    if workers < 0 or per_shard < 1:
        raise ConfigError("--workers must be non-negative (0 = one per core), --documents_per_shard positive")
    workers = workers or len(os.sched_getaffinity(0))
    cfg = load_config(rest, default_config=DEFAULT_CONFIG)
    out, t = Path(opts["--out"]), cfg.training
    jobs = [(entry.path, out / entry.name) for entry in t.datasets] or [(t.dataset_path, out)]
    for path, folder in jobs:
        index = tokenize_source(path, t.dataset_text_field, cfg.model.tokenizer_path, folder, workers, per_shard)
        print(
            f"tokenized {counted(index['documents'], 'document')} into {index['tokens']:,} tokens "
            f"({index['dtype']}, {counted(len(index['shards']), 'shard')}): {folder}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    exit_now(run_tool(main))
