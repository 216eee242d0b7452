"""The decoder of the mixture-of-experts families (Qwen3-MoE, DeepSeek-V3): the shared decoder
(`decoder.py`) whose blocks may hold MoE layers (`moe.py`), handing a pipeline's routing sums on from stage to
stage for the load-balancing loss, and the `model.*` keys every MoE family takes."""

from __future__ import annotations

import torch

from titanlite.models.common.attention import Mask
from titanlite.models.common.decoder import Decoder
from titanlite.models.common.kv_cache import KVCache
from titanlite.models.common.moe import layer_stats, moe_layers, routing_sums

MOE_SHAPE_KEYS = (
    "n_layers",
    "dim",
    "n_heads",
    "ffn_dim",
    "rope_theta",
    "max_seq_len",
    "num_experts",
    "top_k",
    "moe_ffn_dim",
    "router_aux_loss_coef",
    "router_bias_update_rate",
)
"""The fields the `model.*` config keys override in every MoE family (`ModelSpec.shape.keys`)."""


class MoEDecoder(Decoder):
    """A decoder whose blocks may hold MoE layers (`moe.MoE` and its subclasses): the forward that hands a
    pipeline's routing sums on, and the routing counters zeroed at initialisation. Qwen3-MoE and
    DeepSeek-V3 build on it."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.routing_in: torch.Tensor | None = None
        """The routing sums the earlier pipeline stages handed this (last) stage in its last forward."""

    def forward(  # type: ignore[override]
        self,
        tokens: torch.Tensor,
        routing: torch.Tensor | None = None,
        cache: KVCache | None = None,
        positions: torch.Tensor | None = None,
        mask: Mask = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """tokens [b, s] -> logits [b, s, vocab].

        As a pipeline stage (`parallelisms/pipeline.keep_stage`) the load-balancing loss, which pools every
        MoE layer's routing, travels with the hidden states: a stage before the last returns (hidden
        states, the `moe.routing_sums` of its layers and of the `routing` it was handed), and the last
        stage keeps the `routing` it was handed for the loss (`moe_balance.aux_loss_term`). The gradient of
        the loss reaches each stage's routers back along the same way.

        With a KV `cache` (generation, the whole model) the tokens continue the cached positions: a prompt
        from position 0, then one token at a time (`models/common/kv_cache.py`). `positions` and `mask`
        are the batch's documents where the family takes `block_causal` (`Decoder.hidden_states`)."""
        h = self.hidden_states(tokens, cache, positions, mask)
        if self.output is None:
            if routing is None:  # the first stage
                routing = torch.zeros(3, self.args.num_experts, device=h.device)
            return h, routing_sums(layer_stats(self), routing)
        self.routing_in = routing
        return self.output(self.norm(h))

    @torch.no_grad()
    def init_weights(self, seed: int, buffer_device: torch.device | None = None) -> None:
        """The decoder's parameters and RoPE tables (`Decoder.init_weights`), and the routing counters zeroed."""
        super().init_weights(seed, buffer_device)
        device = self.rope_cos.device
        for moe in moe_layers(self):
            moe.tokens_per_expert = torch.zeros(moe.num_experts, device=device)
            if moe.expert_bias is not None:
                moe.expert_bias = torch.zeros(moe.num_experts, device=device)
            if moe.step_tokens is not None:
                moe.step_tokens = torch.zeros(moe.num_experts, device=device)
