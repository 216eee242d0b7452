"""Train the bundled byte-level BPE (`titanlite/data/assets/pydocs_2k.tiktoken`) on the bundled corpus.

Why our own trainer: it is small, deterministic and offline, and it guarantees that the file is
*consistent with tiktoken's encoder*. tiktoken does not replay a merge list; it repeatedly merges the
adjacent pair whose concatenated bytes have the lowest rank. A classic trainer that only merges the
chosen pair can disagree with that (when the same bytes are reachable through another split), so
here every affected pre-token is re-segmented with tiktoken's own rule after each merge. The
training segmentation is therefore exactly what tiktoken will produce with the written ranks.

Algorithm: count pre-token frequencies (Llama 3 regex), then repeatedly merge the most frequent
adjacent pair (ties: lowest pair bytes), updating pair counts incrementally for the pre-tokens
that contain the new token's bytes as an adjacent pair. Takes a few seconds for 2048 tokens.

    python -m titanlite.tools.build_tokenizer [--vocab-size 2048] [--corpus DIR] [--out FILE]
"""

from __future__ import annotations

import argparse
import base64
import heapq
import time
from collections import Counter, defaultdict
from collections.abc import Iterable
from pathlib import Path

import regex

from titanlite.data.tiktoken_bpe import BUNDLED_VOCAB, LLAMA3_PATTERN

DEFAULT_CORPUS = Path(__file__).resolve().parents[1] / "data" / "corpus"

Pair = tuple[int, int]


def count_pretokens(texts: Iterable[str]) -> Counter[bytes]:
    """Frequency of each pre-token (the pieces BPE merges never cross), as UTF-8 bytes."""
    pattern = regex.compile(LLAMA3_PATTERN)
    counts: Counter[bytes] = Counter()
    for text in texts:
        counts.update(piece.encode() for piece in pattern.findall(text))
    return counts


class BPETrainer:
    """Byte-level BPE whose ranks reproduce, under tiktoken's encoder, the training segmentation."""

    def __init__(self, word_counts: dict[bytes, int]) -> None:
        self.token_bytes: list[bytes] = [bytes([b]) for b in range(256)]
        self.ranks: dict[bytes, int] = {tok: i for i, tok in enumerate(self.token_bytes)}
        words = sorted(word_counts)  # deterministic word indices
        self.words: list[list[int]] = [list(w) for w in words]  # token ids (= ranks) per pre-token
        self.freqs: list[int] = [word_counts[w] for w in words]
        self.pair_count: dict[Pair, int] = defaultdict(int)
        self.pair_words: dict[Pair, set[int]] = defaultdict(set)
        for wi, word in enumerate(self.words):
            self._add(wi, word)
        self.heap = [self._entry(pair) for pair in self.pair_count]
        heapq.heapify(self.heap)

    def _entry(self, pair: Pair) -> tuple[int, bytes, bytes, int, int]:
        a, b = pair
        return (-self.pair_count[pair], self.token_bytes[a], self.token_bytes[b], a, b)

    def _add(self, wi: int, word: list[int]) -> None:
        for pair in zip(word, word[1:]):
            self.pair_count[pair] += self.freqs[wi]
            self.pair_words[pair].add(wi)

    def _remove(self, wi: int, word: list[int]) -> None:
        for pair in zip(word, word[1:]):
            self.pair_count[pair] -= self.freqs[wi]
            self.pair_words[pair].discard(wi)

    def settle(self, word: list[int]) -> list[int]:
        """tiktoken's rule: merge the leftmost adjacent pair of lowest rank until none is a token."""
        parts = list(word)
        while len(parts) > 1:
            best_rank, best_i = len(self.token_bytes), -1
            for i in range(len(parts) - 1):
                rank = self.ranks.get(self.token_bytes[parts[i]] + self.token_bytes[parts[i + 1]])
                if rank is not None and rank < best_rank:
                    best_rank, best_i = rank, i
            if best_i < 0:
                break
            parts[best_i : best_i + 2] = [best_rank]
        return parts

    def _best_pair(self) -> Pair | None:
        while self.heap:
            neg_count, _, _, a, b = heapq.heappop(self.heap)
            if neg_count < 0 and self.pair_count.get((a, b)) == -neg_count:  # else a stale entry
                return a, b
        return None

    def merge_once(self) -> bool:
        """Add one token (the most frequent pair); False when no pair is left."""
        pair = self._best_pair()
        if pair is None:
            return False
        new = self.token_bytes[pair[0]] + self.token_bytes[pair[1]]
        self.ranks[new] = len(self.token_bytes)
        self.token_bytes.append(new)
        affected: set[int] = set()  # pre-tokens where tiktoken would now merge `new`
        for i in range(1, len(new)):
            left, right = self.ranks.get(new[:i]), self.ranks.get(new[i:])
            if left is not None and right is not None:
                affected |= self.pair_words.get((left, right), set())
        touched: set[Pair] = set()
        for wi in sorted(affected):
            old = self.words[wi]
            self._remove(wi, old)
            self.words[wi] = self.settle(old)
            self._add(wi, self.words[wi])
            touched.update(zip(old, old[1:]), zip(self.words[wi], self.words[wi][1:]))
        for p in touched:
            if self.pair_count[p] > 0:
                heapq.heappush(self.heap, self._entry(p))
            else:
                del self.pair_count[p], self.pair_words[p]
        return True

    def train(self, vocab_size: int) -> dict[bytes, int]:
        while len(self.token_bytes) < vocab_size and self.merge_once():
            pass
        return dict(self.ranks)


def write_tiktoken(ranks: dict[bytes, int], path: Path) -> None:
    lines = [f"{base64.b64encode(tok).decode()} {rank}\n" for tok, rank in sorted(ranks.items(), key=lambda x: x[1])]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(lines), encoding="ascii")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS, help="directory of .txt files")
    parser.add_argument("--vocab-size", type=int, default=2048, help="BPE ranks, including the 256 bytes")
    parser.add_argument("--out", type=Path, default=BUNDLED_VOCAB)
    args = parser.parse_args(argv)
    start = time.perf_counter()
    texts = (p.read_text(encoding="utf-8") for p in sorted(args.corpus.glob("*.txt")))
    ranks = BPETrainer(count_pretokens(texts)).train(args.vocab_size)
    write_tiktoken(ranks, args.out)
    print(f"wrote {len(ranks)} ranks to {args.out} in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
