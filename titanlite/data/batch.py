"""The batch the loader yields and the step consumes: token ids, their labels and their positions.

    Batch(inputs, labels, positions)    LongTensors [local_batch_size, seq_len] (one sample: [seq_len])

`labels` are `inputs` shifted by one token (the next token of the packed stream). `positions` hold each
input token's position in its own document: 0 at its BOS, counting up to its EOS, then 0 again where the
next document begins. A sample that starts inside a long document continues that document's count (the
value a stream produces does not depend on where windows, batches or resumes cut it: it is the token's
offset in its tokenized document, which the loader's state records). The model reads positions only
under `model.attn_mask_type = "block_causal"` (RoPE angles, and the document mask derived from them in
`titanlite/models/common/attention.py`); otherwise they cost one more [b, s] int64 per microbatch on the host
(and in the broadcast of a replica's batch, `run/replica_batches.py`), never a device copy.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class Batch(NamedTuple):
    """One microbatch (or one sample) of token ids (module docstring)."""

    inputs: torch.Tensor
    labels: torch.Tensor
    positions: torch.Tensor

    @classmethod
    def of_windows(cls, windows: torch.Tensor) -> Batch:
        """The batch of token windows [b, s + 1], each row one document from its first token."""
        inputs = windows[:, :-1]
        positions = torch.arange(inputs.shape[1], device=windows.device).expand_as(inputs)
        return cls(inputs, windows[:, 1:], positions)

    def to(self, device: torch.device, positions: bool = True) -> Batch:
        """On `device` (the positions too only when `positions`: a causal step leaves them on the host);
        pinned host tensors (the loader pins them on CUDA) copy without blocking the host."""
        inputs, labels = (t.to(device, non_blocking=True) for t in self[:2])
        return Batch(inputs, labels, self.positions.to(device, non_blocking=True) if positions else self.positions)


def collate(samples: list[Batch]) -> Batch:
    """Samples stacked into a batch, field by field."""
    return Batch(*(torch.stack(field) for field in zip(*samples)))
