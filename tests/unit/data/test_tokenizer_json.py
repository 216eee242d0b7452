"""A Hugging Face `tokenizer.json` as `model.tokenizer_path`: the same ids as the tiktoken file it was made
from, special-token strings in text stay plain text (also in a pickled copy, as the loader's workers get
it), BOS/EOS from `tokenizer_config.json`, and bad files are one line.

The HF files are made here from the bundled 2k vocabulary (`data/hf_tokenizer.py`, `transformers`'
converter); nothing is downloaded. A Llama 3-sized one (128,000 ranks, Llama 3's 256 special tokens) is
checked in `test_hf_client.py`, which converts one already. Through `run_train.sh`: a checkpointed run with
a tokenizer.json resumes exactly.
"""

from __future__ import annotations

import json
import pickle
import shutil
import sys
from pathlib import Path

import pytest

from harness import SHALLOW, SMALL, resume_from, train
from titanlite.checkpoint.fingerprint import tokenizer_fingerprint
from titanlite.data.hf_tokenizer import hf_tokenizer_files
from titanlite.data.sources import open_source
from titanlite.data.tiktoken_bpe import BUNDLED_VOCAB, TiktokenTokenizer
from titanlite.data.tokenizer import build_tokenizer
from titanlite.data.tokenizer_json import TOKENIZER_CONFIG, TOKENIZER_JSON, HFTokenizer
from titanlite.errors import CheckpointError, ConfigError, run_cli
from titanlite.launcher import preflight

pytest.importorskip("transformers")  # the converter that writes the HF files from the tiktoken ones

TEXTS = [
    "The Python interpreter reads a file.\n\n    def f(x):\n\treturn x ** 2  # 12345",
    "naïve café, 日本語 😀 👩‍👩‍👧‍👦  trailing spaces   \r\n\r\n",
    "control \x00\x01\x7f \ufffd \u200b\u2028 tabs\t\tand 1234567890 it's they'll",
    "",
]
SPECIAL_TEXT = "before<|end_of_text|>after <|begin_of_text|> <|reserved_special_token_3|><|eot_id|>"


def export(tokenizer: TiktokenTokenizer, folder: Path) -> Path:
    """`tokenizer` as HF tokenizer files in `folder` (made if needed)."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in hf_tokenizer_files(tokenizer, 64).items():
        (folder / name).write_text(text)
    return folder


@pytest.fixture(scope="module")
def bundled(tmp_path_factory) -> tuple[TiktokenTokenizer, HFTokenizer]:
    tiktoken = TiktokenTokenizer(BUNDLED_VOCAB)
    folder = export(tiktoken, tmp_path_factory.mktemp("bundled_hf"))
    hf = build_tokenizer(str(folder))
    assert isinstance(hf, HFTokenizer)
    return tiktoken, hf


def test_bundled_corpus_ids_equal(bundled):
    """Every document of the bundled corpus, as the loader encodes it (BOS + text + EOS), and odd text."""
    tiktoken, hf = bundled
    source = open_source("", "text")
    docs = [source.document(d) for d in range(source.num_documents)]
    assert len(docs) > 3000
    assert [hf.encode(d, bos=True, eos=True) for d in docs] == [tiktoken.encode(d, bos=True, eos=True) for d in docs]
    for text in TEXTS:
        ids = hf.encode(text, bos=False, eos=False)
        assert ids == tiktoken.encode(text, bos=False, eos=False) and hf.decode(ids) == text
    assert (hf.n_words, hf.bos_id, hf.eos_id, hf.pad_id) == (tiktoken.n_words, 2048, 2049, -1) == (2056, 2048, 2049, -1)


def test_special_token_strings_stay_plain_text(bundled):
    """Also after a pickle (the loader's workers): the library's own pickle drops that setting."""
    tiktoken, hf = bundled
    expected = tiktoken.encode(SPECIAL_TEXT, bos=False, eos=False)
    assert max(expected) < 2048  # no special token (2048 and up)
    for tok in (hf, pickle.loads(pickle.dumps(hf))):
        assert tok.encode(SPECIAL_TEXT, bos=False, eos=False) == expected
        assert tok.decode(expected) == SPECIAL_TEXT


def test_bos_and_eos_come_from_tokenizer_config(bundled, tmp_path):
    """Qwen3's way (no BOS, EOS named), GPT-2's (`add_bos_token` false), the older `{"content": ...}` form,
    and no config at all (the tokens' usual names); a name that is not a token, an entry of no token's form
    (a number, a list, a dict without `content`), or an `add_bos_token` that is not a boolean, is one line."""
    source = Path(bundled[1].path)
    shutil.copy(source / TOKENIZER_JSON, tmp_path / TOKENIZER_JSON)
    bare = build_tokenizer(str(tmp_path / TOKENIZER_JSON))
    assert (bare.bos_id, bare.eos_id) == (2048, 2049)
    cfg = tmp_path / TOKENIZER_CONFIG
    cfg.write_text(json.dumps({"bos_token": None, "eos_token": "<|reserved_special_token_0|>"}))
    qwen_like = build_tokenizer(str(tmp_path))
    assert (qwen_like.bos_id, qwen_like.eos_id) == (None, 2050)
    plain = qwen_like.encode("a b", bos=False, eos=False)
    assert qwen_like.encode("a b", bos=True, eos=True) == [*plain, 2050]
    cfg.write_text(json.dumps({"bos_token": {"content": "<|reserved_special_token_1|>"}}))
    assert (build_tokenizer(str(tmp_path)).bos_id, build_tokenizer(str(tmp_path)).eos_id) == (2051, 2049)
    # GPT-2's way: BOS and EOS one token, `add_bos_token` false: documents are separated by EOS alone.
    gpt2 = {"bos_token": "<|reserved_special_token_0|>", "eos_token": "<|reserved_special_token_0|>"}
    cfg.write_text(json.dumps({**gpt2, "add_bos_token": False}))
    gpt2_like = build_tokenizer(str(tmp_path))
    assert (gpt2_like.bos_id, gpt2_like.eos_id) == (None, 2050)
    assert gpt2_like.encode("a b", bos=True, eos=True) == [*plain, 2050]
    cfg.write_text(json.dumps({**gpt2, "add_bos_token": True}))
    assert build_tokenizer(str(tmp_path)).encode("a b", bos=True, eos=True) == [2050, *plain, 2050]
    cfg.write_text(json.dumps({**gpt2, "add_bos_token": "no"}))
    with pytest.raises(ConfigError, match=r"tokenizer_config.json: add_bos_token 'no' is not true or false"):
        build_tokenizer(str(tmp_path))
    cfg.write_text(json.dumps({"eos_token": "<|im_end|>"}))
    with pytest.raises(ConfigError, match=r"tokenizer_config.json: eos_token '<\|im_end\|>' is not a token of"):
        build_tokenizer(str(tmp_path))
    # An entry of another type is refused, not read as "no token" (which would train without BOS).
    for entry in (2049, ["<|begin_of_text|>"], {"__type": "AddedToken"}):
        cfg.write_text(json.dumps({"bos_token": entry}))
        with pytest.raises(ConfigError, match=r"tokenizer_config.json: bos_token .* is not a token \(a string, "):
            build_tokenizer(str(tmp_path))


def test_the_fingerprint_covers_the_config(bundled, tmp_path):
    """A resume compares it: another BOS/EOS is another tokenizer, the same files elsewhere are the same."""
    shutil.copytree(bundled[1].path, tmp_path / "copy")
    same = tokenizer_fingerprint(str(tmp_path / "copy"))
    assert same["digest"] == tokenizer_fingerprint(bundled[1].path)["digest"]
    assert same["digest"] == tokenizer_fingerprint(str(tmp_path / "copy" / TOKENIZER_JSON))["digest"]
    (tmp_path / "copy" / TOKENIZER_CONFIG).write_text(json.dumps({"eos_token": "<|reserved_special_token_0|>"}))
    assert tokenizer_fingerprint(str(tmp_path / "copy"))["digest"] != same["digest"]
    assert tokenizer_fingerprint("")["digest"] != same["digest"]


def test_bad_files_are_one_line(tmp_path):
    with pytest.raises(ConfigError, match=rf"model.tokenizer_path {tmp_path}: a folder without a tokenizer.json"):
        build_tokenizer(str(tmp_path))
    broken = tmp_path / "broken.json"
    broken.write_text('{"version": "1.0", "model": ')
    with pytest.raises(ConfigError, match=r"broken.json: not a Hugging Face tokenizer.json \(EOF while parsing"):
        build_tokenizer(str(broken))
    (tmp_path / TOKENIZER_JSON).write_text("{}")
    with pytest.raises(ConfigError, match=r"tokenizer.json: not a Hugging Face tokenizer.json \(Model missing"):
        build_tokenizer(str(tmp_path))


def test_a_broken_config_is_one_line(bundled, tmp_path):
    shutil.copy(Path(bundled[1].path) / TOKENIZER_JSON, tmp_path / TOKENIZER_JSON)
    (tmp_path / TOKENIZER_CONFIG).write_text('{"eos_token": ')
    with pytest.raises(ConfigError, match=r"tokenizer_config.json: not JSON \(Expecting value"):
        build_tokenizer(str(tmp_path))


def test_without_the_tokenizers_package_the_preflight_names_the_install(bundled, tmp_path, monkeypatch, capsys):
    """Exit code 2 and one line before any rank starts; the tiktoken format still loads."""
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # `import tokenizers` raises ImportError
    args = ["--job.dump_folder", str(tmp_path / "dump"), "--model.tokenizer_path", bundled[1].path]
    assert run_cli(preflight.main, args) == 2
    err = capsys.readouterr().err.strip()
    assert err.splitlines() == [
        f"titanlite: error: model.tokenizer_path {bundled[1].path} is a Hugging Face tokenizer, which needs the "
        "tokenizers package: pip install -e '.[hf]' (or pip install 'tokenizers>=0.20'; run_train.sh: "
        "TITANLITE_EXTRAS=hf)"
    ]
    assert build_tokenizer(str(BUNDLED_VOCAB)).n_words == 2056


def test_a_resume_compares_the_tokenizer_files(bundled, tmp_path, process_group):
    """As for a tiktoken file, a resume with other tokenizer files stops in one line, even with the tiktoken
    file this tokenizer.json was made from (the fingerprint is the files, not the ids; the same files
    elsewhere have the same one: `test_the_fingerprint_covers_the_config`)."""
    from checkpointed_run import Run

    first = Run(tmp_path / "run", over={"model.tokenizer_path": bundled[1].path})
    first.train(1, 1)
    first.ckpt.close()
    with pytest.raises(
        CheckpointError, match=rf"model.tokenizer_path was {bundled[1].path} \(digest \w+\), this run has bundled"
    ):
        Run(tmp_path / "run").ckpt.load()


@pytest.mark.slow
def test_run_train_with_a_tokenizer_json_resumes_exactly(bundled, tmp_path):
    """Two ranks through run_train.sh, each with a loader worker (the tokenizer crosses a pickle): 4 steps
    with a checkpoint every 2, then step-2 alone resumed to step 4: the same losses, bitwise."""
    common = [
        *SMALL,
        *SHALLOW,
        "--model.tokenizer_path",
        f"{bundled[1].path}/{TOKENIZER_JSON}",
        "--training.steps",
        "4",
    ]
    common += ["--checkpoint.enable", "--checkpoint.interval", "2", "--training.dataloader_num_workers", "1"]
    reference = train(tmp_path / "reference", 2, *common, launcher="run_train").ok()
    resumed = resume_from(
        tmp_path / "reference", tmp_path / "resumed", 2, lambda dump: train(dump, 2, *common, launcher="run_train")
    )
    assert len(reference.losses) == 4
    assert resumed.losses == reference.losses[2:]
