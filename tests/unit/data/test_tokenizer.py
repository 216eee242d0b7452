"""The bundled BPE round-trips any text, the rank file agrees with tiktoken, Llama 3 ids line up."""

from pathlib import Path

import pytest
import regex

from titanlite.data.tiktoken_bpe import (
    BUNDLED_VOCAB,
    LLAMA3_N_RANKS,
    LLAMA3_PATTERN,
    TiktokenTokenizer,
    load_ranks,
    special_tokens,
)
from titanlite.data.tokenizer import Tokenizer, build_tokenizer
from titanlite.errors import ConfigError
from titanlite.tools.build_tokenizer import BPETrainer, count_pretokens, write_tiktoken

CORPUS = Path(__file__).resolve().parents[3] / "titanlite" / "data" / "corpus"


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return build_tokenizer(None)


def test_bundled_vocab_ids(tok):
    assert tok.n_words == 2048 + 8
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (2048, 2049, -1)
    assert build_tokenizer("").n_words == tok.n_words


def test_round_trip_corpus(tok):
    text = (CORPUS / "pydocs_003.txt").read_text(encoding="utf-8")[:50_000]
    ids = tok.encode(text, bos=False, eos=False)
    assert tok.decode(ids) == text
    assert len(text.encode()) / len(ids) > 2.5  # the merges actually compress English prose
    assert max(ids) < 2048


@pytest.mark.parametrize(
    "text",
    [
        "",
        "héllo wörld — ünïcödé ✓",
        "emoji 👩‍👩‍👧‍👦 🚀🔥 and CJK 漢字かなカナ 한국어",
        "control \x00\x01\x7f and lone surrogate-ish \ufffd \u200b\u2028 tabs\t\tand\r\nCRLF",
        "   leading and trailing spaces   \n\n\n",
        "x" * 5000,
    ],
)
def test_round_trip_unicode(tok, text):
    assert tok.decode(tok.encode(text, bos=False, eos=False)) == text


def test_bos_eos_placement(tok):
    plain = tok.encode("Hello world", bos=False, eos=False)
    assert tok.encode("Hello world", bos=True, eos=True) == [tok.bos_id, *plain, tok.eos_id]
    assert tok.encode("Hello world", bos=True, eos=False) == [tok.bos_id, *plain]
    assert tok.encode("Hello world", bos=False, eos=True) == [*plain, tok.eos_id]


def test_special_token_text_is_plain_text(tok):
    text = "<|begin_of_text|> <|end_of_text|><|reserved_special_token_0|>"
    ids = tok.encode(text, bos=False, eos=False)
    assert tok.bos_id not in ids and tok.eos_id not in ids
    assert tok.decode(ids) == text


def test_llama3_special_layout():
    specials = special_tokens(LLAMA3_N_RANKS)
    assert len(specials) == 256
    assert specials["<|begin_of_text|>"] == 128000
    assert specials["<|end_of_text|>"] == 128001
    assert specials["<|start_header_id|>"] == 128006
    assert specials["<|eot_id|>"] == 128009
    assert sorted(specials.values()) == list(range(128000, 128256))
    small = special_tokens(300)
    assert len(small) == 8 and small["<|begin_of_text|>"] == 300 and small["<|end_of_text|>"] == 301


def _train_tiny(tmp_path: Path, text: str, vocab_size: int) -> tuple[BPETrainer, Path]:
    trainer = BPETrainer(count_pretokens([text]))
    ranks = trainer.train(vocab_size)
    path = tmp_path / "tiny.tiktoken"
    write_tiktoken(ranks, path)
    return trainer, path


def test_trained_ranks_reproduce_training_segmentation(tmp_path):
    text = (
        "The quick brown fox jumps over the lazy dog. The dog sleeps; the fox thinks. "
        "aaaa aaa aa abcabcabc bcbcbc abab 1234567 12 123 ünïcödé ünï 🚀🚀 the the the\n"
    ) * 3
    trainer, path = _train_tiny(tmp_path, text, 320)
    tok = TiktokenTokenizer(path)
    assert tok.n_words == 328 and tok.bos_id == 320
    segmentation = {b"".join(trainer.token_bytes[t] for t in word): word for word in trainer.words}
    expected = [t for piece in regex.findall(LLAMA3_PATTERN, text) for t in segmentation[piece.encode()]]
    assert tok.encode(text, bos=False, eos=False) == expected
    assert len(expected) < len(text) / 2


def test_trainer_is_deterministic(tmp_path):
    text = "ab ab ba ba cd cd dc dc " * 5
    first = BPETrainer(count_pretokens([text])).train(270)
    assert BPETrainer(count_pretokens([text])).train(270) == first
    assert 256 < len(first) <= 270  # stops early when no pair is left


def test_bundled_vocab_file_is_well_formed():
    ranks = load_ranks(BUNDLED_VOCAB)
    assert len(ranks) == 2048
    assert all(ranks[bytes([b])] == b for b in range(256))


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="model.tokenizer_path: no such file"):
        build_tokenizer(str(tmp_path / "nope.model"))
    bad = tmp_path / "bad.model"
    bad.write_text("this is not base64\n")
    with pytest.raises(ConfigError, match="not a tiktoken BPE file"):
        build_tokenizer(str(bad))


def test_a_file_without_every_single_byte_is_one_clear_error(tmp_path):
    """tiktoken would panic in Rust on the first text needing a missing byte; the load says so instead."""
    ranks = {bytes([b]): i for i, b in enumerate(b for b in range(256) if b not in (0x80, 0xFF))}
    ranks.update({b"ab": 254, b"cd": 255})
    path = tmp_path / "partial.tiktoken"
    write_tiktoken(ranks, path)
    with pytest.raises(ConfigError, match=r"partial.tiktoken: 2 of the 256 single bytes have no token \(first: 0x80\)"):
        build_tokenizer(str(path))
