"""Counting host syncs on CPU: what would make the host wait for the GPU on CUDA.

Three kinds are counted, each where it is made:
* host reads of tensors (`SYNC_METHODS`: item, tolist, bool/float/int, numpy, cpu) and explicit
  `torch.cuda.synchronize` calls, by patching them;
* blocking copies to a device: a `Tensor.to` that names a device without `non_blocking=True`, made by
  titanlite's own code (on CUDA a batch's host-to-device copy then waits for the GPU's queued work; on
  the CPU every device is the host, so naming one is what marks a copy);
* operations whose output size is read from the device on CUDA (`DATA_DEPENDENT`, e.g. `nonzero`, or
  `repeat_interleave` without `output_size`), by a dispatch mode while the counter is entered.
"""

from __future__ import annotations

import traceback
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import titanlite

SYNC_METHODS = ("item", "tolist", "__bool__", "__float__", "__int__", "numpy", "cpu")
DATA_LOADER_FILES = ("torchdata/", "torch/utils/data/")
TITANLITE = str(Path(titanlite.__file__).parent)
_ATEN = torch.ops.aten
DATA_DEPENDENT = {
    _ATEN.nonzero.default,
    _ATEN.masked_select.default,
    _ATEN.bincount.default,
    _ATEN._unique2.default,
    _ATEN.unique_consecutive.default,
    _ATEN.unique_dim.default,
}
"""Operations whose output size CUDA reads on the host (besides `repeat_interleave` without `output_size`)."""


class SyncCounter(TorchDispatchMode):
    """Counts host syncs (module docstring), with where they came from, in `calls`.

    Left out, since they are host tensors on CUDA too and reading them does not wait for the GPU: the
    optimizer's step counters (foreach AdamW keeps them on the host) and the data loader's own tensors
    (it draws its sampler seed when an iterator starts). The patched reads and copies are counted from
    construction until `monkeypatch` is undone; the data-dependent operations while the counter is entered
    (`with`). `copies` counts titanlite's non-blocking copies to a device, so that a test sees the copies
    it expects were made, not left out."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, optimizer: torch.optim.Optimizer | None = None):
        super().__init__()
        self.calls: list[str] = []
        self.copies = 0
        self.optimizer = optimizer
        for name in SYNC_METHODS:
            monkeypatch.setattr(torch.Tensor, name, self._wrap(name, getattr(torch.Tensor, name)))
        monkeypatch.setattr(torch.Tensor, "to", self._wrap_to(torch.Tensor.to))
        monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: self._record("cuda.synchronize"))

    def _record(self, what: str) -> None:
        frame = traceback.extract_stack(limit=3)[0]
        if not any(part in frame.filename for part in DATA_LOADER_FILES):
            self.calls.append(f"{what} at {frame.filename}:{frame.lineno}")

    def _wrap(self, name, method):
        def counted(tensor, *args, **kwargs):
            steps = self.optimizer.state.values() if self.optimizer is not None else ()
            if not any(tensor is s.get("step") for s in steps):
                self._record(f"Tensor.{name}")
            return method(tensor, *args, **kwargs)

        return counted

    def _wrap_to(self, method):
        def to(tensor, *args, **kwargs):
            caller = traceback.extract_stack(limit=2)[0]
            moves = "device" in kwargs or any(isinstance(a, (torch.device, str, torch.Tensor)) for a in args)
            if moves and caller.filename.startswith(TITANLITE):  # not a dtype cast, not torch's own
                if kwargs.get("non_blocking") or any(a is True for a in args):
                    self.copies += 1
                else:
                    self.calls.append(f"blocking Tensor.to at {caller.filename}:{caller.lineno}")
            return method(tensor, *args, **kwargs)

        return to

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        unsized = func is _ATEN.repeat_interleave.Tensor and kwargs.get("output_size") is None
        if func in DATA_DEPENDENT or unsized:
            # The Python frame that called the operation (the dispatch mode's own frames above it).
            frame = next(
                f for f in reversed(traceback.extract_stack()[:-1]) if "torch/" not in f.filename.replace("\\", "/")
            )
            self.calls.append(f"{func} at {frame.filename}:{frame.lineno}")
        return func(*args, **kwargs)
