"""Encoding speed of the two tokenizer formats on the same text and the same vocabulary: a tiktoken file
against the Hugging Face `tokenizer.json` made from it (`data/hf_tokenizer.py`), in tokens/s on one core.

    scripts/python.sh benchmarks/bench_tokenizers.py [--tiktoken FILE] [--dataset PATH] [--repeats 10]
        [--out outputs/bench/tokenizers.json]

Default: the bundled 2k vocabulary on every document of the bundled corpus. Each row encodes every
document one call at a time, as the data loader does (one process per rank or loader worker, so one core
each: `RAYON_NUM_THREADS=1` keeps `tokenizers` on one thread); the fastest of `--repeats` passes is kept,
the rows taking turns pass after pass. Rows: titanlite's `encode(doc, bos=True, eos=True)` of each
format, and each library's plain call under it (tiktoken `encode_ordinary`, tokenizers
`encode(doc, add_special_tokens=False).ids`). Both formats must give the same ids on every document, or
the script stops.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

os.environ["RAYON_NUM_THREADS"] = "1"  # before tokenizers starts its thread pool

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from titanlite.data.hf_tokenizer import hf_tokenizer_files  # noqa: E402
from titanlite.data.local_source import LocalSource  # noqa: E402
from titanlite.data.sources import open_source  # noqa: E402
from titanlite.data.tiktoken_bpe import BUNDLED_VOCAB, TiktokenTokenizer  # noqa: E402
from titanlite.data.tokenizer_json import HFTokenizer  # noqa: E402


def best_rates(cases: dict, docs: list[str], repeats: int) -> dict[str, tuple[float, int]]:
    """{case: (tokens/s of its fastest pass over `docs`, tokens per pass)}; the cases take turns, pass after
    pass, so that a moment of load elsewhere on the machine costs each case one pass, not one row."""
    best = {name: float("inf") for name in cases}
    tokens = {}
    for fn in cases.values():
        fn(docs[:50])  # warm caches
    for _ in range(repeats):
        for name, fn in cases.items():
            start = time.perf_counter()
            tokens[name] = sum(len(ids) for ids in fn(docs))
            best[name] = min(best[name], time.perf_counter() - start)
    return {name: (tokens[name] / best[name], tokens[name]) for name in cases}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiktoken", default=str(BUNDLED_VOCAB), help="a tiktoken-format file")
    parser.add_argument("--dataset", default="", help="training.dataset_path (default: the bundled corpus)")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", default="outputs/bench/tokenizers.json")
    args = parser.parse_args(argv)

    tiktoken = TiktokenTokenizer(args.tiktoken)
    with tempfile.TemporaryDirectory() as folder:
        for name, text in hf_tokenizer_files(tiktoken, 2048).items():
            (Path(folder) / name).write_text(text)
        hf = HFTokenizer(folder)
    source = open_source(args.dataset, "text")
    if not isinstance(source, LocalSource):
        raise SystemExit("--dataset: local files only")
    docs = [source.document(d) for d in range(source.num_documents)]
    if [hf.encode(d, bos=True, eos=True) for d in docs] != [tiktoken.encode(d, bos=True, eos=True) for d in docs]:
        raise SystemExit("the two formats give different ids")
    cases = {
        "titanlite tiktoken format: encode(doc, bos, eos)": lambda ds: [
            tiktoken.encode(d, bos=True, eos=True) for d in ds
        ],
        "titanlite tokenizer.json: encode(doc, bos, eos)": lambda ds: [hf.encode(d, bos=True, eos=True) for d in ds],
        "tiktoken encode_ordinary(doc)": lambda ds: [tiktoken.model.encode_ordinary(d) for d in ds],
        "tokenizers encode(doc, add_special_tokens=False)": lambda ds: [
            hf.model.encode(d, add_special_tokens=False).ids for d in ds
        ],
    }
    mb = sum(len(d.encode("utf-8")) for d in docs) / 1e6
    rows = [
        dict(name=name, tokens_per_s=rate, mb_per_s=rate / tokens * mb, tokens=tokens)
        for name, (rate, tokens) in best_rates(cases, docs, args.repeats).items()
    ]
    import tiktoken as tiktoken_lib
    import tokenizers as tokenizers_lib

    versions = f"tiktoken {tiktoken_lib.__version__}, tokenizers {tokenizers_lib.__version__}"
    base = rows[0]["tokens_per_s"]
    lines = [
        f"{Path(args.tiktoken).name} ({tiktoken.n_words:,} tokens) on {args.dataset or 'the bundled corpus'}: "
        f"{len(docs):,} documents, {mb:.2f} MB, {rows[0]['tokens']:,} tokens; one core; {versions}; "
        f"{platform.processor() or platform.machine()}",
        "",
        "| encoding, per document | tokens/s per core | MB/s | x titanlite tiktoken |",
        "|---|---:|---:|---:|",
        *(
            f"| {r['name']} | {r['tokens_per_s']:,.0f} | {r['mb_per_s']:.2f} | {r['tokens_per_s'] / base:.2f} |"
            for r in rows
        ),
    ]
    print("\n".join(lines))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(dict(versions=versions, documents=len(docs), mb=mb, rows=rows), indent=2))
    print(f"\nJSON: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
