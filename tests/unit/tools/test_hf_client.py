"""`transformers` as a real client of titanlite's Hugging Face folders, both directions.

One tiny model with the bundled vocabulary is exported once (module fixture, with its tokenizer files);
`AutoModelForCausalLM`, `AutoTokenizer` and `pipeline` load it as a user would. Logits must agree within
1e-4 relative, tokenizer ids exactly (also those of llama3 and qwen3 exports of a user's own
`tokenizer.json`), greedy generation token for token. The reverse direction imports
`save_pretrained` folders (untied and tied); a config that does not match the flavor is one line.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import pickle
import shutil
from contextlib import redirect_stderr, redirect_stdout

import pytest
import torch
from builders import config, llama3_sized_tiktoken

from harness import ROOT, tiny_args
from titanlite.checkpoint.hf import check_hf_config, export_hf, import_hf
from titanlite.data.hf_tokenizer import hf_tokenizer_files
from titanlite.data.tokenizer import Tokenizer, build_tokenizer
from titanlite.data.tokenizer_json import TOKENIZER_CONFIG, TOKENIZER_JSON
from titanlite.errors import CheckpointError, run_cli
from titanlite.models import qwen3
from titanlite.models.llama3 import SPEC, Transformer, llama3_configs
from titanlite.models.llama3.rope import rope_tables
from titanlite.planning.run_plan import RunPlan
from titanlite.tools.generate import generate
from titanlite.tools.generate import main as generate_main
from titanlite.tools.sampling import next_token

transformers = pytest.importorskip("transformers")

TOK = build_tokenizer(None)
ARGS = tiny_args(n_layers=2, vocab_size=TOK.n_words)
SEQ = 64
TEXTS = [
    "The Python interpreter reads a file.\n\n    def f(x):\n\treturn x ** 2  # 12345",
    "naïve café, 日本語 😀  trailing spaces   ",
    "before<|end_of_text|>after <|begin_of_text|> <|reserved_special_token_3|>",
]


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def titan_model(args=ARGS, seed=1) -> Transformer:
    model = Transformer(args, seq_len=SEQ)
    model.init_weights(seed=seed)
    return model.eval()


def write_tokenizer(tokenizer: Tokenizer, folder) -> None:
    for name, text in hf_tokenizer_files(tokenizer, SEQ).items():
        (folder / name).write_text(text)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    model = titan_model()
    out = tmp_path_factory.mktemp("hf") / "export"
    old = os.umask(0o022)
    try:
        export_hf(
            model,
            out,
            adapter=SPEC.hf_adapter,
            bos_id=TOK.bos_id,
            eos_id=TOK.eos_id,
            write_extra=lambda folder: write_tokenizer(TOK, folder),
        )
    finally:
        os.umask(old)
    return model, out


def test_export_loads_whole_in_transformers(exported):
    model, out = exported
    assert {p.name: p.stat().st_mode & 0o777 for p in out.iterdir()} == {
        name: 0o644
        for name in (
            "config.json",
            "generation_config.json",
            "model-00001-of-00001.safetensors",
            "model.safetensors.index.json",
            "tokenizer.json",
            "tokenizer_config.json",
        )
    }
    assert "chat_template" not in (out / "tokenizer_config.json").read_text()
    tok = transformers.AutoTokenizer.from_pretrained(str(out))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    ids = torch.tensor([TOK.encode(TEXTS[0], bos=True, eos=False)[:SEQ]])
    with torch.no_grad():
        assert rel_diff(hf(ids).logits, model(ids)) < 1e-4
    prompt = "The Python interpreter"
    prompt_ids = tok(prompt, return_tensors="pt")["input_ids"]
    assert prompt_ids[0].tolist() == TOK.encode(prompt, bos=True, eos=False)
    greedy = hf.generate(prompt_ids, max_new_tokens=12)[0, prompt_ids.shape[1] :].tolist()
    assert greedy == generate(model, prompt_ids[0].tolist(), 12, eos_id=TOK.eos_id)
    # Negative control: another model's generation differs.
    assert greedy != generate(titan_model(seed=7), prompt_ids[0].tolist(), 12, eos_id=TOK.eos_id)
    pipe = transformers.pipeline("text-generation", model=hf, tokenizer=tok)
    text = pipe(prompt, max_new_tokens=12)[0]["generated_text"]
    assert text == prompt + TOK.decode(greedy)


def _check_ids(tokenizer: Tokenizer, hf_tok) -> None:
    for text in TEXTS:
        ours = tokenizer.encode(text, bos=True, eos=False)
        # Special-token strings in text: plain text for titanlite, the special token for HF by default.
        assert hf_tok(text, split_special_tokens=True)["input_ids"] == ours
        assert hf_tok(text)["input_ids"] == [tokenizer.bos_id, *tokenizer.model.encode(text, allowed_special="all")]
        assert hf_tok.decode(ours) == tokenizer.decode(ours)
    assert (hf_tok.bos_token_id, hf_tok.eos_token_id) == (tokenizer.bos_id, tokenizer.eos_id)
    assert hf_tok.convert_ids_to_tokens(tokenizer.eos_id) == "<|end_of_text|>"


def test_tokenizer_ids_equal(exported):
    _check_ids(TOK, transformers.AutoTokenizer.from_pretrained(str(exported[1])))


def test_llama3_sized_tokenizer_ids_equal(tmp_path):
    """A 128,000-rank file gets Llama 3's special tokens (ids 128000+): the bundled ranks padded with
    tokens no UTF-8 text can produce (0xf8 never occurs in UTF-8). titanlite reading the HF files it wrote
    (`model.tokenizer_path` = the folder) gives the same ids, vocabulary and BOS/EOS as the tiktoken file,
    special-token strings as plain text, also after a pickle (the loader's workers)."""
    tokenizer = llama3_sized_tiktoken(tmp_path)
    assert (tokenizer.bos_id, tokenizer.n_words) == (128000, 128256)
    write_tokenizer(tokenizer, tmp_path)
    _check_ids(tokenizer, transformers.AutoTokenizer.from_pretrained(str(tmp_path)))
    ours = build_tokenizer(str(tmp_path))
    assert (ours.n_words, ours.bos_id, ours.eos_id) == (128256, 128000, 128001)
    corpus = (ROOT / "titanlite/data/corpus/pydocs_003.txt").read_text(encoding="utf-8")[:100_000]
    for copy in (ours, pickle.loads(pickle.dumps(ours))):
        for text in [*TEXTS, corpus]:
            assert copy.encode(text, bos=True, eos=True) == tokenizer.encode(text, bos=True, eos=True)
    assert RunPlan.build(config(model__tokenizer_path=str(tmp_path)), 1).model_args.vocab_size == 128256


# --- the export's tokenizer per family: training's ids in transformers ------------------------------------

NUMBERS = "In 2007 the 12,345th call to f(x) returned 42 (0.5 s)."
"""A text with numbers: a pre-tokenization other than training's splits them otherwise (one id per digit)."""
QWEN3_ARGS = qwen3.ModelArgs(
    dim=64, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=16, vocab_size=TOK.n_words, ffn_dim=96, max_seq_len=SEQ
)
FAMILIES = {"llama3": (SPEC, "llama"), "qwen3": (qwen3.SPEC, "qwen3")}
"""Each family's spec and the `model_type` its export's config.json names."""
OWN_CONFIGS = {
    "own_with_bos": {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"},
    # Qwen3's published tokenizer_config.json: no BOS, its family's class.
    "own_without_bos": {"bos_token": None, "eos_token": "<|end_of_text|>", "tokenizer_class": "Qwen2Tokenizer"},
}


def family_model(family: str) -> torch.nn.Module:
    """A one-block model of `family` with the bundled vocabulary."""
    if family == "llama3":
        return titan_model(dataclasses.replace(ARGS, n_layers=1))
    model = qwen3.Transformer(QWEN3_ARGS, seq_len=SEQ)
    model.init_weights(seed=1)
    return model.eval()


def own_tokenizer(folder, source: str) -> Tokenizer:
    """A user's own tokenizer.json (the bundled vocabulary's, with the library's byte-level post-processor
    alone, as a tokenizer trained with `tokenizers` has) and its tokenizer_config.json (`OWN_CONFIGS`)."""
    data = json.loads(hf_tokenizer_files(TOK, SEQ)[TOKENIZER_JSON])
    data["post_processor"] = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": True}
    folder.mkdir()
    (folder / TOKENIZER_JSON).write_text(json.dumps(data))
    (folder / TOKENIZER_CONFIG).write_text(json.dumps(OWN_CONFIGS[source]))
    return build_tokenizer(str(folder))


@pytest.mark.parametrize("source", ["bundled", *OWN_CONFIGS])
@pytest.mark.parametrize("family", FAMILIES)
def test_the_export_tokenizes_in_transformers_as_training_did(tmp_path, family, source):
    """An export of either family (its `config.json` names the family, whose class `transformers` would
    otherwise pick), trained on the bundled vocabulary or on the user's own tokenizer.json with or without
    BOS: `AutoTokenizer` gives training's ids for a text with numbers, BOS first exactly where training put
    one. Training also ends each document with EOS; encoding a text in transformers adds none (generation
    stops at it). The user's files copied as they are tokenize otherwise (the negative control)."""
    tokenizer = TOK if source == "bundled" else own_tokenizer(tmp_path / "own", source)
    assert (tokenizer.bos_id is None) is (source == "own_without_bos")
    spec, model_type = FAMILIES[family]
    out = tmp_path / "export"
    export_hf(
        family_model(family),
        out,
        adapter=spec.hf_adapter,
        bos_id=tokenizer.bos_id,
        eos_id=tokenizer.eos_id,
        write_extra=lambda folder: write_tokenizer(tokenizer, folder),
    )
    assert json.loads((out / "config.json").read_text())["model_type"] == model_type
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(out))
    ids = hf_tok(NUMBERS)["input_ids"]
    assert ids == tokenizer.encode(NUMBERS, bos=True, eos=False)
    assert (ids[0] == hf_tok.bos_token_id == tokenizer.bos_id) is (tokenizer.bos_id is not None)
    assert tokenizer.encode(NUMBERS, bos=True, eos=True) == [*ids, hf_tok.eos_token_id]
    assert build_tokenizer(str(out)).encode(NUMBERS, bos=True, eos=True) == [*ids, tokenizer.eos_id]
    if source != "bundled":
        for name in (TOKENIZER_JSON, TOKENIZER_CONFIG):
            shutil.copy(tmp_path / "own" / name, out / name)
        assert transformers.AutoTokenizer.from_pretrained(str(out))(NUMBERS)["input_ids"] != ids


def hf_config(**over):
    base = dict(
        hidden_size=ARGS.dim,
        intermediate_size=ARGS.ffn_hidden_dim,
        num_hidden_layers=ARGS.n_layers,
        num_attention_heads=ARGS.n_heads,
        num_key_value_heads=ARGS.kv_heads,
        vocab_size=ARGS.vocab_size,
        rms_norm_eps=ARGS.norm_eps,
        rope_theta=ARGS.rope_theta,
        max_position_embeddings=SEQ,
    )
    return transformers.LlamaConfig(**{**base, **over})


@pytest.mark.parametrize("tied", [False, True])
def test_import_of_save_pretrained(tmp_path, tied):
    """A tied checkpoint (as Llama 3.2 ships) loads into the untied model: the embedding is copied."""
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(hf_config(tie_word_embeddings=tied)).eval()
    hf.save_pretrained(str(tmp_path))
    model = titan_model(seed=5)
    import_hf(model, tmp_path, adapter=SPEC.hf_adapter)
    ids = torch.randint(0, ARGS.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert rel_diff(model(ids), hf(ids).logits) < 1e-4
    assert torch.equal(model.output.weight, model.tok_embeddings.weight) is tied


def test_mismatched_config_is_one_line_before_any_rank(tmp_path, capsys):
    """The preflight (what run_train.sh runs before starting ranks) reads config.json: one line, exit 2."""
    transformers.LlamaForCausalLM(hf_config(rope_theta=10000.0)).save_pretrained(str(tmp_path / "hf"))
    with pytest.raises(CheckpointError, match=r"rope_theta = 10000.0 in its config.json, 500000.0 in this model$"):
        check_hf_config(tmp_path / "hf", ARGS, SPEC.hf_adapter)
    from titanlite.launcher.preflight import main as preflight_main

    argv = ["--training.seq_len", "64", "--job.dump_folder", str(tmp_path / "run")]
    argv += ["--checkpoint.initial_load_path", str(tmp_path / "hf"), "--checkpoint.initial_load_in_hf"]
    capsys.readouterr()
    assert run_cli(preflight_main, argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "does not match model.flavor 'debugmodel'" in err, err
    assert "hidden_size = 64 in its config.json, 256 in model.flavor 'debugmodel'" in err
    assert "rope_theta = 10000.0 in its config.json, 500000.0" in err
    # An untied checkpoint cannot load into a tied model.
    tied = tiny_args(n_layers=2, vocab_size=TOK.n_words, tie_embeddings=True)
    with pytest.raises(CheckpointError, match="tie_word_embeddings = False in its config.json, True in"):
        check_hf_config(tmp_path / "hf", tied, SPEC.hf_adapter)


def test_1b_flavor_matches_llama_3_2_1b():
    """Llama-3.2-1B's published config.json fits the 1B flavor with Llama 3's vocabulary, and its factor-32
    RoPE frequencies are transformers' own."""
    published = {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "hidden_act": "silu",
        "max_position_embeddings": 131072,
        "model_type": "llama",
        "rms_norm_eps": 1e-05,
        "rope_scaling": {
            "factor": 32.0,
            "high_freq_factor": 4.0,
            "low_freq_factor": 1.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
        "rope_theta": 500000.0,
        "tie_word_embeddings": True,
        "vocab_size": 128256,
        "attention_bias": False,
        "mlp_bias": False,
    }
    args = dataclasses.replace(llama3_configs["1B"], vocab_size=128256)
    assert SPEC.hf_adapter.config_mismatches(published, args) == []
    assert SPEC.hf_adapter.config_mismatches(
        {**published, "rope_scaling": {**published["rope_scaling"], "factor": 8.0}}, args
    )
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](transformers.LlamaConfig(**published), "cpu")
    _, sin = rope_tables(args, 2)  # position 1: the angle is the frequency itself (all below pi/2)
    torch.testing.assert_close(torch.asin(sin[1].double()), inv_freq.double(), rtol=1e-5, atol=1e-9)
    _, sin8 = rope_tables(dataclasses.replace(args, rope_scaling_factor=8.0), 2)  # negative control: 3.1's factor
    assert not torch.allclose(torch.asin(sin8[1].double()), inv_freq.double(), rtol=1e-3)


def test_generate_cli_greedy_equals_transformers(exported, capsys):
    model, out = exported
    prompt = "The Python interpreter"
    argv = ["--hf", str(out), "--prompt", prompt, "--max_new_tokens", "12"]
    argv += ["--training.seq_len", "64", "--model.flavor", "debugmodel"]
    # The CLI builds the configured flavor: run it on the tiny shapes by exporting them as the flavor.
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    ids = torch.tensor([TOK.encode(prompt, bos=True, eos=False)])
    want = prompt + TOK.decode(hf.generate(ids, max_new_tokens=12)[0, ids.shape[1] :].tolist())
    flavors = dict(llama3_configs)
    try:
        llama3_configs["debugmodel"] = ARGS
        stdout, stderr = io.StringIO(), io.StringIO()
        with redirect_stdout(stdout), redirect_stderr(stderr):
            assert run_cli(generate_main, argv) == 0, stderr.getvalue()
    finally:
        llama3_configs.clear()
        llama3_configs.update(flavors)
    assert stdout.getvalue() == want + "\n"
    assert "tokens/s" in stderr.getvalue()
    assert run_cli(generate_main, ["--help"]) == 0 and "--max_new_tokens" in capsys.readouterr().out


def test_sampling():
    logits = torch.tensor([0.1, 3.0, 2.9, -1.0])
    assert next_token(logits, 0.0, 0, None) == 1
    assert next_token(logits, 1.0, 1, torch.Generator().manual_seed(0)) == 1  # top-1 is greedy
    draws = [next_token(logits, 1.0, 2, torch.Generator().manual_seed(s)) for s in range(40)]
    assert set(draws) == {1, 2}  # top-2 never draws the others
    again = [next_token(logits, 1.0, 2, torch.Generator().manual_seed(s)) for s in range(40)]
    assert draws == again


def test_export_help(capsys):
    from titanlite.tools.hf import main as hf_main

    assert run_cli(hf_main, ["export", "--help"]) == 0
    out = capsys.readouterr().out
    assert "--checkpoint DIR" in out and "scripts/python.sh -m titanlite.tools.hf export" in out
