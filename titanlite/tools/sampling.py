"""Choosing the next token from a model's logits: greedy, or sampling with temperature and top-k.

Greedy is `argmax` (the first of equal maxima, as `transformers` picks), so greedy generation gives the
same tokens as `generate(do_sample=False)` on the exported model. Sampling draws from the given
generator only, so a seed fixes the text.
"""

from __future__ import annotations

import torch


def next_token(logits: torch.Tensor, temperature: float, top_k: int, generator: torch.Generator | None) -> int:
    """The next token id from the last position's `logits` [vocab]: argmax at `temperature` 0, else a draw
    from softmax(logits / temperature) restricted to the `top_k` largest (0 = all)."""
    if temperature <= 0:
        return int(torch.argmax(logits))
    scaled = logits.float() / temperature
    if 0 < top_k < scaled.numel():
        kth = torch.topk(scaled, top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))
