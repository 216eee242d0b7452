"""Rebuild the bundled training corpus `titanlite/data/corpus/pydocs_*.txt`.

The default training run needs real natural-language text on any machine, offline. CPython ships
its own prose documentation: `pydoc_data.topics` (the language reference topics that `help()`
shows) and the docstrings of the standard library. This script collects both, without importing
any stdlib module (docstrings are read with `ast` from the `.py` sources), and writes them in the
generic local-text format the data loader reads: one document per topic or docstring, documents
separated by one blank line, no blank line inside a document.

The output is deterministic for a given Python version (sorted traversal, first occurrence wins
when deduplicating). The files are committed to git so that every machine trains on identical
data; run this only to regenerate them:

    python -m titanlite.tools.build_corpus [--out DIR] [--files 12] [--min-chars 100]
"""

from __future__ import annotations

import argparse
import ast
import os
import sys
import sysconfig
import textwrap
from collections.abc import Iterator
from pathlib import Path

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "data" / "corpus"

# Test suites are code-like and huge, idlelib is an application, site-packages is not the stdlib.
SKIP_DIRS = frozenset({"test", "tests", "idlelib", "site-packages", "dist-packages", "__pycache__"})
DOC_NODES = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


def collapse(text: str) -> str:
    """One document per block: dedent, strip, drop blank lines (the loader splits on them)."""
    lines = (line.rstrip() for line in textwrap.dedent(text).strip().splitlines())
    return "\n".join(line for line in lines if line.strip())


def topic_documents() -> Iterator[str]:
    """The language reference topics shown by `help()`, in sorted key order."""
    from pydoc_data.topics import topics

    for key in sorted(topics):
        yield topics[key]


def _docstrings(node: ast.AST) -> Iterator[str]:
    """Docstrings of `node` and its nested classes/functions, in source order."""
    if isinstance(node, DOC_NODES):
        doc = ast.get_docstring(node, clean=True)
        if doc:
            yield doc
    for child in ast.iter_child_nodes(node):
        yield from _docstrings(child)


def stdlib_sources(root: Path) -> Iterator[Path]:
    """The stdlib `.py` files under `root`, in sorted order, without tests and applications."""
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
        for name in sorted(filenames):
            if name.endswith(".py") and not name.startswith("test_"):
                yield Path(dirpath) / name


def docstring_documents(root: Path) -> Iterator[str]:
    for path in stdlib_sources(root):
        try:
            tree = ast.parse(path.read_bytes(), filename=str(path))
        except (SyntaxError, ValueError):  # a few stdlib files are deliberately invalid
            continue
        yield from _docstrings(tree)


def collect(min_chars: int) -> list[str]:
    """All documents, collapsed, at least `min_chars` long, deduplicated (first one wins)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    seen: set[str] = set()
    docs: list[str] = []
    for raw in (*topic_documents(), *docstring_documents(stdlib)):
        doc = collapse(raw)
        if len(doc) >= min_chars and doc not in seen:
            seen.add(doc)
            docs.append(doc)
    return docs


def split_evenly(docs: list[str], n_files: int) -> list[list[str]]:
    """Consecutive groups of similar byte size: a document goes where its first byte falls."""
    sizes = [len(doc.encode()) + 2 for doc in docs]
    target = sum(sizes) / n_files
    groups: list[list[str]] = [[] for _ in range(n_files)]
    start = 0
    for doc, size in zip(docs, sizes):
        groups[min(int(start / target), n_files - 1)].append(doc)
        start += size
    return [g for g in groups if g]


def write_corpus(out: Path, n_files: int, min_chars: int) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("pydocs_*.txt"):
        old.unlink()
    paths = []
    for i, group in enumerate(split_evenly(collect(min_chars), n_files)):
        path = out / f"pydocs_{i:03d}.txt"
        path.write_text("\n\n".join(group) + "\n", encoding="utf-8")
        paths.append(path)
    return paths


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--files", type=int, default=12)
    parser.add_argument("--min-chars", type=int, default=100, help="drop shorter documents")
    args = parser.parse_args(argv)
    paths = write_corpus(args.out, args.files, args.min_chars)
    total = sum(p.stat().st_size for p in paths)
    print(f"wrote {len(paths)} files, {total / 1e6:.2f} MB, with Python {sys.version.split()[0]}")


if __name__ == "__main__":
    main()
