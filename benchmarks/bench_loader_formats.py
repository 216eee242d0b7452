"""Loader throughput per core by data format: text tokenized on the fly with tiktoken, text tokenized on the
fly with Hugging Face `tokenizers` (the same vocabulary as a tokenizer.json), and pre-tokenized shards.

    python benchmarks/bench_loader_formats.py [--batches 400] [--seq_len 2048] [--local_batch_size 4]

Each row: `build_dataloader` over the bundled corpus with no worker processes (one core does everything:
read, tokenize (text), pack, batch), timed over `--batches` batches after 5 warm-up ones. The workers a
node needs = what its GPUs consume / the row's tokens/s (each loader worker is one such core).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from titanlite.data.hf_tokenizer import hf_tokenizer_files  # noqa: E402
from titanlite.data.loader import build_dataloader  # noqa: E402
from titanlite.data.tokenizer import build_tokenizer  # noqa: E402
from titanlite.tools.tokenize import tokenize_source  # noqa: E402

NODE_TOKENS_PER_S = 8 * 76_466  # the 1B config on one H200, times the 8 GPUs of a node


def rate(tokenizer_path: str, dataset_path: str, seq_len: int, batch: int, batches: int) -> float:
    loader = build_dataloader(
        tokenizer=build_tokenizer(tokenizer_path),
        dataset_path=dataset_path,
        text_field="text",
        seq_len=seq_len,
        local_batch_size=batch,
        global_batch_size=batch,
        dp_rank=0,
        dp_degree=1,
    )
    it = iter(loader)
    for _ in range(5):
        next(it)
    start = time.perf_counter()
    tokens = sum(next(it).inputs.numel() for _ in range(batches))
    return tokens / (time.perf_counter() - start)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, default=400)
    parser.add_argument("--seq_len", type=int, default=2048)
    parser.add_argument("--local_batch_size", type=int, default=4)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        hf = Path(tmp) / "hf"
        hf.mkdir()
        for name, text in hf_tokenizer_files(build_tokenizer(""), args.seq_len).items():
            (hf / name).write_text(text)
        tokens = Path(tmp) / "tokens"
        tokenize_source("", "text", "", tokens, workers=1, per_shard=16384)
        cases = {
            "text, tiktoken on the fly": ("", ""),
            "text, HF tokenizers on the fly": (str(hf), ""),
            "pre-tokenized shards": ("", str(tokens)),
        }
        print("| loader (0 workers, one core) | tokens/s per core | workers for 8 GPUs (611,728 tokens/s) |")
        print("|---|---|---|")
        for name, (tok, data) in cases.items():
            tps = rate(tok, data, args.seq_len, args.local_batch_size, args.batches)
            print(f"| {name} | {tps:,.0f} | {NODE_TOKENS_PER_S / tps:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
