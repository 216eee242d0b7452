"""Bad configs and overrides: each stops in preflight with exit code 2 and one line naming the problem."""

from __future__ import annotations

import base64
import subprocess

import pytest
import torch
from builders import config

from harness import ROOT, child_env
from titanlite.errors import ConfigError, run_cli
from titanlite.launcher import preflight
from titanlite.parallelisms.float8 import unit as float8
from titanlite.parallelisms.parallel_dims import ParallelDims

BASE = str(ROOT / "train_configs/debug_model.toml")

PP2 = ["--parallelism.pipeline_parallel_degree", "2"]
REPLICATE2 = ["--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree", "1"]
F8 = ["--float8.enable", "--float8.emulate"]
AUTO = "auto_filter_small_kn"
# A rule between compile and data-parallel keys: refused by the run plan, so by the preflight.
BUCKETED_FSDP2 = ["--compile.enable", "--compile.bucketing", "transformer_block", "--parallelism.dp_impl", "fsdp2"]
FT2 = ["--fault_tolerance.enable", "--fault_tolerance.group_size", "2"]

# (file text or None for the debug config, overrides, world size, fragments the message must contain)
CASES = [
    (None, ["--trainingg.steps", "3"], 2, ["section 'trainingg'", "did you mean 'training'"]),
    (None, ["--training.step", "3"], 2, ["training.step", "did you mean 'training.steps'"]),
    (None, ["--training.steps", "three"], 2, ["training.steps", "expected int", "'three'"]),
    (None, ["--training.steps", "-5"], 2, ["training.steps", "positive"]),
    (None, ["--parallelism.data_parallel_shard_degree", "3"], 2, ["dp_shard=3", "world size 2"]),
    (None, ["--parallelism.tensor_parallel_degree", "3"], 3, ["tensor_parallel_degree 3", "n_heads 16"]),
    (
        None,
        ["--parallelism.tensor_parallel_degree", "16", "--parallelism.data_parallel_shard_degree", "1"],
        16,
        ["tensor_parallel_degree 16", "n_kv_heads 8"],
    ),
    (None, ["--training.seq_len", "4096"], 2, ["seq_len 4096", "max_seq_len 2048"]),
    (
        None,
        ["--parallelism.context_parallel_degree", "2", "--training.seq_len", "66"],
        2,
        ["seq_len 66", "2 x context_parallel_degree 2"],
    ),
    (None, ["--parallelism.context_parallel_degree", "3"], 2, ["world size 2", "context_parallel_degree 3"]),
    (None, ["--model.tokenizer_path", "/nonexistent/tokenizer.model"], 2, ["tokenizer_path", "/nonexistent"]),
    (None, ["--model.vocab_size", "2000"], 2, ["model.vocab_size 2,000", "tokenizer's 2,056 ids"]),
    (None, ["--training.dataset_path", "/nonexistent/*.jsonl"], 2, ["/nonexistent/*.jsonl"]),
    (None, ["--job.dump_folder", "/etc/passwd/out"], 2, ["dump_folder", "/etc/passwd/out", "not writable"]),
    ("[training]\nsteps = 3\n[model\n", [], 2, ["invalid TOML", "line 3"]),
    (None, ["--model.flavor", "7B"], 2, ["model.flavor", "8B"]),
    (None, ["--compile.bucketing", "everything"], 2, ["compile.bucketing", "transformer_block"]),
    (None, ["--training.global_batch_size", "12"], 2, ["global_batch_size 12", "local_batch_size 8"]),
    (None, ["--training.dataset_virtual_shards", "3"], 2, ["3"]),
    (
        None,
        [
            "--parallelism.dp_impl",
            "fsdp2",
            "--parallelism.data_parallel_replicate_degree",
            "2",
            "--parallelism.data_parallel_shard_degree",
            "1",
        ],
        2,
        ["fsdp2", "data_parallel_shard_degree"],
    ),
    (None, ["--metrics.enable_tensorboard", "perhaps"], 2, ["metrics.enable_tensorboard", "expected bool"]),
    (None, ["--compile.components", "model,optimizer"], 2, ["compile.components", "optimizer"]),
    (None, ["--optimizer.lr"], 2, ["--optimizer.lr", "needs a value"]),
    (None, ["--checkpoint.keep_latest_k", "-1"], 2, ["keep_latest_k", "negative"]),
    (
        None,
        ["--checkpoint.enable", "--checkpoint.local_interval", "1000", "--checkpoint.local_folder", "{tmp}/local"],
        2,
        ["checkpoint.local_interval 1000 is a multiple of checkpoint.interval 50:"],
    ),
    (
        None,
        ["--checkpoint.enable", "--checkpoint.local_interval", "5", "--checkpoint.local_folder", "{tmp}/a_file/x"],
        2,
        ["checkpoint.local_folder", "a_file/x' is not writable: Not a directory"],
    ),
    (None, ["--lr_scheduler.warmup_steps", "-2"], 2, ["warmup_steps", "negative"]),
    (None, ["--parallelism.data_parallel_shard_degree", "0"], 2, ["data_parallel_shard_degree", "-1"]),
    (None, ["--model.name", "gpt2"], 2, ["model.name", "llama3"]),
    ("[training]\nseq_len = 64\nseq_len = 32\n", [], 2, ["invalid TOML"]),
    (None, ["--optimizer.lr", "nan"], 2, ["config key 'optimizer.lr' must be a finite number, got nan"]),
    (None, ["--optimizer.beta1", "1.5"], 2, ["config key 'optimizer.beta1' must be in [0, 1), got 1.5"]),
    (None, ["--optimizer.eps", "-1e-8"], 2, ["optimizer.eps", "positive", "-1e-08"]),
    (None, ["--optimizer.weight_decay", "-0.1"], 2, ["optimizer.weight_decay", "non-negative"]),
    (None, ["--optimizer.name", "SGD"], 2, ["optimizer.name", "AdamW"]),
    (None, ["--comm.train_timeout_seconds", "0"], 2, ["comm.train_timeout_seconds", "positive"]),
    (None, ["--comm.init_timeout_seconds", "-5"], 2, ["comm.init_timeout_seconds", "positive"]),
    (
        None,
        ["--comm.train_timeout_seconds", "10000000000000"],
        2,
        ["comm.train_timeout_seconds", "positive and <= 604800"],
    ),
    (None, ["--model.vocab_size", "99999999999999999999"], 2, ["model.vocab_size", "must fit a 64-bit integer"]),
    (None, ["--training.global_batch_size", "-8"], 2, ["global_batch_size", "-1 (local x dp) or positive"]),
    (None, ["--checkpoint.enable", "--checkpoint.load_step", "3"], 2, ["load_step 3", "step-3 does not exist"]),
    (None, ["--checkpoint.initial_load_path", "/nonexistent"], 2, ["initial_load_path /nonexistent is not a folder"]),
    (None, ["--model.tokenizer_path", "{tmp}/no_bytes.tiktoken"], 2, ["no_bytes.tiktoken", "256 of the 256"]),
    (None, ["--model.tokenizer_path", "{tmp}/broken.json"], 2, ["broken.json: not a Hugging Face tokenizer.json"]),
    (None, ["--model.tokenizer_path", "{tmp}"], 2, ["a folder without a tokenizer.json"]),
    (None, [*PP2, "--parallelism.data_parallel_shard_degree", "2"], 2, ["pp=2 x", "dp_shard=2", "world size 2"]),
    (None, ["--parallelism.pipeline_parallel_degree", "4"], 2, ["world size 2", "pipeline_parallel_degree 4"]),
    (
        None,
        [
            *PP2,
            "--parallelism.pipeline_parallel_stages_per_rank",
            "4",
            "--parallelism.pipeline_parallel_schedule",
            "Interleaved1F1B",
        ],
        2,
        ["8 pipeline stages", "6 blocks"],
    ),
    (None, [*PP2, "--parallelism.pipeline_parallel_microbatch_size", "8"], 2, ["1F1B", "1 microbatches", "degree 2"]),
    (
        None,
        [*PP2, "--parallelism.pipeline_parallel_microbatch_size", "3"],
        2,
        ["local_batch_size 8", "microbatch_size 3"],
    ),
    (
        None,
        [
            *PP2,
            "--parallelism.pipeline_parallel_schedule",
            "GPipe",
            "--parallelism.pipeline_parallel_stages_per_rank",
            "2",
        ],
        2,
        ["GPipe runs one stage per rank"],
    ),
    (None, [*PP2, "--parallelism.pipeline_parallel_split_points", "6"], 2, ["split_points [6]", "1..5"]),
    (None, ["--parallelism.pipeline_parallel_split_points", "3"], 2, ["pipeline_parallel_degree > 1"]),
    # A key whose feature is off is refused, not ignored.
    (None, ["--parallelism.pipeline_parallel_microbatch_size", "4"], 2, ["microbatch_size 4 needs", "degree > 1"]),
    (None, ["--activation_checkpoint.selective_ac_option", "3"], 2, ["selective_ac_option 3 needs", "mode selective"]),
    (None, ["--validation.dataset_path", "/x.jsonl"], 2, ["validation.dataset_path /x.jsonl needs validation.enable"]),
    (None, ["--compile.enable", "--compile.components", ""], 2, ["compile.components is empty", "model and/or loss"]),
    (None, ["--float8.recipe", "rowwise"], 2, ["float8.recipe is set but float8.enable is not"]),
    (None, ["--float8.filter_fqns", "output"], 2, ["float8.filter_fqns is set but float8.enable is not"]),
    (None, [*PP2, "--parallelism.tensor_parallel_degree", "2", "--training.seq_len", "127"], 4, ["seq_len 127", "2"]),
    # Sequence parallelism splits every sequence over tp, pipeline stages or not; the FFN is split over tp.
    (None, ["--parallelism.tensor_parallel_degree", "2", "--training.seq_len", "127"], 2, ["seq_len 127 is not a"]),
    (
        None,
        ["--parallelism.tensor_parallel_degree", "2", "--model.ffn_dim", "767"],
        2,
        ["divide the model's ffn_dim 767"],
    ),
    (
        None,
        [*PP2, "--parallelism.dp_impl", "fsdp2", "--parallelism.gradient_reduction", "per_microbatch"],
        2,
        ["gradient_reduction per_microbatch", "fsdp2", "once per schedule step"],
    ),
    (
        None,
        [
            *PP2,
            "--parallelism.pipeline_parallel_schedule",
            "InterleavedZeroBubble",
            "--parallelism.gradient_reduction",
            "per_step",
        ],
        2,
        ["gradient_reduction per_step", "InterleavedZeroBubble", "use auto or per_microbatch"],
    ),
    (
        None,
        [*PP2, "--parallelism.pipeline_parallel_schedule", "InterleavedZeroBubble", "--compile.enable"],
        2,
        ["InterleavedZeroBubble cannot run compiled blocks", "compile.components = loss"],
    ),
    (None, [*BUCKETED_FSDP2], 2, ["compile.bucketing=transformer_block needs SimpleFSDP"]),
    (
        None,
        ["--compile.enable", "--compile.backend", "eager", "--compile.scope", "model"]
        + ["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "2"],
        2,
        ["compile.scope=model with full activation checkpointing needs SimpleFSDP"],
    ),
    (None, ["--model.attn_mask_type", "document"], 2, ["model.attn_mask_type", "block_causal"]),
    (None, [*PP2, "--model.attn_mask_type", "block_causal"], 2, ["block_causal is not supported with pipeline"]),
    (
        None,
        ["--model.name", "qwen3_moe", "--model.attn_mask_type", "block_causal"],
        2,
        ["model.attn_mask_type block_causal is not supported by model qwen3_moe"],
    ),
    # Float8: what it does not run yet, and a CPU without emulation (this machine has no GPU).
    (None, ["--float8.enable"], 2, ["float8 on a CPU needs float8.emulate"]),
    (None, [*F8, "--float8.recipe", "mxfp8"], 2, ["float8.recipe mxfp8 is not supported yet"]),
    (
        None,
        [*F8, "--float8.recipe", "rowwise", "--float8.all_gather"],
        2,
        ["float8.all_gather needs float8.recipe tensorwise"],
    ),
    (
        None,
        [*F8, "--float8.all_gather", *REPLICATE2],
        2,
        ["float8.all_gather gathers sharded weights", "--no-float8.all_gather"],
    ),
    (
        None,
        [*F8, "--float8.all_gather", "--parallelism.tensor_parallel_degree", "2"],
        2,
        ["float8.all_gather with tensor parallelism", "--no-float8.all_gather"],
    ),
    (None, [*F8, "--float8.all_gather", *PP2], 2, ["float8.all_gather with pipeline parallelism"]),
    (None, [*F8, "--float8.recipe", "blockwise"], 2, ["float8.recipe", "tensorwise"]),
    # A tied output projection in float8 would cast the embedding's weight: it must stay in high precision.
    (
        None,
        ["--model.name", "qwen3", "--model.flavor", "debugmodel_tied", *F8, "--float8.filter_fqns", AUTO],
        2,
        ["float8 with tied embeddings", "'output' shares the embedding's weight", "add output to float8.filter_fqns"],
    ),
    (None, ["--float8.all_gather"], 2, ["float8.all_gather is set but float8.enable is not"]),
    (None, ["--job.dump_folder", "{tmp}/a_file"], 2, ["job.dump_folder", "a_file' is a file, not a folder"]),
    # Replica groups (fault_tolerance): what no group of the job could run.
    (
        None,
        [*FT2, "--fault_tolerance.replica_id", "2"],
        2,
        ["fault_tolerance.replica_id 2 is outside fault_tolerance.group_size 2", "numbered 0 .. 1"],
    ),
    (
        None,
        [*FT2, "--fault_tolerance.min_replica_size", "3"],
        2,
        ["fault_tolerance.min_replica_size 3 is more than fault_tolerance.group_size 2", "no step could ever commit"],
    ),
    (
        None,
        ["--fault_tolerance.group_size", "2"],
        2,
        ["fault_tolerance.group_size is set but fault_tolerance.enable is not"],
    ),
    (
        None,
        ["--fault_tolerance.lighthouse", "http://h:1"],
        2,
        ["fault_tolerance.lighthouse is set but fault_tolerance.enable is not"],
    ),
    (
        None,
        [*FT2, *PP2, "--parallelism.data_parallel_shard_degree", "1"],
        2,
        ["fault_tolerance.enable does not combine with pipeline_parallel_degree > 1"],
    ),
    (
        None,
        [*FT2, "--training.global_batch_size", "48"],
        2,
        ["global_batch_size 48 is not a multiple of local_batch_size 8 x data-parallel degree 2 x replica groups 2"],
    ),
    (
        None,
        ["--checkpoint.initial_load_path", "{tmp}"],
        2,
        ["holds a Hugging Face model (config.json, safetensors)", "set checkpoint.initial_load_in_hf"],
    ),
]

# Files the cases above name as {tmp}/<name>: a BPE file of 300 two-byte tokens and no single bytes, a
# truncated tokenizer.json, a file where a folder is expected, and what makes {tmp} a Hugging Face folder.
FILES = {
    "a_file": "not a folder\n",
    "config.json": "{}\n",
    "model.safetensors": "",
    "no_bytes.tiktoken": "".join(
        f"{base64.b64encode(bytes([i // 256 + 97, i % 256])).decode()} {i}\n" for i in range(300)
    ),
    "broken.json": '{"version": "1.0", "model": ',
}


def case_id(text: str | None, overrides: list[str]) -> str:
    """A readable test id: the overrides (`training.steps=three`), or the first line of a TOML file."""
    if text is not None:
        return "toml:" + text.strip().splitlines()[-1].replace(" ", "")
    parts, i = [], 0
    while i < len(overrides):
        key = overrides[i].removeprefix("--")
        if i + 1 < len(overrides) and not overrides[i + 1].startswith("--"):
            key, i = f"{key}={overrides[i + 1]}", i + 1
        parts.append(key)
        i += 1
    return ",".join(parts)


@pytest.mark.parametrize("text,overrides,world,fragments", CASES, ids=[case_id(c[0], c[1]) for c in CASES])
def test_bad_input_one_line_exit_2(tmp_path, monkeypatch, capsys, text, overrides, world, fragments):
    for name, content in FILES.items():
        (tmp_path / name).write_text(content)
    overrides = [o.replace("{tmp}", str(tmp_path)) for o in overrides]
    config = BASE
    if text is not None:
        config = str(tmp_path / "bad.toml")
        (tmp_path / "bad.toml").write_text(text)
    args = ["--config", config, "--job.dump_folder", str(tmp_path / "dump"), *overrides]
    monkeypatch.setenv("WORLD_SIZE", str(world))
    assert run_cli(preflight.main, args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    for frag in fragments:
        assert frag in err, (frag, err)


def test_table_is_large_enough():
    assert len(CASES) >= 20


@pytest.mark.slow
def test_launcher_reports_bad_input_without_traceback(tmp_path):
    """Through run_train.sh: the preflight stops the launch before the launcher starts any rank."""
    proc = subprocess.run(
        [str(ROOT / "run_train.sh"), "--training.stepz", "3"],
        env=child_env(NGPU="2"),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2
    assert "training.stepz" in proc.stderr and "Traceback" not in proc.stderr
    assert "torch.distributed.run" not in proc.stderr


@pytest.mark.slow
def test_a_bad_combination_stops_before_any_rank(tmp_path):
    """A rule between keys (bucketing needs SimpleFSDP) stops run_train.sh in its preflight: exit 2, one
    line, and no rank ever prints (rank output is prefixed `[rank`)."""
    proc = subprocess.run(
        [str(ROOT / "run_train.sh"), "--job.dump_folder", str(tmp_path / "dump"), *BUCKETED_FSDP2],
        env=child_env(NGPU="2"),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    assert lines == ["titanlite: error: compile.bucketing=transformer_block needs SimpleFSDP data parallelism and "
                     "backend aot_eager or inductor (parallelism.dp_impl is fsdp2); "
                     "set compile.bucketing none"], lines  # fmt: skip


@pytest.fixture
def read_only_checkpoint_folder(tmp_path):
    """A dump folder whose `checkpoint/` is a read-only mount (as root, a folder's mode does not stop writes)."""
    folder = tmp_path / "dump" / "checkpoint"
    folder.mkdir(parents=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro", "tmpfs", str(folder)], capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a read-only tmpfs here: {mounted.stderr.strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", str(folder)], check=True)


@pytest.mark.slow
def test_a_read_only_checkpoint_folder_is_one_line_before_any_rank(tmp_path, read_only_checkpoint_folder):
    proc = subprocess.run(
        [str(ROOT / "run_train.sh"), "--job.dump_folder", str(tmp_path / "dump"), "--checkpoint.enable"],
        env=child_env(NGPU="2"),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert (proc.returncode, proc.stdout, proc.stderr.splitlines()) == (
        2,
        "",
        [f"titanlite: error: checkpoint.folder '{read_only_checkpoint_folder}' is not writable: Read-only file system"],
    ), proc.stderr[-3000:]


@pytest.mark.slow
def test_a_missing_validation_dataset_is_one_line_naming_its_key_before_any_rank(tmp_path):
    proc = subprocess.run(
        [
            str(ROOT / "run_train.sh"),
            "--job.dump_folder",
            str(tmp_path / "dump"),
            "--validation.enable",
            "--validation.dataset_path",
            "/nonexistent/x.jsonl",
        ],
        env=child_env(NGPU="2"),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = proc.stderr.splitlines()
    assert (proc.returncode, proc.stdout, len(lines)) == (2, "", 1), proc.stderr[-3000:]
    assert lines[0].startswith("titanlite: error: validation.dataset_path '/nonexistent/x.jsonl' matches no ")


@pytest.mark.parametrize(
    "version,capability,recipe,emulate,refused",
    [
        ("0.18.1", (9, 0), "tensorwise", False, ""),
        ("0.18.0", (8, 0), "rowwise", False, "float8.recipe rowwise needs a GPU of compute capability 8.9 or newer"),
        ("0.18.0", (8, 0), "rowwise", True, ""),
        (None, (9, 0), "tensorwise", False, "float8.enable needs torchao, the `float8` extra"),
        ("0.17.0", (9, 0), "tensorwise", False, "torchao 0.17.0 with torch"),
    ],
)
def test_float8_needs_a_tested_torchao_and_a_gpu_with_float8(
    monkeypatch, version, capability, recipe, emulate, refused
):
    """The float8 rules a CPU machine cannot meet otherwise, with torchao's version and the GPU's compute
    capability patched: an A100 (8.0) runs float8 only emulated, an H100 (9.0) as it is."""
    monkeypatch.setattr(float8, "torchao_version", lambda: version)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "GPU")
    cfg = config(None, {"float8__enable": True, "float8__recipe": recipe, "float8__emulate": emulate})
    dims = ParallelDims(dp_replicate=1, dp_shard=2, tp=1, world_size=2)
    try:
        float8.rules(cfg, dims)
        float8.check_device(cfg, torch.device("cuda", 0))
    except ConfigError as err:
        assert refused and refused in str(err), err
        assert "\n" not in str(err)
    else:
        assert not refused


@pytest.mark.parametrize(
    "tool,argv,line",
    [
        ("generate", ["--prompt", "a", "--temperature", "nan"], "--temperature 'nan' is not a finite number"),
        ("generate", ["--prompt", "a", "--checkpoint", "x", "--step", "3"], "--checkpoint and --step exclude each"),
        ("generate", ["--prompt", "a", "--top_k", "5", "--seed", "9"], "--top_k and --seed choose how to sample"),
        ("hf", ["export", "--out", "x", "--max-shard-mb", "inf"], "--max-shard-mb 'inf' is not a finite number"),
        ("hf", ["export", "--out", "x", "--max-shard-mb", "0"], "--max-shard-mb 0 must be positive"),
    ],
)
def test_a_tools_bad_option_is_one_line_before_anything_loads(capsys, tool, argv, line):
    """Options a tool would otherwise turn into a traceback (a NaN temperature, an infinite shard size) or
    silently ignore (a step beside an explicit checkpoint) or obey absurdly (one file per tensor): one line,
    exit code 2."""
    import importlib

    main = importlib.import_module(f"titanlite.tools.{tool}").main
    assert run_cli(main, argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("titanlite: error: ") and line in err and err.count("\n") == 1, err
