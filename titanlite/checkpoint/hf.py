"""Hugging Face interop: the Llama model as sharded safetensors in the `transformers` layout, and back.

Names (titanlite -> HF): `tok_embeddings` -> `model.embed_tokens`, `layers.{i}.attention.w{q,k,v,o}` ->
`model.layers.{i}.self_attn.{q,k,v,o}_proj`, `feed_forward.w1/w3/w2` -> `mlp.gate/up/down_proj`,
`attention_norm` -> `input_layernorm`, `ffn_norm` -> `post_attention_layernorm`, `norm` -> `model.norm`,
`output` -> `lm_head` (absent with tied embeddings).

RoPE: titanlite rotates interleaved pairs (x[2i], x[2i+1]) of each head (Meta's convention); HF's
`rotate_half` pairs x[i] with x[i + head_dim/2]. The rows of each head of wq and wk are permuted on
export (and back on import) so that both compute the same attention.

Export streams: parameters are gathered one at a time (`full_tensor()`, a collective on every rank),
rank 0 converts each into its buffer and writes a shard whenever the next tensor would take the buffer
past `max_shard_bytes`; no rank ever holds more than one gathered parameter plus one shard.
Import: each rank reads only the rows and columns of its own block of every parameter (a DTensor
shard under FSDP/TP), with safetensors' lazy slices.

CLI: `python -m titanlite.checkpoint.hf export --config FILE --step N --out DIR [--max-shard-mb M]
[--section.key value ...]`, single process or under torchrun with the training layout.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn
from torch.distributed.tensor import DTensor

from titanlite.errors import CheckpointError
from titanlite.models.init import local_block
from titanlite.models.llama3.model import ModelArgs

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}

_BLOCK = {
    "attention.wq": "self_attn.q_proj", "attention.wk": "self_attn.k_proj", "attention.wv": "self_attn.v_proj",
    "attention.wo": "self_attn.o_proj", "feed_forward.w1": "mlp.gate_proj", "feed_forward.w3": "mlp.up_proj",
    "feed_forward.w2": "mlp.down_proj", "attention_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}


def hf_name(fqn: str, tied: bool = False) -> str:
    """The HF name of titanlite parameter `fqn`."""
    if fqn == "tok_embeddings.weight" or (tied and fqn == "output.weight"):
        return "model.embed_tokens.weight"
    if fqn == "output.weight":
        return "lm_head.weight"
    if fqn == "norm.weight":
        return "model.norm.weight"
    _, layer, rest = fqn.split(".", 2)
    module, _, leaf = rest.rpartition(".")
    return f"model.layers.{layer}.{_BLOCK[module]}.{leaf}"


def _rope_heads(fqn: str, args: ModelArgs) -> int:
    """Number of heads whose rows are RoPE-permuted in parameter `fqn` (0: not permuted)."""
    if fqn.endswith("attention.wq.weight"):
        return args.n_heads
    if fqn.endswith("attention.wk.weight"):
        return args.kv_heads
    return 0


def to_hf_rope(w: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Rows of whole heads, interleaved pairs -> halves (HF's rotate_half layout)."""
    return w.view(-1, head_dim // 2, 2, w.shape[-1]).transpose(1, 2).reshape(w.shape)


def from_hf_rope(w: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Inverse of `to_hf_rope`."""
    return w.view(-1, 2, head_dim // 2, w.shape[-1]).transpose(1, 2).reshape(w.shape)


def hf_config(args: ModelArgs, dtype: torch.dtype, bos_id: int, eos_id: int) -> dict:
    """A `config.json` that `transformers.LlamaForCausalLM` accepts for this model."""
    rope_scaling = None
    if args.use_scaled_rope:  # the constants of titanlite.models.llama3.model._scale_freqs
        rope_scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                        "original_max_position_embeddings": 8192}
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": args.dim, "intermediate_size": args.ffn_hidden_dim, "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads, "num_key_value_heads": args.kv_heads, "head_dim": args.head_dim,
        "hidden_act": "silu", "max_position_embeddings": args.max_seq_len, "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta, "rope_scaling": rope_scaling, "vocab_size": args.vocab_size,
        "tie_word_embeddings": args.tie_embeddings, "bos_token_id": bos_id, "eos_token_id": eos_id,
        "attention_bias": False, "mlp_bias": False, "initializer_range": 0.02, "use_cache": True,
        "torch_dtype": DTYPE_NAMES[dtype],
    }


def _params(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(FQN, parameter as stored: shard or plain), in state-dict order, each tied tensor once."""
    tied = model.args.tie_embeddings
    return [(k, v) for k, v in model.state_dict().items() if not (tied and k == "output.weight")]


def export_hf(model: nn.Module, out: str | Path, *, dtype: torch.dtype = torch.float32, bos_id: int,
              eos_id: int, max_shard_bytes: int = 2 << 30) -> None:
    """Write `model` (any layout) to `out` as HF safetensors shards + index + config; collective.

    The folder is written as `<out>.partial` and renamed when complete; `out` must not exist yet.
    """
    out = Path(out)
    rank = dist.get_rank() if dist.is_initialized() else 0
    tmp = out.with_name(out.name + ".partial")
    error = None
    if rank == 0:
        if out.exists():
            error = f"export folder {out} already exists"
        else:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
    if dist.is_initialized():
        box = [error]
        dist.broadcast_object_list(box, src=0)
        error = box[0]
    if error:
        raise CheckpointError(error)
    args: ModelArgs = model.args
    names_per_shard: list[list[str]] = []
    buffer: dict[str, torch.Tensor] = {}
    size = total = 0

    def flush() -> None:
        nonlocal buffer, size
        if buffer:
            save_file(buffer, str(tmp / f"shard-{len(names_per_shard):05d}.safetensors"), metadata={"format": "pt"})
            names_per_shard.append(list(buffer))
            buffer, size = {}, 0

    for fqn, param in _params(model):
        full = param.full_tensor() if isinstance(param, DTensor) else param
        if rank == 0:
            t = full.detach().to("cpu", dtype)
            if _rope_heads(fqn, args):
                t = to_hf_rope(t, args.head_dim)
            t = t.contiguous()
            if size and size + t.nbytes > max_shard_bytes:
                flush()
            buffer[hf_name(fqn, args.tie_embeddings)] = t
            size += t.nbytes
            total += t.nbytes
        del full
    if rank == 0:
        flush()
        n = len(names_per_shard)
        weight_map = {}
        for i, names in enumerate(names_per_shard):
            name = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.rename(tmp / f"shard-{i:05d}.safetensors", tmp / name)
            weight_map.update({k: name for k in names})
        (tmp / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
        (tmp / "config.json").write_text(json.dumps(hf_config(args, dtype, bos_id, eos_id), indent=2))
        os.rename(tmp, out)
    if dist.is_initialized():
        dist.barrier()


class _HFReader:
    """Lazy access to the tensors of an HF safetensors folder (sharded with an index, or one file)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if (self.path / INDEX).is_file():
            self.weight_map = json.loads((self.path / INDEX).read_text())["weight_map"]
        elif (self.path / SINGLE).is_file():
            with safe_open(str(self.path / SINGLE), framework="pt") as f:
                self.weight_map = {k: SINGLE for k in f.keys()}
        else:
            raise CheckpointError(f"Hugging Face checkpoint {path}: neither {INDEX} nor {SINGLE} found")
        self._files: dict[str, object] = {}

    def slice(self, name: str):
        if name not in self.weight_map:
            raise CheckpointError(f"Hugging Face checkpoint {self.path} has no tensor {name!r}")
        file = self.weight_map[name]
        if file not in self._files:
            try:
                self._files[file] = safe_open(str(self.path / file), framework="pt")
            except Exception as e:  # safetensors raises its own error type for a damaged file
                raise CheckpointError(f"Hugging Face checkpoint {self.path}: cannot open {file} ({e})") from None
        return self._files[file].get_slice(name)


@torch.no_grad()
def import_hf(model: nn.Module, path: str | Path) -> None:
    """Load HF Llama weights into `model` (any layout); each rank reads only its own blocks."""
    args: ModelArgs = model.args
    reader = _HFReader(path)
    for fqn, param in _params(model):
        name = hf_name(fqn, args.tie_embeddings)
        sl = reader.slice(name)
        shape = tuple(sl.get_shape())
        if shape != tuple(param.shape):
            raise CheckpointError(
                f"Hugging Face checkpoint {path}: {name!r} has shape {shape}, this model {tuple(param.shape)} "
                "(another model flavor?)"
            )
        local, offset = local_block(param)
        if local.numel() == 0:
            continue
        rows = slice(offset[0], offset[0] + local.shape[0])
        cols = slice(offset[1], offset[1] + local.shape[1]) if local.dim() == 2 else None
        if _rope_heads(fqn, args):
            # The permutation stays within a head: read the whole heads covering this block's rows.
            hd = args.head_dim
            first, last = rows.start // hd * hd, -(-rows.stop // hd) * hd
            block = from_hf_rope(sl[first:last, cols], hd)[rows.start - first : rows.stop - first]
        else:
            block = sl[rows, cols] if cols is not None else sl[rows]
        local.copy_(block)


def _build_model(cfg, world_size: int):
    """The model of `cfg` on this process's device, parallelized like training would (the CLI's)."""
    from titanlite.models.llama3 import Transformer
    from titanlite.models.llama3.parallelize import parallelize_llama
    from titanlite.train import RunPlan

    plan = RunPlan.build(cfg, world_size)
    device = torch.device("cpu")
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    if world_size > 1:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    with torch.device("meta"):
        model = Transformer(plan.model_args, seq_len=cfg.training.seq_len)
    if world_size > 1:
        plan.dims.build_mesh(device.type)
        model = parallelize_llama(model, plan.dims, cfg)
    model.to_empty(device=device)
    model.init_weights(seed=cfg.training.seed, buffer_device=device)
    return model, plan.tokenizer


def main(argv: list[str] | None = None) -> int:
    """`export --config FILE [--step N] --out DIR [--max-shard-mb M] [overrides]`: a DCP step -> HF folder."""
    from titanlite.checkpoint import folders
    from titanlite.checkpoint.manager import DTYPES, load_model_weights
    from titanlite.config import load_config
    from titanlite.errors import UserError
    from titanlite.train import DEFAULT_CONFIG

    argv = list(sys.argv[1:] if argv is None else argv)
    usage = "usage: python -m titanlite.checkpoint.hf export --config FILE [--step N] --out DIR [--max-shard-mb M]"
    if not argv or argv[0] != "export":
        print(usage, file=sys.stderr)
        return 2
    opts = {"--step": "-1", "--out": "", "--max-shard-mb": "2048"}
    rest, i = [], 1
    while i < len(argv):
        if argv[i] in opts and i + 1 < len(argv):
            opts[argv[i]] = argv[i + 1]
            i += 2
        else:
            rest.append(argv[i])
            i += 1
    try:
        if not opts["--out"]:
            raise CheckpointError(f"--out is required ({usage})")
        cfg = load_config(rest, default_config=DEFAULT_CONFIG)
        model, tokenizer = _build_model(cfg, int(os.environ.get("WORLD_SIZE", "1")))
        root = Path(cfg.job.dump_folder) / cfg.checkpoint.folder
        step = int(opts["--step"])
        path = folders.newest_intact(root) if step < 0 else folders.step_dir(root, step)
        if path is None or not path.is_dir():
            raise CheckpointError(f"no complete checkpoint in {root}" if path is None else f"checkpoint {path} does not exist")
        if why := folders.problem(path):
            raise CheckpointError(f"checkpoint {path} is unusable: {why}")
        load_model_weights(model, str(path))
        export_hf(model, opts["--out"], dtype=DTYPES[cfg.checkpoint.export_dtype], bos_id=tokenizer.bos_id,
                  eos_id=tokenizer.eos_id, max_shard_bytes=int(float(opts["--max-shard-mb"]) * 2**20))
        if not dist.is_initialized() or dist.get_rank() == 0:
            print(f"exported {path} to {opts['--out']}", flush=True)
    except UserError as e:
        print(f"titanlite: error: {e}", file=sys.stderr, flush=True)
        return 2
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
