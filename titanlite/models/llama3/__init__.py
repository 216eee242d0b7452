"""Llama 3: the model, its flavors, its parallelize plan, its Hugging Face adapter and its memory model."""

from titanlite.models.llama3.flavors import llama3_configs
from titanlite.models.llama3.hf_adapter import LlamaHFAdapter
from titanlite.models.llama3.memory import activation_bytes
from titanlite.models.llama3.model import ModelArgs, Transformer
from titanlite.models.llama3.parallelize import llama_units, parallelize_llama
from titanlite.models.registry import ModelSpec

SPEC = ModelSpec(
    name="llama3",
    model_cls=Transformer,
    flavors=llama3_configs,
    parallelize=parallelize_llama,
    units=llama_units,
    tp_divisible=lambda args: {"n_heads": args.n_heads, "n_kv_heads": args.kv_heads},
    hf_adapter=LlamaHFAdapter(),
    activation_bytes=activation_bytes,
)

__all__ = ["SPEC", "ModelArgs", "Transformer", "llama3_configs"]
