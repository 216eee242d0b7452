"""Can the data pipeline keep up? The loader alone against the trainer's consumption, and titanlite's
tokenization against raw tiktoken on the same text.

    python benchmarks/bench_data.py [--suite outputs/bench/suite.json | --trainer-tps N] [--batches 300]
        [--dp 2] [--out outputs/bench/data.json] [--config FILE] [--section.key value ...]

Loader rows: `titanlite.data.loader.build_dataloader` for dp rank 0 of `--dp` ranks (the corpus and
tokenizer of the config), iterated for `--batches` batches after 5 warm-up batches, with 0 and 1
workers: documents streamed per virtual shard, tokenized, packed into seq_len + 1 windows and batched.
The trainer consumes local_batch x seq_len tokens per dp rank per step: its rate per dp rank is the
suite's global tokens/s over the variant's dp degree (`--suite`, fastest variant), or `--trainer-tps`
given directly. Headroom = loader tokens/s / that rate (> 1: the loader is not the bottleneck).

Tokenizer rows, all on every document of the config's dataset: `Tokenizer.encode(doc, bos, eos)` (what
the loader calls), raw tiktoken `encode_ordinary` on the same `tiktoken.Encoding`, and tiktoken's
threaded `encode_ordinary_batch`, in tokens/s and MB of UTF-8 text per second.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from titanlite.config import DEFAULT_CONFIG, load_config  # noqa: E402
from titanlite.data.loader import build_dataloader  # noqa: E402
from titanlite.data.local_source import LocalSource  # noqa: E402
from titanlite.data.sources import open_source  # noqa: E402
from titanlite.data.tokenizer import Tokenizer, build_tokenizer  # noqa: E402

WARMUP_BATCHES = 5


def loader_rate(cfg, tokenizer: Tokenizer, dp: int, workers: int, batches: int) -> float:
    t = cfg.training
    loader = build_dataloader(
        tokenizer=tokenizer,
        dataset_path=t.dataset_path,
        text_field=t.dataset_text_field,
        seq_len=t.seq_len,
        local_batch_size=t.local_batch_size,
        global_batch_size=t.local_batch_size * dp,
        dp_rank=0,
        dp_degree=dp,
        virtual_shards=t.dataset_virtual_shards,
        num_workers=workers,
    )
    it = iter(loader)
    for _ in range(WARMUP_BATCHES):
        next(it)
    start = time.perf_counter()
    tokens = sum(next(it)[0].numel() for _ in range(batches))
    return tokens / (time.perf_counter() - start)


def trainer_rate(args) -> tuple[float, str]:
    """Tokens/s one dp rank of the trainer consumes, and where the number comes from."""
    if args.trainer_tps:
        return args.trainer_tps, "--trainer-tps"
    suite = json.loads(Path(args.suite).read_text())
    rows = [r for r in suite["variants"] if not r["error"]]
    best = max(rows, key=lambda r: r["tokens_per_s"] / suite_dp(r, suite["world"]))
    return best["tokens_per_s"] / suite_dp(best, suite["world"]), f"{args.suite}: {best['name']}"


def suite_dp(row: dict, world: int) -> int:
    overrides = row["overrides"]
    tp = (
        int(overrides[overrides.index("--parallelism.tensor_parallel_degree") + 1])
        if "--parallelism.tensor_parallel_degree" in overrides
        else 1
    )
    return world // tp


def tokenizer_rows(cfg, tokenizer: Tokenizer) -> list[dict]:
    source = open_source(cfg.training.dataset_path, cfg.training.dataset_text_field)
    if not isinstance(source, LocalSource):
        return []
    docs = [source.document(d) for d in range(source.num_documents)]
    mb = sum(len(d.encode("utf-8")) for d in docs) / 1e6
    enc = tokenizer.model
    cases = {
        "titanlite Tokenizer.encode (bos+eos), per document": lambda: [
            tokenizer.encode(d, bos=True, eos=True) for d in docs
        ],
        "raw tiktoken encode_ordinary, per document": lambda: [enc.encode_ordinary(d) for d in docs],
        "raw tiktoken encode_ordinary_batch (threads)": lambda: enc.encode_ordinary_batch(docs),
    }
    rows = []
    for name, fn in cases.items():
        fn()  # warm caches
        start = time.perf_counter()
        tokens = sum(len(ids) for ids in fn())
        elapsed = time.perf_counter() - start
        rows.append(
            dict(name=name, tokens_per_s=tokens / elapsed, mb_per_s=mb / elapsed, tokens=tokens, docs=len(docs))
        )
    return rows


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--suite", default="outputs/bench/suite.json", help="bench_suite.py's JSON")
    source.add_argument("--trainer-tps", type=float, default=0.0, help="the trainer's tokens/s per dp rank")
    parser.add_argument("--batches", type=int, default=300)
    parser.add_argument("--dp", type=int, default=2, help="data-parallel degree the loader serves a rank of")
    parser.add_argument("--out", default="outputs/bench/data.json")
    parser.add_argument("--config", default=str(ROOT / DEFAULT_CONFIG))
    args, overrides = parser.parse_known_args(argv)
    cfg = load_config(["--config", args.config, *overrides])
    tokenizer = build_tokenizer(cfg.model.tokenizer_path or None)
    consumer, consumer_source = trainer_rate(args)
    loaders = [
        dict(name=f"loader, {w} workers", tokens_per_s=loader_rate(cfg, tokenizer, args.dp, w, args.batches))
        for w in (0, 1)
    ]
    toks = tokenizer_rows(cfg, tokenizer)
    t = cfg.training
    lines = [
        f"loader: dp rank 0 of {args.dp}, batch {t.local_batch_size} x {t.seq_len}, {args.batches} batches; "
        f"trainer consumes {consumer:,.0f} tokens/s per dp rank ({consumer_source})",
        "",
        "| data path | tokens/s | headroom over the trainer |",
        "|---|---:|---:|",
        *(f"| {r['name']} | {r['tokens_per_s']:,.0f} | {r['tokens_per_s'] / consumer:.1f}x |" for r in loaders),
        "",
        f"tokenization of the whole dataset ({toks[0]['docs'] if toks else 0:,} documents, "
        f"{toks[0]['tokens'] if toks else 0:,} tokens)",
        "",
        "| tokenizer | tokens/s | MB/s | x raw tiktoken |",
        "|---|---:|---:|---:|",
    ]
    raw = next((r for r in toks if r["name"].startswith("raw tiktoken encode_ordinary,")), None)
    lines += [
        f"| {r['name']} | {r['tokens_per_s']:,.0f} | {r['mb_per_s']:.2f} | "
        f"{r['tokens_per_s'] / raw['tokens_per_s']:.2f} |"
        for r in toks
    ]
    print("\n".join(lines))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(
        json.dumps(
            dict(consumer_tps=consumer, consumer_source=consumer_source, loaders=loaders, tokenizers=toks), indent=2
        )
    )
    print(f"\nJSON: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
